"""The fused residual add + norm as serving runtimes call it (issue 37): vLLM's
`fused_add_rms_norm(x, residual, w, eps)` writes `residual <- x + residual` and `x <- N(residual) w`
in place; others return both. Both outputs are compared with the float64 oracle of the sum:
`s = x + residual` formed exactly, `normed = N(s) g (+ b)`, and the new residual `s` itself.

A probe row is the pair (x, residual) side by side, [x | residual], and an output row
[normed | new residual], so the supervised runners move them as any other rows. The strata are
about the sum, where the norm sees it: residual >> x and x >> residual, x = -residual + tiny (the
eps regime reached by cancellation), a sum past float16's range with each input inside it, and a
residual stream grown over many blocks (a large common offset). q/eps is the sum's.

Faults only fusion makes, each said only where it reproduces the candidate's residual output:
`residual_stale` (the residual output is the input residual), `residual_is_normed` (it holds the
normed value), `aliasing` (normed + residual: x overwritten in place, then read for the sum),
`sum_in_low_precision` (it equals x + residual formed in a narrower dtype), and
`sum_overflow` (the normed output is not finite where the sum passes float16's range though each
input is inside it). Otherwise the normed half is diagnosed as a plain norm of the sum (eps,
gain offset, upcast, ...)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ADD = "add"
STRATA = ("residual_dominant", "x_dominant", "cancellation", "sum_overflow", "offset_stream")


@dataclass
class FusedStratum:
    name: str
    normed: object  # comparison.StratumResult of the normed output
    residual: object  # comparison.StratumResult of the new residual
    x: object = field(default=None, repr=False)  # the inputs, float64
    r: object = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.normed.passed and self.residual.passed


class _Verdict:
    """What a fused layer's result says of itself: passed when nothing errored and every stratum holds."""

    @property
    def passed(self) -> bool:
        return self.error is None and not self.findings and all(s.passed for s in self.strata)

    def _diagnoses(self) -> list:
        return [{"code": d.code, "message": d.message, "evidence": d.evidence} for d in self.diagnoses]


def _num(v):  # JSON has no inf or NaN: said as text, as the check report says them
    return v if math.isfinite(v) else str(v)


@dataclass
class FusedResult(_Verdict):
    name: str
    kind: str
    dim: int
    dtype: str
    strata: list = field(default_factory=list)
    diagnoses: list = field(default_factory=list)
    error: str | None = None
    findings: list = field(default_factory=list)  # what the stored weight says on its own (results.weight_faults)

    def as_dict(self) -> dict:
        def one(r):
            return {"status": r.status, "violations": r.violations, "elements": r.elements,
                    "max_abs_err": _num(r.max_abs_err), "q_over_eps": [_num(v) for v in r.q_over_eps],
                    "nonfinite_candidate": r.nonfinite_candidate}

        return {"name": self.name, "kind": self.kind, "dim": self.dim, "dtype": self.dtype, "fused": ADD,
                "verdict": "pass" if self.passed else "fail", "error": self.error,
                "strata": [{"name": s.name, "normed": one(s.normed), "residual": one(s.residual)} for s in self.strata],
                "diagnoses": self._diagnoses(), "findings": list(self.findings)}


