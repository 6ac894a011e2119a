"""An exported graph's norms as the model's layers: each under the reference layer it stands for
(by name, or by value where no name says anything), with the graph's eps, gain and subgraph (and a
BatchNormalization's running statistics, which pairing compares like the gain)."""

from __future__ import annotations

from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.model.layers import NormLayer
from parity_cli.model.pairing import BY_VALUE, graph_layer
from parity_cli.sources.onnx_graph import (
    FUSED,
    _match_by_gain,
    _match_by_name,
    distinct_norms,
    find_norms,
    load_model,
    reduced_words,
)
from parity_cli.sources.tensors import Eps


def candidate_layers(path, reference: list) -> tuple[list, dict]:
    """The exported graph's norms as NormLayers under the reference's names (their family's
    conventions, the graph's eps, gain, offset and subgraph), and what the report says of the
    file. A norm that maps to no reference layer keeps its own name: pairing reports it."""
    import dataclasses
    from collections import Counter

    path = Path(path)
    model = load_model(path)
    unread: dict = {}
    norms = find_norms(model, path, unread)
    by_name = {layer.name: layer for layer in reference}
    _match_by_name(norms, reference)
    _match_by_gain(norms, reference)  # only where no name or path says anything
    layers = []
    for norm in distinct_norms(norms):
        ref = by_name.get(norm.name)
        if ref is not None and {"batch_norm", "group_norm"} & {ref.kind, norm.kind} and ref.kind != norm.kind:
            ref = None  # a BatchNorm (GroupNorm) is no other kind's copy: the layer is missing, this norm extra
            norm = dataclasses.replace(norm, name=f"{norm.name} ({norm.kind})")
        eps = Eps(norm.eps, norm.eps_source)
        stats = {"running_mean": norm.running_mean, "running_var": norm.running_var}
        if ref is not None:
            family_offset = ref.semantic_offset if ref.semantic_offset is not None else ref.gain_offset
            layer = dataclasses.replace(ref, weight=norm.weight, bias=norm.bias, eps=eps, gain_offset=norm.offset,
                                        semantic_offset=family_offset if family_offset != norm.offset else None,
                                        tensor=norm.name, program=norm.program, **stats,
                                        fused_program=norm.fused_program or None,
                                        warnings=[BY_VALUE] if norm.paired_by == "value" else [])
        else:
            layer = NormLayer(name=norm.name, kind=norm.kind, dim=norm.dim, order="native", gain_offset=norm.offset,
                              eps=eps, weight=norm.weight, bias=norm.bias, family="onnx", tensor=norm.name,
                              program=norm.program, **stats, **({"groups": norm.groups} if norm.groups else {}),
                              fused_program=norm.fused_program or None)
        graph_findings = []  # findings of the copy's graph itself: pairing reports them for the layer
        if norm.reduced:
            graph_findings.append({"code": "reduced_precision_reduction", "message": reduced_words(norm.reduced),
                                   "reduction_dtype": norm.reduced})
        if norm.training:
            graph_findings.append({"code": "batch_statistics", "message": TRAINING_WORDS})
        if ref is not None and norm.groups is not None and norm.groups != ref.groups:
            graph_findings.append({"code": "group_count_mismatch", "groups": norm.groups, "checkpoint_groups": ref.groups,
                                   "message": f"the graph's GroupNormalization normalises {norm.groups} groups of "
                                              f"{norm.dim // norm.groups} channels; the checkpoint's GroupNorm has "
                                              f"{ref.groups} of {ref.dim // max(ref.groups, 1)}"})
        layers.append(graph_layer(layer, norm, graph_findings))
    eps_common = Counter(n.eps for n in norms).most_common(1)
    dtypes = Counter(n.dtype for n in norms).most_common(1)
    info = {"format": "onnx", "norms": len(norms),
            "forms": dict(Counter(n.form for n in norms)),
            "eps": {"value": eps_common[0][0] if eps_common else None,
                    "source": "onnx: the most common eps of its norms"},
            "dtype": dtypes[0][0] if dtypes else None,
            "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "producer": f"{model.producer_name} {model.producer_version}".strip()}
    if unread:
        info["unread"] = unread
    folded = _folded(model, reference, {layer.name for layer in layers})
    if not norms:  # nothing to pair, and no eps to state: one line, with why where BatchNorms were folded
        raise InputError(f"{path}: no norm found in the graph" + (f": {folded['message']}" if folded else
                         f" (looked for {', '.join(FUSED)} and the decomposed Pow/ReduceMean/Add/Sqrt pattern "
                         "followed by a Mul by the gain)"))
    if folded:
        info["batch_norm_folded"] = folded
    return layers, info


TRAINING_WORDS = ("the graph's BatchNormalization runs with training_mode=1: it normalises every batch with that "
                  "batch's own mean and variance, not the running statistics the checkpoint stores")


def _folded(model, reference: list, found: set) -> dict | None:
    """The checkpoint's BatchNorms the graph has no BatchNormalization for, where it has Convs: what
    torch.onnx.export does to an eval-mode Conv + BatchNorm (constant folding, the dynamo optimizer
    fuses the pair into one Conv with w * scale / sqrt(var + eps) and a shifted bias). What the fold
    computes is not checked here: each such layer is missing from the copy (pairing's
    checkpoint_layer_missing), and the copy's description in the report says why."""
    missing = [layer.name for layer in reference if layer.kind == "batch_norm" and layer.name not in found]
    convs = sum(1 for node in model.graph.node if node.op_type in ("Conv", "ConvTranspose"))
    if not missing or not convs:
        return None
    kept = sum(1 for node in model.graph.node if node.op_type == "BatchNormalization")
    return {"missing": len(missing), "layers": missing[:10], "batch_normalization_nodes": kept, "conv_nodes": convs,
            "message": f"{len(missing)} BatchNorm layer(s) of the checkpoint have no BatchNormalization in the graph "
                       f"({kept} kept beside {convs} Conv): an exporter that folds an eval-mode BatchNorm into the "
                       "Conv before it (torch.onnx.export's default do_constant_folding=True, the dynamo exporter's "
                       "optimize=True) leaves no eps, gain or statistics to compare; export with "
                       "do_constant_folding=False (or dynamo with optimize=False) to check them"}
