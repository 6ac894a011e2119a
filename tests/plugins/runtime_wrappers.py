"""Deployment glue around the runtimes' real kernels (llama.cpp's ggml, MLX, ExecuTorch), each with
a fault such glue has had: eps hard-coded by the wrapper (llama.cpp #2373), Gemma's stored w handed
over as the gain (the `+ 1` dropped), and activations left in float16 where the runtime allows it
(the square formed in float16: pytorch #133085). The kernels are the runtimes' own; only the glue
is planted. Plugin functions: (x, weight, eps) -> y at x's dtype."""

import types

import torch

# --- llama.cpp's ggml: ggml_mul(ggml_rms_norm(x, eps), w) through parity's own ctypes binding ---


def _ggml(x, gain, eps):
    from parity_cli.backends import ggml_kernels

    layer = types.SimpleNamespace(kind="rms_norm", gain_offset=0.0, weight=gain, name="wrapper", dim=gain.shape[-1])
    return ggml_kernels.prepare(layer, gain, None, eps)(x)


def ggml_eps_1e6(x, weight, eps):
    return _ggml(x, weight, 1e-6)


def ggml_offset_dropped(x, weight, eps):
    return _ggml(x, weight, eps)


# --- MLX: mx.fast.rms_norm, and the same norm composed of mx ops in the input dtype ---


def _mx(t):
    import mlx.core as mx

    types_ = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
    return mx.array(t.detach().float().numpy()).astype(types_[t.dtype])


def _torch(y, like):
    import mlx.core as mx
    import numpy as np

    return torch.from_numpy(np.array(y.astype(mx.float32), copy=True)).to(like.dtype).reshape(like.shape)


def mlx_eps_1e6(x, weight, eps):
    import mlx.core as mx

    return _torch(mx.fast.rms_norm(_mx(x), _mx(weight.to(x.dtype)), 1e-6), x)


def mlx_offset_dropped(x, weight, eps):
    import mlx.core as mx

    return _torch(mx.fast.rms_norm(_mx(x), _mx(weight.to(x.dtype)), eps), x)


def mlx_half_activations(x, weight, eps):
    """x * rsqrt(mean(x * x) + eps) * w in mx ops at x's dtype: no upcast before the square."""
    import mlx.core as mx

    h = _mx(x)
    return _torch(h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + eps) * _mx(weight.to(x.dtype)), x)


# --- ExecuTorch: a module exported, lowered to XNNPACK and run by the ExecuTorch runtime ---

_PROGRAMS: dict = {}


def _executorch(form, x, weight, eps):
    from parity_cli.backends import executorch_runtime

    key = (form.__name__, x.dtype, x.shape[-1], eps)
    if key not in _PROGRAMS:
        example = (torch.zeros(2, x.shape[-1], dtype=x.dtype), weight.to(x.dtype))
        _PROGRAMS[key] = executorch_runtime._export(lambda h, w: form(h, w, eps), example, 4096)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return _PROGRAMS[key].execute([flat, weight.to(x.dtype).contiguous()])[0].reshape(x.shape)


def _upcast(h, w, eps):  # LlamaRMSNorm's forward
    f = h.float()
    return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _in_dtype(h, w, eps):
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


def executorch_eps_1e6(x, weight, eps):
    return _executorch(_upcast, x, weight, 1e-6)


def executorch_offset_dropped(x, weight, eps):
    return _executorch(_upcast, x, weight, eps)


def executorch_half_activations(x, weight, eps):
    return _executorch(_in_dtype, x, weight, eps)