def probe_pairs(dim: int, eps: float, dtype, seed: int) -> list[tuple[str, object, object]]:
    """(stratum, x, residual), float64 rows each exactly representable in `dtype`. The sum of each
    pair is what the norm sees; its q/eps spans the seeds' regimes (cancellation down to q ~ eps)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 8

    def rnd(scale, rows=n):
        return (torch.randn(rows, dim, generator=g, dtype=torch.float64) * scale).to(dtype).to(torch.float64)

    out = [("residual_dominant", rnd(0.01), rnd(10.0)), ("x_dominant", rnd(10.0), rnd(0.01))]
    # x = -residual + tiny: the sum is the tiny part, its q/eps from 0.1 to 1e6. The residual is larger by
    # a factor the dtype can cancel and keep the sum's first bits (2 in bfloat16, 16 in float16, 2^17
    # in float32): what reaches the norm is the regime of the seeds, through cancellation
    scale = torch.tensor([0.3, 1, 3, 10, 30, 100, 300, 1000], dtype=torch.float64)[:, None] * eps ** 0.5
    tiny = torch.randn(n, dim, generator=g, dtype=torch.float64) * scale
    ratio = 2.0 ** (round(-math.log2(torch.finfo(dtype).eps)) - 6)
    big = (torch.randn(n, dim, generator=g, dtype=torch.float64) * scale * ratio).to(dtype).to(torch.float64)
    x = (tiny - big).to(dtype).to(torch.float64)
    out.append(("cancellation", x, big))
    if dtype == torch.float16:  # each input inside float16's range, the sum past it on a few channels (an outlier
        # feature both branches carry): the rest of the row is ordinary, as in a real stream
        x, r = rnd(1.0), rnd(1.0)
        cols = torch.randperm(dim, generator=g)[:max(1, dim // 16)]
        x[:, cols] = (torch.rand(n, cols.numel(), generator=g, dtype=torch.float64) * 8000 + 36000).to(dtype).double()
        r[:, cols] = (torch.rand(n, cols.numel(), generator=g, dtype=torch.float64) * 8000 + 36000).to(dtype).double()
        out.append(("sum_overflow", x, r))
    offset = 64.0 * torch.sign(torch.randn(n, 1, generator=g, dtype=torch.float64))
    out.append(("offset_stream", rnd(1.0), (offset + rnd(1.0)).to(dtype).to(torch.float64)))
    return out


def reference(x, r, gain, bias, eps: float, kind: str):
    """The oracle: the sum in float64 (exact for two values of any narrower float), its norm."""
    from parity_cli.backends.implementations import oracle_normalize

    s = x + r
    y = oracle_normalize(s, eps, kind) * gain
    return (y if bias is None else y + bias), s


def reference_gain(layer, dtype):
    """The oracle's gain and bias: the layer's, as the candidate receives them (rounded to its dtype)."""
    import torch

    gain = layer.gain_offset + layer.weight.to(dtype).to(torch.float64)
    return gain, None if layer.bias is None else layer.bias.to(dtype).to(torch.float64)


def check_add_norm(layer, run_all, dtype, tol, seed: int = 0, strata: tuple = STRATA) -> FusedResult:
    """`run_all([(x, residual), ...]) -> [(normed, new_residual) or an error's words, ...]` at `dtype`
    (in_process of a kernel, or the supervised runner); every stratum's two outputs against the oracle."""
    import torch

    from parity_cli.comparison import compare_batch

    name = str(dtype).removeprefix("torch.")
    result = FusedResult(layer.name, layer.kind, layer.dim, name)
    gain, bias = reference_gain(layer, dtype)
    eps = layer.eps.value
    pairs = [p for p in probe_pairs(layer.dim, eps, dtype, seed) if p[0] in strata]
    outputs = run_all([(x.to(dtype), r.to(dtype)) for _, x, r in pairs])
    for (stratum, x, r), out in zip(pairs, outputs):
        if isinstance(out, str):  # a fault in the candidate is a finding
            result.error = f"{stratum}: {out}"
            return result
        out = _tensors(out, (x.shape, x.shape), ("normed output", "new residual"))
        if isinstance(out, str):
            result.error = f"{stratum}: {out}"
            return result
        ref_y, ref_s = reference(x, r, gain, bias, eps, layer.kind)
        y, s = out
        # a sum past the dtype's range is stored as inf by any kernel: the residual's reference is the
        # sum as the dtype holds it, and matching infinities are compared as equal
        held = ref_s.to(dtype).to(torch.float64)
        same_inf = torch.isinf(held) & (s == held)
        ref_res = torch.where(same_inf, torch.zeros_like(held), ref_s)
        cand_res = torch.where(same_inf, torch.zeros_like(s), s)
        seg = [(stratum, 0, x.shape[0])]
        extra = None
        if layer.kind == "layer_norm" and tol.mean_rounding:  # a float32 mean summed in any order, as check allows
            from parity_cli.comparison import mean_rounding_allowance

            extra = mean_rounding_allowance(ref_s, gain, eps, tol)
        (normed,) = compare_batch(seg, ref_s, ref_y, y, eps, layer.kind, tol, extra=extra, dtype=dtype)
        (residual,) = compare_batch(seg, ref_s, ref_res, cand_res, eps, layer.kind, tol, dtype=dtype)
        for part, cand in ((normed, y), (residual, s)):
            part.x, part.cand, part.shared = ref_s, cand, {}  # shared: diagnosis' per-probe cache
        normed.ref, residual.ref = ref_y, ref_s
        result.strata.append(FusedStratum(stratum, normed, residual, x, r))
    if not result.passed:
        result.diagnoses = diagnose_add_norm(layer, result, gain, bias, eps, tol, dtype)
    return result


