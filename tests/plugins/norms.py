"""Candidate implementations written only to the plugin contract (README, Implementations):
correct ones, and one per planted fault. Each fault is the single change named by its function."""

import torch


class LlamaRMSNorm(torch.nn.Module):
    """Correct, Llama order: fp32 normalise, cast to the input dtype, then multiply by w."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(torch.nn.Module):
    """Correct, Gemma order: gain 1 + w in fp32, cast last. Adds its own 1 to the stored w."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _normalise(x, eps):
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x, weight, eps):
    """Correct function form, gain w."""
    return (_normalise(x, eps) * weight.float()).to(x.dtype)


def gemma_rms_norm(x, weight, eps):
    return (_normalise(x, eps) * (1.0 + weight.float())).to(x.dtype)


# --- planted faults ------------------------------------------------------------------------

def eps_outside_sqrt(x, weight, eps):
    h = x.float()
    return (h / (h.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight.float()).to(x.dtype)


def eps_hardcoded_1e5(x, weight, eps):
    return rms_norm(x, weight, 1e-5)


def eps_missing(x, weight, eps):
    return rms_norm(x, weight, 0.0)


def mean_subtracted(x, weight, eps):
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def permuted_weight(x, weight, eps):
    return rms_norm(x, weight.roll(1), eps)


def gemma_without_offset(x, weight, eps):
    return rms_norm(x, weight, eps)


def gemma_offset_twice(x, weight, eps):
    return (_normalise(x, eps) * (2.0 + weight.float())).to(x.dtype)


def no_upcast(x, weight, eps):
    """Squares and averages in the input dtype: x^2 overflows float16 for |x| > 256."""
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * weight


def raises(x, weight, eps):
    raise RuntimeError("kernel not built for this shape")


def exits(x, weight, eps):
    import sys

    sys.exit(3)


def wrong_shape(x, weight, eps):
    return rms_norm(x, weight, eps)[..., :-1]


def slow(x, weight, eps):
    """For the interrupt test: long enough to be interrupted mid-run."""
    import os
    import time

    marker = os.environ.get("PARITY_TEST_MARKER")
    if marker:
        open(marker, "w").close()
    time.sleep(0.5)
    return rms_norm(x, weight, eps)


def held(x, weight, eps):
    """For the signal tests: says it has started (PARITY_TEST_MARKER), then waits for a release that
    never comes (PARITY_TEST_RELEASE, bounded at 120 s), so that the run cannot end before the signal
    the test sends, however loaded the machine."""
    import os
    import time

    marker, release = os.environ.get("PARITY_TEST_MARKER"), os.environ.get("PARITY_TEST_RELEASE")
    if marker:
        open(marker, "w").close()
    deadline = time.monotonic() + 120
    while release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    return rms_norm(x, weight, eps)


def layer_norm_without_bias(x, weight, eps, bias=None):
    """Fault: LayerNorm that ignores the checkpoint's bias."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, eps)


def rms_norm_with_bias(x, weight, eps, bias=None):
    """Fault: RMSNorm (no mean removed) on a LayerNorm checkpoint, bias added."""
    y = rms_norm(x, weight, eps)
    return y if bias is None else y + bias


class OffsetRMSNorm(torch.nn.Module):
    """Correct for either family when told the offset: gain = offset + w, Gemma order (like Liger's offset)."""

    def __init__(self, dim, eps=1e-6, offset=0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        return (_normalise(x, self.eps) * (self.offset + self.weight.float())).type_as(x)


def scaled_rms_norm(x, weight, eps, scale=1.0):
    """Correct at scale=1; anything else is a gain fault chosen by --candidate-arg."""
    return rms_norm(x, weight, eps) * scale


def hangs(x, weight, eps):
    """Fault: never returns (a deadlocked kernel)."""
    import time

    time.sleep(3600)


def returns_float32(x, weight, eps):
    """Correct values, but returned in float32 whatever the input dtype."""
    return (_normalise(x, eps) * weight.float())


def not_differentiable(x, weight, eps):
    """Correct forward computed outside autograd (e.g. a kernel without a backward)."""
    with torch.no_grad():
        return rms_norm(x, weight, eps)


class _DroppedShared(torch.autograd.Function):
    """RMSNorm with a hand-written backward that forgets the shared-denominator term:
    dx = w*g/r instead of (w*g - x̄ * mean(x̄ * w*g)) / r."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.float()
        r = torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        xbar = h / r
        ctx.save_for_backward(xbar, r, weight)
        return (xbar * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        xbar, r, weight = ctx.saved_tensors
        gf = g.float()
        dx = gf * weight.float() / r  # the fault: no "- xbar * mean(xbar * w * g)" term
        dw = (gf * xbar).reshape(-1, xbar.shape[-1]).sum(0)
        return dx.to(g.dtype), dw.to(weight.dtype), None


def dropped_shared_term(x, weight, eps):
    return _DroppedShared.apply(x, weight, eps)


class _CorrectBackward(torch.autograd.Function):
    """The same hand-written Function with the full backward: passes --grad."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        return _DroppedShared.forward(ctx, x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        xbar, r, weight = ctx.saved_tensors
        gw = g.float() * weight.float()
        dx = (gw - xbar * (xbar * gw).mean(-1, keepdim=True)) / r
        dw = (g.float() * xbar).reshape(-1, xbar.shape[-1]).sum(0)
        return dx.to(g.dtype), dw.to(weight.dtype), None


def full_backward(x, weight, eps):
    return _CorrectBackward.apply(x, weight, eps)


def gain_scaled_1pct(x, weight, eps):
    """Fault outside the panel: every gain 1% too large."""
    return rms_norm(x, weight * 1.01, eps)


def noisy(x, weight, eps):
    """Fault outside the panel: 2% multiplicative noise on the output."""
    y = rms_norm(x, weight, eps)
    gen = torch.Generator().manual_seed(11)
    return (y.float() * (1 + 0.02 * torch.randn(y.shape, generator=gen))).to(y.dtype)


def gemma_in_llama_order(x, weight, eps):
    """Gemma semantics (gain 1 + w) computed in Llama order: cast to the input dtype, then
    multiply by (1 + w) rounded to the input dtype. Right math, wrong cast order."""
    return (1.0 + weight.double()).to(x.dtype) * _normalise(x, eps).to(x.dtype)


def mutates_input(x, weight, eps):
    """Correct output, but scribbles over its input afterwards (in-place kernels do)."""
    y = rms_norm(x, weight, eps)
    x.mul_(0)
    return y


def odd_channels_zeroed(x, weight, eps):
    """Every odd channel's gain is 0 (a mis-strided weight copy): half of the channels fail."""
    w = weight.clone()
    w[1::2] = 0
    return (_normalise(x, eps) * w.float()).to(x.dtype)


def statistics_of_half_the_row(x, weight, eps, bias=None):
    """A LayerNorm whose mean and variance are read from the first half of each row only (a reduction
    over the wrong extent): the form is right, the statistics are not the row's."""
    h = x.float()
    half = h[..., : h.shape[-1] // 2]
    mean, var = half.mean(-1, keepdim=True), half.var(-1, unbiased=False, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


# --- issue 47: causes that were misnamed ---------------------------------------------------------

def scale_held_in_dtype(x, weight, eps):
    """eps used, in float32; the scale 1/sqrt(q + eps) then held in x's dtype (a kernel's rstd
    buffer of the input type): at eps 1e-12 it is 1e6, past float16's 65504, so inf."""
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)
    return ((x * rstd).float() * weight.float()).to(x.dtype)


def half_arithmetic(x, weight, eps):
    """A float32 kernel that does its arithmetic in float16 (an accumulator type left at half):
    the right form, float16's rounding."""
    h = x.half()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + max(eps, 6e-8)) * weight.half()
    return y.to(x.dtype)
