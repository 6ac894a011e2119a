"""Issue 4: every side pluggable — references, entry points, candidate arguments, converted
checkpoints, gradients, bitwise mode, hung and odd candidates."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import SLOW, load_json, plugin, run_parity
from safetensors.torch import load_file, save_file

from parity_cli import api
from parity_cli.backends.implementations import oracle_normalize
from parity_cli.options import parse_args

# --- references and bitwise mode ----------------------------------------------------------------

def test_hf_against_itself_is_bitwise(ckpt):
    report = api.check(ckpt("llama", layers=1, eps=1e-5), candidate="hf", reference="hf",
                       reference_dtype="bfloat16", exact=True)
    assert report.passed
    assert report.header["tolerance"]["atol"] == 0 and report.header["tolerance"]["rtol"] == 0
    assert report.header["reference"]["dtype"] == "bfloat16"


def test_torch_against_hf_shows_few_ulp_differences(ckpt):
    # F.rms_norm multiplies the weight in fp32 (Gemma order); HF Llama rounds to bf16 first
    # and multiplies in bf16: two roundings where torch has one, so they differ by at most ~1 ulp.
    # Where torch's kernel is exactly Gemma order, the diagnosis says so (cast_order).
    report = api.check(ckpt("llama", layers=1, eps=1e-5), candidate="torch", reference="hf",
                       reference_dtype="bfloat16", exact=True)
    assert not report.passed
    for layer in report.layers:
        (diag,) = layer.diagnoses
        assert diag.code in ("bitwise_difference", "cast_order")
        assert 0 < diag.evidence["max_ulp"] <= 2
        if diag.code == "cast_order":
            assert diag.evidence["matched_order"] == "gemma"
        worst = max(s.max_ulp for s in layer.strata)
        assert worst == diag.evidence["max_ulp"]


def test_reference_can_be_any_implementation(ckpt):
    report = api.check(ckpt("llama", layers=1), candidate=plugin("rms_norm"), reference=plugin("LlamaRMSNorm"),
                       reference_dtype="float32")
    assert report.passed
    assert report.header["reference"]["impl"].endswith(":LlamaRMSNorm")


# --- candidate arguments ------------------------------------------------------------------------------

def test_parse_args_json_else_string():
    assert parse_args(["offset=1.0", "casting_mode=gemma", "flag=true", "n=3", "xs=[1,2]"]) == {
        "offset": 1.0, "casting_mode": "gemma", "flag": True, "n": 3, "xs": [1, 2]}


def test_candidate_arg_reaches_the_constructor(ckpt):
    path = ckpt("gemma3", layers=1, eps=1e-6)
    assert not api.check(path, candidate=plugin("OffsetRMSNorm")).passed  # offset 0: gain w, not 1 + w
    assert api.check(path, candidate=plugin("OffsetRMSNorm"), candidate_args=["offset=1.0"]).passed


def test_candidate_arg_reaches_a_function(ckpt):
    path = ckpt("llama", layers=1)
    assert api.check(path, candidate=plugin("scaled_rms_norm"), candidate_args=["scale=1"]).passed
    assert not api.check(path, candidate=plugin("scaled_rms_norm"), candidate_args=["scale=1.01"]).passed


def test_unknown_candidate_arg_is_a_clear_error(ckpt):
    r = run_parity("check", ckpt("llama", layers=1), "--candidate", plugin("OffsetRMSNorm"),
                   "--candidate-arg", "casting_mode=gemma")
    assert r.returncode == 2
    assert "casting_mode" in r.stderr and "does not accept" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run_parity("check", ckpt("llama", layers=1), "--candidate", "hf", "--candidate-arg", "x=1")
    assert r.returncode == 2 and "takes no arguments" in r.stderr


# --- entry points ----------------------------------------------------------------------------------------

@SLOW
def test_entry_point_plugin_is_found_by_name(tmp_path, ckpt, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "parity_ep_demo").mkdir(parents=True)
    (pkg / "parity_ep_demo" / "__init__.py").write_text(
        "import torch\n\n"
        "def rms_norm(x, weight, eps):\n"
        "    h = x.float()\n"
        "    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)\n")
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "parity-ep-demo"\nversion = "0.1"\n\n'
        '[project.entry-points."parity_cli.implementations"]\nep-rms = "parity_ep_demo:rms_norm"\n')
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(pkg)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    monkeypatch.syspath_prepend(str(site))  # what PYTHONPATH=site gives a new interpreter; entry points read sys.path
    env = {"PYTHONPATH": str(site)}  # for the supervised child as well
    listed = run_parity("implementations", "--json", env=env)
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert "ep-rms" in rows and "parity_ep_demo:rms_norm" in rows["ep-rms"]["source"]
    assert "parity-ep-demo" in rows["ep-rms"]["source"]
    out = tmp_path / "r.json"
    r = run_parity("check", ckpt("llama", layers=1), "--candidate", "ep-rms", "--json", out, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert load_json(out)["candidate"]["source"].startswith("entry point ep-rms")
    unknown = run_parity("check", ckpt("llama", layers=1), "--candidate", "ep-nope", env=env)
    assert unknown.returncode == 2 and "ep-rms" in unknown.stderr  # the message lists what is known


# --- converted checkpoints ----------------------------------------------------------------------------

def _copy(src, dst, config=None, edit=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors")
    return dst


def test_candidate_checkpoint_identical_copy_passes(ckpt, tmp_path):
    src = ckpt("llama", layers=2, eps=1e-6)
    report = api.check(src, candidate="hf", candidate_checkpoint=str(_copy(src, tmp_path / "copy")))
    assert report.passed
    assert report.header["candidate"]["checkpoint"]["findings"] == 0


def test_candidate_checkpoint_eps_changed(ckpt, tmp_path):
    src = ckpt("llama", layers=2, eps=1e-6)
    copy = _copy(src, tmp_path / "copy", config={"rms_norm_eps": 1e-5})
    report = api.check(src, candidate="hf", candidate_checkpoint=str(copy))
    assert not report.passed
    for layer in report.layers:
        codes = [f["code"] for f in layer.findings]
        assert codes == ["checkpoint_eps_mismatch"]
        assert layer.findings[0]["candidate"]["value"] == 1e-5 and layer.findings[0]["reference"]["value"] == 1e-6
        assert layer.candidate_eps["value"] == 1e-5
        # the probes then run with the copy's eps, and the tiny stratum shows it
        assert "tiny" in [s.name for s in layer.strata if s.status == "fail"]


def test_candidate_checkpoint_weight_shifted_by_one(ckpt, tmp_path):
    src = ckpt("llama", layers=2, eps=1e-6)
    name = "model.layers.1.input_layernorm.weight"

    def shift(t):
        t[name] = (t[name].double() + 1).to(t[name].dtype)

    report = api.check(src, candidate="hf", candidate_checkpoint=str(_copy(src, tmp_path / "copy", edit=shift)))
    by_name = {l.name: l for l in report.layers}
    bad = by_name["model.layers.1.input_layernorm"]
    assert [f["code"] for f in bad.findings] == ["checkpoint_weight_mismatch"]
    assert bad.findings[0]["uniform_shift"] == 1.0 and bad.findings[0]["affected_channels"] == 64
    assert all(not l.findings for n, l in by_name.items() if n != bad.name)
    assert not report.passed


def test_candidate_checkpoint_missing_layer(ckpt, tmp_path):
    src = ckpt("llama", layers=2, eps=1e-6)
    copy = _copy(src, tmp_path / "copy", edit=lambda t: t.pop("model.layers.0.post_attention_layernorm.weight"))
    out = tmp_path / "r.json"
    r = run_parity("check", src, "--candidate", "hf", "--candidate-checkpoint", copy, "--json", out)
    assert r.returncode == 1
    assert "checkpoint_layer_missing" in r.stdout
    layer = [l for l in load_json(out)["layers"] if l["name"] == "model.layers.0.post_attention_layernorm"][0]
    assert layer["status"] == "fail" and layer["findings"][0]["code"] == "checkpoint_layer_missing"


def test_candidate_checkpoint_extra_layer_fails_the_report(ckpt, tmp_path):
    src = ckpt("qwen2", layers=1, eps=1e-6)
    copy = ckpt("qwen3", layers=1, eps=1e-6)  # qwen3 adds q_norm/k_norm the original lacks
    report = api.check(src, candidate="hf", candidate_checkpoint=str(copy))
    extra = {f["layer"] for f in report.findings}
    assert extra == {"model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"}
    assert not report.passed


# --- gradients -----------------------------------------------------------------------------------------------

def test_closed_form_gradient_agrees_with_oracle_autograd():
    """dL/dx_i = g_i/r - x_i/(n r^3) * sum_j x_j g_j (unit gain), r = sqrt(q + eps): the closed form
    and float64 autograd of the overflow-safe oracle must agree."""
    gen = torch.Generator().manual_seed(5)
    for scale, eps in ((1.0, 1e-5), (1e-3, 1e-6), (300.0, 1e-6), (1e-4, 1e-5)):
        x = (scale * torch.randn(6, 32, generator=gen, dtype=torch.float64)).requires_grad_(True)
        g = torch.randn(6, 32, generator=gen, dtype=torch.float64)
        (oracle_normalize(x, eps) * g).sum().backward()
        xd = x.detach()
        n = xd.shape[-1]
        r = torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
        closed = g / r - xd / (n * r ** 3) * (xd * g).sum(-1, keepdim=True)
        torch.testing.assert_close(x.grad, closed, rtol=1e-12, atol=1e-12 * float(closed.abs().max()))


@pytest.mark.parametrize("candidate,dtype", [("hf", "bfloat16"), ("torch", "bfloat16"), ("hf", "float32"),
                                             (plugin("full_backward"), "bfloat16"), (plugin("LlamaRMSNorm"), "float16")])
def test_correct_backward_passes(ckpt, candidate, dtype):
    report = api.check(ckpt("llama", layers=1, eps=1e-5), candidate=candidate, dtype=dtype, grad=True)
    assert report.passed, [(l.name, [(g.name, g.max_abs_err) for g in l.grad if not g.passed]) for l in report.layers]
    assert {g.name for g in report.layers[0].grad} >= {"normal:dx", "normal:dweight", "tiny:dx"}


def test_gemma_layernorm_backward_passes(ckpt):
    assert api.check(ckpt("gemma3", layers=1, eps=1e-6), candidate="hf", grad=True).passed
    assert api.check(ckpt("gpt2", layers=1, eps=1e-5), candidate="hf", grad=True, dtype="float32").passed


def test_dropped_shared_term_passes_forward_fails_grad(ckpt):
    path = ckpt("llama", layers=1, eps=1e-5)
    assert api.check(path, candidate=plugin("dropped_shared_term")).passed
    report = api.check(path, candidate=plugin("dropped_shared_term"), grad=True)
    assert not report.passed
    for layer in report.layers:
        assert all(s.passed for s in layer.strata)  # the forward is right
        failing = {g.name for g in layer.grad if not g.passed}
        assert "normal:dx" in failing and "normal:dweight" not in failing
        assert [d.code for d in layer.diagnoses] == ["grad_mismatch"]


def test_non_differentiable_candidate_is_a_finding(ckpt):
    report = api.check(ckpt("llama", layers=1), candidate=plugin("not_differentiable"), grad=True)
    assert not report.passed
    layer = report.layers[0]
    assert all(s.passed for s in layer.strata)
    assert any("not differentiable" in (g.error or "") for g in layer.grad)
    assert layer.diagnoses[0].code == "grad_error"


# --- robust candidates ----------------------------------------------------------------------------------------

def test_hung_candidate_times_out_per_layer_and_the_run_goes_on(ckpt, tmp_path):
    out = tmp_path / "r.json"
    r = run_parity("check", ckpt("llama", layers=2), "--candidate", plugin("hangs"), "--timeout", "0.5",
                   "--layers", "model.layers.*", "--json", out)
    assert r.returncode == 1, r.stderr
    layers = load_json(out)["layers"]
    assert len(layers) == 4
    assert all(l["status"] == "error" and "timed out after 0.5s" in l["error"] for l in layers)


def test_wrong_dtype_is_reported_and_compared_after_upcast(ckpt):
    report = api.check(ckpt("llama", layers=1, eps=1e-5), candidate=plugin("returns_float32"))
    layer = report.layers[0]
    assert any("returned float32 for bfloat16" in w for w in layer.warnings)
    # fp32 output of Gemma-order math is closer to the exact result than bf16 rounding: it passes
    assert report.passed


def test_bad_timeout_is_input_error(ckpt):
    r = run_parity("check", ckpt("llama", layers=1), "--timeout", "0")
    assert r.returncode == 2 and "--timeout" in r.stderr


# --- GPU -------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_candidate_records_the_gpu(ckpt):
    report = api.check(ckpt("llama", layers=1, eps=1e-5), candidate="hf", device="cuda", grad=True)
    assert report.passed
    env = report.header["environment"]
    assert env["gpu"]["name"] and env["cuda"] and report.header["candidate"]["device"].startswith("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reference_device(ckpt):
    report = api.check(ckpt("gemma3", layers=1), candidate="torch", device="cuda", reference="hf",
                       reference_device="cuda", reference_dtype="float32")
    assert report.header["reference"]["device"].startswith("cuda")


def test_permuted_weights_in_a_copy_are_not_called_precision_loss(ckpt, tmp_path):
    src = ckpt("llama", layers=1, eps=1e-6, dtype="float32")
    name = "model.norm.weight"

    def permute(t):
        t[name] = t[name].flip(0).to(torch.bfloat16)

    report = api.check(src, candidate="hf", candidate_checkpoint=str(_copy(src, tmp_path / "copy", edit=permute)))
    (finding,) = next(l for l in report.layers if l.name == "model.norm").findings
    assert finding["code"] == "checkpoint_weight_mismatch" and "precision_loss" not in finding


def test_explain_uses_the_candidate_checkpoint(ckpt, tmp_path):
    src = ckpt("llama", layers=1, eps=1e-6)
    copy = _copy(src, tmp_path / "copy", config={"rms_norm_eps": 1e-5})
    ladder = api.explain(src, candidate="hf", candidate_checkpoint=str(copy), layers="model.norm")
    steps = {s["changes"]: s for s in ladder["model.norm"]}
    assert steps["nothing"]["status"] == "fail"  # the copy's eps, as in the check
    assert steps["eps"]["status"] == "pass" and "1e-5" in steps["eps"]["step"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_oracle_on_the_gpu_agrees_with_the_cpu_oracle(ckpt):
    """The float64 oracle and the comparison on the GPU give the CPU's verdict and counts; the
    figures differ only by float64 reduction order (relative 1e-12 is 1e4 ulp of float64)."""
    path = ckpt("llama", layers=2, eps=1e-5)
    runs = {dev: api.check(path, candidate="torch", device="cuda", candidate_eps=1e-6, reference_device=dev)
            for dev in ("cpu", "cuda")}
    assert runs["cuda"].header["reference"]["device"].startswith("cuda")
    for a, b in zip(runs["cpu"].layers, runs["cuda"].layers):
        assert a.status == b.status == "fail"
        for sa, sb in zip(a.strata, b.strata):
            assert (sa.name, sa.status, sa.violations) == (sb.name, sb.status, sb.violations)
            assert sb.max_abs_err == pytest.approx(sa.max_abs_err, rel=1e-12)
        assert [d.code for d in a.diagnoses] == [d.code for d in b.diagnoses] == ["eps_mismatch"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reference_device_auto_follows_fast_float64():
    props = torch.cuda.get_device_properties(0)
    fast = (props.major, props.minor) in api.FAST_FLOAT64
    assert api.reference_device("auto", "cuda:0") == ("cuda:0" if fast else "cpu")
    assert api.reference_device("auto", "cpu") == "cpu"


def test_reference_device_auto_is_the_cpu_for_a_cpu_candidate_or_another_reference():
    """Only the float64 oracle follows a GPU candidate: another reference would run other kernels."""
    assert api.reference_device("auto", "cpu") == "cpu"
    assert api.reference_device("auto", "cuda", oracle=False) == "cpu"
    opts = api.CheckOptions(reference="hf")
    assert not api.is_oracle(opts) and api.is_oracle(api.CheckOptions())
    assert not api.is_oracle(api.CheckOptions(reference_dtype="float32"))
