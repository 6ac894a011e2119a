"""Stage 1 for an exported model: the norms of a `.onnx` graph, their eps, gains and subgraphs.

An exporter rarely keeps a norm as one op. What is found:
- fused: `RMSNormalization` (opset 23), ORT's `SimplifiedLayerNormalization` and
  `SkipSimplifiedLayerNormalization`, `LayerNormalization`, `SkipLayerNormalization`; eps is the
  `epsilon` attribute (the op's default 1e-5 when absent);
- decomposed: `Pow(h, 2)` (or `Mul(h, h)`) -> `ReduceMean` -> `Add(eps)` -> `Sqrt` -> `Div`
  (or `Reciprocal` -> `Mul`), or `Add(eps)` -> `Pow(-0.5)` -> `Mul`; `h = x - ReduceMean(x)`
  makes it a LayerNorm; eps is the `Add`'s constant;
- `BatchNormalization` (an inference BatchNorm: scale, B, input_mean, input_var, `epsilon`
  default 1e-5): its running statistics are read beside the gain; `training_mode=1` (or an old
  opset's `is_test=0`) normalises with each batch's statistics, which the layer then reports;
  an export that folded the BatchNorm into the preceding Conv (torch.onnx.export's constant
  folding, the dynamo optimizer) has no BatchNorm left to find;
- `GroupNormalization` (opset 21: scale and bias per channel, `num_groups`, `epsilon` default
  1e-5), what torch's dynamo exporter emits for nn.GroupNorm at opset 21; opset 18's op (scale
  and bias per group) holds no GroupNorm's per-channel gain and is refused with one line. The
  TorchScript exporter (every opset) and dynamo at opset 18 decompose GroupNorm into
  Reshape -> InstanceNormalization -> Reshape -> Mul -> Add, which is not found here;
- then `Mul` by the gain, through `Cast`s, where the gain is an initializer, or an initializer
  plus a constant (`Add(w, 1)`: Gemma's offset kept in the graph); an exporter that folded
  `1 + w` into one initializer stores the offset baked in, as llama.cpp's Gemma does.
Each norm maps to a checkpoint layer by its gain's initializer name, else by the node path an
exporter writes (`/model/layers.0/input_layernorm/Mul_1`). Its subgraph, from the norm's input
to its output with the initializers it reads, is kept as bytes: `--candidate onnxruntime` runs
exactly that, casts included.

The file is untrusted: its size is capped before protobuf parses it, external data is read by
each tensor's declared offset and length after checking them against the side file, never a
path outside the model's directory, and only for norm gains."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.tensors import MAX_NORM_ELEMENTS

MAX_ONNX_BYTES = 2 << 30  # protobuf's own limit: larger models keep their weights as external data
FUSED = {  # op -> (kind, input index of the gain, of the bias, default epsilon)
    "RMSNormalization": ("rms_norm", 1, None, 1e-5),
    "SimplifiedLayerNormalization": ("rms_norm", 1, None, 1e-5),
    "SkipSimplifiedLayerNormalization": ("rms_norm", 2, None, 1e-12),  # ORT's contrib schema default
    "LayerNormalization": ("layer_norm", 1, 2, 1e-5),
    "SkipLayerNormalization": ("layer_norm", 2, 3, 1e-12),
    "BatchNormalization": ("batch_norm", 1, 2, 1e-5),  # X, scale, B, input_mean, input_var (_batch_norm)
    "GroupNormalization": ("group_norm", 1, 2, 1e-5),  # X, scale, bias; num_groups (_group_norm)
}
_PASS = ("Cast", "Identity")
SKIP_EXTRA = {"SkipSimplifiedLayerNormalization": (1, 3), "SkipLayerNormalization": (1, 4)}  # skip, folded bias
MAX_GAIN_BYTES = 64 << 20  # all norm gains read from one file together (a 405B model has 17 MB)
FLOAT32_MAX = 3.4028234663852886e38  # an eps beyond it has no float32 value (GGUF's, ONNX's attribute)
MAX_ENTRIES = 300_000  # nodes and values of one graph, all subgraphs included: parsed, 200k took 540 MB
MAX_NORMS = 10_000  # norms in one graph: every one costs a subgraph (a 405B model has 253)
_FLOAT_TYPES = (1, 10, 11, 16)
_DTYPES = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}


@dataclass
class OnnxNorm:
    name: str  # the checkpoint layer it maps to (or its own best name)
    kind: str
    dim: int
    eps: float
    eps_source: str
    form: str  # the op, or "decomposed"
    weight: object  # torch tensor as stored
    bias: object = None
    offset: float = 0.0  # a constant the graph adds to the stored gain
    dtype: str = "float32"  # the norm's input type in the graph
    computes_in: str | None = None  # the op's own input type, past the casts into it (a converter's half node)
    program: bytes = b""  # the subgraph x -> y, serialised
    fused_program: bytes = b""  # a Skip op's own fused form (x, skip) -> (y, x + skip), serialised
    names: tuple = ()  # every name the graph gives it (gain, scope, node path), most telling first
    paired_by: str = "name"  # how it was matched to a checkpoint layer: "name", or "value" (its gain)
    reduced: str | None = None  # the narrower dtype a Cast pair inside the pattern reduces the mean square in
    running_mean: object = None  # BatchNormalization: input_mean and input_var as stored
    running_var: object = None
    training: bool = False  # BatchNormalization with training_mode=1: the batch's statistics, not these
    groups: int | None = None  # GroupNormalization: its num_groups
    depth: int = 0  # norms on the longest path of the data flow before this one (norm_depths)
    ends: tuple = ()  # (the norm's input tensor, its output tensor)


def load_model(path: Path):
    """The graph without its external data, after the size check."""
    import onnx

    from parity_cli.sources.jsonfile import regular_file

    regular_file(path, "the ONNX model", MAX_ONNX_BYTES, f"more than an ONNX protobuf can hold ({MAX_ONNX_BYTES}); refused")
    count_entries(path)
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise InputError(f"{path}: not a readable ONNX model ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]})") from None


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


class _Group(Exception):
    """A protobuf group field (wire types 3 and 4): protobuf parses past it, a count that stopped there
    would not, and no ONNX message has one."""


def _fields(buf, start: int, end: int):
    """(field number, start, end) of each length-delimited field of one protobuf message; other
    wire types are stepped over. Malformed bytes end the walk (onnx's own parse then says so); a
    group field raises _Group (protobuf would parse what follows it)."""
    i = start
    try:
        while i < end:
            key, i = _varint(buf, i, end)
            wire = key & 7
            if wire in (3, 4):
                raise _Group
            if wire == 0:
                _, i = _varint(buf, i, end)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(buf, i, end)
                if i + n > end:
                    return
                yield key >> 3, i, i + n
                i += n
            else:
                return
    except ValueError:
        return


# message -> {field: message it holds} for the fields that hold graph entries: ModelProto's graph (7)
# and functions (25); a GraphProto's every entry counts; a node's attributes (5) hold subgraphs (6, 11)
# and functions (25), and its training_info (20: TrainingInfoProto's initialization 1 and algorithm 2)
_GRAPH_HOLDERS = {"model": {7: "graph", 25: "function", 20: "training"}, "training": {1: "graph", 2: "graph"},
                  "function": {7: "node"}, "node": {5: "attribute"}, "attribute": {6: "graph", 11: "graph"}}
MAX_NESTING = 32  # messages within messages the count follows; protobuf's own limit is about 100


def count_entries(path: Path) -> int:
    """The graph's entries (nodes, initializers, values, and those of its subgraphs and functions),
    counted from the wire format before protobuf parses the file: parsed, each costs far more than
    its bytes (4 million Identity nodes, 120 MB on disk, passed 6 GiB), so past MAX_ENTRIES it is
    refused here. Stops counting at the bound."""
    import mmap

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if not size:
            return 0
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    count = 0
    try:
        stack = [("model", 0, size, 0)]
        while stack:
            kind, start, end, depth = stack.pop()
            if depth > MAX_NESTING:  # what protobuf would still parse and a count that skipped it would not see
                raise InputError(f"{path}: nests subgraphs more than {MAX_NESTING} levels deep (no real export "
                                 "nests this deep); refused before parsing it")
            for field, a, b in _fields(buf, start, end):
                inner = "node" if kind == "graph" and field == 1 else _GRAPH_HOLDERS.get(kind, {}).get(field)
                if kind == "graph" or inner == "node":
                    count += 1
                    if count > MAX_ENTRIES:
                        raise InputError(f"{path}: more than {MAX_ENTRIES} nodes and values in the graph (a 405B "
                                         "model's export has about 18,000); refused before parsing it")
                if inner is not None:
                    stack.append((inner, a, b, depth + 1))
    except _Group:
        raise InputError(f"{path}: holds a protobuf group field, which no ONNX message has (the count of its "
                         "nodes would stop there, protobuf's parse would not); refused before parsing it") from None
    finally:
        buf.close()
    return count


def _typed_skeleton(model):
    """The model for shape inference: each float initializer of more than 64 elements as a typed,
    shaped graph input without its data. Inference reads only its type and shape (values are
    propagated for integer shape tensors alone), and protobuf would otherwise copy every weight of
    an embedded model (94 MB for a ResNet-50: 2 s) to infer the types of a few norms' inputs."""
    import onnx
    from onnx import helper

    g = model.graph
    light = onnx.GraphProto(name=g.name)
    light.node.extend(g.node)
    light.input.extend(g.input)
    light.output.extend(g.output)
    light.value_info.extend(g.value_info)
    light.sparse_initializer.extend(g.sparse_initializer)
    declared = {vi.name for vi in g.input}
    for t in g.initializer:
        if t.data_type in _FLOAT_TYPES and t.dims and math.prod(t.dims) > 64:
            if t.name not in declared:
                light.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
                declared.add(t.name)
        else:
            light.initializer.append(t)
    out = onnx.ModelProto(ir_version=model.ir_version)
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    out.graph.CopyFrom(light)
    return out


class _Graph:
    def __init__(self, model, path: Path):
        self.model, self.path = model, path
        g = model.graph
        self.init = {t.name: t for t in g.initializer}
        self.producer = {}
        self.consumers: dict[str, list] = {}
        self.order = {id(n): k for k, n in enumerate(g.node)}  # graph order, for every subgraph
        self._arrays: dict = {}
        self._read = 0
        for node in g.node:
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)
        self.types = {}
        try:
            import onnx

            inferred = onnx.shape_inference.infer_shapes(_typed_skeleton(model), strict_mode=False)
            for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
                self.types[vi.name] = (vi.type.tensor_type.elem_type,
                                       len(vi.type.tensor_type.shape.dim) if vi.type.tensor_type.HasField("shape") else None)
        except Exception:
            pass

    def only(self, name: str, op: str | tuple):
        """The single consumer of `name` with this op type, or None."""
        ops = (op,) if isinstance(op, str) else op
        found = [n for n in self.consumers.get(name, []) if n.op_type in ops]
        return found[0] if len(found) == 1 else None

    def back(self, name: str) -> tuple[str, list]:
        """Back through Cast/Identity to where a value comes from: (that value, the nodes passed,
        nearest first). At most 8 steps: a cycle of casts in a hostile graph ends here."""
        passed = []
        while name in self.producer and self.producer[name].op_type in _PASS and len(passed) < 8:
            passed.append(self.producer[name])
            name = passed[-1].input[0]
        return name, passed

    def forward(self, name: str) -> tuple[str, list]:
        """On through Cast/Identity nodes that alone consume `name` (a float16 Cast pair a
        mixed-precision converter puts around a ReduceMean): (the value reached, the nodes passed).
        At most 8 steps, as back()."""
        passed = []
        while len(passed) < 8:
            users = self.consumers.get(name, [])
            if len(users) != 1 or users[0].op_type not in _PASS:
                break
            passed.append(users[0])
            name = users[0].output[0]
        return name, passed

    def through(self, name: str) -> str:
        """Back through Cast/Identity to where a value comes from."""
        return self.back(name)[0]

    def constant(self, name: str):
        """A scalar constant (initializer or Constant node), through casts, else None."""
        name = self.through(name)
        t = self.init.get(name)
        if t is None and name in self.producer and self.producer[name].op_type == "Constant":
            node = self.producer[name]
            t = next((a.t for a in node.attribute if a.name == "value"), None)
        if t is None or (math.prod(t.dims) if t.dims else 1) != 1:
            return None  # not a scalar: Add(1.0, w) asks whether w is the constant, and it is not
        arr = self.array(t, limit=16)
        if arr.dtype.kind not in "fiub":  # a complex eps would lose its imaginary part in float()
            raise InputError(f"{self.path}: the constant {t.name or name!r} is {arr.dtype}, not a real number; refused")
        return float(arr.reshape(-1)[0])

    def array(self, t, limit: int = MAX_NORM_ELEMENTS):
        """An initializer as numpy, external data read by its declared offset and length; each
        initializer read once, all of them together at most MAX_GAIN_BYTES."""
        cache = self._arrays
        key = t.name if t.name and self.init.get(t.name) is t else None  # a Constant node's value has no name
        if key is not None and key in cache:
            return cache[key]
        arr = self._array(t, limit)
        self._read += arr.nbytes
        if self._read > MAX_GAIN_BYTES:
            raise InputError(f"{self.path}: more than {MAX_GAIN_BYTES} bytes of norm gains; refused")
        if key is not None:
            cache[key] = arr
        return arr

    def _array(self, t, limit: int):
        from onnx import numpy_helper

        count = math.prod(t.dims) if t.dims else 1
        if any(d < 0 for d in t.dims) or count > limit:
            raise InputError(f"{self.path}: initializer {t.name!r} declares {list(t.dims)} elements "
                             f"(a norm gain is at most {limit}); refused")
        if t.data_location == 1:  # EXTERNAL
            return self._external(t, count)
        try:
            return numpy_helper.to_array(t)
        except Exception as exc:
            raise InputError(f"{self.path}: initializer {t.name!r} does not hold its declared {list(t.dims)} "
                             f"({' '.join(str(exc).split())[:120]})") from None

    def _external(self, t, count: int):
        import numpy as np
        from onnx import helper

        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        base = self.path.parent.resolve()
        try:
            target = (base / location).resolve()
        except (ValueError, OSError, RuntimeError) as exc:  # a NUL byte, a symlink loop
            raise InputError(f"{self.path}: external data {location!r} of {t.name!r} cannot be opened "
                             f"({' '.join(str(exc).split())[:80]}); refused") from None
        if not location or os.path.isabs(location) or base not in target.parents:
            raise InputError(f"{self.path}: initializer {t.name!r} points outside the model's directory "
                             f"({location!r}); refused")
        if t.data_type not in _FLOAT_TYPES:
            raise InputError(f"{self.path}: initializer {t.name!r} has element type {t.data_type}, not a float; "
                             "refused")
        np_dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        need = count * np.dtype(np_dtype).itemsize
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", need))
        except ValueError:
            raise InputError(f"{self.path}: initializer {t.name!r} has a malformed offset/length") from None
        try:
            st = target.stat()
        except OSError:
            raise InputError(f"{self.path}: external data {location} of {t.name!r} is missing") from None
        import stat as stat_mod

        if not stat_mod.S_ISREG(st.st_mode):
            raise InputError(f"{self.path}: external data {location} of {t.name!r} is not a regular file; refused")
        size = st.st_size
        if length != need or offset < 0 or offset + length > size:
            raise InputError(f"{self.path}: initializer {t.name!r} declares {length} bytes at {offset} of "
                             f"{location} ({size} bytes) for {list(t.dims)} elements; refused")
        with open(target, "rb") as fh:
            fh.seek(offset)
            data = fh.read(length)
        if t.data_type == 16:  # bfloat16: numpy has none; the 16-bit pattern
            return np.frombuffer(data, dtype=np.uint16).reshape(tuple(t.dims))
        return np.frombuffer(data, dtype=np_dtype).reshape(tuple(t.dims)).copy()

    def gain(self, name: str):
        """(initializer, offset) behind a gain operand: w, or w + c through casts."""
        name = self.through(name)
        if name in self.init:
            return self.init[name], 0.0
        node = self.producer.get(name)
        if node is not None and node.op_type == "Add":
            for a, b in ((0, 1), (1, 0)):
                c = self.constant(node.input[b])
                base = self.through(node.input[a])
                if c is not None and base in self.init:
                    return self.init[base], c
        return None, 0.0


