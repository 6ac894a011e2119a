"""Two faults in one model, told apart by the row length: full-width norms get eps hard-coded
to 1e-5, the narrow per-head q/k norms (Gemma 3) lose the +1 of their 1 + w gain."""

import torch


def eps_wide_offset_narrow(x, weight, eps, wide=64):
    h = x.float()
    if x.shape[-1] >= wide:
        eps, gain = 1e-5, 1.0 + weight.float()
    else:
        gain = weight.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gain).to(x.dtype)
