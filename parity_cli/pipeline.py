"""The library API: one function per command, called by the CLI and directly by tests.

check() wires the stages: checkpoint -> layers -> probes -> implementations -> comparison
-> diagnosis -> report."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from parity_cli import __version__
from parity_cli.sources.huggingface import open_checkpoint, resolve_eps
from parity_cli.errors import InputError
from parity_cli.model.families import family_by_name, family_for_model_type
from parity_cli.report.grouping import g as _g
from parity_cli.check import parallel
from parity_cli.check.parallel import resolve_jobs
from parity_cli.report.replay import fingerprint, options_from_report, recorded_path, recorded_spec  # noqa: F401

DTYPES = {
    "float32": "float32", "fp32": "float32", "f32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "fp64": "float64", "double": "float64", "f64": "float64",
}


@dataclass
class CheckOptions:
    candidate: str | None = None  # None: torch, or onnxruntime for an .onnx candidate checkpoint
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
    reference_device: str = "auto"  # auto: the candidate's GPU when it has fast float64, else the CPU
    exact: bool = False  # bitwise: atol = rtol = 0, no allowance
    candidate_args: list[str] | dict | None = None  # KEY=VALUE for the candidate's constructor/function
    candidate_checkpoint: str | None = None  # a converted copy: the candidate uses its weights and eps
    grad: bool = False  # backward parity too
    timeout: float | None = None  # seconds per layer for the candidate; None: 120 s; inf: no limit
    jobs: int | str = 1  # workers over layers; "auto": one per CPU this process may run on
    threads: int = 1  # torch intra-op threads per process (the parent's and each candidate child's)
    isolation: str = "auto"  # auto | process | none (supervisor.open_runners)
    candidate_memory: str | int | None = None  # cap on the candidate's resident memory; None: half of RAM
    activations: str | None = None  # a `parity capture` file: a `captured` stratum of real rows per layer
    captured: dict | None = None  # its rows by layer, once loaded (check() fills it)


def dtype_name(name: str) -> str:
    key = name.lower().removeprefix("torch.")
    if key not in DTYPES:
        raise InputError(f"--dtype: unknown dtype '{name}'; use float32, bfloat16, float16 or float64")
    return DTYPES[key]


# (major, minor) compute capabilities whose float64 runs at 1/2 of float32 (P100, V100, A100,
# H100/H200, B200); every other part runs it at 1/32-1/64, slower than the CPU for the oracle
FAST_FLOAT64 = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}


def reference_device(option: str, candidate_device: str, oracle: bool = True) -> str:
    """--reference-device: `auto` runs the float64 oracle on the candidate's GPU when that GPU
    has fast float64 (the probe set then crosses the bus once), otherwise on the CPU. Any other
    reference (`oracle` False: another implementation, or not float64) stays on the CPU unless
    asked: moving it would change which kernels the reference runs."""
    if option != "auto":
        return check_device(option)
    if not oracle or not candidate_device.startswith("cuda"):
        return "cpu"
    import torch

    props = torch.cuda.get_device_properties(torch.device(candidate_device))
    return candidate_device if (props.major, props.minor) in FAST_FLOAT64 else "cpu"


def is_oracle(opts) -> bool:
    """The reference is the float64 oracle (what --reference-device auto may move to a GPU)."""
    return opts.reference == "oracle" and dtype_name(opts.reference_dtype) == "float64"


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
        from parity_cli.sources.gguf import float32_decimal

        out.update(stored_as="float32", decimal=float32_decimal(eps.value))
    return out


def environment(device: str, threads: int | None = None, jobs: int | None = None) -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device_name": "cpu",
        "cuda": torch.version.cuda,
        # what the timing of this run rests on: the CPUs it may use, its workers and their threads
        "cpus": resolve_jobs("auto"),
        "jobs": jobs,
        "threads": threads,
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


ONE_PERCENT_Q_OVER_EPS = 1 / (0.99 ** -2 - 1)  # 49.2512562814: q/eps where A = 0.99


def inspect(path: str | Path, family: str | None = None, eps: float | None = None) -> dict:
    """What a check would run on, without running it: family, eps and its source, each layer's
    weight and the RMS below which eps attenuates its output by more than 1%."""
    import math

    from parity_cli.check.layer import weight_stats
    from parity_cli.model.layers import discover_layers
    from parity_cli.sources.onnx_graph import is_onnx

    if is_onnx(path):
        return _inspect_onnx(path)
    ckpt, fam, resolved = load(path, family, eps)
    found = discover_layers(ckpt, fam, resolved)
    warnings = list(found.warnings)
    if resolved.source == "family-default":
        warnings.append(f"eps is not in {_config_name(ckpt)} (looked for {_eps_keys(ckpt, fam)}); "
                        f"the family default {_g(resolved.value)} is assumed")
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family '{fam.name}'")
    layers, nonfinite, nonpositive = [], [], []
    for layer in found.layers:
        stats = weight_stats(layer.weight)
        gain = None if stats["min"] is None else {"min": layer.gain_offset + stats["min"],
                                                   "max": layer.gain_offset + stats["max"]}
        if stats["nonfinite"]:
            nonfinite.append((layer.name, stats["nonfinite"]))
        if gain is not None and gain["min"] <= 0:
            nonpositive.append((layer.name, gain["min"]))
        layers.append({
            "name": layer.name, "kind": layer.kind, "dim": layer.dim, "shape": list(layer.shape),
            "order": layer.order, "bias": layer.bias is not None,
            "eps": {"value": layer.eps.value, "source": layer.eps.source},
            "weight": stats, "gain": gain, "gain_offset": layer.gain_offset,
            "rms_1pct": math.sqrt(ONE_PERCENT_Q_OVER_EPS * layer.eps.value),
            "warnings": layer.warnings,
        })
    # one line per kind of condition, with how many layers and which: a healthy 109-layer model
    # must not print 77 lines about it
    from parity_cli.report.grouping import layer_count, name_pattern

    universe = [l.name for l in found.layers]
    notes = []
    if nonfinite:
        names = [n for n, _ in nonfinite]
        warnings.append(f"non-finite weight values in {layer_count(len(names))} ({name_pattern(names, universe)}): "
                        f"{sum(c for _, c in nonfinite)} values; every output of those layers is NaN or inf")
    if nonpositive:
        names = [n for n, _ in nonpositive]
        notes.append(f"channels with effective gain <= 0 (lowest {min(v for _, v in nonpositive):.3g}) in "
                     f"{layer_count(len(names))} ({name_pattern(names, universe)}): common in trained weights, "
                     "and checked like any other gain")
    return {
        "schema_version": 1,
        "tool": {"name": "parity-cli", "version": __version__},
        "checkpoint": {"path": str(ckpt.path), "format": ckpt.format, "family": fam.name,
                       "model_type": ckpt.model_type, "files": [f.name for f in ckpt.files],
                       "unmatched": found.unmatched},
        "eps": _eps_dict(resolved),
        "layers": layers,
        "warnings": warnings,
        "notes": notes,
    }


def _inspect_onnx(path) -> dict:
    """An exported graph on its own: each norm found, its form, eps and where that came from,
    its gain (with any offset the graph adds), and the dtype it computes in."""
    import math
    from collections import Counter

    from parity_cli.check.layer import weight_stats
    from parity_cli.sources.onnx_graph import find_norms, load_model, reduced_words

    path = Path(path)
    model = load_model(path)
    norms = find_norms(model, path)
    if not norms:
        raise InputError(f"{path}: no norm found in the graph")
    layers = []
    for n in norms:
        stats = weight_stats(n.weight)
        gain = None if stats["min"] is None else {"min": n.offset + stats["min"], "max": n.offset + stats["max"]}
        layers.append({"name": n.name, "kind": n.kind, "dim": n.dim, "shape": list(n.weight.shape), "order": n.form,
                       "bias": n.bias is not None, "eps": {"value": n.eps, "source": n.eps_source},
                       "weight": stats, "gain": gain, "gain_offset": n.offset, "form": n.form, "dtype": n.dtype,
                       "rms_1pct": math.sqrt(ONE_PERCENT_Q_OVER_EPS * n.eps),
                       "warnings": [reduced_words(n.reduced)] if n.reduced else []})
    eps = Counter(n.eps for n in norms).most_common(1)[0][0]
    forms = Counter(n.form for n in norms)
    return {
        "schema_version": 1,
        "tool": {"name": "parity-cli", "version": __version__},
        "checkpoint": {"path": str(path), "format": "onnx", "family": "onnx graph",
                       "model_type": ", ".join(f"{k} x{v}" for k, v in forms.items()), "files": [path.name],
                       "unmatched": []},
        "eps": {"value": eps, "source": "the most common eps of its norms"},
        "layers": layers,
        "warnings": [],
        "notes": [f"{len(set(n.eps for n in norms))} distinct eps values across {len(norms)} norms"]
        if len(set(n.eps for n in norms)) > 1 else [],
    }


def stored_dtype(layers) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.stored_dtype] = counts.get(layer.stored_dtype, 0) + 1
    name = max(counts, key=counts.get)
    return name if name in DTYPES.values() else "float32"


def candidate_args(opts: CheckOptions) -> dict:
    from parity_cli.backends.implementations import parse_args

    return opts.candidate_args if isinstance(opts.candidate_args, dict) else parse_args(opts.candidate_args)


def timeout_of(opts: CheckOptions) -> float | None:
    """Seconds per layer: the default when unset, none at all only when asked for (inf)."""
    from parity_cli.isolation.supervisor import DEFAULT_TIMEOUT

    if opts.timeout is None:
        return DEFAULT_TIMEOUT
    return None if opts.timeout == float("inf") else float(opts.timeout)


def effective(opts: CheckOptions) -> CheckOptions:
    """The candidate when none is named: an exported .onnx copy runs its own subgraphs in ONNX
    Runtime; anything else gets torch's fused kernel."""
    import dataclasses

    from parity_cli.sources.onnx_graph import is_onnx

    if opts.candidate:
        return opts
    onnx_copy = opts.candidate_checkpoint and is_onnx(opts.candidate_checkpoint)
    return dataclasses.replace(opts, candidate="onnxruntime" if onnx_copy else "torch")


