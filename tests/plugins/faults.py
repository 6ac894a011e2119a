"""One configurable candidate for the diagnosis confusion matrix (issue 13): the family's own
math with any set of faults planted at once, the way real migrations combine them (ONNX's
default eps *and* the stored w as the gain; a hard-coded eps *and* no upcast).

`faults` is a comma-separated list:
  eps=V        eps hard-coded to V          eps_outside   x / (sqrt(q) + eps)
  no_offset    gain w where 1 + w is used   offset_twice  gain 2 + w (1 + w families)
  add_one      gain 1 + w where w is used   scale=S       every gain times S
  no_upcast    square and sum in the dtype  mean          centring flipped (RMS <-> LayerNorm)
  variance     divide by sqrt(var + eps) without centring x
  fp32_seq     the mean square summed sequentially in float32 (float32/float64 inputs)
  channels2    the gain of channels 1 and 2 times 1.5 (a mis-broadcast weight)
  one_pass     (LayerNorm) the variance as E[x^2] - E[x]^2 in float32, clamped at 0 (CTranslate2's CPU kernel)
For a BatchNorm (kind batch_norm, issue 26), in float32 as runtimes compute it:
  eps=V, eps_outside (x - mean) / (sqrt(var) + eps)
  batch_stats  the batch's mean and variance (a module left in training mode)
  swapped      running_var as the mean, running_mean as the variance
  missing      mean 0 and variance 1 (running statistics never loaded)
"""

import torch


def _parse(faults: str) -> dict:
    out = {}
    for item in filter(None, (f.strip() for f in faults.split(","))):
        key, _, value = item.partition("=")
        out[key] = float(value) if value else True
    return out


def _sequential_mean_square(h):
    acc = torch.zeros(h.shape[:-1], dtype=torch.float32)
    for j in range(h.shape[-1]):
        acc = acc + h[..., j].float() * h[..., j].float()
    return (acc / h.shape[-1]).unsqueeze(-1)


def _batch_norm(x, weight, eps, bias, f, running_mean, running_var):
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(work)
    mean, var = running_mean.to(work), running_var.to(work)
    if f.get("batch_stats"):
        mean, var = h.mean(0), h.var(0, unbiased=False)
    if f.get("swapped"):
        mean, var = var, mean
    if f.get("missing"):
        mean, var = torch.zeros_like(mean), torch.ones_like(var)
    y = (h - mean) / (torch.sqrt(var) + eps) if f.get("eps_outside") else (h - mean) * torch.rsqrt(var + eps)
    y = y * weight.to(work)
    if bias is not None:
        y = y + bias.to(work)
    return y.to(x.dtype)


def planted(x, weight, eps, bias=None, faults="", offset=0.0, kind="rms_norm", running_mean=None, running_var=None):
    f = _parse(faults)
    eps = f.get("eps", eps)
    if kind == "batch_norm":
        return _batch_norm(x, weight, eps, bias, f, running_mean, running_var)
    work = x.dtype if f.get("no_upcast") else (torch.float64 if x.dtype == torch.float64 and not f.get("fp32_seq")
                                                else torch.float32)
    h = x.to(work)
    centred = (kind == "layer_norm") != bool(f.get("mean"))
    if centred and f.get("one_pass"):
        m = h.float().mean(-1, keepdim=True)
        var = (h.float().pow(2).mean(-1, keepdim=True) - m * m).clamp_min(0)
        y = (h.float() - m) * torch.rsqrt(var + eps) * (offset + weight.float())
        return (y + (0 if bias is None else bias.float())).to(x.dtype)
    if centred:
        h = h - h.mean(-1, keepdim=True)
    if f.get("variance"):
        q = (h - h.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
    elif f.get("fp32_seq"):
        q = _sequential_mean_square(h)
    else:
        q = h.pow(2).mean(-1, keepdim=True)
    y = h / (torch.sqrt(q) + eps) if f.get("eps_outside") else h * torch.rsqrt(q + eps)
    gain_offset = offset
    if f.get("no_offset"):
        gain_offset = offset - 1.0
    if f.get("offset_twice") or f.get("add_one"):
        gain_offset = offset + 1.0
    g = (gain_offset + weight.to(y.dtype)) * f.get("scale", 1.0)
    if f.get("channels2"):
        g = g.clone()
        g[1:3] = g[1:3] * 1.5
    y = y * g
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def _act(name, z):
    return torch.nn.functional.silu(z) if name == "silu" else torch.sigmoid(z)


def planted_gated(x, z, weight, eps, groups=1, faults="", gate="before", activation="silu"):
    """A gated RMSNorm in float32 (one cast at the end), with faults (issue 26):
      eps=V, gate_moved (after where before, or the reverse), no_gate, sigmoid / silu (the other
      activation), groups=G (the statistic over G groups instead)"""
    f = _parse(faults)
    eps = f.get("eps", eps)
    groups = int(f.get("groups", groups))
    if f.get("gate_moved"):
        gate = "after" if gate == "before" else "before"
    if f.get("other_act"):
        activation = "sigmoid" if activation == "silu" else "silu"
    h = x.float()
    a = _act(activation, z.float())
    if gate == "before" and not f.get("no_gate"):
        h = h * a
    g = h.reshape(h.shape[0], groups, -1)
    y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(h.shape) * weight.float()
    if gate == "after" and not f.get("no_gate"):
        y = y * a
    return y.to(x.dtype)


def planted_group(x, weight, eps, bias=None, groups=1, faults=""):
    """A GroupNorm on (N, C, S) maps in float32, with faults (issue 26): eps=V, groups=G (another
    group count), eps_outside ((x - mean) / (std + eps) per group)"""
    f = _parse(faults)
    eps = f.get("eps", eps)
    groups = int(f.get("groups", groups))
    n, c, s = x.shape
    g = x.float().reshape(n, groups, -1)
    centred = g - g.mean(-1, keepdim=True)
    var = centred.pow(2).mean(-1, keepdim=True)
    h = centred / (var.sqrt() + eps) if f.get("eps_outside") else centred * torch.rsqrt(var + eps)
    y = h.reshape(n, c, s) * weight.float()[:, None]
    if bias is not None:
        y = y + bias.float()[:, None]
    return y.to(x.dtype)
