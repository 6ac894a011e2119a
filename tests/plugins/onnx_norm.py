"""ONNX Runtime's own RMSNormalization (opset 23) with its defaults, wrapped as a plugin the way
a user would: the candidate passes no epsilon (ONNX's default is 1e-5) and uses the weight it is
handed as the scale (no Gemma 1 + w). Real third-party code for the diagnosis tests."""

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

_SESSIONS = {}


def _session(dim: int, eps=None):
    if (dim, eps) not in _SESSIONS:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", dim])
        s = helper.make_tensor_value_info("scale", TensorProto.FLOAT, [dim])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", dim])
        attrs = {} if eps is None else {"epsilon": float(eps)}  # None: ONNX's default epsilon
        node = helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=-1, **attrs)
        model = helper.make_model(helper.make_graph([node], "rms", [x, s], [y]),
                                  opset_imports=[helper.make_opsetid("", 23)])
        model.ir_version = 10
        _SESSIONS[(dim, eps)] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return _SESSIONS[(dim, eps)]


def _run(x, scale, eps):
    out = _session(x.shape[-1], eps).run(None, {"x": x.float().numpy(), "scale": scale.float().numpy()})[0]
    return torch.from_numpy(np.ascontiguousarray(out)).to(x.dtype)


def rms_normalization_defaults(x, weight, eps):
    """As a user first writes it: no epsilon attribute, the weight as the scale."""
    return _run(x, weight, None)


def rms_normalization(x, weight, eps, offset=0.0):
    """Used right: the checkpoint's eps, and the family's gain (offset=1 for Gemma)."""
    return _run(x, weight.float() + offset, eps)
