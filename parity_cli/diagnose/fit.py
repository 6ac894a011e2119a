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
candidate within tolerance on (nearly) every element and on the elements that failed, and
removes most of the candidate's own deviation from the reference there: the residual check.
Landing within twice the tolerance is not enough: at the hairline (a candidate that misses by
less than that) the reference itself would pass it. There the failure is called marginal and
the variants that fit about as well are listed, none picked. Otherwise nothing is claimed."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

MATCH_SLACK = 2.0  # the variant is float64 (or the dtype's own math); the candidate rounds once more
MATCH_SHARE = 0.99
MOST = 0.5  # a variant explains a fault only if it leaves at most this share of the deviation
HAIRLINE_FACTORS = 2.0  # at the hairline, combinations of up to this many factors are listed
U32 = 2.0 ** -24
SCREEN_SAMPLE = 4096  # failing elements per stratum the screen looks at
MATCH_ROWS = 16  # rows per stratum the full residual check looks at (strided, first and last kept)
MATCH_COLS = 2048  # and channels


@dataclass(frozen=True)
class Factors:
    """One combination. Defaults are the layer's expected semantics; `changed` counts the rest."""

    centred: bool  # subtract the row mean before normalising
    variance: bool = False  # divide by sqrt(variance + eps) without centring x (a LayerNorm-as-RMSNorm)
    eps: float = 0.0
    eps_label: str = "configured"  # configured | estimated | zero
    outside: bool = False  # x / (sqrt(q) + eps)
    # exact | no_upcast (square in the dtype, mean accumulated wider: torch's half mean) | no_upcast_sum
    # (the sum of squares itself in the dtype, then / n: it overflows first, as MLX's mx.mean) | float32
    precision: str = "exact"
    gain: str = "expected"  # expected | offset | scale | channel
    gain_value: float = 0.0  # the offset, or the uniform scale
    eps_spread: float = 0.0  # of the estimate: (75th - 25th percentile) / median
    eps_interval: tuple = ()  # (25th, 75th percentile) of the per-element estimates
    eps_shared: bool = False  # an estimate remembered by the probe set: its normalised probes are shared
    eps_raw: float = 0.0  # this layer's own median, when eps is a shared estimate


@dataclass
class Fit:
    factors: Factors | None  # None: a marginal failure, no one combination picked
    closeness: float  # the share of the deviation the combination leaves (residual())
    findings: list = field(default_factory=list)  # (code, message, evidence) per changed factor
    reproduced: dict = field(default_factory=dict)  # shares of elements the combination reproduces


# --- the variant ------------------------------------------------------------------------------------

def normalise(x, f: Factors, dtype):
    """N(x) for the factors, float64 out. `exact` is float64 and overflow-safe where the
    formula allows (the scaled form of the oracle)."""
    import torch

    from parity_cli.backends.implementations import oracle_normalize

    if f.precision != "exact":
        work = dtype if f.precision.startswith("no_upcast") else torch.float32
        h = x.to(work)
        if f.centred:
            h = h - h.mean(-1, keepdim=True)
        square = (h - h.mean(-1, keepdim=True)).pow(2) if f.variance else h.pow(2)
        if f.precision == "no_upcast_sum":
            q = square.sum(-1, keepdim=True) / h.shape[-1]
        else:
            q = square.mean(-1, keepdim=True)
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
        self.originals = [s for s in ctx.strata if s.cand is not None and s.x is not None]
        merged = _merged(self.originals)
        self.strata = [merged] if merged is not None else self.originals
        self.bias = ctx.bias

    def named(self, f: Factors):
        """(stratum, its normalised rows) for every compared stratum, merged batch or not."""
        if self.strata is self.originals:
            return list(zip(self.originals, self.normalised(f)))
        (n,) = self.normalised(f)
        return [(s, n[lo:hi]) for s, (_, lo, hi) in zip(self.originals, self.strata[0].segments)]

    def normalised(self, f: Factors):
        key = ("fit", f.centred, f.variance, f.eps, f.outside, f.precision, str(self.ctx.dtype))
        out = []
        for s in self.strata:
            # the layer's own eps (or 0) is shared by every layer of this probe set; an estimate is not
            shared = getattr(s, "shared", None) is not None and (f.eps_label != "estimated" or f.eps_shared)
            store = s.shared if shared else self.ctx.cache.setdefault(id(s), {})
            if key not in store:
                store[key] = normalise(s.x, f, self.ctx.dtype)
            out.append(store[key])
        return out

    def shared_store(self):
        """The probe set's store (the first compared stratum's), or None."""
        for s in self.strata:
            if getattr(s, "shared", None) is not None:
                return s.shared
        return None

    def gain(self, f: Factors):
        g = self.ctx.gain
        if f.gain == "offset":
            return g + f.gain_value
        if f.gain == "scale":
            return g * f.gain_value
        if f.gain == "channel":
            return self.ctx.cache[("channel_gain", f.centred, f.variance)]  # set by _resolve_gain
        return g

    def sampled(self, f: Factors):
        """(stratum or its sample, the variant there) for the residual check: on a large stratum
        only the sampled elements of the variant are computed."""
        g = self.gain(f)
        out = []
        for s, n in zip(self.strata, self.normalised(f)):
            if _large(n):
                s = _sampled(self.ctx, s)
                v = _grid(n, s.rows, s.cols) * g[s.cols]
                out.append((s, v if self.bias is None else v + self.bias[s.cols]))
            else:
                v = n * g
                out.append((s, v if self.bias is None else v + self.bias))
        return out


