"""Stage 6 for an inference BatchNorm: which fault reproduces the candidate.

A BatchNorm's eps meets the running variance of each channel, never the input: a wrong eps moves
every output of channel c by the factor sqrt((var_c + eps) / (var_c + eps')), so the channels with
the smallest running_var / eps show it first (the converters' classic: Keras' BatchNormalization
default epsilon 1e-3 on a PyTorch model trained with 1e-5). The other faults of a conversion are
about the statistics themselves: the batch's used at inference (a module left in training mode),
the running mean and variance swapped, or missing (a fresh module's 0 and 1).

As in the joint fit for RMSNorm/LayerNorm, a cause is stated only when its float64 transcription
reproduces the candidate on every compared element within the tolerance; otherwise only what the
failing channels show."""

from __future__ import annotations

import math

from parity_cli.diagnose.causes import Diagnosis, compared_strata, median, opening, reproduces

# eps values conversions actually carry, tried before a raw estimate (which rounding leaves fuzzy)
COMMON_EPS = (1e-3, 1e-5, 1e-6, 1e-4, 1e-12, 1e-8, 1.001e-5, 0.001)


def _reproduces(strata, variant, tol, gain, bias, slack) -> bool:
    """variant(x, stratum) -> float64 normalised h: w h + b within the tolerance and the fold's
    rounding (`slack(x)`) of the candidate."""
    def output(s):
        h = variant(s.x, s)
        return None if h is None else h * gain + (0.0 if bias is None else bias)

    return reproduces(strata, output, lambda s, y: tol.atol + tol.rtol * y.abs() + slack(s.x))


def estimate_eps(strata, mean, var, gain, bias) -> float | None:
    """The eps that explains the candidate, read off the channel with the smallest running
    variance (where eps moves the output most): w (x - mean) / (y - b) = sqrt(var + eps')."""
    import torch

    estimates = []
    channel_order = torch.argsort(var)
    for s in strata:
        x, cand = s.x.to(torch.float64), s.cand.to(torch.float64)
        d = x - mean
        out = cand - (0.0 if bias is None else bias)
        with torch.no_grad():
            root = gain * d / out
        for c in channel_order[: max(1, min(8, var.numel()))].tolist():
            r = root[:, c]
            ok = torch.isfinite(r) & (r > 0) & (d[:, c].abs() > 0.5 * math.sqrt(float(var[c]) + 1e-30)) & \
                (out[:, c].abs() > 1e-6 * gain[c].abs())
            if bool(ok.any()):
                estimates.extend((r[ok] ** 2 - var[c]).tolist())
        if estimates:
            break
    return median(estimates)


