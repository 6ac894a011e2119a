"""Stage 1 for an OpenVINO IR (`model.xml` + `model.bin`): its norms, their eps, gains and subgraphs.

The IR is read with OpenVINO's own reader (openvino.Core().read_model), never by parsing the
XML here, and searched for the norms OpenVINO's frontends write:
- MVN-6 (`axes` over the last axis, `eps_mode` inside_sqrt or outside_sqrt) and MVN-1
  (`reduction_axes`, eps inside the root; the op's default eps is 1e-9), `normalize_variance`
  set: a LayerNorm, what the PyTorch and ONNX frontends translate `layer_norm` into;
- decomposed: `Power(h, 2)` (or `Multiply(h, h)`) -> `ReduceMean(last axis)` -> `Add(eps)` ->
  `Sqrt` -> `Divide(h, .)`, `Divide(1, .)` or `Power(., -1)` -> `Multiply(h, .)`, or
  `Add(eps)` -> `Power(-0.5)` -> `Multiply`: what the PyTorch frontend writes for a Hugging Face
  RMSNorm (aten::rsqrt is Sqrt then Divide(1, .)); `h = x - ReduceMean(x)` makes it a LayerNorm;
- a fused `RMS`/`RMSNorm` op with its `epsilon`, where an IR carries one (the CPU plugin fuses
  the pattern into it internally; OpenVINO 2026.4's reader reads no IR that holds it);
- then a `Multiply` by the gain, through `Convert`s (the casts of a half model, the f16
  decompression of `save_model(compress_to_fp16=True)`), where the gain is a Constant, or a
  Constant plus a scalar (`Add(w, 1)`: Gemma's offset kept; the frontends fold it, so a Gemma IR
  usually stores 1 + w, baked in as llama.cpp's does), and for a LayerNorm an `Add` of a bias.
eps is the attribute, or the `Add`'s Constant with the element type it is stored in: a
compress_to_fp16 IR stores 1e-5 as float16's 1.00136e-5. Each norm maps to a checkpoint layer by
its gain Constant's name (`self.model.layers.0.input_layernorm.weight`) or the module path in its
ops' friendly names (`__module.model.layers.0.input_layernorm/aten::pow/Power`, the ONNX
frontend's `/model/layers.0/input_layernorm/Mul_1`). Its subgraph, from the norm's input to its
output with the constants it reads, is cut out and serialised: `--candidate openvino` compiles
exactly that.

The files are untrusted: both must be regular files within size caps before OpenVINO reads them;
OpenVINO's reader checks every Constant's declared offset and size against the .bin (refused in
one line: the .bin must hold every constant the XML declares) and maps the .bin rather than
reading it, so only the norms' gains are read from it, each bounded before its bytes are touched.
Nothing in the IR is executed: no extension is loaded, an op outside OpenVINO's opsets is refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.tensors import MAX_NORM_ELEMENTS

MAX_XML_BYTES = 128 << 20  # a 405B model's IR has about 10 MB of XML; the reader holds it parsed in memory
MAX_BIN_BYTES = 4 << 40  # the weights are mapped, not read: a bound on what a file may claim to be
MAX_OPS = 300_000  # ops of one IR (a 405B model's has about 20,000)
MAX_NORMS = 10_000
MAX_GAIN_BYTES = 64 << 20  # all norm gains read from one .bin together
FLOAT32_MAX = 3.4028234663852886e38
_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64"}
_PASS = ("Convert",)
FUSED = ("RMS", "RMSNorm")
PROGRAM_MAGIC = b"PARITY-OV-IR\x00"  # an IR subgraph in layer.program: magic, len(xml) (u64), xml, bin


@dataclass
class IrNorm:
    """One norm of the IR: the same fields as an ONNX graph's (onnx_graph.OnnxNorm), which the
    pairing by name and by value reads."""

    name: str
    kind: str
    dim: int
    eps: float
    eps_source: str
    form: str  # "decomposed", "MVN-6", "MVN-1", or the fused op
    weight: object
    bias: object = None
    offset: float = 0.0
    dtype: str = "float32"
    program: bytes = b""
    names: tuple = ()
    paired_by: str = "name"
    reduced: str | None = None
    eps_mode: str = "inside_sqrt"
    eps_stored: str = "f32"  # the element type the eps Constant is stored in (f16 in a compressed IR)
    running_mean: object = None
    running_var: object = None
    training: bool = False
    groups: int | None = None
    depth: int = 0  # norms on the longest path of the data flow before this one
    ends: tuple = ()  # (the norm's input, its output) as the model's Outputs (a runtime capture reads them)


def is_openvino_ir(path) -> bool:
    return str(path).lower().endswith(".xml")


def weights_path(path) -> Path:
    return Path(path).with_suffix(".bin")


def check_files(path) -> Path | None:
    """The XML and its .bin (None where there is none) as regular files within their caps."""
    from parity_cli.sources.jsonfile import regular_file

    path = Path(path)
    regular_file(path, "the OpenVINO IR", MAX_XML_BYTES, f"over the {MAX_XML_BYTES >> 20} MiB of XML an IR may have")
    weights = weights_path(path)
    try:
        weights.stat()
    except OSError:
        return None
    regular_file(weights, f"the weights of {path.name}", MAX_BIN_BYTES, "more than any model's weights; refused")
    return weights


_CORE = []


def _core():
    if not _CORE:
        import openvino as ov

        _CORE.append(ov.Core())
    return _CORE[0]


def count_layers(path, cap: int = MAX_OPS) -> int:
    """The `<layer` elements of an IR's XML, counted from its bytes a chunk at a time (no parse, no
    tree), stopping past `cap`: OpenVINO's reader builds the whole model before its ops can be
    counted (700,000 layers in 124 MB took 2.6 GB and ran past 120 s). A count that also takes
    `<layer` inside a text or comment only refuses earlier."""
    import re

    token = re.compile(rb"<layer[\s>/]")
    count, tail = 0, b""
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                return count
            data = tail + chunk  # a token cut by the last chunk's end is whole here
            count += len(token.findall(data)) - len(token.findall(tail))  # one inside the tail was counted there
            if count > cap:
                return count
            tail = data[-7:]


def read_model(path):
    """(the IR as an openvino.Model, its ops in order), after the file checks; failures in one line."""
    path = Path(path)
    weights = check_files(path)
    if count_layers(path) > MAX_OPS:
        raise InputError(f"{path}: more than {MAX_OPS} layers (a 405B model's IR has about 20,000); refused before "
                         "OpenVINO reads it")
    core = _core()
    try:
        model = core.read_model(str(path), str(weights)) if weights else core.read_model(str(path))
    except Exception as exc:
        text = " ".join(str(exc).split())
        if "Incorrect weights in bin file" in text or "is_valid_weights_range" in text:
            size = weights.stat().st_size if weights else 0
            raise InputError(f"{path}: declares constants past the end of {weights_path(path).name} ({size} bytes): "
                             "the .bin must hold every constant the XML declares; refused") from None
        if "unsupported opset" in text or "doesn't contain the operation" in text:
            what = text[text.find("Cannot create"):] if "Cannot create" in text else text[-200:]
            raise InputError(f"{path}: an op outside OpenVINO's opsets ({what[:200]}); no extension is loaded "
                             "for an untrusted IR; refused") from None
        raise InputError(f"{path}: not a readable OpenVINO IR ({text[-240:]})") from None
    ops = model.get_ordered_ops()
    if len(ops) > MAX_OPS:
        raise InputError(f"{path}: more than {MAX_OPS} ops (a 405B model's IR has about 20,000); refused")
    return model, ops


def producer(model) -> str | None:
    """The exporter the IR's own rt_info names: optimum-intel (its `optimum` section, with the
    transformers it exported from) or OpenVINO's converter (the framework it converted from). Text
    from the file: each value cut to 40 characters."""
    def get(*keys):
        try:
            return str(model.get_rt_info(list(keys)).astype(str))[:40] if model.has_rt_info(list(keys)) else None
        except Exception:
            return None

    runtime, framework = get("Runtime_version"), get("conversion_parameters", "framework")
    intel, transformers = get("optimum", "optimum_intel_version"), get("optimum", "transformers_version")
    parts = [f"transformers {transformers}" if intel and transformers else None,
             f"OpenVINO {runtime.split('-')[0]}" if runtime else None,
             f"from {framework}" if framework and not intel else None]
    said = ", ".join(p for p in parts if p)
    if intel:
        return f"optimum-intel {intel}" + (f" ({said})" if said else "")
    return f"OpenVINO's converter ({said})" if said else None


# --- the graph ------------------------------------------------------------------------------------


def _id(node) -> int:
    return node.get_instance_id()


def _key(output) -> tuple:
    return (_id(output.get_node()), output.get_index())


def _type(node) -> str:
    return node.get_type_name()


def _elem(node) -> str:
    return node.get_output_element_type(0).get_type_name()


def _users(output) -> list:
    """The nodes reading an output, each once, in a stable order."""
    seen, out = set(), []
    for inp in output.get_target_inputs():
        node = inp.get_node()
        if _id(node) not in seen and _type(node) != "Result":
            seen.add(_id(node))
            out.append(node)
    return sorted(out, key=lambda n: n.get_friendly_name())


def _back(output) -> tuple:
    """Back through Converts to where a value comes from: (that output, the Converts passed). At
    most 8 steps."""
    passed = []
    while _type(output.get_node()) in _PASS and len(passed) < 8:
        passed.append(output.get_node())
        output = output.get_node().input_value(0)
    return output, passed


def _forward(output) -> tuple:
    """On through Converts that alone read `output`: (the output reached, the Converts passed)."""
    passed = []
    while len(passed) < 8:
        users = list(output.get_target_inputs())
        if len(users) != 1 or _type(users[0].get_node()) not in _PASS:
            break
        passed.append(users[0].get_node())
        output = passed[-1].output(0)
    return output, passed


def _only(output, types) -> object:
    """The single reader of `output` of one of these types, or None."""
    found = [n for n in _users(output) if _type(n) in types]
    return found[0] if len(found) == 1 else None


class _Reader:
    """Constants read from the mapped .bin, each bounded before its bytes are touched."""

    def __init__(self, path: Path):
        self.path = path
        self.read = 0

    def array(self, node, limit: int = MAX_NORM_ELEMENTS):
        """A Constant's values as numpy (bf16 as its 16-bit patterns, uint16)."""
        import numpy as np

        shape = list(node.get_output_shape(0))
        count = math.prod(shape) if shape else 1
        if count > limit:
            raise InputError(f"{self.path}: the Constant {node.get_friendly_name()!r} holds {shape} elements "
                             f"(a norm gain has at most {limit}); refused")
        elem = _elem(node)
        data = np.array(node.get_data(), copy=True)
        if elem == "bf16":  # the reader hands bf16 data out typed as float16: the bits are bf16's
            data = data.view(np.uint16)
        self.read += data.nbytes
        if self.read > MAX_GAIN_BYTES:
            raise InputError(f"{self.path}: more than {MAX_GAIN_BYTES} bytes of norm gains; refused")
        return data.reshape(shape)

    def scalar(self, output) -> tuple:
        """(value, the element type it is stored in) of a one-element Constant behind Converts, or (None, None)."""
        output, _ = _back(output)
        node = output.get_node()
        if _type(node) != "Constant":
            return None, None
        shape = list(node.get_output_shape(0))
        if (math.prod(shape) if shape else 1) != 1:
            return None, None
        elem = _elem(node)
        arr = self.array(node, limit=16)
        if elem == "bf16":
            import torch

            return float(torch.from_numpy(arr.reshape(-1).astype("int16")).view(torch.bfloat16)[0]), elem
        if arr.dtype.kind not in "fiub":
            raise InputError(f"{self.path}: the Constant {node.get_friendly_name()!r} is {arr.dtype}, not a real "
                             "number; refused")
        return float(arr.reshape(-1)[0]), elem

    def tensor(self, node):
        """A gain or bias Constant as a torch tensor of its stored type, leading 1s dropped."""
        import numpy as np
        import torch

        elem = _elem(node)
        if elem not in _DTYPES:
            raise InputError(f"{self.path}: the norm gain {node.get_friendly_name()!r} is {elem}, not a float type; "
                             "refused")
        arr = self.array(node)
        if elem == "bf16":
            t = torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(arr))
        while t.dim() > 1 and t.shape[0] == 1:
            t = t[0]
        return t

    def gain(self, output) -> tuple:
        """(Constant node, offset) behind a gain operand: w, or w + c, through Converts; (None, 0)."""
        output, _ = _back(output)
        node = output.get_node()
        if _type(node) == "Constant":
            return node, 0.0
        if _type(node) == "Add":
            for a, b in ((0, 1), (1, 0)):
                c, _ = self.scalar(node.input_value(b))
                base = _back(node.input_value(a))[0].get_node()
                if c is not None and _type(base) == "Constant" and list(base.get_output_shape(0)) != []:
                    shape = list(base.get_output_shape(0))
                    if math.prod(shape) > 1:
                        return base, c
        return None, 0.0


