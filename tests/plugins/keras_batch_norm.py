"""keras 3's own BatchNormalization (torch backend) wrapped as plugins for a batch_norm layer, the
way a user converting a PyTorch CNN would: real third-party code for tests/test_batch_norm.py."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402

if keras.backend.backend() != "torch":  # keras was imported earlier with another backend
    raise ImportError(f"keras runs on the {keras.backend.backend()} backend here, not torch")


def _run(layer, x, weight, bias, running_mean, running_var, training=False):
    layer.build((None, x.shape[-1]))
    bias = torch.zeros_like(weight) if bias is None else bias
    # keras' order: gamma, beta, moving_mean, moving_variance
    layer.set_weights([t.float().numpy() for t in (weight, bias, running_mean, running_var)])
    y = layer(x.float(), training=training)
    return torch.as_tensor(keras.ops.convert_to_numpy(y)).to(x.dtype)


def batch_norm_default(x, weight, eps, bias=None, running_mean=None, running_var=None):
    """BatchNormalization with keras' default epsilon (1e-3) instead of the checkpoint's."""
    return _run(keras.layers.BatchNormalization(axis=-1), x, weight, bias, running_mean, running_var)


def batch_norm(x, weight, eps, bias=None, running_mean=None, running_var=None):
    """Used right: the checkpoint's eps."""
    return _run(keras.layers.BatchNormalization(axis=-1, epsilon=eps), x, weight, bias, running_mean, running_var)


def batch_norm_training(x, weight, eps, bias=None, running_mean=None, running_var=None):
    """Called with training=True at inference: the batch's moments (keras computes the variance as
    E[x^2] - E[x]^2 in float32), not the moving statistics."""
    return _run(keras.layers.BatchNormalization(axis=-1, epsilon=eps), x, weight, bias, running_mean, running_var,
                training=True)
