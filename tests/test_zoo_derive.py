"""Families derived from the model's own transformers classes (issue 25), checked against those
classes: the forms and orders found are re-derived here from independent transcriptions of the
issue's facts (gpt_oss is Gemma's cast order with gain w, Gemma 3's SigLIP tower is saved without
`vision_model.`, Gemma 4's gain is w), and a checkpoint of a type no file claims is checked
with its own classes."""

import json
import shutil

import pytest
from conftest import NARROW_RESNET, SLOW

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from plugins.installed_classes import built_class, eps_of  # noqa: E402

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


def test_a_gated_norm_and_a_weightless_norm_are_derived_as_what_their_classes_compute():
    """Qwen3-Next's linear-attention norm is RMSNorm(x) * w * silu(z) (its forward normalises, casts,
    multiplies by the weight, then by silu of the gate in float32); Llama 4's L2Norm has no parameter
    and runs over each head. Each entry is checked against the module run here in float64."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    gated = _by_name(derive("qwen3_next"))
    entry = next(v for k, v in gated.items() if k.endswith("linear_attn.norm"))
    module = Qwen3NextRMSNormGated(32, eps=1e-6).to(torch.float64)
    x, z = torch.randn(3, 32, dtype=torch.float64), torch.randn(3, 32, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(torch.rand(32, dtype=torch.float64) + 0.5)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * module.weight * torch.nn.functional.silu(z)
        assert torch.allclose(module(x, z), want, rtol=1e-5)  # float32 inside
    assert (entry["kind"], entry["gate"], entry["activation"], entry["groups"]) == ("gated_rms_norm", "after", "silu", 1)
    assert "layers.{i}.self_attn.q_norm" in gated  # the attention layers' norms are found beside it
    l2 = next(v for k, v in _by_name(derive("llama4_text")).items() if k.endswith("qk_norm"))
    norm = built_class("llama4_text", "layers.0.self_attn.qk_norm")(1e-5)  # Llama4TextL2Norm until 5.24
    assert not list(norm.parameters()) and l2["weightless"] is True and l2["kind"] == "rms_norm"
    assert l2["dim"] == "head_dim" and l2["eps_keys"] == ["rms_norm_eps"]


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
        report = api.check(path, candidate="transformers", strata=["zero", "tiny", "normal"])  # supervised
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


def test_a_forced_family_without_its_eps_key_says_the_eps_is_assumed(tmp_path):
    """lxmert's LayerNorms use eps 1e-12 from the model code; its config has no layer_norm_eps.
    Forced to `layer_norm`, the family's 1e-5 is a guess: said on the verdict line and recorded
    as forced. Its generated family reads the module's own 1e-12, and says nothing of the kind."""
    from parity_cli.report.terminal import quiet_line

    path = tmp_path / "lxmert"
    truth = write_tiny_checkpoint("lxmert", path)
    assert {n["eps"] for n in truth["norms"]} == {1e-12}
    assert "layer_norm_eps" not in json.loads((path / "config.json").read_text())
    # its own family reads the module's eps 1e-12: the forced one contradicts it, and is confirmed
    forced = api.check(path, family="layer_norm", family_force=True, candidate="oracle", strata=["normal"])
    d = forced.to_dict()
    assert d["eps"] == {"value": 1e-5, "source": "family-default"} and d["checkpoint"]["family_forced"] is True
    line = quiet_line(d)
    assert line.startswith("PASS: ") and "eps 1e-5 is forced family layer_norm's default, assumed" in line
    own = api.check(path, candidate="transformers", strata=["zero", "tiny", "normal"], isolation="none").to_dict()
    assert own["checkpoint"]["family"] == "lxmert" and own["checkpoint"]["family_forced"] is False
    assert {layer["eps"]["value"] for layer in own["layers"]} == {1e-12}
    assert own["summary"]["verdict"] == "pass" and "assumed" not in quiet_line(own)