def diagnose_batch_norm(layer, strata, gain, bias, eps: float, tol, dtype, exact: bool = False) -> list[Diagnosis]:
    import torch

    from parity_cli.backends.implementations import batch_normalize
    from parity_cli.comparison import fold_rounding_allowance

    done, compared = opening(strata, dtype, exact)
    if done is not None:
        return done
    failing = [s for s in strata if s.status != "pass"]
    mean = layer.running_mean.to(torch.float64)
    var = layer.running_var.to(torch.float64)

    def slack(x):
        return fold_rounding_allowance(x, mean, var, gain, bias, eps, dtype)

    def with_eps(value):
        return lambda x, s: batch_normalize(x, mean, var, value)


    def batch_statistics(x, s):  # each stratum is one call, one batch (a one-row batch: its own mean, h = 0)
        return batch_normalize(x, x.mean(0), x.var(0, unbiased=False), eps)

    def batch_statistics_at_dtype(x, s):
        """The same at the candidate's dtype, as torch computes it: a batch near its mean has a
        variance that rounding at float32 decides, which float64 cannot reproduce."""
        import torch.nn.functional as F

        if x.shape[0] < 2:  # torch refuses a one-row batch in training mode
            return batch_statistics(x, s)
        w, b = gain.to(dtype), None if bias is None else bias.to(dtype)
        y = F.batch_norm(x.to(dtype), None, None, w, b, training=True, eps=eps).to(torch.float64)
        return (y - (0.0 if bias is None else bias)) / gain

    def batch_statistics_mean_of_squares(x, s):
        """keras 3's moments at the candidate's dtype (float32 for a half input): the variance as
        E[x^2] - E[x]^2, which cancels where a channel's mean is large against its spread."""
        h = x.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
        m = h.mean(0)
        v = (h * h).mean(0) - m * m
        return batch_normalize(x, m.to(torch.float64), v.to(torch.float64), eps)

    hypotheses = [
        ("batch_statistics", batch_statistics,
         "the candidate normalises with the batch's mean and variance, not the running statistics (a module in "
         "training mode at inference, or track_running_stats=False)", {}),
        ("running_statistics_swapped", lambda x, s: batch_normalize(x, var, mean, eps),
         "the candidate uses running_var as the mean and running_mean as the variance (the statistics swapped "
         "in a conversion)", {}),
        ("running_statistics_missing", lambda x, s: batch_normalize(x, torch.zeros_like(mean), torch.ones_like(var),
                                                                     eps),
         "the candidate normalises with mean 0 and variance 1, a fresh module's: the running statistics were "
         "not loaded", {}),
        ("eps_outside_sqrt", lambda x, s: (x - mean) / (torch.sqrt(var) + eps),
         "the candidate computes (x - running_mean) / (sqrt(running_var) + eps): eps is outside the root",
         {"form": "(x - running_mean) / (sqrt(running_var) + eps)"}),
    ]
    def moments_slack(x):
        """What float32 batch moments may carry in any summation order (XLA's, flax's fast variance
        E[x^2] - E[x]^2 clipped at 0): mean within (n + 1) u mean|x|, the variance within
        (n + 2) u (E[x^2] + m^2) + 2 |m| of that, each moving w h by its derivative."""
        u, n = 2.0 ** -24, x.shape[0]
        h = x.to(torch.float64)
        m, v = h.mean(0), h.var(0, unbiased=False)
        dm = (n + 1) * u * h.abs().mean(0)
        dv = (n + 2) * u * ((h * h).mean(0) + m * m) + 2 * m.abs() * dm
        root = torch.sqrt(v + eps)
        return slack(x) + gain.abs() * (dm / root + 0.5 * (h - m).abs() * dv / root ** 3)

    found = []
    alternatives = {"batch_statistics": ((batch_statistics, slack), (batch_statistics_at_dtype, slack),
                                         (batch_statistics_mean_of_squares, slack), (batch_statistics, moments_slack))}
    for code, variant, message, evidence in hypotheses:
        forms = alternatives.get(code, ((variant, slack),))
        if all(any(_reproduces([s], form, tol, gain, bias, room) for form, room in forms) for s in compared):
            found.append(Diagnosis(code, message, dict(evidence)))
            break
    if not found:
        estimate = estimate_eps(compared_strata(failing) or compared, mean, var, gain, bias)
        tried = [v for v in COMMON_EPS if v != eps]
        if estimate is not None and math.isfinite(estimate) and estimate >= 0:
            tried.sort(key=lambda v: abs(math.log((v + 1e-300) / (estimate + 1e-300))))
            tried = tried[:3] + [estimate]
        for value in tried:
            if _reproduces(compared, with_eps(value), tol, gain, bias, slack):
                smallest = float(var.min())
                found.append(Diagnosis(
                    "eps_mismatch",
                    f"the candidate behaves as if eps = {value:.3g} where the layer's eps is {eps:.3g} "
                    f"({layer.eps.source}); the channels with the smallest running_var / eps show it first "
                    f"(here {smallest / eps if eps > 0 else math.inf:.3g})",
                    {"estimated_eps": value, "configured_eps": eps, "eps_source": layer.eps.source,
                     "raw_estimate": estimate,
                     "smallest_running_var_over_eps": smallest / eps if eps > 0 else math.inf}))
                break
    if found:
        return found
    return [_symptom(failing, var, eps)]


def _symptom(failing, var, eps: float) -> Diagnosis:
    """No known fault reproduces it: which channels fail, and where they sit on running_var / eps."""
    import torch

    channels = torch.zeros(var.numel(), dtype=torch.bool)
    for s in failing:
        if s.bad is not None:
            channels |= s.bad.reshape(-1, var.numel()).any(0).cpu()
    names = sorted(s.name for s in failing)
    if bool(channels.any()) and eps > 0:
        ratio = var[channels] / eps
        where = (f"{int(channels.sum())} of {var.numel()} channels fail, their running_var / eps "
                 f"{float(ratio.min()):.3g} to {float(ratio.max()):.3g} (the layer's: "
                 f"{float((var / eps).min()):.3g} to {float((var / eps).max()):.3g})")
    else:
        where = "the failing elements' channels are not known"
    if names == ["large"]:
        return Diagnosis("symptom_large_inputs", f"errors only at large |x| ({where}); no known fault reproduces "
                         "it: an intermediate overflowing the candidate's dtype", {"strata": names})
    return Diagnosis("unexplained", f"no known BatchNorm fault (eps, batch statistics, swapped or missing running "
                     f"statistics, eps outside the root) reproduces the candidate; {where}", {"strata": names})
