"""The `llama.cpp` built-in: llama.cpp's own ggml CPU kernels, the graph llama.cpp builds for every
norm (build_norm): `ggml_mul(ggml_rms_norm(x, eps), w)` for RMSNorm, `ggml_add(ggml_mul(ggml_norm(x,
eps), w), b)` for LayerNorm, computed with ggml_graph_compute_with_ctx; a GroupNorm as ggml's own
`ggml_group_norm(x, n_groups, eps)` on a [S, 1, C, N] tensor (it normalises each run of C/n_groups
channels of ne[2] over all their ne[0] * ne[1] positions; eps is its argument, a C float), then
`ggml_mul` and `ggml_add` by the gain and bias as [1, 1, C, 1] (stable-diffusion.cpp's
ggml_nn_group_norm); a gated RMSNorm as llama.cpp's models build it: Mamba2's (gate before the
statistic) `ggml_swiglu_split(z, x)` = silu(z) * x, reshaped to [C/groups, groups, N] for
ggml_rms_norm and the gain, Qwen3-Next's and Kimi Linear's (gate after) the grouped RMSNorm times
ggml_silu(z) or ggml_sigmoid(z). ggml has no BatchNorm op: refused.

The kernels come from a prebuilt llama.cpp: the xllamacpp wheel links ggml statically and exports
its symbols (`pip install --no-deps xllamacpp`, 34 MB; llama-cpp-python has no binary wheel and
builds llama.cpp from source). They are called through ctypes, the Python package never imported.

What ggml computes (measured on xllamacpp 2026.10.11549, bit for bit): activations in float32 (a
bfloat16 or float16 probe is upcast exactly, the result rounded back once: llama.cpp's F32
activations), each square in float32 summed in double, scale = 1 / sqrtf(mean + eps) in float32;
eps is a C float, as llama.cpp passes it (1e-6 is float32's 9.99999997e-07). Gemma's `1 + w` is what
a GGUF stores; here the effective gain is passed as llama.cpp's loader leaves it. An F16 input
aborts the process inside ggml (it asserts F32), which is why nothing but F32 is handed to it."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from parity_cli.backends import Runtime, distribution_version
from parity_cli.errors import InputError

NAME = "llama.cpp"
INSTALL = "pip install --no-deps xllamacpp (a prebuilt llama.cpp whose ggml symbols parity calls)"
RUNTIME = Runtime(
    "llama.cpp", "llama.cpp's ggml CPU kernels, the graph its build_norm makes (ggml_rms_norm or ggml_norm, ggml_mul, "
    "ggml_add) in F32 activations", package="xllamacpp", install=INSTALL, distributions=("xllamacpp",),
    needs="llama.cpp's ggml kernels", order=50)
KINDS = ("rms_norm", "layer_norm", "group_norm", "gated_rms_norm")
DTYPES = ("float32", "bfloat16", "float16")
_LIB: list = []


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def library() -> Path:
    try:
        spec = importlib.util.find_spec("xllamacpp")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"--candidate llama.cpp needs llama.cpp's ggml kernels: {INSTALL}")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("xllamacpp*.so"))
    if not found:
        raise InputError(f"--candidate llama.cpp: no ggml library in the installed xllamacpp; {INSTALL}")
    return found[0]


def version() -> str | None:
    return distribution_version("xllamacpp")


def computes_in(dtype: str, info: dict | None) -> str:
    """float32 whatever the probe's dtype: the kernel upcasts, and rounds back once at the end."""
    return "f32"


def describe(device: str = "cpu") -> dict:
    if device.startswith("cuda"):
        raise InputError("--candidate llama.cpp runs ggml's CPU kernels here; the CUDA backend is not loaded")
    return {"runtime": version(), "library": library().name, "backend": "ggml CPU",
            "kernel": "ggml_rms_norm then ggml_mul by the gain (ggml_norm, ggml_mul, ggml_add for LayerNorm): "
                      "llama.cpp's build_norm; ggml_group_norm, ggml_mul, ggml_add for GroupNorm; the gated "
                      "RMSNorm as llama.cpp's Mamba2 (ggml_swiglu_split) and Qwen3-Next graphs",
            "computes_in": "float32 activations (ggml upcasts; the probe's dtype is restored once at the end), "
                           "the mean square summed in double, eps as a C float"}


