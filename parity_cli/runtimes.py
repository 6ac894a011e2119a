"""`parity runtimes CKPT`: one checkpoint through every installed runtime built-in, at each dtype,
as one table: runtime x dtype -> verdict, cause, worst/allowed. The page an engineer brings to a
deployment review: which runtime is safe for this checkpoint, and why not the others.

Each cell is a whole `parity check` (supervised, the same probes and tolerances), so a cell says
exactly what `parity check --candidate RUNTIME --dtype DTYPE` says. A runtime that is not
installed is listed as such, with its install command; a runtime that has no kernel for the
model's norms, or for a dtype, is "refused" with its one line: neither is a failure of the model."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from parity_cli.errors import AdapterError, InputError

# the rows before the registered runtimes: torch eager (the baseline every other row is read against)
# and the model's own transformers class; then every runtime file of parity_cli.backends, in its order
_EAGER = {
    "torch": ("torch.nn.functional's fused norm (the baseline every other row is read against)", "torch",
              "pip install torch"),
    "transformers": ("the model's own transformers module class", "transformers", "pip install transformers"),
}


def known() -> dict:
    """{runtime: (what it runs, the module whose presence says it is installed, how to install it)}."""
    from parity_cli.backends import registered

    return {**_EAGER, **{name: (m.RUNTIME.summary, m.RUNTIME.package, m.RUNTIME.install)
                         for name, m in registered().items()}}


DTYPES = ("float32", "bfloat16", "float16")


# what a runtime computes in, shortly, for the table's "runs in" column (describe() says it at length)
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


VERDICTS = ("pass", "fail", "refused", "not installed", "error", "adapter")


@dataclass
class Cell:
    runtime: str
    dtype: str
    verdict: str  # pass, fail, refused, not installed, error, adapter (parity's adapter disagrees with the runtime)
    cause: str = ""
    worst_over_allowed: float | None = None  # over the finite outputs; `nonfinite` says where there were others
    layers: int = 0
    failed: int = 0
    runtime_version: str | None = None
    nonfinite: bool = False  # some output was inf/NaN where the oracle is finite
    vs_torch_same_dtype: dict | None = None  # check.severity: the worst error over torch eager's
    computes_in: str | None = None  # what the runtime really computes in (llama.cpp: f32; OpenVINO: its plugin's)
    seconds: float | None = None
    unchecked: list = field(default_factory=list)  # the checkpoint's norms this check did not cover

    @property
    def ran(self) -> bool:
        return self.verdict in ("pass", "fail", "error", "adapter")

    def as_dict(self) -> dict:
        from parity_cli.check.results import jfloat

        out = dict(self.__dict__)
        if out["worst_over_allowed"] is not None:
            out["worst_over_allowed"] = jfloat(out["worst_over_allowed"])
        return out

    @classmethod
    def from_dict(cls, data, runtime: str, dtypes: list) -> Cell:
        """A cell a runtime's process sent (JSON): its known fields, each of its type, for this runtime and
        one of the dtypes asked; anything else is that process's error."""
        from parity_cli.check.results import unjfloat

        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - set(fields) or data.get("runtime") != runtime or \
                data.get("dtype") not in dtypes or data.get("verdict") not in VERDICTS:
            raise ValueError("not a cell of this runtime")
        out = cls(**data)
        out.worst_over_allowed = unjfloat(out.worst_over_allowed)
        for name, kind in (("cause", str), ("layers", int), ("failed", int), ("nonfinite", bool),
                           ("unchecked", list)):
            if not isinstance(getattr(out, name), kind):
                raise ValueError(f"a cell's {name} is not a {kind.__name__}")
        return out


@dataclass
class Table:
    checkpoint: str
    cells: list = field(default_factory=list)
    basis: dict = field(default_factory=dict)  # what every cell's semantics rest on (pipeline.basis)

    @property
    def passed(self) -> bool:
        return self.verdict().passed

    def verdict(self):
        """report.gate's, as every command's."""
        from parity_cli.report.gate import runtimes_verdict

        return runtimes_verdict(self.as_dict())

    @property
    def unchecked(self) -> list:
        """The checkpoint's norms no cell checked (the same for every cell that ran): a verdict says it."""
        return next((c.unchecked for c in self.cells if c.ran and c.unchecked), [])

    def as_dict(self) -> dict:
        from parity_cli.report.gate import runtimes_verdict

        data = {"checkpoint": self.checkpoint, "unchecked": self.unchecked, "basis": self.basis,
                "cells": [c.as_dict() for c in self.cells]}
        return {**data, "verdict": runtimes_verdict(data).word.lower()}


def installed(runtime: str) -> bool:
    try:
        return importlib.util.find_spec(known()[runtime][1]) is not None
    except (ImportError, ValueError):
        return False


