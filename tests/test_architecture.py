"""The code's one direction (issue 24): stages import downwards only, no module circles, the
wheel carries every stage, and ruff finds no dead code. Each contract is also shown to fail on a
planted violation, so that a contract that checks nothing cannot pass here."""

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

    def parity(*args):
        return subprocess.run([sys.executable, "-m", "parity_cli", *map(str, args)], capture_output=True, text=True,
                              env=env, cwd=tmp_path)

    listed = parity("implementations")
    assert listed.returncode == 0 and "torch's rms_norm, as a runtime file" in listed.stdout, listed.stderr
    llama = ckpt("llama", layers=1, eps=1e-6, dtype="float32")
    r = parity("check", llama, "--candidate", "toy", "-q")
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr
    table = parity("runtimes", ckpt("bert", layers=1, eps=1e-12, dtype="float32"), "--runtimes", "torch,toy",
                   "--dtypes", "float32")
    assert table.returncode == 0, table.stdout + table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith("toy ")]
    assert len(rows) == 1 and " refused [1]" in rows[0], table.stdout
    assert "[1] toy: builds RMSNorm only; bert.embeddings.LayerNorm is a layer_norm" in table.stdout
