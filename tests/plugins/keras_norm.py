"""keras 3's own LayerNormalization (torch backend) wrapped as plugins, the way a user would:
real third-party code for the diagnosis tests (issue 13)."""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402


def _run(layer, x, weights):
    layer.build((None, x.shape[-1]))
    layer.set_weights([w.float().numpy() for w in weights])
    return torch.as_tensor(keras.ops.convert_to_numpy(layer(x.float()))).to(x.dtype)


def layer_norm_default(x, weight, eps, bias=None):
    """LayerNormalization with keras' default epsilon (1e-3) instead of the checkpoint's."""
    bias = torch.zeros_like(weight) if bias is None else bias
    return _run(keras.layers.LayerNormalization(axis=-1), x, [weight, bias])


def layer_norm(x, weight, eps, bias=None):
    """Used right: the checkpoint's eps."""
    bias = torch.zeros_like(weight) if bias is None else bias
    return _run(keras.layers.LayerNormalization(axis=-1, epsilon=eps), x, [weight, bias])


def rms_scaling(x, weight, eps):
    """LayerNormalization(rms_scaling=True) used as an RMSNorm, with the checkpoint's eps."""
    return _run(keras.layers.LayerNormalization(axis=-1, epsilon=eps, rms_scaling=True), x, [weight])
