"""Stage 6 for a GroupNorm: which fault reproduces the candidate.

A GroupNorm is a LayerNorm over each group of C / groups channels and all their positions, so its
eps meets each group's variance: a group that is silent (constant) or tiny while the others carry
signal is where a wrong eps shows. What a port gets wrong besides eps is the grouping itself: the
group count (32 hard-coded where the model used another; 1, a LayerNorm over every channel; one a
channel, an InstanceNorm) and eps outside the root. A cause is stated only when its float64
transcription reproduces every compared element within the tolerance (as for the other kinds)."""

from __future__ import annotations

import math

from parity_cli.diagnose.batch_norm import COMMON_EPS
from parity_cli.diagnose.causes import Diagnosis, median, opening, reproduces


def _reproduces(strata, variant, tol, slack) -> bool:
    """variant(x) -> the float64 output: within the tolerance and the conditioning allowance
    (`slack(x)`) of the candidate."""
    return reproduces(strata, lambda s: variant(s.x), lambda s, y: tol.atol + tol.rtol * y.abs() + slack(s.x))


def _estimate_eps(strata, groups: int, gain, bias) -> float | None:
    """The eps that explains the candidate, read off the rows' smallest-variance groups:
    w (x - mean) / (y - b) = sqrt(var + eps')."""
    import torch

    from parity_cli.backends.implementations import mean_square

    estimates = []
    for s in strata:
        n = s.x.shape[0]
        grouped = s.x.reshape(n, groups, -1)
        mean = grouped.mean(-1, keepdim=True)
        var = mean_square(grouped, "layer_norm")
        d = (grouped - mean).reshape(n, -1)
        out = s.cand.to(torch.float64) - (0.0 if bias is None else bias)
        with torch.no_grad():
            root = (gain * d / out).reshape(n, groups, -1)
        smallest = var.argmin(-1)
        for r in range(n):
            g = int(smallest[r])
            big = d.reshape(n, groups, -1)[r, g].abs() >= 0.5 * d.reshape(n, groups, -1)[r, g].abs().max()
            vals = root[r, g][big & torch.isfinite(root[r, g]) & (root[r, g] > 0)]
            estimates.extend((vals ** 2 - var[r, g]).tolist())
    return median(estimates)


def _affine_in_dtype(strata, groups: int, gain, bias, eps: float, dtype) -> Diagnosis | None:
    """A half-precision GroupNorm that rounds h, then w * h, then + b, each to its dtype (mlx.nn.GroupNorm
    at bfloat16/float16), where torch rounds once at the end: said where that form reproduces every
    compared element within a unit of the dtype at the size of its terms, and one rounding does not
    (as diagnose.causes.affine_in_dtype_diagnosis for a LayerNorm, per group and per position)."""
    import torch

    from parity_cli.backends.implementations import group_normalize

    if dtype not in (torch.float16, torch.bfloat16) or not strata:
        return None
    unit = torch.finfo(dtype).eps
    w, b = gain.double(), 0.0 if bias is None else bias.double()
    three = one = True
    for s in strata:
        h = group_normalize(s.x.double(), groups, eps)
        y3 = ((h.to(dtype).double() * w).to(dtype).double() + b).to(dtype).double()
        y1 = (h * w + b).to(dtype).double()
        size = (h * w).abs() + (b.abs() if torch.is_tensor(b) else abs(b))
        cand = s.cand.double()
        ok = torch.isfinite(cand)
        three &= bool(((cand - y3).abs()[ok] <= (unit * size)[ok]).all())
        one &= bool((cand[ok] == y1[ok]).all())
    if not three or one:
        return None
    name = str(dtype).removeprefix("torch.")
    return Diagnosis("affine_in_input_dtype",
                     f"the candidate rounds the normalised value, then w * h, then + b, each to {name} (three "
                     f"roundings where torch rounds once): where w h nearly cancels b the output keeps only "
                     f"|w h| x 2^-{int(-math.log2(unit))}, past the allowance", {"dtype": name, "roundings": 3})