def test_layers_are_grouped_by_tower_each_with_its_own_eps(tmp_path):
    """Gemma 3 as transformers 5.24 saves it: 13 language RMSNorms (2 layers x 6 + the final norm)
    read text_config's eps, the SigLIP tower's 6 LayerNorms (2 layers x 2, post_layernorm, the
    pooling head's) vision_config's, and the projector's RMSNorm is a tower of its own. Each eps
    key is given its own value here, so a layer reading another tower's eps shows."""
    from parity_cli.report.terminal import towers_line

    path = tmp_path / "gemma3"
    write_tiny_checkpoint("gemma3", path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 3e-6
    config["vision_config"]["layer_norm_eps"] = 7e-6
    (path / "config.json").write_text(json.dumps(config))
    info = api.inspect(path)
    by_tower = {}
    for layer in info["layers"]:
        by_tower.setdefault(layer["tower"], set()).add((layer["kind"], layer["eps"]["value"]))
    counts = {t: sum(1 for layer in info["layers"] if layer["tower"] == t) for t in by_tower}
    assert counts == {"language": 13, "vision": 6, "projector": 1}
    assert by_tower == {"language": {("rms_norm", 3e-6)}, "vision": {("layer_norm", 7e-6)},
                        "projector": {("rms_norm", 7e-6)}}
    assert towers_line(info["layers"]) == "towers: language 13, projector 1, vision 6"
    report = api.check(path, candidate="transformers", strata=["zero", "tiny", "normal"], isolation="none").to_dict()
    assert report["summary"]["verdict"] == "pass"
    assert {layer["tower"] for layer in report["layers"]} == {"language", "vision", "projector"}


def test_a_model_of_one_stack_has_no_tower_line(tmp_path):
    from parity_cli.report.terminal import towers_line

    path = tmp_path / "qwen2"
    write_tiny_checkpoint("qwen2", path)
    info = api.inspect(path)
    assert {layer["tower"] for layer in info["layers"]} == {"main"} and towers_line(info["layers"]) == ""


def test_a_gated_norm_that_a_shrunk_model_makes_look_plain_is_classified_with_its_gate():
    """Zamba2's Mamba norm is rms_norm(x * silu(gate)) per group of channels. Called without the
    gate on one group it computes a plain RMSNorm, so only a call with a gate says what it is: it is
    classified with one, its groups read off group_size, and the plain norms beside it still found."""
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    from parity_cli.model.derive import classify

    norm = Zamba2RMSNormGated(64, group_size=16, eps=1e-5)
    x = torch.randn(3, 64, dtype=torch.float64)
    with torch.no_grad():  # without its gate, one group: exactly an RMSNorm with gain w
        plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.allclose(Zamba2RMSNormGated(64, group_size=64, eps=1e-5).to(torch.float64)(x), plain)
    sem = classify(norm, 1e-5)
    assert (sem["kind"], sem["gate"], sem["activation"], sem["groups"]) == ("gated_rms_norm", "before", "silu",
                                                                              64 // norm.group_size)
    data = derive("zamba2")
    assert any(n["name"].endswith("mamba.norm") and n["kind"] == "gated_rms_norm" for n in data["norms"])
    assert "layers.{i}.input_layernorm" in _by_name(data)


def test_a_sequential_position_is_not_a_layer_index():
    """RT-DETR's enc_output is Sequential(Linear, LayerNorm): `enc_output.{i}` would claim the
    Linear's 2-D weight as a norm. The pattern keeps the position; the whole model then checks."""
    data = _by_name(derive("rt_detr"))
    assert "enc_output.1" in data and "enc_output.{i}" not in data


def test_a_model_the_first_shrink_leaves_large_is_shrunk_harder():
    """XLM's embedding width (emb_dim 2048) is not a name the first shrink knows: over 100 M
    parameters. The second shrink lowers every size-like int, and the family is derived."""
    data = derive("xlm")
    assert data["norms"] and {n["kind"] for n in data["norms"]} == {"layer_norm"}


def test_gemma4_per_layer_overrides_follow_the_shrunk_layers(tmp_path):
    """Gemma 4 keeps per-layer overrides by layer index (a full-attention layer's head_dim). A tiny
    checkpoint of 2 layers must not keep the indices of 30, or transformers cannot read its config:
    it is written, read back, and its own class passes against the oracle."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma4")
    from transformers import AutoConfig

    path = tmp_path / "gemma4"
    write_tiny_checkpoint("gemma4", path)
    config = AutoConfig.from_pretrained(path)  # raised on out-of-range per_layer_config keys
    assert config.text_config.num_hidden_layers == 2
    # the kept full-attention layer (index 1) carries the override of the first full-attention layer
    # of the class's own default config, and nothing of the 30 layers is left
    from transformers import Gemma4TextConfig

    default = Gemma4TextConfig()
    first_full = default.layer_types.index("full_attention")
    override = {k: v for k, v in default.to_dict()["per_layer_config"].items() if int(k) == first_full}
    written = json.loads((path / "config.json").read_text())["text_config"]
    assert written["layer_types"] == ["sliding_attention", "full_attention"]
    assert {int(k): v for k, v in written["per_layer_config"].items()} == {1: next(iter(override.values()))}
    report = api.check(path, candidate="transformers", strata=["zero", "tiny", "normal"], isolation="none")
    assert report.passed and len(report.layers) >= 10
    for layer in report.layers:  # each eps is the value at the config key it names, or the model code's
        source = layer.eps["source"]
        if source.startswith("config:"):
            node = json.loads((path / "config.json").read_text())
            for part in source.removeprefix("config:").split("."):
                node = node[part]
            assert layer.eps["value"] == node, layer.name
        else:
            assert source.startswith("model-code"), (layer.name, source)


def test_a_norm_class_built_from_a_config_runs_as_the_candidate(tmp_path):
    """CpmAntLayerNorm(config) takes its width and eps from a config, not (dim, eps=)."""
    path = tmp_path / "cpmant"
    write_tiny_checkpoint("cpmant", path)
    report = api.check(path, candidate="transformers", strata=["zero", "tiny", "normal"], isolation="none")
    assert report.passed and not any(layer.error for layer in report.layers)
    bad = api.check(path, candidate="transformers", candidate_eps=1e-2, strata=["tiny"], isolation="none")
    assert not bad.passed  # the eps given reaches the class through its config


@pytest.mark.parametrize("value", [5, "text", [1e-6], True])
def test_a_sub_config_of_the_wrong_type_is_one_line(tmp_path, value):
    """Qwen2.5-VL's language norms read text_config.rms_norm_eps: a text_config that is not an
    object is bad input naming the key, never a silent family default."""
    path = tmp_path / "qwen2_5_vl"
    write_tiny_checkpoint("qwen2_5_vl", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "text_config": value}))
    with pytest.raises(InputError) as info:
        api.check(path, strata=["normal"])
    message = str(info.value)
    assert message.startswith(f"{path / 'config.json'}: 'text_config' is a") and "not an object" in message
    assert "\n" not in message


def test_gemma3n_audio_tower_eps_as_its_own_classes_build_it():
    """gemma3n's audio conformer, built from its own config class with a marker eps: every
    Gemma3nRMSNorm in it is claimed by the gemma3n family under model.audio_tower., and the eps
    the family gives each (the config's, or the class default 1e-6 where the model code passes
    none) is the module's own."""
    from transformers import Gemma3nAudioConfig
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nAudioEncoder, Gemma3nRMSNorm

    from parity_cli.model.families import family_by_name

    marker = 3.7e-5
    config = Gemma3nAudioConfig(rms_norm_eps=marker, hidden_size=64, conf_num_hidden_layers=2,
                                conf_num_attention_heads=4)
    encoder = Gemma3nAudioEncoder(config)
    family = family_by_name("gemma3n")
    norms = [(name, m) for name, m in encoder.named_modules() if type(m) is Gemma3nRMSNorm and m.with_scale]
    assert len(norms) == 2 * 9
    for name, module in norms:
        pattern = family.match(f"model.audio_tower.{name}")
        assert pattern is not None, name
        sem = pattern.semantics
        expected = sem.eps if sem.eps is not None else (marker if sem.eps_keys == ("audio_config.rms_norm_eps",)
                                                         else None)
        assert expected == eps_of(module), (name, eps_of(module), sem)
    assert {eps_of(m) for _, m in norms} == {1e-6, marker}  # both kinds are there


def test_a_tower_is_named_by_the_innermost_sub_config_its_eps_comes_from():
    """pi0 keeps PaliGemma's towers under vlm_config: its SigLIP norms read
    vlm_config.vision_config.layer_norm_eps, its language norms vlm_config.text_config's."""
    from parity_cli.model.layers import tower_of

    assert tower_of("paligemma_with_expert.x.encoder.layers.0.layer_norm1",
                    "config:vlm_config.vision_config.layer_norm_eps") == "vision"
    assert tower_of("paligemma_with_expert.x.layers.0.input_layernorm", "config:vlm_config.text_config.rms_norm_eps") \
        == "language"
    # a name that says its tower wins over where its eps comes from (Gemma 3's projector reads the vision eps)
    assert tower_of("multi_modal_projector.mm_soft_emb_norm", "config:vision_config.layer_norm_eps") == "projector"
    assert tower_of("model.visual.blocks.0.norm1", "config:text_config.rms_norm_eps") == "vision"


def test_a_config_model_type_is_never_a_family_name(ckpt):
    """`--family layer_norm` forces the family; a config saying model_type "layer_norm" is no model."""
    path = ckpt("bert", layers=1, config_extra={"model_type": "layer_norm"})
    with pytest.raises(InputError, match="model_type 'layer_norm'"):
        api.load(path)
    assert api.load(path, family="layer_norm")[1].name == "layer_norm"


def test_two_copy_layers_are_never_given_one_name():
    """A GGUF layer is renamed to the reference's only where no copy layer has that name already:
    a duplicate would hide one of them from the pairing."""
    from parity_cli.model.families import family_by_name
    from parity_cli.model.layers import NormLayer
    from parity_cli.pipeline import _as_named
    from parity_cli.sources.tensors import Eps

    def layer(name):
        return NormLayer(name=name, kind="rms_norm", dim=4, order="gemma", gain_offset=0.0, eps=Eps(1e-6, "x"),
                         weight=torch.ones(4))

    fam = family_by_name("gemma")
    reference = [layer("model.language_model.norm")]
    copy = _as_named([layer("model.language_model.norm"), layer("model.norm")], reference, fam)
    assert sorted(c.name for c in copy) == ["model.language_model.norm", "model.norm"]
    assert [c.name for c in _as_named([layer("model.norm")], reference, fam)] == ["model.language_model.norm"]


@pytest.mark.parametrize("name,tower", [
    ("model.embed_audio.hard_embedding_norm", "audio"),  # gemma3n's audio embedder
    ("audio_embed.encoder.layers.0.norm", "audio"),  # phi4_multimodal
    ("model.vision_tower.vision_model.post_layernorm", "vision"),  # llava
    ("vpm.encoder.layers.0.layer_norm1", "vision"),  # minicpmv's vision model
    ("model.language_model.layers.0.input_layernorm", "language"),
    ("model.layers.0.input_layernorm", "main"),
])
def test_a_tower_segment_named_after_its_modality_says_so(name, tower):
    from parity_cli.model.layers import tower_of

    assert tower_of(name, "") == tower


# BatchNorm at inference (issue 26's batch_norm): what each module holds and computes is read off the
# module itself, loaded back from the tiny checkpoint by transformers, never off the derivation


def _loaded_batch_norms(path):
    """(name, module) of every BatchNorm of the model transformers loads from `path`: torch's, and the
    frozen copies (a class named ...FrozenBatchNorm2d), with the statistics the checkpoint holds."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path).to(torch.float64).eval()
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) or type(m).__name__.endswith("FrozenBatchNorm2d")]


def _computes_with(module, eps):
    """Whether the module's own forward is (x - running_mean) / sqrt(running_var + eps) * w + b in float64
    on its stored statistics (a tiny checkpoint's variances reach 1e-6: a wrong eps shows there)."""
    c = module.running_var.numel()
    x = torch.randn(5, c, generator=torch.Generator().manual_seed(c), dtype=torch.float64)
    x = x * module.running_var.sqrt() + module.running_mean  # each channel at its own scale
    spatial = 0 if isinstance(module, torch.nn.BatchNorm1d) else 2
    with torch.no_grad():
        got = module(x.reshape(5, c, *([1] * spatial))).reshape(5, c)
    want = (x - module.running_mean) / torch.sqrt(module.running_var + eps) * module.weight + module.bias
    return bool(torch.allclose(got, want, rtol=1e-10, atol=1e-12))


@pytest.mark.parametrize("model_type,cls", [("resnet", "BatchNorm2d"),
                                            pytest.param("fastspeech2_conformer", "BatchNorm1d", marks=SLOW)])
def test_every_batch_norm_is_checked_under_its_stored_name_with_its_own_eps(tmp_path, model_type, cls):
    """ResNet's BatchNorm2d and FastSpeech2's conformer BatchNorm1d (an audio model): every one the
    model holds is a batch_norm layer under its own name, with the module's own eps (torch's default,
    fixed by the model code), and the model's own class passes against the float64 oracle."""
    path = tmp_path / model_type
    write_tiny_checkpoint(model_type, path, config=NARROW_RESNET if model_type == "resnet" else None)
    modules = _loaded_batch_norms(path)
    assert modules and {type(m).__name__ for _, m in modules} == {cls}
    layers = {layer["name"]: layer for layer in api.inspect(path)["layers"]}
    for name, module in modules:
        assert layers[name]["kind"] == "batch_norm", name
        assert layers[name]["eps"]["value"] == module.eps and layers[name]["eps"]["source"].startswith("model-code")
        assert _computes_with(module, layers[name]["eps"]["value"]), name
    report = api.check(path, candidate="transformers", dtype="float32", strata=["zero", "tiny", "normal"],
                       isolation="none", layers="*norm*")
    assert {layer.name for layer in report.layers} >= {name for name, _ in modules}
    assert report.passed
    # the check can fail: Keras' default 1e-3 in place of torch's 1e-5
    bad = api.check(path, candidate="torch", candidate_eps=1e-3, strata=["tiny"], isolation="none",
                    layers=modules[0][0])
    assert not bad.passed


def test_a_batch_norm_eps_from_the_config_is_read_from_the_config(tmp_path):
    """PatchTST's BatchNorm1d takes config.norm_eps: with another value written in config.json, the
    model transformers loads and every layer parity finds hold that value."""
    path = tmp_path / "patchtst"
    write_tiny_checkpoint("patchtst", path)
    config = json.loads((path / "config.json").read_text())
    config["norm_eps"] = 3.5e-4
    (path / "config.json").write_text(json.dumps(config))
    modules = _loaded_batch_norms(path)
    assert modules and {m.eps for _, m in modules} == {3.5e-4}
    layers = {layer["name"]: layer for layer in api.inspect(path)["layers"]}
    for name, module in modules:
        assert layers[name]["kind"] == "batch_norm" and layers[name]["eps"] == {"value": module.eps,
                                                                                "source": "config:norm_eps"}
    assert api.check(path, candidate="transformers", dtype="float32", strata=["zero", "tiny", "normal"],
                     isolation="none").passed


def _forward_literal_eps(cls) -> float:
    """The eps a frozen BatchNorm writes inside its forward, read from its source (the test's own
    way to it; the derivation measures it off the module's output)."""
    import inspect
    import re

    found = re.findall(r"epsilon\s*=\s*([0-9.eE+-]+)", inspect.getsource(cls.forward))
    assert len(found) == 1, found
    return float(found[0])


@pytest.mark.parametrize("model_type", [pytest.param("rt_detr", marks=SLOW), pytest.param("d_fine", marks=SLOW)])
def test_a_frozen_batch_norm_is_checked_with_the_eps_its_forward_fixes(tmp_path, model_type):
    """RT-DETR's and D-FINE's backbones replace BatchNorm2d by a FrozenBatchNorm2d: gain, bias and
    statistics are buffers, the folded scale-and-shift is the eval formula, and eps is a literal inside
    forward. Each is a batch_norm layer with that eps (from the model code), and the module itself,
    loaded with the checkpoint's statistics, computes the formula with it."""
    path = tmp_path / model_type
    write_tiny_checkpoint(model_type, path)
    frozen = [(n, m) for n, m in _loaded_batch_norms(path) if type(m).__name__.endswith("FrozenBatchNorm2d")]
    assert frozen and not any(isinstance(m.weight, torch.nn.Parameter) for _, m in frozen)
    eps = _forward_literal_eps(type(frozen[0][1]))
    layers = {layer["name"]: layer for layer in api.inspect(path)["layers"]}
    for name, module in frozen:
        assert layers[name]["kind"] == "batch_norm", name
        assert layers[name]["eps"]["value"] == eps and layers[name]["eps"]["source"].startswith("model-code")
        assert _computes_with(module, eps) and not _computes_with(module, eps * 10), name
    # the reference and torch's F.batch_norm agree on them; a wrong eps is caught
    names = [name for name, _ in frozen[:4]]
    assert api.check(path, candidate="torch", dtype="float32", strata=["zero", "tiny", "normal"], isolation="none",
                     layers="backbone.*").passed
    assert not api.check(path, candidate="torch", candidate_eps=eps / 10, strata=["tiny"], isolation="none",
                         layers=names[0]).passed


def test_a_frozen_batch_norm_class_runs_as_the_candidate(tmp_path):
    """RTDetrFrozenBatchNorm2d(n) takes no eps (its forward fixes 1e-5) and is no BatchNorm2d: the
    model's own class, built as its signature asks, passes against the oracle at float32, and at
    float64 with float32's tolerance (where an eps the family got wrong would be far above it: the
    stem's smallest running_var is near 1e-6)."""
    path = tmp_path / "rt_detr"
    write_tiny_checkpoint("rt_detr", path)
    for dtype, tol in (("float32", {}), ("float64", {"atol": 1e-5, "rtol": 1.3e-6})):
        report = api.check(path, candidate="transformers", dtype=dtype, strata=["zero", "tiny", "normal"],
                           isolation="none", layers="backbone.model.embedder.*", **tol)
        assert report.passed and len(report.layers) == 3, [layer.error for layer in report.layers]
        assert min(layer.statistics["running_var_over_eps"]["min"] for layer in report.layers) < 1


def test_a_batch_norm_whose_eps_its_output_does_not_show_is_not_guessed():
    """torchvision's original FrozenBatchNorm2d has no eps (1 / sqrt(0) where a variance is 0), and one
    that adds eps outside the root computes another function: neither is a batch_norm, each says why."""
    from parity_cli.model.derive import classify, module_eps

    class Frozen(torch.nn.Module):
        def __init__(self, n, outside=False):
            super().__init__()
            self.outside = outside
            for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
                self.register_buffer(name, torch.full((n,), value))

        def forward(self, x):
            shape = (1, -1, 1, 1)
            var = self.running_var.reshape(shape)
            inv = 1 / (var.sqrt() + 1e-5) if self.outside else var.rsqrt()
            scale = self.weight.reshape(shape) * inv
            return x * scale + self.bias.reshape(shape) - self.running_mean.reshape(shape) * scale

    plain = Frozen(8)
    assert module_eps(plain) is None and "eps" in classify(plain, module_eps(plain))["unsupported"]
    outside = Frozen(8, outside=True)
    assert "not (x - mean) / sqrt(var + eps)" in classify(outside, module_eps(outside))["unsupported"]


@SLOW
def test_a_model_whose_size_lists_are_tuples_is_shrunk_harder():
    """EfficientNet's channel sizes are tuples (and its width and depth coefficients multiply them):
    over 60 M parameters until the tuples are shrunk too. Every norm of it is a BatchNorm2d reading
    batch_norm_eps, whose class default the family states."""
    from transformers import EfficientNetConfig

    data = derive("efficientnet")
    assert data["norms"] and not data["unsupported"]
    assert {(n["kind"], tuple(n["eps_keys"]), n["eps_default"]) for n in data["norms"]} == {
        ("batch_norm", ("batch_norm_eps",), EfficientNetConfig().batch_norm_eps)}
    assert {n["hf_class"] for n in data["norms"]} == {"torch.nn.modules.batchnorm.BatchNorm2d"}


def test_a_channels_first_layer_norm_is_a_layer_norm_at_each_position():
    """ConvNeXt's LayerNorm with data_format="channels_first" normalises over C at each position of an
    (N, C, H, W) map: per position, the formula of a LayerNorm over the C channels (written here), so
    the family states it as one with layout channels_first, and its class passes as the candidate."""
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    norm = ConvNextLayerNorm(8, eps=1e-6, data_format="channels_first").to(torch.float64)
    x = torch.randn(2, 8, 3, 5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8, dtype=torch.float64) + 0.5)
        norm.bias.copy_(torch.randn(8, dtype=torch.float64))
        centred = x - x.mean(1, keepdim=True)
        want = centred / torch.sqrt(centred.pow(2).mean(1, keepdim=True) + 1e-6) * norm.weight[:, None, None] \
            + norm.bias[:, None, None]
        assert torch.allclose(norm(x), want, atol=1e-12)
    entries = [n for n in derive("convnext")["norms"] if n.get("layout") == "channels_first"]
    assert entries and all(n["kind"] == "layer_norm" and n["eps"] == 1e-6 for n in entries)
    assert all(n["hf_class"].endswith("ConvNextLayerNorm") for n in entries)


def test_a_channels_first_class_passes_as_the_candidate(tmp_path):
    path = tmp_path / "convnext"
    write_tiny_checkpoint("convnext", path)
    report = api.check(path, candidate="transformers", layers="*downsampling_layer.0", isolation="none")
    assert report.layers and report.passed, report.summary()