def _rank(output) -> int | None:
    rank = output.get_partial_shape().rank
    return rank.get_length() if rank.is_static else None


def _last_axis(axes, rank) -> bool:
    """Whether the reduction axes are exactly the last one."""
    axes = [int(a) for a in axes]
    if len(axes) != 1:
        return False
    if axes[0] == -1:
        return True
    return rank is not None and axes[0] == rank - 1


# normalisation ops an IR may hold: one the reader cannot take as a norm makes a checkpoint layer the
# copy lacks "not checked" (it may be that op), never "missing"
NORM_OPS = ("MVN", "GroupNormalization", "BatchNormInference", "NormalizeL2", *FUSED)


def find_norms(model, ops, path, unread: dict | None = None) -> list:
    """Every norm of the IR (IrNorm), in graph order, each with its serialised subgraph; `unread`
    counts, by op, the normalisation ops that are no norm the reader can take."""
    path = Path(path)
    reader = _Reader(path)
    found = []
    for node in ops:
        kind = _type(node)
        try:
            if kind == "MVN":
                norm = _mvn(reader, node)
            elif kind == "ReduceMean":
                norm = _decomposed(reader, node)
            elif kind == "GroupNormalization":
                norm = _group(reader, node)
            elif kind in FUSED:
                norm = _fused(reader, node)
            else:
                norm = None
        except InputError:
            raise
        except Exception as exc:  # the graph is not what the pattern reads: that norm is not found
            if isinstance(exc, (KeyboardInterrupt, MemoryError)):
                raise
            norm = None
        if isinstance(norm, list):  # a statistic several norms share: one norm per gain
            found.extend(norm)
        elif norm is not None:
            found.append(norm)
        if len(found) > MAX_NORMS:
            raise InputError(f"{path}: more than {MAX_NORMS} norms in one IR (a 405B model has 253); refused")
        if not norm and unread is not None and kind in NORM_OPS:
            unread[kind] = unread.get(kind, 0) + 1
    _depths(ops, found)
    _programs(found, path)
    return found


