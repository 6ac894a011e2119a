"""torch.nn.BatchNorm2d used the way conversions get it wrong (and right), as plugins for a
batch_norm layer: the real module, fed each probe row as a 1 x 1 feature map. For
tests/test_batch_norm.py."""

import torch


def _module(x, weight, eps, bias, running_mean, running_var, statistics=True):
    module = torch.nn.BatchNorm2d(x.shape[-1], eps=eps).to(x.dtype)
    state = {"weight": weight, "bias": bias}
    if statistics:
        state.update(running_mean=running_mean, running_var=running_var)
    module.load_state_dict(state, strict=False)  # strict=False: what lets a forgotten buffer through
    return module


def _call(module, x):
    with torch.no_grad():
        return module(x[:, :, None, None]).reshape(x.shape)


def eval_mode(x, weight, eps, bias=None, running_mean=None, running_var=None):
    """Used right: everything loaded, eval mode."""
    return _call(_module(x, weight, eps, bias, running_mean, running_var).eval(), x)


def left_in_training_mode(x, weight, eps, bias=None, running_mean=None, running_var=None):
    """model.eval() forgotten: the batch's mean and variance, not the running statistics."""
    return _call(_module(x, weight, eps, bias, running_mean, running_var).train(), x)


def statistics_not_loaded(x, weight, eps, bias=None, running_mean=None, running_var=None):
    """Only the affine parameters loaded: a fresh module's running mean 0 and variance 1."""
    return _call(_module(x, weight, eps, bias, running_mean, running_var, statistics=False).eval(), x)
