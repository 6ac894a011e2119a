"""Norm kinds beyond RMSNorm and LayerNorm with gain w (issue 26), each against the real
transformers class it came from: Nemotron's LayerNorm1P (a LayerNorm with gain 1 + w), and
MobileBERT's NoNorm, which is not a normalisation at all and is said to be one of nothing."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P  # noqa: E402

from parity_cli import api  # noqa: E402
from parity_cli.model.derive import classify, derive, write_tiny_checkpoint  # noqa: E402
from parity_cli.model.forms import hf_forward  # noqa: E402


def _layer_norm_1p_float64(x, w, b, eps):
    """The LayerNorm1P formula, transcribed: (x - mean) / sqrt(var + eps) * (1 + w) + b."""
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w) + b


@pytest.fixture
def norm():
    module = NemotronLayerNorm1P(64, eps=1e-5)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # stored w around 0, as Nemotron trains it
        module.weight.copy_(torch.rand(64, generator=gen) * 0.4 - 0.2)
        module.bias.copy_(torch.rand(64, generator=gen) * 0.4 - 0.2)
    return module


def test_layer_norm_1p_is_classified_as_layer_norm_with_gain_one_plus_w(norm):
    sem = classify(norm, 1e-5)
    assert (sem["kind"], sem["gain_offset"], sem["order"], sem["order_exact"]) == ("layer_norm", 1.0, "native", True)
    x = torch.randn(9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    x[0] *= 1e-3  # eps shows here
    with torch.no_grad():
        got = norm.to(torch.float64)(x)
    want = _layer_norm_1p_float64(x, norm.weight.double(), norm.bias.double(), 1e-5)
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_hf_transcription_is_bitwise_the_class(norm, dtype):
    module = norm.to(dtype)
    x = (torch.randn(33, 64, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    ours = hf_forward("layer_norm", "native", 1.0, "rsqrt", 64, module.weight, module.bias, 1e-5)
    with torch.no_grad():
        assert torch.equal(module(x), ours(x))


def test_nemotron_checks_with_its_own_class_and_a_port_without_the_one_is_named(tmp_path):
    """Nemotron (a derived family): every LayerNorm1P found with the config's norm_eps and passing
    with its own class; a port that uses plain LayerNorm on the stored w is diagnosed on every
    layer as the missing + 1."""
    data = derive("nemotron")
    assert data["norms"] and {(n["kind"], n["gain_offset"]) for n in data["norms"]} == {("layer_norm", 1.0)}
    assert {tuple(n["eps_keys"]) for n in data["norms"]} == {("norm_eps",)}
    path = tmp_path / "nemotron"
    write_tiny_checkpoint("nemotron", path)
    eps = json.loads((path / "config.json").read_text())["norm_eps"]
    ok = api.check(path, candidate="transformers", isolation="none")
    assert ok.passed and len(ok.layers) == 5 and {layer.eps["value"] for layer in ok.layers} == {eps}
    plugin = tmp_path / "plain.py"
    plugin.write_text("import torch\n\nclass PlainLayerNorm(torch.nn.LayerNorm):\n    pass\n")
    bad = api.check(path, candidate=f"{plugin}:PlainLayerNorm", dtype="float32", isolation="none")
    assert not bad.passed
    assert all({d.code for d in layer.diagnoses} == {"weight_offset_mismatch"} for layer in bad.layers)


def test_mobilebert_no_norm_is_not_a_normalisation():
    """NoNorm is w * x + b: no statistic, no eps. Listed as what it is, never checked as a norm."""
    from transformers.models.mobilebert.modeling_mobilebert import NoNorm

    assert classify(NoNorm(64), None) == {"unsupported": "not a normalisation (w * x + b: no statistic, no eps)"}
    data = derive("mobilebert")
    assert not data["norms"]
    assert {u["why"] for u in data["unsupported"]} == {"not a normalisation (w * x + b: no statistic, no eps)"}
