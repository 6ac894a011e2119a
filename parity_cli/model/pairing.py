"""Stage 2b (--candidate-checkpoint): the original checkpoint against a converted copy.

Each side's layers are read with that side's own family conventions (a GGUF Gemma stores
1 + w, an HF Gemma stores w), so weights are compared as effective gains. Every difference is
a finding that fails the layer (or the report, for layers only the copy has)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parity_cli.model.layers import NormLayer


@dataclass
class Pairing:
    candidate_layers: dict[str, NormLayer]  # reference layer name -> the copy's layer
    layer_findings: dict[str, list[dict]] = field(default_factory=dict)
    report_findings: list[dict] = field(default_factory=list)


def _rounded(values, dtype):
    """float64 values as the copy's dtype stores them."""
    import torch

    return values.to(dtype).to(torch.float64)


def half_step(values, dtype_name: str):
    """Half the spacing of `dtype_name`'s values at each of `values` (float64): 2^(e - p - 1) for
    |v| in [2^e, 2^(e+1)), p the dtype's mantissa bits; constant below the smallest normal number."""
    import torch

    info = torch.finfo(getattr(torch, dtype_name))
    _, exp = torch.frexp(values.abs())  # |v| = m * 2^exp, m in [0.5, 1): the binade is 2^(exp - 1)
    binade = torch.where(values == 0, torch.zeros_like(values), torch.ldexp(torch.ones_like(values), exp - 1))
    return binade.clamp_min(info.tiny) * info.eps / 2


def rounding_bound(a, a_dtype: str, b, b_dtype: str):
    """How far apart two stored copies of one gain can be, element by element: each copy is the gain
    (less its own stored offset) rounded to nearest in its own dtype, and a round to nearest moves a
    value by at most half a step of that dtype at the rounded result (the step at the true value is
    never larger). So |a - b| <= half_step(a) + half_step(b); for float32 against bfloat16 at |a| in
    [1, 2): 2^-24 + 2^-8. The same dtype and offset: both are one rounding of one value, bound 0."""
    return half_step(a, a_dtype) + half_step(b, b_dtype)


def eps_equal(a: float, b: float) -> bool:
    """Equal once both are float32: GGUF stores eps as float32, so 1e-5 read back as
    9.99999974738e-06 is the same eps; 1e-6 against 1e-5 is not."""
    import struct

    try:
        return struct.pack("<f", a) == struct.pack("<f", b)
    except OverflowError:  # beyond float32: no copy stores it, so equal only to itself
        return a == b


def _lost_to(ref64, cand64, bad, cand_dtype, stored) -> str | None:
    """The dtype the copy's differing channels are the reference rounded to: the sum (offset + w,
    an ONNX float16 conversion of Gemma's folded gain), w before a float32 offset was added (a
    graph that upcasts w, then folds 1 + w), or the stored w where the copy keeps the offset apart.
    `stored`: (reference w, copy w, reference offset)."""
    import torch

    for dtype in dict.fromkeys((cand_dtype, torch.float16, torch.bfloat16)):
        if not dtype.is_floating_point or torch.finfo(dtype).bits >= 32 and dtype != cand_dtype:
            continue
        forms = [_rounded(ref64, dtype)]
        if stored is not None and tuple(stored[0].shape) == tuple(stored[1].shape):
            ref_w, cand_w, offset = (stored[0].double().flatten(), stored[1].double().flatten(), stored[2])
            forms.append(_rounded(offset + _rounded(ref_w, dtype), torch.float32))
            if bool(((cand64 - ref64) == (cand_w - ref_w)).all()):  # the same offset on both sides
                forms.append(offset + _rounded(ref_w, dtype))
        if any(bool((cand64[bad] == form[bad]).all()) for form in forms):
            return str(dtype).removeprefix("torch.")
    return None


