"""The `onnxruntime` built-in: the family's norm as an ONNX graph, run by an ONNX Runtime session.

What a model exported to ONNX computes: `RMSNormalization` (opset 23) or its decomposed form
(Pow -> ReduceMean -> Add(eps) -> Sqrt -> Reciprocal -> Mul), `LayerNormalization` (opset 17),
Gemma's `1 + w` as an `Add` on the scale, casts where the family's Hugging Face code has them;
an inference BatchNorm as `BatchNormalization` (opset 15 semantics, training_mode 0) on (N, C)
rows with the layer's running statistics, or decomposed as (x - mean) / Sqrt(var + eps) * w + b;
a GroupNorm as `GroupNormalization` (opset 21: per-channel scale and bias) on its (N, C*S) rows
reshaped to (N, C, S) maps, or decomposed (a LayerNorm over each (N, group, C/groups*S) slice);
a gated RMSNorm (Mamba2's, Qwen3-Next's: ONNX has no op for it) decomposed as its module's export
is: x and the gate z (the probe row [x | z] split) cast to float32, act(z) (Sigmoid, times z for
SiLU) multiplied into x before the per-group statistic or into the result after it, the statistic
as the RMSNorm pattern above over a (N, groups, C/groups) reshape, the gain cast-then-multiplied
(llama order) or in float32 (gemma order).
The weight, bias and statistics are graph inputs, so one session serves every layer of a shape
and eps.

At bfloat16 the CPU provider has no kernel for Mul, BatchNormalization or InstanceNormalization
(onnxruntime 1.32): a bfloat16 export of a norm that multiplies its gain at the input dtype (Llama's
and T5's order, Mamba2's gated norm), of a BatchNorm or of a GroupNorm cannot run there, so that cell
is refused in one line (check_layer) rather than computed in float32 as no deployment would.

--candidate-arg: op=auto|fused|decomposed (auto: fused where the runtime has the op),
compute=float32 (cast in and out, for a dtype the execution provider has no kernel for)."""

from __future__ import annotations

from parity_cli.backends import Runtime, refuse_unbuilt
from parity_cli.backends.exporting import cia_ops_materialized_once
from parity_cli.errors import InputError

RUNTIME = Runtime(
    "onnxruntime", "the family's norm as an ONNX graph (RMSNormalization-23 or decomposed, LayerNormalization-17, "
    "BatchNormalization, GroupNormalization) in ONNX Runtime's CPU provider; --candidate-arg op=fused|decomposed, "
    "compute=float32", package="onnxruntime", install="pip install onnx onnxruntime", requires=("onnx", "onnxruntime"),
    extra="onnx", args={"op": ("auto", "fused", "decomposed"), "compute": ("float32",)},
    public="torch.onnx.export of the module, run by an InferenceSession", order=20)

NAME = "onnxruntime"
INSTALL = "pip install onnx onnxruntime"
KINDS = ("rms_norm", "layer_norm", "batch_norm", "group_norm", "gated_rms_norm")
DTYPES = ("float32", "bfloat16", "float16", "float64")
OPS = ("auto", "fused", "decomposed")
_SESSIONS: dict = {}
_ONNX_TYPES = {"float32": 1, "float16": 10, "float64": 11, "bfloat16": 16}  # TensorProto enum


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bfloat16_gap(layer) -> str | None:
    """The op a bfloat16 export of the layer's module needs and ONNX Runtime's CPU provider has no
    bfloat16 kernel for (measured on onnxruntime 1.32 with torch.onnx.export, both exporters): the
    gain product of a family that multiplies at the input dtype (`weight * h.to(dtype)`: Llama's and
    T5's order), BatchNormalization, GroupNorm's InstanceNormalization. None: the export runs (Gemma's
    and OLMo 2's float32 arithmetic with one cast, LayerNormalization, torch.nn.RMSNorm's export)."""
    if layer.kind == "batch_norm":
        return "BatchNormalization kernel"
    if layer.kind == "group_norm":
        return "InstanceNormalization kernel (the exported GroupNorm's)"
    if layer.order in ("llama", "t5"):
        return "Mul kernel (the family multiplies the gain at the input dtype)"
    return None


