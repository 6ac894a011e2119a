"""The library API: one function per command, called by the CLI and directly by tests, and the
option types and helpers a caller needs to build them. A facade: nothing inside parity_cli
imports it (the layers contract in pyproject.toml says so), so it can stay stable while the
stages under it move."""

from __future__ import annotations

from pathlib import Path

from parity_cli.model.load import load
from parity_cli.options import (
    DTYPES,
    FAST_FLOAT64,
    ONE_PERCENT_Q_OVER_EPS,
    CheckOptions,
    check_device,
    dtype_name,
    is_oracle,
    reference_device,
    reference_dtype_for,
)
from parity_cli.pipeline import check, inspect

__all__ = ["DTYPES", "FAST_FLOAT64", "ONE_PERCENT_Q_OVER_EPS", "CheckOptions", "check", "check_device", "dtype_name",
           "explain", "inspect", "is_oracle", "load", "reference_device",
           "reference_dtype_for"]


def explain(path: str | Path, options: CheckOptions | None = None, layer_names: list[str] | None = None,
            **kwargs) -> dict:
    """The one-factor-at-a-time ladder for the failing (or named) layers; see parity_cli.explain."""
    from parity_cli.explain import explain as ladder

    return ladder(path, options or CheckOptions(**kwargs), layer_names)