def folded_batch_norms(ops) -> int:
    """Ops the PyTorch frontend named after a BatchNorm it decomposed (`.../aten::batch_norm/
    BatchNormInference` on an Add or Multiply): OpenVINO converts an eval-mode BatchNorm into a
    Multiply and an Add by constants, (w / sqrt(var + eps)) and (b - mean * that), and folds the
    Multiply into a Convolution before it. Counted by their names, one per BatchNorm."""
    names = {node.get_friendly_name().rsplit("/", 1)[0] for node in ops
             if _type(node) in ("Add", "Multiply") and "batch_norm" in node.get_friendly_name().lower()}
    return len(names)


def _group(reader, node):
    """GroupNormalization-12 (data, scale[C], bias[C]; num_groups, epsilon) over (N, C, ...): the
    op the PyTorch frontend writes for nn.GroupNorm."""
    attrs = node.get_attributes()
    groups = int(attrs.get("num_groups", 0))
    if groups < 1 or node.get_input_size() < 3:
        return None
    gain, offset = reader.gain(node.input_value(1))
    bias, bias_offset = reader.gain(node.input_value(2))
    if gain is None or bias is None or bias_offset:
        return None
    x, _ = _back(node.input_value(0))
    y, casts = _forward(node.output(0))
    where = node.get_friendly_name() or "GroupNormalization"
    norm = _norm(reader, "group_norm", "GroupNormalization", gain, offset, bias, float(attrs.get("epsilon", 1e-5)),
                 f"openvino:{where}.epsilon", x, y, [node, *casts])
    if norm is not None:
        if norm.dim % groups:
            return None
        norm.groups = groups
    return norm