def diagnose_group_norm(layer, strata, gain, bias, eps: float, tol, dtype, exact: bool = False) -> list[Diagnosis]:
    from parity_cli.backends.implementations import group_normalize, per_position
    from parity_cli.comparison import mean_rounding_allowance

    done, compared = opening(strata, dtype, exact)
    if done is not None:
        return done
    failing = [s for s in strata if s.status != "pass"]
    full_gain = per_position(gain, layer)
    full_bias = None if bias is None else per_position(bias, layer)

    def affine(h):
        return h * full_gain + (0.0 if full_bias is None else full_bias)

    def grouped(groups, value=eps, outside=False):
        def run(x):
            if not outside:
                return affine(group_normalize(x, groups, value))
            n = x.shape[0]
            g = x.reshape(n, groups, -1)
            c = g - g.mean(-1, keepdim=True)
            std = c.pow(2).mean(-1, keepdim=True).sqrt()
            return affine((c / (std + value)).reshape(n, -1))
        return run

    def slack(x):
        if not tol.mean_rounding:
            return 0.0
        n = x.shape[0]
        return mean_rounding_allowance(x.reshape(n, layer.groups, -1), full_gain.reshape(layer.groups, -1), eps,
                                       tol).reshape(n, -1)

    channels = layer.dim
    # the counts conversions carry first, then every other divisor of C (4 groups where the layer has 1),
    # at most 64 in all: a count reproduces every element or is not said
    common = [g for g in dict.fromkeys([1, channels, layer.groups // 2, layer.groups * 2, 32, 16, 8])
              if g >= 1 and channels % g == 0 and g != layer.groups]
    rest = [g for g in range(2, min(channels, 1 << 16)) if channels % g == 0 and g not in common and g != layer.groups]
    counts = (common + rest)[:64]
    for g in counts:
        if _reproduces(compared, grouped(g), tol, slack):
            what = ("one group over every channel (a LayerNorm)" if g == 1 else
                    "one group a channel (an InstanceNorm)" if g == channels else f"{g} groups")
            return [Diagnosis("group_count_mismatch",
                              f"the candidate normalises with {what} where the layer has {layer.groups} groups "
                              f"of {channels // layer.groups} channels",
                              {"groups": layer.groups, "candidate_groups": g})]
    def slack_outside(x):  # the same rounding of the mean, amplified by 1 / (std + eps) instead
        if not tol.mean_rounding:
            return 0.0
        n = x.shape[0]
        g = x.reshape(n, layer.groups, -1)
        std = (g - g.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).sqrt()
        m = g.abs().amax(-1, keepdim=True)
        return (tol.mean_rounding * full_gain.reshape(layer.groups, -1).abs() * m / (std + eps)).reshape(n, -1)

    if _reproduces(compared, grouped(layer.groups, outside=True), tol, slack_outside):
        return [Diagnosis("eps_outside_sqrt", "the candidate computes (x - mean) / (std + eps) per group: eps is "
                          "outside the root", {"form": "(x - mean) / (std + eps) per group"})]
    estimate = _estimate_eps([s for s in failing if s in compared] or compared, layer.groups, full_gain, full_bias)
    tried = [v for v in COMMON_EPS if v != eps]
    if estimate is not None and math.isfinite(estimate) and estimate >= 0:
        tried.sort(key=lambda v: abs(math.log((v + 1e-300) / (estimate + 1e-300))))
        tried = tried[:3] + [estimate]
    for value in tried:
        if _reproduces(compared, grouped(layer.groups, value), tol, slack):
            return [Diagnosis("eps_mismatch",
                              f"the candidate behaves as if eps = {value:.3g} where the layer's eps is {eps:.3g} "
                              f"({layer.eps.source}); a group that is silent or tiny while the others are not "
                              "shows it first",
                              {"estimated_eps": value, "configured_eps": eps, "eps_source": layer.eps.source,
                               "raw_estimate": estimate})]
    rounded = _affine_in_dtype(compared, layer.groups, full_gain, full_bias, eps, dtype)
    if rounded is not None:
        return [rounded]
    names = sorted(s.name for s in failing)
    ranges = [s.failing_q_over_eps for s in failing if s.failing_q_over_eps]
    where = (f"failing groups at variance / eps {min(r[0] for r in ranges):.3g} to {max(r[1] for r in ranges):.3g}"
             if ranges else "the failing groups are not known")
    return [Diagnosis("unexplained", f"no known GroupNorm fault (eps, group count, eps outside the root) reproduces "
                      f"the candidate; {where}", {"strata": names})]