def _tensor(graph: _Graph, t):
    import numpy as np
    import torch

    if t.data_type not in _FLOAT_TYPES:
        raise InputError(f"{graph.path}: the norm gain {t.name!r} has ONNX type {t.data_type}, not a float type; "
                         "refused")

    arr = graph.array(t)
    if t.data_type == 16:
        if arr.dtype != np.uint16:  # onnx's own conversion gave float32 values
            return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(torch.bfloat16)
        return torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


def _norm_names(graph: _Graph, gain_name: str, nodes, shared: bool = False) -> list[str]:
    """What the graph says of the checkpoint layer a norm belongs to, most telling first: its
    gain's initializer name (unless several norms read it: an exporter merged identical gains),
    the name scopes, the node path; else the gain's name itself."""
    names = []
    for suffix in (".weight", ".scale", ".gamma"):
        if gain_name.endswith(suffix) and not gain_name.startswith("onnx::") and not shared:
            names.append(gain_name[: -len(suffix)])
    for node in reversed(nodes):  # the dynamo exporter: the module path in the node's metadata
        scope = _scope(node)
        if scope:
            names.append(scope)
            break
    for node in nodes:  # the TorchScript exporter: /model/layers.0/input_layernorm/Mul_1
        parts = [p for p in node.name.split("/") if p][:-1]
        # a ModuleList's scope repeats its name: /model/layers/layers.0/ is model.layers.0
        parts = [p for k, p in enumerate(parts) if not (k + 1 < len(parts) and parts[k + 1].startswith(p + "."))]
        if parts:
            names.append(".".join(parts))
            break
    return list(dict.fromkeys(names + [gain_name]))


