"""Stratified norm parity as one assertion in a kernel library's own tests.

`assert_norm_parity(candidate, family=..., hidden_size=..., eps=..., dtype=...)` builds one norm
layer with the family's semantics (or reads one from a checkpoint), runs the stratified probes
through the float64 oracle and the candidate, and raises AssertionError with the CLI's grouped
finding when they disagree. `check_norm` is its twin that returns the result instead of raising.

The work is the library's own: the layer check of parity_cli.check.layer, the probes of
parity_cli.probes.strata, the candidate conventions of parity_cli.backends.implementations, the
diagnosis and the grouping of the report. Nothing here re-implements the math. Torch is imported
when a check runs, never at import: the pytest plugin imports this module in every session.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from parity_cli.check.results import LayerResult
    from parity_cli.model.families import Family

    Candidate = Callable[..., torch.Tensor] | torch.nn.Module | type[torch.nn.Module]
    DType = str | torch.dtype
    Weight = str | torch.Tensor | None

__all__ = ["FusedParityResult", "NormCase", "NormParityResult", "assert_norm_parity", "check_norm", "norm_cases",
           "DEFAULT_FAMILIES", "DEFAULT_DTYPES", "PER_HEAD_FAMILIES"]

DTYPE_NAMES = {"float16": "float16", "fp16": "float16", "half": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float32": "float32", "fp32": "float32", "float": "float32",
               "float64": "float64", "fp64": "float64", "double": "float64"}
# what norm_cases() covers by default: Llama order, Gemma's 1 + w, OLMo 2's cast-last gain, Cohere's
# per-head LayerNorm, T5's cast to the weight dtype and nn.LayerNorm with bias
DEFAULT_FAMILIES = ("llama", "gemma", "olmo2", "cohere", "t5", "layer_norm")
DEFAULT_DTYPES = ("bfloat16", "float16", "float32")
# families whose cases are per-head norms (a (heads, head_dim) gain): Cohere's q/k norms
PER_HEAD_FAMILIES = {"cohere": 128}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
_NO_BIAS = object()


# --- the result ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, repr=False)
class NormParityResult:
    """One layer's parity: truthy when it holds. `to_dict()` is the CLI's JSON report of that
    layer (schema parity_cli/schema/report.schema.json); `message` the finding as the CLI says it."""

    layer: LayerResult  # the library's per-layer result (parity_cli.check.results.LayerResult)
    message: str
    _report: dict = field(repr=False)

    @property
    def status(self) -> str:
        """pass, fail or error (a gradient the candidate could not compute)."""
        return self.layer.status

    @property
    def passed(self) -> bool:
        return self.layer.status == "pass"

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failing_strata(self) -> list[str]:
        return [s.name for s in self.layer.strata + self.layer.grad if s.status != "pass"]

    @property
    def diagnoses(self) -> list[dict]:
        """Each diagnosis as the report writes it: code, message and its evidence (estimated_eps, ...)."""
        return [dict(d) for d in self._report["layers"][0]["diagnoses"]]

    @property
    def worst_ratio(self) -> float:
        """The largest |cand - ref| / allowed over every stratum (<= 1 passes)."""
        from parity_cli.report.grouping import times_allowed

        ratios = [times_allowed(s["worst"]) for s in self._report["layers"][0]["strata"] if s.get("worst")]
        return max(ratios, default=0.0)

    def to_dict(self) -> dict:
        """The JSON report of this one layer (a fresh copy: json.dumps takes it as it is)."""
        import copy

        return copy.deepcopy(self._report)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        t = self._report["testing"]
        what = (f"{t['family']} {t['kind']} hidden={t['hidden_size']}" + (f" heads={t['heads']}" if t["heads"] else "")
                + f" eps={t['eps']:g} {t['dtype']} {t['device']}")
        if self.passed:
            strata = self._report["probes"]["strata"]
            return (f"NormParityResult(PASS, {what}: {len(strata)} strata, worst {self.worst_ratio:.3g}x allowed)")
        finding = self.message.splitlines()[0].removeprefix("FAIL: ")
        return f"NormParityResult({self.status.upper()}, {what}: {finding})"


# --- the public functions -------------------------------------------------------------------------


def assert_norm_parity(candidate: Candidate, *, family: str | Family | None = None, hidden_size: int | None = None,
                       eps: float | None = None, dtype: DType | None = None, device: str = "cpu",
                       weight: Weight = None, bias: Any = "auto", heads: int | None = None,
                       strata: Sequence[str] | str | None = None, atol: float | None = None,
                       rtol: float | None = None, grad: bool = False, seed: int = 0,
                       checkpoint: str | Path | None = None, layer: str | None = None,
                       fused: str | None = None, scale: str | float = "static") -> NormParityResult:
    """Checks `candidate` against the float64 oracle of the family's norm on stratified probes;
    raises AssertionError with the finding (stratum, worst element, q/eps, diagnosis) when parity
    fails, and returns the NormParityResult when it holds.

    candidate: a function ``fn(x, weight, eps)`` (plus ``bias=`` for LayerNorm families) returning
        the output, a torch.nn.Module subclass (built as ``cls(hidden_size, eps=eps)``, its weight
        filled with the stored weight) or a module instance (copied, moved to `device` and `dtype`,
        its weight filled; its own eps is what is checked). x is (rows, hidden_size), or (rows,
        heads, hidden_size) for a per-head norm; weight and x arrive at `dtype` on `device`.
    family: a family name (llama, gemma, olmo2, cohere, t5, layer_norm, gemma3n, ...), a model_type
        one claims (qwen3, mistral, bert, ...) or a Family object: what the reference computes,
        including the gain (Gemma's 1 + w of a stored w) and the numerics order its diagnosis
        compares with. Default: llama (the checkpoint's own with checkpoint=).
    hidden_size, eps: the norm's size and the model's eps (the config's, not a kernel default).
    dtype: the candidate's input and weight dtype (float16, bfloat16, float32, float64).
    weight: None (a module instance's own weight; otherwise the family's initial value, gain 1),
        "random" (a trained-looking gain from `seed`, effective gain in [0.5, 1.5]) or a tensor of
        the stored weight, shape (hidden_size,) or (heads, hidden_size).
    bias: LayerNorm only: "auto" (a random bias for nn.LayerNorm families, none otherwise),
        None, "random" or a tensor.
    heads: a per-head norm (Cohere's q/k norms): the gain is (heads, hidden_size).
    strata: probe strata (default: zero, tiny, normal, constant, mixed, large, outlier; "extreme"
        is opt-in), as a list or a comma-separated string.
    atol, rtol: replace the dtype's tolerance profile (configs/tolerances.toml).
    grad: also compare dx and dweight by autograd against the float64 reference's.
    checkpoint, layer: read the layer from a checkpoint instead (its eps, weight and stored dtype;
        `family`, `eps` and `dtype` given explicitly override them).
    fused: "add": `candidate` is a fused residual add + norm, ``fn(x, residual, weight, eps)``
        returning (normed, new_residual) or writing both in place (vLLM's: x <- normed, residual
        <- x + residual); both outputs are checked against the float64 oracle of the sum, on
        strata of the sum (parity_cli.check.fused). Returns a FusedParityResult.
        "quant": `candidate` is a norm + int8 quantize, ``fn(x, weight, eps, scale=None)`` (plus
        ``bias=`` for LayerNorm families) returning (q, scale); compared after dequantizing, half a quantization step allowed, saturation
        counted apart, and the rounding mode, wrap-around and the scale's placement diagnosed.
    scale: fused="quant" only: "static" (a scale calibrated on the normal stratum, given to the
        kernel), "dynamic" (the kernel's own per token, scale=None) or a number (that static scale).

    Bad input (an unknown family or stratum, a candidate that is not callable, that returns a
    wrong shape or no tensor, a device or dtype that is not there) raises one TypeError or
    ValueError naming the argument. An exception the candidate raises propagates as itself."""
    __tracebackhide__ = True
    if fused is not None:
        result = _check_fused(candidate, fused, family=family, hidden_size=hidden_size, eps=eps, dtype=dtype,
                              device=device, weight=weight, bias=bias, atol=atol, rtol=rtol, seed=seed, scale=scale)
    else:
        result = _check(candidate, family=family, hidden_size=hidden_size, eps=eps, dtype=dtype, device=device,
                        weight=weight, bias=bias, heads=heads, strata=strata, atol=atol, rtol=rtol, grad=grad,
                        seed=seed, checkpoint=checkpoint, layer=layer)
    if not result.passed:
        raise AssertionError(result.message)
    return result


def check_norm(candidate: Candidate, *, family: str | Family | None = None, hidden_size: int | None = None,
               eps: float | None = None, dtype: DType | None = None, device: str = "cpu", weight: Weight = None,
               bias: Any = "auto", heads: int | None = None, strata: Sequence[str] | str | None = None,
               atol: float | None = None, rtol: float | None = None, grad: bool = False, seed: int = 0,
               checkpoint: str | Path | None = None, layer: str | None = None,
               fused: str | None = None, scale: str | float = "static") -> NormParityResult:
    """assert_norm_parity without the assertion: the NormParityResult, pass or fail (for notebooks:
    `bool(result)`, `result.to_dict()`, `print(result)`). Bad input raises as there."""
    __tracebackhide__ = True
    if fused is not None:
        return _check_fused(candidate, fused, family=family, hidden_size=hidden_size, eps=eps, dtype=dtype,
                            device=device, weight=weight, bias=bias, atol=atol, rtol=rtol, seed=seed, scale=scale)
    return _check(candidate, family=family, hidden_size=hidden_size, eps=eps, dtype=dtype, device=device,
                  weight=weight, bias=bias, heads=heads, strata=strata, atol=atol, rtol=rtol, grad=grad,
                  seed=seed, checkpoint=checkpoint, layer=layer)


# --- cases for pytest's parametrize ---------------------------------------------------------------


@dataclass(frozen=True)
class NormCase:
    """One (family, dtype, size) a kernel is checked at: `case.kwargs()` are assert_norm_parity's
    keyword arguments, `case.id` the test id (llama-bf16-h4096)."""

    family: str
    dtype: str
    hidden_size: int
    eps: float
    heads: int | None = None
    weight: str | None = "random"

    @property
    def id(self) -> str:
        heads = f"-{self.heads}x{self.hidden_size}" if self.heads else f"-h{self.hidden_size}"
        return f"{self.family}-{_SHORT.get(self.dtype, self.dtype)}{heads}"

    def kwargs(self) -> dict:
        return {"family": self.family, "dtype": self.dtype, "hidden_size": self.hidden_size, "eps": self.eps,
                "heads": self.heads, "weight": self.weight}


def norm_cases(families: Sequence[str] = DEFAULT_FAMILIES, dtypes: Sequence[str] = DEFAULT_DTYPES,
               hidden_sizes: Sequence[int] = (4096,), eps: float | None = None, weight: str | None = "random",
               per_head: dict | None = None) -> list:
    """pytest.param(NormCase) for every family x dtype x hidden size, for
    ``@pytest.mark.parametrize("case", norm_cases())``: the `norm_parity` fixture reads the case.

    eps: None gives each family its config default (llama 1e-6, gemma 1e-6, olmo2 1e-5, cohere
    1e-5, t5 1e-6, layer_norm 1e-5). per_head: family -> head_dim of its per-head cases (default
    PER_HEAD_FAMILIES: cohere's q/k norms, hidden_size // 128 heads of 128). `pytest
    --parity-dtypes=bfloat16` deselects the other dtypes' cases."""
    import pytest

    per_head = PER_HEAD_FAMILIES if per_head is None else per_head
    out = []
    for name in families:
        fam = _family(name)
        for size in hidden_sizes:
            size = _positive_int(size, "hidden_sizes")
            head_dim = per_head.get(name)
            heads = None
            if head_dim and size % head_dim == 0 and size // head_dim > 1:
                heads, size = size // head_dim, head_dim
            for dt in dtypes:
                case = NormCase(family=name, dtype=_dtype_name(dt), hidden_size=size,
                                eps=fam.eps_default_for(name) if eps is None else _eps(eps), heads=heads,
                                weight=weight)
                out.append(pytest.param(case, id=case.id))
    return out


# --- arguments ---------------------------------------------------------------------------------------


def _family(family) -> Family:
    from parity_cli.errors import InputError
    from parity_cli.model.families import Family, find_family, known_families

    if isinstance(family, Family):
        return family
    if not isinstance(family, str):
        raise TypeError(f"family: expected a family name, a model_type or a Family, got {type(family).__name__}")
    try:
        found = find_family(family)
    except InputError as exc:  # a broken family file: still the argument's family
        raise ValueError(f"family: {exc}") from None
    if found is None:
        raise ValueError(f"family: unknown family '{family}' (neither a family nor a model_type one claims); "
                         f"known families: {known_families()}")
    return found


def _dtype_name(dtype) -> str:
    text = str(dtype).removeprefix("torch.") if dtype is not None else ""
    name = DTYPE_NAMES.get(text.lower())
    if name is None:
        raise ValueError(f"dtype: {dtype!r} is not a dtype the check runs at; use float16, bfloat16, float32 or "
                         "float64 (a torch.dtype or its name)")
    return name


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def _eps(value, name: str = "eps") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ValueError(f"{name}: expected a finite number >= 0 (the model's eps), got {value!r}")
    return float(value)


def _tolerance(value, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _strata(strata) -> list:
    from parity_cli.errors import InputError
    from parity_cli.probes.strata import select_strata

    if strata is None:
        names = None
    elif isinstance(strata, str):
        names = [s.strip() for s in strata.split(",") if s.strip()]
    elif isinstance(strata, (list, tuple)) and all(isinstance(s, str) for s in strata):
        names = list(strata)
    else:
        raise TypeError(f"strata: expected a list of stratum names or a comma-separated string, got {strata!r}")
    try:
        return select_strata(names)
    except InputError as exc:
        raise ValueError(str(exc).replace("--strata: ", "strata: ")) from None


def _device(device, dtype):
    """(the device's name, the torch dtype), refusing a device that is not there and a dtype it
    cannot compute in."""
    import torch

    from parity_cli.errors import InputError
    from parity_cli.options import check_device

    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {type(device).__name__}")
    try:
        name = check_device(str(device))
    except InputError as exc:
        raise ValueError(str(exc).replace("--device", "device", 1)) from None
    dt = getattr(torch, dtype)
    if name.startswith("cuda") and dt == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(f"dtype: bfloat16 has no kernels on {name} ({torch.cuda.get_device_name(name)}); "
                         "use float16 or float32 there")
    try:
        probe = torch.ones(4, dtype=dt, device=name)
        (probe * torch.rsqrt((probe * probe).mean())).sum().item()
    except Exception as exc:  # a backend without this dtype
        raise ValueError(f"dtype: {dtype} is not supported on {name}: {type(exc).__name__}: {exc}") from None
    return name, dt


def _spec(candidate) -> str:
    """How messages name the candidate."""
    import functools
    import inspect

    if isinstance(candidate, functools.partial):
        args = [repr(a) for a in candidate.args] + [f"{k}={v!r}" for k, v in candidate.keywords.items()]
        return f"partial({_spec(candidate.func)}{''.join(', ' + a for a in args)})"
    if inspect.isclass(candidate):
        return f"{candidate.__module__}.{candidate.__qualname__}"
    name = getattr(candidate, "__qualname__", None)
    if name is not None:
        return f"{getattr(candidate, '__module__', None) or '?'}.{name}"
    return f"{type(candidate).__qualname__} instance"


def _tensor_arg(value, shape: tuple, name: str, what: str):
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected None, 'random' or a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name}: a {what} is a floating-point tensor, got {str(value.dtype).removeprefix('torch.')}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: shape {list(value.shape)} where the layer's is {list(shape)} "
                         "(hidden_size, or heads x hidden_size)")
    return value.detach().to("cpu", copy=True)


def _random(shape: tuple, seed: int, what: str, low: float, high: float):
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{what}:{shape}".encode()))
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float64)


def _has_bias(sem) -> bool:
    """nn.LayerNorm and its kin store a bias; Cohere's LayerNorm and every RMSNorm do not."""
    return sem.kind == "layer_norm" and sem.order in ("native", "native_fp32")


# --- the check ---------------------------------------------------------------------------------------


@dataclass
class _Setup:
    layer: Any  # NormLayer
    family: Any  # Family
    dtype: str
    strata: list
    module: Any = None  # the candidate's module instance, when it is one
    weight_source: str = "init"
    checkpoint: dict | None = None  # the report's checkpoint block, for a layer read from one
    family_from: str | None = None  # how the family was named, where not by its name


def _layer_from_family(candidate, fam, hidden_size, eps, dtype, weight, bias, heads, seed) -> _Setup:
    import torch

    from parity_cli.model.layers import NormLayer
    from parity_cli.sources.tensors import Eps

    sem = fam.semantics
    if sem.kind not in ("rms_norm", "layer_norm"):
        raise ValueError(f"family: '{fam.name}' is a {sem.kind}; assert_norm_parity builds RMSNorm and LayerNorm "
                         "layers from a family (check this one from a checkpoint: checkpoint=..., layer=...)")
    if hidden_size is None:
        raise TypeError("hidden_size: required (the size the norm runs over), unless checkpoint= is given")
    if eps is None:
        raise TypeError("eps: required (the model's eps, from its config), unless checkpoint= is given")
    if dtype is None:
        raise TypeError("dtype: required (the candidate's input dtype), unless checkpoint= is given")
    hidden_size = _positive_int(hidden_size, "hidden_size")
    eps = _eps(eps)
    if heads is not None:
        heads = _positive_int(heads, "heads")
    module = candidate if isinstance(candidate, torch.nn.Module) else None
    own = getattr(module, "weight", None) if module is not None else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and heads is None:
        heads = int(weight.shape[0])
    if isinstance(own, torch.Tensor) and own.dim() == 2 and heads is None and weight is None:
        heads = int(own.shape[0])
    shape = (heads, hidden_size) if heads else (hidden_size,)
    offset = float(sem.gain_offset)
    source = "init"
    if weight is None and isinstance(own, torch.Tensor):
        if tuple(own.shape) != shape:
            raise ValueError(f"candidate: its weight has shape {list(own.shape)} where the layer's is {list(shape)} "
                             f"(hidden_size={hidden_size}{f', heads={heads}' if heads else ''})")
        w, source = own.detach().to("cpu", torch.float32, copy=True), "the module's own"
    elif weight is None:
        w = torch.full(shape, 1.0 - offset, dtype=torch.float32)  # the family's init: a gain of 1
    elif isinstance(weight, str):
        if weight != "random":
            raise ValueError(f"weight: expected None, 'random' or a tensor, got {weight!r}")
        w, source = (_random(shape, seed, "weight", 0.5, 1.5) - offset).to(torch.float32), "random"
    else:
        w, source = _tensor_arg(weight, shape, "weight", "weight"), "given"
    b = None
    if sem.kind == "layer_norm":
        own_bias = getattr(module, "bias", None) if module is not None else None
        if isinstance(bias, str) and bias == "auto":
            if isinstance(own_bias, torch.Tensor) and tuple(own_bias.shape) == shape:
                b = own_bias.detach().to("cpu", torch.float32, copy=True)
            elif _has_bias(sem):
                b = _random(shape, seed, "bias", -0.5, 0.5).to(torch.float32)
        elif isinstance(bias, str) and bias == "random":
            b = _random(shape, seed, "bias", -0.5, 0.5).to(torch.float32)
        elif bias is not None and not isinstance(bias, str):
            b = _tensor_arg(bias, shape, "bias", "bias")
        elif bias is not None:
            raise ValueError(f"bias: expected 'auto', None, 'random' or a tensor, got {bias!r}")
    elif bias is not None and not (isinstance(bias, str) and bias == "auto"):
        raise ValueError(f"bias: family '{fam.name}' is an RMSNorm, which has no bias")
    name = f"{fam.name}:{sem.kind}[{'x'.join(str(s) for s in shape)}]"
    layer = NormLayer(name=name, kind=sem.kind, dim=hidden_size, order=sem.order, gain_offset=offset,
                      eps=Eps(eps, "argument:eps"), weight=w, bias=b, family=fam.name,
                      inverse_sqrt=sem.inverse_sqrt, hf_class=sem.hf_class, tensor=name, semantic_offset=offset)
    return _Setup(layer=layer, family=fam, dtype=_dtype_name(dtype), strata=[], module=module,
                  weight_source=source)


def _layer_from_checkpoint(candidate, checkpoint, name, family, eps, dtype, hidden_size, weight, heads) -> _Setup:
    import torch

    from parity_cli.errors import InputError
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load

    if not isinstance(name, str) or not name:
        raise TypeError("layer: the name of a norm layer of the checkpoint (model.layers.0.input_layernorm)")
    for arg, value in (("hidden_size", hidden_size), ("weight", weight), ("heads", heads)):
        if value is not None:
            raise ValueError(f"{arg}: the checkpoint's layer has its own; leave {arg} out with checkpoint=")
    fam_name = None if family is None else (family if isinstance(family, str) else _family(family).name)
    try:
        ckpt, fam, resolved = load(checkpoint, fam_name, None if eps is None else _eps(eps))
        found = [l for l in discover_layers(ckpt, fam, resolved).layers if l.name == name]
    except InputError as exc:
        raise ValueError(f"checkpoint: {exc}") from None
    if not found:
        raise ValueError(f"layer: {checkpoint} has no norm layer named '{name}'")
    layer = found[0]
    if layer.kind not in ("rms_norm", "layer_norm"):
        raise ValueError(f"layer: '{name}' is a {layer.kind}; assert_norm_parity checks RMSNorm and LayerNorm layers")
    module = candidate if isinstance(candidate, torch.nn.Module) else None
    dt = _dtype_name(dtype if dtype is not None else layer.stored_dtype)
    from parity_cli.model.families import family_choice
    from parity_cli.report.replay import recorded_path

    described = {"path": recorded_path(ckpt.path), "format": ckpt.format, "family": fam.name,
                 "family_source": fam.source_line,
                 "family_forced": fam_name is not None,
                 "family_from": family_choice(fam_name, fam, ckpt.model_type, ckpt.format,
                                             getattr(ckpt, "architecture", None)),
                 "model_type": ckpt.model_type, "files": [f.name for f in ckpt.files], "unmatched": []}
    return _Setup(layer=layer, family=fam, dtype=dt, strata=[], module=module, weight_source="checkpoint",
                  checkpoint=described)


def _implementation(candidate, spec: str, setup: _Setup):
    import inspect

    import torch

    from parity_cli.backends.implementations import Implementation, from_object

    if setup.module is not None:
        return _instance(candidate, spec, setup)
    if inspect.isclass(candidate) and not issubclass(candidate, torch.nn.Module):
        raise TypeError(f"candidate: {spec} is a class but not a torch.nn.Module subclass; pass a function "
                        "fn(x, weight, eps), a torch.nn.Module subclass or a module instance")
    if isinstance(candidate, Implementation) or not callable(candidate):
        raise TypeError(f"candidate: {candidate!r} is not callable; pass a function fn(x, weight, eps), "
                        "a torch.nn.Module subclass or a module instance")
    return from_object(spec, candidate)


def _instance(module, spec: str, setup: _Setup):
    """A module instance as an implementation: a deep copy, moved to the side's device and dtype,
    its weight (and bias) filled with the stored ones for every call; its eps is its own."""
    import copy

    import torch

    from parity_cli.backends.implementations import Implementation

    try:
        own = copy.deepcopy(module)
    except Exception as exc:
        raise TypeError(f"candidate: cannot copy the module instance ({type(exc).__name__}: {exc}); pass its "
                        "class, or a function fn(x, weight, eps) that calls it") from None
    target = getattr(own, "weight", None)
    if not isinstance(target, torch.Tensor) and setup.weight_source not in ("init",):
        raise TypeError(f"candidate: {spec} has no weight tensor to fill with weight={setup.weight_source}")
    if isinstance(target, torch.Tensor) and tuple(target.shape) != tuple(setup.layer.shape):
        raise ValueError(f"candidate: its weight has shape {list(target.shape)} where the layer's is "
                         f"{list(setup.layer.shape)}")

    def prepare(layer, weight, bias, eps):
        m = own.to(device=weight.device, dtype=weight.dtype).eval()
        with torch.no_grad():
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor):
                w.copy_(weight)  # as stored: a Gemma module adds its own 1
            b = getattr(m, "bias", None)
            if bias is not None and isinstance(b, torch.Tensor):
                b.copy_(bias)
        m.zero_grad(set_to_none=True)  # --grad reads its weight's gradient afresh every call
        return m

    return Implementation(spec, f"module instance {type(module).__module__}.{type(module).__qualname__}", prepare)


class _Runner:
    """The candidate runs here, in the caller's process (it is the caller's own object), on copies
    of the probes; on a GPU the probe batch goes to the device once per probe set (the rows of each
    stratum are views of that one copy), and each call gets its own device-side copy."""

    isolated = False

    def __init__(self, impl):
        self.impl = impl
        self._job = None

    def submit(self, job) -> None:
        self._job = job

    def collect(self):
        from parity_cli.isolation.runners import CandidateRun, collect, execute

        job = self._job
        if job.device != "cpu":
            job.inputs = [_on_device(x, job.device) for x in job.inputs]
        return collect(execute(self.impl, job, copy_inputs=True), CandidateRun())

    def run(self, job):
        self.submit(job)
        return self.collect()

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


_DEVICE_COPIES: dict = {}  # id(base tensor) -> (weakref to it, its copy on the device)


def _on_device(x, device: str):
    """x on `device`, through one transfer of the batch x is a view of (kept while that batch lives)."""
    import weakref

    base = x._base if x._base is not None else x
    if not base.is_contiguous():
        return x.to(device)
    key = (id(base), device)
    entry = _DEVICE_COPIES.get(key)
    if entry is None or entry[0]() is not base:
        copy = base.to(device, copy=True)  # never the batch itself: the entry must not keep it alive
        _DEVICE_COPIES[key] = (weakref.ref(base, lambda _, k=key: _DEVICE_COPIES.pop(k, None)), copy)
    else:
        copy = entry[1]
    return copy.as_strided(x.size(), x.stride(), x.storage_offset() - base.storage_offset())


def _check(candidate, *, family, hidden_size, eps, dtype, device, weight, bias, heads, strata, atol, rtol, grad,
           seed, checkpoint, layer) -> NormParityResult:
    __tracebackhide__ = True
    import torch

    from parity_cli.check.layer import Side, check_layer
    from parity_cli.comparison import grad_tolerance_for, tolerance_for
    from parity_cli.options import CheckOptions, reference_device

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an integer, got {seed!r}")
    if not isinstance(grad, bool):
        raise TypeError(f"grad: expected True or False, got {grad!r}")
    if not callable(candidate):
        raise TypeError(f"candidate: {candidate!r} is not callable; pass a function fn(x, weight, eps), "
                        "a torch.nn.Module subclass or a module instance")
    if checkpoint is not None or layer is not None:
        if checkpoint is None:
            raise TypeError("checkpoint: layer= names a layer of a checkpoint; give its path as checkpoint=")
        setup = _layer_from_checkpoint(candidate, checkpoint, layer, family, eps, dtype, hidden_size, weight, heads)
    else:
        given = "llama" if family is None else family
        setup = _layer_from_family(candidate, _family(given), hidden_size, eps, dtype, weight, bias, heads, seed)
        if isinstance(given, str) and given != setup.family.name:
            setup.family_from = f"family={given!r}: a model type of {setup.family.name}"
    setup.strata = _strata(strata)
    atol, rtol = _tolerance(atol, "atol"), _tolerance(rtol, "rtol")
    dev, dt = _device(device, setup.dtype)
    spec = _spec(candidate)
    impl = _implementation(candidate, spec, setup)

    tol = tolerance_for(setup.dtype, atol, rtol)
    grad_tol = grad_tolerance_for(setup.dtype) if grad else None
    opts = CheckOptions(seed=seed, grad=grad, dtype=setup.dtype, device=dev)
    ref_device = reference_device("auto", dev, True)
    from parity_cli.backends.implementations import BUILTINS

    reference = Side(BUILTINS["oracle"], "oracle", torch.float64, ref_device)
    runner = _Runner(impl)
    cand_side = Side(impl, spec, dt, dev, None, runner)
    result = check_layer(setup.layer, reference, cand_side, setup.strata, tol, opts, grad_tol=grad_tol)
    if result.error or any(s.status == "error" for s in result.strata):
        _raise_candidate_fault(impl, spec, setup, dt, dev, seed, result)
    report = _report(result, setup, spec, impl, tol, grad_tol, dev, ref_device, seed, grad)
    return NormParityResult(layer=result, message=_message(report), _report=report)


@dataclass
class FusedParityResult:
    """A fused residual add + norm's parity (fused="add"): truthy when both outputs hold on every
    stratum of the sum. `result` is parity_cli.check.fused.FusedResult."""

    result: Any

    @property
    def passed(self) -> bool:
        return self.result.passed

    def __bool__(self) -> bool:
        return self.passed

    @property
    def diagnoses(self) -> list[dict]:
        return self.to_dict()["diagnoses"]

    @property
    def failing_strata(self) -> list[str]:
        return [s.name for s in self.result.strata if not s.passed]

    def to_dict(self) -> dict:
        return self.result.as_dict()

    @property
    def message(self) -> str:
        r = self.result
        if r.passed:
            what = f"{r.kind} + int8 quantize ({r.mode} scale)" if getattr(r, "mode", None) else f"fused add + {r.kind}"
            return f"PASS: {what} {r.dtype}, within tolerance on {len(r.strata)} strata"
        if r.error:
            return f"ERROR: fused add + {r.kind} {r.dtype}: {r.error}"
        if getattr(r, "mode", None):  # norm + quantize: one output, dequantized
            parts = [s.name for s in r.strata if not s.passed]
            lines = [f"FAIL: {r.kind} + int8 quantize ({r.mode} scale) {r.dtype}: {', '.join(parts)}"]
        else:
            parts = [f"{s.name} ({', '.join(p for p, ok in (('normed', s.normed.passed), ('residual', s.residual.passed)) if not ok)})"
                     for s in r.strata if not s.passed]
            lines = [f"FAIL: fused add + {r.kind} {r.dtype}: {'; '.join(parts)}"]
        lines += [f"  {d.code}: {d.message}" for d in r.diagnoses]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message


def _check_fused(candidate, fused, *, family, hidden_size, eps, dtype, device, weight, bias, atol, rtol, seed,
                 scale="static"):
    """fused="add": the kernel adapted to (x, residual) -> (normed, new_residual), run here on the
    device, both outputs against the oracle of the sum (parity_cli.check.fused)."""
    __tracebackhide__ = True
    import inspect

    from parity_cli.backends.fused import adapt
    from parity_cli.check.fused import check_add_norm, in_process
    from parity_cli.comparison import tolerance_for

    if fused not in ("add", "quant"):
        raise ValueError(f"fused: {fused!r}; the fused forms checked are 'add' (a residual add + norm) and 'quant' "
                         "(a norm + int8 quantize)")
    if not callable(candidate) or inspect.isclass(candidate):
        what = "fn(x, residual, weight, eps)" if fused == "add" else "fn(x, weight, eps, scale=None)"
        raise TypeError(f"candidate: a fused {fused} is a function {what}, got {candidate!r}")
    given = "llama" if family is None else family
    setup = _layer_from_family(candidate, _family(given), hidden_size, eps, dtype, weight, bias, None, seed)
    layer = setup.layer
    if layer.kind not in ("rms_norm", "layer_norm"):
        raise ValueError(f"family={given!r}: a fused {fused} is checked on an RMSNorm or a LayerNorm, not a {layer.kind}")
    dev, dt = _device(device, setup.dtype)
    w = layer.weight.to(device=dev, dtype=dt)
    b = {"bias": None if layer.bias is None else layer.bias.to(device=dev, dtype=dt)} if layer.kind == "layer_norm" else {}
    if fused == "quant":
        return _check_quant(candidate, layer, setup, dev, dt, w, b, atol, rtol, seed, scale)
    pair = adapt(candidate, w, layer.eps.value, **b)

    def on_device(x, r):
        return pair(_on_device(x, dev), _on_device(r, dev))

    return FusedParityResult(check_add_norm(layer, in_process(on_device), dt, tolerance_for(setup.dtype, atol, rtol),
                                            seed))


def _check_quant(candidate, layer, setup, dev, dt, w, b: dict, atol, rtol, seed, scale):
    __tracebackhide__ = True
    from parity_cli.backends.fused import adapt_quant
    from parity_cli.check.fused import check_norm_quant, in_process, static_scale
    from parity_cli.comparison import tolerance_for

    if scale == "dynamic":
        mode, value = "dynamic", None
    elif scale == "static":
        mode, value = "static", static_scale(layer, dt, seed)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool) and 2.0 ** -126 <= scale <= 3.4e38:
        mode, value = "static", float(scale)  # a float32 kernel holds it: a subnormal one would saturate everything
    else:
        raise ValueError(f"scale: {scale!r}; 'static', 'dynamic' or a number float32 holds (2^-126 to 3.4e38)")
    quant = adapt_quant(candidate, w, layer.eps.value, value, **b)

    def on_device(x):
        return quant(_on_device(x, dev))

    return FusedParityResult(check_norm_quant(layer, in_process(on_device), dt, tolerance_for(setup.dtype, atol, rtol),
                                              seed, mode, value))


# --- a candidate that raises or returns garbage --------------------------------------------------------


def _raise_candidate_fault(impl, spec, setup, dt, dev, seed, result):
    """The check ran the candidate on copies and kept its faults as words; here the first faulty call
    is made again in this frame, so that the caller gets the candidate's own exception and traceback
    (its frames, not ours), or one TypeError/ValueError naming what it returned."""
    __tracebackhide__ = True
    import torch

    from parity_cli.isolation.runners import readable
    from parity_cli.probes.strata import build_probe_set

    layer = setup.layer
    ps = build_probe_set(setup.strata, layer.dim, layer.eps.value, dt, seed)
    heads = layer.shape[:-1]

    def spread(x):
        return x if not heads else x.reshape(x.shape[0], *([1] * len(heads)), x.shape[-1]).expand(
            x.shape[0], *heads, x.shape[-1]).contiguous()

    weight = layer.weight.to(dt).to(dev, copy=True)
    bias = None if layer.bias is None else layer.bias.to(dt).to(dev, copy=True)
    fault = None
    try:
        fn = impl.prepare(layer, weight, bias, layer.eps.value)
    except Exception as exc:
        fault = _own(exc, f"candidate: building {spec} failed: {type(exc).__name__}: {exc}"
                     + (f" (a module class is built as cls({layer.shape[-1] if not heads else list(layer.shape)}, "
                        f"eps={layer.eps.value:g}))" if isinstance(exc, TypeError) else ""))
    else:
        for name, lo, hi in ps.segments:
            x = spread(ps.at(dt)[lo:hi]).to(dev, copy=True)
            try:
                with torch.no_grad():
                    y = fn(x)
            except Exception as exc:
                fault = _own(exc, f"candidate: calling {spec} failed on the {name} stratum: {type(exc).__name__}: "
                                  f"{exc} (a function is called as fn(x, weight, eps)"
                                  + (", bias=bias" if layer.kind == "layer_norm" else "") + ")")
                break
            value, _, err = readable(y, x.numel())
            if err:
                fault = TypeError(f"candidate: {spec} {err} (stratum {name}, input {list(x.shape)} "
                                  f"{str(dt).removeprefix('torch.')}); a norm returns a floating-point tensor")
                break
            if tuple(value.shape) != tuple(x.shape):
                fault = ValueError(f"candidate: {spec} returned shape {list(value.shape)} for input {list(x.shape)} "
                                   f"(stratum {name}); a norm returns its input's shape")
                break
    if fault is None:  # it did not happen again: say what the check saw
        said = result.error or next(f"{s.name}: {s.error}" for s in result.strata if s.error)
        fault = AssertionError(f"candidate {spec} failed during the check: {said}")
    raise fault


def _own(exc: Exception, words: str) -> Exception:
    """The candidate's exception with its traceback from its own first frame; where it has none (a
    call it could not take: wrong arguments, no weight to fill), one TypeError in our words."""
    import parity_cli

    root = str(Path(parity_cli.__file__).resolve().parent)
    tb = exc.__traceback__
    while tb is not None and str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(root):
        tb = tb.tb_next
    if tb is None:
        return TypeError(words)
    return exc.with_traceback(tb)


# --- the report ---------------------------------------------------------------------------------------


def _report(result, setup: _Setup, spec: str, impl, tol, grad_tol, dev: str, ref_device: str, seed: int,
            grad: bool) -> dict:
    """The CLI's JSON report of the one layer, with what the call was under `testing`."""
    from parity_cli import __version__
    from parity_cli.check.results import Report, jfloat
    from parity_cli.comparison import ZERO_REFERENCE_RULE
    from parity_cli.pipeline import environment
    from parity_cli.probes.strata import load_strata

    layer, fam = setup.layer, setup.family
    strata = setup.strata
    header = {
        "tool": {"name": "parity-cli", "version": __version__},
        "environment": environment(dev),
        # no checkpoint: the layer is the call's arguments
        "checkpoint": setup.checkpoint or {
            "path": "parity_cli.testing", "format": "arguments", "family": fam.name,
            "family_source": fam.source_line,
            "family_forced": True, "family_from": setup.family_from or f"family={fam.name!r}", "model_type": None,
            "files": [],
            "unmatched": []},
        "eps": {"value": layer.eps.value, "source": layer.eps.source},
        "reference": {"impl": "oracle", "source": "built-in", "dtype": "float64", "dtype_source": "default",
                      "device": ref_device, "eps": layer.eps.value},
        "candidate": {"impl": spec, "source": impl.source, "dtype": setup.dtype, "device": dev, "args": {},
                      "eps": layer.eps.value, "eps_source": layer.eps.source, "checkpoint": None, "timeout": None,
                      "isolation": "none", "isolated": False, "workers": 1},
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "source": tol.source, "mean_rounding": tol.mean_rounding,
                      "max_violation_fraction": 0.0, "zero_reference": ZERO_REFERENCE_RULE,
                      "nonfinite": "a non-finite candidate value where the reference is finite is always a violation",
                      "exact": False,
                      "grad": None if grad_tol is None else {"rtol": grad_tol.rtol, "row_atol": grad_tol.row_atol,
                                                             "source": grad_tol.source}},
        "probes": {"seed": seed, "strata": [s.name for s in strata],
                   "not_covered": [n for n in load_strata() if n not in {s.name for s in strata}],
                   "descriptions": {s.name: s.description for s in strata},
                   "rounding": f"probes are rounded to {setup.dtype}; the reference sees the rounded values",
                   "grad": grad, "layers": None, "activations": None},
    }
    d = Report(header=header, layers=[result]).to_dict()
    # each worst element with its row's q/eps: where on the eps curve the worst miss sits
    for s_dict, s in zip(d["layers"][0]["strata"], result.strata):
        rows = s.row_q_over_eps or []
        if s_dict.get("worst") and s.worst is not None and 0 <= s.worst.vector < len(rows):
            s_dict["worst"]["q_over_eps"] = jfloat(rows[s.worst.vector])
    d["testing"] = {"family": fam.name, "kind": layer.kind, "order": layer.order, "gain_offset": layer.gain_offset,
                    "hidden_size": layer.dim, "heads": (list(layer.shape[:-1]) or [None])[0],
                    "eps": layer.eps.value, "dtype": setup.dtype, "device": dev, "weight": setup.weight_source,
                    "bias": layer.bias is not None, "candidate": spec}
    return d


def _message(d: dict) -> str:
    """The finding first (pytest's one-line summary shows it), then what was checked and how."""
    from parity_cli.report.terminal import fmt as _fmt
    from parity_cli.testing.message import finding_lines

    lines = finding_lines(d)
    t, tol = d["testing"], d["tolerance"]
    kind = {"rms_norm": "RMSNorm", "layer_norm": "LayerNorm"}.get(t["kind"], t["kind"])
    gain = f"gain {t['gain_offset']:g} + w" if t["gain_offset"] else "gain w"
    size = f"{t['heads']} heads x {t['hidden_size']}" if t["heads"] else f"hidden {t['hidden_size']}"
    context = (f"checked: {t['family']} {kind} ({gain}, {t['order']} order), {size}, eps {_fmt(t['eps'])}, "
               f"{t['dtype']} on {t['device']}; candidate {t['candidate']}; reference: the float64 oracle")
    rule = (f"pass: |cand - ref| <= atol + rtol*|ref|, atol {_fmt(tol['atol'])}, rtol {_fmt(tol['rtol'])} "
            f"({tol['source']}); strata {', '.join(d['probes']['strata'])}; seed {d['probes']['seed']}")
    return "\n".join([lines[0], context, *lines[1:], rule])
