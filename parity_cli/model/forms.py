"""The numerics orders of the Hugging Face norm classes (families.ORDERS), written once: the `hf`
built-in runs them, and a family derived from a model's own classes is classified against them.

Each is a transcription of the class's forward: its upcasts, cast order and inverse square root,
so that it is bitwise equal to the module at every dtype."""

from __future__ import annotations

from parity_cli.errors import InputError


def hf_forward(kind: str, order: str, gain_offset: float, inverse_sqrt: str, dim: int, weight, bias, eps: float,
               where: str = "the norm", statistics=None, groups: int = 1):
    """A function of the input batch computing the norm as the family's class does. A batch_norm
    takes its (running_mean, running_var) as `statistics`."""
    import torch
    import torch.nn.functional as F

    if kind == "batch_norm":  # nn.BatchNorm*d in eval mode: F.batch_norm at the parameter dtype
        if order != "native" or statistics is None:
            raise InputError(f"hf: a batch_norm runs in order 'native' with its running statistics ({where})")
        mean, var = statistics
        gain = weight + gain_offset if gain_offset else weight
        return lambda x: F.batch_norm(x, mean, var, gain, bias, training=False, eps=eps)
    if kind == "group_norm":  # nn.GroupNorm: F.group_norm at the parameter dtype, on (N, C, *) maps
        gain = weight + gain_offset if gain_offset else weight
        return lambda x: F.group_norm(x, groups, gain, bias, eps)
    if order == "native_fp32":  # F.layer_norm of x.float(), then cast: OLMo's OlmoLayerNorm
        if kind != "layer_norm":
            raise InputError(f"hf: order 'native_fp32' is only defined for LayerNorm ({where})")

        def native_fp32(x):
            gain = None if weight is None else (weight.float() + gain_offset if gain_offset else weight.float())
            return F.layer_norm(x.float(), (dim,), gain, None if bias is None else bias.float(), eps).to(x.dtype)

        return native_fp32
    if order == "native":  # nn.LayerNorm runs at the parameter dtype
        if kind != "layer_norm":
            raise InputError(f"hf: order 'native' is only defined for LayerNorm ({where})")
        # Nemotron's LayerNorm1P: F.layer_norm with the gain 1 + w, that sum at the weight's dtype
        gain = weight + gain_offset if gain_offset else weight
        return lambda x: F.layer_norm(x, (dim,), gain, bias, eps)

    def inv_sqrt(v):
        return torch.pow(v, -0.5) if inverse_sqrt == "pow" else torch.rsqrt(v)

    def normalise(h):  # h is float32
        if kind == "layer_norm":
            h = h - h.mean(-1, keepdim=True)
        return h * inv_sqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    if order == "llama":

        def llama(x):
            h = normalise(x.to(torch.float32))
            return weight * h.to(x.dtype)

        return llama
    if order == "gemma":

        def gemma(x):
            h = normalise(x.float())
            h = h * (gain_offset + weight.float()) if gain_offset else weight.float() * h
            if bias is not None:
                h = h + bias.float()
            return h.type_as(x)

        return gemma
    if order == "t5":

        def t5(x):
            # x * rsqrt(fp32 variance) promotes to fp32 for half x; float64 x stays float64.
            h = x * inv_sqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
            if weight.dtype in (torch.float16, torch.bfloat16):
                h = h.to(weight.dtype)
            return weight * h

        return t5
    raise InputError(f"hf: no transcription for numerics order '{order}'")




def gated_forward(order: str, gate: str, activation: str, groups: int, dim: int, weight, eps: float,
                  gain_offset: float = 0.0):
    """A gated RMSNorm class's forward on [x | z] rows, transcribed: float32 throughout, the gate
    act(z) in float32 before the grouped statistic (Mamba2, Bamba, Zamba2, Nemotron-H, Granite 4's
    MambaRMSNormGated; Falcon-H1 with norm_before_gate=False) or after it (Qwen3-Next, Qwen3.5,
    Kimi Linear); the gain cast-then-multiplied (llama order) or in float32 (gemma order)."""
    import torch

    act = torch.nn.functional.silu if activation == "silu" else torch.sigmoid
    size = dim // groups
    gain = weight + gain_offset if gain_offset else weight

    def run(x2):
        x, z = x2[..., :dim], x2[..., dim:]
        dtype = x.dtype
        h = x.to(torch.float32)
        if gate == "before":
            h = h * act(z.to(torch.float32))
        grouped = h.view(*h.shape[:-1], groups, size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
        h = grouped.view(*h.shape[:-1], dim)
        y = gain * h.to(dtype) if order == "llama" else gain.to(torch.float32) * h
        if gate == "after":
            y = y * act(z.to(torch.float32))
        return y.to(dtype)

    return run
