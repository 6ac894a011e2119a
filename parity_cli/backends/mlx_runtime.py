"""The `mlx` built-in: the family's norm with MLX's own kernels, as mlx-lm builds a Hugging Face
model for Apple silicon (and MLX's CPU build runs it on Linux: `pip install mlx mlx-cpu`).

- RMSNorm: `mx.fast.rms_norm(x, w, eps)`, what mlx.nn.RMSNorm calls; Gemma's `1 + w` as mlx-lm's
  gemma models write it, `mx.fast.rms_norm(x, 1.0 + weight, eps)`: the sum in the weight's dtype;
- LayerNorm: `mx.fast.layer_norm(x, w, b, eps)` (mlx.nn.LayerNorm);
- GroupNorm: mlx.nn.GroupNorm(groups, C, eps, pytorch_compatible=True) on channels-last maps, the
  probe rows (N, C*S) channel-major given as (N, S, C);
- BatchNorm: mlx.nn.BatchNorm(C, eps) in eval mode with the checkpoint's running statistics.
Gated norms have no MLX layer: refused. Tensors cross as numpy arrays (bfloat16 through float32,
exactly: the values are bfloat16 already), in the candidate's dtype; MLX computes there, with
float32 accumulation inside its fast kernels."""

from __future__ import annotations

from parity_cli.backends import Runtime
from parity_cli.errors import InputError

NAME = "mlx"
INSTALL = 'pip install mlx mlx-cpu (Linux; on Apple silicon: pip install mlx)'
RUNTIME = Runtime(
    "mlx", "MLX's kernels as mlx-lm builds the norm (mx.fast.rms_norm, mx.fast.layer_norm, mlx.nn.GroupNorm, "
    "mlx.nn.BatchNorm; mlx[cpu] on Linux)", package="mlx", install=INSTALL, extra="mlx",
    public="mlx.nn's norm modules", order=60)
KINDS = ("rms_norm", "layer_norm", "group_norm", "batch_norm")


def describe(device: str = "cpu") -> dict:
    from importlib.metadata import version

    if device.startswith("cuda"):
        raise InputError(f"--candidate mlx runs on MLX's CPU (or Apple GPU) device, not {device}")
    return {"runtime": f"mlx {version('mlx')}", "device": "cpu",
            "kernel": "mx.fast.rms_norm / mx.fast.layer_norm; mlx.nn.GroupNorm, mlx.nn.BatchNorm",
            "computes_in": "the input dtype, with float32 accumulation inside the fast kernels"}


DTYPES = ("float32", "bfloat16", "float16")


def check_layer(layer, dtype: str | None = None) -> None:
    if dtype is not None and dtype not in DTYPES:  # said once, before any layer runs
        raise InputError(f"--candidate mlx: MLX computes {', '.join(DTYPES)}, not {dtype}")
    if layer.kind not in KINDS:
        raise InputError(f"--candidate mlx: MLX has no {layer.kind} layer ({layer.name}); it runs "
                         f"{', '.join(KINDS)}")
    if layer.weight is not None and layer.weight.dim() > 1:
        raise InputError(f"--candidate mlx: {layer.name} has a per-head gain, which mlx-lm applies after the "
                         "norm; not built here")


def _mx(t, mx, dtype):
    import torch

    return mx.array(t.detach().to(device="cpu", dtype=torch.float32).numpy()).astype(dtype)


def prepare(layer, weight, bias, eps: float):
    """x -> y through MLX, at x's dtype."""
    import mlx.core as mx
    import numpy as np
    import torch

    check_layer(layer)
    types = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    if weight.dtype not in types:
        raise InputError(f"--candidate mlx: MLX computes float32, bfloat16, float16, not "
                         f"{str(weight.dtype).removeprefix('torch.')}")
    dtype = types[weight.dtype]
    w = _mx(weight, mx, dtype)
    if layer.gain_offset:  # mlx-lm's Gemma: 1.0 + weight, in the weight's dtype
        w = layer.gain_offset + w
    b = None if bias is None else _mx(bias, mx, dtype)
    run = _kernel(layer, mx, w, b, eps, dtype)

    def call(x):
        y = run(_mx(x, mx, dtype))
        mx.eval(y)
        out = torch.from_numpy(np.array(y.astype(mx.float32), copy=True))
        return out.to(dtype=x.dtype, device=x.device).reshape(x.shape)

    return call