def _depths(ops, norms) -> None:
    """Each norm's depth in the data flow, as onnx_graph.norm_depths counts it (ops in
    topological order, as get_ordered_ops gives them)."""
    ends = {_key(norm._ends[1]): norm for norm in norms}
    level: dict = {}
    for node in ops:
        here = max((level.get(_key(node.input_value(k)), 0) for k in range(node.get_input_size())), default=0)
        for output in node.outputs():
            level[_key(output)] = here + 1 if _key(output) in ends else here
    for key, norm in ends.items():
        norm.depth = level.get(key, 1) - 1


def _gain_after(reader, output) -> tuple:
    """From a normalised value: on through Converts to the Multiply by the gain. (gain node, offset,
    multiply node, the Converts passed) or None."""
    found = _gains_after(reader, output)
    return found[0] if len(found) == 1 else None


def _gains_after(reader, output) -> list:
    """Every Multiply by a gain that reads a normalised value, each as _gain_after gives it: one,
    or several where the conversion merged the statistic of norms fed the same input (OpenVINO's
    common subexpressions: five RMSNorms of one x share Power/ReduceMean/Add/Sqrt/Divide, then five
    gain Multiplies). Each is a norm; [] where any reader is something else."""
    passed = []
    for _ in range(4):
        users = _users(output)
        if len(users) == 1 and _type(users[0]) in _PASS:
            passed.append(users[0])
            output = users[0].output(0)
            continue
        if not users or any(_type(u) != "Multiply" for u in users):
            return []
        found = []
        for mul in users:
            k = 1 if _key(mul.input_value(0)) == _key(output) else 0
            w, offset = reader.gain(mul.input_value(k))
            if w is None:
                return []
            found.append((w, offset, mul, passed))
        return found
    return []


