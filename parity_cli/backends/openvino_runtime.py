"""The `openvino` built-in: the family's norm as an OpenVINO model, compiled on an OpenVINO plugin.

What a model converted to OpenVINO computes, built from opset ops as its frontends emit them:
- RMSNorm decomposed, as the PyTorch frontend translates the Hugging Face classes: Power(h, 2) ->
  ReduceMean(-1) -> Add(eps) -> Sqrt -> Divide(1, .) (aten::rsqrt) -> Multiply(h, .), or
  Power(q + eps, -0.5) (Gemma 3n's pow), then Multiply by the gain; the CPU plugin fuses the
  pattern into its internal RMS kernel;
- LayerNorm as MVN-6 (axes [-1], normalize_variance, eps_mode inside_sqrt: aten::layer_norm),
  or decomposed (ReduceMean -> Subtract -> the pattern above, as the ONNX frontend reads an
  unfused export);
- the family's casts (Convert): Llama casts the normalised value to the input type before the
  gain, Gemma/OLMo 2/Cohere compute in f32 with the gain and cast last, T5 casts to a half
  weight's type; Gemma's `1 + w` is an Add on the f32 scale.
- an inference BatchNorm as BatchNormInference-5 (the running statistics, the gain and bias as
  Constants at the model's type; the frontend translates aten::batch_norm so, and its own
  transformations then fold it into a Multiply and an Add), on (N, C) rows;
- a GroupNorm as GroupNormalization-12 (scale and bias per channel, num_groups, epsilon), on the
  (N, C*S) probe rows given as (N, C, S) maps, as the frontend translates aten::group_norm.
- a gated RMSNorm ([x | z] probe rows; no OpenVINO op) decomposed as the frontend translates its
  module (Mamba2's, Qwen3-Next's): x and z Sliced and converted to f32, Swish(z) (aten::silu) or
  Sigmoid(z), multiplied into x before the per-group statistic (gate before) or into the result
  (gate after), the statistic as the RMSNorm pattern over a [n, groups, C/groups] Reshape, the gain
  at the input type after a Convert (llama order) or in f32 (gemma order).
The gain and bias are Constants, as in a converted model (the plugin folds and fuses them as it
would there): one compiled model per layer. A bfloat16 probe enters as f32 and is converted
inside the model (exact: the values are bfloat16 already); a bfloat16 result leaves as f32, exactly.

--candidate-arg: precision=f32|bf16|f16 (the plugin's INFERENCE_PRECISION_HINT; unset: the
plugin's own default, which is bf16 on CPUs with avx512_bf16/AMX), form=auto|decomposed|mvn
(auto: decomposed for RMSNorm, MVN for LayerNorm), eps_mode=inside_sqrt|outside_sqrt (MVN's).

An exported IR's own norm subgraph (openvino_ir, --candidate-checkpoint model.xml) arrives as
`layer.program` and runs as it is, its constants, eps and Converts included."""

from __future__ import annotations

import hashlib

from parity_cli.backends import Runtime, distribution_version, refuse_unbuilt
from parity_cli.errors import InputError
from parity_cli.sources.openvino_ir import program_parts

NAME = "openvino"
INSTALL = "pip install openvino"
RUNTIME = Runtime(
    "openvino", "the family's norm as an OpenVINO model (decomposed RMS pattern, MVN-6 for LayerNorm) compiled on its "
    "CPU plugin; --candidate-arg precision=f32|bf16|f16, form=decomposed|mvn, eps_mode=inside_sqrt|outside_sqrt",
    package="openvino", install="pip install openvino", extra="openvino",
    args={"precision": ("f32", "bf16", "f16"), "form": ("auto", "decomposed", "mvn"),
          "eps_mode": ("inside_sqrt", "outside_sqrt")},
    public="ov.convert_model of the module, compiled on the CPU plugin", header="openvino", deviations=("eps_mode",),
    order=30)
