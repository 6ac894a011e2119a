"""Stage 1 for a LiteRT (TFLite) flatbuffer, `.tflite`: its norms, their eps and gains.

What `litert_torch.convert` writes for a Hugging Face model (litert-torch 0.10.0, read from converted
graphs): an RMSNorm as MUL(x, x) (or SQUARE) -> MEAN(last axis) -> ADD(eps) -> RSQRT -> MUL(x, .) ->
MUL(., gain); a LayerNorm as MEAN(x) -> SQUARED_DIFFERENCE(x, mean) -> MEAN -> ADD(eps) -> RSQRT ->
MUL(x - mean, .) -> MUL(., gain) -> ADD(., bias). RESHAPEs and CASTs between them are walked through.
The eps is the ADD's constant as stored (a float16 graph stores 1e-5 as 1.00136e-5); Gemma's 1 + w is
folded into the gain constant by the converter, as llama.cpp's converter bakes it.

Each op's output is named by the module path it was traced in: `LlamaModel_model/LlamaDecoderLayer_0/
LlamaRMSNorm_input_layernorm;5` (a class, then the attribute it is held under; a ModuleList's own name
is left out). The RSQRT's path, as `model.0.input_layernorm`, pairs the norm with the checkpoint's
layer (onnx_graph._match_by_name, by the longest dotted suffix), else its gain does. Constants are
named by the first path that made them (`arith.constantN` where that is lost), and equal constants
are stored once: a Llama's norms share one eps, fresh gains of ones one gain.

The file is untrusted: it is read by a flatbuffer walker written here, every offset, length and
count checked against the file before it is followed (no generated schema code, which follows any
offset it is given); a file that is not a TFLite model of schema 3, or whose tables point outside it,
is one line. Nothing in it is executed and no interpreter is built to read it."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.onnx_graph import OnnxNorm
from parity_cli.sources.tensors import MAX_NORM_ELEMENTS

MAX_TFLITE_BYTES = 1 << 36  # 64 GiB: a buffer may sit past the flatbuffer's 2 GiB (Buffer.offset)
MAX_ITEMS = 1 << 22  # tensors, operators or buffers of one graph
MAX_DEPTH = 8  # RESHAPEs and CASTs walked through between two ops of a norm
ADD, MUL, MEAN, SUB, RESHAPE, CAST, SQUARE, RSQRT, SQUARED_DIFFERENCE = 0, 18, 40, 41, 22, 53, 92, 76, 99
DTYPES = {0: ("float32", 4), 1: ("float16", 2), 10: ("float64", 8), 18: ("bfloat16", 2)}  # TensorType: (dtype, bytes)


class _Bad(Exception):
    pass


class _Buf:
    """Bounded little-endian reads of the flatbuffer (an mmap of the file)."""

    def __init__(self, data):
        self.data, self.size = data, len(data)

    def u(self, fmt: str, at: int):
        n = struct.calcsize(fmt)
        if at < 0 or at + n > self.size:
            raise _Bad(f"a read at byte {at} runs past the end ({self.size} bytes)")
        return struct.unpack_from("<" + fmt, self.data, at)[0]

    def table(self, at: int) -> _Table:
        vtable = at - self.u("i", at)
        vsize = self.u("H", vtable)
        if vsize < 4 or vsize % 2:
            raise _Bad(f"a table at byte {at} has a vtable of {vsize} bytes")
        return _Table(self, at, vtable, vsize)


@dataclass
class _Table:
    buf: _Buf
    at: int
    vtable: int
    vsize: int

    def _field(self, i: int) -> int | None:
        slot = 4 + 2 * i
        if slot >= self.vsize:
            return None
        off = self.buf.u("H", self.vtable + slot)
        return self.at + off if off else None

    def scalar(self, i: int, fmt: str, default=0):
        at = self._field(i)
        return default if at is None else self.buf.u(fmt, at)

    def _ref(self, i: int) -> int | None:
        at = self._field(i)
        return None if at is None else at + self.buf.u("I", at)

    def vector(self, i: int) -> tuple[int, int]:
        """(the first element's byte, the count) of a vector field; (0, 0) where it is absent."""
        at = self._ref(i)
        if at is None:
            return 0, 0
        n = self.buf.u("I", at)
        if n > MAX_ITEMS or at + 4 + n > self.buf.size:
            raise _Bad(f"a vector at byte {at} declares {n} elements past the end of the file")
        return at + 4, n

    def tables(self, i: int) -> list[_Table]:
        start, n = self.vector(i)
        return [self.buf.table(start + 4 * k + self.buf.u("I", start + 4 * k)) for k in range(n)]

    def ints(self, i: int, fmt: str = "i") -> list[int]:
        start, n = self.vector(i)
        size = struct.calcsize(fmt)
        if start + n * size > self.buf.size:
            raise _Bad(f"a vector at byte {start} runs past the end")
        return list(struct.unpack_from(f"<{n}{fmt}", self.buf.data, start)) if n else []

    def string(self, i: int) -> str:
        start, n = self.vector(i)
        return bytes(self.buf.data[start:start + n]).decode("utf-8", "replace") if n else ""


@dataclass
class Tensor:
    name: str
    shape: tuple
    type: int
    data: object  # the constant's bytes (a memoryview), or None for an activation


@dataclass
class Op:
    code: int
    inputs: list
    outputs: list


@dataclass
class Graph:
    path: Path
    tensors: list
    ops: list
    description: str
    version: int
    _constants: dict = field(default_factory=dict, repr=False)

    def producer(self) -> dict:
        return {t: k for k, op in enumerate(self.ops) for t in op.outputs}

    def constant(self, t: int):
        """A float constant's values as stored (a torch tensor), else None: an activation, another
        type, bytes that disagree with its shape, or more elements than a norm has (a weight matrix
        beside a MUL is never copied out of the file). Each is materialised once."""
        if t in self._constants:
            return self._constants[t]
        import torch

        tensor = self.tensors[t] if 0 <= t < len(self.tensors) else None
        kind = DTYPES.get(tensor.type) if tensor is not None and tensor.data is not None else None
        count = math.prod(tensor.shape or (1,)) if kind else 0
        value = None
        if kind and 0 < count <= MAX_NORM_ELEMENTS and len(tensor.data) == count * kind[1]:
            value = torch.frombuffer(bytearray(tensor.data), dtype=getattr(torch, kind[0]))
        self._constants[t] = value
        return value


def is_tflite(path) -> bool:
    return str(path).lower().endswith(".tflite")


def read_graph(path: Path) -> Graph:
    """The main subgraph's tensors (constants with their bytes) and operators, every offset checked."""
    from parity_cli.sources.jsonfile import regular_file

    path = Path(path)
    regular_file(path, "the TFLite model", MAX_TFLITE_BYTES, "more than a TFLite model holds; refused")
    with open(path, "rb") as fh:
        try:
            data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError) as exc:  # an empty file cannot be mapped
            raise InputError(f"{path}: not a TFLite model (cannot map it: {exc})") from None
    if len(data) < 8 or bytes(data[4:8]) != b"TFL3":
        raise InputError(f"{path}: not a TFLite model (no TFL3 identifier at byte 4)")
    try:
        return _graph(path, _Buf(memoryview(data)))
    except _Bad as exc:
        raise InputError(f"{path}: a malformed TFLite flatbuffer: {exc}") from None