def _scope(node) -> str | None:
    """'pkg.torch.onnx.name_scopes' = ['', 'model.layers.0.input_layernorm', 'mul_1']: the module
    the op ran in. Read as a literal (never evaluated), and only when short."""
    import ast

    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes" and len(prop.value) < 4096:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError, RecursionError):
                return None
            if isinstance(scopes, list) and len(scopes) >= 2 and all(isinstance(x, str) for x in scopes):
                return scopes[-2] or None
    return None


# normalisation ops a graph may hold: one the reader cannot take as a norm makes a checkpoint layer
# the copy lacks "not checked" (it may be that node), never "missing"
NORM_OPS = (*FUSED, "InstanceNormalization", "MeanVarianceNormalization", "LpNormalization")


def find_norms(model, path: Path, unread: dict | None = None) -> list[OnnxNorm]:
    """Every norm of the graph, in graph order; `unread` counts, by op, the normalisation nodes
    that are no norm the reader can take."""
    graph = _Graph(model, path)
    found = []
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            norm = _batch_norm(graph, node)
        elif node.op_type == "GroupNormalization":
            norm = _group_norm(graph, node)
        elif node.op_type == "InstanceNormalization":
            norm = _instance_group_norm(graph, node)
        elif node.op_type in FUSED:
            norm = _fused(graph, node)
        elif node.op_type == "ReduceMean":
            norm = _decomposed(graph, node)
        else:
            norm = None
        if norm is not None:
            found.append(norm)
            if len(found) > MAX_NORMS:
                raise InputError(f"{path}: more than {MAX_NORMS} norms in one graph (a 405B model has 253); refused")
        elif unread is not None and node.op_type in NORM_OPS:
            unread[node.op_type] = unread.get(node.op_type, 0) + 1
    norm_depths(model.graph.node, found)
    return found


