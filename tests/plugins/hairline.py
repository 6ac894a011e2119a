"""Candidates at the hairline (issue 23): faults that miss the tolerance by about 1x, where
several variants land near the candidate, and LayerNorm faults from real runtimes that the
hypothesis space lacked. Each is a transcription of what the runtime computes, written only to
the plugin contract (x, weight, eps[, bias])."""

import torch


def _layer_norm(x, weight, eps, bias, work):
    """torch's LayerNorm at `work` precision, gain and bias applied there, cast back to x's dtype."""
    b = None if bias is None else bias.to(work)
    return torch.nn.functional.layer_norm(x.to(work), x.shape[-1:], weight.to(work), b, eps).to(x.dtype)


def gain_scaled(x, weight, eps, bias=None, scale=1.01):
    """Llama order (float32 normalise, cast to the input dtype, multiply by the gain), with every
    gain `scale` x the stored one: at bfloat16 a 1 % gain error misses by about 1x the allowance."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * scale).to(x.dtype) * h.to(x.dtype)


def layer_norm_float32(x, weight, eps, bias=None):
    """float32 math handed back at the input dtype (float64 asked for: JAX without x64)."""
    return _layer_norm(x, weight, eps, bias, torch.float32)


def rms_norm_eps_stored_f16(x, weight, eps, bias=None):
    """An OpenVINO float16 IR on the CPU: the graph's constants are float16 (eps 1e-5 is held as
    1.00136e-5), the math is float32, the output is float16 again, then the gain in float16."""
    e = float(torch.tensor(eps, dtype=torch.float16))
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + e)
    return weight.to(torch.float16) * h.to(torch.float16)


def layer_norm_eps_outside(x, weight, eps, bias=None):
    """(x - mean) / (std + eps): OpenVINO MVN(eps_mode="outside_sqrt") and hand-written code."""
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    y = h / (h.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def layer_norm_eps_in_dtype(x, weight, eps, bias=None):
    """A float16 graph on a runtime that computes in float32: its eps constant is held in float16,
    where 1e-12 is 0, so an all-zero row is 0/0 = NaN; everything else is right."""
    e = float(torch.tensor(eps, dtype=x.dtype))
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + e) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def layer_norm_in_dtype(x, weight, eps, bias=None):
    """LayerNorm computed in the input dtype throughout, eps too: no upcast, and 1e-12 is 0 in
    float16, so an all-zero row is 0/0."""
    e = torch.tensor(eps, dtype=x.dtype)
    h = x - x.mean(-1, keepdim=True)
    y = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + e) * weight.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


def layer_norm_mean_as_sum(x, weight, eps, bias=None):
    """tinygrad's LayerNorm in float32: mean = sum / n, the sum rounded once per element
    (sequentially), so a constant row's x - mean is a few ulps instead of 0 and eps (1e-12) does
    not absorb it. The variance is the mean square of x - mean, as tinygrad computes it."""
    h = x.float()
    n = h.shape[-1]
    acc = torch.zeros(h.shape[:-1], dtype=torch.float32)
    for j in range(n):
        acc = acc + h[..., j]
    h = h - (acc / n).unsqueeze(-1)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def _mean_in(x, weight, eps, bias, dtype):
    """A LayerNorm in float32 whose mean alone is rounded to `dtype` (a half-precision reduction)."""
    h = x.float()
    h = h - h.mean(-1, keepdim=True).to(dtype).float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def layer_norm_mean_in_float16(x, weight, eps, bias=None):
    return _mean_in(x, weight, eps, bias, torch.float16)


def layer_norm_mean_in_bfloat16(x, weight, eps, bias=None):
    return _mean_in(x, weight, eps, bias, torch.bfloat16)


def layer_norm_folded_f16(x, weight, eps, bias=None):
    """keras' generic LayerNorm formula, x * (g / sqrt(var + eps)) + (b - mean * g / sqrt(var + eps)),
    run as a float16 graph: moments in float32 and stored as float16, eps a float16 constant (1e-12
    is 0 there). A variance that is 0 in float16 gives inf * 0 or inf - inf: NaN on the zero rows,
    on constant rows, and on tiny rows whose variance underflows float16."""
    half = torch.float16
    h = x.float()
    mean = h.mean(-1, keepdim=True).to(half)
    var = h.var(-1, unbiased=False, keepdim=True).to(half)
    inv = torch.rsqrt(var + torch.tensor(eps, dtype=half)) * weight.to(half)
    res = -mean * inv + (0 if bias is None else bias.to(half))
    return x.to(half) * inv + res


# --- one entry for the diagnosis panel (tests/diagnosis_panel.py) ------------------------------------

def rms_norm_float32(x, weight, eps, bias=None):
    """float32 math handed back at the input dtype, Gemma order (one rounding)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


FAULTS = {  # key -> (RMSNorm candidate, LayerNorm candidate)
    "gain_llama": (gain_scaled, None),
    "fp32_math": (rms_norm_float32, layer_norm_float32),
    "eps_f16": (rms_norm_eps_stored_f16, None),
    "eps_lost": (None, layer_norm_eps_in_dtype),
    "mean_sum": (None, layer_norm_mean_as_sum),
}


def planted(x, weight, eps, bias=None, faults="", offset=0.0, kind="rms_norm"):
    """The panel's calling convention (tests/plugins/faults.py): one key of FAULTS, `key` or
    `key=value` (gain_llama's scale). The gain's offset is the family's (Gemma's 1 + w)."""
    key, _, value = faults.partition("=")
    fn = FAULTS[key][kind == "layer_norm"]
    weight = weight + offset if offset else weight
    args = {"scale": float(value)} if value else {}
    return fn(x, weight, eps, bias, **args)


def layer_norm_naive_variance(x, weight, eps, bias=None):
    """var = E[x^2] - E[x]^2 in float32 (hand-written fused kernels): on a constant row that
    difference is rounding noise of c^2, which can be negative (NaN) or swamp eps 1e-12; rows with
    any spread are fine."""
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = h.pow(2).mean(-1, keepdim=True) - mean * mean
    y = (h - mean) * torch.rsqrt(var + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)
