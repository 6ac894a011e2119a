"""Stage 6: from a failing layer's strata to its cause.

Method of the sources: keep the high-precision reference and change conditions. The cause is
the simplest combination of changed factors that reproduces the candidate (parity_cli.diagnose.fit);
the single-change panel below only adds evidence. When nothing reproduces it, the rule of
thumb of the sources names a first suspect from the rows that failed: only small q/eps -> the
eps value or placement; only large inputs -> overflow or a missing upcast."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parity_cli.backends.implementations import mean_square, oracle_normalize
from parity_cli.comparison import StratumResult, Tolerance
from parity_cli.model.layers import NormLayer


@dataclass
class Diagnosis:
    code: str
    message: str
    evidence: dict = field(default_factory=dict)


@dataclass
class Context:
    """What every hypothesis may use: the layer, its expected gain and the results."""

    layer: NormLayer
    gain: object  # float64 effective gain (offset + weight)
    bias: object
    tol: Tolerance
    dtype: object  # candidate torch dtype
    strata: list[StratumResult]
    cache: dict = field(default_factory=dict, repr=False)  # per-stratum masks shared by every variant

    @property
    def eps(self) -> float:
        return self.layer.eps.value


def estimate_eps(ctx: Context):
    """(median, spread) of the eps that explains the candidate with the expected gain and
    semantics, or None: the explain ladder's fallback when the diagnosis found none."""
    from parity_cli.diagnose import fit

    est = fit.estimate_eps(fit.Panel(ctx), fit.Factors(centred=ctx.layer.kind == "layer_norm", eps=ctx.eps), ctx.gain)
    return None if est is None else est[:2]


def _affine(ctx: Context, y, gain=None):
    y = y * (ctx.gain if gain is None else gain)
    return y if ctx.bias is None else y + ctx.bias


def _eps_outside(x, eps, kind="rms_norm"):
    """x / (sqrt(q) + eps); for a LayerNorm (x - mean) / (std + eps)."""
    import torch

    h = x - x.mean(-1, keepdim=True) if kind == "layer_norm" else x
    q = mean_square(x, kind).unsqueeze(-1)
    return h / (torch.sqrt(q) + eps)


def _no_upcast(ctx: Context, x):
    """Squares and averages in the candidate dtype, as code without .float() does."""
    import torch

    h = x.to(ctx.dtype)
    if ctx.layer.kind == "layer_norm":
        h = h - h.mean(-1, keepdim=True)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
    return y.to(torch.float64)


def _eps_zero(ctx: Context, x):
    """eps = 0: rows with q = 0 become 0/0 = NaN, as they do in the faulty kernel."""
    import torch

    y = oracle_normalize(x, 0.0, ctx.layer.kind)
    zero_rows = (mean_square(x, ctx.layer.kind) == 0).unsqueeze(-1)
    return torch.where(zero_rows, torch.full_like(y, math.nan), y)


RULED_OUT = ("eps value (estimated), eps = 0, eps outside the root, mean subtraction, variance for mean "
             "square, gain offset 0/1/2, uniform gain scale, per-channel gain, no upcast / float32 math, and "
             "their combinations of up to three")


def _failing_rows(ctx: Context, spread: list | None = None):
    """(q/eps, max |x|) of every row with an element outside tolerance (and into `spread`, each
    row's std / max |x|)."""
    import torch

    q_eps, peak = [], []
    for s in ctx.strata:
        if s.status != "fail" or s.cand is None or s.x is None:
            continue
        allowed = ctx.tol.atol + ctx.tol.rtol * s.ref.abs()
        ok = ((s.cand - s.ref).abs() <= allowed) | (s.cand == s.ref) | (torch.isnan(s.cand) & torch.isnan(s.ref))
        bad = ~ok.all(-1)
        if not bool(bad.any()):
            continue
        q = mean_square(s.x[bad], ctx.layer.kind)
        q_eps += (q / ctx.eps if ctx.eps > 0 else torch.full_like(q, math.inf)).tolist()
        peak += s.x[bad].abs().amax(-1).tolist()
        if spread is not None:
            spread += (s.x[bad].std(-1, unbiased=False) / s.x[bad].abs().amax(-1).clamp_min(1e-300)).tolist()
    return q_eps, peak


