"""Issue 23: no confident wrong cause at the hairline, and LayerNorm faults the hypothesis space
lacked. Real candidates (tests/plugins/hairline.py) through the library API, in this process."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from parity_cli import api

HAIRLINE = str(Path(__file__).resolve().parent / "plugins" / "hairline.py")


def check(ckpt, model_type, dtype, eps, fn, hidden=64):
    path = ckpt(model_type, layers=1, hidden=hidden, heads=hidden // 16, eps=eps, dtype=dtype, seed=7)
    return api.check(path, candidate=f"{HAIRLINE}:{fn}", isolation="none")


def failing(report):
    out = [l for l in report.layers if l.status == "fail"]
    assert out, "the planted fault must fail some layer"
    return out


def times_allowance(layer) -> float:
    """The worst |cand - ref| / allowed over the layer's strata, from the report's own worst elements."""
    return max(abs(s.worst.candidate - s.worst.reference) / s.worst.allowed for s in layer.strata
               if s.violations and s.worst is not None)


# --- the hairline: marginal, the variants listed, none picked -----------------------------------------

def test_every_gain_one_percent_large_at_bfloat16_is_marginal_not_a_missing_upcast(ckpt):
    """A 1 % gain error at bfloat16 (rtol 1.6 %) misses by ~1.2x: 'no upcast' lands within the
    matcher's 2x slack and was stated as the cause (the issue: on 59 layers)."""
    report = check(ckpt, "llama", "bfloat16", 1e-6, "gain_scaled")
    for layer in failing(report):
        (diag,) = layer.diagnoses
        assert diag.code == "marginal", [d.code for d in layer.diagnoses]
        missed_by = times_allowance(layer)
        assert 1 < missed_by <= 2
        assert diag.evidence["times_allowance"] == pytest.approx(missed_by)
        assert f"{missed_by:.3g} x the allowance" in diag.message
        assert "no upcast" not in diag.evidence["matching_variants"]
    # the planted scale is among the variants listed on some layer: 1.01 x a bf16 weight rounds
    # to bf16 again (half an ulp, 2^-8 relative, either way)
    scales = [float(v.removeprefix("gain x ")) for l in failing(report) for v in l.diagnoses[0].evidence["variants"]
              for v in [v["variant"]] if v.startswith("gain x ")]
    assert scales and all(abs(s - 1.01) <= 2.0 ** -8 + 1e-9 for s in scales), scales


def test_float32_math_at_float64_on_a_layer_norm_is_no_gain_finding(ckpt):
    """JAX without x64: float32 math handed back at float64 misses by 1.4-1.7x. It was
    channel_gain_mismatch, "every channel's gain is 1 x the expected"."""
    report = check(ckpt, "bert", "float64", 1e-12, "layer_norm_float32")
    for layer in failing(report):
        assert [d.code for d in layer.diagnoses] == ["marginal"]
        assert not any("1 x the expected" in d.message for d in layer.diagnoses)
        # its fitted uniform scale is 1 within float32 rounding: never a gain variant either
        assert not any(v.startswith("gain x") for v in layer.diagnoses[0].evidence["matching_variants"])
        assert "float32 math" in layer.diagnoses[0].evidence["matching_variants"]


def test_eps_held_as_float16_gets_no_confident_wrong_cause(ckpt):
    """An OpenVINO float16 IR holds eps 1e-5 as float16 (1.00136e-5). It was channel_gain_mismatch
    x1 on 24 of 61 layers. A relative eps change of 1.4e-4 moves the output by at most half that,
    far inside float16's 1e-3: the data cannot name it; if eps is named, it is the held value."""
    held = float(np.float16(1e-5))
    assert held == pytest.approx(1.00136e-5, rel=1e-5)
    report = check(ckpt, "llama", "float16", 1e-5, "rms_norm_eps_stored_f16")
    for layer in failing(report):
        codes = {d.code for d in layer.diagnoses}
        assert codes <= {"marginal", "eps_mismatch"}, codes
        for d in layer.diagnoses:
            if d.code == "eps_mismatch":
                assert d.evidence["estimated_eps"] == pytest.approx(held, rel=1e-3)


# --- LayerNorm faults the hypothesis space lacked --------------------------------------------------------

@pytest.mark.parametrize("model_type,dtype,eps", [("bert", "float32", 1e-12), ("gpt2", "bfloat16", 1e-5)])
def test_layer_norm_with_eps_outside_the_root_is_named(ckpt, model_type, dtype, eps):
    """(x - mean) / (std + eps), OpenVINO's MVN(eps_mode="outside_sqrt"): was symptom_small_inputs
    or unexplained."""
    report = check(ckpt, model_type, dtype, eps, "layer_norm_eps_outside")
    for layer in failing(report):
        assert [d.code for d in layer.diagnoses] == ["eps_outside_sqrt"]
        assert "(std + eps)" in layer.diagnoses[0].message


def test_float16_layer_norm_whose_eps_rounds_to_zero_names_eps_lost_to_the_dtype(ckpt):
    """eps 1e-12 held as float16 is 0 (float16's smallest subnormal is 2^-24 ~ 6e-8)."""
    assert float(np.float16(1e-12)) == 0.0
    report = check(ckpt, "bert", "float16", 1e-12, "layer_norm_eps_in_dtype")
    for layer in failing(report):
        (diag,) = layer.diagnoses
        assert diag.code == "eps_missing" and diag.evidence["lost_to_dtype"] is True
        assert "1e-12 is 0 in float16" in diag.message
    # the verdict line names what happened (issue 47): the eps was rounded to zero in that dtype, not dropped
    from parity_cli.report.terminal import quiet_line

    line = quiet_line(report.to_dict())
    assert "eps_missing (eps 1e-12 rounds to 0 in float16: an all-zero row computes 0/0)" in line, line


