"""The library API: one function per command, called by the CLI and directly by tests.

check() wires the stages: checkpoint -> layers -> probes -> implementations -> comparison
-> diagnosis -> report."""

from __future__ import annotations

import dataclasses
import fnmatch
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
    reference_dtype: str = "float64"
    reference_device: str = "cpu"
    exact: bool = False  # bitwise: atol = rtol = 0, no allowance
    candidate_args: list[str] | dict | None = None  # KEY=VALUE for the candidate's constructor/function
    candidate_checkpoint: str | None = None  # a converted copy: the candidate uses its weights and eps
    grad: bool = False  # backward parity too
    timeout: float | None = None  # seconds per layer for the candidate
    jobs: int = 1  # worker processes over layers (each with one torch thread); 1: this process
    only: tuple | None = None  # internal: the layer names a --jobs worker checks


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
    where = str(path) if ckpt.format == "gguf" else str(Path(path) / "config.json")
    fam = family_by_name(family) if family else family_for_model_type(ckpt.model_type, where)
    return ckpt, fam, resolve_eps(ckpt, fam, eps)


def _config_name(ckpt) -> str:
    return str(ckpt.path) if ckpt.format == "gguf" else str(ckpt.path / "config.json")


def _eps_keys(ckpt, fam) -> str:
    if ckpt.format == "gguf":
        arch = getattr(ckpt, "architecture", "{arch}")
        return f"{arch}.attention.layer_norm_rms_epsilon, {arch}.attention.layer_norm_epsilon"
    return ", ".join(fam.eps_keys)


def _eps_dict(eps) -> dict:
    """eps with its source; a value stored as float32 (GGUF) also gives the decimal it came from."""
    out = {"value": eps.value, "source": eps.source}
    if eps.source.startswith("gguf:"):
        from parity_cli.gguf_checkpoint import float32_decimal

        out.update(stored_as="float32", decimal=float32_decimal(eps.value))
    return out


def environment(device: str) -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device_name": "cpu",
        "cuda": torch.version.cuda,
    }
    env["torch_build"] = {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
                          "debug": torch.version.debug, "git": getattr(torch.version, "git_version", None)}
    if device.startswith("cuda"):
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        env["device_name"] = torch.cuda.get_device_name(dev)
        env["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                      "memory_gib": round(props.total_memory / 2**30, 1), "cuda_runtime": torch.version.cuda,
                      "cudnn": torch.backends.cudnn.version()}
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
        warnings.append(f"eps is not in {_config_name(ckpt)} (looked for {_eps_keys(ckpt, fam)}); "
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
        "eps": _eps_dict(resolved),
        "layers": layers,
        "warnings": warnings,
    }


def _stored_dtype(layers) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.stored_dtype] = counts.get(layer.stored_dtype, 0) + 1
    name = max(counts, key=counts.get)
    return name if name in DTYPES.values() else "float32"


def _guarded(work, deadline: float | None):
    """Runs work() and returns (value, error). A fault is a message, not a raise; past the
    deadline the work is abandoned in a daemon thread and reported as a timeout."""
    import threading
    import time

    box: dict = {}

    def target():
        try:
            box["value"] = work()
        except BaseException as exc:  # SystemExit from a candidate is a finding too
            box["error"] = exc

    if deadline is None:
        target()
    else:
        thread = threading.Thread(target=target, daemon=True, name="parity-candidate")
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return None, "timed out"
    if "error" in box:
        if isinstance(box["error"], KeyboardInterrupt):
            raise box["error"]
        return None, _failure("", box["error"])
    return box.get("value"), None


def _call(fn, x, deadline: float | None = None):
    """Runs one side: (float64 output on the CPU, error, the dtype it returned)."""
    import torch

    def work():
        with torch.no_grad():
            return fn(x)

    y, err = _guarded(work, deadline)
    if err:
        return None, err, None
    if not isinstance(y, torch.Tensor):
        return None, f"returned {type(y).__name__}, not a tensor", None
    return y.detach().to("cpu", torch.float64), None, str(y.dtype).removeprefix("torch.")


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