def _zero_division(ctx: Context) -> list[str]:
    """The strata (zero first) whose rows give non-finite output where the reference is finite,
    when every such row is one where eps carries the denominator (q/eps <= 100) and the all-zero
    rows are among them: 0/0 where eps should have been. Else []."""
    import torch

    names = []
    for s in ctx.strata:
        if s.cand is None or s.x is None or s.nonfinite_candidate <= s.nonfinite_reference:
            continue
        new = (~torch.isfinite(s.cand) & torch.isfinite(s.ref)).any(-1)
        if not bool(new.any()):
            continue
        q = mean_square(s.x[new], ctx.layer.kind)
        if ctx.eps > 0 and bool((q > 100 * ctx.eps).any()):
            return []  # non-finite where eps is negligible: an overflow, not a 0/0
        names.append(s.name)
    return ["zero"] + [n for n in names if n != "zero"] if "zero" in names else []


def _failing_finite(ctx: Context) -> set[str]:
    """Failing strata with an element outside tolerance where the candidate is finite."""
    import torch

    out = set()
    for s in ctx.strata:
        if s.status != "fail" or s.cand is None:
            continue
        allowed = ctx.tol.atol + ctx.tol.rtol * s.ref.abs()
        if bool((torch.isfinite(s.cand) & ((s.cand - s.ref).abs() > allowed)).any()):
            out.add(s.name)
    return out


def _symptom(ctx: Context, failing: set[str]) -> Diagnosis:
    """The rule of thumb of the sources, on the rows that failed (not the strata they belong to:
    a constant row at c = 100 has q/eps 1e10 and is no small input)."""
    spread: list = []
    q_eps, peak = _failing_rows(ctx, spread)
    ev = {"strata": sorted(failing), "ruled_out": RULED_OUT}
    if q_eps:
        ev["failing_q_over_eps"] = {"min": min(q_eps), "max": max(q_eps)}
        ev["failing_max_abs_x"] = max(peak)
        ev["failing_rows"] = len(q_eps)
    if ctx.layer.kind == "layer_norm" and spread and max(spread) <= ctx.layer.dim * 2.0 ** -24:
        # the spread is below what rounding the mean in float32 leaves: x - mean is that rounding
        # there, whatever eps is (an exactly constant row gives the bias for every eps)
        ev["failing_max_spread"] = max(spread)
        return Diagnosis("symptom_mean_rounding",
                         f"errors only on rows whose spread is within float32 rounding of their mean ("
                         f"{', '.join(sorted(failing))}): x - mean and the variance are rounding noise there, amplified "
                         "by 1 / sqrt(var + eps); suspect how the mean and variance are computed (precision, order, "
                         "E[x^2] - E[x]^2), not the eps value: an exactly constant row gives the bias for any eps", ev)
    # "only at small q/eps" needs rows of larger q/eps that pass: a capture of real rows, all below
    # 1e4, fails everywhere without saying anything about q/eps
    compared = [s.q_over_eps[1] for s in ctx.strata if s.status in ("pass", "fail") and s.q_over_eps]
    if q_eps and max(q_eps) <= 1e4 and compared and max(compared) > max(q_eps):
        return Diagnosis("symptom_small_inputs",
                         f"errors only on rows with q/eps <= {max(q_eps):.3g} ({', '.join(sorted(failing))}): suspect "
                         "q/eps, the eps value or where it enters; no combination of known faults reproduces it", ev)
    if peak and min(peak) >= 256:
        return Diagnosis("symptom_large_inputs",
                         f"errors only on rows with |x| >= {min(peak):.3g} ({', '.join(sorted(failing))}): suspect "
                         "intermediate overflow or precision (squaring or summing without an upcast)", ev)
    where = "" if not q_eps else f" on rows with q/eps {min(q_eps):.3g}..{max(q_eps):.3g}"
    return Diagnosis("unexplained",
                     f"failing strata {', '.join(sorted(failing))}{where}: no combination of known faults reproduces "
                     "the candidate; compare the worst elements", ev)


# The panel of known variants (issue: "change one condition at a time"): each is the expected
# semantics with one condition changed. Their names go into the evidence when they fit.
EPS_PANEL = (1e-5, 1e-6, 1e-8, 1e-12, 1.1920928955078125e-07, 0.0)


