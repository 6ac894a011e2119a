"""A LiteRT (.tflite) graph's norms as the model's layers: each under the reference layer it stands
for (by its traced module path, else by its gain), with the graph's eps, gain and bias."""

from __future__ import annotations

from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.model.layers import NormLayer
from parity_cli.model.pairing import BY_VALUE, graph_layer
from parity_cli.sources.onnx_graph import _match_by_gain, _match_by_name, distinct_norms
from parity_cli.sources.tensors import Eps
from parity_cli.sources.tflite_graph import find_norms, match_by_path, read_graph


def candidate_layers(path, reference: list) -> tuple[list, dict]:
    """The graph's norms under the reference's names, and what the report says of the file. A norm
    that maps to no reference layer keeps its own name: pairing reports it."""
    import dataclasses
    from collections import Counter

    path = Path(path)
    graph = read_graph(path)
    norms = find_norms(graph)
    if not norms:
        raise InputError(f"{path}: no norm found in the TFLite graph (looked for ADD(MEAN(x * x), eps) -> RSQRT "
                         "-> MUL and its LayerNorm form with SQUARED_DIFFERENCE, each followed by a MUL by the gain)")
    by_name = {layer.name: layer for layer in reference}
    match_by_path(norms, reference)
    _match_by_name(norms, reference)
    _match_by_gain(norms, reference)  # only where no module path says anything
    layers = []
    for norm in distinct_norms(norms):
        ref = by_name.get(norm.name)
        eps = Eps(norm.eps, norm.eps_source)
        if ref is not None:
            family_offset = ref.semantic_offset if ref.semantic_offset is not None else ref.gain_offset
            layer = dataclasses.replace(ref, weight=norm.weight, bias=norm.bias, eps=eps, gain_offset=norm.offset,
                                        semantic_offset=family_offset if family_offset != norm.offset else None,
                                        tensor=norm.name, program=None,
                                        warnings=[BY_VALUE] if norm.paired_by == "value" else [])
        else:
            layer = NormLayer(name=norm.name, kind=norm.kind, dim=norm.dim, order="native", gain_offset=norm.offset,
                              eps=eps, weight=norm.weight, bias=norm.bias, family="tflite", tensor=norm.name)
        layers.append(graph_layer(layer, norm, []))
    eps_common = Counter(n.eps for n in norms).most_common(1)
    dtypes = Counter(n.dtype for n in norms).most_common(1)
    info = {"format": "tflite", "norms": len(norms), "forms": dict(Counter(n.kind for n in norms)),
            "eps": {"value": eps_common[0][0], "source": "tflite: the most common eps of its norms"},
            "dtype": dtypes[0][0] if dtypes else None, "schema_version": graph.version,
            "producer": graph.description or None}
    return layers, info

