"""The CI decision: which failures count, given a baseline of accepted findings and --fail-on.

A finding is (layer, stratum, diagnosis code): stable across reruns with the same seed, and
specific enough that a new fault in an already-failing layer is still caught. A baseline
accepts a finding only at its size or smaller: the same code with eps moved 100x, or twice the
error, is a worse fault, not the accepted one."""

from __future__ import annotations

import json
import math
from pathlib import Path

from parity_cli.errors import InputError

FAIL_ON = ("fail", "unchecked", "warn")  # each fails on what the one before does, and more
MARGIN = 0.10  # a worst |err|/allowed up to 10 % above the baseline's is the same fault (another
# machine's libm, a torch update); beyond it the fault grew


class _Bad(Exception):
    """A field the gate reads has the wrong type: the caller names the file."""


def _list(container: dict, key: str, where: str, required: bool = False) -> list:
    """container[key] as a list: absent is empty (an older report) unless required; null is not a list."""
    if key not in container and not required:
        return []
    value = container.get(key)
    if not isinstance(value, list):
        raise _Bad(f"{where} is {'null' if value is None else type(value).__name__}, not a list")
    return value


def _dict(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{where} is {'null' if value is None else type(value).__name__}, not an object")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{where} is {'null' if value is None else type(value).__name__}, not a string")
    return value