def _panel(ctx: Context):
    """(name, variant(ctx, x) -> float64 output or None) for every single-condition change."""
    out = []
    est = estimate_eps(ctx)
    eps_values = list(EPS_PANEL) + ([est[0]] if est and est[0] > 0 else [])
    for e in eps_values:
        if e != ctx.eps:
            label = "estimated" if est and e == est[0] and e not in EPS_PANEL else f"{e:g}"
            out.append((f"eps={label}" if label != "estimated" else f"eps~{e:.3g}",
                        _eps_variant_fn(e)))
    out.append(("eps outside sqrt", lambda c, x: _affine(c, _eps_outside(x, c.eps, c.layer.kind))))
    if ctx.layer.kind == "rms_norm":
        out.append(("mean subtracted", lambda c, x: _affine(c, oracle_normalize(x, c.eps, "layer_norm"))))
    else:
        out.append(("mean not subtracted", lambda c, x: _affine(c, oracle_normalize(x, c.eps, "rms_norm"))))
    for offset in (0.0, 1.0, 2.0):
        if offset != ctx.layer.gain_offset:
            out.append((f"gain {offset:g} + w", (lambda d: lambda c, x: _affine(
                c, oracle_normalize(x, c.eps, c.layer.kind), c.gain + d))(offset - ctx.layer.gain_offset)))
    for order in ("llama", "gemma"):
        out.append((f"{order} cast order", (lambda o: lambda c, x: _ordered(c, x, o))(order)))
    out.append(("no upcast", lambda c, x: _affine(c, _no_upcast(c, x))))
    return out


def _eps_variant_fn(value: float):
    def variant(c, x):
        return _affine(c, _eps_zero(c, x) if value == 0 else oracle_normalize(x, value, c.layer.kind))

    return variant


def _ordered(ctx: Context, x, order: str):
    """The expected math at the candidate dtype in one of the two HF cast orders (bitwise as HF)."""
    import torch

    if ctx.dtype == torch.float64 or ctx.layer.kind != "rms_norm":
        return None
    w = (ctx.gain - ctx.layer.gain_offset).to(ctx.dtype)
    xd = x.to(ctx.dtype)
    h = xd.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
    if order == "llama":
        gain = (ctx.layer.gain_offset + w.double()).to(ctx.dtype)
        y = gain * h.to(ctx.dtype)
    else:
        y = (h * (ctx.layer.gain_offset + w.float())).to(ctx.dtype)
    return y.to(torch.float64) + (0 if ctx.bias is None else ctx.bias)


def matching_variants(ctx: Context) -> list[str]:
    """Single changes (and cast orders) that reproduce the candidate, by fit.match's check."""
    from parity_cli.diagnose import fit

    compared = [s for s in ctx.strata if s.cand is not None]
    names = []
    for name, variant in _panel(ctx):
        outputs = []
        for s in compared:
            v = variant(ctx, s.x)
            if v is None:
                break
            outputs.append((s, v))
        else:
            if outputs and fit.match(ctx, [o[0] for o in outputs], [o[1] for o in outputs]) is not None:
                names.append(name)
    return names


def cast_order_diagnosis(ctx: Context) -> Diagnosis | None:
    """The candidate equals the other family's cast order bit for bit, and not the expected one."""
    import torch

    compared = [s for s in ctx.strata if s.cand is not None]
    if not compared or ctx.layer.order not in ("llama", "gemma"):
        return None
    other = "gemma" if ctx.layer.order == "llama" else "llama"

    def equal(order):
        for s in compared:
            v = _ordered(ctx, s.x, order)
            if v is None or not bool(((s.cand == v) | (torch.isnan(s.cand) & torch.isnan(v))).all()):
                return False
        return True

    if equal(other) and not equal(ctx.layer.order):
        return Diagnosis("cast_order",
                         f"the candidate matches {other}-order numerics bit for bit (the family uses {ctx.layer.order} "
                         "order): " + ("the gain is applied in float32 and the cast is last"
                                       if other == "gemma" else "the cast to the input dtype comes before the gain"),
                         {"expected_order": ctx.layer.order, "matched_order": other})
    return None