def _worst(data: dict) -> tuple[float | None, bool]:
    """(the largest |cand - ref| / allowed over every compared stratum of every layer whose outputs
    are finite, whether any stratum's candidate went non-finite where the reference did not). A
    non-finite stratum's worst element may be a finite one: it never stands for the stratum."""
    from parity_cli.report.grouping import times_allowed

    best, nonfinite = None, False
    for layer in data["layers"]:
        for s in layer.get("strata", []):
            counts = s.get("nonfinite") or {}
            if (counts.get("candidate") or 0) > (counts.get("reference") or 0):
                nonfinite = True
                continue
            if isinstance(s.get("worst"), dict):  # the pass rule's own ratio (exact: a difference is inf)
                ratio = times_allowed(s["worst"])
                best = ratio if best is None else max(best, ratio)
    return best, nonfinite


def version(runtime: str) -> str | None:
    """The installed distribution's version, read from its metadata (nothing imported)."""
    from parity_cli.backends import distribution_version, registered

    module = registered().get(runtime)
    found = distribution_version(*((module.RUNTIME.distributions if module else ()) or (runtime,)))
    return None if found is None else found.split("-releases")[0]


def computes_in(runtime: str, dtype: str, candidate: dict | None) -> str:
    """What the runtime really computes the probes in, shortly, as its file says (llama.cpp and vLLM
    upcast to float32 whatever the probe dtype; OpenVINO's plugin runs its inference precision, bf16
    by default on a CPU with avx512_bf16/AMX); the others compute in the probe's dtype."""
    from parity_cli.backends import registered

    module = registered().get(runtime)
    hook = getattr(module, "computes_in", None)
    if hook is None:
        return _SHORT.get(dtype, dtype)
    return hook(dtype, (candidate or {}).get(module.RUNTIME.header))


def _ran(runtime: str, dtype: str, report) -> Cell:
    from parity_cli.report.terminal import quiet_line

    data = report.to_dict()
    summary = data["summary"]
    line = quiet_line(data)
    worst, nonfinite = _worst(data)
    return Cell(runtime, dtype, "pass" if report.passed else "fail",
                "" if report.passed else line.partition(": ")[2] or line, worst, summary.get("layers", 0),
                summary.get("failed", 0) + summary.get("errors", 0), version(runtime), nonfinite,
                data["candidate"].get("vs_torch_same_dtype"), computes_in(runtime, dtype, data["candidate"]),
                unchecked=list(data["checkpoint"].get("unchecked") or []))


def cell(path, runtime: str, dtype: str, torch_baseline=None, **options) -> Cell:
    """One runtime at one dtype: a whole `parity check --candidate RUNTIME --dtype DTYPE`, read
    against `torch_baseline` (the same check with torch) where given."""
    import time

    from parity_cli import pipeline

    if not installed(runtime):
        return Cell(runtime, dtype, "not installed", known()[runtime][2])
    started = time.monotonic()
    try:
        report = torch_baseline if runtime == "torch" and torch_baseline is not None else pipeline.check(
            path, candidate=runtime, dtype=dtype, torch_baseline=torch_baseline, **options)
    except AdapterError as exc:  # parity's adapter and the runtime's own path disagree: parity's fault
        return Cell(runtime, dtype, "adapter", str(exc), runtime_version=version(runtime))
    except InputError as exc:
        return Cell(runtime, dtype, "refused", str(exc).removeprefix("--candidate ").splitlines()[0],
                    runtime_version=version(runtime))
    out = _ran(runtime, dtype, report)
    out.seconds = time.monotonic() - started
    return out


def _cpus() -> int:
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _nothing_ran(path, cells: list) -> str:
    """The one line of a table where no runtime checked anything: each refusal's reason once."""
    reasons: dict = {}
    for c in cells:
        why = f"not installed ({c.cause})" if c.verdict == "not installed" else c.cause or c.verdict
        reasons.setdefault(why, []).append(f"{c.runtime} {c.dtype}")
    said = "; ".join(f"{', '.join(who[:3])}{' ...' if len(who) > 3 else ''}: {why}" for why, who in reasons.items())
    return f"{path}: no runtime checked any layer ({said})"


def _baseline(path, dtype: str, options: dict):
    """torch eager at `dtype` on the same layers and probes: the torch row, and what every other
    row's severity is read against. None where torch refuses (then the checkpoint's own refusal
    is each cell's)."""
    from parity_cli import pipeline

    try:
        return pipeline.check(path, candidate="torch", dtype=dtype, **options)
    except InputError:
        return None


def cells_of(send, path, runtime: str, dtypes: list, options: dict, baselines: dict) -> None:
    """A runtime's cells, one dtype after another, in one process (supervisor.Task): its import,
    its compiled programs and the self-check's public path shared across its dtypes. The process is
    the isolation: the checks inside it run in it."""
    import torch

    torch.set_num_threads(1)
    for dtype in dtypes:
        try:
            found = cell(path, runtime, dtype, baselines.get(dtype), **{**options, "isolation": "none"})
        except Exception as exc:  # a Python exception the check did not make a finding: the cell's error
            found = Cell(runtime, dtype, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                         runtime_version=version(runtime))
        send(found.as_dict())


