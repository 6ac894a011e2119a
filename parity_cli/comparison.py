"""Stage 5: reference vs candidate -> a result per stratum, every violation counted.

Tolerances are a plain table (configs/tolerances.toml) keyed by candidate dtype; results are
values that know whether they passed; turning them into words is the report stage's job (parity_cli.report)."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from parity_cli.errors import InputError
from parity_cli.resources import configs_dir, load_toml

ZERO_REFERENCE_RULE = (
    "relative error is computed only where the reference is nonzero; where it is zero the "
    "element is judged by atol alone"
)


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    source: str  # "profile:float16", "option", ...
    mean_rounding: float = 0.0  # LayerNorm conditioning allowance (configs/tolerances.toml)
    row_atol: float = 0.0  # gradients: atol as a share of the row's largest reference value


def tolerance_for(dtype_name: str, atol: float | None = None, rtol: float | None = None,
                  exact: bool = False) -> Tolerance:
    """The dtype's profile, overridden by --atol/--rtol; `exact` is bitwise (no allowance at all)."""
    if exact:
        return Tolerance(0.0, 0.0, "exact")
    path = configs_dir() / "tolerances.toml"
    table = load_toml(path)
    if dtype_name not in table:
        if atol is None or rtol is None:
            raise InputError(f"{path}: no tolerance profile for dtype {dtype_name}; pass --atol and --rtol")
        profile = {}
    else:
        profile = table[dtype_name]
    source = f"profile:{dtype_name}" if atol is None and rtol is None else (
        "option" if atol is not None and rtol is not None else f"option+profile:{dtype_name}"
    )
    return Tolerance(
        atol=float(profile["atol"] if atol is None else atol),
        rtol=float(profile["rtol"] if rtol is None else rtol),
        source=source,
        mean_rounding=float(profile.get("mean_rounding", 0.0)),
    )


@dataclass
class Worst:
    """The element furthest outside (or closest to) its tolerance."""

    vector: int
    index: int
    input: float
    reference: float
    candidate: float
    allowed: float


@dataclass
class StratumResult:
    name: str
    status: str  # "pass" | "fail" | "error"
    vectors: int
    q_over_eps: tuple[float, float]
    attenuation: tuple[float, float]
    elements: int = 0
    violations: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    nonfinite_reference: int = 0
    nonfinite_candidate: int = 0
    max_ulp: float | None = None  # largest difference in units in the last place of the candidate dtype
    failing_q_over_eps: tuple[float, float] | None = None  # q/eps range of the rows with a violation
    shared: dict | None = field(default=None, repr=False)  # the probe set's cache (diagnosis variants)
    worst: Worst | None = None
    error: str | None = None
    # Kept for diagnosis, not serialised: float64 input, reference and candidate outputs.
    x: object = field(default=None, repr=False)
    ref: object = field(default=None, repr=False)
    cand: object = field(default=None, repr=False)
    bad: object = field(default=None, repr=False)  # bool (vectors, dim): the elements outside tolerance
    batch: object = field(default=None, repr=False)  # the layer's batch this stratum's rows are part of
    # Per probe row, for --plot (small; kept after the tensors are dropped): q/eps, and the
    # row's largest |cand - ref| over its largest |ref| (inf where the candidate is non-finite).
    row_q_over_eps: list = field(default=None, repr=False)
    row_error: list = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def violation_fraction(self) -> float:
        return self.violations / self.elements if self.elements else 0.0


def q_over_eps_stats(x, eps: float, kind: str, q=None):
    """(min, max) of q/eps and of the attenuation A = sqrt(q / (q + eps)) over the rows.

    A zero row has q/eps = 0 and A = 0 (its output is zero); with eps = 0 every nonzero row
    has q/eps = inf and A = 1."""
    from parity_cli.backends.implementations import mean_square

    if q is None:
        q = mean_square(x, kind)
    lo, hi = float(q.min()), float(q.max())
    ratios = [0.0 if v == 0 else (v / eps if eps > 0 else math.inf) for v in (lo, hi)]
    return (ratios[0], ratios[1]), (attenuation(ratios[0]), attenuation(ratios[1]))


