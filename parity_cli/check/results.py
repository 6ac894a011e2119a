"""Stage 7: results -> the JSON report (a contract: `parity schema` prints it), written all or nothing.

Checking produced values; this module turns them into a dict and files (parity_cli.report.terminal
turns the dict into lines)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parity_cli.comparison import StratumResult
from parity_cli.diagnose.causes import Diagnosis

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


def weight_faults(layer, nonfinite: int) -> list[dict]:
    """The findings a stored weight makes on its own, whatever the candidate does: every command's
    (check, fused, runtimes through check). A non-finite gain makes both sides output NaN and
    "agree": the checkpoint itself is broken, and that fails."""
    if not nonfinite:
        return []
    return [{"code": "nonfinite_weight",
             "message": f"{nonfinite} non-finite value(s) in the stored weight {layer.tensor or layer.name}: every "
                        "output of this layer is NaN or inf", "count": nonfinite}]


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
    captured: dict | None = None  # --activations: where real rows sit on q/eps, and what the faults do to them
    runtime_node: dict | None = None  # --runtime-capture: the runtime's node this layer's rows came from
    tower: str = "main"  # the part of a multimodal model the norm serves (model.layers.tower_of)
    statistics: dict | None = None  # batch_norm: the smallest running_var / eps (check.layer.running_summary)
    vs_torch: dict | None = None  # a runtime candidate's worst error over torch eager's (check.severity)
    judged_at: str | None = None  # the dtype its probes ran at, where the copy's node computes in a narrower one

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
            # norms of the checkpoint no layer checked (checkpoint.unchecked): a verdict covers what it compared
            "unchecked": len((self.header.get("checkpoint") or {}).get("unchecked") or []),
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
        "tower": layer.tower,
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
        "captured": _jsonable(layer.captured),
        **({"runtime_node": _jsonable(layer.runtime_node)} if layer.runtime_node else {}),
        "statistics": _jsonable(layer.statistics),
        **({"vs_torch_same_dtype": layer.vs_torch} if layer.vs_torch else {}),
        **({"judged_at": layer.judged_at} if layer.judged_at else {}),
    }
