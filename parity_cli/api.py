"""The library API: one function per command, called by the CLI and directly by tests.

check() wires the stages: checkpoint -> layers -> probes -> implementations -> comparison
-> diagnosis -> report."""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from pathlib import Path

from parity_cli import __version__
from parity_cli.checkpoint import open_checkpoint, resolve_eps
from parity_cli.errors import InputError
from parity_cli.families import family_by_name, family_for_model_type

DTYPES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "fp64": "float64", "double": "float64", "f64": "float64",
}


@dataclass
class CheckOptions:
    candidate: str = "torch"
    reference: str = "oracle"
    dtype: str | None = None  # candidate input/weight dtype; None: the checkpoint's stored dtype
    device: str = "cpu"
    family: str | None = None
    eps: float | None = None  # overrides the checkpoint's eps for both sides
    candidate_eps: float | None = None  # the candidate alone (simulates a deployment config)
    atol: float | None = None
    rtol: float | None = None
    strata: list[str] | None = None
    seed: int = 0
    layers: str | None = None
    max_violation_fraction: float = 0.0


def dtype_name(name: str) -> str:
    key = name.lower().removeprefix("torch.")
    if key not in DTYPES:
        raise InputError(f"--dtype: unknown dtype '{name}'; use float32, bfloat16, float16 or float64")
    return DTYPES[key]


def check_device(device: str) -> str:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise InputError(f"--device: '{device}' is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: no CUDA device is available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise InputError(f"--device: '{device}' is not supported (cpu, cuda, cuda:N)")
    return str(dev)


def load(path: str | Path, family: str | None = None, eps: float | None = None):
    """Checkpoint, its family and its resolved eps (the part `inspect` and `check` share)."""
    ckpt = open_checkpoint(path)
    fam = family_by_name(family) if family else family_for_model_type(ckpt.model_type, str(Path(path) / "config.json"))
    return ckpt, fam, resolve_eps(ckpt, fam, eps)


def environment(device: str) -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device_name": "cpu",
        "cuda": torch.version.cuda,
    }
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name(torch.device(device))
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def _weight_stats(weight) -> dict:
    import torch

    w = weight.to(torch.float64)
    finite = w[torch.isfinite(w)]
    return {
        "dtype": str(weight.dtype).removeprefix("torch."),
        "min": float(finite.min()) if finite.numel() else None,
        "max": float(finite.max()) if finite.numel() else None,
        "mean": float(finite.mean()) if finite.numel() else None,
        "nonfinite": int(w.numel() - finite.numel()),
    }


ONE_PERCENT_Q_OVER_EPS = 1 / (0.99 ** -2 - 1)  # 49.2512562814: q/eps where A = 0.99


def inspect(path: str | Path, family: str | None = None, eps: float | None = None) -> dict:
    """What a check would run on, without running it: family, eps and its source, each layer's
    weight and the RMS below which eps attenuates its output by more than 1%."""
    import math

    from parity_cli.layers import discover_layers

    ckpt, fam, resolved = load(path, family, eps)
    found = discover_layers(ckpt, fam, resolved)
    warnings = list(found.warnings)
    if resolved.source == "family-default":
        warnings.append(f"eps is not in {ckpt.path / 'config.json'} (looked for {', '.join(fam.eps_keys)}); "
                        f"the family default {resolved.value:g} is assumed")
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family '{fam.name}'")
    layers = []
    for layer in found.layers:
        stats = _weight_stats(layer.weight)
        gain = None if stats["min"] is None else {"min": layer.gain_offset + stats["min"],
                                                   "max": layer.gain_offset + stats["max"]}
        if stats["nonfinite"]:
            warnings.append(f"{layer.name}: {stats['nonfinite']} non-finite weight value(s)")
        if gain is not None and gain["min"] <= 0:
            warnings.append(f"{layer.name}: effective gain <= 0 in some channel (min {gain['min']:.3g})")
        layers.append({
            "name": layer.name, "kind": layer.kind, "dim": layer.dim, "shape": list(layer.shape),
            "order": layer.order, "bias": layer.bias is not None,
            "eps": {"value": layer.eps.value, "source": layer.eps.source},
            "weight": stats, "gain": gain, "gain_offset": layer.gain_offset,
            "rms_1pct": math.sqrt(ONE_PERCENT_Q_OVER_EPS * layer.eps.value),
            "warnings": layer.warnings,
        })
    return {
        "schema_version": 1,
        "tool": {"name": "parity-cli", "version": __version__},
        "checkpoint": {"path": str(ckpt.path), "format": ckpt.format, "family": fam.name,
                       "model_type": ckpt.model_type, "files": [f.name for f in ckpt.files],
                       "unmatched": found.unmatched},
        "eps": {"value": resolved.value, "source": resolved.source},
        "layers": layers,
        "warnings": warnings,
    }