def _close(a, b, dtype) -> bool:
    """Equal to within one unit of the dtype at the values' size (a sum formed in float32 or in the
    dtype rounds differently by that much)."""
    import torch

    unit = torch.finfo(dtype).eps
    ok = torch.isfinite(a) & torch.isfinite(b)
    return bool(((a - b).abs()[ok] <= unit * b.abs()[ok] + 1e-30).all()) and bool(ok.any())


def _tensors(out, shapes, names):
    """A candidate's outputs as float64 tensors of the expected shapes, or what is wrong with them, in
    words (a fault in the candidate is a finding, never parity's traceback)."""
    import torch

    if not isinstance(out, (tuple, list)) or len(out) != len(shapes):
        return f"the candidate returned {type(out).__name__}, not ({', '.join(names)})"
    got = []
    for value, shape, name in zip(out, shapes, names):
        if not isinstance(value, torch.Tensor):
            return f"the candidate's {name} is a {type(value).__name__}, not a tensor"
        if value.numel() != math.prod(shape):
            return f"the candidate's {name} has shape {list(value.shape)}, expected {list(shape)}"
        got.append(value.detach().to("cpu", torch.float64).reshape(shape))
    return tuple(got)


def in_process(pair):
    """run_all for a kernel adapted as pair(x, residual) -> (normed, new_residual) (or quant(x) ->
    (q, scale), its inputs single tensors), called here."""

    def run_all(inputs):
        out = []
        for args in inputs:
            try:
                out.append(pair(*args) if isinstance(args, tuple) else pair(args))
            except Exception as exc:  # noqa: BLE001 - the candidate's fault, kept as words
                out.append(f"the candidate raised {type(exc).__name__}: {exc}")
        return out

    return run_all


def diagnose_add_norm(layer, result: FusedResult, gain, bias, eps: float, tol, dtype) -> list:
    """Fusion's own faults where they reproduce the residual output; else the normed half as a
    plain norm of the sum (causes.diagnose, with the sum as the norm's input)."""
    import torch

    from parity_cli.diagnose.causes import Diagnosis, diagnose

    failing = [s for s in result.strata if not s.passed]
    out = []

    def every(pred):
        return bool(failing) and all(pred(s) for s in failing)

    def equal(a, b):  # element for element, NaN where NaN; an output with no finite value matches nothing
        return bool(torch.isfinite(a).any()) and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())

    if every(lambda s: not s.residual.passed and equal(s.residual.cand, s.r)):
        out.append(Diagnosis("residual_stale", "the residual output is the residual input unchanged: the kernel "
                             "never wrote x + residual back, so the next block adds to a stale stream", {}))
    elif every(lambda s: not s.residual.passed and equal(s.residual.cand, s.normed.cand)):
        out.append(Diagnosis("residual_is_normed", "the residual output holds the normed value, not x + residual: "
                             "the next block's residual is this block's normalised output", {}))
    elif every(lambda s: not s.residual.passed and _close(s.residual.cand, (s.normed.cand + s.r).to(dtype).double(), dtype)):
        out.append(Diagnosis("aliasing", "the residual output is normed + residual: the kernel wrote the normed "
                             "value into x (in place, x and out sharing storage) and then read x for the sum", {}))
    else:
        narrower = [d for d in (torch.bfloat16, torch.float16) if torch.finfo(d).eps > torch.finfo(dtype).eps]
        for low in narrower:
            def formed(s, low=low):
                return (s.x.to(low) + s.r.to(low)).to(dtype).to(torch.float64)

            bad = [s for s in failing if not s.residual.passed]
            if bad and all(equal(s.residual.cand, formed(s)) for s in bad):
                lname = str(low).removeprefix("torch.")
                out.append(Diagnosis("sum_in_low_precision", f"x + residual is formed in {lname}, not in float32: the "
                                     f"residual output equals that sum on every compared element, and the stream "
                                     f"loses {lname}'s precision block after block", {"sum_dtype": lname}))
                break
    overflow = [s for s in failing if s.name == "sum_overflow" and s.normed.nonfinite_candidate]
    if overflow:
        out.append(Diagnosis("sum_overflow", "the normed output is not finite where x + residual passes float16's "
                             "range though each input is inside it: the sum (or the numerator read back from the "
                             "stored float16 residual) overflows before any upcast",
                             {"nonfinite": sum(s.normed.nonfinite_candidate for s in overflow)}))
    if not out:  # the residual is right: the norm of the sum is what differs
        normed = [s.normed for s in result.strata if s.name != "sum_overflow"]
        out = diagnose(layer, normed, gain, tol, dtype, bias=bias)
    return out