def _kernel(layer, mx, w, b, eps: float, dtype):
    import mlx.nn as nn

    if layer.kind == "rms_norm":
        return lambda x: mx.fast.rms_norm(x, w, eps)
    if layer.kind == "layer_norm":
        return lambda x: mx.fast.layer_norm(x, w, b, eps)
    if layer.kind == "group_norm":
        module = nn.GroupNorm(layer.groups, layer.dim, eps=eps, affine=True, pytorch_compatible=True)
        module.weight, module.bias = w, b if b is not None else mx.zeros_like(w)
        module.set_dtype(dtype)

        def group(x):  # (N, C*S) channel-major -> (N, S, C) channels-last, and back
            maps = x.reshape(x.shape[0], layer.dim, -1).transpose(0, 2, 1)
            return module(maps).transpose(0, 2, 1).reshape(x.shape[0], -1)

        return group
    module = nn.BatchNorm(layer.dim, eps=eps, affine=True, track_running_stats=True)
    module.weight, module.bias = w, b if b is not None else mx.zeros_like(w)
    module.running_mean = _mx(layer.running_mean, mx, dtype)
    module.running_var = _mx(layer.running_var, mx, dtype)
    module.eval()
    return module


def public_path(layer, weight, bias, eps: float):
    """The same norm through MLX's public path, as a deployment builds it, written apart from prepare
    (issue 46's differential truth): an `mlx.nn` module of the kind, its parameters set at the
    candidate dtype and called as a module: mlx.nn.RMSNorm, mlx.nn.LayerNorm, mlx.nn.GroupNorm
    (pytorch_compatible, channels-last maps) and mlx.nn.BatchNorm (eval, the running statistics).
    A gain offset (Gemma's 1 + w) is mlx-lm's own module, `mx.fast.rms_norm(x, 1.0 + self.weight,
    eps)`: mlx_lm.models.gemma.RMSNorm where mlx-lm is installed, else that one line transcribed
    (mlx-lm is not a dependency here). Tensors cross as numpy arrays, as prepare's do."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    import torch

    check_layer(layer, str(weight.dtype).removeprefix("torch."))
    types = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    dtype = types[weight.dtype]

    def tensor(t):
        return mx.array(t.detach().to(device="cpu", dtype=torch.float32).numpy()).astype(dtype)

    w, b = tensor(weight), None if bias is None else tensor(bias)
    if layer.kind == "rms_norm":
        module = _offset_rms_norm(nn, mx, layer.dim, eps, layer.gain_offset) if layer.gain_offset \
            else nn.RMSNorm(layer.dim, eps=eps)
        module.weight = w
    elif layer.kind == "layer_norm":
        module = nn.LayerNorm(layer.dim, eps=eps, affine=True, bias=b is not None)
        module.weight = w + layer.gain_offset if layer.gain_offset else w
        if b is not None:
            module.bias = b
    elif layer.kind == "group_norm":
        module = nn.GroupNorm(layer.groups, layer.dim, eps=eps, affine=True, pytorch_compatible=True)
        module.weight = w
        module.bias = b if b is not None else mx.zeros_like(w)
    else:  # batch_norm (check_layer refuses the rest)
        module = nn.BatchNorm(layer.dim, eps=eps, affine=True, track_running_stats=True)
        module.weight = w
        module.bias = b if b is not None else mx.zeros_like(w)
        module.running_mean, module.running_var = tensor(layer.running_mean), tensor(layer.running_var)
    module.eval()

    def run(x):
        h = mx.array(x.detach().to(device="cpu", dtype=torch.float32).numpy()).astype(dtype)
        if layer.kind == "group_norm":  # rows (N, C*S), channel-major -> maps (N, S, C), channels last
            y = module(h.reshape(h.shape[0], layer.dim, -1).transpose(0, 2, 1)).transpose(0, 2, 1)
        else:
            y = module(h)
        mx.eval(y)
        out = torch.from_numpy(np.array(y.astype(mx.float32), copy=True))
        return out.reshape(x.shape).to(dtype=x.dtype, device=x.device)

    return run


def _offset_rms_norm(nn, mx, dim: int, eps: float, offset: float):
    """mlx-lm's Gemma RMSNorm (mlx_lm/models/gemma.py): the gain 1.0 + weight, at the weight's dtype."""
    if offset == 1.0:
        try:
            from mlx_lm.models.gemma import RMSNorm

            return RMSNorm(dim, eps=eps)
        except ImportError:
            pass

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = mx.ones((dim,))
            self.eps = eps

        def __call__(self, x):
            return mx.fast.rms_norm(x, offset + self.weight, self.eps)

    return RMSNorm()