def _num(value, where: str) -> float | None:
    """A number as the report writes it ("inf", "nan" for non-finite ones); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Bad(f"{where} is {type(value).__name__}, not a number")
    if isinstance(value, str):
        if value not in ("inf", "-inf", "nan"):
            raise _Bad(f"{where} is the string {value[:20]!r}, not a number")
        return float(value)
    return float(value)


def _entries(report: dict, strict: bool = False) -> dict:
    """{(layer, stratum, code): its size}, every field read checked (a baseline is a file; `strict`
    for one: each size must be one a run can write)."""
    out: dict = {}
    for i, layer in enumerate(_list(report, "layers", "layers", required=True)):
        at = f"layers[{i}]"
        _dict(layer, at)
        name = _str(layer.get("name"), f"{at}.name")
        status = _str(layer.get("status"), f"{at}.status")
        if status == "pass":
            continue
        diagnoses = [_dict(d, f"{at}.diagnoses[{j}]") for j, d in enumerate(_list(layer, "diagnoses", f"{at}.diagnoses", True))]
        codes = {}
        for j, d in enumerate(diagnoses):
            codes.setdefault(_str(d.get("code"), f"{at}.diagnoses[{j}].code"),
                             _eps_size(d, f"{at}.diagnoses[{j}]", strict))
        if not codes:
            codes = {"error" if status == "error" else "unexplained": {}}
        strata = {}
        for key in ("strata", "grad"):
            for j, s in enumerate(_list(layer, key, f"{at}.{key}", key == "strata")):
                where = f"{at}.{key}[{j}]"
                _dict(s, where)
                if _str(s.get("status"), f"{where}.status") != "pass":
                    strata[_str(s.get("name"), f"{where}.name")] = _stratum_size(s, where, strict)
        for s, size in strata.items():
            out.update(((name, s, c), {**size, **eps}) for c, eps in codes.items())
        # checkpoint-vs-checkpoint differences are findings of their own, not of a stratum
        extra = _list(layer, "findings", f"{at}.findings")
        for j, f in enumerate(extra):
            where = f"{at}.findings[{j}]"
            _dict(f, where)
            out[(name, "checkpoint", _str(f.get("code"), f"{where}.code"))] = _finding_size(f, where)
        if not strata and not extra:
            out.update(((name, "*", c), eps) for c, eps in codes.items())
    for j, f in enumerate(_list(report, "findings", "findings")):
        where = f"findings[{j}]"
        _dict(f, where)
        layer = f.get("layer", "*")
        out[(_str(layer, f"{where}.layer"), "checkpoint", _str(f.get("code"), f"{where}.code"))] = \
            _finding_size(f, where)
    return out


# the widest eps interval a diagnosis gives (the 25th..75th percentile of per-element estimates): a baseline's
# wider one would accept any eps at all ([0, 1e300] let a 100,000x eps fault pass)
MAX_INTERVAL = 1e4


def _eps_size(d: dict, where: str, strict: bool = False) -> dict:
    est = _num(d.get("estimated_eps"), f"{where}.estimated_eps")
    if est is None:
        return {}
    if strict and not (math.isfinite(est) and est > 0):
        raise _Bad(f"{where}.estimated_eps is {est}, not an eps a diagnosis estimates (finite, > 0)")
    interval = d.get("interval")
    if interval is None or interval == []:
        return {"eps": est}
    if not isinstance(interval, list) or len(interval) != 2:
        raise _Bad(f"{where}.interval is not a [low, high] pair")
    lo, hi = (_num(v, f"{where}.interval") for v in interval)
    if strict and not (lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)
                       and 0 < lo <= est <= hi <= lo * MAX_INTERVAL):
        raise _Bad(f"{where}.interval [{lo:g}, {hi:g}] is not an interval a diagnosis gives (finite, > 0, around "
                   f"its estimate {est:g}, within a factor of {MAX_INTERVAL:g})")
    return {"eps": est, "interval": (lo, hi)}


def _stratum_size(s: dict, where: str, strict: bool = False) -> dict:
    """The worst element's |cand - ref| / allowed (its |cand - ref| where nothing is allowed:
    --exact), and the candidate's non-finite count. `strict` (a baseline): a worst element must be
    one a run writes: a finite reference and allowance, and a non-finite candidate only where the
    stratum counts non-finite outputs (a worst of "inf" alone would accept any error at all)."""
    size = {}
    nonfinite = s.get("nonfinite")
    if nonfinite is not None:
        size["nonfinite"] = _num(_dict(nonfinite, f"{where}.nonfinite").get("candidate"), f"{where}.nonfinite.candidate")
    worst = s.get("worst")
    if worst is not None:
        _dict(worst, f"{where}.worst")
        ref, cand, allowed = (_num(worst.get(k), f"{where}.worst.{k}") for k in ("reference", "candidate", "allowed"))
        finite = all(v is None or math.isfinite(v) for v in (ref, allowed)) and (allowed is None or allowed >= 0)
        if strict and not finite:
            raise _Bad(f"{where}.worst holds a reference or allowance that is not a finite number")
        if strict and cand is not None and not math.isfinite(cand) and not (size.get("nonfinite") or 0) > 0:
            raise _Bad(f"{where}.worst.candidate is {cand} where the stratum counts no non-finite output")
        if None not in (ref, cand, allowed):
            err = abs(cand - ref)
            size["ratio"] = (err / allowed if allowed > 0 else err) if not math.isnan(err) else math.inf
            size["exact"] = not allowed > 0
    return size


def _finding_size(f: dict, where: str) -> dict:
    """A checkpoint difference's extent: channels, max |diff|, non-finite values, and the copy's eps."""
    size = {k: _num(f.get(k), f"{where}.{k}") for k in ("affected_channels", "max_abs_diff", "count")
            if f.get(k) is not None}
    if isinstance(f.get("candidate"), dict) and f["candidate"].get("value") is not None:
        size["copy_eps"] = _num(f["candidate"]["value"], f"{where}.candidate.value")
    return size


def _worse(new: dict, old: dict) -> str | None:
    """Why a finding is worse than the baseline's one of the same identity; None: same or smaller."""
    eps = new.get("eps")
    if eps is not None and old.get("eps") is not None and eps != old["eps"]:
        lo, hi = old.get("interval") or (old["eps"] / (1 + MARGIN), old["eps"] * (1 + MARGIN))
        if not lo <= eps <= hi:
            return f"behaves as eps {eps:.3g}, outside the baseline's {lo:.3g}..{hi:.3g} (estimated {old['eps']:.3g})"
    ratio, was = new.get("ratio"), old.get("ratio")
    if ratio is not None and was is not None and math.isinf(was) and math.isfinite(ratio) and not old.get("nonfinite"):
        return f"worst |err|/allowed {ratio:.3g}, where the baseline's was not finite"
    if ratio is not None and was is not None and new.get("exact") == old.get("exact") and ratio > was * (1 + MARGIN):
        unit = "|err|" if new.get("exact") else "|err|/allowed"
        return f"worst {unit} {ratio:.3g}, the baseline's {was:.3g}"
    for key, what in (("nonfinite", "non-finite outputs"), ("affected_channels", "differing channels"),
                      ("count", "non-finite weights"), ("max_abs_diff", "max |diff|")):
        if new.get(key) is not None and old.get(key) is not None and new[key] > old[key] * (1 + MARGIN):
            return f"{new[key]:.4g} {what}, the baseline's {old[key]:.4g}"
    if new.get("copy_eps") is not None and old.get("copy_eps") is not None and new["copy_eps"] != old["copy_eps"]:
        return f"the copy's eps is {new['copy_eps']:.6g}, the baseline's {old['copy_eps']:.6g}"
    return None