# --- norm + quantize -----------------------------------------------------------------------------

QMIN, QMAX = -128, 127  # int8, as vLLM's static and dynamic int8 quant clamp


@dataclass
class QuantResult(_Verdict):
    name: str
    kind: str
    dim: int
    dtype: str
    mode: str  # static | dynamic
    scale: float | None  # the static scale given
    strata: list = field(default_factory=list)  # comparison.StratumResult of the dequantized output
    saturated: dict = field(default_factory=dict)  # stratum -> elements past the int8 range at that scale
    diagnoses: list = field(default_factory=list)
    error: str | None = None
    findings: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dim": self.dim, "dtype": self.dtype, "fused": "quant",
                "mode": self.mode, "scale": self.scale, "verdict": "pass" if self.passed else "fail",
                "error": self.error, "saturated": dict(self.saturated),
                "strata": [{"name": s.name, "status": s.status, "violations": s.violations, "elements": s.elements,
                            "max_abs_err": _num(s.max_abs_err)} for s in self.strata],
                "diagnoses": self._diagnoses(), "findings": list(self.findings)}


def static_scale(layer, dtype, seed: int) -> float:
    """A static scale as calibration picks one: the normal stratum's largest |y| over 127, so that
    ordinary rows use the int8 range and large or outlier rows saturate (counted apart)."""
    from parity_cli.backends.implementations import oracle_normalize
    from parity_cli.probes.strata import build_probe_set, select_strata

    gain, bias = reference_gain(layer, dtype)
    ps = build_probe_set(select_strata(None), layer.dim, layer.eps.value, dtype, seed)
    normal = next(p.x for p in ps.probes if p.stratum == "normal")
    y = oracle_normalize(normal, layer.eps.value, layer.kind) * gain + (0 if bias is None else bias)
    return max(float(y.abs().max()) / QMAX, 2.0 ** -126)  # a zero gain still gets a scale a kernel can divide by


