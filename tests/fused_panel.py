"""The fused kernels' panel (issue 37) as data: each add + norm kernel of tests/plugins/fused_kernels.py
at each dtype and width, each norm + int8 quantize kernel of tests/plugins/quant_kernels.py at each
dtype and scale, and the codes it must get (empty: correct, never flagged). Read by
tests/test_fused.py and benchmarks/fused_matrix.py (DIAGNOSIS.md's table)."""

import importlib.util
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent / "plugins"
DTYPES = ("float32", "bfloat16", "float16")
WIDTHS = (64, 2048)
SCALES = ("static", "dynamic")


def expected(kernel: str, dtype: str) -> set:
    return {
        "returns_pair": set(), "in_place": set(),
        # a bfloat16 sum is invisible at bfloat16 (the stored residual is rounded there anyway)
        "bf16_sum": set() if dtype == "bfloat16" else {"sum_in_low_precision"},
        "stale_residual": {"residual_stale"},
        "aliased": {"aliasing"},
        # the sum at the input dtype overflows only in float16's range
        "half_sum": {"sum_overflow"} if dtype == "float16" else set(),
        "eps_1e6": {"eps_mismatch"},
    }[kernel]


def quant_expected(kernel: str, scale: str) -> set:
    return {
        "correct": set(),
        "truncates": {"quant_rounding_truncates"},
        # a per-token scale never puts a value past 127: there is nothing to wrap
        "wraps": {"quant_wraps"} if scale == "static" else set(),
        "scale_before_gain": {"quant_scale_before_gain"},
    }[kernel]


# (form, kernel, dtype, width or scale, the codes it must get)
PANEL = [("add", k, d, w, expected(k, d))
         for k in ("returns_pair", "in_place", "bf16_sum", "stale_residual", "aliased", "half_sum", "eps_1e6")
         for d in DTYPES for w in WIDTHS]
PANEL += [("quant", k, d, s, quant_expected(k, s)) for k in ("correct", "truncates", "wraps", "scale_before_gain")
          for d in DTYPES for s in SCALES]
FILES = {"add": "fused_kernels.py", "quant": "quant_kernels.py"}


def kernels(form: str):
    spec = importlib.util.spec_from_file_location(f"{form}_kernels", PLUGINS / FILES[form])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(case, modules=None) -> set:
    """The codes a case gets (empty where it passes)."""
    from parity_cli.testing import check_norm

    form, kernel, dtype, size, _ = case
    fn = getattr((modules or {}).get(form) or kernels(form), kernel)
    shape = {"hidden_size": size} if form == "add" else {"hidden_size": 256, "scale": size}
    result = check_norm(fn, family="llama", eps=1e-5 if form == "add" else 1e-6, dtype=dtype, weight="random",
                        fused=form, **shape)
    return {d["code"] for d in result.diagnoses} if not result else set()
