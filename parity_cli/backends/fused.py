"""Fused residual add + norm kernels as candidates (issue 37): the kernel's own calling convention
adapted to rows [x | residual] -> [normed | new residual], which the supervised runners move like
any other rows (check.fused compares both halves with the oracle of the sum).

Built-ins: `torch` is the unfused composition as transformers writes it (`hidden = residual +
hidden` at the activation dtype, then the family's norm: the baseline), `vllm` is vLLM's own
`torch.ops._C.fused_add_rms_norm(x, residual, w, eps)`, in place, and `onnxruntime` is the contrib
op ORT's transformer optimiser fuses the pair into: `SkipSimplifiedLayerNormalization` (RMSNorm) or
`SkipLayerNormalization` (LayerNorm), its fourth output the sum, on the CPU provider. A plugin is a function
fn(x, residual, weight, eps) that returns (normed, new_residual) or writes both in place (x <- normed,
residual <- x + residual) and returns None."""

from __future__ import annotations

from parity_cli.errors import InputError

BUILTINS = ("torch", "vllm", "onnxruntime")


def adapt(kernel, weight, eps: float, **kwargs):
    """(x, residual) -> (normed, new_residual) for a kernel that returns the pair or works in place,
    called on copies: an in-place kernel writes into its own arguments (the gain included), never the
    caller's, and never the next call's."""

    def run(x, r):
        x, r = x.clone(), r.clone()
        out = kernel(x, r, weight.clone(), eps, **kwargs)
        if out is None:
            return x, r
        if isinstance(out, (tuple, list)) and len(out) == 2:
            return out[0], out[1]
        raise TypeError("a fused add + norm returns (normed, new_residual), or works in place and returns None; "
                        f"it returned {type(out).__name__}")

    return run


def adapt_quant(kernel, weight, eps: float, scale, **kwargs):
    """x -> (q, scale) for a norm + quantize kernel fn(x, weight, eps, scale=None): `scale` the static
    scale it is given (None: it computes its own per token and returns it)."""
    import torch

    def run(x):
        out = kernel(x.clone(), weight.clone(), eps, scale=scale, **kwargs)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("a norm + quantize kernel returns (q, scale)")
        q, s = out
        s = torch.as_tensor(s, dtype=torch.float64)
        if s.numel() not in (1, x.shape[0]):
            raise TypeError(f"a norm + quantize kernel's scale is one number or one per row, not {s.numel()}")
        return q, s.reshape(-1, 1).expand(x.shape[0], 1)

    return run


def on_rows_quant(quant, layer):
    """quant(x) -> (q, scale) as rows [q | scale] (q's integers as floats, exactly)."""
    import torch

    def run(x):
        q, s = quant(x.contiguous())
        return torch.cat([q.to(torch.float64).reshape(x.shape), s.to(torch.float64).reshape(-1, 1)], -1)

    return run


def _vllm_quant(layer, weight, eps: float, mode: str, scale):
    """vLLM's CPU path for RMSNorm + int8: its rms_norm kernel, then static_scaled_int8_quant or
    dynamic_scaled_int8_quant (the CPU wheel has no fused norm + quant kernel; its fp8 ops are empty)."""
    import torch

    from parity_cli.backends import vllm_kernels

    vllm_kernels.check_layer(layer)
    rms = vllm_kernels._load(str(weight.device))
    gain = weight.double() + layer.gain_offset if layer.gain_offset else weight

    def run(x):
        h = x.contiguous()
        y = torch.empty_like(h)
        rms(y, h, gain.to(h.dtype).contiguous(), float(eps))
        q = torch.empty(h.shape, dtype=torch.int8)
        if mode == "static":
            s = torch.tensor([scale], dtype=torch.float32)
            torch.ops._C.static_scaled_int8_quant(q, y, s, None)
        else:
            s = torch.empty(h.shape[0], 1, dtype=torch.float32)
            torch.ops._C.dynamic_scaled_int8_quant(q, y, s, None)
        return q, s.to(torch.float64).reshape(-1, 1).expand(h.shape[0], 1)

    return run


def on_rows(pair, layer):
    """pair(x, residual) as a function of rows [x | residual], returning [normed | new residual]."""
    import torch

    def run(x2):
        x, r = x2[..., :layer.dim], x2[..., layer.dim:]
        y, s = pair(x.contiguous(), r.contiguous())
        return torch.cat([y.reshape(x.shape), s.reshape(r.shape)], -1)

    return run


def _composed(layer, weight, bias, eps: float):
    """transformers' unfused block: the sum at the activation dtype, then the family's norm."""
    import torch.nn.functional as F

    gain = weight + layer.gain_offset if layer.gain_offset else weight

    def pair(x, r):
        s = x + r
        h = s.float()
        if layer.kind == "layer_norm":
            y = F.layer_norm(h, (layer.dim,), gain.float(), None if bias is None else bias.float(), eps)
        else:
            y = F.rms_norm(h, (layer.dim,), gain.float(), eps)
        return y.to(x.dtype), s

    return pair


