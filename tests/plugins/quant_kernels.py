"""RMSNorm + int8 quantize kernels (issue 37), fn(x, weight, eps, scale=None) -> (q, scale): a static
scale is given, a dynamic one (None) is the kernel's own per token (max |y| / 127). A correct one,
then one fault each in the quantize step. Pure torch, the norm as vLLM computes it (float32, one
cast to the input dtype before quantizing)."""

import torch


def _normed(x, weight, eps, bias=None):
    h = x.float()
    if bias is not None:  # a LayerNorm family: centred, and its bias added
        h = h - h.mean(-1, keepdim=True)
        return (weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) + bias.float()).to(x.dtype)
    return (weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _scale(y, scale):
    if scale is not None:
        return torch.tensor(float(scale))
    return (y.float().abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)


def correct(x, weight, eps, scale=None, bias=None):
    y = _normed(x, weight, eps, bias)
    s = _scale(y, scale)
    return torch.round(y.float() / s).clamp(-128, 127).to(torch.int8), s


def truncates(x, weight, eps, scale=None):
    y = _normed(x, weight, eps)
    s = _scale(y, scale)
    return torch.trunc(y.float() / s).clamp(-128, 127).to(torch.int8), s


def wraps(x, weight, eps, scale=None):
    """No clamp: a value past 127 wraps around as the int8 cast does."""
    y = _normed(x, weight, eps)
    s = _scale(y, scale)
    return torch.round(y.float() / s).to(torch.int32).to(torch.int8), s


def scale_before_gain(x, weight, eps, scale=None):
    """The normalised value quantized before the gain: the integers of N(x), not N(x) * w."""
    y = _normed(x, torch.ones_like(weight), eps)
    s = _scale(y, scale)
    return torch.round(y.float() / s).clamp(-128, 127).to(torch.int8), s


def huge_scale(x, weight, eps, scale=None):
    """Claims a per-token scale of 1e6 and returns zeros: its own scale must not widen the allowance."""
    return torch.zeros(x.shape, dtype=torch.int8), torch.full((x.shape[0], 1), 1e6)


def fractional_q(x, weight, eps, scale=None):
    """Hands back x / scale unrounded, as floats: not int8 values."""
    y = _normed(x, weight, eps)
    s = _scale(y, scale)
    return y.float() / s, s
