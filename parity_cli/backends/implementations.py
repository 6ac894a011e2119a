"""Stage 4: implementations of a norm layer — the float64 oracle, built-ins and user plugins.

Every implementation is a factory: ``prepare(layer, weight, bias, eps)`` returns a function
of the probe batch. ``weight``/``bias`` arrive already at the side's dtype and device,
exactly as stored (no gain offset applied): applying the family's offset is part of what an
implementation must get right."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parity_cli.backends import registered
from parity_cli.errors import InputError
from parity_cli.model.layers import NormLayer

Prepared = Callable[[object], object]  # x -> y, both torch tensors


@dataclass(frozen=True)
class Implementation:
    name: str
    source: str  # "built-in" or where the plugin was loaded from
    prepare: Callable[..., Prepared]  # (layer, weight, bias, eps) -> Prepared
    description: str = ""
    # y = normalise(x, eps, kind) * (offset + w) (+ b) at float64: the gain-free part is shared
    # by every layer of a probe set (the oracle); None: run prepare's function per layer
    normalise: Callable | None = None


# --- the float64 oracle -----------------------------------------------------------------


def _row_scaled(x, kind: str):
    """Rows divided by their max |x| (m, 1 for zero rows), mean removed for LayerNorm."""
    import torch

    x = x.to(torch.float64)
    m = x.abs().amax(dim=-1, keepdim=True)
    safe_m = torch.where(m > 0, m, torch.ones_like(m))
    xs = x / safe_m
    if kind == "layer_norm":
        xs = xs - xs.mean(dim=-1, keepdim=True)
    return xs, safe_m


def oracle_normalize(x, eps: float, kind: str = "rms_norm"):
    """x / sqrt(q + eps) in float64 with no overflow for any finite input.

    Dividing each row by its max |x| (m) turns q + eps into (q/m^2 + eps/m^2) * m^2:
    nothing squared exceeds 1, so [1e200, -1e200] normalises to [1, -1], and a zero row
    gives zeros (0/0 = NaN when eps = 0, as the formula says). For "layer_norm" the row mean
    is removed first and q is the variance."""
    import torch

    xs, m = _row_scaled(x, kind)
    qs = (xs * xs).mean(dim=-1, keepdim=True)
    denom = torch.sqrt(qs + eps / (m * m))
    return torch.where(denom > 0, xs / denom, torch.full_like(xs, math.nan if eps == 0 else 0.0))


def mean_square(x, kind: str = "rms_norm"):
    """q per row in float64 (what eps is compared against); inf only past float64's range."""
    xs, m = _row_scaled(x, kind)
    return (xs * xs).mean(dim=-1) * (m * m).squeeze(-1)


def batch_normalize(x, mean, var, eps: float):
    """(x - running_mean) / sqrt(running_var + eps) in float64, per channel (the last axis): the
    statistics are the checkpoint's, not the batch's. A channel with running_var = eps = 0 gives
    0/0 = NaN, as the formula says."""
    import torch

    x = x.to(torch.float64)
    return (x - mean.to(device=x.device, dtype=torch.float64)) / torch.sqrt(
        var.to(device=x.device, dtype=torch.float64) + eps)