def test_float16_layer_norm_in_the_dtype_names_both_the_lost_eps_and_the_missing_upcast(ckpt):
    report = check(ckpt, "bert", "float16", 1e-12, "layer_norm_in_dtype")
    for layer in failing(report):
        assert {d.code for d in layer.diagnoses} == {"eps_missing", "reduced_precision_reduction"}


def test_nan_on_every_zero_row_is_eps_missing_even_when_nothing_reproduces_the_rest(ckpt):
    """keras' folded formula as a float16 graph: NaN on the zero, constant and tiny rows (variance
    0 in float16, eps 0 there), and finite errors elsewhere that no known variant reproduces. It
    was `unexplained` alone."""
    report = check(ckpt, "bert", "float16", 1e-12, "layer_norm_folded_f16")
    for layer in failing(report):
        first = layer.diagnoses[0]
        assert first.code == "eps_missing" and first.evidence["lost_to_dtype"] is True
        assert first.evidence["strata"][0] == "zero"
        zero = next(s for s in layer.strata if s.name == "zero")
        assert zero.nonfinite_candidate == zero.elements and zero.nonfinite_reference == 0


def test_a_float32_mean_summed_in_order_passes_and_the_constant_rows_are_said(ckpt):
    """tinygrad's mean = sum / n in float32, summed in order: a constant row's x - mean is a few ulps
    instead of 0, amplified by 1/sqrt(eps) = 10^6 at eps 1e-12. That is a correct float32 algorithm
    (issue 35: OpenVINO's MVN sums the same way), within the (n + 1) u a sum of n terms may lose: it
    passes, and the ill-conditioned stratum is a warning. It was float32_accumulation, a failure."""
    report = check(ckpt, "bert", "float32", 1e-12, "layer_norm_mean_as_sum")
    assert report.passed and report.layers
    for layer in report.layers:
        (said,) = [w for w in layer.warnings if "summation order" in w]
        assert said.startswith("constant: ") and "within the 65 u a sum of 64 terms may lose" in said, said


def test_a_mean_formed_in_half_precision_still_fails(ckpt):
    """The allowance covers float32 sums, not a mean rounded to float16 or bfloat16 (2^-11, 2^-8
    relative: 30x and 250x (n + 1) u at n = 64)."""
    for fn in ("layer_norm_mean_in_float16", "layer_norm_mean_in_bfloat16"):
        report = check(ckpt, "bert", "float32", 1e-12, fn)
        assert not report.passed and "constant" in {s.name for layer in failing(report) for s in layer.strata
                                                     if s.status == "fail"}, fn


def test_errors_only_on_constant_rows_are_not_blamed_on_eps_when_nothing_fits(ckpt):
    """var = E[x^2] - E[x]^2 in float32 at BERT's width: NaN or noise on constant rows only. No
    known variant reproduces it; the symptom points at the mean and variance, not at eps (a
    constant row's exact output is the bias whatever eps is). It said "suspect the eps value"."""
    report = check(ckpt, "bert", "float32", 1e-12, "layer_norm_naive_variance", hidden=768)
    for layer in failing(report):
        assert {s.name for s in layer.strata if s.status == "fail"} == {"constant"}
        assert [d.code for d in layer.diagnoses] == ["symptom_mean_rounding"]
        assert "not the eps value" in layer.diagnoses[0].message


# --- units -------------------------------------------------------------------------------------------

def test_residual_is_the_share_of_the_deviation_the_variant_leaves():
    import torch

    from parity_cli.diagnose.fit import residual

    f64 = {"dtype": torch.float64}
    cand = torch.tensor([1.5, 1.5, 1.5, math.nan, math.inf, 2.0], **f64)
    ref = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], **f64)
    v = torch.tensor([1.5, 1.0, 1.25, math.nan, 1.0, 11.0], **f64)
    rho = residual(cand, ref, v)
    # |c - v| / |c - ref|: 0, 1, 0.5; NaN matched by NaN: 0; inf not matched: 1; 9 / 1 capped at 2
    assert rho.tolist() == pytest.approx([0.0, 1.0, 0.5, 0.0, 1.0, 2.0])
    # a precision variant's own rounding bound is taken off the residual
    assert residual(cand[:3], ref[:3], v[:3], torch.tensor([0.0, 0.25, 0.0], **f64)).tolist() == [0, 0.5, 0.5]


def test_a_marginal_report_is_schema_valid_and_groups_its_layers(ckpt):
    jsonschema = pytest.importorskip("jsonschema")
    from parity_cli.report import grouping
    from parity_cli.resources import schema_path

    report = check(ckpt, "llama", "bfloat16", 1e-6, "gain_scaled").to_dict()
    data = json.loads(json.dumps(report))
    jsonschema.validate(data, json.loads(schema_path().read_text()))
    bad = [l for l in data["layers"] if l["status"] == "fail"]
    assert bad and all(d["code"] == "marginal" for l in bad for d in l["diagnoses"])
    (group,) = grouping.groups(data)  # figures that differ per layer stay out of the grouped text
    assert len(group.layers) == len(bad) and group.codes == ["marginal"]
