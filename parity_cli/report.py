"""Stage 7: results -> the JSON report (a contract, see BRIEF §3) and the terminal table.

Checking produced values; this module only turns them into words and files."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.comparison import StratumResult
from parity_cli.diagnosis import Diagnosis

SCHEMA_VERSION = 1


def jfloat(value: float):
    """JSON has no inf/nan: non-finite numbers become the strings "inf", "-inf", "nan"."""
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def unjfloat(value):
    """The inverse of jfloat, for every reader of a report dict: "inf"/"-inf"/"nan" back to floats
    (None stays None), so renderers compare and format numbers, never strings."""
    return float(value) if isinstance(value, str) else value


def worst(values, default=None):
    """The largest error, NaN counting as the largest of all (an error that is not even a number
    is worse than any finite one); strings from JSON are read back as numbers."""
    nums = [unjfloat(v) for v in values if v is not None]
    if not nums:
        return default
    if any(math.isnan(v) for v in nums):
        return math.nan
    return max(nums)


def least(values, default=None):
    nums = [v for v in (unjfloat(v) for v in values if v is not None) if not math.isnan(v)]
    return min(nums) if nums else default


@dataclass
class LayerResult:
    name: str
    kind: str
    dim: int
    eps: dict
    weight: dict
    strata: list[StratumResult]
    diagnoses: list[Diagnosis] = field(default_factory=list)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    grad: list[StratumResult] = field(default_factory=list)  # --grad: "<stratum>:dx", "<stratum>:dweight"
    shape: list[int] | None = None
    candidate_eps: dict | None = None  # where the candidate's eps differs in origin (--candidate-checkpoint)
    findings: list[dict] = field(default_factory=list)  # checkpoint-vs-checkpoint differences; each fails

    @property
    def status(self) -> str:
        checked = self.strata + self.grad
        if self.error is not None or any(s.status == "error" for s in checked):
            return "error"
        return "fail" if self.findings or any(s.status == "fail" for s in checked) else "pass"

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Report:
    header: dict  # tool, environment, checkpoint, eps, reference, candidate, tolerance, probes
    layers: list[LayerResult]
    warnings: list[str] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)  # report-level: e.g. layers only the candidate has

    @property
    def passed(self) -> bool:
        return not self.findings and all(layer.passed for layer in self.layers)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def summary(self) -> dict:
        statuses = [layer.status for layer in self.layers]
        return {
            "layers": len(statuses),
            "passed": statuses.count("pass"),
            "failed": statuses.count("fail"),
            "errors": statuses.count("error"),
            "verdict": "pass" if self.passed else "fail",
        }

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            **self.header,
            "layers": [_layer_dict(layer) for layer in self.layers],
            "warnings": list(self.warnings),
            "findings": _jsonable(self.findings),
            "summary": self.summary(),
        }


def _stratum_dict(s: StratumResult) -> dict:
    return {
        "name": s.name,
        "status": s.status,
        "error": s.error,
        "vectors": s.vectors,
        "elements": s.elements,
        "q_over_eps": {"min": jfloat(s.q_over_eps[0]), "max": jfloat(s.q_over_eps[1])},
        "attenuation": {"min": jfloat(s.attenuation[0]), "max": jfloat(s.attenuation[1])},
        "max_abs_err": jfloat(s.max_abs_err),
        "max_rel_err": jfloat(s.max_rel_err),
        "violations": s.violations,
        "violation_fraction": s.violation_fraction,
        "max_ulp": None if s.max_ulp is None else jfloat(s.max_ulp),
        "failing_q_over_eps": None if s.failing_q_over_eps is None else {
            "min": jfloat(s.failing_q_over_eps[0]), "max": jfloat(s.failing_q_over_eps[1])},
        "nonfinite": {"reference": s.nonfinite_reference, "candidate": s.nonfinite_candidate},
        "worst": None if s.worst is None else {
            "vector": s.worst.vector,
            "index": s.worst.index,
            "input": jfloat(s.worst.input),
            "reference": jfloat(s.worst.reference),
            "candidate": jfloat(s.worst.candidate),
            "allowed": jfloat(s.worst.allowed),
        },
    }


def _jsonable(value):
    if isinstance(value, float):
        return jfloat(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _layer_dict(layer: LayerResult) -> dict:
    return {
        "name": layer.name,
        "kind": layer.kind,
        "dim": layer.dim,
        "status": layer.status,
        "error": layer.error or next((f"{s.name}: {s.error}" for s in layer.strata if s.error), None),
        "eps": layer.eps,
        "weight": _jsonable(layer.weight),
        "strata": [_stratum_dict(s) for s in layer.strata],
        "diagnoses": [{"code": d.code, "message": d.message, **_jsonable(d.evidence)} for d in layer.diagnoses],
        "warnings": list(layer.warnings),
        "shape": layer.shape,
        "grad": [_stratum_dict(s) for s in layer.grad],
        "candidate_eps": _jsonable(layer.candidate_eps),
        "findings": _jsonable(layer.findings),
    }


def json_text(data: dict) -> str:
    """The one serialisation of a report: strict JSON (non-finite numbers are already strings)."""
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def write_json(data: dict, path: str | Path) -> None:
    write_files({path: json_text(data)})


def write_files(outputs: dict) -> None:
    """All or nothing: every output goes to a temporary file first, then all are renamed, so an
    interrupted or failed run leaves no partial report and no half of the set."""
    staged = []
    try:
        for path, text in outputs.items():
            staged.append((_stage(text, Path(path)), Path(path)))
        with _signals_held():
            for tmp, path in staged:
                os.replace(tmp, path)
    except OSError as exc:
        from parity_cli.errors import InputError

        raise InputError(f"{exc.filename or ''}: cannot write report: {exc.strerror or exc}") from None
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)


class _signals_held:
    """Ctrl-C or SIGTERM between two renames would leave half a set: for the few renames the
    handlers only take note, and the first signal noted is acted on right after, with the set
    complete. (Masking would not do: the kernel hands a process signal to any thread, and torch
    has threads.) Outside the main thread handlers cannot be changed, and nothing is held."""

    def __enter__(self):
        import signal
        import threading

        self.noted, self.saved = [], {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, lambda signum, frame: self.noted.append((signum, frame)))
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if self.noted and exc[0] is None:
            signum, frame = self.noted[0]
            handler = self.saved.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
        return False


def _stage(text: str, path: Path) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is not what a report file should have
        return tmp
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --- terminal ----------------------------------------------------------------------------

def _fmt(value) -> str:
    value = unjfloat(value)
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.3g}"


def render(d: dict, console) -> None:
    """A row per layer, then one line per diagnosis of each failing layer (from the report dict,
    so a saved report renders the same)."""
    from rich.markup import escape as _e  # paths, names and messages are data, never markup
    from rich.table import Table

    cand, ref, tol = d["candidate"], d["reference"], d["tolerance"]
    console.print(
        f"[bold]{_e(d['checkpoint']['path'])}[/] family [bold]{d['checkpoint']['family']}[/], "
        f"eps {d['eps']['value']:.3g} ({_e(d['eps']['source'])})"
    )
    console.print(
        f"candidate [bold]{_e(cand['impl'])}[/] {cand['dtype']} on {cand['device']} eps {cand['eps']:.3g}  vs  "
        f"reference {_e(ref['impl'])} {ref['dtype']} eps {ref['eps']:.3g}   atol {tol['atol']:g} rtol {tol['rtol']:g}"
        + ("  (bitwise)" if tol.get("exact") else "") + ("  +grad" if d["probes"].get("grad") else "")
    )
    conv = cand.get("checkpoint")
    if conv:
        console.print(f"candidate checkpoint [bold]{_e(conv['path'])}[/] ({conv['format']}, family {conv['family']}), "
                      f"eps {conv['eps']['value']:.6g} ({_e(conv['eps']['source'])}): {conv['findings']} difference(s)")
    table = Table(show_edge=False, header_style="bold")
    for col in ("layer", "dim", "status", "failing strata", "max abs err", "max rel err", "q/eps (failing)"):
        table.add_column(col, justify="right" if col in ("dim", "max abs err", "max rel err") else "left",
                         no_wrap=col in ("layer", "q/eps (failing)", "status"))
    colours = {"pass": "green", "fail": "red", "error": "magenta"}
    for layer in d["layers"]:
        strata = layer["strata"] + layer.get("grad", [])
        failing = [s["name"] for s in strata if s["status"] != "pass"]
        failing += [f["code"] for f in layer.get("findings", [])]
        finite = [s for s in strata if s["status"] != "error"]
        # q/eps of the rows that failed tells the story (small -> eps, large -> overflow); else
        # the range covered. Older reports lack the failing rows' range: their strata's then.
        shown = [s.get("failing_q_over_eps") or s["q_over_eps"] for s in finite if s["status"] == "fail"] \
            or [s["q_over_eps"] for s in finite]
        qmin = least((q["min"] for q in shown), default=0)
        qmax = worst((q["max"] for q in shown), default=0)
        table.add_row(
            _e(layer["name"]),
            str(layer["dim"]),
            f"[{colours[layer['status']]}]{layer['status']}[/]",
            _e(", ".join(failing)) or "-",
            _fmt(worst((s["max_abs_err"] for s in finite), default=0)),
            _fmt(worst((s["max_rel_err"] for s in finite), default=0)),
            f"{_fmt(qmin)} .. {_fmt(qmax)}",
        )
    console.print(table)
    if len(d["layers"]) > 1:
        render_heat(d, console)
    for layer in d["layers"]:
        if layer["error"]:
            console.print(f"  [magenta]{_e(layer['name'])}[/]: candidate error: {_e(layer['error'])}")
        for finding in layer.get("findings", []):
            console.print(f"  [red]{_e(layer['name'])}[/] [bold]{finding['code']}[/]: {_e(finding['message'])}")
        for diag in layer["diagnoses"]:
            console.print(f"  [red]{_e(layer['name'])}[/] [bold]{diag['code']}[/]: {_e(diag['message'])}")
    for layer in d["layers"]:
        for warning in layer["warnings"]:
            console.print(f"[yellow]warning:[/] {_e(layer['name'])}: {_e(warning)}")
    for warning in d["warnings"]:
        console.print(f"[yellow]warning:[/] {_e(warning)}")
    for finding in d.get("findings", []):
        console.print(f"[red]{_e(finding['code'])}[/]: {_e(finding['message'])}")
    s = d["summary"]
    gate = d.get("gate") or {}
    for key, label in (("accepted", "accepted by the baseline"), ("gone", "in the baseline but gone")):
        items = gate.get("baseline", {}).get(key, [])
        if items:
            console.print(f"{len(items)} finding(s) {label}: "
                          + ", ".join(f"{f['layer']}/{f['stratum']}/{f['code']}" for f in items[:10]))
    verdict = "[green]PASS[/]" if gate.get("verdict", s["verdict"]) == "pass" else "[red]FAIL[/]"
    console.print(
        f"{verdict}: {s['passed']}/{s['layers']} layers pass, {s['failed']} fail, {s['errors']} error; "
        f"strata: {', '.join(d['probes']['strata'])}"
    )


# --- the heat grid: every layer x every stratum in a few lines -----------------------------------

# (upper bound of worst error / allowed, character, colour). Characters alone carry the meaning,
# so the grid reads the same with NO_COLOR or in a CI log.
HEAT_LEVELS = ((0.1, "·", "green"), (0.5, "░", "green"), (1.0, "▒", "yellow"), (10.0, "▓", "red"),
               (math.inf, "█", "red"))


def _ratio(stratum: dict) -> float | None:
    """Worst element's error over what it was allowed: < 1 passes, > 1 fails."""
    w = stratum.get("worst")
    if not w:
        return None
    vals = [unjfloat(w.get(k)) for k in ("candidate", "reference", "allowed")]
    if any(v is None or not math.isfinite(v) for v in vals):
        return math.inf
    cand, ref, allowed = vals
    if cand == ref:
        return 0.0
    return abs(cand - ref) / allowed if allowed > 0 else math.inf


