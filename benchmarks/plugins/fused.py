"""A plugin that is torch's own fused RMSNorm: the same math as the `torch` built-in, but as
user code it runs supervised, so timing it against the built-in measures isolation alone."""

import torch.nn.functional as F


def rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