def first_head(layer, strata, gain, bias):
    """Diagnosis reasons about one gain vector: for per-head gains (heads, dim) it looks at the
    first head's rows (every head sees the same probes). 1-D layers pass through unchanged."""
    heads = layer.shape[:-1]
    if not heads:
        return strata, gain, bias
    n = 1
    for h in heads:
        n *= h
    first = [dataclasses.replace(s, x=_every(s.x, n), ref=_every(s.ref, n), cand=_every(s.cand, n)) for s in strata]
    return first, gain.reshape(-1, layer.dim)[0], None if bias is None else bias.reshape(-1, layer.dim)[0]


def _run_layers(layers, pairing, reference, candidate, strata, tol, opts, grad_tol, progress=None):
    from parity_cli.report import LayerResult

    results = []
    for k, layer in enumerate(layers):
        if progress is not None:
            progress(k, len(layers), layer.name)
        if pairing is None:
            results.append(_check_layer(layer, reference, candidate, strata, tol, opts, grad_tol=grad_tol))
            continue
        findings = pairing.layer_findings.get(layer.name, [])
        other = pairing.candidate_layers.get(layer.name)
        if other is None:  # nothing to probe: the copy lacks the layer
            result = LayerResult(name=layer.name, kind=layer.kind, dim=layer.dim,
                                 eps={"value": layer.eps.value, "source": layer.eps.source},
                                 weight=_weight_stats(layer.weight), strata=[], shape=list(layer.shape))
        else:
            result = _check_layer(layer, reference, candidate, strata, tol, opts, cand_layer=other, grad_tol=grad_tol)
        result.findings = result.findings + findings
        results.append(result)
    return results


def _worker_init():
    import torch

    torch.set_num_threads(1)  # the processes are the parallelism; threads would fight over the cores


def _worker(path, opts, names):
    """A --jobs worker: the same check restricted to `names`, in its own process."""
    return check(path, dataclasses.replace(opts, jobs=1, only=tuple(names))).layers


def _run_parallel(path, opts, names, progress):
    """Layers are independent: spread them over processes (spawned, so no torch state is
    inherited) in small chunks for balance, and put the results back in layer order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    jobs = min(opts.jobs, len(names))
    size = max(1, len(names) // (jobs * 4))
    chunks = [names[k:k + size] for k in range(0, len(names), size)]
    done: dict = {}
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init)
    try:
        futures = [pool.submit(_worker, str(path), opts, chunk) for chunk in chunks]
        for future in as_completed(futures):
            for result in future.result():
                done[result.name] = result
            if progress is not None:
                progress(len(done), len(names), f"{len(done)} layers")
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return [done[name] for name in names]


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grad_of(fn, weight_leaf, x, upstream, deadline):
    """(dx, dweight) by autograd of sum(upstream * fn(x)), or an error: a candidate that is not
    differentiable is a finding. dweight comes from a module's own weight when fn is a module."""
    import torch

    def work():
        xl = _leaf(x)
        with torch.enable_grad():
            y = fn(xl)
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"returned {type(y).__name__}, not a tensor")
            if not y.requires_grad:
                raise TypeError("output does not require grad: not differentiable")
            (y.to(upstream.dtype) * upstream).sum().backward()
        w = fn.weight if isinstance(fn, torch.nn.Module) and isinstance(getattr(fn, "weight", None), torch.Tensor) \
            else weight_leaf
        if xl.grad is None:
            raise TypeError("no gradient reached the input")
        dw = None if w is None or w.grad is None else w.grad.detach().to("cpu", torch.float64)
        return xl.grad.detach().to("cpu", torch.float64), dw

    return _guarded(work, deadline)