def _bias_after(reader, output):
    """A LayerNorm's bias: the single Add of a vector Constant after the gain; (node, Add) or None."""
    users = _users(output)
    if len(users) != 1 or _type(users[0]) != "Add":
        return None
    add = users[0]
    k = 1 if _key(add.input_value(0)) == _key(output) else 0
    b, offset = reader.gain(add.input_value(k))
    if b is None or offset:
        return None
    return b, add


def _names(gain, nodes) -> list:
    """What the IR says of the checkpoint layer a norm belongs to, most telling first: its gain
    Constant's name (`self.model.norm.weight`, or an ONNX initializer's), the module path of the
    PyTorch frontend's friendly names (`__module.model.norm/aten::pow/Power`), the ONNX frontend's
    node path (`/model/layers.0/input_layernorm/Mul_1`); else the gain's own name."""
    names = []
    for name in [gain.get_friendly_name(), *sorted(gain.output(0).get_names())]:
        bare = name.removeprefix("self.")  # a module's parameter as the PyTorch frontend names it
        for suffix in (".weight", ".scale", ".gamma"):
            if bare.endswith(suffix) and len(bare) > len(suffix):
                names.append(bare[: -len(suffix)])
    for node in reversed(nodes):  # the gain Multiply's module first: a shared statistic is one norm's
        friendly = node.get_friendly_name()
        if friendly.startswith("__module."):
            names.append(friendly.split("/")[0].removeprefix("__module."))
            break
    for node in nodes:
        parts = [p for p in node.get_friendly_name().split("/") if p][:-1]
        parts = [p for k, p in enumerate(parts) if not (k + 1 < len(parts) and parts[k + 1].startswith(p + "."))]
        if parts and node.get_friendly_name().startswith("/"):
            names.append(".".join(parts))
            break
    return list(dict.fromkeys([n for n in names if n] + [gain.get_friendly_name()]))