@dataclass
class _Batch:
    """Every compared stratum of a layer as the one batch the comparison ran on: the screen and
    the residual check then take a few passes over it instead of a few per stratum, and its
    normalised variants are the probe set's, shared by every layer that has it."""

    x: object
    ref: object
    cand: object
    bad: object
    violations: int
    shared: dict
    segments: list
    name: str = "*"


def _merged(strata):
    """The strata's batch when they are all of one (layer_check sets `batch`) and cover it in
    order, else None (the per-stratum path: hand-built strata, per-head rows, captured rows)."""
    import torch

    batch = getattr(strata[0], "batch", None) if strata else None
    if batch is None or len(strata) != len(batch.segments) or any(
            getattr(s, "batch", None) is not batch or s.name != seg[0] for s, seg in zip(strata, batch.segments)):
        return None
    bad = torch.cat([s.bad if s.bad is not None else torch.zeros(s.ref.shape, dtype=torch.bool) for s in strata])
    return _Batch(batch.x, batch.ref, batch.cand, bad, sum(s.violations for s in strata), batch.store,
                  batch.segments)


# --- the residual check --------------------------------------------------------------------------------

def match(ctx, strata, variant_outputs, extra_rel: float = 0.0, extra_mean: float = 0.0) -> float | None:
    """None unless the candidate is within MATCH_SLACK x tolerance of the variant on nearly all
    elements and nearly all failing ones, and the variant removes most of the deviation there
    (residual()); else that residual share (lower is closer). `extra_rel` widens the allowance
    by a relative term (the bound of a float32 accumulation over the row), `extra_mean` by that
    share of a LayerNorm row's conditioning (the bound of a float32 mean)."""
    parts = []
    for s, v in zip(strata, variant_outputs):
        if _large(v):
            s = _sampled(ctx, s)  # the screen saw the failing elements; here a strided sample will do
            v = _grid(v, s.rows, s.cols)
        parts.append((s, v))
    return _match(ctx, parts, extra_rel, extra_mean)


def _distance(a, b):
    """|a - b|, 0 where they agree (inf == inf, NaN on both sides), inf where only one is finite."""
    import torch

    d = (a - b).abs_()
    if not bool(torch.isfinite(d).all()):
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        d = torch.where(same, torch.zeros_like(d), d).nan_to_num_(nan=math.inf)
    return d


def residual(cand, ref, v, bound=None):
    """Per failing element, how much of the candidate's own deviation from the reference the
    variant leaves: |cand - v| / |cand - ref| (less the variant's own rounding bound, which a
    precision variant cannot reproduce element by element, only bound), capped at 2. 0: the
    variant is the candidate; 1: it is no closer than the reference."""
    import torch

    r = _distance(cand, v)
    if bound is not None:
        r = (r - bound).clamp_(min=0.0)
    d = _distance(cand, ref)
    inf = torch.isinf(d)
    rho = r / d.clamp_min(1e-300)
    if bool(inf.any()):  # a non-finite deviation is removed only by a variant that has it too
        rho = torch.where(inf, torch.where(torch.isinf(r), torch.ones_like(r), torch.zeros_like(r)), rho)
    return rho.nan_to_num_(nan=1.0).clamp_(max=2.0)


def _match(ctx, parts, extra_rel: float, extra_mean: float = 0.0, f: Factors | None = None) -> float | None:
    """match() on (stratum or its sample, the variant there) pairs."""
    import torch

    total = hit = bad_total = bad_hit = 0
    removed = 0.0
    layer_norm = ctx.layer.kind == "layer_norm"
    if f is None and extra_mean:
        f = Factors(centred=layer_norm, eps=ctx.eps)
    for s, v in parts:
        bound = _bound(ctx, s, f, v, extra_rel, extra_mean)
        allowed = v.abs().mul_(ctx.tol.rtol).add_(ctx.tol.atol)
        if bound is not None:
            allowed.add_(bound)
        if layer_norm and ctx.tol.mean_rounding:  # as the pass/fail comparison grants
            allowed.add_(_rounding(ctx, s))
        err = (s.cand - v).abs_().div_(allowed)
        if not bool(torch.isfinite(err).all()):
            # NaN or inf somewhere: equal values (inf == inf) and NaN on both sides are agreement
            same = (s.cand == v) | (torch.isnan(v) & torch.isnan(s.cand))
            err = torch.where(same, torch.zeros_like(v), err).nan_to_num_(nan=math.inf)
        ok = err <= MATCH_SLACK
        key = ("ref_bad", id(s))
        if key not in ctx.cache:  # depends on the stratum only, not on the variant
            ctx.cache[key] = (_bad(ctx, s), int(_bad(ctx, s).sum()))
        ref_bad, n_bad = ctx.cache[key]
        total += ok.numel()
        hit += int(ok.sum())
        bad_total += n_bad
        if n_bad:
            bad_hit += int((ok & ref_bad).sum())
            removed += float(residual(s.cand[ref_bad], s.ref[ref_bad], v[ref_bad],
                                      None if bound is None else bound[ref_bad]).sum())
    if bad_total == 0 or hit < MATCH_SHARE * total or bad_hit < MATCH_SHARE * bad_total:
        return None
    left = removed / bad_total
    if left > MOST:  # within the slack, but no closer to the candidate than the reference is
        return None
    ctx.cache["reproduced"] = {"failing_elements": bad_hit / bad_total, "elements": hit / total,
                               "within": f"{MATCH_SLACK:g} x tolerance", "deviation_left": left}
    return left


