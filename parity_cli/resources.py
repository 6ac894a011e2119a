"""Finds the data the tool ships with (configs/, the demo checkpoint, the report schema),
both in a source checkout and in an installed wheel."""

from __future__ import annotations

import sys
from functools import cache
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from parity_cli.errors import InputError

_PACKAGE_DIR = Path(__file__).resolve().parent


@cache
def configs_dir() -> Path:
    """The wheel carries configs/ as parity_cli.configs; a source tree has it beside the package."""
    try:
        path = Path(str(resources.files("parity_cli.configs")))
        if (path / "probes.toml").is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    path = _PACKAGE_DIR.parent / "configs"
    if (path / "probes.toml").is_file():
        return path
    raise InputError("cannot find the configs/ data directory of parity-cli (broken install?)")


def demo_checkpoint() -> Path:
    return _PACKAGE_DIR / "demo"


def schema_path() -> Path:
    return _PACKAGE_DIR / "schema" / "report.schema.json"


def load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: invalid TOML: {exc}") from None