def _check_layer(layer, reference: Side, candidate: Side, strata, tol, opts: CheckOptions,
                 cand_layer=None, grad_tol=None, keep_tensors=False):
    """Probes one layer through both sides. A fault in the reference is the user's input
    (exit 2); a fault in the candidate (raise, hang, wrong shape) is a finding in the result.

    `cand_layer` is the same layer from --candidate-checkpoint: the candidate then gets that
    checkpoint's weight, eps and conventions while the reference keeps the original's."""
    import time

    from parity_cli.comparison import compare, errored, mean_rounding_allowance
    from parity_cli.diagnosis import bitwise_diagnosis, diagnose, diagnose_grad
    from parity_cli.probes import build_probes
    from parity_cli.report import LayerResult

    cand_layer = cand_layer or layer
    eps = layer.eps.value
    cand_eps = candidate.eps if candidate.eps is not None else cand_layer.eps.value
    # Both sides see the weight as the candidate receives it (rounded to its dtype).
    w_cand = cand_layer.weight.to(candidate.dtype)
    b_cand = None if cand_layer.bias is None else cand_layer.bias.to(candidate.dtype)
    w_ref = layer.weight.to(candidate.dtype).to(reference.dtype)
    b_ref = None if layer.bias is None else layer.bias.to(candidate.dtype).to(reference.dtype)
    try:
        ref_fn = reference.impl.prepare(layer, w_ref.to(reference.device),
                                        None if b_ref is None else b_ref.to(reference.device), eps)
    except Exception as exc:
        raise InputError(_failure(f"--reference {reference.spec}: cannot build {layer.name}: ", exc)) from None
    deadline = None if opts.timeout is None else time.monotonic() + opts.timeout
    w_dev = w_cand.to(candidate.device)
    b_dev = None if b_cand is None else b_cand.to(candidate.device)
    cand_fn, layer_error = _guarded(lambda: candidate.impl.prepare(cand_layer, w_dev, b_dev, cand_eps), deadline)
    if layer_error:
        layer_error = ("candidate timed out after %gs" % opts.timeout) if layer_error == "timed out" \
            else f"building the candidate failed: {layer_error}"

    heads = layer.shape[:-1]  # per-head gains (Cohere q/k norms): every head sees every probe

    def spread(x):
        return x if not heads else x.reshape(x.shape[0], *([1] * len(heads)), x.shape[-1]).expand(
            x.shape[0], *heads, x.shape[-1]).contiguous()

    def rows(y):
        return y if y is None or not heads else y.reshape(-1, y.shape[-1])

    results, grads, returned_dtypes = [], [], set()
    probes = build_probes(strata, layer.dim, eps, candidate.dtype, opts.seed)
    for probe in probes:
        x = spread(probe.x)
        # each side gets its own copy: an in-place kernel must not change what the other side
        # or the comparison sees
        ref, ref_err, _ = _call(ref_fn, x.to(device=reference.device, dtype=reference.dtype, copy=True))
        if ref_err:
            raise InputError(f"--reference {reference.spec} failed on {layer.name}, stratum {probe.stratum}: {ref_err}")
        if layer_error:
            cand, cand_err = None, layer_error
        else:
            cand, cand_err, got = _call(cand_fn, x.to(device=candidate.device, dtype=candidate.dtype, copy=True),
                                        deadline)
            if cand_err == "timed out":
                layer_error = cand_err = "candidate timed out after %gs" % opts.timeout
            if got:
                returned_dtypes.add(got)
        if cand_err:
            results.append(errored(probe.stratum, rows(x), eps, layer.kind, cand_err))
        elif tuple(cand.shape) != tuple(ref.shape):
            results.append(errored(probe.stratum, rows(x), eps, layer.kind,
                                   f"candidate returned shape {list(cand.shape)}, expected {list(ref.shape)}"))
        else:
            extra = None
            if layer.kind == "layer_norm" and tol.mean_rounding:
                extra = rows(mean_rounding_allowance(x, layer.gain_offset + w_ref.cpu(), eps, tol))
            q = probe.mean_square(layer.kind)
            if heads:
                q = q.repeat_interleave(rows(x).shape[0] // q.shape[0])
            results.append(compare(probe.stratum, rows(x), rows(ref), rows(cand), eps, layer.kind, tol,
                                   opts.max_violation_fraction, extra, candidate.dtype, q))
        if opts.grad:
            grads.extend(_grad_strata(probe, x, rows, layer, cand_layer, reference, candidate, w_ref, b_ref, w_cand, b_cand,
                                      ref_fn, cand_eps, eps, grad_tol, opts, deadline,
                                      layer_error or cand_err))
    stats = _weight_stats(layer.weight)
    warnings = list(layer.warnings)
    weight_findings = []
    if stats["nonfinite"]:
        # Both sides then output NaN and "agree": the checkpoint itself is broken, and that fails.
        weight_findings.append({"code": "nonfinite_weight",
                                "message": f"{stats['nonfinite']} non-finite value(s) in the stored weight "
                                           f"{layer.tensor or layer.name}: every output of this layer is NaN or inf",
                                "count": stats["nonfinite"]})
    wrong_dtype = sorted(returned_dtypes - {str(candidate.dtype).removeprefix("torch.")})
    if wrong_dtype:
        warnings.append(f"candidate returned {', '.join(wrong_dtype)} for {str(candidate.dtype).removeprefix('torch.')} "
                        "input (compared after upcasting to float64)")
    result = LayerResult(
        name=layer.name, kind=layer.kind, dim=layer.dim,
        eps={"value": eps, "source": layer.eps.source},
        weight=stats, strata=results, error=layer_error, warnings=warnings, grad=grads,
        shape=list(layer.shape), findings=weight_findings,
    )
    if cand_layer is not layer or candidate.eps is not None:
        result.candidate_eps = {"value": cand_eps, "source": "option:--candidate-eps" if candidate.eps is not None
                                else cand_layer.eps.source}
    gain = layer.gain_offset + w_ref.cpu()
    bias = None if b_ref is None else b_ref.cpu()
    strata_d, gain_d, bias_d = first_head(layer, results, gain, bias)
    if opts.exact:  # bitwise mode: the question is how many ulps, not which semantics
        result.diagnoses = bitwise_diagnosis(strata_d, candidate.dtype, layer, gain_d, tol, bias_d)
    else:
        result.diagnoses = diagnose(layer, strata_d, gain_d, tol, candidate.dtype, bias_d)
    if opts.grad:
        result.diagnoses.extend(diagnose_grad(layer, grads, gain if not heads else None, eps))
    if not keep_tensors:  # the raw tensors served diagnosis; a 126-layer run should not keep them
        for s in results + grads:
            s.x = s.ref = s.cand = None
    return result


def _grad_strata(probe, x, rows, layer, cand_layer, reference, candidate, w_ref, b_ref, w_cand, b_cand, ref_fn, cand_eps, eps,
                 grad_tol, opts, deadline, forward_error):
    """dx and dweight of one stratum: candidate autograd against the reference's float64 autograd."""
    import torch

    from parity_cli.comparison import compare, errored

    gen = torch.Generator().manual_seed(_crc(f"{opts.seed}:grad:{probe.stratum}:{layer.dim}"))
    upstream = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    name_dx, name_dw = f"{probe.stratum}:dx", f"{probe.stratum}:dweight"
    w_leaf = _leaf(w_ref.to(reference.device))
    try:
        ref_grad_fn = reference.impl.prepare(layer, w_leaf, None if b_ref is None else b_ref.to(reference.device), eps)
    except Exception as exc:
        raise InputError(_failure(f"--reference {reference.spec}: cannot build {layer.name} for --grad: ", exc)) from None
    (dx_ref, dw_ref), err = _unpack(_grad_of(ref_grad_fn, w_leaf, x.to(reference.dtype).to(reference.device),
                                             upstream.to(reference.dtype).to(reference.device), None))
    if err:
        raise InputError(f"--reference {reference.spec} is not differentiable on {layer.name}: {err}")
    if forward_error:
        return [errored(name_dx, rows(x), eps, layer.kind, forward_error)]
    wc_leaf = _leaf(w_cand.to(candidate.device))
    cand_grad_fn, err = _guarded(lambda: candidate.impl.prepare(
        cand_layer, wc_leaf, None if b_cand is None else b_cand.to(candidate.device), cand_eps), deadline)
    if not err:
        (dx_c, dw_c), err = _unpack(_grad_of(cand_grad_fn, wc_leaf, x.to(candidate.dtype).to(candidate.device),
                                             upstream.to(candidate.dtype).to(candidate.device), deadline))
    if err:
        return [errored(name_dx, rows(x), eps, layer.kind, f"backward: {err}")]
    out = []
    if tuple(dx_c.shape) != tuple(dx_ref.shape):
        return [errored(name_dx, rows(x), eps, layer.kind, f"dx has shape {list(dx_c.shape)}, expected {list(dx_ref.shape)}")]
    dx_ref = rows(dx_ref.cpu())
    out.append(compare(name_dx, rows(x), dx_ref, rows(dx_c), eps, layer.kind, grad_tol, 0.0,
                       grad_tol.row_atol * dx_ref.abs().amax(-1, keepdim=True)))
    if dw_ref is not None:
        dw_ref = dw_ref.cpu().reshape(1, -1)
        if dw_c is None:
            out.append(errored(name_dw, rows(x)[:1], eps, layer.kind, "no gradient reached the weight"))
        elif dw_c.numel() != dw_ref.numel():
            out.append(errored(name_dw, rows(x)[:1], eps, layer.kind,
                               f"dweight has shape {list(dw_c.shape)}, expected {list(w_ref.shape)}"))
        else:
            # One "row": the weight's gradient, summed over every probe of the stratum.
            xr = rows(x)[:1] if dw_ref.shape[-1] == layer.dim else torch.ones_like(dw_ref)
            extra = grad_tol.row_atol * dw_ref.abs().amax(-1, keepdim=True)
            if layer.kind == "layer_norm" and grad_tol.mean_rounding:
                # dweight sums g * x̂ over rows, and x̂ carries the mean's rounding (tolerances.toml)
                xs = x.to(torch.float64)
                cond = xs.abs().amax(-1, keepdim=True) / torch.sqrt(xs.var(-1, unbiased=False, keepdim=True) + eps)
                extra = extra + grad_tol.mean_rounding * (upstream.abs() * cond).reshape(-1, *layer.shape).sum(0).reshape(1, -1)
            out.append(compare(name_dw, xr, dw_ref, dw_c.reshape(1, -1), eps, layer.kind, grad_tol, 0.0, extra))
    return out


def _unpack(pair):
    value, err = pair
    return (value if value is not None else (None, None)), err


def _crc(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


def check(path: str | Path, options: CheckOptions | None = None, progress=None, **kwargs):
    """Runs the whole check and returns a Report; raises InputError for bad input.

    `progress(done, total, layer_name)` is called before each layer (the CLI's progress bar)."""
    import torch

    from parity_cli import implementations as impls
    from parity_cli.comparison import (
        ZERO_REFERENCE_RULE,
        grad_tolerance_for,
        tolerance_for,
    )
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
    if opts.timeout is not None and not opts.timeout > 0:
        raise InputError(f"--timeout must be > 0 seconds, got {opts.timeout}")
    strata = select_strata(opts.strata)
    device = check_device(opts.device)
    ref_device = check_device(opts.reference_device)
    ref_dtype_name = dtype_name(opts.reference_dtype)
    cand_args = opts.candidate_args if isinstance(opts.candidate_args, dict) else impls.parse_args(opts.candidate_args)
    cand_impl = impls.resolve(opts.candidate, cand_args)
    ref_impl = impls.resolve(opts.reference)

    ckpt, fam, eps = load(path, opts.family, opts.eps)
    found = discover_layers(ckpt, fam, eps, opts.layers, names=None if opts.only is None else set(opts.only))
    if not found.layers:
        raise InputError(f"{ckpt.path}: no checkable norm layer ({'; '.join(found.warnings) or 'none matched'})")
    cand_dtype_name = dtype_name(opts.dtype) if opts.dtype else _stored_dtype(found.layers)
    tol = tolerance_for(cand_dtype_name, opts.atol, opts.rtol, exact=opts.exact)
    grad_tol = grad_tolerance_for(cand_dtype_name, exact=opts.exact) if opts.grad else None
    candidate = Side(cand_impl, opts.candidate, getattr(torch, cand_dtype_name), device, opts.candidate_eps)
    reference = Side(ref_impl, opts.reference, getattr(torch, ref_dtype_name), ref_device)

    pairing, conversion = None, None
    if opts.candidate_checkpoint:
        from parity_cli.pairing import pair

        ckpt2, fam2, eps2 = load(opts.candidate_checkpoint)
        found2 = discover_layers(ckpt2, fam2, eps2)
        pairing = pair(found.layers, found2.layers, str(ckpt2.path))
        conversion = {
            "path": str(ckpt2.path), "format": ckpt2.format, "family": fam2.name, "model_type": ckpt2.model_type,
            "eps": {"value": eps2.value, "source": eps2.source},
            "layers": len(found2.layers), "unmatched": found2.unmatched,
            "findings": sum(len(v) for v in pairing.layer_findings.values()) + len(pairing.report_findings),
        }

    warnings = list(found.warnings)
    if eps.source == "family-default":
        warnings.append(
            f"eps is not in {_config_name(ckpt)} (looked for {_eps_keys(ckpt, fam)}); "
            f"using the family default {eps.value:g}"
        )
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family "
                        f"'{fam.name}' and were not checked: {', '.join(found.unmatched[:10])}")

    if opts.jobs > 1 and len(found.layers) > 1 and opts.only is None:
        results = _run_parallel(path, opts, [layer.name for layer in found.layers], progress)
    else:
        results = _run_layers(found.layers, pairing, reference, candidate, strata, tol, opts, grad_tol, progress)

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
        "eps": _eps_dict(eps),
        "reference": {"impl": ref_impl.name, "source": ref_impl.source, "dtype": ref_dtype_name,
                      "device": ref_device, "eps": eps.value},
        "candidate": {"impl": cand_impl.name, "source": cand_impl.source, "dtype": cand_dtype_name,
                      "device": device, "args": cand_args,
                      "eps": opts.candidate_eps if opts.candidate_eps is not None else (
                          conversion["eps"]["value"] if conversion else eps.value),
                      "eps_source": "option:--candidate-eps" if opts.candidate_eps is not None else (
                          conversion["eps"]["source"] if conversion else eps.source),
                      "checkpoint": conversion,
                      "timeout": opts.timeout},
        "tolerance": {"atol": tol.atol, "rtol": tol.rtol, "source": tol.source,
                      "mean_rounding": tol.mean_rounding,
                      "max_violation_fraction": opts.max_violation_fraction,
                      "zero_reference": ZERO_REFERENCE_RULE,
                      "nonfinite": "a non-finite candidate value where the reference is finite is always a violation",
                      "exact": opts.exact,
                      "grad": None if grad_tol is None else {"rtol": grad_tol.rtol, "row_atol": grad_tol.row_atol,
                                                             "source": grad_tol.source}},
        "probes": {
            "seed": opts.seed,
            "strata": [s.name for s in strata],
            "not_covered": [n for n in load_strata() if n not in {s.name for s in strata}],
            "descriptions": {s.name: s.description for s in strata},
            "rounding": f"probes are rounded to {cand_dtype_name}; the reference sees the rounded values",
            "grad": opts.grad,
        },
    }
    return Report(header=header, layers=results, warnings=warnings,
                  findings=pairing.report_findings if pairing else [])