KINDS = ("rms_norm", "layer_norm", "batch_norm", "group_norm", "gated_rms_norm")
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("f32", "bf16", "f16")
FORMS = ("auto", "decomposed", "mvn")
EPS_MODES = ("inside_sqrt", "outside_sqrt")
_OV_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
_MODELS: dict = {}
_DEVICES: dict = {}  # --device -> the OpenVINO device, once checked
_CORE = []


def core():
    """One openvino.Core per process."""
    if not _CORE:
        import openvino as ov

        _CORE.append(ov.Core())
    return _CORE[0]


def plugin_device(device: str) -> str:
    """--device as an OpenVINO device: cpu -> CPU, cuda -> GPU, cuda:N -> GPU.N."""
    device = str(device)
    if device == "cpu":
        return "CPU"
    index = device.partition(":")[2]
    return "GPU" + (f".{index}" if index else "")


def _check_device(device: str) -> str:
    """The OpenVINO device for --device, refused in one line where its plugin is absent."""
    if device in _DEVICES:
        return _DEVICES[device]
    name = plugin_device(device)
    try:
        available = list(core().available_devices)
    except Exception as exc:  # listing the devices loads every plugin: one that cannot load says why
        available, why = [], " ".join(str(exc).split())[:200]
        if name != "CPU":
            raise InputError(f"openvino: --device {device} maps to OpenVINO's {name} plugin, which cannot load "
                             f"here ({why})") from None
        return name
    if name not in available and not (name == "GPU" and any(d.startswith("GPU") for d in available)):
        raise InputError(f"openvino: --device {device} maps to OpenVINO's {name} device, which is not present "
                         f"(OpenVINO sees: {', '.join(available) or 'nothing'}); --device cpu runs the CPU plugin")
    _DEVICES[device] = name
    return name


def compile_config(precision: str | None, threads: int | None = None) -> dict:
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    return config


def _check_precision(precision: str | None) -> None:
    if precision is not None and precision not in PRECISIONS:
        raise InputError(f"openvino: precision={precision!r}; use one of {', '.join(PRECISIONS)}")


def check_layer(layer, dtype: str | None = None) -> None:
    """The kinds and dtypes an OpenVINO model is built for here; anything else is one line before a
    layer runs. An exported IR's own subgraph (layer.program) runs as it is, whatever its kind."""
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"openvino: no {dtype} model is built (the CPU plugin computes float64 as f32); "
                         f"use --dtype {', '.join(DTYPES)}")
    if program_parts(getattr(layer, "program", None) or b""):
        return
    refuse_unbuilt("openvino", layer, KINDS, "model")


def describe(device: str, precision: str | None = None, **_args) -> dict:
    """What the report states of the runtime: its version, the device, and the inference precision
    the plugin runs at (asked for, or its own default), read off a compiled one-op model, so a
    hint the CPU cannot honour (bf16 without avx512_bf16) shows as what runs. Refuses an absent
    plugin in one line."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as op

    _check_precision(precision)
    name = _check_device(device)
    c = core()
    try:
        default = _type_name(c.get_property(name, "INFERENCE_PRECISION_HINT"))
    except Exception:
        default = None
    x = op.parameter([-1, 4], ov.Type.f32)
    try:
        compiled = c.compile_model(ov.Model([op.multiply(x, op.constant(np.float32(2.0)))], [x]), name,
                                   compile_config(precision, 1))
        running = _type_name(compiled.get_property("INFERENCE_PRECISION_HINT"))
    except Exception as exc:
        raise InputError(f"openvino: the {name} plugin cannot compile a model here: "
                         f"{' '.join(str(exc).split())[:240]}") from None
    try:
        device_name = str(c.get_property(name, "FULL_DEVICE_NAME"))
    except Exception:
        device_name = name
    return {"runtime": distribution_version("openvino") or f"openvino {ov.get_version()}",
            "version": ov.get_version(), "device": name, "device_name": device_name,
            "kernel": "the family's norm from opset ops (decomposed RMSNorm, MVN-6, BatchNormInference-5, "
                      "GroupNormalization-12, a decomposed gated RMSNorm), compiled on the plugin",
            "computes_in": f"{running} (the {name} plugin's inference precision, "
                           f"{'asked' if precision else 'its default'}); a half model's Converts as the frontend "
                           "emits them",
            "inference_precision": running, "plugin_default": default,
            "precision_source": f"--candidate-arg precision={precision}" if precision else "the plugin's default",
            "precision_asked": precision}


def precision_note(info: dict) -> str | None:
    """A line for the report's warnings where the precision is not f32, or not what was asked."""
    running, asked = info.get("inference_precision"), info.get("precision_asked")
    if asked and running != asked:
        return (f"openvino: precision={asked} was asked, the {info['device']} plugin runs {running} "
                f"({info['device_name']} has no {asked} support); the verdict is for {running}")
    if running and running != "f32":
        why = f"--candidate-arg precision={asked}" if asked else "the plugin's default on this CPU"
        return (f"openvino: the {info['device']} plugin computes at {running} ({why}): every op rounds to {running}; "
                "--candidate-arg precision=f32 checks the kernels at full precision")
    return None