def check_norm_quant(layer, run_all, dtype, tol, seed: int = 0, mode: str = "static",
                     scale: float | None = None) -> QuantResult:
    """`run_all([x, ...]) -> [(q, scale) or words, ...]`; each stratum dequantized (q * scale) against
    the oracle's normed value clamped to the int8 range at that scale, allowed half a quantization
    step more than the dtype's tolerance. Elements past the range are counted apart (saturated)."""
    import torch

    from parity_cli.backends.implementations import oracle_normalize
    from parity_cli.comparison import compare_batch
    from parity_cli.probes.strata import build_probe_set, select_strata

    result = QuantResult(layer.name, layer.kind, layer.dim, str(dtype).removeprefix("torch."), mode, scale)
    gain, bias = reference_gain(layer, dtype)
    eps = layer.eps.value
    ps = build_probe_set(select_strata(None), layer.dim, eps, dtype, seed)
    outputs = run_all([p.x.to(dtype) for p in ps.probes])
    for probe, out in zip(ps.probes, outputs):
        if isinstance(out, str):
            result.error = f"{probe.stratum}: {out}"
            return result
        rows = probe.x.shape[0]
        out = _tensors(out, (probe.x.shape, (rows, 1)), ("q", "scale"))
        if isinstance(out, str) or not bool(((out[0] == out[0].round()) & (out[0] >= QMIN) & (out[0] <= QMAX)).all()):
            result.error = f"{probe.stratum}: " + (out if isinstance(out, str) else "q holds values that are not int8")
            return result
        q, s_out = out
        y = oracle_normalize(probe.x, eps, layer.kind) * gain + (0 if bias is None else bias)
        unit = torch.finfo(dtype).eps
        if mode == "dynamic":  # the kernel's own per-token scale: max|y| / 127 of its own (rounded) row, which
            # is the reference's to the dtype's rounding: the allowance grows with that, never with the
            # candidate's own scale (a huge scale and q = 0 would pass otherwise)
            ref_scale = (y.abs().amax(-1, keepdim=True) / QMAX).clamp_min(1e-30)
            extra = 0.5 * ref_scale * (1 + unit) + unit * y.abs()
        else:
            ref_scale = torch.full_like(s_out, scale)
            extra = (0.5 * ref_scale * (1 + 2 ** -10)).expand_as(y)  # half a step, and the scale's rounding
        lo, hi = QMIN * ref_scale, QMAX * ref_scale
        result.saturated[probe.stratum] = int(((y < lo) | (y > hi)).sum())
        ref = torch.maximum(torch.minimum(y, hi), lo)
        seg = [(probe.stratum, 0, rows)]
        (cmp,) = compare_batch(seg, probe.x, ref, q * s_out, eps, layer.kind, tol, extra=extra, dtype=dtype)
        cmp.x, cmp.ref, cmp.cand, cmp.shared = probe.x, ref, q * s_out, {}
        cmp.q_int, cmp.y, cmp.step = q, y, s_out  # the integers, the oracle, the scale the kernel divided by
        result.strata.append(cmp)
    if not result.passed:
        result.diagnoses = diagnose_norm_quant(layer, result, gain, dtype)
    return result


def diagnose_norm_quant(layer, result: QuantResult, gain, dtype) -> list:
    """Which quantization reproduces the integers: the rounding mode (truncation where nearest is
    expected), wrap-around instead of saturation, the scale applied before the gain."""
    import torch

    from parity_cli.diagnose.causes import Diagnosis

    failing = [s for s in result.strata if not s.passed]

    def share(form) -> float:
        hit = total = 0
        for s in failing:
            expect = form(s)
            hit += int((expect == s.q_int).sum())
            total += s.q_int.numel()
        return hit / max(total, 1)

    def seen(s):  # the normed value as the kernel holds it before quantizing: rounded to its dtype
        return s.y.to(dtype).to(torch.float64) / s.step

    nearest = share(lambda s: torch.round(seen(s)).clamp(QMIN, QMAX))
    forms = {
        "quant_rounding_truncates": (lambda s: torch.trunc(seen(s)).clamp(QMIN, QMAX),
                                     "the candidate truncates x / scale toward zero where round-to-nearest is "
                                     "expected: every element loses up to a whole step, biased toward 0"),
        "quant_wraps": (lambda s: ((torch.round(seen(s)) - QMIN) % 256 + QMIN),
                        "the candidate wraps past the int8 range instead of saturating: a value above 127 "
                        "comes back negative (a cast without a clamp)"),
        "quant_scale_before_gain": (lambda s: torch.round(
            (s.y / gain).to(dtype).to(torch.float64) / s.step).clamp(QMIN, QMAX),
            "the candidate quantizes the normalised value before the gain multiplies it (scale placed "
            "before the gain): the integers are those of N(x), not of N(x) * w"),
    }
    for code, (form, words) in forms.items():
        got = share(form)
        if got >= 0.99 and got > nearest + 0.01:
            return [Diagnosis(code, words, {"share_reproduced": round(got, 4), "share_round_to_nearest": round(nearest, 4)})]
    sat = {k: v for k, v in result.saturated.items() if v}
    return [Diagnosis("quant_unexplained", "the dequantized output misses the oracle by more than half a "
                      "quantization step, and no rounding, saturation or scale placement reproduces its integers",
                      {"share_round_to_nearest": round(nearest, 4), "saturated": sat})]
