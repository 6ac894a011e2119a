"""An OpenVINO IR's norms as the model's layers: each under the reference layer it stands for (by
the names the IR keeps, or by value where none says anything), with the IR's eps, gain and subgraph,
and what the IR itself says of it (an MVN with eps outside the root, a reduction cast to half)."""

from __future__ import annotations

from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.model.layers import NormLayer
from parity_cli.model.pairing import BY_VALUE, graph_layer
from parity_cli.sources.onnx_graph import _match_by_gain, _match_by_name, distinct_norms, reduced_words
from parity_cli.sources.openvino_ir import find_norms, folded_batch_norms, producer, read_model
from parity_cli.sources.tensors import Eps

OUTSIDE_WORDS = ("the IR's {form} has eps_mode=outside_sqrt: it computes (x - mean) / (sqrt(var) + eps), "
                 "eps outside the root, where the checkpoint's LayerNorm has sqrt(var + eps)")


def graph_findings(norm, ref) -> list[dict]:
    """What the IR says of one norm before anything runs."""
    findings = []
    if norm.reduced:
        findings.append({"code": "reduced_precision_reduction", "message": reduced_words(norm.reduced).replace(
            "ONNX Runtime's CPU provider has no", "a plugin without a").replace("drops the pair", "may drop the pair"),
            "reduction_dtype": norm.reduced})
    if norm.eps_stored in ("f16", "bf16") and ref is not None and norm.eps != ref.eps.value:
        import torch

        name = {"f16": "float16", "bf16": "bfloat16"}[norm.eps_stored]
        rounded = float(torch.tensor(ref.eps.value, dtype=torch.float64).to(getattr(torch, name)))
        why = (f"the checkpoint's {ref.eps.value:.6g} rounded to {name}" if rounded == norm.eps else
               f"where the checkpoint has {ref.eps.value:.6g}")
        findings.append({"code": "eps_mismatch", "stored_as": norm.eps_stored, "value": norm.eps,
                         "configured_eps": ref.eps.value,
                         "message": f"the IR stores eps as {name}: {norm.eps:.6g}, {why} (a half-precision model's "
                                    "conversion writes its eps Constant at the model's type)"})
    if norm.eps_mode == "outside_sqrt":
        findings.append({"code": "eps_outside_sqrt", "message": OUTSIDE_WORDS.format(form=norm.form),
                         "form": norm.form})
    return findings


def candidate_layers(path, reference: list) -> tuple[list, dict]:
    """The IR's norms as NormLayers under the reference's names (their family's conventions, the
    IR's eps, gain, offset and subgraph), and what the report says of the file. A norm that maps
    to no reference layer keeps its own name: pairing reports it."""
    import dataclasses
    from collections import Counter

    path = Path(path)
    model, ops = read_model(path)
    unread: dict = {}
    norms = find_norms(model, ops, path, unread)
    folded = folded_batch_norms(ops)
    if not norms:
        raise InputError(f"{path}: no norm found in the IR " + (
            f"({folded} BatchNorm(s) decomposed by OpenVINO's conversion into a Multiply and an Add by constants, "
            "w / sqrt(var + eps) and b - mean * w / sqrt(var + eps), the Multiply folded into the Convolution before "
            "it where there is one: no eps, gain or statistics are left to compare; check the ONNX export with "
            "do_constant_folding=False instead)" if folded else
            "(looked for MVN, GroupNormalization, the decomposed Power/ReduceMean/Add/Sqrt pattern and a fused RMS "
            "op, each followed by a Multiply by the gain)"))
    by_name = {layer.name: layer for layer in reference}
    _match_by_name(norms, reference)
    _match_by_gain(norms, reference)  # only where no name says anything
    layers = []
    for norm in distinct_norms(norms):
        ref = by_name.get(norm.name)
        eps = Eps(norm.eps, norm.eps_source)
        if ref is not None and {"batch_norm", "group_norm"} & {ref.kind, norm.kind} and ref.kind != norm.kind:
            ref = None  # a BatchNorm or GroupNorm is no MVN's: the layer is missing, this norm extra
            norm = dataclasses.replace(norm, name=f"{norm.name} ({norm.kind})")
        if ref is not None:
            family_offset = ref.semantic_offset if ref.semantic_offset is not None else ref.gain_offset
            layer = dataclasses.replace(ref, weight=norm.weight, bias=norm.bias, eps=eps, gain_offset=norm.offset,
                                        semantic_offset=family_offset if family_offset != norm.offset else None,
                                        tensor=norm.name, program=norm.program,
                                        warnings=[BY_VALUE] if norm.paired_by == "value" else [],
                                        **({"groups": norm.groups} if norm.groups else {}))
        else:
            layer = NormLayer(name=norm.name, kind=norm.kind, dim=norm.dim, order="native", gain_offset=norm.offset,
                              eps=eps, weight=norm.weight, bias=norm.bias, family="openvino", tensor=norm.name,
                              program=norm.program, **({"groups": norm.groups} if norm.groups else {}))
        layers.append(graph_layer(layer, norm, graph_findings(norm, ref)))
    eps_common = Counter(n.eps for n in norms).most_common(1)
    dtypes = Counter(n.dtype for n in norms).most_common(1)
    stored = Counter(n.eps_stored for n in norms if n.form == "decomposed")
    info = {"format": "openvino", "norms": len(norms), "forms": dict(Counter(n.form for n in norms)),
            "eps": {"value": eps_common[0][0], "source": "openvino: the most common eps of its norms"},
            "dtype": dtypes[0][0] if dtypes else None,
            "weights": Path(path).with_suffix(".bin").name,
            "eps_stored_as": dict(stored) if stored else None}
    if (by := producer(model)):
        info["producer"] = by
    if unread:
        info["unread"] = unread
    if folded:
        info["batch_norm_decomposed"] = folded
    try:
        import openvino as ov

        info["runtime"] = ov.get_version()
    except Exception:
        pass
    return layers, info