def _gain_finding(code: str, what: str, ref, cand, ref_dtype, cand_dtype, baked: bool,
                  family_offset: float = 1.0, stored: tuple | None = None) -> dict | None:
    """Per channel |cand - ref|: exact agreement is expected, except the float32 rounding of
    offset + w when the copy stores the gain with the offset baked in (llama.cpp's Gemma).
    `stored` (the reference's w, the copy's w, the reference's offset): a copy's precision loss
    may be in w rather than in the sum (_lost_to)."""
    import torch

    if tuple(ref.shape) != tuple(cand.shape):
        return {"code": "checkpoint_shape_mismatch",
                "message": f"{what}: shape {list(cand.shape)} in the candidate checkpoint, {list(ref.shape)} in the reference",
                "reference_shape": list(ref.shape), "candidate_shape": list(cand.shape)}
    ref64, cand64 = ref.to(torch.float64).flatten(), cand.to(torch.float64).flatten()
    allowed = torch.zeros_like(ref64)
    if baked:
        mag = torch.maximum(ref64.abs(), cand64.abs())
        allowed = half_step(mag, "float32") * 1.001  # the converter's float32 rounding of offset + w
        if ref_dtype == torch.float16:
            # llama.cpp's converter adds the offset in a float16 checkpoint's own dtype (it upcasts
            # only other dtypes first): one more float16 rounding of the gain. A copy that stores
            # float16 gains from a wider checkpoint has lost precision, which is a finding
            allowed = allowed + half_step(mag, "float16") * 1.001
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
    # a shift is whole up to 1e-2, or up to two roundings of the copy's dtype at its gains' size (a
    # bfloat16 runtime that adds its own 1 to a gain already holding one: 1 + (1 + w), each sum rounded)
    narrow = str(cand_dtype).removeprefix("torch.")
    noise = 2 * half_step(cand64[bad], narrow) if narrow in ("bfloat16", "float16") else torch.zeros_like(delta)
    if count == ref64.numel() and shift and bool(((delta - shift).abs() <= noise.clamp_min(1e-2)).all()):
        finding["uniform_shift"] = float(shift)
        if family_offset == 0 and shift > 0:  # a gain that is w, given a converter's + 1 (as for its 1 + w neighbours)
            finding["message"] += (f"; every channel is shifted by {shift:+g}: an offset added in the conversion to a "
                                   "gain that is w (this norm has no 1 + w)")
        else:
            finding["message"] += (f"; every channel is shifted by {shift:+g}: a gain offset (1 + w) "
                                   + ("applied twice" if shift > 0 else "missing") + " in the conversion")
    else:
        lost = _lost_to(ref64, cand64, bad, cand_dtype, stored)
        if lost:  # every differing channel is the reference rounded to a narrower dtype, and nothing else
            finding["precision_loss"] = True
            finding["lost_to"] = lost
            finding["message"] += (f"; the candidate's gains passed through {lost}, which does not hold the "
                                   f"reference's {str(ref_dtype).removeprefix('torch.')} values exactly")
    return finding


# a copy's layer matched to the reference by the values of its gain (an exported graph whose names
# and node paths name no layer): said as a warning of the layer, and its graph order is checked
BY_VALUE = ("paired with the copy's norm by its gain's values: the graph's names and node paths name no "
            "checkpoint layer, so a gain moved to another layer is caught only by the graph's order")


def graph_layer(layer, norm, findings: list):
    """A copy's layer read from a graph (ONNX, an IR) with what the graph says of it: its own
    findings (pair reports them), the norm's depth in the data flow (the order check's) and the
    dtype its own node computes in (a converter's half node inside a float32 graph)."""
    if findings:
        layer.graph_findings = findings
    layer.graph_depth = norm.depth
    layer.computes_in = getattr(norm, "computes_in", None) or norm.dtype
    return layer


def _effective(layer):
    return layer.gain_offset + layer.weight.double()


def _gain_owner(reference: list[NormLayer]):
    """(layer, its copy) -> the other reference layers whose effective gain the copy holds exactly
    (as the copy's dtype stores it): a gain moved from one layer to another."""
    import torch

    index: dict = {}

    def owners(layer, other) -> list[str]:
        dtype = other.weight.dtype if other.weight.is_floating_point() else torch.float64
        table = index.get(dtype)
        if table is None:
            table = index[dtype] = {}
            for ref in reference:
                key = (tuple(ref.weight.shape), _rounded(_effective(ref), dtype).numpy().tobytes())
                table.setdefault(key, []).append(ref.name)
        key = (tuple(other.weight.shape), _rounded(_effective(other), dtype).numpy().tobytes())
        return [name for name in table.get(key, []) if name != layer.name]

    return owners


def _depth(layer, k: int) -> tuple:
    """Where a copy's norm runs: its depth in the graph's data flow (onnx_graph.norm_depths), then
    its place in the graph's list."""
    return (getattr(layer, "graph_depth", k), k)