def _warm_cells(path, chosen: list, dtypes: list, options: dict, workers: int, report, baselines: dict) -> dict:
    """{(runtime, dtype): Cell} with one warm process a runtime (at most `workers` at once, the
    slowest runtimes first); a process that dies or hangs leaves its remaining cells `error`."""
    from multiprocessing.connection import wait

    from parity_cli.backends import runtime as runtime_file
    from parity_cli.isolation.supervisor import DEFAULT_TIMEOUT, Task

    def start_cost(name: str) -> float:  # what the runtime's file declares (torch and transformers: none)
        module = runtime_file(name)
        return module.RUNTIME.start_seconds if module is not None else 0.0

    queue = sorted(chosen, key=lambda r: -start_cost(r))  # stable: table order among equals
    running: dict = {}  # connection -> (task, runtime, dtypes still to come)
    cells: dict = {}
    per_cell = DEFAULT_TIMEOUT * 4 if options.get("timeout") is None else float(options["timeout"]) * 4
    try:
        while queue or running:
            while queue and len(running) < workers:
                runtime = queue.pop(0)
                task = Task("parity_cli.runtimes:cells_of", str(path), runtime, list(dtypes), options, baselines)
                running[task.conn] = (task, runtime, list(dtypes))
            for conn in wait(list(running), per_cell):
                task, runtime, left = running[conn]
                got = task.receive(0)
                try:
                    got = None if got is None else Cell.from_dict(got, runtime, left)
                except (TypeError, ValueError):  # not a cell: the process lied, and is stopped like a dead one
                    task.kill()
                    task.garbled, got = True, None
                if got is None:  # ended: what it did not send is an error of that process
                    for dtype in left:
                        cells[runtime, dtype] = Cell(runtime, dtype, "error", f"the {runtime} process {task.why()}",
                                                     runtime_version=version(runtime))
                        report(cells[runtime, dtype])
                    task.close()
                    del running[conn]
                    continue
                left.remove(got.dtype)
                cells[runtime, got.dtype] = got
                report(got)
    finally:
        for task, _, _ in running.values():
            task.close()
    return cells


_BASIS = ("family", "model_type", "family_forced", "family_contradiction", "family_moved")


def table(path, runtimes: list[str] | None = None, dtypes: list[str] | None = None, progress=None,
          **options) -> Table:
    """Every runtime in `runtimes` (default: all known) at every dtype; the checkpoint's own
    errors (a bad path, no norm) are the caller's InputError, raised before any runtime runs, and
    a table where no cell ran is one too. `progress(cell, done, total)` hears each cell as it ends."""
    everything = known()
    chosen = list(runtimes or everything)
    unknown = [r for r in chosen if r not in everything]
    if unknown:
        raise InputError(f"--runtimes: unknown runtime {', '.join(unknown)}; known: {', '.join(everything)}")
    bad = [d for d in (dtypes or DTYPES) if d not in DTYPES]
    if bad:
        raise InputError(f"--dtypes: {', '.join(bad)}; use {', '.join(DTYPES)}")
    from parity_cli.model.load import load

    load(path)  # the checkpoint's own faults are one line before any runtime runs
    out = Table(str(path))
    dtypes = list(dtypes or DTYPES)
    total, done = len(chosen) * len(dtypes), []

    def report(c: Cell) -> None:
        done.append(c)
        if progress is not None:
            progress(c, len(done), total)

    from parity_cli import pipeline

    # torch at the first dtype, before any runtime: a checkpoint check refuses (an int8 gain, no norm at
    # all) is one line here, not a table of refusals; it is also that dtype's baseline
    first = pipeline.check(path, candidate="torch", dtype=dtypes[0], **options)
    out.basis = {"checkpoint": {k: first.header["checkpoint"][k] for k in _BASIS if k in first.header["checkpoint"]},
                 "eps": first.header["eps"]}
    # torch eager at each dtype, once: the torch rows, and what every other row's severity is read against
    baselines = {dtype: first if dtype == dtypes[0] else _baseline(path, dtype, options) for dtype in dtypes}
    cells = {}
    if "torch" in chosen:
        for dtype in dtypes:
            cells["torch", dtype] = cell(path, "torch", dtype, baselines[dtype], **options)
            report(cells["torch", dtype])
    rest = [r for r in chosen if r != "torch"]
    absent = [r for r in rest if not installed(r)]
    for runtime in absent:
        for dtype in dtypes:
            cells[runtime, dtype] = cell(path, runtime, dtype, **options)
            report(cells[runtime, dtype])
    rest = [r for r in rest if r not in absent]
    if options.get("isolation", "auto") == "auto" and rest:  # one warm process a runtime, two at once on 2 CPUs
        cells.update(_warm_cells(path, rest, dtypes, options, _cpus(), report, baselines))
    else:
        for dtype in dtypes:
            for runtime in rest:
                cells[runtime, dtype] = cell(path, runtime, dtype, baselines[dtype], **options)
                report(cells[runtime, dtype])
    out.cells = [cells[runtime, dtype] for runtime in chosen for dtype in dtypes]
    if not any(c.ran for c in out.cells):
        raise InputError(_nothing_ran(path, out.cells))
    return out
