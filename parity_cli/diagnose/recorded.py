"""Causes for a layer judged on a runtime capture. The runtime recorded what it used (the eps of
its node, the gain and bias tensors it attached), so those are tried first: where the float64 norm
with the runtime's own parameters reproduces every recorded output row, the runtime's kernel did
what it was told and each parameter that differs from the reference is the cause, read, not
estimated. Where they do not, an eps is estimated from the rows themselves (the node may record one
and compute with another); failing that the kernel itself is at fault and the probes' diagnosis
stands, the recorded differences staying findings."""

from __future__ import annotations

import dataclasses

from parity_cli.diagnose.causes import EPS_PANEL, Diagnosis


def reproduced_by_own_parameters(copy, tol) -> bool:
    """Every recorded output within the tolerance of the float64 oracle with the runtime's eps,
    gain, bias and kind (the same allowance a check grants: the dtype's, and for LayerNorm a mean
    summed in any order, comparison.mean_rounding_allowance)."""
    import torch

    from parity_cli.backends.implementations import BUILTINS
    from parity_cli.comparison import mean_rounding_allowance

    x, y = (t.to(torch.float64) for t in copy.recorded)
    expected = BUILTINS["oracle"].prepare(copy, copy.weight, copy.bias, copy.eps.value)(x)
    allowed = tol.atol + tol.rtol * expected.abs()
    if copy.kind == "layer_norm" and tol.mean_rounding:
        allowed = allowed + mean_rounding_allowance(x, copy.gain_offset + copy.weight.to(torch.float64),
                                                    copy.eps.value, tol)
    return bool(((y - expected).abs() <= allowed).all())


def estimated_eps(copy) -> float | None:
    """The eps the rows follow with the runtime's gain and bias: per row, x (less its mean for a
    LayerNorm) is k times the recorded h = (y - b) / g, k = sqrt(q + eps); the rows with the smallest
    q say the most. None where the rows say nothing (no row with a gain and an output)."""
    import torch

    x, y = (t.to(torch.float64) for t in copy.recorded)
    g = copy.gain_offset + copy.weight.to(torch.float64)
    keep = g.abs() > 1e-6
    if not bool(keep.any()):
        return None
    h = (y - (0 if copy.bias is None else copy.bias.to(torch.float64)))[:, keep] / g[keep]
    centred = x - x.mean(-1, keepdim=True) if copy.kind == "layer_norm" else x
    q = (centred * centred).mean(-1)
    xs = centred[:, keep]
    den = (h * h).sum(-1)
    ok = (den > 0) & torch.isfinite(den) & torch.isfinite((xs * h).sum(-1))
    if not bool(ok.any()):
        return None
    k = (xs * h).sum(-1)[ok] / den[ok]
    e = k * k - q[ok]
    small = q[ok] <= torch.quantile(q[ok], 0.25)
    return max(0.0, float(e[small].median()))


def _eps_from_rows(layer, copy, tol, runtime: str) -> Diagnosis | None:
    """An eps the rows follow where the recorded one does not reproduce them: the estimate, or the
    usual value nearest it, whichever reproduces every row."""
    import math

    from parity_cli.model.pairing import eps_equal

    guess = estimated_eps(copy)
    if guess is None:
        return None
    near = sorted({v for v in EPS_PANEL if v > 0} | {layer.eps.value},
                  key=lambda v: abs(math.log10(v) - math.log10(guess)) if guess > 0 else v)
    for value in near[:3] + [guess]:
        trial = dataclasses.replace(copy, eps=dataclasses.replace(copy.eps, value=value))
        if reproduced_by_own_parameters(trial, tol):
            if eps_equal(value, layer.eps.value):  # the rows follow the layer's own eps: no eps fault in them
                return None
            return Diagnosis("eps_mismatch",
                             f"{runtime}'s rows follow eps ≈ {value:.3g} (estimated from them) where the layer's eps is "
                             f"{layer.eps.value:.6g} ({layer.eps.source}); its node records {copy.eps.value:.6g}",
                             {"estimated_eps": value, "configured_eps": layer.eps.value,
                              "eps_source": layer.eps.source, "recorded_eps": copy.eps.value})
    return None


def _offset(layer) -> float:
    return layer.semantic_offset if layer.semantic_offset is not None else layer.gain_offset