def heat_cell(stratum: dict | None) -> tuple[str, str]:
    if stratum is None:
        return " ", ""
    if stratum["status"] == "error":
        return "E", "magenta"
    nonfinite = stratum.get("nonfinite", {})
    if stratum["status"] == "fail" and nonfinite.get("candidate", 0) > nonfinite.get("reference", 0):
        return "!", "bold red"
    ratio = _ratio(stratum)
    if ratio is None:
        return "?", ""
    if stratum["status"] == "fail" and ratio <= 1.0:  # failed by the violation share, not the worst element
        return "▓", "red"
    for bound, char, colour in HEAT_LEVELS:
        if ratio <= bound:
            return char, colour
    return "█", "red"


def render_heat(d: dict, console, width: int | None = None) -> None:
    """Strata as rows, layers as columns (table order), one character per cell; wraps to the
    terminal width, so a 126-layer model is a few lines."""
    from rich.text import Text

    layers = d["layers"]
    if not layers:
        return
    rows = list(d["probes"]["strata"])
    grad_names = []
    for layer in layers:
        for g in layer.get("grad", []):
            if g["name"] not in grad_names:
                grad_names.append(g["name"])
    rows += grad_names
    label_w = max(len(r) for r in rows) + 1
    width = width or console.width or 100
    per_line = max(10, width - label_w - 2)
    console.print(f"heat grid: columns are layers 0..{len(layers) - 1} in table order; "
                  "· ░ < half the tolerance, ▒ within it, ▓ █ outside (x10), ! non-finite, E error")
    for start in range(0, len(layers), per_line):
        chunk = layers[start:start + per_line]
        ruler = "".join(str((start + k) // 10 % 10) if (start + k) % 10 == 0 else " " for k in range(len(chunk)))
        console.print(Text(" " * label_w + ruler, style="dim"))
        for row in rows:
            line = Text(row.rjust(label_w - 1) + " ")
            for layer in chunk:
                found = next((s for s in layer["strata"] + layer.get("grad", []) if s["name"] == row), None)
                char, colour = heat_cell(found)
                line.append(char, style=colour or None)
            console.print(line)
