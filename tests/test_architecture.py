"""The code's one direction (issue 24): stages import downwards only, no module circles, the
wheel carries every stage, and ruff finds no dead code. Each contract is also shown to fail on a
planted violation, so that a contract that checks nothing cannot pass here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "pyproject.toml")

importlinter = pytest.importorskip("importlinter", reason="the test extra brings import-linter")


def lint(monkeypatch, *planted, contract=None) -> int:
    """lint-imports on this package, with `planted` (importer, imported) edges added to its graph."""
    from importlinter.cli import lint_imports
    from importlinter.configuration import settings

    real = settings.GRAPH_BUILDER

    class Planting:
        def build(self, *args, **kwargs):
            graph = real.build(*args, **kwargs)
            for importer, imported in planted:
                graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="planted")
            return graph

    monkeypatch.setattr(settings, "GRAPH_BUILDER", Planting())
    monkeypatch.chdir(ROOT)
    return lint_imports(config_filename=CONFIG, no_cache=True, no_logo=True,
                        limit_to_contracts=(contract,) if contract else ())


def test_the_stages_import_one_way(monkeypatch):
    assert lint(monkeypatch) == 0


@pytest.mark.parametrize("importer, imported", [
    ("parity_cli.sources.jsonfile", "parity_cli.api"),  # the facade is imported by nothing below it
    ("parity_cli.model.layers", "parity_cli.check.layer"),  # a stage reaching up the data flow
    ("parity_cli.errors", "parity_cli.text"),
])
def test_an_upward_import_breaks_the_layers(monkeypatch, importer, imported):
    assert lint(monkeypatch, (importer, imported), contract="layers") == 1


def test_a_circle_inside_a_stage_breaks_the_no_circles_contract(monkeypatch):
    """diagnose.causes imports diagnose.fit: fit importing causes back is the circle issue 24 removed
    (the layers contract cannot see it: both modules are one stage)."""
    assert lint(monkeypatch, ("parity_cli.diagnose.fit", "parity_cli.diagnose.causes"), contract="layers") == 0
    assert lint(monkeypatch, ("parity_cli.diagnose.fit", "parity_cli.diagnose.causes"), contract="no-circles") == 1


def test_ruff_is_clean():
    ruff = pytest.importorskip("ruff", reason="the test extra brings ruff")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1000:]
    assert ruff


def test_every_stage_package_ships_in_the_wheel():
    """A subpackage missing from [tool.setuptools] packages is absent from a non-editable install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "parity_cli").rglob("__init__.py")}
    assert listed == present | {"parity_cli.configs"}


def test_every_stage_has_one_folder():
    """Each stage of the data flow is a folder that says what it is (its __init__ docstring)."""
    import importlib

    for stage in ("sources", "model", "probes", "backends", "isolation", "check", "diagnose", "report"):
        module = importlib.import_module(f"parity_cli.{stage}")
        assert (module.__doc__ or "").strip(), stage


TOY_RUNTIME = '''
"""A runtime written as one file, to show that adding one touches no other file."""

from parity_cli.backends import Runtime

RUNTIME = Runtime("toy", "torch's rms_norm, as a runtime file", package="torch", install="pip install torch",
                  distributions=("torch",), order=99)


def check_layer(layer, dtype=None):
    from parity_cli.errors import InputError

    if layer.kind != "rms_norm":
        raise InputError(f"toy: builds RMSNorm only; {layer.name} is a {layer.kind}")


def computes_in(dtype, described):
    return "toy-" + dtype


def prepare(layer, weight, bias, eps):
    import torch.nn.functional as F

    return lambda x: F.rms_norm(x, (layer.dim,), weight, eps)
'''


def test_a_runtime_is_one_file_found_by_the_registry(tmp_path, ckpt):
    """Issue 46: a copy of the package with one more file under backends/ has one more runtime in
    --candidate, `parity implementations` and `parity runtimes`, and its refusals are cells."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(ROOT / "parity_cli", copy / "parity_cli", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", copy / "configs")
    (copy / "parity_cli" / "backends" / "toy_runtime.py").write_text(TOY_RUNTIME)
    env = {**__import__("os").environ, "PYTHONPATH": str(copy), "COLUMNS": "200"}
    commands = [["implementations"], ["check", ckpt("llama", layers=1, eps=1e-6, dtype="float32"), "--candidate", "toy",
                                      "-q"],
                ["runtimes", ckpt("bert", layers=1, eps=1e-12, dtype="float32"), "--runtimes", "torch,toy",
                 "--dtypes", "float32"]]
    # the three commands in one interpreter (one torch import, not three), each through main() as
    # `python -m parity_cli` calls it
    driver = """
import json, sys
from click.testing import CliRunner
import parity_cli.cli
assert parity_cli.cli.__file__.startswith(sys.argv[2]), parity_cli.cli.__file__
results = []
for argv in json.loads(sys.argv[1]):
    with CliRunner().isolation() as (out, err, _):
        try:
            parity_cli.cli.main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code
        results.append((code, out.getvalue().decode(), err.getvalue().decode()))
print(json.dumps(results))
"""
    ran = subprocess.run([sys.executable, "-c", driver, json.dumps([[str(w) for w in c] for c in commands]), str(copy)],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    listed, r, table = (subprocess.CompletedProcess(c, *result) for c, result in zip(commands, json.loads(ran.stdout)))
    assert listed.returncode == 0 and "torch's rms_norm, as a runtime file" in listed.stdout, listed.stderr
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr
    assert table.returncode == 0, table.stdout + table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("toy ")]
    assert len(rows) == 1 and " refused [1]" in rows[0], table.stdout
    assert "[1] toy: builds RMSNorm only; bert.embeddings.LayerNorm is a layer_norm" in table.stdout


def _weak_asserts():
    import importlib.util

    spec = importlib.util.spec_from_file_location("weak_asserts", ROOT / "tools" / "weak_asserts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_test_cannot_fail():
    """Issue 49: no test asserts nothing, accepts a pass or a fail alike, or asserts only inside a loop
    that may not run (tools/weak_asserts.py; .ci/run runs it too)."""
    found = _weak_asserts().scan(sorted((ROOT / "tests").rglob("*.py")))
    assert found == [], "\n".join(f"{p}:{line}: {kind}: {name}" for p, line, kind, name in found)


def test_the_scan_finds_each_kind_of_test_that_cannot_fail(tmp_path):
    source = tmp_path / "test_planted.py"
    source.write_text(
        "def _check(r):\n    assert r\n\n"
        "def test_nothing(x):\n    x.run()\n\n"
        "def test_helper(x):\n    _check(x)\n\n"
        "def test_either(r):\n    assert r.status in ('pass', 'fail')\n\n"
        "def test_either_exit(r):\n    assert r.returncode in (0, 1)\n\n"
        "def test_loop(report):\n    for layer in report.layers:\n        assert layer.ok\n\n"
        "def test_loop_over_literal():\n    for k in (1, 2):\n        assert k\n\n"
        "def test_loop_said_to_run(report):\n    assert report.layers\n    for layer in report.layers:\n"
        "        assert layer.ok\n\n"
        "def test_excused(x):\n    # weak-ok: its contract is to raise nothing\n    x.run()\n")
    found = {(kind, name or line) for _, line, kind, name in _weak_asserts().scan([source])}
    assert found == {("no-assert", "test_nothing"), ("pass-or-fail", 11), ("pass-or-fail", 14),
                     ("loop-only", "test_loop")}
