"""Issue 16: ONNX Runtime as a candidate — the family's norm as an ONNX graph in an
InferenceSession (RMSNormalization-23 or the decomposed pattern, LayerNormalization-17)."""

import pytest

from conftest import run_parity
from parity_cli import api

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

# one model type per family in configs/families
FAMILIES = ["llama", "qwen3", "gemma3_text", "gemma3n_text", "cohere", "olmo2", "t5", "bert", "gpt2"]


@pytest.mark.parametrize("op", ["fused", "decomposed"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_passes_with_its_own_semantics(ckpt, model_type, dtype, op):
    path = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-5)
    report = api.check(path, candidate="onnxruntime", candidate_args={"op": op}, dtype=dtype, isolation="none")
    assert report.passed, [(l.name, l.status, l.error, [d.code for d in l.diagnoses]) for l in report.layers]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "bert"])
def test_bfloat16_through_float32_compute(ckpt, model_type):
    path = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-5, dtype="bfloat16")
    report = api.check(path, candidate="onnxruntime", candidate_args={"compute": "float32"}, isolation="none")
    assert report.header["candidate"]["dtype"] == "bfloat16" and report.passed


def test_a_missing_bf16_kernel_is_one_clear_line(ckpt):
    """The CPU execution provider has no bfloat16 Mul: the decomposed Llama graph cannot be built."""
    path = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5, dtype="bfloat16")
    r = run_parity("check", path, "--candidate", "onnxruntime", "--candidate-arg", "op=decomposed")
    assert r.returncode == 1
    groups = [line for line in r.stdout.splitlines() if line.startswith("3 layers: error:")]
    assert len(groups) == 1 and "compute=float32" in r.stdout and "bfloat16" in groups[0]


def test_the_runtime_default_eps_is_caught(ckpt):
    """A deployment that builds the graph with ONNX's default epsilon 1e-5 on a 1e-6 model."""
    path = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-6)
    report = api.check(path, candidate="onnxruntime", candidate_eps=1e-5, dtype="float32")
    assert not report.passed
    codes = {d.code for l in report.layers for d in l.diagnoses}
    assert codes == {"eps_mismatch"}
    est = [d.evidence["estimated_eps"] for l in report.layers for d in l.diagnoses]
    assert all(abs(e - 1e-5) / 1e-5 < 0.05 for e in est)


def test_candidate_args_are_checked(ckpt):
    path = ckpt("llama", layers=1)
    r = run_parity("check", path, "--candidate", "onnxruntime", "--candidate-arg", "op=sideways")
    assert r.returncode == 2 and r.stderr.strip() == ("parity: error: --candidate-arg op=sideways: onnxruntime "
                                                      "accepts op=auto|fused|decomposed")
    r = run_parity("check", path, "--candidate", "torch", "--candidate-arg", "op=fused")
    assert r.returncode == 2 and "takes no arguments" in r.stderr
