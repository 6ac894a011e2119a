"""A kernel library's fused norms, as its authors write them, in torch ops where the real library has
Triton or CUDA (so that they run on any CPU): the forward of Liger Kernel's RMSNorm with its
`casting_mode` (llama, gemma, none) and `offset`, vLLM's fused residual-add + RMSNorm, a fused
LayerNorm, and an RMSNorm with a hand-written backward as Liger's has. Each is correct as written;
the faults below are the classic ones, each one change to a correct kernel.

The tests in tests/test_testing_api.py and tests/test_pytest_plugin.py check them with
parity_cli.testing the way such a library would: one assertion in its existing tests."""

from __future__ import annotations

import torch

# --- the kernels --------------------------------------------------------------------------------


def rms_norm_fwd(x, weight, eps, offset=0.0, casting_mode="llama"):
    """Liger's RMSNorm forward (liger_kernel/ops/rms_norm.py), one row a program:
    llama - only the inverse RMS in float32: x * rstd cast back to x's dtype, then times (offset + w)
    gemma - everything in float32, including offset + w; cast to x's dtype last
    none  - no casting at all: x^2, its mean and rsqrt at x's dtype"""
    if casting_mode == "llama":
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * rstd).to(x.dtype) * (offset + weight)
    if casting_mode == "gemma":
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * rstd * (offset + weight.float())).to(x.dtype)
    if casting_mode == "none":
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x * rstd * (offset + weight)
    raise ValueError(f"casting_mode {casting_mode!r}")


def fused_rms_norm(x, weight, eps):
    """The library's public functional form, Llama casting: fn(x, weight, eps)."""
    return rms_norm_fwd(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    """vLLM's fused_add_rms_norm (csrc/layernorm_kernels.cu): residual += x at the input dtype, then the
    RMSNorm of the new residual with the variance in float32, (x * rstd) cast back, times w."""
    residual = residual + x
    h = residual.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * rstd).to(x.dtype) * weight, residual


def fused_layer_norm(x, weight, eps, bias=None):
    """A fused LayerNorm: mean, variance and the affine in float32, cast last. Per-head gains (Cohere's
    q/k norms: weight (heads, head_dim), x (rows, heads, head_dim)) broadcast as they are."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class FusedRMSNorm(torch.nn.Module):
    """Liger's LigerRMSNorm(hidden_size, eps=1e-6, offset=0.0, casting_mode="llama"): a Gemma model
    is served with offset=1.0, casting_mode="gemma" (its checkpoint stores w, the gain is 1 + w)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - offset))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, x):
        return rms_norm_fwd(x, self.weight, self.variance_epsilon, self.offset, self.casting_mode)


class FusedLayerNorm(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-5, bias=True):
        super().__init__()
        shape = hidden_size if isinstance(hidden_size, (tuple, list)) else (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(shape))
        self.bias = torch.nn.Parameter(torch.zeros(shape)) if bias else None
        self.eps = eps

    def forward(self, x):
        return fused_layer_norm(x, self.weight, self.eps, self.bias)


# the configuration a library picks per model family: which kernel, with which casting and offset
FAMILY_KERNELS = {
    "llama": lambda x, w, eps: rms_norm_fwd(x, w, eps, casting_mode="llama"),
    "t5": lambda x, w, eps: rms_norm_fwd(x, w, eps, casting_mode="llama"),
    "gemma": lambda x, w, eps: rms_norm_fwd(x, w, eps, offset=1.0, casting_mode="gemma"),
    "olmo2": lambda x, w, eps: rms_norm_fwd(x, w, eps, casting_mode="gemma"),
    "cohere": fused_layer_norm,
    "layer_norm": fused_layer_norm,
}


# --- a hand-written backward, as Liger's -------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """Gemma-order RMSNorm with its backward written out: with n = x * rstd and g = dy * w,
    dx = rstd * (g - n * mean(g * n)) and dw = sum over rows of dy * n."""

    @staticmethod
    def forward(ctx, x, weight, eps, drop_shared_term):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(xf, weight, rstd)
        ctx.drop = drop_shared_term
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xf, weight, rstd = ctx.saved_tensors
        n = xf * rstd
        g = dy.float() * weight.float()
        shared = 0.0 if ctx.drop else n * (g * n).mean(-1, keepdim=True)
        dx = rstd * (g - shared)
        dw = (dy.float() * n).reshape(-1, n.shape[-1]).sum(0)
        return dx.to(dy.dtype), dw.to(weight.dtype), None, None


def rms_norm_custom_backward(x, weight, eps):
    return _RMSNormFunction.apply(x, weight, eps, False)


# --- the classic faults, each one change to a correct kernel ------------------------------------------


def rms_norm_eps_1e5(x, weight, eps):
    """eps hard-coded at 1e-5 (Apex's and TransformerEngine's default) whatever the model's is."""
    return rms_norm_fwd(x, weight, 1e-5)


def rms_norm_no_upcast(x, weight, eps):
    """casting_mode="none": x^2 and its mean at the input dtype (x^2 overflows float16 past |x| = 256)."""
    return rms_norm_fwd(x, weight, eps, casting_mode="none")


def gemma_rms_norm_without_offset(x, weight, eps):
    """A Gemma model served by the Llama configuration: the stored w used as the gain, 1 + w missing."""
    return rms_norm_fwd(x, weight, eps, offset=0.0, casting_mode="gemma")


def rms_norm_eps_outside_sqrt(x, weight, eps):
    """x / (sqrt(q) + eps): "adds eps" too, outside the root."""
    h = x.float()
    return (h / (h.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype) * weight


def rms_norm_backward_drops_shared_term(x, weight, eps):
    """The backward forgets the term every element of a row shares (dx = rstd * g)."""
    return _RMSNormFunction.apply(x, weight, eps, True)


def rms_norm_from_fused_add(x, weight, eps):
    """vLLM's fused add + RMSNorm, checked on its norm: a zero residual."""
    return fused_add_rms_norm(x, torch.zeros_like(x), weight, eps)[0]
