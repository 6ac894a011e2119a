"""Stage 2b (--candidate-checkpoint): the original checkpoint against a converted copy.

Each side's layers are read with that side's own family conventions (a GGUF Gemma stores
1 + w, an HF Gemma stores w), so weights are compared as effective gains. Every difference is
a finding that fails the layer (or the report, for layers only the copy has)."""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from parity_cli.layers import NormLayer


@dataclass
class Pairing:
    candidate_layers: dict[str, NormLayer]  # reference layer name -> the copy's layer
    layer_findings: dict[str, list[dict]] = field(default_factory=dict)
    report_findings: list[dict] = field(default_factory=list)


def _rounded(values, dtype):
    """float64 values as the copy's dtype stores them."""
    import torch

    return values.to(dtype).to(torch.float64)


def eps_equal(a: float, b: float) -> bool:
    """Equal once both are float32: GGUF stores eps as float32, so 1e-5 read back as
    9.99999974738e-06 is the same eps; 1e-6 against 1e-5 is not."""
    import struct

    return struct.pack("<f", a) == struct.pack("<f", b)


def _gain_finding(code: str, what: str, ref, cand, ref_dtype, cand_dtype, baked: bool) -> dict | None:
    """Per channel |cand - ref|: exact agreement is expected, except the float32 rounding of
    offset + w when the copy stores the gain with the offset baked in (llama.cpp's Gemma)."""
    import torch

    if tuple(ref.shape) != tuple(cand.shape):
        return {"code": "checkpoint_shape_mismatch",
                "message": f"{what}: shape {list(cand.shape)} in the candidate checkpoint, {list(ref.shape)} in the reference",
                "reference_shape": list(ref.shape), "candidate_shape": list(cand.shape)}
    ref64, cand64 = ref.to(torch.float64).flatten(), cand.to(torch.float64).flatten()
    allowed = torch.zeros_like(ref64)
    if baked:
        mag = torch.maximum(ref64.abs(), cand64.abs())
        exponent = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
        allowed = 0.5 * torch.pow(2.0, exponent - 23) * 1.001  # half a float32 ulp at |gain|
    diff = (cand64 - ref64).abs()
    bad = ~(diff <= allowed) | (torch.isnan(cand64) != torch.isnan(ref64))
    bad &= ~(torch.isnan(cand64) & torch.isnan(ref64))
    count = int(bad.sum())
    if not count:
        return None
    idx = torch.nonzero(bad).flatten()[:10].tolist()
    delta = (cand64 - ref64)[bad]
    finding = {
        "code": code,
        "message": f"{what} differs in {count} of {ref64.numel()} channels (max |diff| {float(diff[bad].max()):.4g})",
        "affected_channels": count,
        "max_abs_diff": float(diff[bad].max()),
        "channels": [{"channel": j, "reference": float(ref64[j]), "candidate": float(cand64[j])} for j in idx],
    }
    mean = float(delta.mean())
    shift = round(mean) if math.isfinite(mean) else 0  # a NaN gain has no shift to name
    if count == ref64.numel() and shift and bool(((delta - shift).abs() < 1e-2).all()):
        finding["uniform_shift"] = float(shift)
        finding["message"] += (f"; every channel is shifted by {shift:+g}: a gain offset (1 + w) "
                               + ("applied twice" if shift > 0 else "missing") + " in the conversion")
    elif bool((cand64[bad] == _rounded(ref64, cand_dtype)[bad]).all()):
        # every differing channel is the reference rounded to the copy's dtype, and nothing else
        finding["precision_loss"] = True
        finding["message"] += (f"; the candidate stores {str(cand_dtype).removeprefix('torch.')}, which does not hold "
                               f"the reference's {str(ref_dtype).removeprefix('torch.')} values exactly")
    return finding


def pair(reference: list[NormLayer], candidate: list[NormLayer], cand_path: str) -> Pairing:
    by_name = {layer.name: layer for layer in candidate}
    ref_names = {layer.name for layer in reference}
    out = Pairing(candidate_layers={})
    for layer in reference:
        findings = []
        other = by_name.get(layer.name)
        if other is None:
            findings.append({"code": "checkpoint_layer_missing",
                             "message": f"{layer.name} is missing from the candidate checkpoint {cand_path}"})
            out.layer_findings[layer.name] = findings
            continue
        out.candidate_layers[layer.name] = other
        if not eps_equal(layer.eps.value, other.eps.value):
            findings.append({
                "code": "checkpoint_eps_mismatch",
                "message": f"eps {other.eps.value:.6g} ({other.eps.source}) in the candidate checkpoint, "
                           f"{layer.eps.value:.6g} ({layer.eps.source}) in the reference",
                "reference": {"value": layer.eps.value, "source": layer.eps.source},
                "candidate": {"value": other.eps.value, "source": other.eps.source},
            })
        ref_gain = layer.gain_offset + layer.weight.double()
        cand_gain = other.gain_offset + other.weight.double()
        gain = _gain_finding("checkpoint_weight_mismatch", "effective gain", ref_gain, cand_gain,
                             layer.weight.dtype, other.weight.dtype, baked=layer.gain_offset != other.gain_offset)
        if gain:
            gain["reference_dtype"] = str(layer.weight.dtype).removeprefix("torch.")
            gain["candidate_dtype"] = str(other.weight.dtype).removeprefix("torch.")
            findings.append(gain)
        if (layer.bias is None) != (other.bias is None):
            findings.append({"code": "checkpoint_bias_mismatch",
                             "message": "bias only in the " + ("reference" if other.bias is None else "candidate")})
        elif layer.bias is not None:
            bias = _gain_finding("checkpoint_bias_mismatch", "bias", layer.bias, other.bias,
                                 layer.bias.dtype, other.bias.dtype, baked=False)
            if bias:
                findings.append(bias)
        if findings:
            out.layer_findings[layer.name] = findings
    for name in sorted(set(by_name) - ref_names):
        out.report_findings.append({"code": "checkpoint_layer_extra", "layer": name,
                                    "message": f"{name} is in the candidate checkpoint {cand_path} but not in the reference"})
    return out