def _fused(graph: _Graph, node):
    kind, gi, bi, default = FUSED[node.op_type]
    if len(node.input) <= gi:
        return None
    w, offset = graph.gain(node.input[gi])
    if w is None:
        return None
    attr = next((a for a in node.attribute if a.name == "epsilon"), None)
    if attr is not None and attr.type != 1:  # AttributeProto.FLOAT; a string 'abc' reads as f = 0.0
        where = f"{node.op_type} node {node.name!r}" if node.name else f"a {node.op_type} node"
        raise InputError(f"{graph.path}: {where} has an epsilon attribute that is not a float; refused")
    eps = float(attr.f) if attr is not None else default
    source = f"onnx:{node.name or node.op_type}.epsilon" if attr is not None else f"onnx:{node.op_type} default"
    bias = None
    if bi is not None and len(node.input) > bi and node.input[bi]:
        b, _ = graph.gain(node.input[bi])
        bias = None if b is None else _tensor(graph, b)
    x, casts = graph.back(node.input[0])  # casts into the op belong to it
    nodes = casts[::-1] + [node]
    if node.op_type in SKIP_EXTRA:
        # the residual (skip) and a dense layer's bias ORT folded in are the model's, not the norm's:
        # the subgraph normalises the probe alone
        import onnx

        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        skip, folded = SKIP_EXTRA[node.op_type]
        if len(copy.input) > folded:
            copy.input[folded] = ""
        nodes[-1] = copy
        norm = _norm(graph, kind, w, offset, bias, eps, source, node.op_type, x, node.output[0], nodes,
                     zeros={node.input[skip]}, original=node)
        if norm is not None:
            norm.fused_program = _skip_program(graph, copy, kind, gi, bi, _elem_type(graph, x, w))
            norm.computes_in = _DTYPES.get(_elem_type(graph, node.input[0], w))
        return norm
    norm = _norm(graph, kind, w, offset, bias, eps, source, node.op_type, x, node.output[0], nodes)
    if norm is not None:
        norm.computes_in = _DTYPES.get(_elem_type(graph, node.input[0], w))
    return norm


def _skip_program(graph: _Graph, node, kind: str, gi: int, bi, elem: int) -> bytes:
    """The Skip*LayerNormalization node alone as a model (x, skip) -> (y, x + skip), its gain and bias
    the stored initializers, the dense bias ORT folded in cut (it is the layer before's): what the
    fused check (check.fused) runs. Empty where the gain is computed (w + 1 in the graph)."""
    from onnx import helper, numpy_helper

    names = {gi: node.input[gi]} | ({bi: node.input[bi]} if bi is not None and len(node.input) > bi and node.input[bi]
                                    else {})
    if any(name not in graph.init for name in names.values()):
        return b""
    inputs = ["x", "skip"] + [""] * (max(names) - 1)
    for index, name in names.items():
        inputs[index] = name
    attrs = [a for a in node.attribute if a.name == "epsilon"]
    op = helper.make_node(node.op_type, inputs, ["y", "", "", "sum"], domain=node.domain or "com.microsoft")
    op.attribute.extend(attrs)
    inits = [numpy_helper.from_array(graph.array(graph.init[name]), name) for name in names.values()]
    g = helper.make_graph([op], "fused_norm", [helper.make_tensor_value_info(n, elem, ["n", "dim"]) for n in ("x", "skip")],
                          [helper.make_tensor_value_info(n, elem, None) for n in ("y", "sum")], initializer=inits)
    model = helper.make_model(g, opset_imports=list(graph.model.opset_import), producer_name="parity-cli")
    model.ir_version = min(graph.model.ir_version or 10, 10)
    return model.SerializeToString()


def _int_attribute(graph: _Graph, node, name: str) -> int | None:
    attr = next((a for a in node.attribute if a.name == name), None)
    if attr is None:
        return None
    if attr.type != 2:  # AttributeProto.INT
        where = f"{node.op_type} node {node.name!r}" if node.name else f"a {node.op_type} node"
        raise InputError(f"{graph.path}: {where} has a {name} attribute that is not an integer; refused")
    return int(attr.i)


def _batch_norm(graph: _Graph, node):
    """BatchNormalization(X, scale, B, input_mean, input_var) over the channel axis 1: its eps,
    gain, bias and running statistics, each a stored vector of C values (an operand computed
    in the graph is no checkpoint's: that norm is not found, and its layer is reported missing)."""
    if len(node.input) < 5 or not all(node.input[1:5]):
        return None
    if _int_attribute(graph, node, "spatial") == 0:  # opsets 7-8: statistics per (C, H, W), no BatchNorm layer's
        return None
    training = bool(_int_attribute(graph, node, "training_mode")) or _int_attribute(graph, node, "is_test") == 0
    w, offset = graph.gain(node.input[1])
    tensors = [_vector(graph, name) for name in node.input[2:5]]
    if w is None or any(t is None for t in tensors):
        return None
    attr = next((a for a in node.attribute if a.name == "epsilon"), None)
    if attr is not None and attr.type != 1:
        where = f"{node.op_type} node {node.name!r}" if node.name else f"a {node.op_type} node"
        raise InputError(f"{graph.path}: {where} has an epsilon attribute that is not a float; refused")
    eps = float(attr.f) if attr is not None else FUSED[node.op_type][3]
    source = f"onnx:{node.name or node.op_type}.epsilon" if attr is not None else f"onnx:{node.op_type} default"
    bias, mean, var = (_tensor(graph, t) for t in tensors)
    shapes = [list(w.dims), *(list(t.shape) for t in (bias, mean, var))]
    if len(shapes[0]) != 1 or any(s != shapes[0] for s in shapes):
        where = f"BatchNormalization node {node.name!r}" if node.name else "a BatchNormalization node"
        raise InputError(f"{graph.path}: {where} has scale, B, input_mean, input_var of shapes "
                         f"{', '.join(str(s) for s in shapes)}; each must be [C]; refused")
    x, casts = graph.back(node.input[0])
    norm = _norm(graph, "batch_norm", w, offset, bias, eps, source, node.op_type, x, node.output[0],
                 casts[::-1] + [node], channels_first=True)
    if norm is not None:
        norm.running_mean, norm.running_var, norm.training = mean, var, training
        _named_by_operands(norm, [graph.through(name) for name in node.input[1:5]])
    return norm