def _stored_dtype(layers) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.stored_dtype] = counts.get(layer.stored_dtype, 0) + 1
    name = max(counts, key=counts.get)
    return name if name in DTYPES.values() else "float32"


def _call(fn, x):
    """Runs one side; a fault in the implementation is returned as a message, not raised."""
    import torch

    try:
        with torch.no_grad():
            y = fn(x)
        if not isinstance(y, torch.Tensor):
            return None, f"returned {type(y).__name__}, not a tensor"
        return y.detach().to("cpu", torch.float64), None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit from a candidate is a finding too
        return None, _failure("", exc)


@dataclass
class Side:
    """One side of the comparison: an implementation at a dtype on a device."""

    impl: object  # implementations.Implementation
    spec: str  # as the user wrote it, for messages
    dtype: object  # torch dtype
    device: str
    eps: float | None = None  # None: the layer's own eps


def _failure(prefix: str, exc: BaseException) -> str:
    return f"{prefix}{type(exc).__name__}: {exc}".splitlines()[0][:500]


def _every(t, n):
    return None if t is None else t[::n]


def _check_layer(layer, reference: Side, candidate: Side, strata, tol, opts: CheckOptions):
    """Probes one layer through both sides. A fault in the reference is the user's input
    (exit 2); a fault in the candidate is a finding recorded in the result."""
    from parity_cli.comparison import compare, errored, mean_rounding_allowance
    from parity_cli.diagnosis import diagnose
    from parity_cli.probes import build_probes
    from parity_cli.report import LayerResult

    eps = layer.eps.value
    # Both sides see the weight as the candidate receives it (rounded to its dtype).
    w_cand = layer.weight.to(candidate.dtype)
    b_cand = None if layer.bias is None else layer.bias.to(candidate.dtype)
    w_ref = w_cand.to(reference.dtype)
    b_ref = None if b_cand is None else b_cand.to(reference.dtype)
    try:
        ref_fn = reference.impl.prepare(layer, w_ref, b_ref, eps)
    except Exception as exc:
        raise InputError(_failure(f"--reference {reference.spec}: cannot build {layer.name}: ", exc)) from None
    cand_fn, layer_error = None, None
    try:
        cand_fn = candidate.impl.prepare(layer, w_cand.to(candidate.device),
                                         None if b_cand is None else b_cand.to(candidate.device),
                                         eps if candidate.eps is None else candidate.eps)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        layer_error = _failure("building the candidate failed: ", exc)

    heads = layer.shape[:-1]  # per-head gains (Cohere q/k norms): every head sees every probe

    def spread(x):
        return x if not heads else x.reshape(x.shape[0], *([1] * len(heads)), x.shape[-1]).expand(
            x.shape[0], *heads, x.shape[-1]).contiguous()

    def rows(y):
        return y if y is None or not heads else y.reshape(-1, y.shape[-1])

    results = []
    for probe in build_probes(strata, layer.dim, eps, candidate.dtype, opts.seed):
        x = spread(probe.x)
        ref, ref_err = _call(ref_fn, x.to(reference.dtype))
        if ref_err:
            raise InputError(f"--reference {reference.spec} failed on {layer.name}, stratum {probe.stratum}: {ref_err}")
        cand, cand_err = (None, layer_error) if cand_fn is None else _call(cand_fn, x.to(candidate.dtype).to(candidate.device))
        if cand_err:
            results.append(errored(probe.stratum, rows(x), eps, layer.kind, cand_err))
        elif tuple(cand.shape) != tuple(ref.shape):
            results.append(errored(probe.stratum, rows(x), eps, layer.kind,
                                   f"candidate returned shape {list(cand.shape)}, expected {list(ref.shape)}"))
        else:
            extra = None
            if layer.kind == "layer_norm" and tol.mean_rounding:
                extra = rows(mean_rounding_allowance(x, layer.gain_offset + w_ref, eps, tol))
            results.append(compare(probe.stratum, rows(x), rows(ref), rows(cand), eps, layer.kind, tol,
                                   opts.max_violation_fraction, extra))
    stats = _weight_stats(layer.weight)
    warnings = list(layer.warnings)
    if stats["nonfinite"]:
        # Both sides then output NaN and "agree": the checkpoint itself is broken.
        warnings.append(f"{stats['nonfinite']} non-finite value(s) in the stored weight")
    result = LayerResult(
        name=layer.name, kind=layer.kind, dim=layer.dim,
        eps={"value": eps, "source": layer.eps.source},
        weight=stats, strata=results, error=layer_error, warnings=warnings,
    )
    gain = layer.gain_offset + w_ref
    if heads:  # diagnosis reasons about one gain vector: look at the first head's rows
        n = 1
        for h in heads:
            n *= h
        first = [dataclasses.replace(s, x=_every(s.x, n), ref=_every(s.ref, n), cand=_every(s.cand, n))
                 for s in results]
        result.diagnoses = diagnose(layer, first, gain.reshape(-1, layer.dim)[0],
                                    tol, candidate.dtype, None if b_ref is None else b_ref.reshape(-1, layer.dim)[0])
    else:
        result.diagnoses = diagnose(layer, results, gain, tol, candidate.dtype, b_ref)
    for s in results:  # the raw tensors served diagnosis; a 126-layer run should not keep them
        s.x = s.ref = s.cand = None
    return result