def check_layer(layer, dtype: str | None = None, compute: str | None = None, device: str | None = None) -> None:
    """The kinds and dtypes an ONNX graph is built for here; anything else is one line before a layer
    runs. At bfloat16 on the CPU provider, a form whose export needs a kernel the provider lacks is
    refused (the model cannot run there), unless compute=float32 feeds it float32. An exported graph's
    own subgraph (layer.program) runs as it is."""
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"onnxruntime: no ONNX graph is built at {dtype}; use --dtype {', '.join(DTYPES)}")
    if getattr(layer, "program", None):
        return
    gap = _bfloat16_gap(layer) if dtype == "bfloat16" and compute != "float32" else None
    if gap and not str(device or "cpu").startswith("cuda"):
        raise InputError(f"onnxruntime: the CPU provider has no bfloat16 {gap}: a bfloat16 export of "
                         f"{layer.name} ({layer.kind}) cannot run there; --candidate-arg compute=float32 feeds it "
                         "float32, or --dtype float16")
    refuse_unbuilt("onnxruntime", layer, KINDS, "graph")


def describe(device: str = "cpu", op: str = "auto", compute: str | None = None, **_args) -> dict:
    """What the report states: the runtime's version, its execution provider, the ops and what they
    compute in. Nothing is run here."""
    from parity_cli.backends import distribution_version

    provider = "CUDAExecutionProvider" if str(device).startswith("cuda") else "CPUExecutionProvider"
    return {"runtime": distribution_version("onnxruntime", "onnxruntime-gpu"), "provider": provider, "op": op,
            "kernel": "RMSNormalization-23 (or its decomposition), LayerNormalization-17, BatchNormalization, "
                      "GroupNormalization-21; a gated RMSNorm decomposed",
            "computes_in": "float32 (x, the gain, bias and statistics cast to float32 in the graph, float64 at "
                           "float64 for BatchNorm/GroupNorm; the llama order's gain product at the probe dtype), the "
                           "result cast back to the probe dtype" + (" (compute=float32: fed and read as float32)"
                                                                    if compute == "float32" else "")}


def build_graph(kind: str, order: str, dim: int, per_head: tuple, dtype: str, eps: float, offset: float,
                op: str, bias: bool):
    """The norm of one layer shape as an ONNX model: inputs x (and scale, bias), output y."""
    from onnx import TensorProto, helper

    if kind == "batch_norm":
        return _batch_norm_graph(dim, dtype, eps, offset, op, bias)
    if kind == "gated_rms_norm":
        raise ValueError("a gated RMSNorm's graph is _gated_graph (its groups, gate and activation)")

    t = _ONNX_TYPES[dtype]
    f32 = TensorProto.FLOAT
    shape = ["n", *per_head, dim]
    gain_shape = [*per_head, dim]
    inputs = [helper.make_tensor_value_info("x", t, shape), helper.make_tensor_value_info("scale", t, gain_shape)]
    if bias:
        inputs.append(helper.make_tensor_value_info("bias", t, gain_shape))
    nodes, inits = [], []

    def const(name, value, dtype=f32):
        inits.append(helper.make_tensor(name, dtype, [], [value]))
        return name

    # the gain: the stored w, plus the family's offset computed in float32 (as Gemma's 1.0 + w.float())
    nodes.append(helper.make_node("Cast", ["scale"], ["scale32"], to=f32))
    gain = "scale32"
    if offset:
        nodes.append(helper.make_node("Add", ["scale32", const("offset", float(offset))], ["gain32"]))
        gain = "gain32"
    nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=f32))
    fused = op == "fused" and not per_head
    if kind == "rms_norm" and fused:
        # RMSNormalization with a float32 scale computes in float32 and returns float32 (Y has V's type)
        nodes.append(helper.make_node("RMSNormalization", ["x32", gain], ["y32"], axis=-1, epsilon=float(eps),
                                      stash_type=1))
    elif kind == "layer_norm" and fused:
        extra = []
        if bias:
            nodes.append(helper.make_node("Cast", ["bias"], ["bias32"], to=f32))
            extra = ["bias32"]
        nodes.append(helper.make_node("LayerNormalization", ["x32", gain, *extra], ["y32"], axis=-1,
                                      epsilon=float(eps), stash_type=1))
    else:
        axes = helper.make_tensor("axes", TensorProto.INT64, [1], [-1])
        inits.append(axes)
        h = "x32"
        if kind == "layer_norm":
            nodes.append(helper.make_node("ReduceMean", ["x32", "axes"], ["mean"], keepdims=1))
            nodes.append(helper.make_node("Sub", ["x32", "mean"], ["centred"]))
            h = "centred"
        nodes += [
            helper.make_node("Pow", [h, const("two", 2.0)], ["sq"]),
            helper.make_node("ReduceMean", ["sq", "axes"], ["q"], keepdims=1),
            helper.make_node("Add", ["q", const("eps", float(eps))], ["q_eps"]),
            helper.make_node("Sqrt", ["q_eps"], ["rms"]),
            helper.make_node("Reciprocal", ["rms"], ["inv"]),
            helper.make_node("Mul", [h, "inv"], ["normed"]),
        ]
        if order == "llama" and kind == "rms_norm":  # weight * h.to(dtype): the cast before the gain
            nodes.append(helper.make_node("Cast", ["normed"], ["normed_t"], to=t))
            nodes.append(helper.make_node("Cast", [gain], ["gain_t"], to=t))
            nodes.append(helper.make_node("Mul", ["gain_t", "normed_t"], ["y"]))
        else:
            nodes.append(helper.make_node("Mul", ["normed", gain], ["y32"]))
            if bias:
                nodes.append(helper.make_node("Cast", ["bias"], ["bias32"], to=f32))
                nodes.append(helper.make_node("Add", ["y32", "bias32"], ["y32b"]))
    if nodes[-1].output[0] != "y":
        nodes.append(helper.make_node("Cast", [nodes[-1].output[0]], ["y"], to=t))
    out_type = t
    if dtype == "bfloat16":  # numpy has no bfloat16: the runtime's bf16 result leaves as float32, exactly
        nodes.append(helper.make_node("Cast", ["y"], ["y_out"], to=f32))
        nodes[-2].output[0], nodes[-1].input[0], nodes[-1].output[0] = "y_bf16", "y_bf16", "y"
        out_type = f32
    output = helper.make_tensor_value_info("y", out_type, shape)
    graph = helper.make_graph(nodes, "norm", inputs, [output], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23 if fused and kind == "rms_norm" else 18)],
                              producer_name="parity-cli")
    model.ir_version = 10
    return model