_OPERAND_SUFFIXES = (".weight", ".bias", ".running_mean", ".running_var", ".scale", ".gamma", ".beta")


def _named_by_operands(norm, operands: list[str]) -> None:
    """A BatchNorm's layer as most of its four stored operands name it: a node reading another
    layer's scale beside its own bias and statistics is its own layer holding a moved gain (which
    pairing names), not the other layer with a wrong bias and statistics."""
    from collections import Counter

    stems = [name[: -len(suffix)] for name in operands if not name.startswith("onnx::")
             for suffix in _OPERAND_SUFFIXES if name.endswith(suffix)]
    if not stems:
        return
    stem, votes = Counter(stems).most_common(1)[0]
    if votes > len(operands) // 2 and stem != norm.name:
        norm.name = stem
        norm.names = (stem, *[n for n in norm.names if n != stem])


def _opset(graph: _Graph, domain: str = "") -> int:
    return max((o.version for o in graph.model.opset_import if (o.domain or "") in (domain, "ai.onnx")), default=0)


def _group_norm(graph: _Graph, node):
    """GroupNormalization(X, scale, bias) over (N, C, ...): num_groups, epsilon (default 1e-5) and,
    from opset 21, a scale and bias of C values each (stored vectors, sizes checked before
    reading). Opset 18's op takes scale and bias per group: no GroupNorm's gain, refused."""
    where = f"GroupNormalization node {node.name!r}" if node.name else "a GroupNormalization node"
    if node.domain not in ("", "ai.onnx") or len(node.input) < 3 or not all(node.input[1:3]):
        return None
    groups = _int_attribute(graph, node, "num_groups")
    if groups is None or groups < 1:
        raise InputError(f"{graph.path}: {where} has no positive num_groups attribute; refused")
    if _opset(graph) < 21:
        raise InputError(f"{graph.path}: {where} is opset {_opset(graph)}'s GroupNormalization, whose scale and bias "
                         "are per group (per channel only from opset 21): no GroupNorm's per-channel gain to "
                         "compare; export at opset 21 or later; refused")
    w, offset = graph.gain(node.input[1])
    b = _vector(graph, node.input[2])
    if w is None or b is None:
        return None
    attr = next((a for a in node.attribute if a.name == "epsilon"), None)
    if attr is not None and attr.type != 1:
        raise InputError(f"{graph.path}: {where} has an epsilon attribute that is not a float; refused")
    eps = float(attr.f) if attr is not None else FUSED[node.op_type][3]
    source = f"onnx:{node.name or node.op_type}.epsilon" if attr is not None else f"onnx:{node.op_type} default"
    shapes = [list(w.dims), list(b.dims)]
    if len(shapes[0]) != 1 or shapes[1] != shapes[0] or shapes[0][0] % groups:
        raise InputError(f"{graph.path}: {where} has scale and bias of shapes {shapes[0]}, {shapes[1]} with "
                         f"num_groups {groups}; each must be [C], C a multiple of num_groups; refused")
    bias = _tensor(graph, b)
    x, casts = graph.back(node.input[0])
    norm = _norm(graph, "group_norm", w, offset, bias, eps, source, node.op_type, x, node.output[0],
                 casts[::-1] + [node], channels_first=True)
    if norm is not None:
        norm.groups = groups
    return norm


def _instance_group_norm(graph: _Graph, node):
    """nn.GroupNorm as the TorchScript exporter (every opset) and dynamo below opset 21 write it:
    Reshape(x, [N, G, -1]) -> InstanceNormalization(ones[G], zeros[G], epsilon) -> Reshape(back to
    x's shape) -> Mul(w[C, 1...]) -> Add(b[C, 1...]). G is the length of the constant scale; an
    InstanceNormalization with any other scale, or not between two Reshapes, is no GroupNorm's.
    Its program is that chain rebuilt over (N, C, S) maps (the exporter bakes the traced shape
    into the Reshapes), with the graph's own epsilon, constants and tensors."""
    import numpy as np

    if len(node.input) < 3 or not node.input[0]:
        return None
    before = graph.producer.get(node.input[0])
    if before is None or before.op_type != "Reshape":
        return None
    scale, zero = _vector(graph, node.input[1]), _vector(graph, node.input[2])
    if scale is None or zero is None or len(scale.dims) != 1 or list(zero.dims) != list(scale.dims):
        return None
    ones, zeros = graph.array(scale, limit=1 << 16), graph.array(zero, limit=1 << 16)
    if not (np.all(ones == 1) and np.all(zeros == 0)):
        return None
    groups = int(scale.dims[0])
    after = graph.only(node.output[0], "Reshape")
    mul = graph.only(after.output[0], "Mul") if after is not None else None
    if mul is None:
        return None
    w, offset = graph.gain(mul.input[1] if mul.input[0] == after.output[0] else mul.input[0])
    if w is None or not w.dims or math.prod(w.dims[1:]) != 1 or w.dims[0] % groups:
        return None
    add = graph.only(mul.output[0], "Add")
    b = None
    if add is not None:
        b = _vector(graph, add.input[1] if add.input[0] == mul.output[0] else add.input[0])
        if b is None or list(b.dims) != list(w.dims):
            add, b = None, None
    attr = next((a for a in node.attribute if a.name == "epsilon"), None)
    if attr is not None and attr.type != 1:
        where = f"InstanceNormalization node {node.name!r}" if node.name else "an InstanceNormalization node"
        raise InputError(f"{graph.path}: {where} has an epsilon attribute that is not a float; refused")
    eps = float(attr.f) if attr is not None else 1e-5
    source = f"onnx:{node.name or node.op_type}.epsilon" if attr is not None else "onnx:InstanceNormalization default"
    y = (add or mul).output[0]
    x, casts = graph.back(before.input[0])
    nodes = casts[::-1] + [before, node, after, mul] + ([add] if add is not None else [])
    norm = _norm(graph, "group_norm", w, offset, None if b is None else _tensor(graph, b), eps, source,
                 "InstanceNormalization", x, y, nodes, channels_first=True)
    if norm is None:
        return None
    norm.weight = norm.weight.reshape(-1)
    norm.bias = None if norm.bias is None else norm.bias.reshape(-1)
    norm.dim, norm.groups = int(norm.weight.numel()), groups
    norm.program = _group_program(graph, x, y, scale, zero, w, offset, b, eps)
    return norm