def converted(opts: CheckOptions, reference_layers) -> tuple:
    """--candidate-checkpoint: (its layers under the reference's names, the report's description
    of it, the dtype its norms compute in or None). GGUF and HF copies go through discovery like
    the reference; an .onnx graph through onnx_checkpoint."""
    import fnmatch

    from parity_cli.model.layers import discover_layers
    from parity_cli.sources.onnx_graph import candidate_layers, is_onnx

    if is_onnx(opts.candidate_checkpoint):
        layers, info = candidate_layers(opts.candidate_checkpoint, reference_layers)
        described = {"path": recorded_path(opts.candidate_checkpoint), "format": "onnx",
                     "family": reference_layers[0].family if reference_layers else None, "model_type": None,
                     "eps": info["eps"], "layers": len(layers), "unmatched": [], "onnx": info}
        dtype = info["dtype"]
    else:
        ckpt2, fam2, eps2 = load(opts.candidate_checkpoint)
        found2 = discover_layers(ckpt2, fam2, eps2)
        layers = found2.layers
        described = {"path": recorded_path(ckpt2.path), "format": ckpt2.format, "family": fam2.name,
                     "model_type": ckpt2.model_type, "eps": {"value": eps2.value, "source": eps2.source},
                     "layers": len(found2.layers), "unmatched": found2.unmatched}
        dtype = None
    if opts.layers:  # a --layers run compares those layers, and reports no others as extra
        layers = [l for l in layers if fnmatch.fnmatchcase(l.name, opts.layers)]
    return layers, described, dtype