def attenuation(q_over_eps: float) -> float:
    """A = sqrt(q/(q+eps)) = 1/sqrt(1 + eps/q): the factor eps puts on every component."""
    if q_over_eps <= 0:
        return 0.0
    if math.isinf(q_over_eps):
        return 1.0
    return 1.0 / math.sqrt(1.0 + 1.0 / q_over_eps)


def errored(name: str, x, eps: float, kind: str, message: str) -> StratumResult:
    qe, att = q_over_eps_stats(x, eps, kind)
    return StratumResult(name=name, status="error", vectors=x.shape[0], q_over_eps=qe, attenuation=att,
                         elements=x.numel(), error=message, x=x)


def grad_tolerance_for(dtype_name: str, exact: bool = False) -> Tolerance:
    """Gradients: |c - r| <= grad_rtol*|r| + grad_row_atol*max|r in the row|. A backward pass
    cancels (dx = (g - x̄·mean(x̄ g))/r), so an absolute floor relative to the row's scale is the
    honest allowance; a dropped term is off by the row's scale and still fails."""
    if exact:
        return Tolerance(0.0, 0.0, "exact")
    path = configs_dir() / "tolerances.toml"
    profile = load_toml(path).get(dtype_name, {})
    if "grad_rtol" not in profile:
        raise InputError(f"{path}: no gradient tolerance (grad_rtol, grad_row_atol) for dtype {dtype_name}")
    return Tolerance(atol=0.0, rtol=float(profile["grad_rtol"]), source=f"profile:{dtype_name}:grad",
                     row_atol=float(profile["grad_row_atol"]), mean_rounding=float(profile.get("mean_rounding", 0.0)))


def summation_units(n: int) -> float:
    """The mean of n terms summed in order at unit roundoff u is off by at most (n - 1) u max|x|
    (the recursive sum's bound, Higham's gamma_(n-1)), and the division and the subtraction x - mean
    add a rounding each: (n + 1) u, in units of u. A blocked or pairwise sum stays within it; an exact
    (Welford, compensated) one is within the 4 u the tolerance table states. Never below that."""
    return max(4.0, n + 1.0)