def _group_program(graph: _Graph, x: str, y: str, scale, zero, w, offset, b, eps) -> bytes:
    """The decomposed GroupNorm over (N, C, S): Reshape(x, [0, G, -1]), the graph's
    InstanceNormalization (its epsilon, its ones and zeros), Reshape(Shape(x)), * (w + offset)[C, 1],
    + b[C, 1]; tensors as stored, in x's element type."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    elem = _elem_type(graph, x, w)
    np_type = helper.tensor_dtype_to_np_dtype(elem)

    def stored(t, name):
        return numpy_helper.from_array(graph.array(t).reshape(-1, 1) if name in ("w", "b") else graph.array(t),
                                       name)

    inits = [helper.make_tensor("group_shape", TensorProto.INT64, [3], [0, int(scale.dims[0]), -1]),
             numpy_helper.from_array(graph.array(scale).astype(np_type), "ones"),
             numpy_helper.from_array(graph.array(zero).astype(np_type), "zeros"), stored(w, "w")]
    nodes = [helper.make_node("Shape", [x], ["x_shape"]),
             helper.make_node("Reshape", [x, "group_shape"], ["h"]),
             helper.make_node("InstanceNormalization", ["h", "ones", "zeros"], ["n"], epsilon=float(eps)),
             helper.make_node("Reshape", ["n", "x_shape"], ["m"])]
    gain = "w"
    if offset:
        inits.append(numpy_helper.from_array(np.asarray(offset, dtype=graph.array(w).dtype), "offset"))
        nodes.append(helper.make_node("Add", ["w", "offset"], ["w1"]))
        gain = "w1"
    nodes.append(helper.make_node("Mul", ["m", gain], ["p" if b is not None else y]))
    if b is not None:
        inits.append(stored(b, "b"))
        nodes.append(helper.make_node("Add", ["p", "b"], [y]))
    g = helper.make_graph(nodes, "group_norm", [helper.make_tensor_value_info(x, elem, ["n", "channels", "s"])],
                          [helper.make_tensor_value_info(y, elem, None)], initializer=inits)
    model = helper.make_model(g, opset_imports=list(graph.model.opset_import), producer_name="parity-cli")
    model.ir_version = min(graph.model.ir_version or 10, 10)
    return model.SerializeToString()


def _vector(graph: _Graph, name: str):
    """The stored tensor behind an operand, through casts: an initializer or a Constant node's
    value; None where the graph computes it."""
    name = graph.through(name)
    if name in graph.init:
        return graph.init[name]
    node = graph.producer.get(name)
    if node is not None and node.op_type == "Constant":
        return next((a.t for a in node.attribute if a.name == "value" and a.type == 4), None)  # TENSOR
    return None


def _decomposed(graph: _Graph, mean_node):
    """ReduceMean(h^2) -> Add(eps) -> Sqrt/Div or Pow(-0.5)/Mul -> normed -> Mul(gain) [+ bias]."""
    square, pre = graph.back(mean_node.input[0])  # casts inside the pattern belong to it
    sq = graph.producer.get(square)
    if sq is None:
        return None
    if sq.op_type == "Pow" and graph.constant(sq.input[1]) == 2.0:
        h = sq.input[0]
    elif sq.op_type == "Mul" and sq.input[0] == sq.input[1]:
        h = sq.input[0]
    else:
        return None
    q, post = graph.forward(mean_node.output[0])
    add = graph.only(q, "Add")
    if add is None:
        return None
    other = add.input[1] if add.input[0] == q else add.input[0]
    eps = graph.constant(other)
    if eps is None:
        return None
    nodes = [sq, *pre[::-1], mean_node, *post, add]
    narrow = [next((a.i for a in c.attribute if a.name == "to"), 0) for c in pre if c.op_type == "Cast"]
    reduced = next((_DTYPES[t] for t in narrow if t in (10, 16)), None)
    root = graph.only(add.output[0], ("Sqrt", "Pow"))
    if root is None:
        return None
    nodes.append(root)
    normed = None
    if root.op_type == "Pow":  # (q + eps)^-0.5
        if graph.constant(root.input[1]) != -0.5:
            return None
        mul = graph.only(root.output[0], "Mul")
        normed = mul
    else:
        for consumer in graph.consumers.get(root.output[0], []):
            if consumer.op_type == "Div" and consumer.input[1] == root.output[0]:
                if graph.constant(consumer.input[0]) == 1.0:  # 1 / sqrt, then h * that
                    nodes.append(consumer)
                    normed = graph.only(consumer.output[0], "Mul")
                else:
                    normed = consumer  # h / sqrt
            elif consumer.op_type == "Reciprocal":
                nodes.append(consumer)
                normed = graph.only(consumer.output[0], "Mul")
    if normed is None:
        return None
    if h not in normed.input:  # T5 casts x twice: one Cast feeds the Pow, another the Mul
        base = graph.through(h)
        other = next((i for i in normed.input if i != h and graph.through(i) == base and i != base), None)
        if other is None:
            return None
        nodes += graph.back(other)[1]
    nodes.append(normed)
    # centred h (x - mean(x)): a LayerNorm
    # (torch's float16 LayerNorm export at opset < 17 casts h to double between the Sub and the Pow)
    kind, x = "rms_norm", h
    centred, upcasts = graph.back(h)
    sub = graph.producer.get(centred)
    if sub is not None and sub.op_type == "Sub":
        m = graph.producer.get(sub.input[1])
        if m is not None and m.op_type == "ReduceMean" and m.input[0] == sub.input[0]:
            kind, x = "layer_norm", sub.input[0]
            nodes = [m, sub, *upcasts[::-1]] + nodes
    # the gain: a Mul by an initializer after optional casts
    out, gain_mul = normed.output[0], None
    for _ in range(3):
        cand = graph.consumers.get(out, [])
        if len(cand) != 1:
            break
        nxt = cand[0]
        if nxt.op_type in _PASS:
            nodes.append(nxt)
            out = nxt.output[0]
            continue
        if nxt.op_type == "Mul":
            gain_mul = nxt
        break
    if gain_mul is None:
        return None
    operand = gain_mul.input[1] if gain_mul.input[0] == out else gain_mul.input[0]
    w, offset = graph.gain(operand)
    if w is None:
        return None
    nodes.append(gain_mul)
    y, bias = gain_mul.output[0], None
    nxt = graph.only(y, "Add")
    if kind == "layer_norm" and nxt is not None:
        operand = nxt.input[1] if nxt.input[0] == y else nxt.input[0]
        b, _ = graph.gain(operand)
        if b is not None:
            bias = _tensor(graph, b)
            nodes.append(nxt)
            y = nxt.output[0]
    # x: the tensor before the Casts into h; the casts belong to the norm
    x, casts = graph.back(x)
    nodes = casts[::-1] + nodes
    norm = _norm(graph, kind, w, offset, bias, eps, f"onnx:{add.name or 'Add'} constant", "decomposed", x, y, nodes)
    if norm is not None and reduced and reduced != norm.dtype:
        norm.reduced = reduced
    return norm


def reduced_words(reduced: str) -> str:
    """What a Cast pair around a norm's ReduceMean does, and why the CPU run may not show it."""
    return (f"the graph casts the mean square to {reduced} around its ReduceMean (a mixed-precision converter's "
            f"Cast pair): x^2 {'overflows above |x| = 256 and ' if reduced == 'float16' else ''}is rounded to "
            f"{reduced} before the mean; ONNX Runtime's CPU provider has no {reduced} ReduceMean and drops the "
            "pair, a provider with one (CUDA) reduces in " + reduced)