def _graph(path: Path, buf: _Buf) -> Graph:
    model = buf.table(buf.u("I", 0))
    version = model.scalar(0, "I")
    if version != 3:
        raise _Bad(f"schema version {version}; parity reads version 3")
    codes = [max(c.scalar(0, "b"), c.scalar(3, "i")) for c in model.tables(1)]
    subgraphs = model.tables(2)
    if not subgraphs:
        raise _Bad("no subgraph")
    buffers = model.tables(4)
    main = subgraphs[0]
    tensors = []
    for t in main.tables(0):
        index = t.scalar(2, "I")
        tensors.append(Tensor(name=t.string(3), shape=tuple(t.ints(0)), type=t.scalar(1, "b"),
                              data=_buffer(buf, buffers, index) if 0 < index < len(buffers) else None))
    ops = []
    for op in main.tables(3):
        index = op.scalar(0, "I")
        if index >= len(codes):
            raise _Bad(f"an operator's opcode index {index} is past the {len(codes)} opcodes")
        inputs, outputs = op.ints(1), op.ints(2)
        if any(t >= len(tensors) for t in inputs + outputs):
            raise _Bad("an operator names a tensor past the graph's")
        ops.append(Op(codes[index], inputs, outputs))
    return Graph(path=path, tensors=tensors, ops=ops, description=model.string(3), version=version)


