"""parity_cli.testing: stratified norm parity inside a kernel library's own pytest suite.

    from parity_cli.testing import assert_norm_parity

    def test_fused_rms_norm():
        assert_norm_parity(fused_rms_norm, family="llama", hidden_size=4096, eps=1e-6, dtype=torch.bfloat16)

The float64 oracle of the family's norm and the candidate see the same stratified probes (zero,
tiny with q/eps from 0.01 to 100, normal, constant, mixed, large, outlier); a failure raises
AssertionError with the CLI's finding: the failing strata, their q/eps, the worst element and the
diagnosis (eps_mismatch with the eps the candidate behaves as, eps_outside_sqrt, a missing 1 + w, a
missing upcast, ...). `check_norm` returns the result instead. The pytest plugin (entry point
`parity`, module parity_cli.testing.plugin) adds the `norm_parity` fixture, the `norm_parity`
marker and the --parity-strata / --parity-dtypes options; `norm_cases()` parametrises a test over
families x dtypes x sizes. Importing this package does not import torch."""

from typing import TYPE_CHECKING

__all__ = ["DEFAULT_DTYPES", "DEFAULT_FAMILIES", "PER_HEAD_FAMILIES", "NormCase", "NormParityResult",
           "assert_norm_parity", "check_norm", "norm_cases"]

if TYPE_CHECKING:  # pragma: no cover
    from parity_cli.testing.api import (
        DEFAULT_DTYPES,
        DEFAULT_FAMILIES,
        PER_HEAD_FAMILIES,
        NormCase,
        NormParityResult,
        assert_norm_parity,
        check_norm,
        norm_cases,
    )


def __getattr__(name: str):
    """The names load with parity_cli.testing.api on first use: pytest imports this package for its plugin in
    every session of a project that has parity-cli installed, and such a session should not pay for it."""
    if name in __all__:
        from parity_cli.testing import api

        return getattr(api, name)
    raise AttributeError(f"module 'parity_cli.testing' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