def affine_in_dtype_diagnosis(ctx: Context) -> Diagnosis | None:
    """A half-precision candidate that rounds h, then w * h, then + b, each to its dtype (MLX's
    mx.fast.layer_norm at bfloat16/float16), where torch's kernels round once at the end: where w h
    nearly cancels b the result keeps only |w h| 2^-p. Said where that form reproduces every
    compared element within a unit of the dtype at the size of its terms, and one rounding does not."""
    import torch

    half = (torch.float16, torch.bfloat16)
    compared = [s for s in ctx.strata if s.cand is not None]
    if not compared or ctx.dtype not in half or ctx.layer.kind not in ("layer_norm", "rms_norm") or \
            ctx.gain.dim() > 1:
        return None
    unit = torch.finfo(ctx.dtype).eps
    w = ctx.gain.double()
    b = 0.0 if ctx.bias is None else ctx.bias.double()

    def forms(x):
        h = x.double()
        if ctx.layer.kind == "layer_norm":
            h = h - h.mean(-1, keepdim=True)
        h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)
        wh = (h.to(ctx.dtype).double() * w).to(ctx.dtype).double()
        size = (h * w).abs() + (b.abs() if torch.is_tensor(b) else abs(b))  # the terms' size: where rounding acts
        return (wh + b).to(ctx.dtype).double(), (h * w + b).to(ctx.dtype).double(), size

    three = one = True
    for s in compared:
        y3, y1, size = forms(s.x)
        cand = s.cand.double()
        ok = torch.isfinite(cand)
        three &= bool(((cand - y3).abs()[ok] <= (unit * size)[ok]).all())
        one &= bool((cand[ok] == y1[ok]).all())
    if three and not one:
        name = str(ctx.dtype).removeprefix("torch.")
        return Diagnosis("affine_in_input_dtype",
                         f"the candidate rounds the normalised value, then w * h, then + b, each to {name} (three "
                         f"roundings where torch's kernels round once): where w h nearly cancels b the output keeps "
                         f"only |w h| x 2^-{int(-math.log2(unit))}, past the allowance",
                         {"dtype": name, "roundings": 3})
    return None


def _row_statistics(ctx: Context):
    """[(x, the kernel's mean, its variance, the row's mean, its variance)] of every failing row whose
    output is exactly an affine function of the row, (x - m') / sqrt(v' + eps) times the gain plus the
    bias (x / sqrt(v' + eps) for RMSNorm); None where a failing row is not (another fault). A
    non-finite or a constant row says nothing of a slope and is left out. Fitted once a layer (both
    per-row diagnoses read it)."""
    if "row_statistics" not in ctx.cache:
        ctx.cache["row_statistics"] = _fit_rows(ctx)
    return ctx.cache["row_statistics"]


def _fit_rows(ctx: Context):
    import torch

    if ctx.layer.kind not in ("layer_norm", "rms_norm") or ctx.gain.dim() > 1:
        return None
    g = ctx.gain.double()
    if not bool((g.abs() > 1e-3).all()):
        return None
    unit = torch.finfo(ctx.dtype).eps if ctx.dtype.is_floating_point else 2.0 ** -52
    centred = ctx.layer.kind == "layer_norm"
    out = []
    for s in ctx.strata:
        if s.cand is None or s.status != "fail":
            continue
        x, c = s.x.double(), s.cand.double()
        z = (c - (0 if ctx.bias is None else ctx.bias.double())) / g
        bad = ((c - s.ref).abs() > ctx.tol.atol + ctx.tol.rtol * s.ref.abs()).any(-1)
        for i in torch.nonzero(bad).flatten().tolist():
            xi, zi = x[i], z[i]
            if not bool(torch.isfinite(zi).all() and torch.isfinite(xi).all()) or float(xi.std()) == 0:
                continue
            if centred:  # least squares z = scale x + offset, in closed form
                dx = xi - xi.mean()
                scale = float((dx * (zi - zi.mean())).sum() / (dx * dx).sum())
                offset = float(zi.mean()) - scale * float(xi.mean())
            else:
                scale, offset = float((xi * zi).sum() / (xi * xi).sum()), 0.0
            # the output rounds at its own size, and x - m' at the size of x (a row far from 0)
            size = max(float(zi.abs().max()), abs(scale) * float(xi.abs().max()) if centred else 0.0)
            if scale <= 0 or float((scale * xi + offset - zi).abs().max()) > 8 * unit * size:
                return None  # not a row-wise affine map: another fault
            v_row = float(xi.var(unbiased=False)) if centred else float(xi.pow(2).mean())
            out.append((xi, -offset / scale if centred else 0.0, 1.0 / scale ** 2 - ctx.eps, float(xi.mean()), v_row))
    return out


