"""End to end through the library API: correct candidates pass, each planted fault fails
on the strata where it shows."""

import pytest
import torch
from conftest import plugin, run_parity

from parity_cli import api

CORRECT = {
    "llama": ["torch", "hf", plugin("LlamaRMSNorm"), plugin("rms_norm")],
    "gemma": ["torch", "hf", plugin("GemmaRMSNorm"), plugin("gemma_rms_norm")],
}


def failing(report, layer=None):
    layers = report.layers if layer is None else [l for l in report.layers if l.name == layer]
    return {s.name for l in layers for s in l.strata if s.status != "pass"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("model_type,family,layers", [("qwen3", "llama", 5), ("gemma3", "gemma", 7)])
def test_correct_candidates_pass(ckpt, model_type, family, layers, dtype):
    path = ckpt(model_type, layers=1, hidden=128, heads=4, dtype=dtype)
    for candidate in CORRECT[family]:
        report = api.check(path, candidate=candidate)
        assert report.header["candidate"]["dtype"] == dtype  # default: as stored
        assert report.exit_code == 0, (candidate, [(l.name, failing(report, l.name)) for l in report.layers])
        assert len(report.layers) == layers and all(l.status == "pass" for l in report.layers)


def test_correct_candidate_passes_the_extreme_stratum_in_float32(ckpt):
    """F.rms_norm upcasts fp16/bf16 but squares fp32 in fp32: |x| ~ 1e19 overflows x^2."""
    path = ckpt("llama", layers=1, dtype="float32")
    report = api.check(path, candidate="torch", strata=["extreme"])
    assert failing(report) == {"extreme"}
    assert api.check(path, candidate="oracle", strata=["extreme"]).exit_code == 0


@pytest.mark.parametrize("fault,model_type,dtype,must_fail,must_pass,code", [
    ("eps_outside_sqrt", "llama", "float32", {"tiny"}, {"zero", "large"}, "eps_outside_sqrt"),
    ("eps_hardcoded_1e5", "llama", "bfloat16", {"tiny"}, {"zero", "normal", "large", "outlier"}, "eps_mismatch"),
    ("eps_missing", "llama", "float32", {"zero", "tiny"}, {"normal", "large"}, "eps_missing"),
    ("mean_subtracted", "llama", "bfloat16", {"normal", "constant"}, {"zero"}, "mean_subtracted"),
    ("permuted_weight", "llama", "bfloat16", {"normal", "large", "mixed"}, {"zero"}, "channel_gain_mismatch"),
    ("gemma_without_offset", "gemma", "bfloat16", {"normal", "constant"}, {"zero"}, "weight_offset_mismatch"),
    ("gemma_offset_twice", "gemma", "float16", {"normal", "constant"}, {"zero"}, "weight_offset_mismatch"),
    ("rms_norm", "gemma", "float32", {"normal", "constant"}, {"zero"}, "weight_offset_mismatch"),
    ("no_upcast", "llama", "float16", {"large", "outlier"}, {"zero"}, "reduced_precision_reduction"),
])
def test_planted_faults_fail_where_they_show(ckpt, fault, model_type, dtype, must_fail, must_pass, code):
    path = ckpt(model_type, layers=1, dtype=dtype, eps=1e-6)
    report = api.check(path, candidate=plugin(fault))
    assert report.exit_code == 1
    for layer in report.layers:
        got = failing(report, layer.name)
        assert must_fail <= got, (layer.name, got)
        assert not (must_pass & got), (layer.name, got)
        assert [d.code for d in layer.diagnoses] == [code], (layer.name, layer.diagnoses)


def test_no_upcast_is_invisible_in_bfloat16(ckpt):
    """bfloat16 has float32's range: x^2 does not overflow, so the same code passes there."""
    assert api.check(ckpt("llama", layers=1, dtype="bfloat16"), candidate=plugin("no_upcast")).exit_code == 0


def test_correct_candidates_have_no_diagnoses(ckpt):
    report = api.check(ckpt("gemma2", layers=1, dtype="bfloat16"), candidate="hf")
    assert report.exit_code == 0 and all(l.diagnoses == [] for l in report.layers)


def test_eps_fault_is_explained_with_the_estimated_eps(ckpt):
    path = ckpt("llama", layers=1, dtype="bfloat16", eps=1e-6)
    report = api.check(path, candidate=plugin("eps_hardcoded_1e5"))
    assert len(report.layers) == 3  # input, post-attention and final norm of one block
    for layer in report.layers:
        codes = {d.code: d for d in layer.diagnoses}
        assert "eps_mismatch" in codes
        assert codes["eps_mismatch"].evidence["estimated_eps"] == pytest.approx(1e-5, rel=0.05)


def test_candidate_eps_simulates_a_deployment_config(ckpt):
    path = ckpt("llama", layers=1, dtype="bfloat16", eps=1e-5)
    report = api.check(path, candidate="torch", candidate_eps=1e-6)
    assert report.exit_code == 1 and "tiny" in failing(report)
    assert report.header["candidate"]["eps"] == 1e-6 and report.header["reference"]["eps"] == 1e-5
    assert all(d.code == "eps_mismatch" for l in report.layers for d in l.diagnoses)


def test_missing_and_doubled_gemma_offset_are_named(ckpt):
    path = ckpt("gemma", layers=1, dtype="bfloat16")
    for fault, delta, word in (("gemma_without_offset", -1.0, "missing"), ("gemma_offset_twice", 1.0, "twice")):
        report = api.check(path, candidate=plugin(fault))
        diags = [d for l in report.layers for d in l.diagnoses if d.code == "weight_offset_mismatch"]
        assert len(diags) == len(report.layers) and word in diags[0].message
        assert diags[0].evidence["offset_error"] == delta and diags[0].evidence["expected_offset"] == 1.0


def test_permuted_weight_names_channels(ckpt):

    path = ckpt("llama", layers=1, dtype="float32")
    report = api.check(path, candidate=plugin("permuted_weight"), layers="model.norm")
    diag = report.layers[0].diagnoses[0]
    from safetensors.torch import load_file

    w = load_file(str(path / "model.safetensors"))["model.norm.weight"].double()
    rolled = w.roll(1)
    moved = int((rolled != w).sum())  # every channel whose neighbour holds a different gain
    assert diag.evidence["affected_channels"] == moved
    first = diag.evidence["channels"][0]
    j = first["channel"]
    assert first["implied"] == pytest.approx(float(rolled[j]), rel=1e-5)
    assert first["expected"] == pytest.approx(float(w[j]), rel=1e-12)


def test_zero_row_nan_is_counted_as_nonfinite(ckpt):
    report = api.check(ckpt("llama", layers=1, dtype="float32"), candidate=plugin("eps_missing"))
    zero = [s for s in report.layers[0].strata if s.name == "zero"][0]
    assert zero.nonfinite_candidate == zero.elements == 64 and zero.nonfinite_reference == 0
    assert zero.violations == 64 and "eps_missing" in {d.code for d in report.layers[0].diagnoses}


def test_a_raising_candidate_is_a_finding_not_a_crash(ckpt):
    report = api.check(ckpt("llama", layers=2), candidate=plugin("raises"))
    assert report.exit_code == 1
    assert all(l.status == "error" for l in report.layers)
    d = report.to_dict()
    assert "kernel not built" in d["layers"][0]["error"] and d["summary"]["errors"] == 5


def test_a_candidate_calling_sys_exit_is_a_finding(ckpt):
    report = api.check(ckpt("llama", layers=1), candidate=plugin("exits"))
    assert report.exit_code == 1 and "SystemExit" in report.to_dict()["layers"][0]["error"]


def test_wrong_shape_is_a_finding(ckpt):
    report = api.check(ckpt("llama", layers=1), candidate=plugin("wrong_shape"))
    assert report.exit_code == 1 and "shape" in report.to_dict()["layers"][0]["error"]


def test_fp16_tolerance_is_tighter_than_bf16(ckpt):
    """The same fault can pass at bf16's rtol and fail at fp16's: tolerance follows the dtype."""
    path = ckpt("llama", layers=1, dtype="float32")
    assert api.check(path, candidate="hf", dtype="bfloat16").header["tolerance"]["rtol"] == 1.6e-2
    assert api.check(path, candidate="hf", dtype="float16").header["tolerance"]["rtol"] == 1e-3


def test_comparison_counts_every_violation():
    from parity_cli.comparison import Tolerance, compare

    x = torch.ones(2, 4, dtype=torch.float64)
    ref = torch.tensor([[1.0, 2.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    cand = ref.clone()
    cand[0, 1] = 2.0 + 2e-3     # outside 1e-3 + 0 * 2
    cand[0, 2] = 5e-4           # zero reference: atol alone, inside
    cand[1, 3] = float("nan")   # non-finite: always a violation
    tol = Tolerance(atol=1e-3, rtol=0.0, source="test")
    r = compare("t", x, ref, cand, 1e-6, "rms_norm", tol)
    assert r.violations == 2 and r.status == "fail" and r.nonfinite_candidate == 1
    assert r.max_abs_err == r.max_rel_err == float("inf")  # a NaN is never hidden by the maxima
    assert (r.worst.vector, r.worst.index) == (1, 3)
    # Non-finite fails whatever share is allowed; finite violations within the share pass.
    assert compare("t", x, ref, cand, 1e-6, "rms_norm", tol, max_violation_fraction=0.25).status == "fail"
    cand[1, 3] = 1.0
    finite = compare("t", x, ref, cand, 1e-6, "rms_norm", tol)
    assert finite.max_abs_err == pytest.approx(2e-3)
    assert finite.max_rel_err == pytest.approx(1e-3)  # the zero reference is excluded from rel error
    assert compare("t", x, ref, cand, 1e-6, "rms_norm", tol, max_violation_fraction=0.125).status == "pass"
    assert compare("t", x, ref, cand, 1e-6, "rms_norm", tol, max_violation_fraction=0.1).status == "fail"


def test_unmatched_norm_like_tensors_are_listed_not_skipped_silently(ckpt):
    import torch

    extra = {"vision_tower.blocks.0.norm1.weight": torch.ones(8, dtype=torch.bfloat16),
             "model.layers.0.mlp.gate_proj.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
    report = api.check(ckpt("llama", layers=1, weights=extra), candidate="hf")
    assert report.header["checkpoint"]["unmatched"] == ["vision_tower.blocks.0.norm1.weight"]
    assert any("vision_tower.blocks.0.norm1.weight" in w for w in report.warnings)
    assert report.exit_code == 0 and len(report.layers) == 3


def test_eps_override_applies_to_both_sides_and_is_recorded(ckpt):
    path = ckpt("llama", layers=1, eps=1e-6)
    report = api.check(path, candidate="torch", eps=1e-5)
    assert report.exit_code == 0
    assert report.header["eps"] == {"value": 1e-5, "source": "override"}
    assert report.header["candidate"]["eps"] == 1e-5 and report.layers[0].eps["source"] == "override"


def test_defaulted_eps_is_a_warning(ckpt):
    report = api.check(ckpt("llama", layers=1, eps=None), candidate="torch")
    assert report.header["eps"] == {"value": 1e-6, "source": "family-default"}
    assert any("family default" in w for w in report.warnings)


def test_family_forced_over_model_type(ckpt):
    """A Gemma-layout checkpoint read as llama: the +1 is no longer expected, so hf (llama) passes
    and a Gemma module fails with the offset named."""
    path = ckpt("gemma", layers=1, dtype="float32")
    assert api.check(path, candidate="hf", family="llama", family_force=True).exit_code == 0
    report = api.check(path, candidate=plugin("GemmaRMSNorm"), family="llama", family_force=True)
    assert {d.code for l in report.layers for d in l.diagnoses} == {"weight_offset_mismatch"}


def test_a_forced_family_the_model_type_contradicts_is_never_silent(ckpt):
    """Issue 47: Llama read as Gemma makes the oracle and the candidate both compute 1 + w, so a PASS
    would say nothing of the model. Refused in one line unless --family-force confirms it; confirmed,
    the verdict line says it. A --family that agrees with the model type (bert as layer_norm) is not."""
    from parity_cli.errors import InputError

    path = ckpt("llama", layers=1, dtype="float32")
    with pytest.raises(InputError) as found:
        api.check(path, family="gemma")
    assert str(found.value).startswith("--family gemma contradicts model_type 'llama' in config.json (family llama): "
                                       "gemma's gain is 1 + w, llama's 0 + w")
    r = run_parity("check", path, "--family", "gemma", "-q")
    assert r.returncode == 2 and r.stdout == "" and "--family-force checks it so anyway" in r.stderr
    r = run_parity("check", path, "--family", "gemma", "--family-force", "-q")
    assert r.returncode == 0 and r.stdout.strip().endswith(
        "(family gemma forced over model_type 'llama', which it contradicts)"), r.stdout
    assert api.check(ckpt("bert", layers=1, eps=1e-12, dtype="float32"), family="layer_norm").passed


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_stored_weights_fail_the_layer(ckpt, bad):
    import torch

    w = torch.ones(64, dtype=torch.bfloat16)
    w[5] = bad
    report = api.check(ckpt("llama", layers=1, weights={"model.norm.weight": w}), candidate="hf")
    norm = [l for l in report.layers if l.name == "model.norm"][0]
    assert norm.weight["nonfinite"] == 1
    assert [f["code"] for f in norm.findings] == ["nonfinite_weight"] and norm.status == "fail"
    assert not report.passed and report.exit_code == 1
    assert all(l.passed for l in report.layers if l.name != "model.norm")