def _order_findings(reference: list[NormLayer], candidate: list[NormLayer],
                    forward: dict[str, int] | None = None) -> dict[str, dict]:
    """A copy paired by value must run the norms holding each layer's gain where the model runs
    that layer. With the model's forward order (installed.forward_order): among the value-paired
    norms of one width, the n-th deepest in the graph holds the gain of the n-th the model calls;
    norms level in the data flow (q_norm beside k_norm) may come in either order. Without it: within
    each role (`model.layers.*.input_layernorm`), layer 0's, 1's, ... gains in that order. A gain
    moved to another layer runs out of place, which the values alone never show."""
    paired = [(k, layer) for k, layer in enumerate(candidate) if BY_VALUE in layer.warnings]
    if not paired:
        return {}
    ref_names = {layer.name for layer in reference}
    paired = [(k, layer) for k, layer in paired if layer.name in ref_names]
    if forward:
        placed = [(k, layer) for k, layer in paired if layer.name in forward]
        widths: dict = {}
        for k, layer in placed:
            widths.setdefault((layer.dim, layer.weight.numel()), []).append((k, layer))
        out = {}
        for group in widths.values():
            out.update(_out_of_place(sorted(group, key=lambda item: _depth(item[1], item[0])), forward))
        return out
    return _out_of_role(paired, ref_names)


def _out_of_place(graph: list, forward: dict[str, int]) -> dict[str, dict]:
    expected = sorted((layer.name for _, layer in graph), key=forward.__getitem__)
    out, i = {}, 0
    while i < len(graph):
        j = i
        while j < len(graph) and _depth(graph[j][1], 0)[0] == _depth(graph[i][1], 0)[0]:
            j += 1
        want = expected[i:j]
        for k in range(i, j):
            layer = graph[k][1]
            if layer.name not in want:
                place = want[k - i] if len(want) == 1 else " or ".join(want)
                out[layer.name] = _misplaced(layer.name, place, "the model's forward order")
        i = j
    return out


def _out_of_role(paired: list, ref_names: set) -> dict[str, dict]:
    import re

    digits = re.compile(r"(?<![^.])\d+(?![^.])")
    roles: dict[str, list] = {}
    for _k, layer in sorted(paired, key=lambda item: _depth(item[1], item[0])):  # the copy's own order
        if digits.search(layer.name):
            roles.setdefault(digits.sub("*", layer.name), []).append(layer)
    out = {}
    for layers in roles.values():
        key = [tuple(int(d) for d in digits.findall(layer.name)) for layer in layers]
        expected = sorted(range(len(layers)), key=lambda k: key[k])
        for k, layer in enumerate(layers):
            place = layers[expected[k]].name
            if place != layer.name:
                out[layer.name] = _misplaced(layer.name, place, "the checkpoint's layer order")
    return out


def _misplaced(name: str, place: str, order: str) -> dict:
    return {"code": "checkpoint_layer_order",
            "message": f"the copy's norm holding {name}'s gain runs where the model runs {place}: the graph's "
                       f"order disagrees with {order} (a gain moved to another layer)",
            "graph_position": place}


def _shape_of(layers: list[NormLayer]) -> dict:
    """Family, blocks and widths: what says which model a list of norm layers belongs to."""
    import re
    from collections import Counter

    blocks = {int(m.group(1)) for l in layers for m in [re.search(r"\.(\d+)\.", l.name)] if m}
    dims = Counter(l.dim for l in layers)
    families = Counter(l.family for l in layers if l.family and l.family != "onnx")
    return {"family": families.most_common(1)[0][0] if families else None, "blocks": len(blocks),
            "width": dims.most_common(1)[0][0] if dims else None, "widths": sorted(dims)}


def _model_mismatch(reference: list[NormLayer], candidate: list[NormLayer], cand_path: str) -> dict | None:
    """The copy is another model when its family or its main width (the hidden size: no conversion
    changes it) differs; a dropped block alone is a conversion fault, which the layers report."""
    if not reference or not candidate:
        return None
    ref, cand = _shape_of(reference), _shape_of(candidate)
    if (ref["width"] == cand["width"]) and (None in (ref["family"], cand["family"]) or ref["family"] == cand["family"]):
        return None

    def words(d):
        return (f"family {d['family'] or 'unknown'}, {d['blocks']} blocks, widths "
                f"{', '.join(str(w) for w in d['widths'])}")

    return {"code": "checkpoint_model_mismatch", "layer": "*",
            "message": f"the candidate checkpoint {cand_path} is a different model: {words(cand)}; the reference: "
                       f"{words(ref)}",
            "reference": ref, "candidate": cand}