def _step(label: str, factor: str, result) -> dict:
    finite = [s for s in result.strata if s.status != "error"]
    return {
        "step": label,
        "changes": factor,
        "status": result.status,
        "error": result.error or next((f"{s.name}: {s.error}" for s in result.strata if s.error), None),
        "max_abs_err": max((s.max_abs_err for s in finite), default=None),
        "max_rel_err": max((s.max_rel_err for s in finite), default=None),
        "failing": [s.name for s in result.strata if s.status != "pass"],
    }


def explain(path: str | Path, options: CheckOptions | None = None, layer_names: list[str] | None = None,
            **kwargs) -> dict:
    """The one-factor-at-a-time ladder for each failing layer (or the named ones): the check as
    run, then the candidate at the reference dtype, the family's own numerics at the candidate
    dtype, and the reference with the eps the candidate appears to use. The step whose errors
    collapse names the factor that carries them."""
    import torch

    from parity_cli import implementations as impls
    from parity_cli.checkpoint import Eps
    from parity_cli.comparison import tolerance_for
    from parity_cli.diagnosis import Context, estimate_eps
    from parity_cli.layers import discover_layers
    from parity_cli.probes import select_strata

    opts = dataclasses.replace(options or CheckOptions(**kwargs), grad=False)
    if layer_names:  # the caller has the report already (check --explain, parity explain REPORT.json)
        wanted = set(layer_names)
    else:
        wanted = {l.name for l in check(path, opts).layers if not l.passed}
        if not wanted:
            return {}
    ckpt, fam, eps = load(path, opts.family, opts.eps)
    found = {l.name: l for l in discover_layers(ckpt, fam, eps).layers}
    unknown = sorted(wanted - set(found))
    if unknown:
        raise InputError(f"explain: no layer named {', '.join(unknown)} in {ckpt.path}")
    strata = select_strata(opts.strata)
    # the candidate dtype exactly as check() chooses it
    checked_layers = [l for n, l in found.items() if not opts.layers or fnmatch.fnmatchcase(n, opts.layers)]
    cand_dtype_name = dtype_name(opts.dtype) if opts.dtype else _stored_dtype(checked_layers)
    cand_dtype = getattr(torch, cand_dtype_name)
    ref_dtype = getattr(torch, dtype_name(opts.reference_dtype))
    cand_impl = impls.resolve(opts.candidate, opts.candidate_args if isinstance(opts.candidate_args, dict)
                              else impls.parse_args(opts.candidate_args))
    reference = Side(impls.resolve(opts.reference), opts.reference, ref_dtype, check_device(opts.reference_device))
    device = check_device(opts.device)
    tol = tolerance_for(cand_dtype_name, opts.atol, opts.rtol, exact=opts.exact)
    run_opts = opts
    copies = None  # --candidate-checkpoint: the candidate keeps the copy's weights and eps in every step
    if opts.candidate_checkpoint:
        from parity_cli.pairing import pair

        ckpt2, fam2, eps2 = load(opts.candidate_checkpoint)
        copies = pair(list(found.values()), discover_layers(ckpt2, fam2, eps2).layers, str(ckpt2.path)).candidate_layers
    out = {}
    for name in [n for n in found if n in wanted]:  # discovery (table) order
        layer = found[name]
        other = None if copies is None else copies.get(name)
        if copies is not None and other is None:
            out[name] = [{"step": "candidate checkpoint", "changes": "nothing", "status": "skipped",
                          "error": "the layer is missing from the candidate checkpoint", "max_abs_err": None,
                          "max_rel_err": None, "failing": []}]
            continue
        steps = []
        as_run = Side(cand_impl, opts.candidate, cand_dtype, device, opts.candidate_eps)
        # kept tensors: the same run also gives the rows the eps is estimated from (step 3)
        checked = _check_layer(layer, reference, as_run, strata, tol, run_opts, cand_layer=other, keep_tensors=True)
        steps.append(_step(f"candidate at {cand_dtype_name} (as checked)", "nothing", checked))
        # 1. the candidate at the reference's dtype: does the error belong to the dtype?
        ref_dtype_name = str(ref_dtype).removeprefix("torch.")
        hi = Side(cand_impl, opts.candidate, ref_dtype, device, opts.candidate_eps)
        steps.append(_step(f"candidate at {ref_dtype_name}", "dtype",
                           _check_layer(layer, reference, hi, strata, tolerance_for(ref_dtype_name), run_opts,
                                        cand_layer=other)))
        # 2. the family's own numerics at the candidate dtype: the floor that dtype imposes
        own = Side(impls.resolve("hf"), "hf", cand_dtype, "cpu", opts.candidate_eps)
        steps.append(_step(f"{layer.family} numerics (hf) at {cand_dtype_name}", "kernel",
                           _check_layer(layer, reference, own, strata, tol, run_opts, cand_layer=other)))
        # 3. the reference with the eps the candidate appears to use
        gain = layer.gain_offset + layer.weight.to(cand_dtype).double()
        bias = None if layer.bias is None else layer.bias.to(cand_dtype).double()
        kept, gain, bias = first_head(layer, checked.strata, gain, bias)
        est = estimate_eps(Context(layer=layer, gain=gain, bias=bias, tol=tol, dtype=cand_dtype, strata=kept))
        if est is not None and est[0] > 0:
            shifted = dataclasses.replace(layer, eps=Eps(est[0], "estimated from the candidate"))
            keep = Side(cand_impl, opts.candidate, cand_dtype, device,
                        opts.candidate_eps if opts.candidate_eps is not None else (other or layer).eps.value)
            steps.append(_step(f"reference with eps {est[0]:.3g} (estimated)", "eps",
                               _check_layer(shifted, reference, keep, strata, tol, run_opts, cand_layer=other)))
        else:
            steps.append({"step": "reference with the candidate's eps", "changes": "eps", "status": "skipped",
                          "error": "no eps could be estimated (the tiny and constant strata show none)",
                          "max_abs_err": None, "max_rel_err": None, "failing": []})
        out[name] = steps
    return out