def variance_cancellation_diagnosis(ctx: Context) -> Diagnosis | None:
    """A LayerNorm whose failing rows are each normalised exactly, with a variance off by more than
    taking it from x - mean can lose and within what E[x^2] - E[x]^2 loses at the kernel's precision:
    (n + 2) u (E[x^2] + m^2), which is far larger than the variance where the mean is large against
    the spread (CTranslate2's CPU LayerNorm, ExecuTorch's portable one). Said only where every such
    row is within that bound and one at least is past the two-pass bound."""
    import torch

    rows = _row_statistics(ctx) if ctx.layer.kind == "layer_norm" else None
    if not rows:
        return None
    unit = max(torch.finfo(ctx.dtype).eps, 2.0 ** -23) if ctx.dtype.is_floating_point else 2.0 ** -23
    n = ctx.layer.dim
    past, worst = 0, None
    for xi, _, v_kernel, m_row, v_row in rows:
        one_pass = (n + 2) * unit * (float(xi.pow(2).mean()) + m_row ** 2)
        off = abs(v_kernel - v_row)
        if off > one_pass:
            return None  # more than cancellation can lose: another fault
        if off > 4 * (n + 2) * unit * v_row:
            past += 1
            if worst is None or off / v_row > worst["variance_error"]:
                worst = {"variance_error": off / v_row, "row_mean": m_row, "row_variance": v_row,
                         "kernel_variance": v_kernel}
    if not past:
        return None
    name = str(ctx.dtype).removeprefix("torch.")
    return Diagnosis("variance_cancellation",
                     f"each failing row is normalised exactly, but with a variance off by up to "
                     f"{worst['variance_error']:.3g} of the row's (a row of mean {worst['row_mean']:.3g} and "
                     f"variance {worst['row_variance']:.3g} normalised as if its variance were "
                     f"{worst['kernel_variance']:.3g}): within what E[x^2] - E[x]^2 loses in {name} where the mean "
                     "is large against the spread, past what the mean of (x - mean)^2 loses; the kernel takes the "
                     "variance in one pass (compute it from x - mean: two passes, or Welford)",
                     {"rows": past, **worst})


def row_statistics_diagnosis(ctx: Context) -> Diagnosis | None:
    """Each failing row's output is exactly an affine function of that row, but with statistics that
    are not the row's: the normalisation's form is right and its mean and variance are wrong
    (ExecuTorch 1.5.1's vectorised half LayerNorm reads a row of variance 0.88 as 90). Said only where
    the per-row fit is exact to the dtype's rounding on every failing row, and its variance off by
    more than 1 % of the row's on nine in ten of them."""
    fitted = _row_statistics(ctx)
    if not fitted:
        return None
    centred = ctx.layer.kind == "layer_norm"
    rows, right, worst = 0, 0, None
    for _, m_kernel, v_kernel, m_row, v_row in fitted:
        if abs(v_kernel - v_row) <= 0.01 * v_row:
            right += 1  # the statistics are the row's: this row's miss is something else
            continue
        rows += 1
        if worst is None or abs(v_kernel / v_row) > abs(worst["kernel_variance"] / worst["row_variance"]):
            worst = {"row_mean": m_row, "row_variance": v_row, "kernel_mean": m_kernel,
                     "kernel_variance": v_kernel}
    if not rows or right > 0.1 * (rows + right):  # nearly every failing row, or it is not the cause
        return None
    what = "mean and variance" if centred else "mean square"
    return Diagnosis("row_statistics_wrong",
                     f"each failing row is normalised exactly, but with a {what} that is not the row's (a row of "
                     f"{'variance' if centred else 'mean square'} {worst['row_variance']:.3g} normalised as if it "
                     f"were {worst['kernel_variance']:.3g}): the kernel's statistics are wrong, its form is right",
                     {"rows": rows, **worst})


