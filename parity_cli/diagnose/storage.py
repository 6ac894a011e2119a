"""Causes that are a dtype's, not a formula's: a kernel whose form and eps are right but that holds
an intermediate, or does its arithmetic, in a narrower dtype than it is checked at. Named apart
because the fix is a buffer's type, not an eps or a gain (issue 47: a float16 rstd that overflows
was called `eps_missing`, a float32 kernel computing in float16 only `unexplained`)."""

from __future__ import annotations

import math

from parity_cli.backends.implementations import mean_square


def fmt(value: float) -> str:
    return f"{value:.3g}"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _scaled(ctx, x):
    """The exact form with only the scale 1/sqrt(q + eps) rounded to the candidate dtype, and h times
    it rounded there too; the gain and bias applied after, in float64."""
    import torch

    x = x.double()
    h = x - x.mean(-1, keepdim=True) if ctx.layer.kind == "layer_norm" else x
    q = mean_square(x, ctx.layer.kind).unsqueeze(-1)
    scale = torch.rsqrt(q + ctx.eps).to(ctx.dtype).double()
    with torch.no_grad():
        y = (h * scale).to(ctx.dtype).double() * ctx.gain
    return y if ctx.bias is None else y + ctx.bias


def _agrees(ctx, cand, y) -> bool:
    """cand as y within the allowance, non-finite exactly where y is."""
    import torch

    finite = torch.isfinite(y)
    if not bool(torch.equal(finite, torch.isfinite(cand))):
        return False
    allowed = ctx.tol.atol + ctx.tol.rtol * y[finite].abs()
    return bool(((cand[finite] - y[finite]).abs() <= allowed).all())


def scale_in_dtype_diagnosis(ctx):
    """`scale_in_input_dtype`: the scale held in the half dtype reproduces every row of every stratum
    (its non-finite rows included) and differs from the exact form on a failing row. At an eps
    whose 1/sqrt(eps) is past the dtype's largest value (1e-12 in float16: 1e6 > 65504) a row with
    q + eps that small gets an infinite scale, and an all-zero row 0 * inf = NaN: the eps was used."""
    import torch

    if ctx.dtype not in (torch.float16, torch.bfloat16) or ctx.layer.kind not in ("rms_norm", "layer_norm"):
        return None
    explains, nonfinite = False, 0
    for s in ctx.strata:
        if s.cand is None or s.x is None:
            continue
        y = _scaled(ctx, s.x)
        if not _agrees(ctx, s.cand.double(), y):
            return None
        if s.status == "fail":
            explains = explains or not _agrees(ctx, s.ref.double(), y)
            nonfinite += int((~torch.isfinite(s.cand)).any(-1).sum())
    if not explains:
        return None
    name, top = _dtype_name(ctx.dtype), torch.finfo(ctx.dtype).max
    limit = 1.0 / top ** 2  # q + eps below this: a scale past the dtype's largest value
    said = (f"the scale 1/sqrt(q + eps) is held in {name}: the eps is used, but where q + eps < {fmt(limit)} the "
            f"scale is past {name}'s largest value {fmt(top)} and becomes inf")
    if ctx.eps > 0 and 1.0 / math.sqrt(ctx.eps) > top:
        said += (f" (eps {fmt(ctx.eps)} alone gives 1/sqrt(eps) = {fmt(1 / math.sqrt(ctx.eps))}, so an all-zero row "
                 "is 0 * inf = NaN)")
    said += f"; elsewhere the scale's rounding to {name} moves every element of a row alike"
    return _diagnosis("scale_in_input_dtype", said, {"dtype": name, "overflow_below_q_plus_eps": limit,
                                                       "nonfinite_rows": nonfinite, "configured_eps": ctx.eps})


def _diagnosis(code, message, evidence) -> tuple:
    """(code, message, evidence): causes.Diagnosis's fields (this module sits below causes)."""
    return code, message, evidence


NARROWER = ("float16", "bfloat16")


def half_arithmetic_diagnosis(ctx):
    """`arithmetic_in_lower_dtype`: a float32 (float64) candidate whose every finite output is a
    float16 (bfloat16) value while the reference's are not: a kernel that computes, or at least
    rounds its result, in the narrower dtype. By chance a float32 value is a float16 one about once
    in 8,000, so thousands of them all are is no accident."""
    import torch

    if ctx.dtype not in (torch.float32, torch.float64):
        return None
    cands = [s.cand[torch.isfinite(s.cand)] for s in ctx.strata if s.cand is not None]
    refs = [s.ref[torch.isfinite(s.ref)] for s in ctx.strata if s.ref is not None]
    if not cands or not refs:
        return None
    cand, ref = torch.cat([c.reshape(-1) for c in cands]), torch.cat([r.reshape(-1) for r in refs])
    held = []
    for name in NARROWER:
        low = getattr(torch, name)
        top = torch.finfo(low).max
        inside = cand.abs() <= top
        if not bool(inside.all()):
            continue
        exact = cand.to(low).to(cand.dtype) == cand
        ref_exact = ref.to(low).to(ref.dtype) == ref
        if bool(exact.all()) and cand.numel() >= 1000 and float(ref_exact.double().mean()) < 0.5:
            held.append((name, int(cand.numel()), int((~ref_exact).sum())))
    if len(held) != 1:  # none, or both (outputs that every narrow type holds say nothing)
        return None
    name, n, not_ref = held[0]
    checked = _dtype_name(ctx.dtype)
    return _diagnosis("arithmetic_in_lower_dtype",
                      f"every one of its {n:,} finite outputs is a {name} value (of the reference's, {not_ref:,} are "
                      f"not): the kernel computes in {name}, or rounds its result there, though it is checked at "
                      f"{checked}; {name}'s rounding is the error",
                      {"values_dtype": name, "checked_at": checked, "outputs": n})