def _gain_causes(layer, copy, findings: list, runtime: str) -> list[Diagnosis]:
    import torch

    ref = layer.gain_offset + layer.weight.to(torch.float64).reshape(-1)
    got = copy.gain_offset + copy.weight.to(torch.float64).reshape(-1)
    if ref.shape != got.shape or torch.equal(ref.to(torch.float32), got.to(torch.float32)):
        return []
    offset = _offset(layer)
    stored = copy.weight.dtype
    tol = 1e-6 * (1 + ref.abs())
    if stored in (torch.float16, torch.bfloat16):  # a runtime that holds its gains at half precision, and adds
        from parity_cli.model.pairing import half_step  # its own 1 there (mlx-lm's Gemma): two roundings

        tol = torch.maximum(tol, 2 * half_step(got, str(stored).removeprefix("torch.")))
    for shift, what in ((offset, "twice"), (-offset, "not at all")) if offset else ():
        if bool(((got - ref - shift).abs() <= tol).all()):
            return [Diagnosis("weight_offset_mismatch",
                              f"{runtime} multiplies by a gain {shift:+g} off the layer's: the +{offset:g} of the "
                              f"family's {offset:g} + w applied {what} ({copy.tensor or 'its gain tensor'})",
                              {"offset_error": shift, "expected_offset": offset, "tensor": copy.tensor,
                               "read_from_copy": True})]
    if stored in (torch.float16, torch.bfloat16) and torch.equal(ref.to(stored).to(torch.float64), got):
        name = str(stored).removeprefix("torch.")
        return [Diagnosis("channel_gain_mismatch",
                          f"{runtime} multiplies by the layer's gain rounded to {name}, as it holds it "
                          f"({copy.tensor or 'its gain tensor'}); the reference's gain is not a {name} value",
                          {"lost_to": name, "tensor": copy.tensor, "read_from_copy": True})]
    other = next((f for f in findings if f.get("code") == "checkpoint_gain_of_other_layer"), None)
    if other is not None:
        return [Diagnosis("channel_gain_mismatch",
                          f"{runtime} multiplies by {copy.tensor or 'a gain'} holding the gain of {other['layers'][0]}: "
                          "the wrong tensor attached to this norm",
                          {"gain_of": other["layers"][0], "tensor": copy.tensor, "read_from_copy": True})]
    count = int((ref.to(torch.float32) != got.to(torch.float32)).sum())
    return [Diagnosis("channel_gain_mismatch",
                      f"{runtime} multiplies by a gain that differs from the layer's in {count} of {ref.numel()} "
                      f"channels ({copy.tensor or 'its gain tensor'})",
                      {"channels": count, "tensor": copy.tensor, "read_from_copy": True})]


def parameter_causes(layer, copy, findings: list, runtime: str) -> list[Diagnosis]:
    """Each parameter the runtime used that differs from the reference's, as a cause."""
    import torch

    from parity_cli.model.pairing import eps_equal

    causes = []
    if layer.kind != copy.kind:
        code, what = (("mean_subtracted", "subtracts the mean (LayerNorm semantics)") if copy.kind == "layer_norm"
                      else ("mean_not_subtracted", "does not subtract the mean (RMSNorm semantics)"))
        causes.append(Diagnosis(code, f"{runtime} runs a {copy.kind} node where the layer is a {layer.kind}: it "
                                      f"{what}", {"runtime_kind": copy.kind, "read_from_copy": True}))
    if not eps_equal(layer.eps.value, copy.eps.value):
        causes.append(Diagnosis("eps_mismatch",
                                f"{runtime} computes with eps = {copy.eps.value:.6g} ({copy.eps.source}) where the "
                                f"layer's eps is {layer.eps.value:.6g} ({layer.eps.source})",
                                {"estimated_eps": copy.eps.value, "configured_eps": layer.eps.value,
                                 "eps_source": layer.eps.source, "read_from_copy": True}))
    causes += _gain_causes(layer, copy, findings, runtime)
    if (layer.bias is None) != (copy.bias is None):
        causes.append(Diagnosis("bias_mismatch", f"{runtime} adds a bias where the layer has none" if layer.bias is None
                                else f"{runtime} adds no bias where the layer has one",
                                {"tensor": copy.tensor, "read_from_copy": True}))
    elif layer.bias is not None and not torch.equal(layer.bias.to(torch.float32), copy.bias.to(torch.float32)):
        count = int((layer.bias.to(torch.float32) != copy.bias.to(torch.float32)).sum())
        causes.append(Diagnosis("bias_mismatch", f"{runtime} adds a bias that differs from the layer's in {count} of "
                                                 f"{layer.dim} channels", {"channels": count, "read_from_copy": True}))
    return causes


def recorded_diagnoses(layer, copy, diagnoses: list, findings: list, tol, runtime: str) -> list[Diagnosis]:
    """The causes a runtime-capture layer reports: its recorded parameters' where they reproduce the
    rows; else an eps its rows follow; else the probes' diagnosis (a kernel fault)."""
    if reproduced_by_own_parameters(copy, tol):
        causes = parameter_causes(layer, copy, findings, runtime)
        return causes or diagnoses
    estimated = _eps_from_rows(layer, copy, tol, runtime)
    if estimated is not None:
        others = [c for c in parameter_causes(layer, copy, findings, runtime) if c.code != "eps_mismatch"]
        return [estimated] + others
    return diagnoses