def notes(info: dict) -> list:
    """The report's warnings of what describe() found: the precision the plugin really runs."""
    note = precision_note(info)
    return [note] if note else []


def computes_in(dtype: str, info: dict | None) -> str:
    """The plugin's inference precision: what every op rounds to, whatever the probe's dtype."""
    return (info or {}).get("inference_precision") or {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]


def _type_name(t) -> str:
    get = getattr(t, "get_type_name", None)
    return get() if get else str(t)


# --- the family's norm as an OpenVINO model -------------------------------------------------------


def _bf16_tensor(t):
    """A torch tensor as an ov.Tensor of element type bf16 that owns its memory: its 16-bit patterns
    copied in, bit for bit (numpy has no bfloat16; an ov.Tensor over a numpy array only borrows the
    array, which nothing would keep alive)."""
    import numpy as np
    import openvino as ov
    import torch

    t = t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    owned = ov.Tensor(ov.Type.bf16, ov.Shape(list(t.shape)))
    if t.numel():
        owned.data.reshape(-1).view(np.uint16)[...] = t.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    return owned


def _constant(t, ov_type: str):
    """A torch tensor as an OpenVINO Constant of that element type that owns a copy of the values
    (bf16 through its 16-bit pattern, as the PyTorch frontend emits a bfloat16 parameter: a bf16
    Constant). Never memory borrowed from a temporary: a Constant over a numpy array that is
    freed afterwards multiplies by whatever is written there next (issue 46)."""
    import numpy as np
    import openvino as ov
    import torch

    t = t.detach().cpu().contiguous()
    if ov_type == "bf16":
        return ov.op.Constant(_bf16_tensor(t), shared_memory=False)
    array = np.ascontiguousarray(t.to(getattr(torch, {"f32": "float32", "f16": "float16"}[ov_type])).numpy())
    return ov.op.Constant(array, shared_memory=False)


