"""Stage 6 for a gated RMSNorm: which fault reproduces the candidate.

What a port of a gated norm gets wrong is its structure: the gate applied after the statistic
where the model applies it before (Mamba's `norm_before_gate=False`) or the reverse, the gate
dropped, sigmoid where the model uses silu (or the reverse), the statistic over the whole row
where the model takes it per group (Mamba2's n_groups), and eps. Closed gates (act(z) ~ 0) before
the statistic make q tiny, so eps shows there. A cause is stated only when its float64
transcription reproduces every compared element within the tolerance."""

from __future__ import annotations

from parity_cli.diagnose.batch_norm import COMMON_EPS
from parity_cli.diagnose.causes import Diagnosis, opening, reproduces


def _reproduces(strata, variant, tol, dtype) -> bool:
    """variant(x) -> the float64 output: within the tolerance, with the gate's one more unit of
    rounding at a half dtype, as check_layer allows."""
    import torch

    unit = float(torch.finfo(dtype).eps) if dtype in (torch.float16, torch.bfloat16) else 0.0
    return reproduces(strata, lambda s: variant(s.x), lambda s, y: tol.atol + (tol.rtol + unit) * y.abs())


def diagnose_gated(layer, strata, gain, eps: float, tol, dtype, exact: bool = False) -> list[Diagnosis]:
    from parity_cli.backends.implementations import gated_normalize, oracle_normalize, split_gate

    done, compared = opening(strata, dtype, exact)
    if done is not None:
        return done
    failing = [s for s in strata if s.status != "pass"]

    def variant(gate=None, groups=None, activation=None, value=eps):
        def run(x2):
            normed, after = gated_normalize(x2, layer, value, gate=gate, groups=groups, activation=activation)
            y = normed * gain
            return y if after is None else y * after
        return run

    def ungated(x2):
        x, _ = split_gate(x2, layer)
        n = x.shape[0]
        return oracle_normalize(x.reshape(n, layer.groups, -1), eps, "rms_norm").reshape(n, -1) * gain

    other_gate = "after" if layer.gate == "before" else "before"
    other_act = "sigmoid" if layer.activation == "silu" else "silu"
    hypotheses = [
        ("gate_position_mismatch", variant(gate=other_gate),
         f"the candidate applies the gate {other_gate} the statistic where the model applies it {layer.gate} "
         f"({'RMSNorm(x * act(z))' if layer.gate == 'before' else 'RMSNorm(x) * act(z)'} expected)",
         {"gate": layer.gate, "candidate_gate": other_gate}),
        ("gate_missing", ungated, "the candidate ignores the gate: a plain RMSNorm of x", {"gate": layer.gate}),
        ("gate_activation_mismatch", variant(activation=other_act),
         f"the candidate gates with {other_act}(z) where the model uses {layer.activation}(z)",
         {"activation": layer.activation, "candidate_activation": other_act}),
    ]
    for g in sorted({1, 2, 4, 8, layer.groups * 2, layer.groups // 2} - {0, layer.groups}):
        if g >= 1 and layer.dim % g == 0:
            hypotheses.append(("group_count_mismatch", variant(groups=g),
                               f"the candidate takes the statistic over {g} group{'s' if g != 1 else ''} of "
                               f"{layer.dim // g} where the model uses {layer.groups} of {layer.dim // layer.groups}",
                               {"groups": layer.groups, "candidate_groups": g}))
    for code, fn, message, evidence in hypotheses:
        if _reproduces(compared, fn, tol, dtype):
            return [Diagnosis(code, message, evidence)]
    for value in [v for v in COMMON_EPS if v != eps]:
        if _reproduces(compared, variant(value=value), tol, dtype):
            return [Diagnosis("eps_mismatch",
                              f"the candidate behaves as if eps = {value:.3g} where the layer's eps is {eps:.3g} "
                              f"({layer.eps.source}); rows whose gate closes "
                              f"{'before the statistic' if layer.gate == 'before' else ''} show it first",
                              {"estimated_eps": value, "configured_eps": eps, "eps_source": layer.eps.source})]
    ranges = [s.failing_q_over_eps for s in failing if s.failing_q_over_eps]
    where = (f"failing groups at q/eps {min(r[0] for r in ranges):.3g} to {max(r[1] for r in ranges):.3g}"
             if ranges else "the failing groups are not known")
    return [Diagnosis("unexplained", "no known gated-norm fault (gate position, gate dropped, activation, group "
                      f"count, eps) reproduces the candidate; {where}", {"strata": sorted(s.name for s in failing)})]
