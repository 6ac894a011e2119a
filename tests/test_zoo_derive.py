"""Families derived from the model's own transformers classes (issue 25), checked against those
classes: the forms and orders found are re-derived here from independent transcriptions of the
issue's facts (gpt_oss is Gemma's cast order with gain w, Gemma 3's SigLIP tower is saved without
`vision_model.`, Gemma 4's gain is w), and a checkpoint of a type no file claims is checked
with its own classes."""

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parity_cli import api  # noqa: E402
from parity_cli.errors import InputError  # noqa: E402
from parity_cli.model.derive import derive, write_tiny_checkpoint  # noqa: E402


def _by_name(data):
    """Norms by their stored name pattern ({root}: the model's prefix, or none)."""
    return {n["name"].removeprefix("{root}"): n for n in data["norms"]}


def _gemma_order(x, weight, eps):
    """Gemma's order, transcribed from the issue's statement: normalise in float32, multiply by
    the float32 gain, cast last."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).type_as(x)


def test_gpt_oss_is_gemma_order_with_gain_w():
    data = derive("gpt_oss")
    assert data["derived_from"].endswith("GptOssForCausalLM")
    assert {n["order"] for n in data["norms"]} == {"gemma"}
    assert {n["gain_offset"] for n in data["norms"]} == {0.0}
    assert {tuple(n["eps_keys"]) for n in data["norms"]} == {("rms_norm_eps",)}
    # the classification, redone by hand on the real class at bfloat16
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    norm = GptOssRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.2, 1.7, 64))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(norm(x), _gemma_order(x, norm.weight, 1e-5))


def test_gemma3_towers_are_named_as_saved_each_with_its_own_eps_key():
    data = _by_name(derive("gemma3"))
    # transformers 5.24 saves the SigLIP tower without its vision_model. prefix
    vision = data["vision_tower.encoder.layers.{i}.layer_norm1"]
    assert vision["kind"] == "layer_norm" and vision["gain_offset"] == 0.0
    assert vision["eps_keys"] == ["vision_config.layer_norm_eps"]
    text = data["language_model.model.layers.{i}.input_layernorm"]
    assert text["kind"] == "rms_norm" and text["gain_offset"] == 1.0 and text["order"] == "gemma"
    assert text["eps_keys"] == ["text_config.rms_norm_eps"]
    assert "language_model.model.layers.{i}.self_attn.q_norm" in data


def test_gemma4_gain_is_w_not_one_plus_w():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma4")
    norms = [n for n in derive("gemma4")["norms"] if n["kind"] == "rms_norm"]
    assert norms and {n["gain_offset"] for n in norms} == {0.0}


def test_norms_parity_cannot_express_are_listed_with_why_never_guessed():
    gated = derive("qwen3_next")
    assert any("gate" in u["why"] for u in gated["unsupported"])
    assert "layers.{i}.self_attn.q_norm" in _by_name(gated)  # the attention layers' norms are found
    l2 = derive("llama4")
    assert any(u["class"].endswith("Llama4TextL2Norm") and "weightless" in u["why"] for u in l2["unsupported"])


def test_an_eps_the_model_code_fixes_is_no_config_key():
    """Whisper's LayerNorms are nn.LayerNorm(d) with torch's default eps: no config key holds it."""
    norms = derive("whisper")["norms"]
    assert norms and all(n["eps_keys"] == [] and n["eps"] == 1e-5 for n in norms)


def _without_generated(tmp_path, monkeypatch):
    from parity_cli.model import families
    from parity_cli.resources import configs_dir

    root = tmp_path / "configs"
    shutil.copytree(configs_dir(), root)
    shutil.rmtree(root / "families" / "derived", ignore_errors=True)
    monkeypatch.setattr(families, "configs_dir", lambda: root)
    families.clear_caches()


def test_a_type_no_file_claims_is_derived_at_run_time_and_checked(tmp_path, monkeypatch):
    from parity_cli.model import families

    try:
        _without_generated(tmp_path, monkeypatch)
        path = tmp_path / "smollm3"
        assert write_tiny_checkpoint("smollm3", path)["class"] == "SmolLM3ForCausalLM"
        report = api.check(path, candidate="transformers", strata=["zero", "tiny", "normal"])
        ck = report.header["checkpoint"]
        assert ck["family"] == "smollm3" and ck["family_source"].endswith(": SmolLM3ForCausalLM")
        assert report.passed and len(report.layers) == 5  # 2 layers x 2 norms + the final norm
        # the eps each layer reads is the config's, and a wrong one is caught
        eps = json.loads((path / "config.json").read_text())["rms_norm_eps"]
        assert report.header["eps"] == {"value": eps, "source": "config:rms_norm_eps"}
        bad = api.check(path, candidate="torch", candidate_eps=eps * 100, strata=["zero", "tiny", "normal"])
        assert not bad.passed
    finally:
        families.clear_caches()


def test_remote_code_and_unknown_types_are_one_line(tmp_path, monkeypatch):
    from parity_cli.model import families

    try:
        _without_generated(tmp_path, monkeypatch)
        path = tmp_path / "m"
        write_tiny_checkpoint("smollm3", path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "evil.Model"}}))
        with pytest.raises(InputError, match="remote code.*--family"):
            api.check(path)
        (path / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
        with pytest.raises(InputError, match="--family"):
            api.check(path)
        assert api.check(path, family="llama", strata=["normal"]).passed  # the way out
    finally:
        families.clear_caches()
