"""Stage 6b: explain a failing layer by fitting the candidate with several factors at once.

A real migration fault is often two changes together (eps 1e-5 *and* the gain w instead of
1 + w; a hard-coded eps *and* no upcast). Matching one planted change at a time then names
one of them, or the wrong one. Here a variant is the expected math with any combination of
factors changed:

    y = gain' * N(x; centring, mean square or variance, eps, eps inside or outside the root,
                  precision) (+ bias)

The gain is fitted on the normal rows (where eps is invisible), eps on the tiny and constant
rows (where it is visible) given that gain, and the combinations are tried from the fewest
changed factors up. A factor is stated only when its whole combination reproduces the
candidate within tolerance on (nearly) every element and on the elements that failed: the
residual check. Otherwise nothing is claimed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MATCH_SLACK = 2.0  # the variant is float64 (or the dtype's own math); the candidate rounds once more
MATCH_SHARE = 0.99
U32 = 2.0 ** -24


@dataclass(frozen=True)
class Factors:
    """One combination. Defaults are the layer's expected semantics; `changed` counts the rest."""

    centred: bool  # subtract the row mean before normalising
    variance: bool = False  # divide by sqrt(variance + eps) without centring x (a LayerNorm-as-RMSNorm)
    eps: float = 0.0
    eps_label: str = "configured"  # configured | estimated | zero
    outside: bool = False  # x / (sqrt(q) + eps)
    precision: str = "exact"  # exact | no_upcast (square and sum in the dtype) | float32
    gain: str = "expected"  # expected | offset | scale | channel
    gain_value: float = 0.0  # the offset, or the uniform scale
    eps_spread: float = 0.0  # of the estimate: (75th - 25th percentile) / median


@dataclass
class Fit:
    factors: Factors
    closeness: float
    findings: list = field(default_factory=list)  # (code, message, evidence) per changed factor


# --- the variant ------------------------------------------------------------------------------------