def options_from_report(data: dict, where: str) -> tuple[str, CheckOptions]:
    """The options a saved report was produced with, to rerun it (parity explain REPORT.json)."""
    try:
        cand, ref, probes = data["candidate"], data["reference"], data["probes"]
        opts = CheckOptions(
            candidate=cand["impl"], reference=ref["impl"], dtype=cand["dtype"], device=cand["device"],
            family=data["checkpoint"].get("family"),
            eps=data["eps"]["value"] if data["eps"]["source"] == "override" else None,
            candidate_eps=cand["eps"] if cand.get("eps_source") == "option:--candidate-eps" else None,
            # a one-sided override is recorded as "option+profile:..."; the profile's own value is harmless
            atol=data["tolerance"]["atol"] if str(data["tolerance"].get("source", "")).startswith("option") else None,
            rtol=data["tolerance"]["rtol"] if str(data["tolerance"].get("source", "")).startswith("option") else None,
            max_violation_fraction=float(data["tolerance"].get("max_violation_fraction", 0.0)),
            timeout=cand.get("timeout"),
            strata=list(probes["strata"]), seed=int(probes["seed"]),
            reference_dtype=ref.get("dtype", "float64"), reference_device=ref.get("device", "cpu"),
            exact=bool(data["tolerance"].get("exact", False)), candidate_args=cand.get("args") or None,
            candidate_checkpoint=(cand.get("checkpoint") or {}).get("path"),
        )
        return data["checkpoint"]["path"], opts
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{where}: the report lacks what a rerun needs ({exc})") from None
