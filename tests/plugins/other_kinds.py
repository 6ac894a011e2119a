"""Gated RMSNorm and GroupNorm ports built from real third-party code, used right and wrong, as
plugin functions for tests/test_other_kinds.py: transformers' own gated norm classes (Mamba2's
Mamba2's gated norm (Mamba2RMSNormGated; MambaRMSNormGated before transformers 5.25), Falcon-H1's FalconH1RMSNormGated, Qwen3-Next's and Kimi Linear's), and
torch.nn.GroupNorm / InstanceNorm1d. Each builds the module per call, fills its gain (and bias)
with what the tool hands over, and runs it at the dtype it is given.

A gated function is called as fn(x, z, weight, eps, groups=G) with x and z (rows, dim); a
GroupNorm function as fn(x, weight, eps, bias=b, groups=G) with x an (N, C, S) feature map."""

import torch


def _filled(module, weight, bias=None):
    module = module.to(weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    return module.eval()


def _mamba(dim, group_size, eps):
    from installed_classes import built_class  # beside this file: the class Mamba2Mixer builds, whatever its name

    return built_class("mamba2", "layers.0.mixer.norm")(dim, group_size=group_size, eps=eps)


# --- gated RMSNorm --------------------------------------------------------------------------------


def mamba(x, z, weight, eps, groups=1):
    """Right for Mamba2: its gated norm as Mamba2Mixer builds it, group_size = dim / n_groups."""
    module = _filled(_mamba(x.shape[-1], x.shape[-1] // groups, eps), weight)
    with torch.no_grad():
        return module(x, gate=z)


def mamba_one_group(x, z, weight, eps, groups=1):
    """Mamba2's gated norm built with group_size = the whole width: n_groups forgotten, the statistic
    taken over every channel at once."""
    module = _filled(_mamba(x.shape[-1], x.shape[-1], eps), weight)
    with torch.no_grad():
        return module(x, gate=z)


def mamba_sigmoid(x, z, weight, eps, groups=1):
    """The gate through sigmoid where Mamba2 uses silu: x * sigmoid(z) in float32, then Mamba's own
    grouped norm called without a gate."""
    module = _filled(_mamba(x.shape[-1], x.shape[-1] // groups, eps), weight)
    with torch.no_grad():
        return module(x.float() * torch.sigmoid(z.float()), gate=None).to(x.dtype)


def falcon_h1_default(x, z, weight, eps, groups=1):
    """Falcon-H1's FalconH1RMSNormGated with its default norm_before_gate=True (the statistic of x,
    the gate after it), per group: Mamba2's gate moved after the statistic."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    module = _filled(FalconH1RMSNormGated(x.shape[-1], eps=eps, n_groups=groups), weight)
    with torch.no_grad():
        return module(x, gate=z)


def qwen3_next(x, z, weight, eps, groups=1):
    """Right for Qwen3-Next: Qwen3NextRMSNormGated, RMSNorm(x) * w * silu(z)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    module = _filled(Qwen3NextRMSNormGated(x.shape[-1], eps=eps), weight)
    with torch.no_grad():
        return module(x, gate=z)


def kimi(x, z, weight, eps, groups=1):
    """Kimi Linear's KimiLinearRMSNormGated (sigmoid of the gate) where Qwen3-Next uses silu."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    module = _filled(KimiLinearRMSNormGated(x.shape[-1], eps=eps), weight)
    with torch.no_grad():
        return module(x, gate=z)


def mamba_for_qwen3_next(x, z, weight, eps, groups=1):
    """Mamba2's gated norm (one group) where Qwen3-Next gates after the statistic: the gate
    moved before it."""
    module = _filled(_mamba(x.shape[-1], x.shape[-1] // groups, eps), weight)
    with torch.no_grad():
        return module(x, gate=z)


# --- GroupNorm, on (N, C, S) maps -----------------------------------------------------------------


def group_norm(x, weight, eps, bias=None, groups=1):
    """Right: torch.nn.GroupNorm(groups, C, eps=eps)."""
    module = _filled(torch.nn.GroupNorm(groups, x.shape[1], eps=eps), weight, bias)
    with torch.no_grad():
        return module(x)


def group_norm_32(x, weight, eps, bias=None, groups=1):
    """torch.nn.GroupNorm(32, C): the group count most code hard-codes, whatever the model's."""
    module = _filled(torch.nn.GroupNorm(32, x.shape[1], eps=eps), weight, bias)
    with torch.no_grad():
        return module(x)


def group_norm_4(x, weight, eps, bias=None, groups=1):
    """torch.nn.GroupNorm(4, C): a count no list of common ones holds where the model has 1."""
    module = _filled(torch.nn.GroupNorm(4, x.shape[1], eps=eps), weight, bias)
    with torch.no_grad():
        return module(x)


def instance_norm(x, weight, eps, bias=None, groups=1):
    """torch.nn.InstanceNorm1d(C, affine=True): every channel normalised on its own (groups = C)."""
    module = _filled(torch.nn.InstanceNorm1d(x.shape[1], eps=eps, affine=True), weight, bias)
    with torch.no_grad():
        return module(x)
