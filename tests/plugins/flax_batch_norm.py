"""flax's own BatchNorm (linen, on jax's CPU) as a plugin for a batch_norm layer, called with
use_running_average=False at inference: the batch's moments, as a training-mode module computes
them (flax's fast variance E[x^2] - E[x]^2 in float32, clipped at 0, in XLA's summation order)."""

import jax.numpy as jnp
import numpy as np
import torch
from flax import linen as nn


def batch_statistics(x, weight, eps, bias=None, running_mean=None, running_var=None):
    module = nn.BatchNorm(use_running_average=False, epsilon=eps, momentum=0.9)
    bias = torch.zeros_like(weight) if bias is None else bias
    variables = {"params": {"scale": jnp.asarray(weight.float().numpy()), "bias": jnp.asarray(bias.float().numpy())},
                 "batch_stats": {"mean": jnp.asarray(running_mean.float().numpy()),
                                 "var": jnp.asarray(running_var.float().numpy())}}
    y, _ = module.apply(variables, jnp.asarray(x.float().numpy()), mutable=["batch_stats"])
    return torch.from_numpy(np.asarray(y).copy()).to(x.dtype)