def diagnose(layer: NormLayer, strata: list[StratumResult], gain, tol: Tolerance, dtype, bias=None) -> list[Diagnosis]:
    """Every factor of the simplest combination that reproduces the candidate (parity_cli.diagnose.fit),
    each its own diagnosis; when none does, only what the data shows: a bit-exact cast order,
    non-finite zero rows, or which rows failed (and what was ruled out)."""
    from parity_cli.diagnose import fit as fitting

    failing = {s.name for s in strata if s.status == "fail"}
    if not failing:
        return []
    ctx = Context(layer=layer, gain=gain, bias=bias, tol=tol, dtype=dtype, strata=strata)
    best = fitting.fit(ctx)
    if best is not None and best.factors is None:  # the hairline: marginal, the variants listed
        return [Diagnosis(code, message, dict(evidence)) for code, message, evidence in best.findings]
    if best is not None and best.findings:
        out = [Diagnosis(code, message, dict(evidence)) for code, message, evidence in best.findings]
        expected = fitting.Factors(centred=layer.kind == "layer_norm", eps=ctx.eps)
        out[0].evidence["matching_variants"] = [fitting.variant_name(best.factors, expected, ctx)]
        if len(out) > 1:
            codes = [d.code for d in out]
            for d in out:
                d.evidence["together_with"] = [c for c in codes if c != d.code]
        return out
    from parity_cli.diagnose.storage import half_arithmetic_diagnosis, scale_in_dtype_diagnosis

    held = scale_in_dtype_diagnosis(ctx) or half_arithmetic_diagnosis(ctx)  # a dtype's, before a 0/0's guess
    if held is not None:
        return [Diagnosis(*held)]
    out: list[Diagnosis] = []
    nan_strata = _zero_division(ctx)
    if nan_strata:
        lost = fitting.eps_lost(ctx.eps, dtype)
        out.append(Diagnosis("eps_missing", "an all-zero row gives non-finite output: " + (lost or "eps is missing "
                             "or zero") + ", so the norm computes 0/0" + (f" (also on {', '.join(nan_strata[1:])} rows, "
                             "where q/eps <= 100)" if len(nan_strata) > 1 else ""),
                             {"strata": nan_strata, "configured_eps": ctx.eps, "lost_to_dtype": bool(lost),
                              "dtype": str(dtype).removeprefix("torch.")}))
        rest = _failing_finite(ctx)
        if rest:  # other rows fail with finite values: what they show, as well
            out.append(_symptom(ctx, rest))
    if not out:
        cast = cast_order_diagnosis(ctx) or affine_in_dtype_diagnosis(ctx) or variance_cancellation_diagnosis(ctx) \
            or row_statistics_diagnosis(ctx)
        if cast:
            out.append(cast)
    if not out:
        out.append(_symptom(ctx, failing))
    variants = matching_variants(ctx)  # single changes (and cast orders) that fit, short of a cause
    if variants:
        out[0].evidence["matching_variants"] = variants
    return out


def diagnose_grad(layer: NormLayer, grads: list[StratumResult], gain=None, eps: float = 0.0) -> list[Diagnosis]:
    """--grad: which gradient (dx, dweight) disagrees on which strata. A backward that is wrong
    where the forward is right (a hand-written autograd Function) is named as such."""
    bad = [g for g in grads if g.status != "pass"]
    if not bad:
        return []
    parts: dict[str, list[str]] = {}
    for g in bad:
        stratum, _, part = g.name.partition(":")
        parts.setdefault(part or "dx", []).append(stratum)
    errors = sorted({g.error for g in bad if g.error})
    if errors:
        return [Diagnosis("grad_error", f"the candidate's backward pass failed: {errors[0]}",
                          {"errors": errors[:5], "parts": parts})]
    words = "; ".join(f"{part} on {', '.join(strata)}" for part, strata in sorted(parts.items()))
    return [Diagnosis("grad_mismatch", f"backward differs from the float64 reference: {words}",
                      {"parts": parts,
                       "max_abs_err": {g.name: g.max_abs_err for g in bad}})]


def compared_strata(strata: list[StratumResult]) -> list[StratumResult]:
    """The strata whose candidate output exists to be reproduced (not errored, not skipped)."""
    return [s for s in strata if s.error is None and s.x is not None and s.cand is not None]