def findings(report: dict) -> set[tuple[str, str, str]]:
    return set(_entries(report))


def all_warnings(report: dict) -> list[str]:
    return list(report.get("warnings", [])) + [
        f"{layer['name']}: {w}" for layer in report["layers"] for w in layer.get("warnings", [])
    ]


def load_report(path: str | Path, what: str = "report") -> dict:
    """A saved report checked against its schema (parity_cli.report.saved) before any field is used."""
    from parity_cli.report import saved as saved_report

    return saved_report.load(Path(path), what)


def load_baseline(path: str | Path) -> dict:
    """A baseline, with every field the gate reads checked now, before the run: a wrong type is
    one line naming the file and the field, not an internal error after minutes of checking."""
    data = load_report(path, "baseline")
    try:
        _entries(data, strict=True)
        for key in ("checkpoint", "candidate"):
            _dict(data[key], key)
    except _Bad as exc:
        raise InputError(f"{path}: the baseline's {exc}") from None
    return data


def _missing_keys(data: dict) -> str | None:
    """The first field that breaks the report's schema (parity_cli.report.saved), or None."""
    from parity_cli.report import saved as saved_report

    try:
        saved_report.validate(data)
    except saved_report.Invalid as exc:
        return str(exc)
    return None


def mismatch(report: dict, baseline: dict) -> list[str]:
    """What makes the baseline another run's: another model (its norm tensors' fingerprint),
    dtype or candidate. Its findings then say little about this run's."""
    def get(d, *keys):
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    out = []
    old, new = get(baseline, "checkpoint", "fingerprint", "sha256"), get(report, "checkpoint", "fingerprint", "sha256")
    if old != new:
        out.append(f"another checkpoint (norm tensors sha256 {str(old)[:12]}..., here {str(new)[:12]}...)"
                   if old and new else "a checkpoint without a fingerprint to compare")
    old, new = get(baseline, "candidate", "dtype"), get(report, "candidate", "dtype")
    if old != new:
        out.append(f"dtype {old}, here {new}")
    for key, what in (("impl", "candidate"), ("args", "candidate arguments")):
        old, new = get(baseline, "candidate", key) or None, get(report, "candidate", key) or None
        if old != new:
            out.append(f"{what} {json.dumps(old)}, here {json.dumps(new)}")
    old = get(baseline, "candidate", "checkpoint", "fingerprint", "sha256") or get(baseline, "candidate", "checkpoint", "path")
    new = get(report, "candidate", "checkpoint", "fingerprint", "sha256") or get(report, "candidate", "checkpoint", "path")
    if old != new:
        out.append("another candidate checkpoint")
    return out


def gate(report: dict, fail_on: str = "fail", baseline: dict | None = None, baseline_path: str | None = None) -> dict:
    if fail_on not in FAIL_ON:
        raise InputError(f"--fail-on must be one of {', '.join(FAIL_ON)}")
    found = _entries(report)
    try:
        known = _entries(baseline, strict=True) if baseline is not None else {}
    except _Bad as exc:
        raise InputError(f"{baseline_path}: the baseline's {exc}") from None
    worse = {key: why for key in found.keys() & known.keys() if (why := _worse(found[key], known[key]))}
    new = sorted(found.keys() - known.keys() | worse.keys())
    warnings = all_warnings(report)
    missed = len((report.get("checkpoint") or {}).get("unchecked") or [])
    failed = bool(new) or (fail_on in ("unchecked", "warn") and bool(missed)) or (fail_on == "warn" and bool(warnings))
    result = {
        "verdict": "fail" if failed else "pass",
        "exit_code": 1 if failed else 0,
        "fail_on": fail_on,
        "warnings": len(warnings),
        "unchecked": missed,
        "new_findings": [{"layer": l, "stratum": s, "code": c, **({"worse": worse[l, s, c]} if (l, s, c) in worse else {})}
                         for l, s, c in new],
    }
    if baseline is not None:
        result["baseline"] = {
            "path": baseline_path,
            "accepted": [{"layer": l, "stratum": s, "code": c} for l, s, c in sorted(found.keys() & known.keys() - worse.keys())],
            "gone": [{"layer": l, "stratum": s, "code": c} for l, s, c in sorted(known.keys() - found.keys())],
            "mismatch": mismatch(report, baseline),
        }
    return result
