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