def _norm(graph, kind, w, offset, bias, eps, source, form, x, y, nodes, zeros=frozenset(), original=None,
          channels_first=False):
    weight = _tensor(graph, w)
    if weight.dim() == 0:
        return None
    if not (math.isfinite(eps) and 0 <= eps <= FLOAT32_MAX):  # the log of it is printed, and no norm has one
        raise InputError(f"{graph.path}: a norm's eps is {eps} ({source}); refused")
    elem = _elem_type(graph, x, w)
    dtype = _DTYPES.get(elem, "float32")
    # one initializer, several norms (unnamed nodes are several too: counted by identity)
    shared = len({id(n) for n in graph.consumers.get(w.name, [])}) > 1
    names = _norm_names(graph, w.name, nodes, shared)
    norm = OnnxNorm(name=names[0], kind=kind, dim=int(weight.shape[-1]), eps=eps, eps_source=source, form=form,
                    weight=weight, bias=bias, offset=offset, dtype=dtype, names=tuple(names))
    norm.program = _subgraph(graph, x, y, nodes, elem, zeros, original, channels_first)
    norm.ends = (x, y)
    return norm


def norm_depths(nodes, norms) -> None:
    """Each norm's depth: how many norms the longest path of the data flow passes before it. A
    norm that reads another's output (through attention, a residual) is deeper; q_norm and k_norm,
    side by side, are level. The order check of a value-paired copy (pairing) compares norms of
    different depth only: a graph's node list orders parallel branches as it likes."""
    ends = {norm.ends[1]: norm for norm in norms if norm.ends}
    level: dict = {}
    for node in nodes:  # topologically sorted, as ONNX requires of a graph's node list
        here = max((level.get(name, 0) for name in node.input if name), default=0)
        for name in node.output:
            level[name] = here + 1 if name in ends else here
    for y, norm in ends.items():
        norm.depth = level.get(y, 1) - 1


def _elem_type(graph, x: str, w) -> int:
    """x's element type: from shape inference, else (ORT's contrib ops are not typed by onnx's
    inference) a Cast that produced it, else the gain's own type (the Skip ops bind both to T)."""
    if x in graph.types and graph.types[x][0]:
        return graph.types[x][0]
    node = graph.producer.get(x)
    if node is not None and node.op_type == "Cast":
        to = next((a.i for a in node.attribute if a.name == "to"), 0)
        if to:
            return to
    for vi in graph.model.graph.input:
        if vi.name == x:
            return vi.type.tensor_type.elem_type
    return w.data_type


def _subgraph(graph: _Graph, x: str, y: str, nodes, elem: int, zeros=frozenset(),
              original=None, channels_first=False) -> bytes:
    """x -> y with every node between them and the initializers they read; a Skip op's skip
    input becomes zeros shaped like x, so the op normalises x alone. A BatchNormalization's x is
    (N, C, ...) (channels_first): its channels are axis 1."""
    from onnx import TensorProto, helper

    # back from y through the norm's own nodes and any all-constant subtree (Constant nodes, an
    # Add(w, 1) on the gain); any other tensor (a Skip op's skip, the rest of the model) is cut
    allowed = {id(n) for n in nodes}
    swap = {id(original): nodes[-1]} if original is not None else {}  # a Skip op with its folded bias cut
    keep, stack, seen = [], [y], set()
    while stack:
        name = stack.pop()
        if name == x or name in seen or name in zeros or not name or name in graph.init:
            continue
        seen.add(name)
        node = graph.producer.get(name)
        if node is not None and id(node) in swap:
            node = swap[id(node)]
        if node is None or not (id(node) in allowed or _constant_tree(graph, name)):
            continue  # becomes zeros shaped like x, below
        keep.append(node)
        stack.extend(i for i in node.input if i)
        if len(keep) > 64:
            raise InputError(f"{graph.path}: a norm subgraph of more than 64 nodes; the pattern is not a norm")
    keep.reverse()
    order = {**graph.order, **{id(new): graph.order.get(old, 0) for old, new in swap.items()}}
    keep.sort(key=lambda n: order.get(id(n), 0))
    produced = {o for n in keep for o in n.output}
    inputs_needed = {i for n in keep for i in n.input if i and i not in produced}
    rank = graph.types.get(x, (None, None))[1]
    out_elem = graph.types.get(y, (None, None))[0] or elem
    extra_nodes, inits = [], []
    for name in sorted(inputs_needed - {x}):
        if name in graph.init and name not in zeros:
            t = graph.init[name]
            arr = graph.array(t)
            from onnx import numpy_helper

            copy = numpy_helper.from_array(arr, name)
            if t.data_type == 16:
                copy = helper.make_tensor(name, TensorProto.BFLOAT16, list(t.dims), arr.reshape(-1).tolist(), raw=False)
            inits.append(copy)
        else:  # the skip of a Skip*Normalization, or a stray input: zeros like x
            extra_nodes += [helper.make_node("Shape", [x], [f"{name}__shape"]),
                            helper.make_node("ConstantOfShape", [f"{name}__shape"], [f"{name}__zf"],
                                             value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])),
                            helper.make_node("Cast", [f"{name}__zf"], [name], to=elem)]
    if channels_first:
        shape = ["n", "channels"] + [f"d{k}" for k in range(2, rank or 2)]
    else:
        shape = [f"d{k}" for k in range((rank or 2) - 1)] + ["dim"]
    g = helper.make_graph(extra_nodes + list(keep), "norm", [helper.make_tensor_value_info(x, elem, shape)],
                          [helper.make_tensor_value_info(y, out_elem, None)], initializer=inits)
    model = helper.make_model(g, opset_imports=list(graph.model.opset_import), producer_name="parity-cli")
    model.ir_version = min(graph.model.ir_version or 10, 10)
    return model.SerializeToString()