def _statistics_findings(layer: NormLayer, other: NormLayer) -> list[dict]:
    """A BatchNorm's running statistics are weights too: a copy that changed them (or lost them:
    normalising with the batch's) computes another function with the same gain."""
    if layer.kind != "batch_norm":
        return []
    if other.running_var is None:
        return [{"code": "checkpoint_statistics_mismatch",
                 "message": "the candidate checkpoint has no running statistics for this BatchNorm"}]
    out = []
    for what, ref, cand in (("running mean", layer.running_mean, other.running_mean),
                            ("running variance", layer.running_var, other.running_var)):
        found = _gain_finding("checkpoint_statistics_mismatch", what, ref, cand, ref.dtype, cand.dtype, baked=False)
        if found:
            found["statistic"] = what
            out.append(found)
    return out


def pair(reference: list[NormLayer], candidate: list[NormLayer], cand_path: str,
         forward: dict[str, int] | None = None) -> Pairing:
    """`forward`: the model's forward order of the reference layers, where known (a copy paired by
    value is checked against it)."""
    by_name = {layer.name: layer for layer in candidate}
    ref_names = {layer.name for layer in reference}
    out = Pairing(candidate_layers={})
    owners = _gain_owner(reference)
    order = _order_findings(reference, candidate, forward)
    other_model = _model_mismatch(reference, candidate, cand_path)
    if other_model:  # said first: every layer's difference follows from it
        out.report_findings.append(other_model)
    for layer in reference:
        findings = []
        other = by_name.get(layer.name)
        if other is None:
            findings.append({"code": "checkpoint_layer_missing",
                             "message": f"{layer.name} is missing from the candidate checkpoint {cand_path}"})
            out.layer_findings[layer.name] = findings
            continue
        out.candidate_layers[layer.name] = other
        if BY_VALUE in other.warnings and BY_VALUE not in layer.warnings:
            layer.warnings.append(BY_VALUE)  # the reference layer's warnings are the report's
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
                             layer.weight.dtype, other.weight.dtype, baked=layer.gain_offset != other.gain_offset,
                             family_offset=layer.gain_offset if layer.semantic_offset is None else layer.semantic_offset,
                             stored=(layer.weight, other.weight, layer.gain_offset))
        if gain and gain["code"] == "checkpoint_shape_mismatch":  # nothing to probe: it would only raise
            del out.candidate_layers[layer.name]
        if gain:
            gain["reference_dtype"] = str(layer.weight.dtype).removeprefix("torch.")
            gain["candidate_dtype"] = str(other.weight.dtype).removeprefix("torch.")
            findings.append(gain)
            moved = owners(layer, other) if gain["code"] == "checkpoint_weight_mismatch" else []
            if moved:
                findings.append({"code": "checkpoint_gain_of_other_layer",
                                 "message": f"the copy's gain here is exactly the reference's gain of {moved[0]}"
                                            + (f" (and {len(moved) - 1} more)" if len(moved) > 1 else "")
                                            + ": gains swapped or assigned to the wrong layer",
                                 "layers": moved[:10]})
        if layer.name in order:
            findings.append(order[layer.name])
        findings += getattr(other, "graph_findings", [])  # what the copy's graph itself computes (onnx_checkpoint)
        if layer.kind in ("group_norm", "gated_rms_norm") and other.kind == layer.kind and other.groups != layer.groups:
            findings.append({"code": "group_count_mismatch", "groups": other.groups, "checkpoint_groups": layer.groups,
                             "message": f"the candidate checkpoint normalises {other.groups} group(s) of "
                                        f"{other.dim // max(other.groups, 1)} channels; the reference {layer.groups} "
                                        f"of {layer.dim // max(layer.groups, 1)}"})
        if (layer.bias is None) != (other.bias is None):
            findings.append({"code": "checkpoint_bias_mismatch",
                             "message": "bias only in the " + ("reference" if other.bias is None else "candidate")})
        elif layer.bias is not None:
            bias = _gain_finding("checkpoint_bias_mismatch", "bias", layer.bias, other.bias,
                                 layer.bias.dtype, other.bias.dtype, baked=False)
            if bias:
                findings.append(bias)
        findings += _statistics_findings(layer, other)
        if findings:
            out.layer_findings[layer.name] = findings
    for name in sorted(set(by_name) - ref_names):
        out.report_findings.append({"code": "checkpoint_layer_extra", "layer": name,
                                    "message": f"{name} is in the candidate checkpoint {cand_path} but not in the reference"})
    return out