def _norm(reader, kind, form, gain, offset, bias_node, eps, eps_source, x, y, nodes, eps_mode="inside_sqrt",
          eps_stored="f32", reduced=None):
    weight = reader.tensor(gain)
    if weight.dim() == 0 or weight.numel() < 2:
        return None
    if not (math.isfinite(eps) and 0 <= eps <= FLOAT32_MAX):
        raise InputError(f"{reader.path}: a norm's eps is {eps} ({eps_source}); refused")
    bias = None if bias_node is None else reader.tensor(bias_node)
    dtype = _DTYPES.get(x.get_element_type().get_type_name(), "float32")
    names = _names(gain, nodes)
    norm = IrNorm(name=names[0], kind=kind, dim=int(weight.shape[-1]), eps=eps, eps_source=eps_source, form=form,
                  weight=weight, bias=bias, offset=offset, dtype=dtype, names=tuple(names), eps_mode=eps_mode,
                  eps_stored=eps_stored, reduced=reduced if reduced != dtype else None)
    norm._ends = (x, y)  # cut out and serialised once every norm is found (_programs)
    return norm


def _mvn(reader, node):
    """MVN-6 (axes input, eps_mode) or MVN-1 (reduction_axes, eps inside the root) over the last axis."""
    attrs = node.get_attributes()
    if not attrs.get("normalize_variance", False):
        return None
    x = node.input_value(0)
    rank = _rank(x)
    if node.get_input_size() > 1:  # MVN-6
        axes_node = _back(node.input_value(1))[0].get_node()
        if _type(axes_node) != "Constant":
            return None
        axes = reader.array(axes_node, limit=16).reshape(-1).tolist()
        form = "MVN-6"
        mode = str(attrs.get("eps_mode", "INSIDE_SQRT")).lower()
    else:  # MVN-1
        axes = list(attrs.get("reduction_axes", []))
        form = "MVN-1"
        mode = "inside_sqrt"
    if not _last_axis(axes, rank):
        return None
    after = _gain_after(reader, node.output(0))
    if after is None:
        return None
    gain, offset, mul, casts = after
    y = mul.output(0)
    bias = _bias_after(reader, y)
    nodes = [node, *casts, mul]
    if bias is not None:
        nodes.append(bias[1])
        y = bias[1].output(0)
    eps = float(attrs.get("eps", 1e-9))
    where = node.get_friendly_name() or f"{form} node"
    source = f"openvino:{where}.eps" + (", eps_mode outside_sqrt" if mode == "outside_sqrt" else "")
    x, _ = _back(x)
    return _norm(reader, "layer_norm", form, gain, offset, None if bias is None else bias[0], eps, source, x, y, nodes,
                 eps_mode=mode)