def group_normalize(x, groups: int, eps: float):
    """A GroupNorm's normalised rows in float64: each row is C channels x S positions, channel-major,
    so a group is a contiguous run of (C / groups) * S elements, normalised as a LayerNorm row
    (overflow-safe, oracle_normalize)."""
    n, width = x.shape
    return oracle_normalize(x.reshape(n, groups, width // groups), eps, "layer_norm").reshape(n, width)


def per_position(t, layer: NormLayer):
    """A per-channel vector (gain, bias) repeated over each channel's positions: the row's layout."""
    return t if t is None or layer.spatial == 1 else t.repeat_interleave(layer.spatial, dim=-1)


def feature_map(fn, layer: NormLayer):
    """fn of an (N, C, S) feature map as a function of probe rows (N, C * S), and back: how a
    GroupNorm (which needs its positions) meets the row-shaped probes."""

    def run(x):
        y = fn(x.reshape(x.shape[0], layer.dim, layer.spatial))
        return y.reshape(x.shape) if hasattr(y, "reshape") and y.numel() == x.numel() else y

    return run


def gate_activation(name: str, z):
    import torch

    return torch.nn.functional.silu(z) if name == "silu" else torch.sigmoid(z)


def split_gate(x2, layer: NormLayer):
    """A gated norm's probe row is [x | z]: the input and its gate, side by side."""
    return x2[..., : layer.dim], x2[..., layer.dim:]


def gated_normalize(x2, layer: NormLayer, eps: float, gate: str | None = None, groups: int | None = None,
                    activation: str | None = None):
    """A gated RMSNorm's gain-free part in float64, as (normalised, multiplier): the gate either
    enters the statistic (`before`: RMSNorm of x * act(z), per group) or multiplies the result
    (`after`: RMSNorm(x) * act(z)). Overflow-safe as oracle_normalize."""
    import torch

    gate, groups, activation = gate or layer.gate, groups or layer.groups, activation or layer.activation
    x, z = split_gate(x2.to(torch.float64), layer)
    a = gate_activation(activation, z)
    h = x * a if gate == "before" else x
    n = h.shape[0]
    normed = oracle_normalize(h.reshape(n, groups, -1), eps, "rms_norm").reshape(n, -1)
    return normed, (a if gate == "after" else None)


def running_statistics(layer: NormLayer, like):
    """The layer's running mean and variance at `like`'s dtype and device (a candidate's copy:
    a model cast to bfloat16 casts its buffers too)."""
    return tuple(t.to(device=like.device, dtype=like.dtype, copy=True) for t in (layer.running_mean, layer.running_var))


def _oracle(layer: NormLayer, weight, bias, eps: float) -> Prepared:
    import torch

    if layer.kind == "gated_rms_norm":
        gain = layer.gain_offset + weight.to(torch.float64)

        def gated(x):
            normed, after = gated_normalize(x, layer, eps)
            y = normed * gain.to(x.device)
            return y if after is None else y * after

        return gated
    if layer.kind == "group_norm":
        gain = per_position(layer.gain_offset + weight.to(torch.float64), layer)
        shift = per_position(None if bias is None else bias.to(torch.float64), layer)
        return lambda x: group_normalize(x.to(torch.float64), layer.groups, eps) * gain.to(x.device) + (
            0.0 if shift is None else shift.to(x.device))
    if layer.kind == "batch_norm":
        gain = layer.gain_offset + weight.to(torch.float64)
        shift = 0.0 if bias is None else bias.to(torch.float64)
        mean, var = layer.running_mean, layer.running_var
        return lambda x: batch_normalize(x, mean, var, eps) * gain.to(x.device) + (
            shift if bias is None else shift.to(x.device))
    gain = layer.gain_offset + weight.to(torch.float64)
    shift = None if bias is None else bias.to(torch.float64)

    def run(x):
        y = oracle_normalize(x, eps, layer.kind) * gain.to(x.device)
        return y if shift is None else y + shift.to(x.device)

    return run


# --- built-ins at the candidate dtype -----------------------------------------------------


def _torch(layer: NormLayer, weight, bias, eps: float) -> Prepared:
    """torch.nn.functional's fused norm with the checkpoint's eps passed explicitly."""
    import torch.nn.functional as F

    gain = weight + layer.gain_offset if layer.gain_offset else weight
    if layer.kind == "group_norm":
        return feature_map(lambda x: F.group_norm(x, layer.groups, gain, bias, eps), layer)
    if layer.kind == "gated_rms_norm":
        # torch has no fused gated norm: F.rms_norm per group with the gate in float32 and one cast at
        # the end, as the fused kernels (mamba_ssm's rmsnorm_fn) compute it (x * silu(z) overflows float16)
        size = layer.dim // layer.groups

        def gated(x2):
            x, z = split_gate(x2, layer)
            a = gate_activation(layer.activation, z.float())
            h = x.float() * a if layer.gate == "before" else x.float()
            y = F.rms_norm(h.reshape(h.shape[0], layer.groups, size), (size,), None, eps).reshape(h.shape)
            y = y * gain.float()
            return (y if layer.gate == "before" else y * a).to(x.dtype)

        return gated
    if layer.kind == "batch_norm":  # inference: the running statistics, never the batch's
        mean, var = running_statistics(layer, weight)
        return lambda x: F.batch_norm(x, mean, var, gain, bias, training=False, eps=eps)
    if weight.dim() > 1:  # per-head gains (Cohere q/k norms): normalise, then broadcast the gain
        if layer.kind == "layer_norm":
            return lambda x: F.layer_norm(x, (layer.dim,), None, None, eps) * gain + (0 if bias is None else bias)
        return lambda x: F.rms_norm(x, (layer.dim,), None, eps) * gain
    if layer.kind == "layer_norm":
        return lambda x: F.layer_norm(x, (layer.dim,), gain, bias, eps)
    return lambda x: F.rms_norm(x, (layer.dim,), gain, eps)


def _hf(layer: NormLayer, weight, bias, eps: float) -> Prepared:
    """A transcription of the family's Hugging Face forward: its upcasts, cast order and the
    exact inverse square root, so that it is bitwise equal to the transformers module."""
    from parity_cli.model.forms import hf_forward

    if layer.kind == "gated_rms_norm":
        from parity_cli.model.forms import gated_forward

        return gated_forward(layer.order, layer.gate, layer.activation, layer.groups, layer.dim, weight, eps,
                             gain_offset=layer.gain_offset)
    stats = running_statistics(layer, weight) if layer.kind == "batch_norm" else None
    fn = hf_forward(layer.kind, layer.order, layer.gain_offset, layer.inverse_sqrt, layer.dim, weight, bias, eps,
                    where=layer.name, statistics=stats, groups=layer.groups)
    return feature_map(fn, layer) if layer.kind == "group_norm" else fn


def _import_class(path: str):
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise InputError(f"transformers: cannot import {path} ({exc}); pip install transformers") from None
    except AttributeError:
        from importlib import metadata

        try:
            version = "transformers " + metadata.version("transformers")
        except metadata.PackageNotFoundError:
            version = "transformers"
        raise InputError(f"{version}: {module} has no class {attr}, which the family names; the class the installed "
                         "release builds there could not be found (force another family with --family)") from None


_EPS_KEYS = ("eps", "layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def _parameters_of(cls) -> set:
    import inspect

    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


def _takes_config(cls) -> bool:
    import inspect

    try:
        params = list(inspect.signature(cls.__init__).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0] == "config"


def _transformers(layer: NormLayer, weight, bias, eps: float) -> Prepared:
    """The real module class of the checkpoint's family (transformers, or torch.nn.LayerNorm)."""
    import torch

    if not layer.hf_class:
        raise InputError(f"transformers: family '{layer.family}' names no module class for {layer.name}")
    cls = _import_class(layer.hf_class)
    size = layer.shape if weight.dim() > 1 else layer.dim
    if layer.kind == "batch_norm":
        return _batch_norm_module(cls, layer, weight, bias, eps, loaded=True)
    if layer.kind == "group_norm":
        return _group_norm_module(cls, layer, weight, bias, eps, loaded=True)
    if layer.kind == "gated_rms_norm":
        return _gated_module(cls, layer, weight, eps)
    if layer.weightless:  # OlmoLayerNorm(hidden), Llama4TextL2Norm(eps): as the class's signature asks
        return maps(_weightless_module(cls, size, eps, layer.eps.value).to(device=weight.device,
                                                                            dtype=weight.dtype).eval(), layer)
    if cls is torch.nn.LayerNorm:
        module = cls(size, eps=eps, bias=bias is not None)
    elif layer.layout == "channels_first" and "data_format" in _parameters_of(cls):
        module = cls(size, eps=eps, data_format="channels_first")  # ConvNextLayerNorm(..., data_format=)
    elif _takes_config(cls):  # CpmAntLayerNorm(config): the config holds the width and eps
        import types

        module = cls(types.SimpleNamespace(hidden_size=size, **{k: eps for k in _EPS_KEYS}))
    else:
        module = cls(size, eps=eps)
    module = module.to(device=weight.device, dtype=weight.dtype)
    baked = (layer.semantic_offset or 0.0) - layer.gain_offset  # GGUF Gemma stores 1 + w; the class adds 1
    with torch.no_grad():
        module.weight.copy_(weight - baked if baked else weight)  # as transformers' GGUF loader does
        if bias is not None:
            module.bias.copy_(bias)
    return maps(module.eval(), layer)


def maps(module, layer: NormLayer):
    """A channels-first class (ConvNeXt's, SAM's LayerNorm) fed each probe row as an (N, C, 1, 1)
    map, the output back as rows; any other module as it is."""
    if layer.layout != "channels_first":
        return module

    def run(x):
        y = module(x.reshape(*x.shape, 1, 1))
        return y.reshape(x.shape) if hasattr(y, "reshape") and y.numel() == x.numel() else y

    return run


def _weightless_module(cls, size: int, eps: float, fixed_eps: float | None = None):
    """A parameterless norm class built as its signature allows: its size and eps where it takes
    them (an eps the model code fixes inside forward is the class's own, as in the model)."""
    import inspect as _inspect

    try:
        params = list(_inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    names = {p.name for p in params}
    kwargs = {"eps": eps} if "eps" in names else {}
    if "eps" not in names and fixed_eps is not None and eps != fixed_eps:
        raise InputError(f"{cls.__name__} fixes its eps inside forward ({fixed_eps:g}); it cannot run at eps {eps:g}")
    if "with_scale" in names:  # Gemma 4's RMSNorm(dim, eps, with_scale=False)
        kwargs["with_scale"] = False
    positional = [p for p in params if p.name not in ("eps", "with_scale") and p.default is p.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return cls(*([size] if positional else []), **kwargs)


def _batch_norm_module(cls, layer: NormLayer, weight, bias, eps: float, loaded: bool, **kwargs) -> Prepared:
    """A BatchNorm module class built as `cls(C, eps=eps)`, its gain, bias and running statistics
    filled as a checkpoint load fills them, in eval mode. A probe row is one sample of C channels:
    BatchNorm2d/3d see it as a 1 x 1 (x 1) feature map, the output comes back as rows."""
    import inspect as _inspect

    import torch

    try:
        takes_eps = "eps" in _inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        takes_eps = True
    # a frozen BatchNorm (RT-DETR's FrozenBatchNorm2d(n)) fixes its eps inside forward: built without one,
    # and an eps it cannot take (--candidate-eps) is refused rather than reported as run
    if not takes_eps and eps != layer.eps.value:
        raise InputError(f"{cls.__name__} fixes its eps inside forward ({layer.eps.value:g}); it cannot run at "
                         f"eps {eps:g}")
    module = cls(layer.dim, **({"eps": eps} if takes_eps else {}), **kwargs).to(device=weight.device,
                                                                                  dtype=weight.dtype)
    mean, var = running_statistics(layer, weight)
    with torch.no_grad():
        for attr, value in (("weight", weight), ("bias", bias), ("running_mean", mean), ("running_var", var)):
            target = getattr(module, attr, None)
            if value is not None and isinstance(target, torch.Tensor):
                target.copy_(value)
            elif value is not None and attr != "bias" and loaded:
                raise TypeError(f"{cls.__name__} has no {attr} tensor to fill")
    module.eval()
    names = [c.__name__ for c in type(module).__mro__]
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        spatial = 2 if "BatchNorm2d" in names else 3 if "BatchNorm3d" in names else 0
    else:  # a frozen BatchNorm broadcasts its statistics as (1, C, 1, 1): a 2-D feature map
        spatial = 3 if "3d" in type(module).__name__ else 1 if "1d" in type(module).__name__ else 2
    if not spatial:
        return module

    def run(x):
        y = module(x.reshape(*x.shape, *([1] * spatial)))
        return y.reshape(x.shape) if isinstance(y, torch.Tensor) and y.numel() == x.numel() else y

    return run


def _group_norm_module(cls, layer: NormLayer, weight, bias, eps: float, loaded: bool, **kwargs) -> Prepared:
    """A GroupNorm module class built as nn.GroupNorm is, `cls(groups, C, eps=eps)`, its gain and
    bias filled, fed (N, C, S) feature maps."""
    import torch

    if "num_groups" in _parameters_of(cls):  # nn.GroupNorm(num_groups, num_channels, eps)
        module = cls(layer.groups, layer.dim, eps=eps, **kwargs)
    else:  # PoolFormerGroupNorm(num_channels): its group count is its own (checked below)
        module = cls(layer.dim, eps=eps, **kwargs)
    if getattr(module, "num_groups", layer.groups) != layer.groups:
        raise InputError(f"{cls.__name__} builds {module.num_groups} groups; the layer has {layer.groups}")
    module = module.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for attr, value in (("weight", weight), ("bias", bias)):
            target = getattr(module, attr, None)
            if value is not None and isinstance(target, torch.Tensor):
                target.copy_(value)
            elif value is not None and attr == "weight" and loaded:
                raise TypeError(f"{cls.__name__} has no weight tensor to fill")
    return feature_map(module.eval(), layer)


def _gated_module(cls, layer: NormLayer, weight, eps: float) -> Prepared:
    """A gated RMSNorm class, built as its own signature asks (Mamba's `group_size`, Falcon-H1's
    `n_groups` and `norm_before_gate`), its weight filled, called as module(x, gate=z)."""
    import inspect as _inspect

    import torch

    try:
        params = set(list(_inspect.signature(cls.__init__).parameters)[1:])
    except (TypeError, ValueError):
        params = set()
    kwargs = {"eps": eps}
    if "group_size" in params:
        kwargs["group_size"] = layer.dim // layer.groups
    if "n_groups" in params:
        kwargs["n_groups"] = layer.groups
    if "norm_before_gate" in params:
        kwargs["norm_before_gate"] = layer.gate == "after"
    module = cls(layer.dim, **kwargs).to(device=weight.device, dtype=weight.dtype).eval()
    with torch.no_grad():
        module.weight.copy_(weight)

    def run(x2):
        x, z = split_gate(x2, layer)
        return module(x, gate=z)

    return run


def _eager(layer: NormLayer, weight, bias, eps: float) -> Prepared:
    """What a compiler or exporter is given: the family's own module class where transformers
    builds it, else the hf transcription of its numerics."""
    if layer.hf_class and importlib.util.find_spec("transformers") is not None:
        try:
            return _transformers(layer, weight, bias, eps)
        except InputError:
            pass
    return _hf(layer, weight, bias, eps)


def _runtime_builtin(name: str, module) -> Implementation:
    """A registered runtime file (parity_cli.backends.registered) as a built-in: its prepare, given
    `eager` (the family's module as parity builds it) where it compiles or exports one."""
    import functools

    runtime = module.RUNTIME
    takes_eager = "eager" in inspect.signature(module.prepare).parameters

    def prepare(layer: NormLayer, weight, bias, eps: float, **args) -> Prepared:
        if takes_eager:
            args["eager"] = _eager(layer, weight, bias, eps)
        return module.prepare(layer, weight, bias, eps, **args)

    functools.update_wrapper(prepare, module.prepare, assigned=("__doc__",))
    return Implementation(name, "built-in", prepare, runtime.summary)


# built-in -> (the modules it imports, the extra of pyproject.toml that installs it); the runtimes' own
# from their files (parity_cli.backends.Runtime)
OPTIONAL_DEPENDENCIES = {"transformers": (("transformers",), "transformers"), "mlx-lm": (("mlx_lm", "mlx"), "mlx")}
# built-ins that take --candidate-arg, and which: the runtimes' own declare theirs
BUILTIN_ARGS: dict = {}


def _builtin_args(spec: str, args: dict | None) -> dict:
    """A built-in's --candidate-arg values, each checked against what it accepts."""
    args = dict(args or {})
    known = BUILTIN_ARGS.get(spec, {})
    if args and not known:
        raise InputError(f"--candidate-arg: the built-in '{spec}' takes no arguments")
    for key, value in args.items():
        if key not in known:
            raise InputError(f"--candidate-arg {key}: {spec} accepts {', '.join(sorted(known))}")
        if value not in known[key]:
            raise InputError(f"--candidate-arg {key}={value}: {spec} accepts {key}={'|'.join(known[key])}")
    return args


def require(spec: str, option: str | None = None) -> None:
    """A built-in whose package is missing is the user's input at fault, said once before any
    layer runs (otherwise every layer fails on the same import). find_spec imports nothing."""
    if spec not in OPTIONAL_DEPENDENCIES:
        return
    modules, extra = OPTIONAL_DEPENDENCIES[spec]
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ValueError:  # in sys.modules without a __spec__: imported already
            found = True
        if not found:
            who = f"{option} {spec}" if option else f"implementation '{spec}'"
            if extra is None:  # a runtime installed on its own, --no-deps (its compiled kernels alone)
                runtime = registered()[spec].RUNTIME
                raise InputError(f"{who} needs {runtime.needs or runtime.name}: {runtime.install}")
            raise InputError(f"{who} needs the {module} package: pip install {' '.join(modules)} "
                             f"(from a checkout: pip install -e '.[{extra}]')")


BUILTINS = {
    "oracle": Implementation("oracle", "built-in", _oracle, "float64 reference of the family's exact math",
                             normalise=oracle_normalize),
    "torch": Implementation("torch", "built-in", _torch, "torch.nn.functional rms_norm/layer_norm at the candidate dtype"),
    "hf": Implementation("hf", "built-in", _hf, "transcription of the family's Hugging Face numerics"),
    "transformers": Implementation("transformers", "built-in", _transformers,
                                   "the family's own transformers module class (needs transformers)"),
}
PUBLIC = "@public"  # NAME@public: the runtime through its own public path (its differential twin)
for _name, _module in registered().items():  # every runtime file under backends/, in table order
    BUILTINS[_name] = _runtime_builtin(_name, _module)
    OPTIONAL_DEPENDENCIES[_name] = (_module.RUNTIME.requires or (_module.RUNTIME.package,), _module.RUNTIME.extra)
    if _module.RUNTIME.args:
        BUILTIN_ARGS[_name] = dict(_module.RUNTIME.args)
    if getattr(_module, "public_path", None) is not None:
        BUILTINS[_name + PUBLIC] = Implementation(
            _name + PUBLIC, "built-in", _module.public_path,
            f"{_name} through its own public path, apart from parity's adapter: {_module.RUNTIME.public}")
        OPTIONAL_DEPENDENCIES[_name + PUBLIC] = OPTIONAL_DEPENDENCIES[_name]
        _takes = inspect.signature(_module.public_path).parameters  # the runtime's arguments its public path takes
        if any(k in _takes for k in _module.RUNTIME.args):
            BUILTIN_ARGS[_name + PUBLIC] = {k: v for k, v in _module.RUNTIME.args.items() if k in _takes}


# --- plugins: MODULE:ATTR or path/to/file.py:ATTR ------------------------------------------


def is_file_target(target: str) -> bool:
    """FILE.py:ATTR (or a path) rather than MODULE:ATTR."""
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_attr(spec: str):
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise InputError(f"implementation '{spec}': expected a built-in name ({', '.join(BUILTINS)}), MODULE:ATTR or FILE.py:ATTR")
    if is_file_target(target):
        path = Path(target)
        if not path.is_file():
            raise InputError(f"implementation '{spec}': no such file {path}")
        mod_name = f"parity_plugin_{abs(hash(str(path.resolve())))}"
        if str(path.resolve().parent) not in sys.path:  # so the plugin can import its neighbours
            sys.path.insert(0, str(path.resolve().parent))
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise InputError(f"implementation '{spec}': cannot load {path} as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as exc:  # user code: report it, never crash
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise InputError(f"implementation '{spec}': {path} raised on import: {type(exc).__name__}: {exc}") from None
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:  # the `parity` script lacks it
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(target)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise InputError(f"implementation '{spec}': cannot import module '{target}': {type(exc).__name__}: {exc}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise InputError(f"implementation '{spec}': '{target}' has no attribute '{attr}'") from None
    if not callable(obj):
        raise InputError(f"implementation '{spec}': '{attr}' is not callable")
    return obj


def _check_accepts(spec: str, target, args: dict, skip: int) -> None:
    """An argument the implementation cannot take is the user's error, found before any probe."""
    if not args:
        return
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return  # builtins without a signature: let the call decide
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params[skip:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = sorted(set(args) - names)
    if unknown:
        raise InputError(f"--candidate-arg {', '.join(unknown)}: {spec} does not accept "
                         f"{'it' if len(unknown) == 1 else 'them'} (it accepts: {', '.join(sorted(names)) or 'nothing'})")


def _plugin(spec: str, obj, args: dict | None = None) -> Implementation:
    import torch

    args = dict(args or {})
    if isinstance(obj, Implementation):  # an entry point may hand over a ready implementation
        if args:
            raise InputError(f"--candidate-arg: {spec} is a prepared implementation and takes no arguments")
        return obj
    if inspect.isclass(obj) and issubclass(obj, torch.nn.Module):
        _check_accepts(spec, obj.__init__, args, skip=2)  # self, dim

        def prepare_module(layer: NormLayer, weight, bias, eps: float) -> Prepared:
            if layer.fused:
                raise InputError(f"{spec}: a fused add + norm is a function fn(x, residual, weight, eps), "
                                 "not a module class")
            if layer.kind == "batch_norm":  # its running statistics filled too, in eval mode
                return _batch_norm_module(obj, layer, weight, bias, eps, loaded=False, **args)
            if layer.kind == "group_norm":  # built as nn.GroupNorm(groups, channels, eps=eps)
                return _group_norm_module(obj, layer, weight, bias, eps, loaded=False, **args)
            if layer.kind == "gated_rms_norm":  # built as its signature asks, called as module(x, gate=z)
                return _gated_module(obj, layer, weight, eps)
            if layer.weightless:  # OlmoLayerNorm(hidden), Llama4TextL2Norm(eps): as its signature asks
                return maps(_weightless_module(obj, layer.dim, eps, layer.eps.value).to(
                    device=weight.device, dtype=weight.dtype).eval(), layer)
            module = obj(layer.shape if weight.dim() > 1 else layer.dim, eps=eps, **args)
            if layer.weightless and not isinstance(getattr(module, "weight", None), torch.Tensor):
                return module.to(device=weight.device, dtype=weight.dtype).eval()  # nothing to fill
            if not isinstance(getattr(module, "weight", None), torch.Tensor):
                raise TypeError(f"{obj.__name__} has no weight tensor to fill")
            module = module.to(device=weight.device, dtype=weight.dtype)
            with torch.no_grad():
                module.weight.copy_(weight)  # as stored: a Gemma module adds its own 1
                if bias is not None and isinstance(getattr(module, "bias", None), torch.Tensor):
                    module.bias.copy_(bias)
            module.eval()
            return maps(module, layer)

        return Implementation(spec, f"plugin module class {obj.__module__}.{obj.__qualname__}", prepare_module)

    _check_accepts(spec, obj, args, skip=3)  # x, weight, eps

    def prepare_function(layer: NormLayer, weight, bias, eps: float) -> Prepared:
        if layer.fused:  # fn(x, residual, weight, eps) -> the pair, or fn(x, weight, eps, scale=None) -> (q, scale)
            from parity_cli.backends import fused

            extra = {"bias": bias} if layer.kind == "layer_norm" else {}
            if layer.fused == "quant":
                return fused.on_rows_quant(fused.adapt_quant(obj, weight, eps, layer.quant[1], **extra, **args), layer)
            return fused.on_rows(fused.adapt(obj, weight, eps, **extra, **args), layer)
        if layer.kind == "batch_norm":
            mean, var = running_statistics(layer, weight)
            return lambda x: obj(x, weight, eps, bias=bias, running_mean=mean, running_var=var, **args)
        if layer.kind == "group_norm":  # called on (N, C, S) feature maps
            return feature_map(lambda x: obj(x, weight, eps, bias=bias, groups=layer.groups, **args), layer)
        if layer.kind == "gated_rms_norm":  # x and its gate z, each (rows, dim)
            return lambda x2: obj(*split_gate(x2, layer), weight, eps, groups=layer.groups, **args)
        if layer.kind == "layer_norm":
            return lambda x: obj(x, weight, eps, bias=bias, **args)
        return lambda x: obj(x, weight, eps, **args)

    return Implementation(spec, f"plugin function {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', spec)}", prepare_function)


def from_object(spec: str, obj, args: dict | None = None) -> Implementation:
    """An implementation from a Python object already in hand (parity_cli.testing): the rules of a
    loaded MODULE:ATTR, a torch.nn.Module subclass built as ATTR(dim, eps=eps), any other callable
    called as ATTR(x, weight, eps)."""
    return _plugin(spec, obj, args)


ENTRY_POINT_GROUP = "parity_cli.implementations"  # a public contract: plugins register under it


def entry_points() -> dict:
    """Named implementations that installed packages register (pyproject:
    [project.entry-points."parity_cli.implementations"] name = "module:attr")."""
    from importlib.metadata import entry_points as installed

    found = {}
    for ep in installed(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def _entry_point_source(ep) -> str:
    dist = getattr(ep, "dist", None)
    where = f" ({dist.name} {dist.version})" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value}{where}"


def available() -> list[dict]:
    """Built-ins and entry-point plugins, with where each comes from (nothing is imported)."""
    rows = [{"name": i.name, "source": i.source, "description": i.description} for i in BUILTINS.values()]
    for name, ep in sorted(entry_points().items()):
        shadowed = " (shadowed by the built-in of that name)" if name in BUILTINS else ""
        rows.append({"name": name, "source": _entry_point_source(ep) + shadowed, "description": ""})
    return rows


def precheck(spec: str, args: dict | None = None) -> None:
    """What can be said of a spec without running any of its code (the parent never imports a
    plugin): its form, that its file exists, that an entry point of that name is installed."""
    if spec in BUILTINS:
        _builtin_args(spec, args)
        require(spec)
        return
    if ":" not in spec:
        found = entry_points()
        if spec not in found:
            known = ", ".join([*BUILTINS, *sorted(found)])
            raise InputError(f"unknown implementation '{spec}'; known: {known}; or MODULE:ATTR, FILE.py:ATTR")
        return
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise InputError(f"implementation '{spec}': expected a built-in name ({', '.join(BUILTINS)}), MODULE:ATTR or FILE.py:ATTR")
    if is_file_target(target) and not Path(target).is_file():
        raise InputError(f"implementation '{spec}': no such file {Path(target)}")


def _fused_builtin(impl: Implementation) -> Implementation:
    """A built-in that also takes a fused add + norm layer (parity_cli.backends.fused): `torch` as
    transformers composes it (the sum at the activation dtype, then the norm), `vllm` with its
    fused_add_rms_norm kernel; the others say in one line that they have no fused form here."""
    import dataclasses

    plain = impl.prepare

    def prepare(layer: NormLayer, weight, bias, eps: float, **kwargs) -> Prepared:
        if not layer.fused:
            return plain(layer, weight, bias, eps, **kwargs)
        from parity_cli.backends import fused

        return fused.builtin(impl.name, layer, weight, bias, eps)

    return dataclasses.replace(impl, prepare=prepare)


def resolve(spec: str, args: dict | None = None) -> Implementation:
    if spec in BUILTINS:
        bound = _builtin_args(spec, args)
        require(spec)
        impl = _fused_builtin(BUILTINS[spec])
        if not bound:
            return impl
        import functools

        return Implementation(spec, impl.source, functools.partial(impl.prepare, **bound), impl.description)
    if ":" not in spec:
        eps_found = entry_points()
        if spec in eps_found:
            ep = eps_found[spec]
            try:
                obj = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                raise InputError(f"implementation '{spec}' ({_entry_point_source(ep)}) failed to load: "
                                 f"{type(exc).__name__}: {exc}") from None
            impl = _plugin(spec, obj, args)
            return Implementation(spec, _entry_point_source(ep), impl.prepare, impl.description)
        known = ", ".join([*BUILTINS, *sorted(eps_found)])
        raise InputError(f"unknown implementation '{spec}'; known: {known}; or MODULE:ATTR, FILE.py:ATTR")
    return _plugin(spec, _load_attr(spec), args)