def _buffer(buf: _Buf, buffers: list, index: int):
    b = buffers[index]
    start, n = b.vector(0)
    if n:
        return buf.data[start:start + n]
    offset, size = b.scalar(1, "Q"), b.scalar(2, "Q")
    if offset <= 1 or not size:  # 1 marks a buffer the writer left empty
        return None
    if offset + size > buf.size:
        raise _Bad(f"buffer {index} declares {size} bytes at byte {offset}, past the end of the file")
    return buf.data[offset:offset + size]


def find_norms(graph: Graph) -> list[OnnxNorm]:
    """Every RSQRT fed by ADD(MEAN(..), eps) and multiplied into its input, with its gain (and bias)."""
    producer = graph.producer()
    consumers: dict = {}
    for k, op in enumerate(graph.ops):
        for t in op.inputs:
            consumers.setdefault(t, []).append(k)
    norms = []
    for op in graph.ops:
        if op.code == RSQRT and len(op.inputs) == 1:
            norm = _norm_at(graph, producer, consumers, op)
            if norm is not None:
                norms.append(norm)
    _depths(graph, norms)
    return norms


def _through(graph: Graph, producer: dict, t: int) -> tuple[int, object]:
    """(the tensor, its producing op) past RESHAPEs and CASTs."""
    for _ in range(MAX_DEPTH):
        k = producer.get(t)
        if k is None or graph.ops[k].code not in (RESHAPE, CAST):
            return t, (graph.ops[k] if k is not None else None)
        t = graph.ops[k].inputs[0]
    return t, None


def _norm_at(graph: Graph, producer: dict, consumers: dict, rsqrt: Op) -> OnnxNorm | None:
    _, add = _through(graph, producer, rsqrt.inputs[0])
    if add is None or add.code != ADD or len(add.inputs) != 2:
        return None
    eps_t = next((t for t in add.inputs if graph.constant(t) is not None), None)
    var_t = next((t for t in add.inputs if t != eps_t), None)
    if eps_t is None or var_t is None or graph.constant(eps_t).numel() != 1:
        return None
    _, mean = _through(graph, producer, var_t)
    if mean is None or mean.code != MEAN:
        return None
    _, sq = _through(graph, producer, mean.inputs[0])
    if sq is None:
        return None
    if sq.code == SQUARE or (sq.code == MUL and len(sq.inputs) == 2 and sq.inputs[0] == sq.inputs[1]):
        kind, x = "rms_norm", sq.inputs[0]
    elif sq.code == SQUARED_DIFFERENCE:
        kind, x = "layer_norm", sq.inputs[0]
    else:
        return None
    eps_value = float(graph.constant(eps_t).double().reshape(-1)[0])
    if not (math.isfinite(eps_value) and eps_value >= 0):
        raise InputError(f"{graph.path}: a norm's eps is {eps_value} (the ADD before RSQRT); refused")
    y, gain, bias = _affine(graph, consumers, rsqrt.outputs[0], kind)
    if gain is None:
        return None
    weight = graph.constant(gain).reshape(-1)
    # the RSQRT's own scope first: a constant equal to another norm's (gains of ones) is stored once,
    # under the first norm's path
    names = list(dict.fromkeys(_names(graph.tensors[rsqrt.outputs[0]].name) + _names(graph.tensors[gain].name)))
    stored = DTYPES.get(graph.tensors[eps_t].type, ("float32",))[0]
    return OnnxNorm(name=names[0] if names else graph.tensors[gain].name, kind=kind, dim=int(weight.numel()),
                      eps=eps_value, eps_source=f"tflite: the {stored} constant ADDed before RSQRT",
                      form="decomposed", weight=weight, bias=None if bias is None else graph.constant(bias).reshape(-1),
                      dtype=DTYPES.get(graph.tensors[x].type, ("float32",))[0], names=tuple(names), ends=(x, y))