def _constant_tree(graph: _Graph, name: str, depth: int = 0) -> bool:
    """Whether `name` is computed from constants and initializers alone (within a few nodes);
    memoised, so a graph built to fan out costs each tensor once."""
    memo = graph.__dict__.setdefault("_const", {})
    if name in memo:
        return memo[name]
    if name in graph.init:
        result = True
    else:
        node = graph.producer.get(name)
        if node is None or depth > 6:
            result = False
        elif node.op_type == "Constant":
            result = True
        else:
            memo[name] = False  # a cycle in a hostile graph is no constant
            result = all(_constant_tree(graph, i, depth + 1) for i in node.input if i)
    memo[name] = result
    return result


def _prefix(names: list[str]) -> int:
    """How many leading dotted parts every name shares (`m.model.` of a wrapped export), stopping
    before a part with a digit (a layer index is never a prefix, even when --layers picks one
    block) and before a name's last part."""
    split = [n.split(".") for n in names]
    if not split:
        return 0
    k = 0
    while (all(len(p) > k + 1 for p in split) and len({p[k] for p in split}) == 1
           and not any(c.isdigit() for c in split[0][k])):
        k += 1
    return k


def _match_by_name(norms: list[OnnxNorm], reference: list) -> None:
    """Each norm whose names are no checkpoint layer's takes the layer whose name is the longest
    dotted suffix of one of them, once each side's common prefix is set aside: an export inside a
    wrapper names `m.model.layers.0.input_layernorm`, one of `model.model` names `layers.0...`.
    A match must cover the whole of one side's unprefixed name and be the only longest one."""
    ref_names = [l.name for l in reference]
    known = set(ref_names)
    ref_split = [n.split(".") for n in ref_names]
    rp = _prefix(ref_names)
    np_ = _prefix([name for n in norms for name in n.names if "." in name])
    for norm in norms:
        if norm.name in known:
            continue
        for name in norm.names:
            parts = name.split(".")
            best, winners = 0, []
            for ref, rparts in zip(ref_names, ref_split):
                k = 0
                while k < min(len(parts), len(rparts)) and parts[-1 - k] == rparts[-1 - k]:
                    k += 1
                if k and (k >= len(rparts) - rp or k >= len(parts) - np_):
                    if k > best:
                        best, winners = k, [ref]
                    elif k == best:
                        winners.append(ref)
            if len(winners) == 1:
                norm.name = winners[0]
                break


def _match_by_gain(norms: list[OnnxNorm], reference: list) -> None:
    """A graph whose names say nothing (ORT's optimizer renames fused nodes, constant folding
    renames Gemma's 1 + w): each such norm takes the reference layer whose effective gain (and
    bias) it holds, in graph order; failing that, the only one whose bias it holds (a gain moved
    to another layer is then that layer's finding, not the bias's); then the one whose gain it
    holds; then that gain shifted by a whole number (a dropped or doubled +1, which pairing then
    reports). Pairing says so, and checks the graph's order (pairing.BY_VALUE)."""
    import torch

    def close(a, b, shifts=(0.0,)):
        return a is not None and b is not None and a.numel() == b.numel() and any(
            torch.allclose(a.double().reshape(-1), b.double().reshape(-1) + d, rtol=1e-3, atol=1e-6) for d in shifts)

    names = {l.name for l in reference}
    free = [l for l in reference if l.name not in {n.name for n in norms}]

    def gains(norm, layer, shifts=(0.0,)):
        return close(norm.offset + norm.weight.double(), layer.gain_offset + layer.weight.double(), shifts)

    tiers = (lambda n, l: gains(n, l) and ((n.bias is None) == (l.bias is None)) and (n.bias is None or close(n.bias, l.bias)),
             "bias",
             lambda n, l: gains(n, l),
             lambda n, l: gains(n, l, (-1.0, 1.0, -2.0, 2.0)))
    for tier in tiers:
        for norm in norms:
            if norm.name in names:
                continue
            fits = [l for l in free if l.dim == norm.dim and l.weight.numel() == norm.weight.numel()]
            if tier == "bias":  # only a bias no other free layer holds says which layer it is
                fits = [l for l in fits if close(norm.bias, l.bias)]
                layer = fits[0] if len(fits) == 1 else None
            else:
                layer = next((l for l in fits if tier(norm, l)), None)
            if layer is not None:
                norm.name, norm.paired_by = layer.name, "value"
                free.remove(layer)


def is_onnx(path) -> bool:
    return str(path).lower().endswith(".onnx")


def distinct_norms(norms):
    """Each norm once under its own name: a norm reached twice (a shared module) once, another
    norm found under a name already taken as `name#2`, `name#3` (its own layer, which pairing
    reports). Graph readers (ONNX, OpenVINO IR) find norms by walking from each output."""
    import dataclasses

    seen: dict = {}
    for norm in norms:
        first = seen.get(norm.name)
        if first is not None and _same(first, norm):
            continue
        if first is not None:
            k = 2
            while f"{norm.name}#{k}" in seen:
                k += 1
            norm = dataclasses.replace(norm, name=f"{norm.name}#{k}")
        seen[norm.name] = norm
        yield norm


def _same(a: OnnxNorm, b: OnnxNorm) -> bool:
    """Two finds of one norm: the same form, eps, offset, gain and bias (and running statistics)."""
    import torch

    def equal(x, y):
        return (x is None) == (y is None) and (x is None or (x.shape == y.shape and bool(torch.equal(x, y))))

    return (a.kind, a.form, a.eps, a.offset, a.training, a.groups) == \
        (b.kind, b.form, b.eps, b.offset, b.training, b.groups) \
        and equal(a.weight, b.weight) and equal(a.bias, b.bias) and equal(a.running_mean, b.running_mean) \
        and equal(a.running_var, b.running_var)
