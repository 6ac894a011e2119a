"""The norm module a deployment hands to a runtime's public path (torch.export for ExecuTorch,
torch.compile): the model's own class, its tensors loaded as a checkpoint load fills them, wrapped
so that it takes parity's probe rows (N, width) and returns output rows.

Written from the layer alone, apart from parity's adapters (backends.implementations and what
the runtime adapters build from it): it is the other side of their differential test (issue 46).
The class is the one the family names (LlamaRMSNorm, Gemma3RMSNorm, nn.LayerNorm, BatchNorm2d,
nn.GroupNorm, Mamba2RMSNormGated); a layer that names none, or a class that cannot be built as
its kind is built, gets the plain torch module of its kind (nn.RMSNorm, nn.LayerNorm, nn.GroupNorm,
nn.BatchNorm1d) with the effective gain offset + w."""

from __future__ import annotations

import functools
import importlib
import inspect

from parity_cli.errors import InputError


def _family_class(layer):
    if not layer.hf_class:
        return None
    module, _, attr = layer.hf_class.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _parameters(cls) -> set:
    try:
        return set(list(inspect.signature(cls.__init__).parameters)[1:])
    except (TypeError, ValueError):
        return set()


def _fill(module, **tensors) -> None:
    import torch

    with torch.no_grad():
        for name, value in tensors.items():
            target = getattr(module, name, None)
            if value is not None and isinstance(target, torch.Tensor):
                target.copy_(value)


def norm_module(layer, weight, bias, eps: float):
    """A torch.nn.Module: probe rows (N, layer.width) -> output rows, at weight's dtype and device,
    in eval mode, its tensors its own parameters and buffers."""
    import torch

    cls, kind, dtype = _family_class(layer), layer.kind, weight.dtype
    offset = layer.gain_offset
    if kind == "batch_norm":
        if cls is None or not issubclass(cls, torch.nn.modules.batchnorm._BatchNorm):
            cls = torch.nn.BatchNorm1d
        inner = cls(layer.dim, eps=eps)
        _fill(inner, weight=weight + offset if offset else weight, bias=bias,
              running_mean=layer.running_mean, running_var=layer.running_var)
        spatial = 2 if issubclass(cls, torch.nn.BatchNorm2d) else 3 if issubclass(cls, torch.nn.BatchNorm3d) else 0
        shape = (lambda x: x.reshape(*x.shape, *([1] * spatial))) if spatial else None
        return _rows(inner.to(dtype=dtype, device=weight.device).eval(), shape)
    if kind == "group_norm":
        if cls is None or not issubclass(cls, torch.nn.GroupNorm):
            cls = torch.nn.GroupNorm
        inner = cls(layer.groups, layer.dim, eps=eps)
        _fill(inner, weight=weight + offset if offset else weight, bias=bias)
        return _rows(inner.to(dtype=dtype, device=weight.device).eval(),
                     lambda x: x.reshape(x.shape[0], layer.dim, -1))
    if kind == "gated_rms_norm":
        if cls is None:
            raise InputError(f"{layer.name}: a gated norm without a module class has no public module")
        params = _parameters(cls)
        kwargs = {"eps": eps}
        if "group_size" in params:
            kwargs["group_size"] = layer.dim // layer.groups
        if "n_groups" in params:
            kwargs["n_groups"] = layer.groups
        if "norm_before_gate" in params:
            kwargs["norm_before_gate"] = layer.gate == "after"
        inner = cls(layer.dim, **kwargs)
        _fill(inner, weight=weight)  # as stored: the class applies its own offset
        return _gated(inner.to(dtype=dtype, device=weight.device).eval(), layer.dim)
    size = tuple(layer.shape) if weight.dim() > 1 else layer.dim
    inner = plain = None
    params = _parameters(cls) if cls is not None else set()
    first = layer.layout == "channels_first"
    if "eps" in params and (not first or "data_format" in params):
        kwargs = {"data_format": "channels_first"} if first else {}  # ConvNeXt's, SAM's LayerNorm
        if cls is torch.nn.LayerNorm:
            kwargs["bias"] = bias is not None
        try:
            inner = cls(size, eps=eps, **kwargs)
        except TypeError:
            inner = None
    if inner is not None and isinstance(getattr(inner, "weight", None), torch.Tensor):
        baked = (layer.semantic_offset or 0.0) - offset  # a GGUF Gemma stores 1 + w; the class adds its 1
        _fill(inner, weight=weight - baked if baked else weight, bias=bias)
    else:  # the plain module of its kind, with the effective gain
        inner = plain = torch.nn.LayerNorm(size, eps=eps, bias=bias is not None) if kind == "layer_norm" \
            else torch.nn.RMSNorm(size, eps=eps)
        _fill(inner, weight=weight + offset if offset else weight, bias=bias)
    if first and inner is plain:  # a plain module normalises the last axis: the rows as they are
        first = False
    shape = (lambda x: x.reshape(*x.shape, 1, 1)) if first else None
    return _rows(inner.to(dtype=dtype, device=weight.device).eval(), shape)


@functools.cache
def _classes():
    """The wrappers, defined when torch is first needed (this module is imported without it)."""
    import torch

    class Rows(torch.nn.Module):
        """module(shape(x)) back as rows: a feature map's positions, a channels-first class's (N, C, 1, 1)."""

        def __init__(self, inner, shape=None):
            super().__init__()
            self.inner, self.shape = inner, shape

        def forward(self, x):
            y = self.inner(self.shape(x) if self.shape is not None else x)
            return y.reshape(x.shape[0], -1) if self.shape is not None else y

    class Gated(torch.nn.Module):
        """A probe row [x | z] -> module(x, gate=z)."""

        def __init__(self, inner, dim: int):
            super().__init__()
            self.inner, self.dim = inner, dim

        def forward(self, x2):
            return self.inner(x2[..., : self.dim], gate=x2[..., self.dim:])

    return Rows, Gated


def _rows(inner, shape=None):
    return _classes()[0](inner, shape)


def _gated(inner, dim: int):
    return _classes()[1](inner, dim)


def fingerprint(layer, weight, bias, eps: float) -> tuple:
    """What a public path's program depends on: the layer's form, the dtype, eps and the bytes of
    every tensor it holds. parity prepares a candidate afresh for each probe set (a fresh copy of
    the weight each time), so that a path that exports or compiles is built once per layer."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for t in (weight, bias, layer.running_mean, layer.running_var):
        if t is None:
            digest.update(b"-")
            continue
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{flat.dtype}{tuple(t.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return (layer.name, layer.kind, layer.order, layer.gain_offset, layer.semantic_offset, layer.hf_class, layer.dim,
            layer.groups, layer.spatial, layer.gate, layer.activation, layer.layout, str(weight.dtype),
            str(weight.device), float(eps), digest.hexdigest())


class Built:
    """A few built paths by fingerprint, the latest kept (parity asks for the same layer's path once
    per probe set, one layer after another)."""

    def __init__(self, size: int = 4):
        self.size, self.items = size, {}

    def get(self, key, build):
        if key not in self.items:
            self.items[key] = build()
            while len(self.items) > self.size:
                self.items.pop(next(iter(self.items)))
        return self.items[key]