def _batch_norm_graph(dim: int, dtype: str, eps: float, offset: float, op: str, bias: bool):
    """An inference BatchNorm on rows (N, C): inputs x, scale, (bias,) mean, var, each cast to
    float32 (float64 at float64: the CPU provider has both kernels) as a model's graph computes a
    half-precision norm; `BatchNormalization` (training_mode 0) where op is fused, else
    (x - mean) / Sqrt(var + eps) * scale + bias. The output at x's dtype."""
    from onnx import TensorProto, helper

    t = _ONNX_TYPES[dtype]
    ct = TensorProto.DOUBLE if dtype == "float64" else TensorProto.FLOAT
    names = ["scale", *(["bias"] if bias else []), "mean", "var"]
    inputs = [helper.make_tensor_value_info("x", t, ["n", dim])]
    inputs += [helper.make_tensor_value_info(name, t, [dim]) for name in names]
    nodes = [helper.make_node("Cast", [name], [name + "_c"], to=ct) for name in ["x", *names]]
    inits = []
    gain = "scale_c"
    if offset:
        inits.append(helper.make_tensor("offset", ct, [], [float(offset)]))
        nodes.append(helper.make_node("Add", ["scale_c", "offset"], ["gain_c"]))
        gain = "gain_c"
    if op == "fused":
        if not bias:  # B is not optional: zeros of C
            nodes += [helper.make_node("Shape", ["mean_c"], ["c_shape"]),
                      helper.make_node("ConstantOfShape", ["c_shape"], ["bias_c"],
                                       value=helper.make_tensor("zero", ct, [1], [0.0]))]
        nodes.append(helper.make_node("BatchNormalization", ["x_c", gain, "bias_c", "mean_c", "var_c"], ["y_c"],
                                      epsilon=float(eps), training_mode=0))
    else:
        inits.append(helper.make_tensor("eps", ct, [], [float(eps)]))
        nodes += [helper.make_node("Sub", ["x_c", "mean_c"], ["centred"]),
                  helper.make_node("Add", ["var_c", "eps"], ["var_eps"]),
                  helper.make_node("Sqrt", ["var_eps"], ["std"]),
                  helper.make_node("Div", ["centred", "std"], ["normed"]),
                  helper.make_node("Mul", ["normed", gain], ["scaled" if bias else "y_c"])]
        if bias:
            nodes.append(helper.make_node("Add", ["scaled", "bias_c"], ["y_c"]))
    out_type = TensorProto.FLOAT if dtype == "bfloat16" else t  # numpy has no bfloat16: its values as float32
    if dtype == "bfloat16":
        nodes += [helper.make_node("Cast", ["y_c"], ["y_bf16"], to=t), helper.make_node("Cast", ["y_bf16"], ["y"],
                                                                                       to=TensorProto.FLOAT)]
    else:
        nodes.append(helper.make_node("Cast", ["y_c"], ["y"], to=t))
    graph = helper.make_graph(nodes, "batch_norm", inputs, [helper.make_tensor_value_info("y", out_type, ["n", dim])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="parity-cli")
    model.ir_version = 10
    return model


def _group_norm_graph(channels: int, groups: int, spatial: int, dtype: str, eps: float, offset: float, op: str,
                      bias: bool):
    """A GroupNorm on probe rows (N, C*S), channel-major: inputs x, scale, (bias,) of C values, cast to
    float32 (float64 at float64), x reshaped to (N, C, S); `GroupNormalization` (opset 21: scale and
    bias per channel, num_groups, stash_type 1) where op is fused, else over (N, groups, C/groups*S):
    (h - ReduceMean(h)) / Sqrt(ReduceMean((h - mean)^2) + eps), reshaped back, * scale[C, 1] + bias.
    The output at x's dtype, as rows (N, C*S)."""
    from onnx import TensorProto, helper

    t = _ONNX_TYPES[dtype]
    ct = TensorProto.DOUBLE if dtype == "float64" else TensorProto.FLOAT
    i64 = TensorProto.INT64
    names = ["scale", *(["bias"] if bias else [])]
    inputs = [helper.make_tensor_value_info("x", t, ["n", channels * spatial])]
    inputs += [helper.make_tensor_value_info(name, t, [channels]) for name in names]
    nodes = [helper.make_node("Cast", [name], [name + "_c"], to=ct) for name in ["x", *names]]
    inits = [helper.make_tensor("map_shape", i64, [3], [0, channels, spatial]),
             helper.make_tensor("row_shape", i64, [2], [0, channels * spatial])]
    nodes.append(helper.make_node("Reshape", ["x_c", "map_shape"], ["x_map"]))
    gain = "scale_c"
    if offset:
        inits.append(helper.make_tensor("offset", ct, [], [float(offset)]))
        nodes.append(helper.make_node("Add", ["scale_c", "offset"], ["gain_c"]))
        gain = "gain_c"
    if not bias:
        nodes += [helper.make_node("Shape", [gain], ["c_shape"]),
                  helper.make_node("ConstantOfShape", ["c_shape"], ["bias_c"],
                                   value=helper.make_tensor("zero", ct, [1], [0.0]))]
    if op == "fused":
        nodes.append(helper.make_node("GroupNormalization", ["x_map", gain, "bias_c"], ["y_map"],
                                      epsilon=float(eps), num_groups=int(groups), stash_type=1))
        opset = 21
    else:
        inits += [helper.make_tensor("group_shape", i64, [3], [0, groups, -1]),
                  helper.make_tensor("axes", i64, [1], [2]),
                  helper.make_tensor("col", i64, [1], [1]),
                  helper.make_tensor("eps", ct, [], [float(eps)])]
        nodes += [helper.make_node("Reshape", ["x_map", "group_shape"], ["h"]),
                  helper.make_node("ReduceMean", ["h", "axes"], ["mean"], keepdims=1),
                  helper.make_node("Sub", ["h", "mean"], ["centred"]),
                  helper.make_node("Mul", ["centred", "centred"], ["square"]),
                  helper.make_node("ReduceMean", ["square", "axes"], ["var"], keepdims=1),
                  helper.make_node("Add", ["var", "eps"], ["var_eps"]),
                  helper.make_node("Sqrt", ["var_eps"], ["std"]),
                  helper.make_node("Div", ["centred", "std"], ["normed"]),
                  helper.make_node("Reshape", ["normed", "map_shape"], ["normed_map"]),
                  helper.make_node("Unsqueeze", [gain, "col"], ["gain_col"]),
                  helper.make_node("Unsqueeze", ["bias_c", "col"], ["bias_col"]),
                  helper.make_node("Mul", ["normed_map", "gain_col"], ["scaled"]),
                  helper.make_node("Add", ["scaled", "bias_col"], ["y_map"])]
        opset = 18
    nodes.append(helper.make_node("Reshape", ["y_map", "row_shape"], ["y_c"]))
    out_type = TensorProto.FLOAT if dtype == "bfloat16" else t  # numpy has no bfloat16: its values as float32
    if dtype == "bfloat16":
        nodes += [helper.make_node("Cast", ["y_c"], ["y_bf16"], to=t), helper.make_node("Cast", ["y_bf16"], ["y"],
                                                                                       to=TensorProto.FLOAT)]
    else:
        nodes.append(helper.make_node("Cast", ["y_c"], ["y"], to=t))
    graph = helper.make_graph(nodes, "group_norm", inputs,
                              [helper.make_tensor_value_info("y", out_type, ["n", channels * spatial])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="parity-cli")
    model.ir_version = 10
    return model


def _gated_graph(dim: int, groups: int, gate: str, activation: str, order: str, dtype: str, eps: float,
                 offset: float):
    """A gated RMSNorm on x and its gate z (each (N, C)), as the module's export computes it: both cast
    to float32, a = act(z) (Sigmoid; SiLU is z * Sigmoid(z)); h = x * a where the gate comes before
    the statistic; over (N, groups, C/groups): h * Reciprocal(Sqrt(ReduceMean(h^2) + eps)), back to
    (N, C); the gain cast-then-multiplied at the dtype (llama order) or in float32 (gemma order);
    times a where the gate comes after; the output at x's dtype."""
    from onnx import TensorProto, helper

    t = _ONNX_TYPES[dtype]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info("x", t, ["n", dim]), helper.make_tensor_value_info("z", t, ["n", dim]),
              helper.make_tensor_value_info("scale", t, [dim])]
    inits = [helper.make_tensor("group_shape", i64, [3], [0, groups, dim // groups]),
             helper.make_tensor("row_shape", i64, [2], [0, dim]), helper.make_tensor("axes", i64, [1], [-1]),
             helper.make_tensor("two", f32, [], [2.0]), helper.make_tensor("eps", f32, [], [float(eps)])]
    nodes = [helper.make_node("Cast", ["x"], ["x32"], to=f32), helper.make_node("Cast", ["z"], ["z32"], to=f32),
             helper.make_node("Cast", ["scale"], ["scale32"], to=f32), helper.make_node("Sigmoid", ["z32"], ["sig"])]
    act = "sig"
    if activation == "silu":
        nodes.append(helper.make_node("Mul", ["z32", "sig"], ["silu"]))
        act = "silu"
    gain = "scale32"
    if offset:
        inits.append(helper.make_tensor("offset", f32, [], [float(offset)]))
        nodes.append(helper.make_node("Add", ["scale32", "offset"], ["gain32"]))
        gain = "gain32"
    h = "x32"
    if gate == "before":
        nodes.append(helper.make_node("Mul", ["x32", act], ["gated"]))
        h = "gated"
    nodes += [helper.make_node("Reshape", [h, "group_shape"], ["grouped"]),
              helper.make_node("Pow", ["grouped", "two"], ["sq"]),
              helper.make_node("ReduceMean", ["sq", "axes"], ["q"], keepdims=1),
              helper.make_node("Add", ["q", "eps"], ["q_eps"]),
              helper.make_node("Sqrt", ["q_eps"], ["rms"]),
              helper.make_node("Reciprocal", ["rms"], ["inv"]),
              helper.make_node("Mul", ["grouped", "inv"], ["normed_groups"]),
              helper.make_node("Reshape", ["normed_groups", "row_shape"], ["normed"])]
    if order == "llama":  # weight * h.to(dtype): h and the gain rounded to the dtype, their product rounded to it
        # (a product of two half values is exact in float32, so Mul there and one Cast is the dtype's own
        # product, which the CPU provider has no bfloat16 kernel for)
        nodes += [helper.make_node("Cast", ["normed"], ["normed_t"], to=t),
                  helper.make_node("Cast", [gain], ["gain_t"], to=t),
                  helper.make_node("Cast", ["normed_t"], ["normed_t32"], to=f32),
                  helper.make_node("Cast", ["gain_t"], ["gain_t32"], to=f32),
                  helper.make_node("Mul", ["gain_t32", "normed_t32"], ["product32"]),
                  helper.make_node("Cast", ["product32"], ["y_t"], to=t),
                  helper.make_node("Cast", ["y_t"], ["y32"], to=f32)]
        y = "y32"
        if gate == "after":  # y * act(z.float()): promoted to float32
            nodes.append(helper.make_node("Mul", ["y32", act], ["y32g"]))
            y = "y32g"
    else:
        nodes.append(helper.make_node("Mul", [gain, "normed"], ["y32"]))
        y = "y32"
        if gate == "after":
            nodes.append(helper.make_node("Mul", ["y32", act], ["y32g"]))
            y = "y32g"
    out_type = TensorProto.FLOAT if dtype == "bfloat16" else t  # numpy has no bfloat16: its values as float32
    nodes.append(helper.make_node("Cast", [y], ["y_dtype"], to=t))
    nodes.append(helper.make_node("Cast", ["y_dtype"], ["y"], to=out_type))
    graph = helper.make_graph(nodes, "gated_rms_norm", inputs, [helper.make_tensor_value_info("y", out_type, ["n", dim])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="parity-cli")
    model.ir_version = 10
    return model


def _session(model, device: str):
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise InputError("onnxruntime: --device cuda needs onnxruntime-gpu (CUDAExecutionProvider is not available)")
        index = int(device.partition(":")[2] or 0)
        providers = [("CUDAExecutionProvider", {"device_id": index})]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers)


def _fused_available() -> bool:
    """RMSNormalization-23 needs a recent runtime (1.22+); older ones get the decomposed form."""
    key = ("fused?",)
    if key not in _SESSIONS:
        try:
            _session(build_graph("rms_norm", "gemma", 4, (), "float32", 1e-6, 0.0, "fused", False), "cpu")
            _SESSIONS[key] = True
        except Exception:
            _SESSIONS[key] = False
    return _SESSIONS[key]


def _to_ort(t):
    """A torch tensor as ONNX Runtime takes it (bfloat16 through its 16-bit pattern)."""
    import onnxruntime as ort
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.view(torch.int16).numpy(), _ONNX_TYPES["bfloat16"])
    return ort.OrtValue.ortvalue_from_numpy(t.numpy())


def _from_ort(value, dtype, device):
    import numpy as np
    import torch

    out = torch.from_numpy(np.ascontiguousarray(value.numpy()))
    return out.to(device=device, dtype=dtype)  # bfloat16 arrives as float32 holding bf16 values: exact


def _program(layer, device: str):
    """An exported graph's own norm subgraph (onnx_checkpoint): run as exported, its weights,
    eps and casts included; the weight the job hands over is the same one, read from the file."""
    import hashlib

    import onnx
    import torch

    key = ("program", hashlib.sha256(layer.program).hexdigest(), device)
    if key not in _SESSIONS:
        model = onnx.load_from_string(layer.program)
        inp = model.graph.input[0]
        elem = inp.type.tensor_type.elem_type
        rank = len(inp.type.tensor_type.shape.dim)
        names = {v: k for k, v in _ONNX_TYPES.items()}
        if elem not in names:
            raise InputError(f"onnxruntime: {layer.name}'s subgraph takes ONNX type {elem}, not a float type")
        out_elem = model.graph.output[0].type.tensor_type.elem_type
        if out_elem == _ONNX_TYPES["bfloat16"] or elem == _ONNX_TYPES["bfloat16"]:
            from onnx import TensorProto, helper

            last = model.graph.output[0].name  # numpy has no bfloat16: read the bf16 values as float32, exactly
            model.graph.node.append(helper.make_node("Cast", [last], [last + "__f32"], to=TensorProto.FLOAT))
            del model.graph.output[:]
            model.graph.output.append(helper.make_tensor_value_info(last + "__f32", TensorProto.FLOAT, None))
        try:
            session = _session(model, device)
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"onnxruntime: cannot run {layer.name}'s exported subgraph: "
                             f"{' '.join(str(exc).split())[:240]}") from None
        _SESSIONS[key] = (session, inp.name, getattr(torch, names[elem]), rank, model.graph.output[0].name)
    session, name, dtype, rank, out = _SESSIONS[key]
    channels_first = layer.kind == "batch_norm"
    feature_map = layer.kind == "group_norm"

    def run(x):
        # the graph's own rank: leading 1s added (batch), or rows folded; (n, heads, dim) kept whole;
        # a BatchNorm's rows (N, C) as N maps of C channels, 1 x 1 each (channels are its axis 1)
        if feature_map:  # a GroupNorm's rows (N, C*S), channel-major, as (N, C, S) maps (1s for the graph's rank)
            shaped = x.reshape(x.shape[0], layer.dim, layer.spatial, *([1] * (rank - 3))) if x.dim() == 2 else x
        elif channels_first:
            shaped = x.reshape(*x.shape[:2], *([1] * (rank - 2))) if x.dim() == 2 and rank > 2 else x
        elif x.dim() <= rank:
            shaped = x.reshape(*([1] * (rank - x.dim())), *x.shape)
        else:
            shaped = x.reshape(*([1] * max(0, rank - 2)), -1, x.shape[-1])
        (y,) = session.run_with_ort_values([out], {name: _to_ort(shaped.to(dtype))})
        return _from_ort(y, torch.float32 if dtype == torch.bfloat16 else dtype, x.device).reshape(x.shape).to(x.dtype)

    return run


def prepare(layer, weight, bias, eps: float, op: str = "auto", compute: str | None = None):
    """(layer, weight, bias, eps) -> x -> y through an InferenceSession; see the module doc."""
    import torch

    if getattr(layer, "program", None):
        return _program(layer, str(weight.device))

    check_layer(layer, _name(weight.dtype), compute, str(weight.device))
    if op not in OPS:
        raise InputError(f"onnxruntime: op={op!r}; use one of {', '.join(OPS)}")
    if compute not in (None, "float32"):
        raise InputError(f"onnxruntime: compute={compute!r}; only compute=float32 is known")
    if op == "auto":  # BatchNormalization is in every opset, GroupNormalization-21 in ORT 1.19+; RMSNormalization 23
        op = "fused" if layer.kind in ("batch_norm", "group_norm") or _fused_available() else "decomposed"
    dtype = _name(weight.dtype)
    run_dtype = "float32" if compute == "float32" else dtype
    if run_dtype not in _ONNX_TYPES:
        raise InputError(f"onnxruntime: no ONNX type for {dtype}")
    per_head = tuple(weight.shape[:-1])
    device = str(weight.device)
    grouping = (layer.groups, layer.spatial) if layer.kind == "group_norm" else None
    if layer.kind == "gated_rms_norm":
        grouping = (layer.groups, layer.gate, layer.activation)
    key = (layer.kind, layer.order, layer.dim, per_head, run_dtype, float(eps), float(layer.gain_offset), op,
           bias is not None, device, grouping)
    if key not in _SESSIONS:
        if layer.kind == "gated_rms_norm":
            model = _gated_graph(layer.dim, layer.groups, layer.gate, layer.activation, layer.order, run_dtype, eps,
                                 layer.gain_offset)
        elif grouping:
            model = _group_norm_graph(layer.dim, layer.groups, layer.spatial, run_dtype, eps, layer.gain_offset, op,
                                      bias is not None)
        else:
            model = build_graph(layer.kind, layer.order, layer.dim, per_head, run_dtype, eps, layer.gain_offset, op,
                                bias is not None)
        try:
            _SESSIONS[key] = _session(model, device)
        except InputError:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split())
            hint = "" if run_dtype == "float32" else (f"; the execution provider may lack {run_dtype} kernels: "
                                                      "--candidate-arg compute=float32 or --dtype float32")
            raise InputError(f"onnxruntime: cannot build the {op} {layer.kind} graph at {run_dtype}: "
                             f"{text[:240]}{hint}") from None
    session = _SESSIONS[key]
    cast = getattr(torch, run_dtype)
    feeds = {"scale": _to_ort(weight.to(cast))}
    if bias is not None:
        feeds["bias"] = _to_ort(bias.to(cast))
    if layer.kind == "batch_norm":  # the running statistics as the candidate's buffers hold them (its dtype)
        feeds["mean"] = _to_ort(layer.running_mean.to(weight.dtype).to(cast))
        feeds["var"] = _to_ort(layer.running_var.to(weight.dtype).to(cast))

    def run(x):
        if layer.kind == "gated_rms_norm":  # a probe row is [x | z]: the graph takes each
            feeds["x"], feeds["z"] = (_to_ort(part.to(cast)) for part in (x[..., :layer.dim], x[..., layer.dim:]))
        else:
            feeds["x"] = _to_ort(x.to(cast))
        try:
            (out,) = session.run_with_ort_values(["y"], feeds)
        except Exception as exc:
            text = " ".join(str(exc).split())
            hint = "" if run_dtype == "float32" else (f" (no {run_dtype} kernel? --candidate-arg compute=float32 "
                                                      "or --dtype float32)")
            raise RuntimeError(f"onnxruntime {op} {layer.kind} at {run_dtype}: {text[:240]}{hint}") from None
        y = _from_ort(out, cast, x.device).to(x.dtype)
        return y if layer.kind != "gated_rms_norm" else y.reshape(*x.shape[:-1], layer.dim)

    return run