def normalise(x, f: Factors, dtype):
    """N(x) for the factors, float64 out. `exact` is float64 and overflow-safe where the
    formula allows (the scaled form of the oracle)."""
    import torch

    from parity_cli.implementations import oracle_normalize

    if f.precision != "exact":
        work = dtype if f.precision == "no_upcast" else torch.float32
        h = x.to(work)
        if f.centred:
            h = h - h.mean(-1, keepdim=True)
        if f.variance:
            q = (h - h.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
        else:
            q = h.pow(2).mean(-1, keepdim=True)
        y = h / (torch.sqrt(q) + f.eps) if f.outside else h * torch.rsqrt(q + f.eps)
        return y.to(torch.float64)
    if not f.variance and not f.outside:
        y = oracle_normalize(x, f.eps, "layer_norm" if f.centred else "rms_norm")
        if f.eps == 0:  # 0/0 on an all-zero row is NaN, as in the faulty kernel
            zero = (x == 0).all(-1, keepdim=True)
            y = torch.where(zero, torch.full_like(y, math.nan), y)
        return y
    m = x.abs().amax(-1, keepdim=True)
    m = torch.where(m > 0, m, torch.ones_like(m))
    xs = x / m
    h = xs - xs.mean(-1, keepdim=True) if f.centred else xs
    q = (xs - xs.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) if f.variance else h.pow(2).mean(-1, keepdim=True)
    if f.outside:  # x/(sqrt(q)+eps) = (x/m) / (sqrt(q/m^2) + eps/m)
        return h / (torch.sqrt(q) + f.eps / m)
    return h / torch.sqrt(q + f.eps / (m * m))


class Panel:
    """Variant outputs of one layer's compared strata, computed once per normalisation and
    shared by every gain (and, through the probes' shared dict, by every layer of that dim)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.strata = [s for s in ctx.strata if s.cand is not None and s.x is not None]
        self.bias = ctx.bias

    def normalised(self, f: Factors):
        key = ("fit", f.centred, f.variance, f.eps, f.outside, f.precision, str(self.ctx.dtype))
        out = []
        for s in self.strata:
            store = s.shared if getattr(s, "shared", None) is not None else self.ctx.cache.setdefault(id(s), {})
            if key not in store:
                store[key] = normalise(s.x, f, self.ctx.dtype)
            out.append(store[key])
        return out

    def gain(self, f: Factors):
        g = self.ctx.gain
        if f.gain == "offset":
            return g + f.gain_value
        if f.gain == "scale":
            return g * f.gain_value
        if f.gain == "channel":
            return self.ctx.cache["channel_gain"]
        return g

    def outputs(self, f: Factors):
        g = self.gain(f)
        ys = []
        for n in self.normalised(f):
            y = n * g
            ys.append(y if self.bias is None else y + self.bias)
        return ys


# --- the residual check --------------------------------------------------------------------------------

def match(ctx, strata, variant_outputs, extra_rel: float = 0.0) -> float | None:
    """None unless the candidate is within MATCH_SLACK x tolerance of the variant on nearly all
    elements and nearly all failing ones; else the mean error/allowance on the failing elements
    (lower is closer). `extra_rel` widens the allowance by a relative term (the bound of a
    float32 accumulation over the row)."""
    import torch

    total = hit = bad_total = bad_hit = 0
    closeness = 0.0
    for s, v in zip(strata, variant_outputs):
        allowed = ctx.tol.atol + (ctx.tol.rtol + extra_rel) * v.abs()
        if ctx.layer.kind == "layer_norm" and ctx.tol.mean_rounding:  # as the pass/fail comparison grants
            allowed = allowed + _rounding(ctx, s)
        both_nan = torch.isnan(v) & torch.isnan(s.cand)
        err = torch.where(both_nan | (s.cand == v), torch.zeros_like(v), (s.cand - v).abs() / allowed)
        err = torch.nan_to_num(err, nan=math.inf)
        ok = err <= MATCH_SLACK
        key = ("ref_bad", id(s))
        if key not in ctx.cache:  # depends on the stratum only, not on the variant
            ref_allowed = ctx.tol.atol + ctx.tol.rtol * s.ref.abs()
            if ctx.layer.kind == "layer_norm" and ctx.tol.mean_rounding:
                ref_allowed = ref_allowed + _rounding(ctx, s)
            ctx.cache[key] = ~(((s.cand - s.ref).abs() <= ref_allowed) | (s.cand == s.ref)
                               | (torch.isnan(s.cand) & torch.isnan(s.ref)))
        ref_bad = ctx.cache[key]
        total += ok.numel()
        hit += int(ok.sum())
        bad_total += int(ref_bad.sum())
        bad_hit += int((ok & ref_bad).sum())
        closeness += float(err[ref_bad & ok].sum())
    if bad_total == 0 or hit < MATCH_SHARE * total or bad_hit < MATCH_SHARE * bad_total:
        return None
    return closeness / max(bad_hit, 1)


def _rounding(ctx, s):
    from parity_cli.comparison import mean_rounding_allowance

    key = ("rounding", id(s))
    if key not in ctx.cache:
        ctx.cache[key] = mean_rounding_allowance(s.x, ctx.gain, ctx.eps, ctx.tol)
    return ctx.cache[key]


# --- fitting the gain and eps ------------------------------------------------------------------------

def _gain_rows(panel: Panel, f: Factors):
    """(candidate - bias, N(x)) on the rows where eps does not matter: the normal stratum (else
    mixed, large), rows with q/eps > 1e4."""
    import torch

    from parity_cli.implementations import mean_square

    for name in ("normal", "mixed", "large", "outlier"):
        rows = [(s, n) for s, n in zip(panel.strata, panel.normalised(f)) if s.name == name]
        if rows:
            s, n = rows[0]
            q = mean_square(s.x, "layer_norm" if f.centred or f.variance else "rms_norm")
            keep = (q > 1e4 * max(panel.ctx.eps, 1e-30)) & torch.isfinite(s.cand).all(-1) & torch.isfinite(n).all(-1)
            if int(keep.sum()) >= 2:
                c = s.cand[keep] - (0 if panel.bias is None else panel.bias)
                return c, n[keep]
    return None


def fit_gain(panel: Panel, f: Factors):
    """Per channel, the least-squares gain candidate ~ g * N(x) on eps-blind rows, and the
    uniform scale s with candidate ~ s * expected gain * N(x)."""
    rows = _gain_rows(panel, f)
    if rows is None:
        return None
    c, n = rows
    g = (c * n).sum(0) / (n * n).sum(0).clamp_min(1e-300)
    v = n * panel.ctx.gain
    s = float((c * v).sum() / (v * v).sum().clamp_min(1e-300))
    return g, s


def estimate_eps(panel: Panel, f: Factors, gain):
    """eps from rows where it is visible (q/eps <= 100) given the gain: inside the root,
    y = x/sqrt(q + e) gives e = x^2/(y/g)^2 - q; outside, y = x/(sqrt(q) + e) gives
    e = x/(y/g) - sqrt(q). The median over usable elements, or None."""
    import torch

    samples = []
    for s in panel.strata:
        if s.name not in ("tiny", "constant"):
            continue
        x = s.x - s.x.mean(-1, keepdim=True) if f.centred else s.x
        q = (s.x - s.x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True) if f.variance \
            else x.pow(2).mean(-1, keepdim=True)
        y = (s.cand - (0 if panel.bias is None else panel.bias)) / gain
        visible = (q > 0) & (q <= 100 * max(panel.ctx.eps, 1e-30))
        usable = visible & (gain.abs() > 1e-3) & (x.abs() > 0.25 * q.sqrt()) & torch.isfinite(y) & (y != 0)
        est = (x / y - q.sqrt()) if f.outside else (x * x) / (y * y) - q
        samples.append(est[usable])
    est = torch.cat(samples) if samples else None
    if est is None or est.numel() == 0:
        return None
    lo, med, hi = (float(v) for v in torch.quantile(est, torch.tensor([0.25, 0.5, 0.75], dtype=est.dtype)))
    return med, ((hi - lo) / abs(med) if med else math.inf)


# --- the search -------------------------------------------------------------------------------------

def _complexity(f: Factors, expected: Factors) -> float:
    """How many things changed; a per-channel gain costs more than one number."""
    cost = 0.0
    cost += f.centred != expected.centred
    cost += f.variance
    cost += f.eps_label != "configured"
    cost += f.outside
    cost += f.precision != "exact"
    cost += {"expected": 0.0, "offset": 1.0, "scale": 1.1, "channel": 1.5}[f.gain]
    return cost


def candidates(ctx, panel: Panel):
    """Every combination worth trying, cheapest first."""
    import torch

    kind = ctx.layer.kind
    expected = Factors(centred=kind == "layer_norm", eps=ctx.eps)
    norms = [expected]
    if kind == "rms_norm":
        norms += [replace(expected, centred=True), replace(expected, variance=True)]
    else:
        norms += [replace(expected, centred=False)]
    precisions = ["exact"] + (["no_upcast"] if ctx.dtype.itemsize <= 2 else ["float32"])
    out = []
    for base in norms:
        fitted = fit_gain(panel, base)
        gains = [("expected", 0.0)]
        for delta in (-1.0, 1.0):
            gains.append(("offset", delta))
        if fitted is not None:
            g, s = fitted
            if math.isfinite(s) and abs(s - 1) > 1e-9:
                gains.append(("scale", s))
            if bool(torch.isfinite(g).all()):
                ctx.cache[("channel_gain", base.centred, base.variance)] = g
                gains.append(("channel", 0.0))
        for gain, value in gains:
            gf = replace(base, gain=gain, gain_value=value)
            g_used = panel.gain(_with_channel(ctx, gf))
            eps_options = [(ctx.eps, "configured"), (0.0, "zero")]
            for outside in ((False, True) if kind == "rms_norm" else (False,)):
                est = estimate_eps(panel, replace(gf, outside=outside), g_used)
                spread = 0.0
                if est is not None and est[0] > 0 and abs(est[0] - ctx.eps) > 0.05 * ctx.eps:
                    eps_options.append((est[0], "estimated"))
                    spread = est[1]
                for eps, label in eps_options:
                    if label == "zero" and (ctx.eps == 0 or outside):
                        continue
                    for precision in precisions:
                        out.append(replace(gf, eps=eps, eps_label=label, outside=outside, precision=precision,
                                           eps_spread=spread if label == "estimated" else 0.0))
                eps_options = eps_options[:2]
    out.sort(key=lambda f: _complexity(f, expected))
    return expected, out


def _with_channel(ctx, f: Factors) -> Factors:
    if f.gain == "channel":
        ctx.cache["channel_gain"] = ctx.cache[("channel_gain", f.centred, f.variance)]
    return f


def fit(ctx, max_factors: float = 3.0) -> Fit | None:
    """The simplest combination of factors that reproduces the candidate, or None."""
    panel = Panel(ctx)
    if not panel.strata:
        return None
    expected, combos = candidates(ctx, panel)
    level, best = None, None
    for f in combos:
        cost = _complexity(f, expected)
        if cost == 0:
            continue  # the reference itself explains nothing: the layer failed against it
        if cost > max_factors or (level is not None and cost > level):
            break
        _with_channel(ctx, f)
        extra = ctx.layer.dim * U32 if f.precision == "float32" else 0.0
        closeness = match(ctx, panel.strata, panel.outputs(f), extra)
        if closeness is not None and (best is None or closeness < best.closeness):
            level, best = cost, Fit(f, closeness)
    if best is not None:
        best.findings = describe(ctx, best.factors, expected)
    return best


# --- words ------------------------------------------------------------------------------------------

def describe(ctx, f: Factors, expected: Factors) -> list:
    """(code, message, evidence) for every factor the fit changed."""
    import torch

    out = []
    kind = ctx.layer.kind
    if f.eps_label == "estimated":
        out.append(("eps_mismatch",
                    f"the candidate behaves as if eps = {f.eps:.3g} where the layer's eps is {ctx.eps:.3g} "
                    f"({ctx.layer.eps.source}); inputs with q/eps near 1 show it first",
                    {"estimated_eps": f.eps, "spread": f.eps_spread, "configured_eps": ctx.eps,
                     "eps_source": ctx.layer.eps.source}))
    if f.eps_label == "zero":
        out.append(("eps_missing", "the candidate matches eps = 0: eps is dropped, so an all-zero row computes 0/0",
                    {"configured_eps": ctx.eps}))
    if f.outside:
        out.append(("eps_outside_sqrt", "the candidate computes x / (sqrt(q) + eps) instead of x / sqrt(q + eps): "
                    "eps is outside the root", {}))
    if f.centred != expected.centred:
        if kind == "rms_norm":
            out.append(("mean_subtracted", "the candidate subtracts the mean (LayerNorm semantics) where the family "
                        "uses RMSNorm", {}))
        else:
            out.append(("mean_not_subtracted", "the candidate does not subtract the mean (RMSNorm semantics) where "
                        "the family uses LayerNorm", {}))
    if f.variance:
        out.append(("variance_not_mean_square", "the candidate divides by sqrt(variance + eps) (a LayerNorm's "
                    "statistic) without centring x, where RMSNorm uses the mean square: rows with a large mean "
                    "(constant rows) show it", {}))
    if f.precision == "no_upcast":
        out.append(("reduced_precision_reduction", "the candidate squares and sums in the input dtype (no float32 "
                    "upcast): x^2 overflows on large inputs and underflows on tiny ones", {}))
    if f.precision == "float32":
        name = str(ctx.dtype).removeprefix("torch.")
        what = ("computes in float32 where float64 was asked for" if name == "float64"
                else "accumulates the mean square in float32 with a longer rounding chain (e.g. a sequential sum)")
        out.append(("float32_accumulation", f"the candidate {what}: its error grows with the row length "
                    f"({ctx.layer.dim}) up to dim x 2^-24 relative", {"dim": ctx.layer.dim}))
    if f.gain == "offset":
        from parity_cli.diagnosis import _offset_message

        ev = {"offset_error": f.gain_value, "expected_offset": ctx.layer.gain_offset}
        out.append(("weight_offset_mismatch", _offset_message(ctx, ev), ev))
    if f.gain == "scale":
        out.append(("channel_gain_mismatch", f"every channel's gain is {f.gain_value:.4g} x the expected: a uniformly "
                    "scaled weight", {"uniform_scale": f.gain_value, "affected_channels": ctx.layer.dim,
                                      "channels": _channels(ctx, ctx.gain * f.gain_value)}))
    if f.gain == "channel":
        g = ctx.cache["channel_gain"]
        slack = 4 * max(ctx.tol.rtol, 1e-6)
        bad = (g - ctx.gain).abs() > slack * ctx.gain.abs().clamp_min(1e-6) + ctx.tol.atol
        count = int(bad.sum())
        if count:
            out.append(("channel_gain_mismatch", f"the gain differs in {count} of {ctx.layer.dim} channels: a wrong, "
                        "permuted or mis-broadcast weight", {"affected_channels": count,
                                                            "channels": _channels(ctx, g, bad)}))
    del torch
    return out


def _channels(ctx, implied, mask=None):
    import torch

    idx = torch.arange(ctx.layer.dim) if mask is None else torch.nonzero(mask).flatten()
    return [{"channel": int(j), "implied": float(implied[j]), "expected": float(ctx.gain[j])} for j in idx[:10].tolist()]


def variant_name(f: Factors, expected: Factors, ctx) -> str:
    """The combined variant in a few words, for matching_variants."""
    parts = []
    if f.eps_label == "estimated":
        parts.append(f"eps~{f.eps:.3g}")
    if f.eps_label == "zero":
        parts.append("eps=0")
    if f.outside:
        parts.append("eps outside sqrt")
    if f.centred != expected.centred:
        parts.append("mean subtracted" if f.centred else "mean not subtracted")
    if f.variance:
        parts.append("variance for mean square")
    if f.precision != "exact":
        parts.append("no upcast" if f.precision == "no_upcast" else "float32 math")
    if f.gain == "offset":
        parts.append(f"gain {ctx.layer.gain_offset + f.gain_value:g} + w")
    if f.gain == "scale":
        parts.append(f"gain x {f.gain_value:.4g}")
    if f.gain == "channel":
        parts.append("fitted per-channel gain")
    return " + ".join(parts)
