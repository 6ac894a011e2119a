"""The wheel must carry configs/, the demo checkpoint and the schema (non-editable installs)."""

import fnmatch
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_package_data_globs_cover_every_shipped_file():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = cfg["package-data"]
    assert cfg["package-dir"]["parity_cli.configs"] == "configs"
    roots = {"parity_cli": ROOT / "parity_cli", "parity_cli.configs": ROOT / "configs"}
    wanted = {
        "parity_cli.configs": [p for p in (ROOT / "configs").rglob("*.toml")],
        "parity_cli": [*(ROOT / "parity_cli" / "demo").iterdir(), ROOT / "parity_cli" / "schema" / "report.schema.json"],
    }
    for package, files in wanted.items():
        assert files
        for f in files:
            rel = f.relative_to(roots[package]).as_posix()
            assert any(fnmatch.fnmatch(rel, g) for g in data[package]), rel


def test_demo_checkpoint_is_what_the_generator_writes(tmp_path):
    from safetensors.torch import load_file

    from parity_cli.resources import demo_checkpoint
    from parity_cli.sources.synthetic import write_demo

    fresh = write_demo(tmp_path / "demo")
    assert (fresh / "config.json").read_text() == (demo_checkpoint() / "config.json").read_text()
    a, b = load_file(str(fresh / "model.safetensors")), load_file(str(demo_checkpoint() / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