# what `parity capture` writes in a capture's metadata, and so what a report repeats of it
CAPTURE_KEYS = ("fingerprint", "checkpoint", "model_class", "tokens", "rows_per_layer", "sampling", "seed", "device",
                "not_seen")


def with_captured(opts: CheckOptions, layers, everything):
    """(opts with the --activations rows of `layers`, the capture's metadata), or (opts, None)
    without --activations; `everything()` gives the whole model's layers (the fingerprint's).
    check() and the explain ladder both probe with the same rows."""
    if not opts.activations or opts.captured is not None:
        return opts, None
    import dataclasses

    from parity_cli.probes import capture

    rows, meta = capture.load(opts.activations, layers, everything())
    return dataclasses.replace(opts, captured=rows), meta


def check(path: str | Path, options: CheckOptions | None = None, progress=None, **kwargs):
    """Runs the whole check and returns a Report; raises InputError for bad input.

    `progress(done, total, layer_name)` is called before each layer (the CLI's progress bar)."""
    opts = effective(options or CheckOptions(**kwargs))
    from parity_cli.isolation import supervisor

    if supervisor.supervised(opts.candidate, opts.device, opts.isolation) or (
            parallel.resolve_jobs(opts.jobs) > 1 and not opts.candidate_checkpoint):
        supervisor.warm()  # the fork server imports torch while this process does
    with supervisor.deferred_interrupt():
        import torch

    from parity_cli.backends import implementations as impls
    from parity_cli.comparison import (
        ZERO_REFERENCE_RULE,
        grad_tolerance_for,
        tolerance_for,
    )
    from parity_cli.check.layer import Side, run_layers, setup_failure
    from parity_cli.model.layers import discover_layers
    from parity_cli.probes.strata import load_strata, select_strata
    from parity_cli.check.results import Report
    from parity_cli.isolation.supervisor import close_runners, open_reference, open_runners, parse_memory, printed_note

    if not 0.0 <= opts.max_violation_fraction <= 1.0:
        raise InputError("--max-violation-fraction must be between 0 and 1")
    for flag, value in (("--eps", opts.eps), ("--candidate-eps", opts.candidate_eps),
                        ("--atol", opts.atol), ("--rtol", opts.rtol)):
        if value is not None and not (value >= 0 and value != float("inf")):
            raise InputError(f"{flag} must be a finite number >= 0, got {value}")
    if opts.timeout is not None and not opts.timeout > 0:
        raise InputError(f"--timeout must be > 0 seconds (inf: no limit), got {opts.timeout}")
    strata = select_strata(opts.strata)
    device = check_device(opts.device)
    ref_device = reference_device(opts.reference_device, device, is_oracle(opts))
    ref_dtype_name = dtype_name(opts.reference_dtype)
    cand_args = candidate_args(opts)
    memory = parse_memory(opts.candidate_memory)
    # a plugin reference is loaded in its own supervised process (below), never here
    ref_plugin = supervisor.reference_supervised(opts.reference, opts.isolation)
    ref_impl = impls.precheck(opts.reference) if ref_plugin else impls.resolve(opts.reference)

    ckpt, fam, eps = load(path, opts.family, opts.eps)
    found = discover_layers(ckpt, fam, eps, opts.layers)
    if not found.layers:
        raise InputError(f"{ckpt.path}: no checkable norm layer ({'; '.join(found.warnings) or 'none matched'})")
    # the fingerprint covers the whole model, whatever --layers picked
    opts, captured_meta = with_captured(opts, found.layers, lambda: discover_layers(ckpt, fam, eps).layers
                                        if opts.layers else found.layers)
    pairing, conversion, copy_dtype = None, None, None
    if opts.candidate_checkpoint:
        from parity_cli.model.pairing import pair

        copy_layers, conversion, copy_dtype = converted(opts, found.layers)
        if conversion["format"] == "onnx" and opts.candidate == "onnxruntime":
            # the graph's own subgraphs run: its eps, its form, its dtype; nothing here would change them
            for flag, given in (("--candidate-eps", opts.candidate_eps is not None),
                                ("--candidate-arg", bool(candidate_args(opts)))):
                if given:
                    raise InputError(f"{flag}: an exported .onnx copy runs its own subgraphs, with the eps and form "
                                     "it has; edit the graph, or check another candidate against its weights")
        pairing = pair(found.layers, copy_layers, conversion["path"])
        conversion["findings"] = sum(len(v) for v in pairing.layer_findings.values()) + len(pairing.report_findings)
    # an exported graph computes in its own input type (float32 for most exports): probe it there
    cand_dtype_name = dtype_name(opts.dtype) if opts.dtype else (copy_dtype or stored_dtype(found.layers))
    tol = tolerance_for(cand_dtype_name, opts.atol, opts.rtol, exact=opts.exact)
    grad_tol = grad_tolerance_for(cand_dtype_name, exact=opts.exact) if opts.grad else None

    warnings = list(found.warnings)
    if eps.source == "family-default":
        warnings.append(
            f"eps is not in {_config_name(ckpt)} (looked for {_eps_keys(ckpt, fam)}); "
            f"using the family default {_g(eps.value)}"
        )
    if found.unmatched:
        warnings.append(f"{len(found.unmatched)} norm-like tensor(s) match no pattern of family "
                        f"'{fam.name}' and were not checked: {', '.join(found.unmatched[:10])}")

    workers = max(1, min(resolve_jobs(opts.jobs), len(found.layers)))
    if not (isinstance(opts.threads, int) and opts.threads >= 1):
        raise InputError(f"--threads must be a whole number >= 1, got {opts.threads}")
    timeout = timeout_of(opts)
    if opts.candidate_memory is None and memory is not None:
        memory //= workers * (2 if ref_plugin else 1)  # the default is half of RAM for all the children together
    sharded = workers > 1 and parallel.shardable(opts, device)
    if sharded:  # whole layers in worker processes: our own code end to end (parity_cli.check.parallel)
        cand_impl, runners = impls.resolve(opts.candidate, cand_args), []
    else:
        cand_impl, runners = open_runners(opts.candidate, cand_args, device, opts.isolation, timeout, memory, workers,
                                          threads=opts.threads)
    ref_runner = None
    if ref_plugin:  # supervised exactly as the candidate: its exit, hang or memory is the user's input
        try:
            ref_impl, ref_runner = open_reference(opts.reference, ref_device, timeout, memory, max(1, len(runners)),
                                                  opts.threads)
        except BaseException:
            close_runners(runners)
            raise
    reference = Side(ref_impl, opts.reference, getattr(torch, ref_dtype_name), ref_device, runner=ref_runner)
    isolated = any(getattr(r, "isolated", False) for r in runners)
    threads = torch.get_num_threads()
    try:
        # One intra-op thread per process unless asked: on tensors of 8K-82K elements a second
        # thread gains 1.03-1.19x idle, and on a loaded CI box the pool spins against the load
        # (213 s against 14.7 s measured, BENCHMARKS.md). Parallelism comes from --jobs.
        torch.set_num_threads(opts.threads)
        if sharded:
            plan = parallel.Plan(str(path), opts, cand_dtype_name, tol, grad_tol, tuple(strata), timeout)
            results = parallel.check_shards(plan, [layer.name for layer in found.layers], workers, progress)
        else:
            candidates = [Side(cand_impl, opts.candidate, getattr(torch, cand_dtype_name), device, opts.candidate_eps,
                               r) for r in runners]
            results = run_layers(found.layers, pairing, reference, candidates, strata, tol, opts, grad_tol, progress)
        note = printed_note(runners)
    finally:
        torch.set_num_threads(threads)
        close_runners(runners + ([ref_runner] if ref_runner else []))
    setup = setup_failure(results, opts.candidate)
    if setup:  # the same InputError from every layer's build, no output anywhere: exit 2, not a verdict
        raise InputError(setup)
    if note:
        warnings.append(note)

    header = {
        "tool": {"name": "parity-cli", "version": __version__},
        "environment": environment(device, threads=opts.threads, jobs=workers),
        "checkpoint": {
            "path": recorded_path(ckpt.path),
            "fingerprint": fingerprint(found.layers),
            "format": ckpt.format,
            "family": fam.name,
            "model_type": ckpt.model_type,
            "files": [f.name for f in ckpt.files],
            "unmatched": found.unmatched,
        },
        "eps": _eps_dict(eps),
        "reference": {"impl": ref_impl.name, "source": ref_impl.source, "dtype": ref_dtype_name,
                      "device": ref_device, "eps": eps.value},
        "candidate": {"impl": recorded_spec(cand_impl.name), "source": cand_impl.source, "dtype": cand_dtype_name,
                      "device": device, "args": cand_args,
                      "eps": opts.candidate_eps if opts.candidate_eps is not None else (
                          conversion["eps"]["value"] if conversion else eps.value),
                      "eps_source": "option:--candidate-eps" if opts.candidate_eps is not None else (
                          conversion["eps"]["source"] if conversion else eps.source),
                      "checkpoint": conversion,
                      "timeout": timeout, "isolation": opts.isolation, "isolated": isolated,
                      "memory_cap": memory if isolated else None, "workers": workers,
                      "threads": opts.threads},
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
            "strata": [s.name for s in strata] + (["captured"] if captured_meta else []),
            "not_covered": [n for n in load_strata() if n not in {s.name for s in strata}],
            "descriptions": {s.name: s.description for s in strata},
            "rounding": f"probes are rounded to {cand_dtype_name}; the reference sees the rounded values",
            "grad": opts.grad,
            "layers": opts.layers,
            "activations": None if captured_meta is None else {
                **{k: captured_meta[k] for k in CAPTURE_KEYS if k in captured_meta},  # only what we wrote
                "path": recorded_path(opts.activations), "layers": sorted(opts.captured)},
        },
    }
    return Report(header=header, layers=results, warnings=warnings,
                  findings=pairing.report_findings if pairing else [])


def explain(path: str | Path, options: CheckOptions | None = None, layer_names: list[str] | None = None,
            **kwargs) -> dict:
    """The one-factor-at-a-time ladder for the failing (or named) layers; see parity_cli.explain."""
    from parity_cli.explain import explain as ladder

    return ladder(path, options or CheckOptions(**kwargs), layer_names)
