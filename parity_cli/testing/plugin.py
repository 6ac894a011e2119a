"""pytest plugin of parity_cli.testing, registered through the `pytest11` entry point `parity`.

Opt-in: nothing happens in a session whose tests use neither the `norm_parity` fixture nor the
`norm_parity` marker, and this module imports neither torch nor the check (a project that merely has
parity-cli installed pays nothing at start-up; `-p no:parity` leaves it out altogether).

- fixture `norm_parity`: ``norm_parity(candidate, **overrides)`` is assert_norm_parity with the test's
  own parameters filled in: a NormCase parameter (norm_cases()), parameters named like its keywords
  (family, hidden_size, eps, dtype, device, heads, weight, ...), then the marker's keywords, then
  --parity-strata. ``norm_parity.check(candidate, ...)`` returns the result without raising.
- marker ``@pytest.mark.norm_parity(family="gemma", eps=1e-6, ...)``: defaults for the fixture, on
  a test, a class or a module.
- ``--parity-strata=zero,tiny,...``: the strata every fixture call probes (default: the default set).
- ``--parity-dtypes=bfloat16,float16``: the norm_cases() parameters at other dtypes are deselected.
"""

from __future__ import annotations

import pytest

DTYPES = pytest.StashKey[set]()  # --parity-dtypes, as dtype names
KEYWORDS = ("family", "hidden_size", "eps", "dtype", "device", "weight", "bias", "heads", "strata", "atol", "rtol",
            "grad", "seed", "checkpoint", "layer", "fused", "scale")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("parity", "norm parity (parity_cli.testing)")
    group.addoption("--parity-strata", default=None, metavar="NAMES",
                    help="comma-separated probe strata for the norm_parity fixture (default: zero, tiny, normal, "
                         "constant, mixed, large, outlier; 'extreme' is opt-in)")
    group.addoption("--parity-dtypes", default=None, metavar="DTYPES",
                    help="keep only the norm_cases() parameters at these dtypes (comma-separated: bfloat16, "
                         "float16, float32, float64); the others are deselected")


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "norm_parity(**kwargs): keyword arguments of "
                            "parity_cli.testing.assert_norm_parity that the norm_parity fixture uses by default")
    strata, dtypes = _names(config.getoption("parity_strata")), _names(config.getoption("parity_dtypes"))
    if strata is not None:  # a wrong name is a usage error at once, not one failure per test
        from parity_cli.errors import InputError
        from parity_cli.probes.strata import select_strata

        try:
            select_strata(strata or None)
        except InputError as exc:
            raise pytest.UsageError(str(exc).replace("--strata", "--parity-strata")) from None
    if dtypes is not None:
        from parity_cli.testing.api import _dtype_name

        try:
            config.stash[DTYPES] = {_dtype_name(d) for d in dtypes}
        except ValueError as exc:
            raise pytest.UsageError(str(exc).replace("dtype:", "--parity-dtypes:", 1)) from None


def pytest_report_header(config) -> list[str] | None:
    given = [f"--{name}={config.getoption(attr)}" for name, attr in (("parity-strata", "parity_strata"),
                                                                       ("parity-dtypes", "parity_dtypes"))
             if config.getoption(attr) is not None]
    return [f"parity: {' '.join(given)}"] if given else None


def _case(item):
    from parity_cli.testing.api import NormCase

    params = getattr(getattr(item, "callspec", None), "params", {})
    return next((v for v in params.values() if isinstance(v, NormCase)), None)


def pytest_collection_modifyitems(config, items) -> None:
    wanted = config.stash.get(DTYPES, None)
    if wanted is None:
        return
    keep, drop = [], []
    for item in items:
        case = _case(item)
        (drop if case is not None and case.dtype not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class NormParity:
    """The `norm_parity` fixture's value: assert_norm_parity bound to the test's parameters."""

    def __init__(self, defaults: dict):
        self.defaults = dict(defaults)

    @property
    def kwargs(self) -> dict:
        return dict(self.defaults)

    def __call__(self, candidate, **overrides):
        __tracebackhide__ = True
        from parity_cli.testing.api import assert_norm_parity

        return assert_norm_parity(candidate, **{**self.defaults, **overrides})

    def check(self, candidate, **overrides):
        __tracebackhide__ = True
        from parity_cli.testing.api import check_norm

        return check_norm(candidate, **{**self.defaults, **overrides})

    def __repr__(self) -> str:
        return f"norm_parity({', '.join(f'{k}={v!r}' for k, v in self.defaults.items())})"


def bound_kwargs(item, config) -> dict:
    """The fixture's defaults for a test: --parity-strata, then the markers (the closest wins), then
    a NormCase parameter, then the parameters named like assert_norm_parity's keywords."""
    kwargs: dict = {}
    strata = _names(config.getoption("parity_strata"))
    if strata:
        kwargs["strata"] = strata
    for mark in reversed(list(item.iter_markers("norm_parity"))):  # module, class, then the test's own
        unknown = sorted(set(mark.kwargs) - set(KEYWORDS))
        if unknown or mark.args:
            raise TypeError(f"@pytest.mark.norm_parity takes keyword arguments of assert_norm_parity "
                            f"({', '.join(KEYWORDS)}); got {', '.join(unknown) or 'positional arguments'}")
        kwargs.update(mark.kwargs)
    case = _case(item)
    if case is not None:
        kwargs.update(case.kwargs())
    params = getattr(getattr(item, "callspec", None), "params", {})
    kwargs.update({k: v for k, v in params.items() if k in KEYWORDS})
    return kwargs


@pytest.fixture
def norm_parity(request) -> NormParity:
    """assert_norm_parity bound to this test's parameters: ``norm_parity(my_kernel)``."""
    return NormParity(bound_kwargs(request.node, request.config))