def public_path(layer, weight, bias, eps: float, dynamo: bool = False):
    """The same norm through ONNX Runtime's public path, as a deployment takes it (issue 46's
    differential truth, written apart from prepare): the family's torch module (backends.deployed: its
    transformers class, else the plain torch module of its kind) at the candidate dtype, exported by
    `torch.onnx.export` (the TorchScript exporter, opset 18, the row axis dynamic, and the dynamo exporter
    where that one has no symbolic, as for torch.nn.RMSNorm's aten::rms_norm; dynamo=True: the dynamo
    exporter throughout, which gives the same ops here and takes seconds longer), run by an
    InferenceSession on the CPU provider. A graph the provider has no kernel for is one line: the
    export cannot run there."""
    import torch

    dtype = _name(weight.dtype)
    if dtype not in _ONNX_TYPES:
        raise InputError(f"onnxruntime: no ONNX type for {dtype}")
    key = ("public", _public_key(layer, weight, bias, eps), dynamo)
    if key not in _SESSIONS:  # parity prepares a layer once a probe set, each time with a fresh copy of its weight
        if len([k for k in _SESSIONS if k[0] == "public"]) > 4:
            _SESSIONS.pop(next(k for k in _SESSIONS if k[0] == "public"))
        _SESSIONS[key] = _exported_session(layer, weight, bias, eps, dynamo)
    session = _SESSIONS[key]
    inp, result = session.get_inputs()[0].name, session.get_outputs()[0].name

    def run(x):
        try:
            (y,) = session.run_with_ort_values([result], {inp: _to_ort(x.to(weight.dtype))})
        except Exception as exc:
            raise RuntimeError(f"onnxruntime export of {layer.kind}: {' '.join(str(exc).split())[:240]}") from None
        return _from_ort(y, torch.float32, x.device).to(x.dtype).reshape(*x.shape[:-1], -1)

    return run


