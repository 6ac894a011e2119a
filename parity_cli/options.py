"""Options as the stages need them: CheckOptions, dtype names, candidate arguments, the
reference device. Its own module so that every stage (capture, explain, --jobs workers, a
replayed report) resolves an option the same way without importing the api facade above them.

Torch is imported inside the functions that need a device: the CLI parses options before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from parity_cli.errors import InputError

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
    family_force: bool = False  # --family-force: check with a --family whose semantics the model type contradicts
    eps: float | None = None  # overrides the checkpoint's eps for both sides
    candidate_eps: float | None = None  # the candidate alone (simulates a deployment config)
    atol: float | None = None
    rtol: float | None = None
    strata: list[str] | None = None
    seed: int = 0
    layers: str | None = None
    max_violation_fraction: float = 0.0
    # None: float64, except under --exact with a reference other than the oracle, where it is the
    # candidate's dtype (reference_dtype_for): a bitwise-equal candidate then passes
    reference_dtype: str | None = None
    reference_device: str = "auto"  # auto: the candidate's GPU when it has fast float64, else the CPU
    exact: bool = False  # bitwise: atol = rtol = 0, no allowance
    candidate_args: list[str] | dict | None = None  # KEY=VALUE for the candidate's constructor/function
    candidate_checkpoint: str | None = None  # a converted copy: the candidate uses its weights and eps
    grad: bool = False  # backward parity too
    timeout: float | None = None  # seconds per layer for the candidate; None: 120 s; inf: no limit
    jobs: int | str = 1  # workers over layers; "auto": one per CPU this process may run on
    threads: int = 1  # torch intra-op threads per process (the parent's and each candidate child's)
    isolation: str = "auto"  # auto | process | none (isolation.supervisor.open_runners)
    candidate_memory: str | int | None = None  # cap on the candidate's resident memory; None: half of RAM
    activations: str | None = None  # a `parity capture` file: a `captured` stratum of real rows per layer
    captured: dict | None = None  # its rows by layer, once loaded (check() fills it)
    runtime_capture: str | None = None  # a `parity capture --runtime` file: the runtime's rows, eps and gains


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
    return opts.reference == "oracle" and dtype_name(opts.reference_dtype or "float64") == "float64"


# the report's reference.dtype_source: where the reference's dtype came from
REFERENCE_DTYPE_SOURCES = {
    "option:--reference-dtype": "given with --reference-dtype",
    "candidate:--exact": "the candidate's, for --exact",
    "default": "the default",
}


def reference_dtype_for(opts, candidate_dtype: str) -> tuple[str, str]:
    """(the reference's dtype, where it came from: a REFERENCE_DTYPE_SOURCES key). --reference-dtype
    when given; else, under --exact with a reference other than the oracle (hf, a plugin), the
    candidate's dtype, since bitwise equality with an implementation is asked at the dtype both
    run at (at float64 a bitwise-equal float32 candidate fails); else float64."""
    if opts.reference_dtype is not None:
        return dtype_name(opts.reference_dtype), "option:--reference-dtype"
    if opts.exact and opts.reference != "oracle":
        return dtype_name(candidate_dtype), "candidate:--exact"
    return "float64", "default"


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


def parse_args(pairs) -> dict:
    """--candidate-arg key=value pairs; a value is JSON where it parses (1.0, true, "x", [1]), else a string."""
    import json

    args = {}
    for pair in pairs or ():
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise InputError(f"--candidate-arg '{pair}': expected KEY=VALUE with KEY a Python identifier")
        try:
            args[key] = json.loads(raw)
        except ValueError:
            args[key] = raw
        except RecursionError:  # [[[...]]] past the parser's depth: no argument is nested so deep
            raise InputError(f"--candidate-arg {key}: the value is nested too deeply to be an argument; "
                             "refused") from None
    return args


def stored_dtype(layers) -> str:
    counts: dict[str, int] = {}
    for layer in layers:
        counts[layer.stored_dtype] = counts.get(layer.stored_dtype, 0) + 1
    name = max(counts, key=counts.get)
    return name if name in DTYPES.values() else "float32"


def candidate_args(opts: CheckOptions) -> dict:
    return opts.candidate_args if isinstance(opts.candidate_args, dict) else parse_args(opts.candidate_args)


ONE_PERCENT_Q_OVER_EPS = 1 / (0.99 ** -2 - 1)  # 49.2512562814: q/eps where A = 0.99


def uses_transformers(opts: CheckOptions) -> bool:
    """The transformers module classes run as the candidate or the reference (torch.compile compiles
    them): each norm's class is then the one the installed transformers builds (bind_classes)."""
    return bool({"transformers", "torch.compile"} & {opts.candidate, opts.reference})
