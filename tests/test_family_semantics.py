"""Correct candidates pass on every family; another family's semantics fails."""

import pytest
from conftest import plugin

from parity_cli import api
from parity_cli.sources.synthetic import LAYOUTS


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
@pytest.mark.parametrize("candidate", ["hf", "torch"])
def test_correct_candidates_pass_on_every_family(ckpt, model_type, candidate):
    report = api.check(ckpt(model_type, layers=1, eps=1e-5), candidate=candidate)
    assert report.passed, report.summary()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("model_type", ["gemma3", "cohere", "t5", "bert", "olmo2"])
def test_hf_passes_in_other_dtypes(ckpt, model_type, dtype):
    assert api.check(ckpt(model_type, layers=1, eps=1e-5), candidate="hf", dtype=dtype).passed


def test_llama_order_module_on_gemma_checkpoint_fails(ckpt):
    report = api.check(ckpt("gemma3", layers=1, eps=1e-6), candidate=plugin("LlamaRMSNorm"))
    assert not report.passed
    codes = {d.code for layer in report.layers for d in layer.diagnoses}
    assert "weight_offset_mismatch" in codes  # gain w where the family expects 1 + w


def test_layernorm_without_bias_on_bert_fails(ckpt):
    report = api.check(ckpt("bert", layers=1, eps=1e-12, dtype="float32"), candidate=plugin("layer_norm_without_bias"))
    assert not report.passed and all(l.status == "fail" for l in report.layers)


def test_rmsnorm_on_layernorm_checkpoint_fails(ckpt):
    report = api.check(ckpt("gpt_neox", layers=1, eps=1e-5), candidate=plugin("rms_norm_with_bias"))
    assert not report.passed and all(l.status == "fail" for l in report.layers)
