"""The CI decision: which failures count, given a baseline of accepted findings and --fail-on.

A finding is (layer, stratum, diagnosis code): stable across reruns with the same seed, and
specific enough that a new fault in an already-failing layer is still caught."""

from __future__ import annotations

import json
from pathlib import Path

from parity_cli.errors import InputError

FAIL_ON = ("fail", "warn")


def findings(report: dict) -> set[tuple[str, str, str]]:
    out = set()
    for layer in report["layers"]:
        if layer["status"] == "pass":
            continue
        codes = [d["code"] for d in layer["diagnoses"]] or ["error" if layer["status"] == "error" else "unexplained"]
        checked = layer["strata"] + layer.get("grad", [])
        strata = [s["name"] for s in checked if s["status"] != "pass"]
        if strata:
            out.update((layer["name"], s, c) for s in strata for c in codes)
        # checkpoint-vs-checkpoint differences are findings of their own, not of a stratum
        out.update((layer["name"], "checkpoint", f["code"]) for f in layer.get("findings", []))
        if not strata and not layer.get("findings"):
            out.update((layer["name"], "*", c) for c in codes)
    out.update((f.get("layer", "*"), "checkpoint", f["code"]) for f in report.get("findings", []))
    return out


def all_warnings(report: dict) -> list[str]:
    return list(report.get("warnings", [])) + [
        f"{layer['name']}: {w}" for layer in report["layers"] for w in layer.get("warnings", [])
    ]


def load_report(path: str | Path, what: str = "report") -> dict:
    from parity_cli.jsonfile import load

    path = Path(path)
    data = load(path, "the " + what, "report")
    if not isinstance(data, dict) or data.get("schema_version") != 1 or not isinstance(data.get("layers"), list):
        raise InputError(f"{path}: not a parity-cli report (schema_version 1 with layers)")
    problem = _missing_keys(data)
    if problem:
        raise InputError(f"{path}: not a complete parity-cli report: {problem}")
    return data


def _missing_keys(data: dict) -> str | None:
    """The schema's required keys, checked without jsonschema (not a runtime dependency)."""
    from parity_cli.resources import schema_path

    schema = json.loads(schema_path().read_text())
    defs = schema["$defs"]
    for key in schema["required"]:
        if key not in data:
            return f"missing '{key}'"
    for i, layer in enumerate(data["layers"]):
        if not isinstance(layer, dict):
            return f"layers[{i}] is not an object"
        for key in defs["layer"]["required"]:
            if key not in layer:
                return f"layers[{i}] has no '{key}'"
        for j, stratum in enumerate(layer["strata"] if isinstance(layer["strata"], list) else []):
            for key in defs["stratum"]["required"]:
                if not isinstance(stratum, dict) or key not in stratum:
                    return f"layers[{i}].strata[{j}] has no '{key}'"
    return None


def gate(report: dict, fail_on: str = "fail", baseline: dict | None = None, baseline_path: str | None = None) -> dict:
    if fail_on not in FAIL_ON:
        raise InputError(f"--fail-on must be one of {', '.join(FAIL_ON)}")
    found = findings(report)
    known = findings(baseline) if baseline is not None else set()
    new = sorted(found - known)
    warnings = all_warnings(report)
    failed = bool(new) or (fail_on == "warn" and bool(warnings))
    result = {
        "verdict": "fail" if failed else "pass",
        "exit_code": 1 if failed else 0,
        "fail_on": fail_on,
        "warnings": len(warnings),
        "new_findings": [{"layer": l, "stratum": s, "code": c} for l, s, c in new],
    }
    if baseline is not None:
        result["baseline"] = {
            "path": baseline_path,
            "accepted": [{"layer": l, "stratum": s, "code": c} for l, s, c in sorted(found & known)],
            "gone": [{"layer": l, "stratum": s, "code": c} for l, s, c in sorted(known - found)],
        }
    return result