@dataclass
class _Rows:
    """A stratum's strided sample of rows and channels, with what the residual check reads
    (x keeps whole rows: the LayerNorm allowance needs the row's statistics)."""

    source: object  # the stratum or batch sampled (x is read from it only when needed)
    ref: object
    cand: object
    rows: object
    cols: object = None
    bad: object = None  # the comparison's mask, sampled
    violations: int = 0

    @property
    def x(self):
        return self.source.x[self.rows]


def _large(t) -> bool:
    """Whether the residual check reads a strided sample of this stratum rather than all of it."""
    return t.shape[0] > MATCH_ROWS or t.shape[-1] > MATCH_COLS


def _grid(t, rows, cols):
    """t[rows][:, cols]; when the sample keeps every row (strata of at most MATCH_ROWS rows),
    one gather of columns instead of a gather of (row, column) pairs."""
    if rows.numel() == t.shape[0]:  # rows are sorted and distinct: all of them, in order
        return t.index_select(1, cols)
    return t[rows[:, None], cols]


@functools.lru_cache(maxsize=256)
def _strided_rows(lo: int, hi: int, count: int):
    """About `count` rows of [lo, hi), strided, the first and the last kept."""
    import torch

    n = hi - lo
    rows = torch.unique(torch.cat([torch.arange(0, n, n // count + 1), torch.tensor([max(n - 1, 0)])]))
    return rows[rows < n] + lo


def _sampled(ctx, s, count: int = 0):
    import torch

    count = count or MATCH_ROWS
    key = ("sample", id(s), count)
    if key not in ctx.cache:
        n, d = s.x.shape
        rows = torch.cat([_strided_rows(lo, hi, count) for _, lo, hi in getattr(s, "segments", None) or [("", 0, n)]])
        cols = torch.arange(0, d, d // MATCH_COLS + 1) if d > MATCH_COLS else torch.arange(d)
        if d > MATCH_COLS:  # the channels that failed are always in the sample, whichever they are
            failed_cols = torch.nonzero(_bad(ctx, s).any(0)).flatten()  # sorted, each once
            if failed_cols.numel() > MATCH_COLS:
                failed_cols = failed_cols[:: failed_cols.numel() // MATCH_COLS + 1]
            keep = torch.zeros(d, dtype=torch.bool)
            keep[cols] = True
            keep[failed_cols] = True
            cols = torch.nonzero(keep).flatten()
        ctx.cache[key] = _Rows(s, _grid(s.ref, rows, cols), _grid(s.cand, rows, cols), rows, cols,
                               _grid(_bad(ctx, s), rows, cols), s.violations)
    return ctx.cache[key]


def _failing(ctx, s):
    """(row, column) indices of the elements that failed against the reference, with the
    candidate's values there: the screen looks only at these."""
    import torch

    key = ("failing", id(s))
    if key not in ctx.cache and not s.violations:  # nothing failed here: nothing to screen
        empty = torch.zeros(0, dtype=torch.long)
        ctx.cache[key] = (empty, empty, s.cand.new_zeros(0), 0.0)
    if key not in ctx.cache:
        bad = _bad(ctx, s)
        cap = SCREEN_SAMPLE * min(2, len(getattr(s, "segments", None) or [s]))
        # a stride over the failing elements themselves: a stride over positions could line up
        # with the row length and miss every failing channel (odd channels, dim 4096, step 8)
        flat = torch.nonzero(bad.reshape(-1)).flatten()
        if flat.numel() > cap:
            flat = flat[:: flat.numel() // cap + 1]
        rows, cols = flat // bad.shape[-1], flat % bad.shape[-1]
        extra = _rounding(ctx, s)[rows, cols] if ctx.layer.kind == "layer_norm" and ctx.tol.mean_rounding else 0.0
        ctx.cache[key] = (rows, cols, s.cand[rows, cols], extra)
    return ctx.cache[key]


def _bad(ctx, s):
    """The elements outside tolerance against the reference: the comparison's own mask when it
    kept one (it computed exactly this), else computed here."""
    import torch

    bad = getattr(s, "bad", None)
    if bad is not None:
        return bad
    if not s.violations:
        return torch.zeros(s.ref.shape, dtype=torch.bool)
    allowed = ctx.tol.atol + ctx.tol.rtol * s.ref.abs()
    if ctx.layer.kind == "layer_norm" and ctx.tol.mean_rounding:
        allowed = allowed + _rounding(ctx, s)
    return ~(((s.cand - s.ref).abs() <= allowed) | (s.cand == s.ref) | (torch.isnan(s.cand) & torch.isnan(s.ref)))


def screen(ctx, panel: Panel, f: Factors, extra_rel: float, extra_mean: float = 0.0) -> float | None:
    """The cheap half of the residual check: does the variant reproduce the failing elements,
    and remove most of their deviation from the reference? The share it leaves (residual()),
    or None. Most combinations fail here, without a pass over every element."""
    import torch

    g = panel.gain(f)
    bad_total = bad_hit = 0
    seen = []
    for s, n in zip(panel.strata, panel.normalised(f)):
        rows, cols, cand, extra = _failing(ctx, s)
        if rows.numel() == 0:
            continue
        v = n.reshape(-1).index_select(0, rows * n.shape[-1] + cols).mul_(g.index_select(0, cols))
        if panel.bias is not None:
            v.add_(panel.bias.index_select(0, cols))
        bound = _bound(ctx, s, f, v, extra_rel, extra_mean, rows, cols)
        allowed = v.abs().mul_(ctx.tol.rtol).add_(ctx.tol.atol).add_(extra)
        if bound is not None:
            allowed.add_(bound)
        allowed.mul_(MATCH_SLACK)
        ok = (cand - v).abs_() <= allowed
        if not (bool(torch.isfinite(v).all()) and _all_finite(ctx, cand)):
            ok |= (cand == v) | (torch.isnan(cand) & torch.isnan(v))  # inf == inf, NaN on both sides
        bad_total += ok.numel()
        bad_hit += int(ok.sum())
        seen.append((s, cand, v, bound))
    if bad_total == 0 or bad_hit < MATCH_SHARE * bad_total:
        return None
    left = sum(float(residual(cand, _failing_ref(ctx, s), v, bound).sum()) for s, cand, v, bound in seen)
    return None if left > MOST * bad_total else left / bad_total


def _failing_ref(ctx, s):
    """The reference at the elements _failing() picked."""
    key = ("failing_ref", id(s))
    if key not in ctx.cache:
        rows, cols, _, _ = _failing(ctx, s)
        ctx.cache[key] = s.ref[rows, cols]
    return ctx.cache[key]


def _all_finite(ctx, t) -> bool:
    """Once per tensor of the layer (the candidate's failing values are screened many times)."""
    import torch

    key = ("finite", id(t))
    if key not in ctx.cache:
        ctx.cache[key] = (t, bool(torch.isfinite(t).all()))  # t kept: its id stays its own
    return ctx.cache[key][1]


def _rounding(ctx, s):
    key = ("rounding", id(s))
    if key not in ctx.cache:
        ctx.cache[key] = _conditioning(ctx, s) * ctx.tol.mean_rounding
    return ctx.cache[key]


def _conditioning(ctx, s, eps: float | None = None, outside: bool = False, rows=None, cols=None):
    """Per element of a LayerNorm (at rows, cols of s when given), |g| max|x| / sqrt(var + eps)
    (outside the root: / (std + eps)): what a relative rounding of the row's mean becomes in the
    output (configs/tolerances.toml, mean_rounding). `eps` defaults to the layer's."""
    import torch

    eps = ctx.eps if eps is None else eps
    peak, var = _row_stats(ctx, s)
    per_row = peak / (var.sqrt() + eps if outside else (var + eps).sqrt()).clamp_min(1e-300)
    g = ctx.gain.to(torch.float64).abs()
    if rows is not None:
        return g[cols] * per_row[rows, 0]
    key = ("conditioning", id(s), eps, outside)
    if key not in ctx.cache:
        sampled = getattr(s, "cols", None)
        ctx.cache[key] = (g if sampled is None else g[sampled]) * per_row
    return ctx.cache[key]


def _row_stats(ctx, s):
    """(max |x|, variance) per row of s: the probes' own, so every layer shares them (a sample's
    rows are its source's)."""
    import torch

    if isinstance(s, _Rows):
        peak, var = _row_stats(ctx, s.source)
        return peak[s.rows], var[s.rows]
    store = getattr(s, "shared", None)
    store, key = (ctx.cache, ("row_stats", id(s))) if store is None else (store, ("row_stats",))
    if key not in store:
        x = s.x.to(torch.float64)
        store[key] = (x.abs().amax(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True))
    return store[key]


def _bound(ctx, s, f: Factors | None, v, extra_rel: float, extra_mean: float, rows=None, cols=None):
    """What the variant is allowed beyond the tolerance, per element (at rows, cols of s when
    given), or None: its own rounding (extra_rel of |v|, extra_mean of a LayerNorm row's
    conditioning), and for a LayerNorm variant whose eps or placement conditions x - mean worse
    than the expected math, the mean-rounding allowance of its own formula beyond the reference's."""
    bound = v.abs().mul_(extra_rel) if extra_rel else None
    if ctx.layer.kind != "layer_norm" or f is None:
        return bound

    eps = f.eps if f.eps > 0 else ctx.eps
    own = None
    if extra_mean:
        own = _conditioning(ctx, s, eps, f.outside, rows, cols) * extra_mean
    if ctx.tol.mean_rounding and (f.outside or eps != ctx.eps):
        more = (_conditioning(ctx, s, eps, f.outside, rows, cols) - _conditioning(ctx, s, rows=rows, cols=cols))
        more = more.clamp_(min=0.0) * ctx.tol.mean_rounding
        own = more if own is None else own + more
    if own is None:
        return bound
    return own if bound is None else bound.add_(own)


# --- fitting the gain and eps ------------------------------------------------------------------------

def _gain_rows(panel: Panel, f: Factors):
    """(candidate - bias, N(x)) on the rows where eps does not matter: the normal stratum (else
    mixed, large), rows with q/eps > 1e4."""
    import torch

    from parity_cli.backends.implementations import mean_square

    named = panel.named(f)
    for name in ("normal", "mixed", "large", "outlier"):
        rows = [(s, n) for s, n in named if s.name == name]
        if rows:
            s, n = rows[0]
            # which rows: a property of the probes alone, so every layer of the probe set shares it
            key = ("gain_rows", f.centred or f.variance, panel.ctx.eps)
            store = s.shared if getattr(s, "shared", None) is not None else panel.ctx.cache
            if key not in store:
                q = mean_square(s.x, "layer_norm" if f.centred or f.variance else "rms_norm")
                idx = torch.nonzero(q > 1e4 * max(panel.ctx.eps, 1e-30)).flatten()
                store[key] = idx[:: idx.numel() // MATCH_ROWS + 1] if idx.numel() > MATCH_ROWS else idx
            idx = store[key]
            c = s.cand[idx] - (0 if panel.bias is None else panel.bias)
            nn = n[idx]
            finite = torch.isfinite(c).all(-1) & torch.isfinite(nn).all(-1)
            if int(finite.sum()) >= 2:
                return c[finite], nn[finite]
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


EPS_STRATA = ("tiny", "constant", "cancellation")  # where q/eps is small: the fused add's x = -residual + tiny too
EPS_COLS = 2048  # channels per row the eps estimate reads (strided): its quartiles are the same to a
# percent or so, and a failing layer costs a fraction of what it did (BENCHMARKS.md, issue 18)


def estimate_eps(panel: Panel, f: Factors, gain):
    """eps from rows where it is visible (q/eps <= 100) given the gain: inside the root,
    y = x/sqrt(q + e) gives e = x^2/(y/g)^2 - q; outside, y = x/(sqrt(q) + e) gives
    e = x/(y/g) - sqrt(q). The median over usable elements, or None. q is the whole row's
    (shared by every layer of the probe set); the elements are a strided sample of channels."""
    import torch

    from parity_cli.backends.implementations import mean_square

    samples = []
    for s in panel.originals:
        if s.name not in EPS_STRATA:
            continue
        d = s.x.shape[-1]
        cols = slice(None) if d <= EPS_COLS else slice(0, d, -(-d // EPS_COLS))
        store = s.shared if getattr(s, "shared", None) is not None else panel.ctx.cache.setdefault(id(s), {})
        key = ("eps_rows", f.centred, f.variance, d)
        if key not in store:
            mean = s.x.mean(-1, keepdim=True)
            q = mean_square(s.x, "layer_norm" if f.variance or f.centred else "rms_norm").unsqueeze(-1)
            x = (s.x - mean if f.centred else s.x)[:, cols]
            store[key] = (x, q, x.abs() > 0.25 * q.sqrt())
        x, q, large = store[key]
        g = gain[cols]
        y = (s.cand[:, cols] - (0 if panel.bias is None else panel.bias[cols])) / g
        visible = (q > 0) & (q <= 100 * max(panel.ctx.eps, 1e-30))
        usable = visible & (g.abs() > 1e-3) & large & torch.isfinite(y) & (y != 0)
        est = (x / y - q.sqrt()) if f.outside else (x * x) / (y * y) - q
        samples.append(est[usable])
    est = torch.cat(samples) if samples else None
    if est is None or est.numel() == 0:
        return None
    if est.numel() > 4096:  # quartiles of a strided sample: the same to a few percent, 100x cheaper
        est = est[:: est.numel() // 4096 + 1]
    lo, med, hi = (float(v) for v in torch.quantile(est, torch.tensor([0.25, 0.5, 0.75], dtype=est.dtype)))
    return med, ((hi - lo) / abs(med) if med else math.inf), lo, hi


# --- the search -------------------------------------------------------------------------------------

def _complexity(f: Factors, expected: Factors) -> float:
    """How many things changed; a per-channel gain costs more than one number."""
    cost = 0.0
    cost += f.centred != expected.centred
    cost += f.variance
    cost += f.eps_label != "configured"
    cost += f.outside
    cost += (f.precision != "exact") + 0.05 * (f.precision == "no_upcast_sum")  # the plainer of two that fit
    cost += {"expected": 0.0, "offset": 1.0, "scale": 1.1, "channel": 1.5}[f.gain]
    return cost


def candidates(ctx, panel: Panel):
    """Every combination worth trying, cheapest first (fitted values are resolved lazily)."""
    return _combinations(ctx.layer.kind, ctx.eps, ctx.dtype.itemsize)


@functools.lru_cache(maxsize=32)
def _combinations(kind: str, eps: float, itemsize: int):
    """The same list for every layer of a kind, eps and dtype width: built once."""
    expected = Factors(centred=kind == "layer_norm", eps=eps)
    norms = [expected]
    if kind == "rms_norm":
        norms += [replace(expected, centred=True), replace(expected, variance=True)]
    else:
        norms += [replace(expected, centred=False)]
    precisions = ["exact"] + (["no_upcast", "no_upcast_sum"] if itemsize <= 2 else ["float32"])
    out = []
    for base in norms:
        # scale and channel gains are fitted only if a combination with them is reached
        gains = [("expected", 0.0), ("offset", -1.0), ("offset", 1.0), ("scale", None), ("channel", 0.0)]
        for gain, value in gains:
            gf = replace(base, gain=gain, gain_value=value)
            for outside in (False, True):  # (x - mean) / (std + eps) too: OpenVINO's MVN outside_sqrt
                for value, label in ((eps, "configured"), (0.0, "zero"), (None, "estimated")):
                    if label == "zero" and (eps == 0 or outside):
                        continue
                    for precision in precisions:
                        out.append(replace(gf, eps=value, eps_label=label, outside=outside, precision=precision))
    out.sort(key=lambda f: _complexity(f, expected))
    return expected, tuple(out)


def _resolve_gain(ctx, panel: Panel, f: Factors) -> Factors | None:
    """Fits the gain of the combination's normalisation (once per layer and normalisation);
    None when the fit is impossible or says nothing new."""
    import torch

    if f.gain not in ("scale", "channel"):
        return f
    key = ("gain_fit", f.centred, f.variance)
    if key not in ctx.cache:
        fitted = fit_gain(panel, replace(f, gain="expected"))
        ctx.cache[key] = fitted
        if fitted is not None and bool(torch.isfinite(fitted[0]).all()):
            ctx.cache[("channel_gain", f.centred, f.variance)] = fitted[0]
    fitted = ctx.cache[key]
    if fitted is None:
        return None
    if f.gain == "scale":
        s = fitted[1]
        return replace(f, gain_value=s) if math.isfinite(s) and abs(s - 1) > _rounding_of_one(ctx.dtype) else None
    return f if ("channel_gain", f.centred, f.variance) in ctx.cache else None


def _resolve_eps(ctx, panel: Panel, f: Factors) -> Factors | None:
    """An "estimated" combination gets its eps now (once per normalisation, gain and placement),
    or is dropped when no estimate differs from the configured eps."""
    if f.eps_label != "estimated":
        return f
    key = ("eps_estimate", f.centred, f.variance, f.outside, f.gain, f.gain_value)
    if key not in ctx.cache:
        est = estimate_eps(panel, f, panel.gain(f))
        ok = est is not None and est[0] > 0 and abs(est[0] - ctx.eps) > 0.05 * ctx.eps
        ctx.cache[key] = _snapped(panel, key, est) if ok else None
    est = ctx.cache[key]
    return None if est is None else replace(f, eps=est[0], eps_spread=est[1], eps_interval=(est[2], est[3]),
                                            eps_shared=est[4], eps_raw=est[5])


SHARED_ESTIMATES = 2  # estimated eps values whose normalisations a probe set keeps for every layer


def _snapped(panel: Panel, key, est):
    """The estimate said with the fewest significant digits that stay inside its interquartile
    range (the data cannot tell them apart): 1.0001e-6 with quartiles 0.99e-6..1.01e-6 is 1e-6.
    It depends on this layer alone, so the figures are the same whatever order or worker the
    layers run in, and layers that fail the same way land on the same value: its normalised
    probes are then computed once for all of them. The residual check tests it on each layer,
    and falls back to the median when it does not fit."""
    med, spread, lo, hi = est
    value = med
    for digits in range(1, 17):
        rounded = float(f"{med:.{digits - 1}e}")
        if lo <= rounded <= hi:
            value = rounded
            break
    store = panel.shared_store()
    shared = False
    if store is not None:
        seen = store.setdefault(("eps_estimates",), set())  # one budget per probe set: each is a batch
        if value in seen or len(seen) < SHARED_ESTIMATES:
            seen.add(value)
            shared = True
    return value, spread, lo, hi, shared, med


def _try(ctx, panel: Panel, f: Factors) -> float | None:
    """The residual check of one combination: the screen on the failing elements, then match.
    float32 math is allowed its rounding bound over the row: dim x 2^-24 of the output, and of
    a LayerNorm row's conditioning (its mean rounds too: sum / n of a constant row is not x)."""
    extra = ctx.layer.dim * U32 if f.precision == "float32" else 0.0
    left = screen(ctx, panel, f, extra, extra)
    if left is None or _match(ctx, panel.sampled(f), extra, extra, f) is None:
        return None
    return left


def _rounding_of_one(dtype) -> float:
    """How far from 1 a uniform gain scale can be by float rounding alone: an ulp of the
    candidate dtype at 1, and never less than float32's (float32 math handed back at float64)."""
    import torch

    return max(float(torch.finfo(dtype).eps), 2.0 ** -23)


def margin(ctx, panel: Panel) -> float:
    """How many times the allowance the candidate misses by: the largest |cand - ref| / allowed
    over the failing elements (each stratum's worst, or the screen's sample when it has none)."""
    worst = 0.0
    for s in panel.originals:
        if not s.violations:
            continue
        w = getattr(s, "worst", None)
        if w is not None and w.allowed > 0:
            d = abs(w.candidate - w.reference)
            worst = max(worst, d / w.allowed if math.isfinite(d) else math.inf)
            continue
        rows, cols, cand, extra = _failing(ctx, s)
        ref = s.ref[rows, cols]
        allowed = ref.abs() * ctx.tol.rtol + ctx.tol.atol + extra
        ratio = _distance(cand, ref) / allowed.clamp_min(1e-300)
        worst = max(worst, float(ratio.max()) if ratio.numel() else 0.0)
    return worst


def _search(ctx, panel: Panel, expected: Factors, combos, max_factors: float, every: bool):
    """(combination, residual share, reproduced) for the simplest combinations that pass the
    residual check, the closest first; with `every`, all of them up to max_factors."""
    level, found = None, []
    for f in combos:
        cost = _complexity(f, expected)
        if cost == 0:
            continue  # the reference itself explains nothing: the layer failed against it
        if cost > max_factors or (not every and level is not None and cost > level):
            break
        f = _resolve_gain(ctx, panel, f)
        f = None if f is None else _resolve_eps(ctx, panel, f)
        if f is None:
            continue
        closeness = _try(ctx, panel, f)
        if closeness is None and f.eps_label == "estimated" and f.eps != f.eps_raw:  # the short value does not fit
            f = replace(f, eps=f.eps_raw, eps_shared=False)
            closeness = _try(ctx, panel, f)
        if closeness is not None:
            level = cost if level is None else level
            found.append((f, closeness, dict(ctx.cache["reproduced"])))
    found.sort(key=lambda t: t[1])  # stable: among equals, the simplest
    return found


def fit(ctx, max_factors: float = 3.0) -> Fit | None:
    """The simplest combination of factors that reproduces the candidate (of those, the one
    that leaves the least of the deviation), a marginal Fit at the hairline, or None."""
    panel = Panel(ctx)
    if not panel.strata:
        return None
    expected, combos = candidates(ctx, panel)
    missed_by = margin(ctx, panel)
    if missed_by <= MATCH_SLACK:  # the reference itself is within the slack: the hairline
        return _marginal(ctx, panel, expected, combos, missed_by)
    found = _search(ctx, panel, expected, combos, max_factors, every=False)
    best = None
    if found:
        f, closeness, reproduced = found[0]
        best = Fit(f, closeness, reproduced=reproduced)
    if best is not None:
        best.findings = describe(ctx, best.factors, expected)
        for _, _, evidence in best.findings:  # how well the whole combination reproduces the candidate
            evidence["reproduced"] = best.reproduced
    return best


def _marginal(ctx, panel: Panel, expected: Factors, combos, missed_by: float) -> Fit:
    """A candidate that misses by less than the matching slack: every variant close to the
    reference lands within it, so none is picked. The variants (of up to HAIRLINE_FACTORS
    factors) that remove most of the deviation and fit about as well as the best are listed."""
    # a gain off by 1 moves every output by about its own size: never a candidate at the hairline
    combos = [f for f in combos if f.gain != "offset"]
    found = [(f, left) for f, left, _ in _search(ctx, panel, expected, combos, HAIRLINE_FACTORS, every=True)
             if describe(ctx, f, expected)]  # a fitted gain that differs in no channel says nothing
    fits = []
    for f, left in found:
        if left > max(2 * found[0][1], found[0][1] + 0.1):
            break  # clearly worse than the best (found is sorted)
        name = variant_name(f, expected, ctx)
        if name not in (n for n, _ in fits):
            fits.append((name, left))
    fits = fits[:6]
    names = ", ".join(n for n, _ in fits)
    message = (f"the candidate misses by at most {missed_by:.3g} x the allowance: a marginal failure, too close to "
               "the tolerance to name a cause; " + (f"variants that fit about as well: {names}" if fits else
                                                     "no known variant removes most of the deviation"))
    evidence = {"times_allowance": missed_by, "variants": [{"variant": n, "deviation_left": left} for n, left in fits],
                "matching_variants": [n for n, _ in fits]}
    return Fit(None, fits[0][1] if fits else 1.0, findings=[("marginal", message, evidence)])


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
                    {"estimated_eps": f.eps, "spread": f.eps_spread, "interval": list(f.eps_interval),
                     "configured_eps": ctx.eps,
                     "eps_source": ctx.layer.eps.source}))
    lost = eps_lost(ctx.eps, ctx.dtype)
    if f.eps_label == "zero" or (f.precision.startswith("no_upcast") and f.eps_label == "configured" and lost):
        out.append(("eps_missing", "the candidate matches eps = 0: " + (lost or "eps is dropped") +
                    ", so an all-zero row computes 0/0", {"configured_eps": ctx.eps, "lost_to_dtype": bool(lost),
                                                           "dtype": str(ctx.dtype).removeprefix("torch.")}))
    if f.outside:
        what = ("(x - mean) / (std + eps) instead of (x - mean) / sqrt(var + eps)" if f.centred
                else "x / (sqrt(q) + eps) instead of x / sqrt(q + eps)")
        out.append(("eps_outside_sqrt", f"the candidate computes {what}: eps is outside the root", {}))
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
    if f.precision == "no_upcast_sum":
        out.append(("reduced_precision_reduction", "the candidate squares and sums in the input dtype (no float32 "
                    "upcast), the sum itself held in that dtype before dividing: it overflows once n x^2 passes the "
                    "dtype's range, and squares underflow on tiny inputs", {"sum_in_dtype": True}))
    if f.precision == "no_upcast":
        out.append(("reduced_precision_reduction", "the candidate squares and sums in the input dtype (no float32 "
                    "upcast): x^2 overflows on large inputs and underflows on tiny ones", {}))
    if f.precision == "float32":
        name = str(ctx.dtype).removeprefix("torch.")
        what = ("computes in float32 where float64 was asked for" if name == "float64"
                else "accumulates the mean and variance in float32 with a longer rounding chain (e.g. mean as "
                "sum / n): on rows whose spread is small next to their mean (constant rows) x - mean is that "
                "rounding, which eps cannot absorb" + ("; eps itself is right" if f.eps_label == "configured" else "")
                if kind == "layer_norm"
                else "accumulates the mean square in float32 with a longer rounding chain (e.g. a sequential sum)")
        out.append(("float32_accumulation", f"the candidate {what}: its error grows with the row length "
                    f"({ctx.layer.dim}) up to dim x 2^-24 relative", {"dim": ctx.layer.dim}))
    if f.gain == "offset":
        ev = {"offset_error": f.gain_value, "expected_offset": ctx.layer.gain_offset}
        out.append(("weight_offset_mismatch", _offset_message(ctx, ev), ev))
    if f.gain == "scale":
        out.append(("channel_gain_mismatch", f"every channel's gain is {_scale(f.gain_value)} x the expected: "
                    + "a uniformly scaled weight", {"uniform_scale": f.gain_value, "affected_channels": ctx.layer.dim,
                                      "channels": _channels(ctx, ctx.gain * f.gain_value)}))
    if f.gain == "channel":
        g = ctx.cache[("channel_gain", f.centred, f.variance)]  # this combination's fit, not the last one tried
        slack = 4 * max(ctx.tol.rtol, 1e-6)
        bad = (g - ctx.gain).abs() > slack * ctx.gain.abs().clamp_min(1e-6) + ctx.tol.atol
        count = int(bad.sum())
        if count:
            out.append(("channel_gain_mismatch", f"the gain differs in {count} of {ctx.layer.dim} channels: a wrong, "
                        "permuted or mis-broadcast weight", {"affected_channels": count,
                                                            "channels": _channels(ctx, g, bad)}))
    del torch
    return out


def eps_lost(eps: float, dtype) -> str:
    """Words when eps held in the candidate dtype is 0 (1e-12 in float16), else ''."""
    import torch

    if eps <= 0 or not dtype.is_floating_point or float(torch.tensor(eps, dtype=dtype)) != 0:
        return ""
    return f"eps {eps:g} is 0 in {str(dtype).removeprefix('torch.')} (lost to the dtype)"


def _scale(value: float) -> str:
    """A scale with the digits that tell it from 1 (1.0000003, not 1)."""
    for digits in range(4, 17):
        text = f"{value:.{digits}g}"
        if float(text) != 1:
            return text
    return repr(value)


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
        parts.append({"no_upcast": "no upcast", "no_upcast_sum": "no upcast, sum in the dtype"}.get(f.precision,
                                                                                               "float32 math"))
    if f.gain == "offset":
        parts.append(f"gain {ctx.layer.gain_offset + f.gain_value:g} + w")
    if f.gain == "scale":
        parts.append(f"gain x {_scale(f.gain_value)}")
    if f.gain == "channel":
        parts.append("fitted per-channel gain")
    return " + ".join(parts)


def _offset_message(ctx, ev):
    delta, expected = ev["offset_error"], ev["expected_offset"]
    baked = ctx.layer.semantic_offset or 0.0
    if baked and not expected:  # a converted file (GGUF Gemma) that stores the family's 1 + w itself
        ev["stored_gain"] = f"{baked:g} + w"
        if delta > 0:
            return (f"every channel's gain is off by {delta:+g}: this file already stores {baked:g} + w (the "
                    f"converter baked the family's +{baked:g} in), and the candidate adds {delta:g} again")
        return (f"every channel's gain is off by {delta:+g}: this file stores {baked:g} + w, and the candidate "
                f"takes {-delta:g} away")
    if delta < 0:
        what = "the +1 is missing: gain w where the family uses 1 + w" if expected else "the gain is w - 1"
    else:
        what = "the +1 is applied twice: gain 2 + w" if expected else "a +1 is added that this family does not use: gain 1 + w"
    return f"every channel's gain is off by {delta:+g}: {what}"