def _vllm(layer, weight, eps: float):
    import torch

    from parity_cli.backends import vllm_kernels

    vllm_kernels.check_layer(layer)
    vllm_kernels._load(str(weight.device))
    kernel = torch.ops._C.fused_add_rms_norm
    gain = weight.double() + layer.gain_offset if layer.gain_offset else weight

    def in_place(x, r, w, e):
        kernel(x, r, w.to(x.dtype).contiguous(), float(e))

    return adapt(in_place, gain, eps)


def _onnxruntime(layer, weight, bias, eps: float):
    """ORT's Skip*LayerNormalization (com.microsoft) on one (x, skip) pair: outputs 0 (normed) and 3
    (input + skip), float32 or float16 as the CPU provider implements them."""
    import numpy as np
    import torch
    from onnx import TensorProto, helper

    from parity_cli.backends.onnx_runtime import _session

    if layer.fused_program:  # an exported graph's own Skip node: its gain, bias, eps and dtype as it holds them
        return _graph_pair(layer.fused_program, np, torch)
    types = {torch.float32: (TensorProto.FLOAT, np.float32), torch.float16: (TensorProto.FLOAT16, np.float16)}
    if weight.dtype not in types:
        raise InputError(f"--candidate onnxruntime: ORT's CPU Skip*LayerNormalization kernels take float32 and "
                         f"float16, not {str(weight.dtype).removeprefix('torch.')}")
    elem, npt = types[weight.dtype]
    simplified = layer.kind == "rms_norm"
    op = "SkipSimplifiedLayerNormalization" if simplified else "SkipLayerNormalization"
    gain = (weight.double() + layer.gain_offset).to(weight.dtype) if layer.gain_offset else weight
    names = ["x", "skip", "gamma"] + ([] if simplified or bias is None else ["beta"])
    inputs = [helper.make_tensor_value_info(n, elem, ["N", layer.dim]) for n in names[:2]]
    inputs += [helper.make_tensor_value_info(n, elem, [layer.dim]) for n in names[2:]]
    node = helper.make_node(op, names, ["y", "", "", "sum"], domain="com.microsoft", epsilon=float(eps))
    graph = helper.make_graph([node], "fused_add_norm", inputs,
                              [helper.make_tensor_value_info(n, elem, ["N", layer.dim]) for n in ("y", "sum")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = _session(model, "cpu")
    consts = {"gamma": gain.detach().cpu().numpy().astype(npt)}
    if "beta" in names:
        consts["beta"] = bias.detach().cpu().numpy().astype(npt)

    def pair(x, r):
        y, s = session.run(None, {"x": x.cpu().numpy().astype(npt), "skip": r.cpu().numpy().astype(npt), **consts})
        return torch.from_numpy(y), torch.from_numpy(s)

    return pair


def _graph_pair(program: bytes, np, torch):
    import onnx

    from parity_cli.backends.onnx_runtime import _session

    session = _session(onnx.load_from_string(program), "cpu")
    npt = {"tensor(float)": np.float32, "tensor(float16)": np.float16}.get(session.get_inputs()[0].type, np.float32)

    def pair(x, r):
        y, s = session.run(None, {"x": x.cpu().float().numpy().astype(npt), "skip": r.cpu().float().numpy().astype(npt)})
        return torch.from_numpy(y.astype(np.float32)).to(x.dtype), torch.from_numpy(s.astype(np.float32)).to(x.dtype)

    return pair


def builtin(name: str, layer, weight, bias, eps: float):
    if layer.fused == "quant":
        mode, scale = layer.quant
        if name == "vllm" and layer.kind == "rms_norm":
            return on_rows_quant(_vllm_quant(layer, weight, eps, mode, scale), layer)
        raise InputError(f"--quant: the built-in '{name}' has no norm + int8 quantize here; built-in: vllm "
                         "(RMSNorm), or a plugin fn(x, weight, eps, scale=None) -> (q, scale)")
    if layer.kind not in ("rms_norm", "layer_norm") or weight.dim() > 1:
        raise InputError(f"--fused add: {layer.name} is a {layer.kind}{' with per-head gains' if weight.dim() > 1 else ''}; "
                         "a fused residual add + norm is checked on RMSNorm and LayerNorm layers")
    if name in ("torch", "hf", "oracle"):
        return on_rows(_composed(layer, weight, bias, eps), layer)
    if name == "vllm":
        return on_rows(_vllm(layer, weight, eps), layer)
    if name == "onnxruntime":
        return on_rows(_onnxruntime(layer, weight, bias, eps), layer)
    raise InputError(f"--fused add: the built-in '{name}' has no fused add + norm here; built-ins: "
                     f"{', '.join(BUILTINS)}, or a plugin fn(x, residual, weight, eps)")
