"""How bad a runtime's error is, read against torch eager at the same dtype on the same probes.

The gate's verdict says whether an error is inside the dtype's allowance; a deployment review also
needs to know whether a red cell is a rounding-order difference (an error of the size torch itself
makes at that dtype: 1-3x) or a broken kernel (an error thousands of times torch's). The ratio is
the runtime's largest |cand - ref| over torch's largest |torch - ref|, both against the float64
oracle on the same probe rows; it never changes a verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass

# worse than torch by this much: not a rounding order, a kernel that computes something else
BROKEN = 1e3


@dataclass(frozen=True)
class Severity:
    """One layer's (or one cell's) worst error beside torch's at the same dtype, on the strata
    where the runtime's output is finite; `nonfinite` says it went inf/NaN in another."""

    candidate: float  # the runtime's largest |cand - ref| where its output is finite (nan: nowhere finite)
    torch: float  # torch eager's on the same strata
    nonfinite: bool = False  # the runtime gave inf/NaN where the oracle is finite

    @property
    def ratio(self) -> float | None:
        """candidate / torch; None where there is no number to give (nothing finite, or torch exact
        and the runtime not)."""
        if math.isnan(self.candidate):
            return None
        if self.torch > 0:
            return self.candidate / self.torch
        return 1.0 if self.candidate == 0 else None

    def words(self, dtype: str) -> str:
        """"1.9x torch bf16", "non-finite", "3x torch f16, non-finite": what a table cell says."""
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}.get(dtype, dtype)
        ratio = self.ratio
        if ratio is None:
            said = "non-finite" if math.isnan(self.candidate) else f"torch {short} exact"
            return said if not self.nonfinite or said == "non-finite" else f"{said}, non-finite"
        said = f"{_ratio(ratio)}x torch {short}"
        return f"{said}, non-finite" if self.nonfinite else said

    def as_dict(self, dtype: str) -> dict:
        from parity_cli.check.results import jfloat

        return {"ratio": None if self.ratio is None else jfloat(self.ratio), "candidate_max_abs_err":
                jfloat(self.candidate), "torch_max_abs_err": jfloat(self.torch), "nonfinite": self.nonfinite,
                "torch_dtype": dtype, "words": self.words(dtype)}


def _ratio(r: float) -> str:
    if r >= 100:
        return f"{r:,.0f}"
    return f"{r:.2g}" if r < 10 else f"{r:.0f}"


def _went_nonfinite(s) -> bool:
    return s.nonfinite_candidate > s.nonfinite_reference or math.isnan(float(s.max_abs_err)) or \
        math.isinf(float(s.max_abs_err))


def layer_error(layer) -> tuple[float, bool]:
    """(the largest |cand - ref| of the strata where the candidate is finite, whether it went
    non-finite in another); (nan, False) for a layer that raised."""
    strata = [s for s in layer.strata if s.status != "error"]
    if layer.error is not None or not strata:
        return math.nan, False
    finite = [float(s.max_abs_err) for s in strata if not _went_nonfinite(s)]
    return max(finite, default=math.nan), len(finite) < len(strata)


def compare(layer, base) -> Severity | None:
    """A layer's Severity against torch's result for the same layer: the largest |cand - ref| of
    the strata where the candidate is finite, over torch's largest on those strata. None where
    either side raised or torch itself is not finite (nothing to read the error against)."""
    if layer.error is not None or base.error is not None:
        return None
    torch_strata = {s.name: s for s in base.strata if s.status != "error"}
    pairs = [(s, torch_strata[s.name]) for s in layer.strata if s.status != "error" and s.name in torch_strata]
    if not pairs or any(_went_nonfinite(t) for _, t in pairs):
        return None
    finite = [(s, t) for s, t in pairs if not _went_nonfinite(s)]
    return Severity(max((float(s.max_abs_err) for s, _ in finite), default=math.nan),
                    max((float(t.max_abs_err) for _, t in finite or pairs), default=0.0),
                    len(finite) < len(pairs))


def per_layer(candidate_layers, torch_layers) -> dict:
    """{layer name: Severity} for every layer both sides checked."""
    torch_by_name = {layer.name: layer for layer in torch_layers}
    found = {layer.name: compare(layer, torch_by_name[layer.name]) for layer in candidate_layers
             if layer.name in torch_by_name}
    return {name: s for name, s in found.items() if s is not None}


def overall(severities: dict) -> Severity | None:
    """A cell's severity: its worst layer's error over torch's worst on the same layers."""
    if not severities:
        return None
    values = list(severities.values())
    finite = [s.candidate for s in values if not math.isnan(s.candidate)]
    return Severity(max(finite, default=math.nan), max(s.torch for s in values), any(s.nonfinite for s in values))
