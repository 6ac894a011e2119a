"""An exported graph's norms as the model's layers: each under the reference layer it stands for
(by name, or by value where no name says anything), with the graph's eps, gain and subgraph."""

from __future__ import annotations

from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.model.layers import NormLayer
from parity_cli.model.pairing import BY_VALUE
from parity_cli.sources.onnx_graph import (
    FUSED,
    _match_by_gain,
    _match_by_name,
    _same,
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
    norms = find_norms(model, path)
    by_name = {layer.name: layer for layer in reference}
    _match_by_name(norms, reference)
    _match_by_gain(norms, reference)  # only where no name or path says anything
    layers, seen = [], {}
    for norm in norms:
        first = seen.get(norm.name)
        if first is not None and _same(first, norm):
            continue  # the same norm reached twice (a shared module): once
        if first is not None:  # another norm under that name: its own layer, which pairing reports
            k = 2
            while f"{norm.name}#{k}" in seen:
                k += 1
            norm = dataclasses.replace(norm, name=f"{norm.name}#{k}")
        seen[norm.name] = norm
        ref = by_name.get(norm.name)
        eps = Eps(norm.eps, norm.eps_source)
        if ref is not None:
            family_offset = ref.semantic_offset if ref.semantic_offset is not None else ref.gain_offset
            layer = dataclasses.replace(ref, weight=norm.weight, bias=norm.bias, eps=eps, gain_offset=norm.offset,
                                        semantic_offset=family_offset if family_offset != norm.offset else None,
                                        tensor=norm.name, program=norm.program,
                                        warnings=[BY_VALUE] if norm.paired_by == "value" else [])
        else:
            layer = NormLayer(name=norm.name, kind=norm.kind, dim=norm.dim, order="native", gain_offset=norm.offset,
                              eps=eps, weight=norm.weight, bias=norm.bias, family="onnx", tensor=norm.name,
                              program=norm.program)
        if norm.reduced:  # a finding of the copy's graph itself: pairing reports it for the layer
            layer.graph_findings = [{"code": "reduced_precision_reduction", "message": reduced_words(norm.reduced),
                                     "reduction_dtype": norm.reduced}]
        layers.append(layer)
    eps_common = Counter(n.eps for n in norms).most_common(1)
    dtypes = Counter(n.dtype for n in norms).most_common(1)
    info = {"format": "onnx", "norms": len(norms),
            "forms": dict(Counter(n.form for n in norms)),
            "eps": {"value": eps_common[0][0] if eps_common else None,
                    "source": "onnx: the most common eps of its norms"},
            "dtype": dtypes[0][0] if dtypes else None,
            "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "producer": f"{model.producer_name} {model.producer_version}".strip()}
    if not norms:
        raise InputError(f"{path}: no norm found in the graph (looked for {', '.join(FUSED)} and the decomposed "
                         "Pow/ReduceMean/Add/Sqrt pattern followed by a Mul by the gain)")
    return layers, info
