"""Stage 6: from a failing layer's strata to its most likely cause.

The rule of thumb of the sources: errors only on small inputs -> q/eps (eps value or
placement); only on large inputs -> intermediate overflow or a missing upcast; the same
channels off at every scale -> the gain (offset, permutation, broadcast). Each diagnosis is
a value with a stable code and the evidence behind it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parity_cli.comparison import StratumResult
from parity_cli.implementations import mean_square, oracle_normalize
from parity_cli.layers import NormLayer

SMALL = {"zero", "tiny"}
LARGE = {"large", "outlier", "extreme"}


@dataclass
class Diagnosis:
    code: str
    message: str
    evidence: dict = field(default_factory=dict)


def estimate_eps(layer: NormLayer, gain, strata: list[StratumResult]):
    """The eps that explains the candidate: for y = x/sqrt(q + eps_c) * g, eps_c = x^2/(y/g)^2 - q.

    Uses tiny-stratum rows (where eps is visible) and channels with a usable gain and input.
    Returns (median, relative spread between the 25th and 75th percentiles) or None."""
    import torch

    samples = []
    for s in strata:
        if s.name != "tiny" or s.cand is None:
            continue
        q = mean_square(s.x, layer.kind).unsqueeze(-1)
        x = s.x
        if layer.kind == "layer_norm":
            x = x - x.mean(dim=-1, keepdim=True)
        y = s.cand / gain
        usable = (gain.abs() > 1e-3) & (x.abs() > 0.25 * q.sqrt()) & torch.isfinite(y) & (y != 0)
        est = (x * x) / (y * y) - q
        samples.append(est[usable])
    if not samples:
        return None
    est = torch.cat(samples)
    if est.numel() == 0:
        return None
    lo, med, hi = (float(v) for v in torch.quantile(est, torch.tensor([0.25, 0.5, 0.75], dtype=est.dtype)))
    spread = (hi - lo) / abs(med) if med else math.inf
    return med, spread


def implied_gain(layer: NormLayer, strata: list[StratumResult], eps: float):
    """Per channel: candidate / reference-normalised value on normal rows, and its relative spread."""
    import torch

    rows_c, rows_n = [], []
    for s in strata:
        if s.name == "normal" and s.cand is not None:
            rows_c.append(s.cand)
            rows_n.append(oracle_normalize(s.x, eps, layer.kind))
    if not rows_c:
        return None
    c, n = torch.cat(rows_c), torch.cat(rows_n)
    # Least squares per channel: g_j = sum(c*n)/sum(n*n); consistency from the residual.
    g = (c * n).sum(0) / (n * n).sum(0).clamp_min(1e-300)
    resid = (c - g * n).abs().amax(0) / (g.abs() * n.abs().amax(0)).clamp_min(1e-300)
    return g, resid


def diagnose(layer: NormLayer, strata: list[StratumResult], gain, rtol: float) -> list[Diagnosis]:
    import torch

    failing = [s for s in strata if s.status == "fail"]
    if not failing:
        return []
    names = {s.name for s in failing}
    eps = layer.eps.value
    out: list[Diagnosis] = []

    nonfinite = [s.name for s in failing if s.nonfinite_candidate > s.nonfinite_reference]
    if "zero" in nonfinite:
        out.append(Diagnosis(
            "eps_missing",
            "an all-zero row gives non-finite output: eps is missing or zero, so the norm computes 0/0",
            {"strata": nonfinite},
        ))
    if nonfinite and set(nonfinite) <= LARGE:
        out.append(Diagnosis(
            "overflow",
            f"non-finite output only on large inputs ({', '.join(nonfinite)}): x^2 or its sum overflows "
            "the working dtype; upcast to float32 before squaring",
            {"strata": nonfinite},
        ))

    if names <= LARGE and not nonfinite:
        out.append(Diagnosis(
            "symptom_large_inputs",
            f"errors only on large inputs ({', '.join(sorted(names))}): suspect intermediate precision "
            "(squaring or summing without an upcast)",
            {"strata": sorted(names)},
        ))

    estimate = estimate_eps(layer, gain, strata)
    if estimate is not None and eps > 0:
        med, spread = estimate
        off = abs(med - eps) / eps
        if off > 0.05 and not (names <= LARGE):
            if spread < 0.1:
                out.append(Diagnosis(
                    "eps_mismatch",
                    f"the candidate behaves as if eps = {med:.3g} where the layer's eps is {eps:.3g} "
                    f"({layer.eps.source}); small inputs (q/eps near 1) show it first",
                    {"estimated_eps": med, "spread": spread, "configured_eps": eps},
                ))
            else:
                out.append(Diagnosis(
                    "symptom_small_inputs",
                    f"the eps implied by small inputs varies from row to row (median {med:.3g}, spread {spread:.2g}) "
                    f"instead of being {eps:.3g}: suspect where eps enters (outside the square root?)",
                    {"estimated_eps": med, "spread": spread, "configured_eps": eps},
                ))

    if "normal" in names:
        fit = implied_gain(layer, strata, eps)
        if fit is not None:
            g, resid = fit
            consistent = bool((resid < 4 * max(rtol, 1e-6)).all())
            bad = (g - gain).abs() > 4 * max(rtol, 1e-6) * gain.abs().clamp_min(1e-6)
            count = int(bad.sum())
            shift = float((g - gain).median())
            uniform = bool(((g - gain - shift).abs() <= 4 * max(rtol, 1e-6) * gain.abs().clamp_min(1e-6)).all())
            if consistent and count and uniform and abs(abs(shift) - 1.0) < 0.05:
                what = ("the +1 offset is missing (gain w instead of 1 + w)" if shift < 0 and layer.gain_offset
                        else "the gain carries an extra +1 (offset applied twice)" if shift > 0 and layer.gain_offset
                        else "a +1 offset is applied that this family does not use" if shift > 0
                        else "the gain is off by -1")
                out.append(Diagnosis(
                    "weight_offset_mismatch",
                    f"every channel's gain is off by {shift:+.3g}: {what}",
                    {"offset_error": shift, "expected_offset": layer.gain_offset},
                ))
            elif consistent and count:
                idx = torch.nonzero(bad).flatten()[:10].tolist()
                out.append(Diagnosis(
                    "channel_gain_mismatch",
                    f"normalisation matches but the gain does not in {count} of {layer.dim} channels: "
                    "wrong, permuted or mis-broadcast weight, or a wrong gain offset",
                    {"channels": [{"channel": j, "implied": float(g[j]), "expected": float(gain[j])} for j in idx],
                     "affected_channels": count},
                ))
    if not out:
        out.append(Diagnosis(
            "unexplained",
            f"failing strata {', '.join(sorted(names))} match no known symptom; compare the worst elements",
            {"strata": sorted(names)},
        ))
    return out
