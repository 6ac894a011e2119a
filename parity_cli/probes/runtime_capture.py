"""What a deployed runtime computes at each norm, recorded inside the runtime on real tokens.

`parity capture MODEL --runtime llama.cpp|onnxruntime|openvino|mlx-lm` runs the runtime itself and keeps,
for every norm node its graph has, a bounded sample of (input row, output row) pairs and the
parameters the runtime used: the eps it read (from the op or the node), the gain and bias it
attached (the values it holds). `parity check REFERENCE --runtime-capture FILE` then judges each
pair against the float64 oracle of the reference on the runtime's own input: the runtime's
upstream (attention, quantized matmuls) does not count against the norm, its norm does.

The file is safetensors: `x:LAYER` and `y:LAYER` rows (float32, exact for the float32, float16 and
bfloat16 activations runtimes compute in), `gain:LAYER` / `bias:LAYER` as the runtime held them,
and the metadata key `parity-runtime` (FORMAT, the runtime, its version, the node each layer came
from, the dtype it computed in).

A fused residual norm (ONNX Runtime's Skip(Simplified)LayerNormalization) normalises input + skip
(+ bias): its `x` is that sum as the runtime computes it from the inputs the node was given, and
`sum:LAYER` holds the sum the node handed on (its input_skip_bias_sum output, the residual stream
the next layer reads). Reading the capture judges one against the other: a sum that differs from
x beyond its dtype's rounding is a finding that fails the layer, even where the norm is right."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sampling import describe

FORMAT = "parity runtime capture 1"
META_KEY = "parity-runtime"
RUNTIMES = ("llama.cpp", "onnxruntime", "openvino", "mlx-lm", "litert")
MAX_LAYERS = 10_000
KINDS = {"RMS_NORM": "rms_norm", "NORM": "layer_norm"}


def _sampled(parts: list, q, rows_per_layer: int, rng) -> list:
    """Row-aligned tensors (x, y, and a Skip op's sum output) cut to rows_per_layer rows as `parity
    capture` keeps rows (sampling.RowSample); a row of each is kept or dropped together."""
    import torch

    from parity_cli.sampling import RowSample

    sample = RowSample.of(rows_per_layer, rng, copy=lambda row: row.clone())
    sample.add(torch.cat(parts, -1), q)
    kept = torch.stack(sample.kept())
    edges = [0]
    for t in parts:
        edges.append(edges[-1] + t.shape[1])
    return [kept[:, a:b].contiguous() for a, b in zip(edges, edges[1:])]


def record(model, runtime: str, text: str | None = None, tokens: list[int] | None = None, max_tokens: int = 512,
           rows_per_layer: int = 96, seed: int = 0, stage=None, precision: str | None = None) -> tuple[dict, dict]:
    """(tensors, metadata) of a capture inside `runtime`; `stage(text)` hears what runs next.
    `precision` (openvino only): the CPU plugin's inference precision, f32, bf16 or f16; None runs
    what the plugin runs by default. The precision it really ran is in the metadata either way."""
    say = stage or (lambda text: None)
    import torch

    from parity_cli.backends.implementations import mean_square
    from parity_cli.probes.capture import MAX_ROWS_PER_LAYER

    if runtime not in RUNTIMES:
        raise InputError(f"--runtime: '{runtime}' is not one of transformers, {', '.join(RUNTIMES)}")
    if not 3 <= rows_per_layer <= MAX_ROWS_PER_LAYER:
        raise InputError(f"--rows-per-layer must be between 3 and {MAX_ROWS_PER_LAYER}")
    if precision is not None and runtime != "openvino":
        raise InputError(f"--precision: {runtime} has no inference precision to choose here; it is for --runtime "
                         "openvino")
    from parity_cli.backends.implementations import require

    require(runtime, "--runtime")  # an absent runtime is one line naming what to install
    say(f"running {model} in {runtime}")
    if runtime == "llama.cpp":
        raw = _llama_cpp(model, text, tokens, max_tokens, rows_per_layer, seed)
    elif runtime == "mlx-lm":
        from parity_cli.backends import mlx_lm_graph

        raw = mlx_lm_graph.record(model, text, tokens, max_tokens)
    else:
        from parity_cli.backends.graph_capture import record as graph_record

        raw = graph_record(model, runtime, text, tokens, max_tokens, precision)
    if not raw["nodes"]:
        raise InputError(f"{model}: {runtime} ran no norm node parity reads as a checkpoint layer; nothing captured")
    rng = random.Random(seed)
    tensors, nodes, nonfinite = {}, {}, []
    merged: dict = {}
    unmapped = list(raw.get("unmapped", []))
    for node in raw["nodes"]:  # nodes that attach one layer's gain (a norm called twice): one layer, all rows
        node.setdefault("seen", node["x"].shape[0])
        same = merged.get(node["layer"])
        if same is None:
            merged[node["layer"]] = node
        elif same["x"].shape[1] != node["x"].shape[1]:  # the same gain over rows of another width: not this layer
            unmapped.append(f"{node['node']} (rows {node['x'].shape[1]} wide, {node['layer']}'s are "
                            f"{same['x'].shape[1]})")
        else:
            import numpy as np

            same["x"], same["y"] = np.concatenate([same["x"], node["x"]]), np.concatenate([same["y"], node["y"]])
            if "sum" in same and "sum" in node:
                same["sum"] = np.concatenate([same["sum"], node["sum"]])
            else:  # a sum output from one of the nodes only: no row-aligned residual to judge
                same.pop("sum", None)
                same.pop("sum_output", None)
            same["node"] += f", {node['node']}"
            same["seen"] += node["seen"]
    for node in sorted(merged.values(), key=lambda n: n["layer"]):
        parts = [torch.from_numpy(node.pop(k)) for k in ("x", "y", "sum") if k in node]
        x = parts[0]
        finite = torch.isfinite(x).all(-1)
        seen = int(node.pop("seen"))  # what the runtime gave (llama.cpp's child samples as it goes)
        parts = [t[finite] for t in parts]
        if not parts[0].shape[0]:  # the runtime gave this norm no finite input: upstream broke, nothing to judge
            nonfinite.append(node["layer"])
            continue
        parts = _sampled(parts, mean_square(parts[0].double(), node["kind"]), rows_per_layer, rng)
        x, y = parts[:2]
        layer = node["layer"]
        tensors[f"x:{layer}"], tensors[f"y:{layer}"] = x, y
        if len(parts) > 2:  # a Skip op's input_skip_bias_sum: the residual it handed on, judged when read
            tensors[f"sum:{layer}"] = parts[2]
        for part in ("gain", "bias"):
            value = node.pop(part)
            if value is not None:  # float32 values, and the dtype the runtime's tensor is stored in
                node[f"{part}_tensor"], node[f"{part}_dtype"] = value[0], value[2]
                tensors[f"{part}:{layer}"] = torch.from_numpy(value[1]).float().contiguous()
        nodes[layer] = {**node, "rows_seen": seen, "rows": int(x.shape[0])}
    meta = {"format": FORMAT, "runtime": runtime, "version": raw.get("version"), "model": str(model),
            "tokens": raw["tokens"], "rows_per_layer": rows_per_layer, "seed": seed,
            "sampling": f"{describe(rows_per_layer)} of each norm node's rows",
            "computes_in": sorted({n["dtype"] for n in nodes.values()}), "nodes": nodes,
            "unmapped": unmapped, "nonfinite_only": nonfinite,
            **{k: raw[k] for k in ("backend", "note", "precision") if raw.get(k)}}
    return tensors, meta


def _llama_cpp(model, text, tokens, max_tokens, rows_per_layer: int, seed: int) -> dict:
    """llama.cpp's norm nodes under the checkpoint's layer names: the GGUF's own gain tensor names
    (blk.0.attn_norm.weight) mapped back with gguf-py's table, as `parity check model.gguf` does."""
    from parity_cli.backends import llama_graph
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load
    from parity_cli.sources.gguf import is_gguf

    if not (Path(model).is_file() and is_gguf(Path(model))):
        raise InputError(f"{model}: --runtime llama.cpp runs a .gguf file")
    ckpt, fam, eps = load(model)
    layers = {layer.name: layer for layer in discover_layers(ckpt, fam, eps).layers}
    by_tensor = {f"{g}.weight": hf for hf, g in ckpt.gguf_names.items() if hf in layers}
    raw = llama_graph.record(model, tokens, text, max_tokens, rows_per_layer=rows_per_layer, seed=seed)
    nodes, unmapped = [], []
    for n in raw["nodes"]:
        layer = by_tensor.get(n["gain"][0]) if n["gain"] is not None else None
        node = n["chain"][-1].rpartition(" -> ")[2] if len(n["chain"]) > 1 else n["node"]
        if layer is None:
            unmapped.append(f"{node} ({n['chain'][-1]})")
            continue
        nodes.append({"layer": layer, "node": node, "op": n["op"], "kind": KINDS[n["op"]], "eps": n["eps"],
                      "eps_source": f"llama.cpp: the {n['op']} node's op_params[0] ({n['node']})",
                      "chain": n["chain"], "gain": n["gain"], "bias": n["bias"], "dtype": n["dtype"],
                      "x": n["x"], "y": n["y"], "seen": n["seen"]})
    return {"nodes": nodes, "unmapped": unmapped, "tokens": raw["tokens"], "note": raw.get("note"),
            "version": raw["version"], "backend": "ggml CPU"}


def summary(out, tensors: dict, meta: dict) -> list[str]:
    rows = [t.shape[0] for name, t in tensors.items() if name.startswith("x:")]
    eps = sorted({n["eps"] for n in meta["nodes"].values() if n.get("eps") is not None})
    version = str(meta.get("version") or "")
    who = meta["runtime"] if not version else version if version.startswith(meta["runtime"]) else (
        f"{meta['runtime']} ({version})")
    lines = [f"{out}: {sum(rows):,} (input, output) row pairs from {meta['tokens']:,} tokens in {who}, {len(rows)} "
             f"norm nodes ({', '.join(meta['computes_in'])}; eps {', '.join(f'{e:.6g}' for e in eps) or 'not recorded'})"]
    said = meta.get("precision")
    if said and said.get("asked") and said["asked"] != said["runs"]:
        lines.append(f"{meta['runtime']}: --precision {said['asked']} was asked; the CPU plugin ran at {said['runs']} "
                     f"(this CPU has no {said['asked']} support): the rows are {said['runs']}'s and judged at it")
    elif said:
        lines.append(f"{meta['runtime']}: the CPU plugin ran at inference precision {said['runs']} ({said['source']}); "
                     "the rows are judged at it")
    if meta.get("note"):
        lines.append(meta["note"])
    if meta.get("nonfinite_only"):
        lines.append(f"{len(meta['nonfinite_only'])} norm node(s) saw only NaN or inf inputs and hold no rows: "
                     + ", ".join(meta["nonfinite_only"][:5]))
    if meta.get("unmapped"):
        lines.append(f"{len(meta['unmapped'])} norm node(s) map to no checkpoint layer and were left out: "
                     + ", ".join(meta["unmapped"][:5]))
    return lines


def write(tensors: dict, meta: dict, out) -> None:
    from safetensors.torch import save

    from parity_cli.outputs import write_bytes

    write_bytes(Path(out), save(tensors, metadata={META_KEY: json.dumps(meta)}))


def load(path, reference_layers) -> tuple[list, dict]:
    """(the capture's norms as NormLayers: the runtime's eps, gain and bias, `recorded` = its (x, y)
    rows; the report's description of the capture). Every malformed part is one line."""
    import torch
    from safetensors import SafetensorError, safe_open

    from parity_cli.model.layers import NormLayer
    from parity_cli.probes.capture import MAX_FILE_BYTES
    from parity_cli.sources.jsonfile import regular_file
    from parity_cli.sources.tensors import Eps

    path = Path(path)
    regular_file(path, "the runtime capture", MAX_FILE_BYTES, "over the 1 GiB a capture may have")
    try:  # safetensors bounds and checks the header itself
        with safe_open(str(path), framework="pt") as fh:
            meta_text = (fh.metadata() or {}).get(META_KEY)
    except (SafetensorError, OSError) as exc:
        raise InputError(f"{path}: not a runtime capture (not safetensors: {' '.join(str(exc).split())[:120]})") \
            from None
    if meta_text is None:
        raise InputError(f"{path}: not a runtime capture (`parity capture MODEL --runtime ...` writes one)")
    from parity_cli.sources.jsonfile import parse

    meta = parse(meta_text, path, "the capture's metadata")  # bounded nesting: one line, never a RecursionError
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("nodes"), dict):
        raise InputError(f"{path}: not a runtime capture of format '{FORMAT}'")
    if len(meta["nodes"]) > MAX_LAYERS:
        raise InputError(f"{path}: {len(meta['nodes']):,} nodes, over the {MAX_LAYERS:,} a capture may hold")
    _check_fields(path, meta)
    layers = []
    try:
        with safe_open(str(path), framework="pt") as fh:
            keys = set(fh.keys())
            for name, node in sorted(meta["nodes"].items()):
                layers.append(_layer(path, fh, keys, name, node, meta["runtime"], NormLayer, Eps, torch))
    except SafetensorError as exc:
        raise InputError(f"{path}: unreadable safetensors: {exc}") from None
    return _named(layers, reference_layers, meta, path), meta


_TEXT = (str, type(None))
# metadata field -> (the types it may have, what it is): what a report repeats is never anything else
_FIELDS = {"runtime": (str, "the runtime's name"), "version": (_TEXT, "its version"), "model": (_TEXT, "the model"),
           "tokens": (int, "a token count"), "backend": (_TEXT, "the backend"), "note": (_TEXT, "a note")}
_NODE_FIELDS = {"node": _TEXT, "op": _TEXT, "gain_tensor": _TEXT, "bias_tensor": _TEXT, "eps_source": _TEXT,
                "dtype": str, "gain_dtype": _TEXT, "bias_dtype": _TEXT, "rows_seen": int, "rows": int,
                "sum_output": _TEXT, "rows_in": _TEXT}
COMPUTES = ("float32", "float16", "bfloat16")


def _check_fields(path, meta: dict) -> None:
    def bad(what):
        raise InputError(f"{path}: the capture's metadata is malformed: {what}")

    if not isinstance(meta.get("runtime"), str):
        bad("no 'runtime' name")
    for key, (types, what) in _FIELDS.items():
        if key in meta and (not isinstance(meta[key], types) or isinstance(meta[key], bool)):
            bad(f"'{key}' is not {what}")
    said = meta.get("precision")
    if said is not None and not (isinstance(said, dict) and isinstance(said.get("runs"), str)
                                 and all(isinstance(v, _TEXT) for v in said.values())):
        bad("'precision' is not the plugin's precision (runs, asked, source)")
    computes = meta.get("computes_in", [])
    if not (isinstance(computes, list) and computes and all(c in COMPUTES for c in computes)):
        bad(f"'computes_in' is not a list of {', '.join(COMPUTES)}")
    for key in ("unmapped", "nonfinite_only"):
        if not (isinstance(meta.get(key, []), list) and all(isinstance(v, str) for v in meta.get(key, []))):
            bad(f"'{key}' is not a list of names")
    for name, node in meta["nodes"].items():
        if not isinstance(node, dict):
            bad(f"node {name!r} is not an object")
        for key, types in _NODE_FIELDS.items():
            if key in node and (not isinstance(node[key], types) or isinstance(node[key], bool)):
                bad(f"node {name!r}: '{key}' has the wrong type")
        if node.get("dtype") not in COMPUTES:
            bad(f"node {name!r}: dtype {node.get('dtype')!r} is not one of {', '.join(COMPUTES)}")
        if node.get("rows_in") not in (None, "float32"):  # rows wider than the dtype the node computed in
            bad(f"node {name!r}: 'rows_in' is {node['rows_in']!r}; only float32 rows may hold more than their dtype")
        chain = node.get("chain", [])
        if not (isinstance(chain, list) and all(isinstance(c, str) for c in chain)):
            bad(f"node {name!r}: 'chain' is not a list of ops")


def _named(layers: list, reference_layers: list, meta: dict, path) -> list:
    """Each recorded norm under the reference layer it is: by name (an export's wrapper prefix set
    aside), else by the gain it holds, as an exported graph's norms are paired (sources.onnx_graph);
    the capture's own name stays in the report's node entry."""
    import dataclasses
    from types import SimpleNamespace

    from parity_cli.sources.onnx_graph import _match_by_gain, _match_by_name
    from parity_cli.sources.tflite_graph import match_by_path

    views = [SimpleNamespace(name=layer.name, names=(layer.name,), offset=0.0, weight=layer.weight,
                             bias=layer.bias, dim=layer.dim, paired_by="name") for layer in layers]
    match_by_path(views, reference_layers)  # a traced module path, without a ModuleList's own name (LiteRT)
    _match_by_name(views, reference_layers)
    _match_by_gain(views, reference_layers)
    by_name = {layer.name: layer for layer in reference_layers}
    paired: dict = {}
    for layer, view in zip(layers, views):
        paired.setdefault(view.name, []).append(layer.name)
    twice = next(((name, nodes) for name, nodes in paired.items() if len(nodes) > 1), None)
    if twice is not None:  # one layer's rows from two nodes: which one the runtime ran is not said
        raise InputError(f"{path}: nodes {', '.join(twice[1][:3])} of the capture all pair "
                         f"with {twice[0]}; a capture holds one node per layer")
    out = []
    for layer, view in zip(layers, views):
        ref = by_name.get(view.name)
        node = meta["nodes"][layer.name]
        node.setdefault("recorded_as", layer.name)
        if view.name != layer.name:
            meta["nodes"][view.name] = node
        node["paired_by"] = view.paired_by
        same = dataclasses.replace(layer, name=view.name, family=ref.family if ref else layer.family,
                                   tower=ref.tower if ref else layer.tower)
        if getattr(layer, "graph_findings", None):  # what the runtime's node itself did wrong (pairing reports it)
            same.graph_findings = layer.graph_findings
        out.append(same)
    return out


def _as_stored(path, name, part, t, dtype, torch):
    """The runtime's tensor in the dtype it stores (an IR compressed to f16, a GGUF's F16 norms), so
    that pairing sees what the gains passed through; its values must be that dtype's."""
    if t is None or dtype in (None, "float32"):
        return t
    if dtype not in ("float16", "bfloat16"):
        raise InputError(f"{path}: {name}: the {part} is stored as '{dtype}', not a dtype parity reads")
    narrow = t.to(getattr(torch, dtype))
    if not torch.equal(narrow.float(), t):
        raise InputError(f"{path}: {name}: the {part} is said to be stored as {dtype} but holds other values")
    return narrow


def _layer(path, fh, keys, name, node, runtime: str, NormLayer, Eps, torch):
    def tensor(key, required=True):
        if key not in keys:
            if required:
                raise InputError(f"{path}: {name}: no tensor {key}")
            return None
        t = fh.get_tensor(key)
        if t.dtype != torch.float32:
            raise InputError(f"{path}: {key} is {str(t.dtype).removeprefix('torch.')}, not float32")
        return t

    if not isinstance(node, dict) or node.get("kind") not in ("rms_norm", "layer_norm"):
        raise InputError(f"{path}: {name}: a node of no kind parity reads")
    eps = node.get("eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and eps >= 0):
        raise InputError(f"{path}: {name}: eps {eps!r} is not a finite number >= 0")
    x, y = tensor(f"x:{name}"), tensor(f"y:{name}")
    gain, bias = tensor(f"gain:{name}", False), tensor(f"bias:{name}", False)
    total = tensor(f"sum:{name}", False)
    if x.dim() != 2 or x.shape != y.shape or not x.shape[0] or not x.shape[1]:
        raise InputError(f"{path}: {name}: rows of shapes {list(x.shape)} and {list(y.shape)}; not (n, width) pairs")
    if total is not None and total.shape != x.shape:
        raise InputError(f"{path}: {name}: sum rows of shape {list(total.shape)} for x rows of {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):  # `parity capture` keeps only rows with a q
        raise InputError(f"{path}: {name}: an input row holds NaN or inf; a capture keeps only finite inputs")
    # the rows hold values of the dtype the node computed in, unless the capture says the runtime
    # handed them out wider (rows_in: OpenVINO at bf16 keeps some nodes at f32)
    held = node.get("rows_in") or node["dtype"]
    computes = getattr(torch, held)
    for part, t in (("x", x), ("y", y), ("sum", total)):
        if t is not None and computes != torch.float32 and not bool((t.to(computes).float() == t)[torch.isfinite(t)].all()):
            raise InputError(f"{path}: {name}: {part} rows are said to be computed in {node['dtype']} but hold other "
                             "values")
    dim = x.shape[1]
    for part, t in (("gain", gain), ("bias", bias)):
        if t is not None and tuple(t.shape) != (dim,):
            raise InputError(f"{path}: {name}: the {part} has shape {list(t.shape)} for rows of width {dim}")
    gain, bias = (_as_stored(path, name, part, t, node.get(f"{part}_dtype"), torch)
                  for part, t in (("gain", gain), ("bias", bias)))
    source = node.get("eps_source") or f"{runtime}'s node"
    weightless = gain is None
    layer = NormLayer(name=name, kind=node["kind"], dim=dim, order="native", gain_offset=0.0,
                      eps=Eps(float(eps), source), weight=torch.ones(dim) if weightless else gain, bias=bias,
                      family="runtime", tensor=str(node.get("gain_tensor") or ""), weightless=weightless,
                      recorded=(x, y), recorded_wide=held != node["dtype"])
    if total is not None:
        found = residual_finding(x, total, node, runtime)
        if found is not None:
            layer.graph_findings = [found]
    return layer


def residual_finding(x, total, node: dict, runtime: str) -> dict | None:
    """The sum a fused residual norm handed on (`sum` rows) against the sum it normalised (`x`): equal
    within two units in the last place, at the node's dtype, of the row's largest |x| (the same three
    operands added in another order differ by less). Anything more (a bias left out, the skip added
    twice, another tensor) is a finding: the residual stream after this norm is not the one it
    normalised. None where every element is within."""
    import torch

    computes = getattr(torch, node["dtype"])
    x64, s64 = x.double(), total.double()
    allowed = 2 * torch.finfo(computes).eps * x64.abs().amax(-1, keepdim=True)
    err = (s64 - x64).abs()
    bad = ~(err <= allowed)  # a NaN sum is bad too
    if not bool(bad.any()):
        return None
    worst = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))
    k = int(torch.argmax(torch.where(bad, worst, torch.full_like(worst, -1.0))))
    row, col = divmod(k, x.shape[1])
    op = node.get("op") or "norm"
    tensor = node.get("sum_output") or "its sum output"
    return {"code": "residual_sum_mismatch",
            "message": f"{runtime}'s {op} node hands on a residual sum ({tensor}) that differs from the sum of "
                       f"its inputs in {int(bad.sum()):,} of {bad.numel():,} elements (worst row {row} "
                       f"[{col}]: sum {float(s64[row, col]):.6g}, inputs' sum {float(x64[row, col]):.6g}; "
                       f"{node['dtype']} rounding allows {float(allowed[row, 0]):.3g}): the residual the next "
                       "layer reads is not the one this norm normalised",
            "elements": int(bad.sum()), "max_abs_err": float(worst.amax()), "tensor": tensor, "read_from_copy": True}
