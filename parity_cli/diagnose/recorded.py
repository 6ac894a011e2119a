"""Causes for a layer judged on a runtime capture. The runtime recorded what it used (the eps of
its node, the gain and bias tensors it attached), so those are tried first: where the float64 norm
with the runtime's own parameters reproduces every recorded output row, the runtime's kernel did
what it was told and each parameter that differs from the reference is the cause, read, not
estimated. Only where they do not reproduce the rows is the kernel itself at fault, and the
probes' own diagnosis stands."""

from __future__ import annotations

from parity_cli.diagnose.causes import Diagnosis


def _oracle(x, layer, eps: float):
    import torch

    from parity_cli.backends.implementations import oracle_normalize

    h = oracle_normalize(x.to(torch.float64), eps, layer.kind)
    y = h * (layer.gain_offset + layer.weight.to(torch.float64))
    return y if layer.bias is None else y + layer.bias.to(torch.float64)


def reproduced_by_own_parameters(copy, tol) -> bool:
    """Every recorded output within the tolerance of the float64 norm with the runtime's eps, gain,
    bias and kind (its rows, its dtype's allowance)."""
    import torch

    x, y = copy.recorded
    expected = _oracle(x, copy, copy.eps.value)
    got = y.to(torch.float64)
    allowed = tol.atol + tol.rtol * expected.abs()
    if copy.kind == "layer_norm":  # a float32 mean rounds: the same share check grants LayerNorm
        allowed = allowed + 4 * torch.finfo(torch.float32).eps * expected.abs().amax(-1, keepdim=True)
    return bool(((got - expected).abs() <= allowed).all())


def _gain_causes(layer, copy, findings: list, runtime: str) -> list[Diagnosis]:
    import torch

    ref = layer.gain_offset + layer.weight.to(torch.float64).reshape(-1)
    got = copy.gain_offset + copy.weight.to(torch.float64).reshape(-1)
    if ref.shape != got.shape or torch.equal(ref.to(torch.float32), got.to(torch.float32)):
        return []
    offset = (layer.semantic_offset if layer.semantic_offset is not None else layer.gain_offset) or 1.0
    for shift, what in ((offset, "twice"), (-offset, "not at all")):
        if bool(((got - ref - shift).abs() <= 1e-6 * (1 + ref.abs())).all()):
            return [Diagnosis("weight_offset_mismatch",
                              f"{runtime} multiplies by a gain {shift:+g} off the layer's: the +{offset:g} of the "
                              f"family's 1 + w applied {what} ({copy.tensor or 'its gain tensor'})",
                              {"offset_error": shift, "expected_offset": offset, "tensor": copy.tensor,
                               "read_from_copy": True})]
    stored = copy.weight.dtype
    if stored in (torch.float16, torch.bfloat16) and torch.equal(ref.to(stored).to(torch.float64), got):
        name = str(stored).removeprefix("torch.")
        return [Diagnosis("channel_gain_mismatch",
                          f"{runtime} multiplies by the layer's gain rounded to {name}, as its file stores it "
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
        code = "variance_not_mean_square" if layer.kind == "rms_norm" else "unexplained"
        causes.append(Diagnosis(code, f"{runtime} runs a {copy.kind} node where the layer is a {layer.kind}",
                                {"runtime_kind": copy.kind}))
    if not eps_equal(layer.eps.value, copy.eps.value):
        causes.append(Diagnosis("eps_mismatch",
                                f"{runtime} computes with eps = {copy.eps.value:.6g} ({copy.eps.source}) where the "
                                f"layer's eps is {layer.eps.value:.6g} ({layer.eps.source})",
                                {"estimated_eps": copy.eps.value, "configured_eps": layer.eps.value,
                                 "eps_source": layer.eps.source, "read_from_copy": True}))
    causes += _gain_causes(layer, copy, findings, runtime)
    if (layer.bias is None) != (copy.bias is None) or (
            layer.bias is not None and not torch.equal(layer.bias.to(torch.float32), copy.bias.to(torch.float32))):
        causes.append(Diagnosis("unexplained", f"{runtime} adds another bias than the layer's", {"bias": True}))
    return causes


def recorded_diagnoses(layer, copy, diagnoses: list, findings: list, tol, runtime: str) -> list[Diagnosis]:
    """The causes a runtime-capture layer reports: its parameters' where they reproduce the rows,
    else the probes' diagnosis with the parameter differences beside it."""
    causes = parameter_causes(layer, copy, findings, runtime)
    if causes and reproduced_by_own_parameters(copy, tol):
        return causes
    codes = {d.code for d in causes}
    return causes + [d for d in diagnoses if d.code not in codes]