def check_layer(layer, dtype: str | None = None) -> None:
    if dtype == "float64":  # ggml's norm kernels take F32 activations; float64 would be rounded, not run
        raise InputError("--candidate llama.cpp: ggml computes float32 activations (bfloat16 and float16 probes "
                         "are upcast exactly), not float64")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--candidate llama.cpp: ggml computes float32 activations from {', '.join(DTYPES)} "
                         f"probes, not {dtype}")
    if layer.kind == "batch_norm":
        raise InputError(f"--candidate llama.cpp: ggml has no BatchNorm op (llama.cpp's models fold it into "
                         f"weights); {layer.name} is a batch_norm")
    if layer.kind not in KINDS:
        raise InputError(f"--candidate llama.cpp: llama.cpp builds {', '.join(KINDS)} with ggml ops; {layer.name} "
                         f"is a {layer.kind}")
    if layer.weight is not None and layer.weight.dim() > 1:
        raise InputError(f"--candidate llama.cpp: {layer.name} has a per-head gain; not built here")
    if layer.kind in ("group_norm", "gated_rms_norm") and (layer.groups < 1 or layer.dim % layer.groups):
        raise InputError(f"--candidate llama.cpp: {layer.name} has {layer.dim} channels in {layer.groups} groups; "
                         "ggml's grouping takes equal groups")