def check(path: str | Path, options: CheckOptions | None = None, **kwargs):
    """Runs the whole check and returns a Report; raises InputError for bad input."""
    import torch

    from parity_cli import implementations as impls
    from parity_cli.comparison import ZERO_REFERENCE_RULE, tolerance_for
    from parity_cli.layers import discover_layers
    from parity_cli.probes import load_strata, select_strata
    from parity_cli.report import Report

    opts = options or CheckOptions(**kwargs)
    if not 0.0 <= opts.max_violation_fraction <= 1.0:
        raise InputError("--max-violation-fraction must be between 0 and 1")
    for flag, value in (("--eps", opts.eps), ("--candidate-eps", opts.candidate_eps),
                        ("--atol", opts.atol), ("--rtol", opts.rtol)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise InputError(f"{flag} must be a finite number >= 0, got {value}")
    strata = select_strata(opts.strata)
    device = check_device(opts.device)
    cand_impl = impls.resolve(opts.candidate)
    ref_impl = impls.resolve(opts.reference)

    ckpt, fam, eps = load(path, opts.family, opts.eps)
    found = discover_layers(ckpt, fam, eps, opts.layers)
    if not found.layers:
        raise InputError(f"{ckpt.path}: no checkable norm layer ({'; '.join(found.warnings) or 'none matched'})")
    cand_dtype_name = dtype_name(opts.dtype) if opts.dtype else _stored_dtype(found.layers)
    tol = tolerance_for(cand_dtype_name, opts.atol, opts.rtol)
    candidate = Side(cand_impl, opts.candidate, getattr(torch, cand_dtype_name), device, opts.candidate_eps)
    reference = Side(ref_impl, opts.reference, torch.float64, "cpu")

    warnings = list(found.warnings)
    if eps.source == "family-default":
        warnings.append(
            f"eps is not in {ckpt.path / 'config.json'} (looked for {', '.join(fam.eps_keys)}); "
            f"using the family default {eps.value:g}"
        )
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family "
                        f"'{fam.name}' and were not checked: {', '.join(found.unmatched[:10])}")

    results = [_check_layer(layer, reference, candidate, strata, tol, opts) for layer in found.layers]

    header = {
        "tool": {"name": "parity-cli", "version": __version__},
        "environment": environment(device),
        "checkpoint": {
            "path": str(ckpt.path),
            "format": ckpt.format,
            "family": fam.name,
            "model_type": ckpt.model_type,
            "files": [f.name for f in ckpt.files],
            "unmatched": found.unmatched,
        },
        "eps": {"value": eps.value, "source": eps.source},
        "reference": {"impl": ref_impl.name, "source": ref_impl.source, "dtype": "float64",
                      "device": reference.device, "eps": eps.value},
        "candidate": {"impl": cand_impl.name, "source": cand_impl.source, "dtype": cand_dtype_name,
                      "device": device,
                      "eps": opts.candidate_eps if opts.candidate_eps is not None else eps.value,
                      "eps_source": "option:--candidate-eps" if opts.candidate_eps is not None else eps.source},
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "source": tol.source,
                      "mean_rounding": tol.mean_rounding,
                      "max_violation_fraction": opts.max_violation_fraction,
                      "zero_reference": ZERO_REFERENCE_RULE,
                      "nonfinite": "a non-finite candidate value where the reference is finite is always a violation"},
        "probes": {
            "seed": opts.seed,
            "strata": [s.name for s in strata],
            "not_covered": [n for n in load_strata() if n not in {s.name for s in strata}],
            "descriptions": {s.name: s.description for s in strata},
            "rounding": f"probes are rounded to {cand_dtype_name}; the reference sees the rounded values",
        },
    }
    return Report(header=header, layers=results, warnings=warnings)