def _fused(reader, node):
    """A fused RMS op (the CPU plugin's internal RMS, RMSNorm): x, then its scale; `epsilon`."""
    attrs = node.get_attributes()
    if "epsilon" not in attrs and "eps" not in attrs:
        return None
    gain, offset = None, 0.0
    for k in range(node.get_input_size() - 1, 0, -1):
        gain, offset = reader.gain(node.input_value(k))
        if gain is not None:
            break
    if gain is None:
        return None
    eps = float(attrs.get("epsilon", attrs.get("eps")))
    x, _ = _back(node.input_value(0))
    y, casts = _forward(node.output(0))
    return _norm(reader, "rms_norm", _type(node), gain, offset, None, eps,
                 f"openvino:{node.get_friendly_name() or _type(node)}.epsilon", x, y, [node, *casts])


def _decomposed(reader, mean):
    """ReduceMean(Power(h, 2)) over the last axis, then Add(eps), the root, the division, the gain."""
    attrs = mean.get_attributes()
    if not attrs.get("keep_dims", False):
        return None
    axes_node = _back(mean.input_value(1))[0].get_node()
    if _type(axes_node) != "Constant":
        return None
    square, pre = _back(mean.input_value(0))
    sq = square.get_node()
    if _type(sq) == "Power" and reader.scalar(sq.input_value(1))[0] == 2.0:
        h = sq.input_value(0)
    elif _type(sq) == "Multiply" and _key(sq.input_value(0)) == _key(sq.input_value(1)):
        h = sq.input_value(0)
    else:
        return None
    if not _last_axis(reader.array(axes_node, limit=16).reshape(-1).tolist(), _rank(h)):
        return None
    narrow = [c.get_attributes().get("destination_type") for c in pre]
    reduced = next((_DTYPES[t] for t in narrow if t in ("f16", "bf16")), None)
    q, post = _forward(mean.output(0))
    adds = [user for user in _users(q) if _type(user) == "Add"]
    norms = []
    for add in adds:  # one, or one an eps where norms of one input share the mean square (OpenVINO's CSE)
        norms += _after_mean(reader, h, add, q, [sq, *pre, mean, *post], reduced)
    return norms


def _after_mean(reader, h, add, q, nodes, reduced) -> list:
    """From Add(q, eps) on: the root, the division, then each gain that reads the normalised value."""
    other = add.input_value(1) if _key(add.input_value(0)) == _key(q) else add.input_value(0)
    eps, stored = reader.scalar(other)
    if eps is None:
        return []
    nodes = [*nodes, add]
    root = _only(add.output(0), ("Sqrt", "Power"))
    if root is None:
        return []
    nodes.append(root)
    normed = None
    if _type(root) == "Power":  # (q + eps)^-0.5
        if reader.scalar(root.input_value(1))[0] != -0.5:
            return []
        normed = _only(root.output(0), ("Multiply",))
    else:
        for user in _users(root.output(0)):
            if _type(user) == "Divide" and _key(user.input_value(1)) == _key(root.output(0)):
                if reader.scalar(user.input_value(0))[0] == 1.0:  # 1 / sqrt (aten::rsqrt), then h * that
                    nodes.append(user)
                    normed = _only(user.output(0), ("Multiply",))
                else:
                    normed = user  # h / sqrt
            elif _type(user) == "Power" and reader.scalar(user.input_value(1))[0] == -1.0:
                nodes.append(user)
                normed = _only(user.output(0), ("Multiply",))
    if normed is None:
        return []
    operands = [normed.input_value(k) for k in range(normed.get_input_size())]
    if _key(h) not in {_key(o) for o in operands}:  # T5 converts x twice: one Convert feeds the Power, one the Multiply
        base = _key(_back(h)[0])
        other = next((o for o in operands if _key(_back(o)[0]) == base and _key(o) != _key(h)), None)
        if other is None:
            return []
        nodes += _back(other)[1]
    nodes.append(normed)
    kind, x = "rms_norm", h
    sub = h.get_node()
    if _type(sub) == "Subtract":  # centred h = x - mean(x): a LayerNorm
        m = sub.input_value(1).get_node()
        if _type(m) == "ReduceMean" and _key(m.input_value(0)) == _key(sub.input_value(0)):
            kind, x = "layer_norm", sub.input_value(0)
            nodes = [m, sub, *nodes]
    x, _ = _back(x)
    where = add.get_friendly_name() or "Add"
    source = f"openvino:{where} constant" + (f", stored as {stored}" if stored and stored != "f32" else "")
    norms = []
    for gain, offset, mul, casts in _gains_after(reader, normed.output(0)):
        own = [*nodes, *casts, mul]
        y, bias = mul.output(0), None
        if kind == "layer_norm":
            found = _bias_after(reader, y)
            if found is not None:
                bias = found[0]
                own.append(found[1])
                y = found[1].output(0)
        norm = _norm(reader, kind, "decomposed", gain, offset, bias, eps, source, x, y, own,
                     eps_stored=stored or "f32", reduced=reduced)
        if norm is not None:
            norms.append(norm)
    return norms