def mean_rounding_allowance(x, gain, eps: float, tol: Tolerance, exact_sum: bool = False):
    """Per element, the LayerNorm conditioning allowance (see configs/tolerances.toml): the mean's
    rounding amplified by |g| / sqrt(var + eps), for a row of n = x.shape[-1] terms summed in any order
    a float32 runtime uses (OpenVINO's MVN sums in order; torch's Welford mean is exact on a constant
    row: both are correct). `exact_sum`: only the 4 u of an exact sum."""
    import torch

    x = x.to(torch.float64)
    m = x.abs().amax(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    units = 4.0 if exact_sum else summation_units(x.shape[-1])
    return tol.mean_rounding * units / 4.0 * gain.to(torch.float64).abs() * m / torch.sqrt(var + eps)


def fold_rounding_allowance(x, mean, var, gain, bias, eps: float, dtype):
    """Per element, what an inference BatchNorm may lose by computing in the candidate's dtype as
    every runtime does, folded into one scale and shift: y = x * s + (b - mean * s), s = w / sqrt(var
    + eps). Each term is rounded once or twice at the dtype's unit eps u, so the output may be off
    by about 2u (|x s| + |mean s| + |b|): large next to |y| exactly where x sits near a large
    running mean (the subtraction the fold moved into the shift). A wrong eps moves y by |y| eps'/
    (2 var), orders above this wherever var is near eps."""
    import torch

    u = torch.finfo(dtype).eps
    x = x.to(torch.float64)
    scale = gain.to(torch.float64).abs() / torch.sqrt(var.to(torch.float64) + eps)
    out = 2 * u * (x.abs() + mean.to(torch.float64).abs()) * scale
    return out if bias is None else out + 2 * u * bias.to(torch.float64).abs()


def ulp_distance(ref, cand, dtype, diff=None, aref=None):
    """|cand - ref| in units in the last place of `dtype` at |ref| (subnormals: the smallest step).
    The unit is eps(dtype) * 2^floor(log2 |ref|), and 2^floor(log2 v) of a normal float64 is v
    with its mantissa bits cleared: exact, one pass, where log2 can round just below a power of
    two. `diff` and `aref`: |cand - ref| and |ref| when the caller has them."""
    import torch

    info = torch.finfo(dtype)
    # a normal float64 for every dtype we compare in
    power = ref.abs().clamp_min_(info.tiny) if aref is None else torch.clamp_min(aref, info.tiny)
    power.view(torch.int64).bitwise_and_(0x7FF0000000000000)
    diff = (cand - ref).abs_() if diff is None else diff
    return diff / power.mul_(info.eps)


def compare(name: str, x, ref, cand, eps: float, kind: str, tol: Tolerance,
            max_violation_fraction: float = 0.0, extra=None, dtype=None, q=None) -> StratumResult:
    """Elementwise |cand - ref| <= atol + rtol*|ref|; a non-finite candidate value where the
    reference is finite is always a violation (NaN fails every comparison).

    When every difference is finite (the common case) one pass computes it and the masks the
    general path needs for inf/NaN are skipped; both paths give the same result. `q` is the
    rows' mean square when the caller has it; the distance in ulps of `dtype` is computed for
    bitwise comparisons and for strata that fail (where it says how far off they are)."""
    import torch

    from parity_cli.backends.implementations import mean_square

    if tuple(cand.shape) != tuple(ref.shape):
        return errored(name, x, eps, kind, f"candidate returned shape {list(cand.shape)}, expected {list(ref.shape)}")
    q = mean_square(x, kind) if q is None else q
    qe, att = q_over_eps_stats(x, eps, kind, q)
    row_q = (q / eps if eps > 0 else torch.where(q > 0, torch.full_like(q, math.inf), q)).tolist()
    ref = ref.to(torch.float64)
    cand = cand.to(torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    elements = ref.numel()
    aref = ref.abs()
    allowed = tol.atol + tol.rtol * aref
    if extra is not None:
        allowed = allowed + extra
    diff = (cand - ref).abs_()
    max_diff = float(diff.max()) if elements else 0.0
    if math.isfinite(max_diff):  # every value on both sides is finite
        ok = diff <= allowed
        violations = elements - int(ok.sum())
        rel = diff / aref
        rel = torch.where(aref > 0, rel, torch.zeros_like(rel))
        flat = int(torch.argmax(diff / allowed.clamp_min(tiny)))
        nonfinite_bad = nonfinite_ref = nonfinite_cand = 0
        max_abs, max_rel = max_diff, (float(rel.max()) if elements else 0.0)
        row_err = (diff.amax(-1) / aref.amax(-1).clamp_min(tiny)).tolist()
        want_ulp = dtype is not None and elements and (violations or (tol.atol == 0 and tol.rtol == 0))
        max_ulp = float(ulp_distance(ref, cand, dtype).max()) if want_ulp else None
    else:
        finite = torch.isfinite(ref) & torch.isfinite(cand)
        diff = torch.where(finite, diff, torch.zeros_like(ref))
        ok = (finite & (diff <= allowed)) | (cand == ref) | (torch.isnan(cand) & torch.isnan(ref))
        violations = int((~ok).sum())
        nonzero = finite & (ref != 0)
        rel = torch.where(nonzero, diff / torch.where(nonzero, aref, torch.ones_like(ref)), torch.zeros_like(ref))
        # Worst element: largest error relative to its allowance; a violating non-finite value beats all.
        score = torch.where(finite, diff / allowed.clamp_min(tiny), torch.zeros_like(ref))
        score = torch.where(ok, score, torch.where(finite, score, torch.full_like(ref, math.inf)))
        flat = int(torch.argmax(score.reshape(-1)))
        # A non-finite value where the reference is finite fails the stratum whatever the allowed
        # share, and makes the error maxima infinite rather than hiding it.
        nonfinite_bad = int((~ok & ~finite).sum())
        nonfinite_ref = int((~torch.isfinite(ref)).sum())
        nonfinite_cand = int((~torch.isfinite(cand)).sum())
        max_abs = math.inf if nonfinite_bad else float(diff.max())
        max_rel = math.inf if nonfinite_bad else float(rel.max())
        scale = aref.nan_to_num(0.0, posinf=0.0).amax(-1).clamp_min(tiny)
        row_err = torch.where((~ok & ~finite).any(-1), torch.full_like(scale, math.inf), diff.amax(-1) / scale).tolist()
        want_ulp = dtype is not None and (violations or (tol.atol == 0 and tol.rtol == 0))  # as the fast path
        max_ulp = None if not want_ulp else (
            math.inf if nonfinite_bad else float(ulp_distance(ref, cand, dtype)[finite].max())
            if bool(finite.any()) else 0.0)
    v, i = divmod(flat, ref.shape[-1])
    fraction = violations / elements if elements else 0.0
    failing_q = None
    bad = None
    if violations:  # which rows failed says more than which stratum: c = 100 is not a small input
        bad = ~ok
        bad_rows = bad.reshape(ref.shape[0], -1).any(-1)
        qs = [row_q[r] for r in torch.nonzero(bad_rows).flatten().tolist()]
        failing_q = (min(qs), max(qs)) if qs else None
    return StratumResult(
        failing_q_over_eps=failing_q,
        row_q_over_eps=row_q,
        row_error=row_err,
        name=name,
        status="fail" if violations and (fraction > max_violation_fraction or nonfinite_bad) else "pass",
        vectors=ref.shape[0],
        q_over_eps=qe,
        attenuation=att,
        elements=elements,
        violations=violations,
        max_abs_err=max_abs,
        max_rel_err=max_rel,
        nonfinite_reference=nonfinite_ref,
        nonfinite_candidate=nonfinite_cand,
        max_ulp=max_ulp,
        worst=Worst(vector=v, index=i, input=float(x[v, i]), reference=float(ref[v, i]),
                    candidate=float(cand[v, i]), allowed=float(allowed[v, i])),
        x=x,
        ref=ref,
        cand=cand,
        bad=bad,
    )


class Workspace:
    """Scratch buffers of one batch shape, reused layer after layer: a 253-layer check then
    allocates them once instead of a dozen fresh multi-MB temporaries per layer (each a
    fresh mmap, zero-filled page by page: the page faults that dominated a busy machine)."""

    def __init__(self):
        self.buffers: dict = {}

    def get(self, name: str, shape, dtype=None, device="cpu"):
        import torch

        dtype = dtype or torch.float64
        key = (name, tuple(shape), dtype, str(device))
        buf = self.buffers.get(key)
        if buf is None:
            if len(self.buffers) > 32:  # many shapes (dims): keep the newest only
                self.buffers.clear()
            buf = self.buffers[key] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return buf


def workspace() -> Workspace:
    """This thread's scratch (--jobs threads each have their own)."""
    if not hasattr(_LOCAL, "ws"):
        _LOCAL.ws = Workspace()
    return _LOCAL.ws


_LOCAL = threading.local()


def compare_batch(segments, x, ref, cand, eps: float, kind: str, tol: Tolerance,
                  max_violation_fraction: float = 0.0, extra=None, dtype=None, q=None,
                  work: Workspace | None = None) -> list[StratumResult]:
    """compare() for every segment (name, first row, end row) of one batch, with the passes
    shared: |c - r|, the allowance, its worst ratio and the relative error are each one pass
    over the whole batch into reused buffers, reduced per row; each stratum's figures are then
    its rows'. Rows with a non-finite value, and a tolerance without atol (where the ratio to
    the allowance is undefined at zero, or overflows below a normal atol), take compare()'s
    general path, stratum by stratum:
    the results are the same either way (tests/test_compare_batch.py checks they agree).

    Why the ratio decides: for finite d and allowed > 0, fl(d / allowed) > 1 exactly when
    d > allowed (a float above `allowed` is at least one ulp above it, and that quotient
    rounds above 1), so the worst element and the verdict come from one pass."""
    import torch

    from parity_cli.backends.implementations import mean_square

    q = mean_square(x, kind) if q is None else q
    # atol below the smallest normal float64 (or 0) would let d / allowed overflow where
    # compare() divides by a clamped allowance: that path then decides the worst element
    if not (tol.atol >= torch.finfo(torch.float64).tiny) or ref.shape != cand.shape or ref.dim() != 2:
        return [compare(name, x[a:b], ref[a:b], cand[a:b], eps, kind, tol, max_violation_fraction,
                        None if extra is None else extra[a:b], dtype, q[a:b]) for name, a, b in segments]
    work = work or workspace()
    shape, dev = ref.shape, ref.device  # a GPU reference is compared where it is (options.reference_device)
    d = torch.sub(cand, ref, out=work.get("d", shape, device=dev)).abs_()
    a = torch.abs(ref, out=work.get("a", shape, device=dev))
    allowed = torch.mul(a, tol.rtol, out=work.get("allowed", shape, device=dev)).add_(tol.atol)
    if extra is not None:
        allowed.add_(extra)
    r = work.get("r", shape, device=dev)
    row_d = d.amax(-1)
    row_a = a.amax(-1)
    score = torch.div(d, allowed, out=r)
    score_l = score.amax(-1).tolist()
    # each stratum's worst row (the first of the largest), and the first largest element in it
    worst_row = {(lo, hi): max(range(lo, hi), key=lambda k: (score_l[k], -k)) for _, lo, hi in segments if hi > lo}
    worst_col = {seg: int(torch.argmax(score[v])) for seg, v in worst_row.items()}
    rel = torch.div(d, a, out=r).nan_to_num_(nan=0.0, posinf=math.inf).amax(-1)  # 0/0 where the reference is 0
    row_d_l, row_a_l, rel_l = (t.tolist() for t in (row_d, row_a, rel))
    counts = [0] * shape[0]
    outside = None
    if any(v > 1 for v in score_l):  # some element is outside: which, one pass over the batch
        outside = torch.gt(d, allowed, out=work.get("outside", shape, torch.bool, dev))
        counts = outside.view(torch.uint8).sum(-1, dtype=torch.int32).tolist()  # 2x the speed of bool
    for k, v in enumerate(rel_l):
        if v == math.inf and math.isfinite(row_d_l[k]):  # d > 0 where the reference is 0: judged by atol alone
            rel_l[k] = float(torch.where(a[k] > 0, d[k] / a[k], torch.zeros_like(d[k])).max())
    tiny = torch.finfo(torch.float64).tiny
    row_q = (q / eps if eps > 0 else torch.where(q > 0, torch.full_like(q, math.inf), q)).tolist()
    out = []
    for name, lo, hi in segments:
        if hi <= lo or not all(math.isfinite(v) for v in row_d_l[lo:hi]):
            out.append(compare(name, x[lo:hi], ref[lo:hi], cand[lo:hi], eps, kind, tol, max_violation_fraction,
                               None if extra is None else extra[lo:hi], dtype, q[lo:hi]))
            continue
        rows = range(lo, hi)
        violations = sum(counts[k] for k in rows)
        elements = (hi - lo) * shape[1]
        v, i = worst_row[(lo, hi)], worst_col[(lo, hi)]
        qe, att = q_over_eps_stats(x[lo:hi], eps, kind, q[lo:hi])
        fraction = violations / elements
        bad = None
        failing_q = None
        if violations:
            bad = outside[lo:hi].clone()  # kept by the result: the buffer is the next layer's
            qs = [row_q[k] for k in rows if counts[k]]
            failing_q = (min(qs), max(qs))
        want_ulp = dtype is not None and violations
        out.append(StratumResult(
            failing_q_over_eps=failing_q,
            row_q_over_eps=row_q[lo:hi],
            row_error=[row_d_l[k] / max(row_a_l[k], tiny) for k in rows],
            name=name,
            status="fail" if violations and fraction > max_violation_fraction else "pass",
            vectors=hi - lo,
            q_over_eps=qe,
            attenuation=att,
            elements=elements,
            violations=violations,
            max_abs_err=max(row_d_l[lo:hi]),
            max_rel_err=max(rel_l[lo:hi]),
            max_ulp=float(ulp_distance(ref[lo:hi], cand[lo:hi], dtype, d[lo:hi], a[lo:hi]).max()) if want_ulp
            else None,
            worst=Worst(vector=v - lo, index=i, input=float(x[v, i]), reference=float(ref[v, i]),
                        candidate=float(cand[v, i]), allowed=float(allowed[v, i])),
            x=x[lo:hi], ref=ref[lo:hi], cand=cand[lo:hi], bad=bad,
        ))
    return out