def build_model(kind: str, order: str, dim: int, per_head: tuple, dtype: str, eps: float, offset: float, form: str,
                eps_mode: str, inverse_sqrt: str, weight, bias=None):
    """One layer's norm as an ov.Model: input x [n, *per_head, dim] at dtype (bf16: f32 in, converted),
    output y at dtype (bf16: converted to f32 at the end, exactly)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as op

    t = _OV_TYPES[dtype]
    T = {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16}[t]
    f32 = ov.Type.f32
    x_in = op.parameter([-1, *per_head, dim], f32 if t == "bf16" else T, name="x")
    x = op.convert(x_in, T) if t == "bf16" else x_in
    w = _constant(weight, t)
    b = None if bias is None else _constant(bias, t)
    axes = op.constant(np.array([-1], dtype=np.int64))

    def c(v):
        return op.constant(np.float32(v))

    def up(v):
        return v if t == "f32" else op.convert(v, f32)

    def normalise(h):
        if form == "mvn":  # MVN-6 over the last axis, as the frontends translate aten::layer_norm
            return op.mvn(h, axes, True, float(eps), eps_mode)
        if kind == "layer_norm":
            h = op.subtract(h, op.reduce_mean(h, axes, True))
        q = op.reduce_mean(op.power(h, c(2.0)), axes, True)  # h is f32 here: eps an f32 Constant
        q_eps = op.add(q, c(eps))
        if inverse_sqrt == "pow":  # torch.pow(q + eps, -0.5)
            return op.multiply(h, op.power(q_eps, c(-0.5)))
        return op.multiply(h, op.divide(c(1.0), op.sqrt(q_eps)))  # aten::rsqrt: Sqrt, then 1 / it

    gain32 = up(w)
    if offset:  # Gemma's 1.0 + weight.float(): an Add on the f32 scale
        gain32 = op.add(gain32, c(offset))
    if order == "llama":  # weight * h.to(input_dtype)
        h = normalise(up(x))
        gain = w if not offset else (gain32 if t == "f32" else op.convert(gain32, T))
        y = op.multiply(gain, h if t == "f32" else op.convert(h, T))
        if b is not None:
            y = op.add(y, b)
    elif order == "t5":  # x * rsqrt(fp32 variance) promotes to f32; cast to a half weight's type
        x32 = up(x)
        q = op.reduce_mean(op.power(x32, c(2.0)), axes, True)
        q_eps = op.add(q, c(eps))
        inv = op.power(q_eps, c(-0.5)) if inverse_sqrt == "pow" else op.divide(c(1.0), op.sqrt(q_eps))
        h = op.multiply(x32, inv)
        if t != "f32":
            h = op.convert(h, T)
        y = op.multiply(w if not offset else (gain32 if t == "f32" else op.convert(gain32, T)), h)
    elif order == "native":  # nn.LayerNorm at the parameter dtype: MVN on x as it is, gain and bias at it
        if form == "mvn":
            h = normalise(x)
            gain = w if not offset else (gain32 if t == "f32" else op.convert(gain32, T))
            y = op.multiply(h, gain)
            if b is not None:
                y = op.add(y, b)
        else:  # decomposed in f32, as an unfused export computes a half LayerNorm
            y = op.multiply(normalise(up(x)), gain32)
            if b is not None:
                y = op.add(y, up(b))
            if t != "f32":
                y = op.convert(y, T)
    else:  # gemma, native_fp32 (and cohere, olmo2): f32 throughout with the gain, cast last
        y = op.multiply(normalise(up(x)), gain32)
        if b is not None:
            y = op.add(y, up(b))
        if t != "f32":
            y = op.convert(y, T)
    if t == "bf16":  # numpy has no bfloat16: the bf16 result leaves as f32, exactly
        y = op.convert(y, f32)
    return ov.Model([y], [x_in], "norm")


def _typed(dtype: str):
    """(the model's element type, its input's) for a probe dtype: bfloat16 enters as f32 (numpy has no
    bfloat16) and is converted inside, exactly."""
    import openvino as ov

    t = _OV_TYPES[dtype]
    T = {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16}[t]
    return t, T, ov.Type.f32 if t == "bf16" else T


def _channel_gain(weight, offset: float, t: str):
    """The gain a channel op takes, at the model's type: the stored w, or offset + w computed in f32
    (the family's 1.0 + w.float()) and converted."""
    import openvino as ov
    import openvino.opset13 as op

    w = _constant(weight, t)
    if not offset:
        return w
    gain = op.add(w if t == "f32" else op.convert(w, ov.Type.f32), op.constant(_np_f32(offset)))
    return gain if t == "f32" else op.convert(gain, w.get_element_type())


def _np_f32(v):
    import numpy as np

    return np.float32(v)


def build_batch_norm_model(dim: int, dtype: str, eps: float, offset: float, weight, bias, mean, var):
    """An inference BatchNorm as the PyTorch frontend translates aten::batch_norm (training False):
    BatchNormInference-5 on x [n, C], its gain, bias, running mean and variance Constants at the
    model's type (as a model cast to that dtype holds its buffers), eps its attribute."""
    import openvino as ov
    import openvino.opset5 as op5
    import openvino.opset13 as op
    import torch

    t, T, takes = _typed(dtype)
    x_in = op.parameter([-1, dim], takes, name="x")
    x = op.convert(x_in, T) if t == "bf16" else x_in
    beta = _constant(bias if bias is not None else torch.zeros_like(weight), t)
    y = op5.batch_norm_inference(x, _channel_gain(weight, offset, t), beta, _constant(mean, t), _constant(var, t),
                                 float(eps))
    if t == "bf16":
        y = op.convert(y, ov.Type.f32)
    return ov.Model([y], [x_in], "batch_norm")


def build_group_norm_model(channels: int, groups: int, spatial: int, dtype: str, eps: float, offset: float, weight,
                           bias):
    """A GroupNorm as the PyTorch frontend translates aten::group_norm: GroupNormalization-12 on x
    [n, C, S] (num_groups, epsilon), scale and bias per channel as Constants at the model's type."""
    import openvino as ov
    import openvino.opset12 as op12
    import openvino.opset13 as op
    import torch

    t, T, takes = _typed(dtype)
    x_in = op.parameter([-1, channels, spatial], takes, name="x")
    x = op.convert(x_in, T) if t == "bf16" else x_in
    beta = _constant(bias if bias is not None else torch.zeros_like(weight), t)
    y = op12.group_normalization(x, _channel_gain(weight, offset, t), beta, int(groups), float(eps))
    if t == "bf16":
        y = op.convert(y, ov.Type.f32)
    return ov.Model([y], [x_in], "group_norm")


def build_gated_model(dim: int, groups: int, gate: str, activation: str, order: str, dtype: str, eps: float,
                      offset: float, inverse_sqrt: str, weight):
    """A gated RMSNorm on [x | z] rows [n, 2C] as the PyTorch frontend translates its module: x and z
    Sliced and converted to f32, act(z) = Swish(z) (aten::silu) or Sigmoid(z); before: the statistic
    of x * act(z), after: the result times act(z); the statistic per group over a [n, groups, C/groups]
    Reshape (Power, ReduceMean, Add eps, Sqrt, Divide 1 by it, Multiply); the gain cast-then-multiplied
    at the type (llama order) or in f32 (gemma order); the output [n, C] at the type."""
    import numpy as np
    import openvino as ov
    import openvino.opset8 as op8
    import openvino.opset13 as op

    t, T, takes = _typed(dtype)
    f32 = ov.Type.f32
    x_in = op.parameter([-1, 2 * dim], takes, name="x2")
    both = op.convert(x_in, T) if t == "bf16" else x_in

    def i64(*values):
        return op.constant(np.array(values, dtype=np.int64))

    def up(v):
        return v if t == "f32" else op.convert(v, f32)

    x = up(op8.slice(both, i64(0), i64(dim), i64(1), i64(-1)))
    z = up(op8.slice(both, i64(dim), i64(2 * dim), i64(1), i64(-1)))
    act = op.swish(z) if activation == "silu" else op.sigmoid(z)
    h = op.multiply(x, act) if gate == "before" else x
    grouped = op.reshape(h, i64(0, groups, dim // groups), True)
    q_eps = op.add(op.reduce_mean(op.power(grouped, op.constant(_np_f32(2.0))), i64(-1), True),
                   op.constant(_np_f32(eps)))
    inv = op.power(q_eps, op.constant(_np_f32(-0.5))) if inverse_sqrt == "pow" else \
        op.divide(op.constant(_np_f32(1.0)), op.sqrt(q_eps))
    normed = op.reshape(op.multiply(grouped, inv), i64(0, dim), True)
    if order == "llama":  # weight * h.to(dtype), at the type
        y = op.multiply(_channel_gain(weight, offset, t), normed if t == "f32" else op.convert(normed, T))
        y = up(y)
    else:
        w = _constant(weight, t)
        gain32 = up(w) if not offset else op.add(up(w), op.constant(_np_f32(offset)))
        y = op.multiply(normed, gain32)
    if gate != "before":  # y * act(z.float()): promoted to f32
        y = op.multiply(y, act)
    if t != "f32":
        y = op.convert(y, T)
    if t == "bf16":
        y = op.convert(y, f32)
    return ov.Model([y], [x_in], "gated_rms_norm")


def _built(key, what: str, dtype: str, device: str, precision: str | None, build) -> None:
    """`build()`'s ov.Model compiled and kept under `key`; a model OpenVINO cannot build is one line."""
    try:
        model = build()
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"openvino: cannot build the {what} model at {dtype}: {' '.join(str(exc).split())[:240]}") \
            from None
    _remember(key, _compile(model, device, precision))


def _compile(model, device: str, precision: str | None):
    import torch

    name = _check_device(device)
    try:
        return core().compile_model(model, name, compile_config(precision, torch.get_num_threads()))
    except Exception as exc:
        raise InputError(f"openvino: the {name} plugin cannot compile the norm: "
                         f"{' '.join(str(exc).split())[:240]}") from None


def _runner(compiled, dtype, kind: str, rank: int | None, maps: tuple | None = None):
    """x -> y through an infer request: probe rows reshaped to the model's rank (leading 1s,
    or rows folded as ONNX's subgraphs are), y back at x's dtype and device. `maps` (C, S): a
    GroupNorm's rows (N, C*S), channel-major, as (N, C, S) maps (1s for the model's rank)."""
    import numpy as np
    import openvino as ov
    import torch

    request = compiled.create_infer_request()
    takes = _type_name(compiled.input(0).get_element_type())
    feeds = {"f32": torch.float32, "f16": torch.float16, "f64": torch.float64}

    def run(x):
        shaped = x
        if maps is not None and x.dim() == 2:
            shaped = x.reshape(x.shape[0], *maps, *([1] * ((rank or 3) - 3)))
        elif rank is not None:
            if x.dim() <= rank:
                shaped = x.reshape(*([1] * (rank - x.dim())), *x.shape)
            else:
                shaped = x.reshape(*([1] * max(0, rank - 2)), -1, x.shape[-1])
        shaped = shaped.detach().to(device="cpu", dtype=dtype).contiguous()
        if takes == "bf16":  # numpy has no bfloat16: the 16-bit patterns, in a tensor that owns them
            data = _bf16_tensor(shaped)
        else:
            data = ov.Tensor(np.ascontiguousarray(shaped.to(feeds.get(takes, torch.float32)).numpy()),
                             shared_memory=False)
        try:
            request.infer({0: data})
        except Exception as exc:
            raise RuntimeError(f"openvino {kind}: {' '.join(str(exc).split())[:240]}") from None
        result = request.get_output_tensor(0)
        if _type_name(result.get_element_type()) == "bf16":
            bits = np.array(result.data, copy=True).view(np.int16)
            out = torch.from_numpy(bits).view(torch.bfloat16)
        else:
            out = torch.from_numpy(np.array(result.data, copy=True))
        out = out.reshape(x.shape) if out.numel() == x.numel() else out.reshape(*x.shape[:-1], -1)  # gated: [x | z] -> y
        return out.to(device=x.device, dtype=x.dtype)

    return run


def _program(layer, device: str, precision: str | None):
    """An exported IR's own norm subgraph, read back from its serialised form and compiled."""
    import numpy as np
    import openvino as ov
    import torch

    xml, weights = program_parts(layer.program)
    key = ("program", hashlib.sha256(layer.program).hexdigest(), device, precision, torch.get_num_threads())
    if key not in _MODELS:
        try:
            blob = ov.Tensor(np.frombuffer(weights or b"\0", dtype=np.uint8), shared_memory=False)  # owns a copy
            model = core().read_model(xml.decode("utf-8"), blob)
        except Exception as exc:
            raise InputError(f"openvino: cannot read {layer.name}'s IR subgraph: {' '.join(str(exc).split())[:240]}") \
                from None
        param = model.get_parameters()[0]
        elem = _type_name(param.get_element_type())
        dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
        if elem not in dtypes:
            raise InputError(f"openvino: {layer.name}'s subgraph takes {elem}, not a float type")
        rank = param.get_output_partial_shape(0).rank
        rank = rank.get_length() if rank.is_static else None
        _MODELS[key] = (_compile(model, device, precision), dtypes[elem], rank)
    compiled, dtype, rank = _MODELS[key]
    maps = (layer.dim, layer.spatial) if layer.kind == "group_norm" else None
    return _runner(compiled, dtype, layer.kind, rank, maps)


def prepare(layer, weight, bias, eps: float, precision: str | None = None, form: str = "auto",
            eps_mode: str = "inside_sqrt"):
    """(layer, weight, bias, eps) -> x -> y through a compiled OpenVINO model; see the module doc."""
    import torch

    _check_precision(precision)
    device = str(weight.device)
    if program_parts(getattr(layer, "program", None) or b""):
        return _program(layer, device, precision)
    if form not in FORMS:
        raise InputError(f"openvino: form={form!r}; use one of {', '.join(FORMS)}")
    if eps_mode not in EPS_MODES:
        raise InputError(f"openvino: eps_mode={eps_mode!r}; use one of {', '.join(EPS_MODES)}")
    check_layer(layer, str(weight.dtype).removeprefix("torch."))
    if layer.kind in ("batch_norm", "group_norm", "gated_rms_norm"):
        if form != "auto" or eps_mode != "inside_sqrt":
            raise InputError(f"openvino: form and eps_mode choose an RMSNorm's or LayerNorm's ops; {layer.name} is a "
                             f"{layer.kind}, built as its one op")
        return _channel_norm(layer, weight, bias, eps, device, precision)
    if form == "auto":
        form = "mvn" if layer.kind == "layer_norm" else "decomposed"
    if form == "mvn" and layer.kind != "layer_norm":
        raise InputError(f"openvino: form=mvn subtracts the mean (a LayerNorm); {layer.name} is an RMSNorm: "
                         "use form=decomposed")
    if eps_mode != "inside_sqrt" and form != "mvn":
        raise InputError(f"openvino: eps_mode is MVN's (form=mvn, a LayerNorm layer); {layer.name} is built "
                         f"{form}")
    dtype = str(weight.dtype).removeprefix("torch.")
    per_head = tuple(weight.shape[:-1])
    digest = _digest(weight, bias)
    key = (layer.kind, layer.order, layer.dim, per_head, dtype, float(eps), float(layer.gain_offset), form, eps_mode,
           layer.inverse_sqrt, digest.hexdigest(), bias is not None, device, precision, torch.get_num_threads())
    if key not in _MODELS:
        _built(key, f"{form} {layer.kind}", dtype, device, precision, lambda: build_model(
            layer.kind, layer.order, layer.dim, per_head, dtype, eps, layer.gain_offset, form, eps_mode,
            layer.inverse_sqrt, weight, bias))
    return _runner(_MODELS[key], weight.dtype, f"{form} {layer.kind}", None)


def _digest(*tensors):
    """What a model's Constants hold, as a cache key: the bytes of each tensor (None: nothing)."""
    import torch

    digest = hashlib.sha256()
    for t in tensors:
        if t is not None:
            digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digest.update(b"|")
    return digest


def _remember(key, compiled) -> None:
    """One compiled model per layer (each holds its own executor): the last few kept."""
    if len(_MODELS) > 4:
        _MODELS.pop(next(iter(_MODELS)))
    _MODELS[key] = compiled


def _channel_norm(layer, weight, bias, eps: float, device: str, precision: str | None):
    """A BatchNorm (rows (N, C), its running statistics at the candidate's dtype, as a model cast to
    it holds them) or a GroupNorm (rows (N, C*S) as (N, C, S) maps) through its OpenVINO op, or a
    gated RMSNorm ([x | z] rows) decomposed."""
    import torch

    dtype = str(weight.dtype).removeprefix("torch.")
    stats = ()
    if layer.kind == "batch_norm":
        stats = tuple(t.to(dtype=weight.dtype, copy=True) for t in (layer.running_mean, layer.running_var))
    key = (layer.kind, layer.dim, layer.groups, layer.spatial, layer.gate, layer.activation, layer.order,
           layer.inverse_sqrt, dtype, float(eps), float(layer.gain_offset), _digest(weight, bias, *stats).hexdigest(),
           device, precision, torch.get_num_threads())
    if key not in _MODELS:
        def build():
            if layer.kind == "gated_rms_norm":
                return build_gated_model(layer.dim, layer.groups, layer.gate, layer.activation, layer.order, dtype,
                                         eps, layer.gain_offset, layer.inverse_sqrt, weight)
            if layer.kind == "batch_norm":
                return build_batch_norm_model(layer.dim, dtype, eps, layer.gain_offset, weight, bias, *stats)
            return build_group_norm_model(layer.dim, layer.groups, layer.spatial, dtype, eps, layer.gain_offset,
                                          weight, bias)

        _built(key, layer.kind, dtype, device, precision, build)
    maps = (layer.dim, layer.spatial) if layer.kind == "group_norm" else None
    return _runner(_MODELS[key], weight.dtype, layer.kind, 3 if maps else None, maps)


def public_path(layer, weight, bias, eps: float, precision: str | None = None):
    """The same norm through OpenVINO's public path, as a deployment takes it (issue 46's differential
    truth, written apart from prepare): the family's torch module (backends.deployed: its transformers
    class, else the plain torch module of its kind) at the candidate dtype, `ov.convert_model` with an
    example input of its rows (the PyTorch frontend: its own ops, Constants and Converts), compiled on
    the plugin (its default precision unless asked). x -> y as prepare's, at x's dtype."""
    import contextlib
    import io
    import warnings

    import openvino as ov
    import torch

    from parity_cli.backends.deployed import norm_module

    _check_precision(precision)
    dtype = str(weight.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise InputError(f"openvino: ov.convert_model of a {dtype} module is not run here; use --dtype "
                         f"{', '.join(DTYPES)}")
    key = ("public", _public_key(layer, weight, bias, eps), precision, torch.get_num_threads())
    if key not in _MODELS:  # parity prepares a layer once a probe set, each time with a fresh copy of its weight
        module = norm_module(layer, weight, bias, eps)
        row = tuple(weight.shape) if weight.dim() > 1 else (layer.width,)
        example = torch.zeros(2, *row, dtype=weight.dtype, device=weight.device)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                converted = ov.convert_model(module, example_input=example)
        except Exception as exc:
            raise InputError(f"openvino: ov.convert_model cannot convert {layer.name}'s module: "
                             f"{' '.join(str(exc).split())[:240]}") from None
        _remember(key, _compile(converted, str(weight.device), precision))
    return _runner(_MODELS[key], weight.dtype, f"ov.convert_model {layer.kind}", None)


def _public_key(layer, weight, bias, eps: float) -> tuple:
    """Everything a deployed module of the layer is built from: its class and kind's parameters, the
    dtype, eps and device, and the bytes of its tensors."""
    stats = (layer.running_mean, layer.running_var) if layer.kind == "batch_norm" else ()
    return (layer.kind, layer.order, layer.hf_class, layer.dim, tuple(weight.shape), layer.groups, layer.spatial,
            layer.gate, layer.activation, layer.layout, float(layer.gain_offset), layer.semantic_offset,
            str(weight.dtype), float(eps), str(weight.device), _digest(weight, bias, *stats).hexdigest())