def _lib():
    if not _LIB:
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")  # an abort inside ggml must not start gdb
        lib = ctypes.CDLL(str(library()))
        void = ctypes.c_void_p
        for name, res, args in (
                ("ggml_init", void, [_InitParams]), ("ggml_free", None, [void]),
                ("ggml_new_tensor_1d", void, [void, ctypes.c_int, ctypes.c_int64]),
                ("ggml_new_tensor_2d", void, [void, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                ("ggml_new_tensor_4d", void, [void, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int64]),
                ("ggml_reshape_2d", void, [void, void, ctypes.c_int64, ctypes.c_int64]),
                ("ggml_reshape_3d", void, [void, void, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
                ("ggml_group_norm", void, [void, void, ctypes.c_int, ctypes.c_float]),
                ("ggml_swiglu_split", void, [void, void, void]),
                ("ggml_silu", void, [void, void]), ("ggml_sigmoid", void, [void, void]),
                ("ggml_get_data", void, [void]), ("ggml_nbytes", ctypes.c_size_t, [void]),
                ("ggml_rms_norm", void, [void, void, ctypes.c_float]), ("ggml_norm", void, [void, void, ctypes.c_float]),
                ("ggml_mul", void, [void, void, void]), ("ggml_add", void, [void, void, void]),
                ("ggml_new_graph", void, [void]), ("ggml_build_forward_expand", None, [void, void]),
                ("ggml_graph_compute_with_ctx", ctypes.c_int, [void, void, ctypes.c_int]),
                ("ggml_cpu_init", None, [])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        lib.ggml_cpu_init()
        _LIB.append(lib)
    return _LIB[0]


def _put(lib, ctx, array):
    """A float32 numpy array as a ggml F32 tensor of its shape (ggml's ne is numpy's shape reversed:
    ne[0] the fastest axis)."""
    import numpy as np

    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim > 2:
        ne = [*reversed(array.shape), 1, 1, 1][:4]
        t = lib.ggml_new_tensor_4d(ctx, 0, *ne)
    else:
        t = (lib.ggml_new_tensor_2d(ctx, 0, array.shape[-1], array.size // array.shape[-1]) if array.ndim == 2
             else lib.ggml_new_tensor_1d(ctx, 0, array.shape[0]))  # 0: GGML_TYPE_F32
    if not t or lib.ggml_nbytes(t) != array.nbytes:
        raise RuntimeError("ggml: a tensor could not be allocated")
    ctypes.memmove(lib.ggml_get_data(t), array.ctypes.data, array.nbytes)
    return t


def prepare(layer, weight, bias, eps: float):
    """x -> llama.cpp's norm graph on ggml's CPU backend, in float32, back in x's dtype."""
    import numpy as np
    import torch

    check_layer(layer)
    lib = _lib()
    gain = (weight.double() + layer.gain_offset).float().cpu().numpy()
    b = None if bias is None else bias.float().cpu().numpy()
    if layer.kind == "group_norm":  # per channel: [1, 1, C, 1], broadcast over positions and rows
        gain = gain.reshape(1, -1, 1, 1)
        b = None if b is None else b.reshape(1, -1, 1, 1)
    elif layer.kind == "gated_rms_norm":  # [C/groups, groups]: as llama.cpp's converter stores Mamba2's ssm_norm
        gain = gain.reshape(layer.groups, -1)

    def run(x):
        h = x.reshape(-1, x.shape[-1]).float().cpu().numpy()
        size = 4 * (h.size + gain.size + (0 if b is None else b.size)) * 6 + (16 << 20)
        ctx = lib.ggml_init(_InitParams(size, None, False))
        if not ctx:
            raise RuntimeError("ggml_init failed")
        try:
            tw = _put(lib, ctx, gain)
            if layer.kind == "layer_norm":
                y = lib.ggml_mul(ctx, lib.ggml_norm(ctx, _put(lib, ctx, h), eps), tw)
                if b is not None:
                    y = lib.ggml_add(ctx, y, _put(lib, ctx, b))
            elif layer.kind == "group_norm":  # rows (N, C*S), channel-major: ne [S, 1, C, N]
                tx = _put(lib, ctx, h.reshape(h.shape[0], layer.dim, 1, -1))
                y = lib.ggml_mul(ctx, lib.ggml_group_norm(ctx, tx, layer.groups, eps), tw)
                if b is not None:
                    y = lib.ggml_add(ctx, y, _put(lib, ctx, b))
            elif layer.kind == "gated_rms_norm":
                y = _gated(lib, ctx, layer, h, tw, eps)
            else:
                y = lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, _put(lib, ctx, h), eps), tw)
            graph = lib.ggml_new_graph(ctx)
            lib.ggml_build_forward_expand(graph, y)
            status = lib.ggml_graph_compute_with_ctx(ctx, graph, 1)
            if status != 0:
                raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")
            out = np.empty((h.shape[0], layer.dim if layer.kind == "gated_rms_norm" else h.shape[1]), np.float32)
            if lib.ggml_nbytes(y) != out.nbytes:
                raise RuntimeError("ggml: the norm's output is not the size of its input")
            ctypes.memmove(out.ctypes.data, lib.ggml_get_data(y), out.nbytes)
        finally:
            lib.ggml_free(ctx)
        return torch.from_numpy(out).to(dtype=x.dtype, device=x.device).reshape(*x.shape[:-1], out.shape[-1])

    return run


def _gated(lib, ctx, layer, h, tw, eps: float):
    """A gated RMSNorm's [x | z] rows as llama.cpp's graphs compute it, all in F32: the gate
    silu(z) * x first (Mamba2: ggml_swiglu_split(z, x)) or the normed value times act(z) last
    (Qwen3-Next: ggml_silu; Kimi Linear: ggml_sigmoid); the statistic over each group of
    C/groups values (ggml_rms_norm of a [C/groups, groups, N] reshape), the gain as [C/groups, groups]."""
    rows, dim, groups = h.shape[0], layer.dim, layer.groups
    tx, tz = _put(lib, ctx, h[:, :dim]), _put(lib, ctx, h[:, dim:])
    act = lib.ggml_silu if layer.activation == "silu" else lib.ggml_sigmoid
    if layer.gate == "before":
        tx = lib.ggml_swiglu_split(ctx, tz, tx) if layer.activation == "silu" else lib.ggml_mul(ctx, tx, act(ctx, tz))
    grouped = lib.ggml_reshape_3d(ctx, tx, dim // groups, groups, rows)
    y = lib.ggml_reshape_2d(ctx, lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, grouped, eps), tw), dim, rows)
    if layer.gate != "before":
        y = lib.ggml_mul(ctx, y, act(ctx, tz))
    return y