def _public_key(layer, weight, bias, eps: float) -> tuple:
    """Everything a deployed module of the layer is built from: its class and kind's parameters, the
    dtype, eps and device, and the bytes of its tensors."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    stats = (layer.running_mean, layer.running_var) if layer.kind == "batch_norm" else ()
    for t in (weight, bias, *stats):
        if t is not None:
            digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digest.update(b"|")
    return (layer.kind, layer.order, layer.hf_class, layer.dim, tuple(weight.shape), layer.groups, layer.spatial,
            layer.gate, layer.activation, layer.layout, float(layer.gain_offset), layer.semantic_offset,
            str(weight.dtype), float(eps), str(weight.device), digest.hexdigest())


def _exported_session(layer, weight, bias, eps: float, dynamo: bool):
    """torch.onnx.export of the layer's deployed module, in an InferenceSession (bfloat16 output read
    as float32, exactly: numpy has no bfloat16)."""
    import contextlib
    import io
    import warnings

    import onnx
    import torch

    from parity_cli.backends.deployed import norm_module

    dtype = _name(weight.dtype)
    module = norm_module(layer, weight, bias, eps)
    row = tuple(weight.shape) if weight.dim() > 1 else (layer.width,)
    example = torch.zeros(2, *row, dtype=weight.dtype, device="cpu")
    def export(with_dynamo: bool):
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), cia_ops_materialized_once():
            warnings.simplefilter("ignore")
            if with_dynamo:
                exported = torch.onnx.export(module.cpu(), (example,), dynamo=True, input_names=["x"],
                                             output_names=["y"], dynamic_shapes=({0: torch.export.Dim("n")},))
                return exported.model_proto
            buffer = io.BytesIO()
            torch.onnx.export(module.cpu(), (example,), buffer, dynamo=False, opset_version=18, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
            return onnx.load_from_string(buffer.getvalue())

    # the TorchScript exporter has no opset-18 symbolic for aten::rms_norm (torch.nn.RMSNorm): dynamo's then
    dynamo = dynamo or any(isinstance(m, getattr(torch.nn, "RMSNorm", ())) for m in module.modules())
    try:
        try:
            model = export(dynamo)
        except Exception:
            if dynamo:
                raise
            model = export(True)  # another op the TorchScript exporter has no symbolic for
    except Exception as exc:
        raise InputError(f"onnxruntime: torch.onnx.export cannot export {layer.name}'s module: "
                         f"{' '.join(str(exc).split())[:240]}") from None
    out = model.graph.output[0]
    if out.type.tensor_type.elem_type == _ONNX_TYPES["bfloat16"]:  # numpy has no bfloat16: read its values as float32
        from onnx import TensorProto, helper

        model.graph.node.append(helper.make_node("Cast", [out.name], [out.name + "__f32"], to=TensorProto.FLOAT))
        del model.graph.output[:]
        model.graph.output.append(helper.make_tensor_value_info(out.name + "__f32", TensorProto.FLOAT, None))
    try:
        session = _session(model, str(weight.device))
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"onnxruntime: the torch.onnx.export of {layer.name} at {dtype} cannot run in ONNX "
                         f"Runtime: {' '.join(str(exc).split())[:240]}") from None
    return session