def _affine(graph: Graph, consumers: dict, r: int, kind: str) -> tuple:
    """(the norm's output, its gain constant, its bias constant). The normalised row is a MUL by r:
    h * r, or for a LayerNorm the converter may write x * r + (-mean * r), an ADD of no constant
    after it. Then a MUL by the gain constant and, for a LayerNorm, an ADD of the bias constant."""
    def uses(t, depth=0):  # the ops reading t, past RESHAPEs and CASTs
        found = []
        for k in consumers.get(t, []):
            op = graph.ops[k]
            if op.code in (RESHAPE, CAST) and depth < MAX_DEPTH:
                found += uses(op.outputs[0], depth + 1)
            else:
                found.append(op)
        return found

    def only_use(t, codes):
        found = uses(t)
        return found[0] if len(found) == 1 and found[0].code in codes else None

    def const_input(op):
        return next((t for t in (op.inputs if op else []) if graph.constant(t) is not None), None)

    for scaled in (op for op in uses(r) if op.code == MUL):
        y = scaled.outputs[0]
        shifted = only_use(y, (ADD,))
        if kind == "layer_norm" and shifted is not None and const_input(shifted) is None:
            y = shifted.outputs[0]
        times = only_use(y, (MUL,))
        gain = const_input(times)
        if gain is None:
            continue
        y, bias = times.outputs[0], None
        if kind == "layer_norm":
            plus = only_use(y, (ADD,))
            bias = const_input(plus)
            if bias is not None:
                y = plus.outputs[0]
        return y, gain, bias
    return None, None, None


def _names(name: str) -> list[str]:
    """A constant's traced module path as the dotted attribute names it was reached by:
    `__main__.Logits/x.LlamaModel_model/x.LlamaDecoderLayer_0/x.LlamaRMSNorm_input_layernorm;5`
    is `model.0.input_layernorm` (the root's own segment has no attribute)."""
    path = name.split(";", 1)[0]
    attrs = []
    for segment in path.split("/"):
        cls = segment.rsplit(".", 1)[-1]
        if "_" in cls:
            attrs.append(cls.split("_", 1)[1])
    return [".".join(attrs)] if attrs else []


def _depths(graph: Graph, norms: list) -> None:
    """Each norm's depth: how many norms the longest path of the data flow passes before it (the
    op list is in execution order); see onnx_graph.norm_depths."""
    ends = {norm.ends[1]: norm for norm in norms}
    level: dict = {}
    for op in graph.ops:
        here = max((level.get(t, 0) for t in op.inputs if t >= 0), default=0)
        for t in op.outputs:
            level[t] = here + 1 if t in ends else here
    for y, norm in ends.items():
        norm.depth = level.get(y, 1) - 1


def match_by_path(norms: list, reference: list) -> None:
    """A traced module path leaves out a ModuleList's own name (`m.model.0.input_layernorm` for
    `model.layers.0.input_layernorm`): each norm takes the one reference layer whose name, with the
    segment before each index dropped, ends its path at a dot (the longest such, if one is longest)."""
    import re

    short = {ref.name: re.sub(r"(^|\.)[^.]+\.(\d+)(?=\.|$)", r"\1\2", ref.name) for ref in reference}
    for norm in norms:
        for name in norm.names:
            fits = [ref for ref, s in short.items() if name == s or name.endswith("." + s)]
            longest = max((len(short[ref]) for ref in fits), default=0)
            best = [ref for ref in fits if len(short[ref]) == longest]
            if len(best) == 1:
                norm.name = best[0]
                break