def opening(strata: list[StratumResult], dtype, exact: bool) -> tuple[list[Diagnosis] | None, list[StratumResult]]:
    """What every kind's diagnosis starts with: nothing to say where no stratum failed, the
    bitwise account under --exact, nothing where no stratum was compared (the errors are the
    finding). (the diagnoses to return now, or None; the compared strata)."""
    if all(s.status == "pass" for s in strata):
        return [], []
    if exact:
        return bitwise_diagnosis(strata, dtype), []
    compared = compared_strata(strata)
    return (None if compared else []), compared


def reproduces(strata: list[StratumResult], output, allowed) -> bool:
    """Whether a hypothesis reproduces the candidate: `output(s)` its float64 output on a stratum's
    inputs (None where it cannot say), `allowed(s, y)` the tolerance per element. Every element the
    candidate returned must lie within it (1e-4 of slack for the arithmetic of the check itself),
    non-finite exactly where the hypothesis is."""
    import torch

    for s in strata:
        y = output(s)
        if y is None:
            return False
        cand = s.cand.to(torch.float64)
        finite = torch.isfinite(cand)
        if not bool((torch.isfinite(y) == finite).all()):
            return False
        bound = allowed(s, y)
        if not bool(((cand - y).abs()[finite] <= bound[finite] * 1.0001 + 1e-300).all()):
            return False
    return True


def median(values: list[float]) -> float | None:
    """The upper median (an estimate every kind reads off many rows; None where there are none)."""
    return sorted(values)[len(values) // 2] if values else None


def bitwise_diagnosis(strata: list[StratumResult], dtype, layer: NormLayer | None = None, gain=None,
                      tol: Tolerance | None = None, bias=None) -> list[Diagnosis]:
    """--exact: report how far from bitwise the candidate is, in ulps of its dtype, and whether it
    is the other HF cast order bit for bit."""
    bad = [s for s in strata if s.status == "fail"]
    if not bad:
        return []
    if layer is not None and gain is not None:
        cast = cast_order_diagnosis(Context(layer=layer, gain=gain, bias=bias, tol=tol, dtype=dtype, strata=strata))
        if cast:
            cast.evidence["max_ulp"] = max((s.max_ulp or 0.0) for s in bad)
            return [cast]
    worst = max((s.max_ulp or 0.0) for s in bad)
    differing = sum(s.violations for s in bad)
    total = sum(s.elements for s in strata)
    name = str(dtype).removeprefix("torch.")
    return [Diagnosis("bitwise_difference",
                      f"{differing} of {total} elements differ, by at most {worst:g} ulp of {name} "
                      "(a different rounding order, not different math, when this is a few ulp)",
                      {"max_ulp": worst, "differing_elements": differing, "elements": total,
                       "strata": sorted(s.name for s in bad)})]


VAGUE = {"marginal", "unexplained"}


def with_copy_eps(diagnoses: list, findings: list, layer) -> list:
    """A copy whose graph or file holds another eps (read there, not estimated): where the probes
    gave no cause or a vague one (a float16 IR whose eps 1e-5 is stored as 1.00136e-5 misses by a
    hair), that eps is the cause, stated with the value the copy holds and where it was read."""
    if diagnoses and not {d.code for d in diagnoses} <= VAGUE:
        return diagnoses
    held = next((f for f in findings if f.get("code") == "eps_mismatch" and "value" in f), None)
    copy = next((f for f in findings if f.get("code") == "checkpoint_eps_mismatch"), None)
    if held is None and copy is None:
        return diagnoses
    value = held["value"] if held is not None else copy["candidate"]["value"]
    where = (f"stored as {held['stored_as']} in the copy" if held is not None and held.get("stored_as")
             else f"read from the copy ({copy['candidate']['source']})" if copy is not None else "read from the copy")
    configured = layer.eps.value
    return [Diagnosis("eps_mismatch",
                      f"the copy computes with eps = {value:.6g} ({where}) where the layer's eps is {configured:.6g} "
                      f"({layer.eps.source})",
                      {"estimated_eps": value, "configured_eps": configured, "eps_source": layer.eps.source,
                       "read_from_copy": True})] + [d for d in diagnoses if d.code not in VAGUE]