# --- each norm's own subgraph ---------------------------------------------------------------------


def pack_program(xml: bytes, weights: bytes) -> bytes:
    import struct

    return PROGRAM_MAGIC + struct.pack("<Q", len(xml)) + xml + weights


def program_parts(program) -> tuple | None:
    """(xml, bin) of an IR subgraph packed by pack_program, or None for anything else (an ONNX one)."""
    import struct

    if not program or not bytes(program[: len(PROGRAM_MAGIC)]) == PROGRAM_MAGIC:
        return None
    head = len(PROGRAM_MAGIC)
    (size,) = struct.unpack_from("<Q", program, head)
    return bytes(program[head + 8: head + 8 + size]), bytes(program[head + 8 + size:])


def _programs(norms: list, path: Path) -> None:
    """Each norm's subgraph x -> y, cut out with the constants it reads and serialised."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="parity-ov-") as tmp:
        for k, norm in enumerate(norms):
            x, y = norm.ends = norm.__dict__.pop("_ends")
            norm.program = _cut(x, y, norm, path, Path(tmp) / f"n{k}.xml")


def _cut(x, y, norm, path: Path, target: Path) -> bytes:
    """x -> y as a model of its own: back from y over the norm's ops and the constants they read
    (at most 64 ops); the inputs that read x read a new Parameter instead while the model is
    serialised, and are put back after. Anything else the pattern reads (another input of the
    model) means it is not a norm's own computation: refused."""
    import openvino as ov
    import openvino.opset13 as op

    rank = _rank(x) or 2
    shape = [-1, norm.dim] + [-1] * (rank - 2) if norm.kind == "group_norm" else [-1] * (rank - 1) + [norm.dim]
    param = op.parameter(ov.PartialShape(shape), x.get_element_type(), name="x")
    rewired, seen, stack = [], set(), [y.get_node()]
    while stack:
        node = stack.pop()
        if _id(node) in seen:
            continue
        seen.add(_id(node))
        if len(seen) > 64:
            raise InputError(f"{path}: {norm.name}'s subgraph has more than 64 ops; the pattern is not a norm")
        for i in range(node.get_input_size()):
            source = node.input_value(i)
            if _key(source) == _key(x):
                rewired.append((node, i))
                continue
            if _type(source.get_node()) in ("Parameter", "ReadValue", "Result"):
                raise InputError(f"{path}: {norm.name}'s subgraph reads {source.get_node().get_friendly_name()!r} "
                                 "besides its input; refused")
            stack.append(source.get_node())
    try:
        for node, i in rewired:
            node.input(i).replace_source_output(param.output(0))
        sub = ov.Model([y], [param], "norm")
        ov.save_model(sub, str(target), compress_to_fp16=False)
        del sub
    finally:
        for node, i in rewired:
            node.input(i).replace_source_output(x)
    return pack_program(target.read_bytes(), target.with_suffix(".bin").read_bytes()
                        if target.with_suffix(".bin").exists() else b"")
