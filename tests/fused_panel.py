"""The fused add + norm panel (issue 37) as data: each kernel of tests/plugins/fused_kernels.py at
each dtype and width, and the codes it must get (empty: correct, never flagged). Read by
tests/test_fused.py and benchmarks/fused_matrix.py (DIAGNOSIS.md's table)."""

import importlib.util
from pathlib import Path

KERNELS = Path(__file__).resolve().parent / "plugins" / "fused_kernels.py"
DTYPES = ("float32", "bfloat16", "float16")
WIDTHS = (64, 2048)


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


PANEL = [(k, d, w) for k in ("returns_pair", "in_place", "bf16_sum", "stale_residual", "aliased", "half_sum", "eps_1e6")
         for d in DTYPES for w in WIDTHS]


def kernels():
    spec = importlib.util.spec_from_file_location("fused_kernels", KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(case, module=None) -> set:
    from parity_cli.testing import check_norm

    kernel, dtype, width = case
    result = check_norm(getattr(module or kernels(), kernel), family="llama", hidden_size=width, eps=1e-5,
                        dtype=dtype, weight="random", fused="add")
    return {d["code"] for d in result.diagnoses} if not result else set()


# --- norm + int8 quantize (tests/plugins/quant_kernels.py) ---

QUANT_KERNELS = Path(__file__).resolve().parent / "plugins" / "quant_kernels.py"
SCALES = ("static", "dynamic")


def quant_expected(kernel: str, scale: str) -> set:
    return {
        "correct": set(),
        "truncates": {"quant_rounding_truncates"},
        # a per-token scale never puts a value past 127: there is nothing to wrap
        "wraps": {"quant_wraps"} if scale == "static" else set(),
        "scale_before_gain": {"quant_scale_before_gain"},
    }[kernel]


QUANT_PANEL = [(k, d, s) for k in ("correct", "truncates", "wraps", "scale_before_gain")
               for d in DTYPES for s in SCALES]


def quant_kernels():
    spec = importlib.util.spec_from_file_location("quant_kernels", QUANT_KERNELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_quant_case(case, module=None) -> set:
    from parity_cli.testing import check_norm

    kernel, dtype, scale = case
    result = check_norm(getattr(module or quant_kernels(), kernel), family="llama", hidden_size=256, eps=1e-6,
                        dtype=dtype, weight="random", fused="quant", scale=scale)
    return {d["code"] for d in result.diagnoses} if not result else set()
