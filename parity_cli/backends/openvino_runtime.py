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

from parity_cli.backends import Runtime
from parity_cli.errors import InputError

RUNTIME = Runtime(
    "openvino", "the family's norm as an OpenVINO model (decomposed RMS pattern, MVN-6 for LayerNorm) compiled on its "
    "CPU plugin; --candidate-arg precision=f32|bf16|f16, form=decomposed|mvn, eps_mode=inside_sqrt|outside_sqrt",
    package="openvino", install="pip install openvino", extra="openvino",
    args={"precision": ("f32", "bf16", "f16"), "form": ("auto", "decomposed", "mvn"),
          "eps_mode": ("inside_sqrt", "outside_sqrt")},
    public="ov.convert_model of the module, compiled on the CPU plugin", header="openvino", order=30)
from parity_cli.sources.openvino_ir import program_parts

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


def describe(device: str, precision: str | None = None) -> dict:
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
    return {"version": ov.get_version(), "device": name, "device_name": device_name,
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
        return out.reshape(x.shape).to(device=x.device, dtype=x.dtype)

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
    if layer.kind not in ("rms_norm", "layer_norm"):
        raise InputError(f"openvino: builds RMSNorm and LayerNorm layers; {layer.name} is a {layer.kind}")
    if form == "auto":
        form = "mvn" if layer.kind == "layer_norm" else "decomposed"
    if form == "mvn" and layer.kind != "layer_norm":
        raise InputError(f"openvino: form=mvn subtracts the mean (a LayerNorm); {layer.name} is an RMSNorm: "
                         "use form=decomposed")
    if eps_mode != "inside_sqrt" and form != "mvn":
        raise InputError(f"openvino: eps_mode is MVN's (form=mvn, a LayerNorm layer); {layer.name} is built "
                         f"{form}")
    dtype = str(weight.dtype).removeprefix("torch.")
    if dtype not in _OV_TYPES:
        raise InputError(f"openvino: no {dtype} model is built (the CPU plugin computes float64 as f32); "
                         "use --dtype float32, float16 or bfloat16")
    per_head = tuple(weight.shape[:-1])
    digest = hashlib.sha256(weight.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    if bias is not None:
        digest.update(bias.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    key = (layer.kind, layer.order, layer.dim, per_head, dtype, float(eps), float(layer.gain_offset), form, eps_mode,
           layer.inverse_sqrt, digest.hexdigest(), bias is not None, device, precision, torch.get_num_threads())
    if key not in _MODELS:
        try:
            model = build_model(layer.kind, layer.order, layer.dim, per_head, dtype, eps, layer.gain_offset, form,
                                eps_mode, layer.inverse_sqrt, weight, bias)
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"openvino: cannot build the {form} {layer.kind} model at {dtype}: "
                             f"{' '.join(str(exc).split())[:240]}") from None
        if len(_MODELS) > 4:  # one compiled model per layer (each holds its own executor): the last few
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = _compile(model, device, precision)
    return _runner(_MODELS[key], weight.dtype, f"{form} {layer.kind}", None)
