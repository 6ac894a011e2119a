"""Every shipped family (configs/families/): discovery with the real HF names, the `hf` built-in
bitwise equal to transformers' own module classes, and wrong-family semantics caught."""

import importlib.util
import re
import warnings

import pytest
import torch

from parity_cli import api
from parity_cli.backends.implementations import BUILTINS
from parity_cli.model.layers import discover_layers
from parity_cli.probes.strata import build_probes, load_strata
from parity_cli.sources.synthetic import LAYOUTS

L = 3
# Norm layers per checkpoint, counted by hand from each transformers modeling_*.py
# (per decoder layer, plus the final/embedding norms).
EXPECTED_LAYERS = {
    "llama": 2 * L + 1, "mistral": 2 * L + 1, "mixtral": 2 * L + 1, "qwen2": 2 * L + 1, "qwen2_moe": 2 * L + 1,
    "phi3": 2 * L + 1,
    "qwen3": 4 * L + 1, "qwen3_moe": 4 * L + 1,  # + q_norm, k_norm
    "deepseek_v3": 4 * L + 1,  # + q_a_layernorm, kv_a_layernorm
    "gemma": 2 * L + 1, "gemma2": 4 * L + 1,
    "gemma3": 4 * L + 1 + 2 * L, "gemma3_text": 4 * L + 1 + 2 * L,
    "gemma3n_text": 9 * L + 2,  # 4 block norms, q/k, altup router, laurel, per-layer input; norm, per-layer projection
    "olmo2": 4 * L + 1,
    "cohere": 3 * L + 1,  # input_layernorm, q_norm, k_norm
    "t5": 2 * L + 3 * L + 2,  # encoder blocks 2 sub-layers, decoder 3, two final norms
    "gpt2": 2 * L + 1, "gpt_neox": 2 * L + 1, "falcon": L + 1, "phi": 3 * L + 1, "bert": 2 * L + 2,
    "nemotron": 2 * L + 1,  # input_layernorm, post_attention_layernorm (LayerNorm1P); norm
    # ResNetBottleNeckLayer: three ResNetConvLayer, a BatchNorm2d each (no shortcut: in == out here); the stem's
    "resnet": 3 * L + 1,
    "mamba2": 2 * L + 1,  # Mamba2Block's norm, its mixer's gated norm (MambaRMSNormGated); norm_f
    "mask2former": 3,  # the pixel decoder's three input projections, a GroupNorm(32, C) each
    "olmo": 2 * L + 1,  # OlmoLayerNorm without parameters: input, post-attention; norm
}
FAMILY = {
    **{m: "llama" for m in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "phi3", "qwen3", "qwen3_moe", "deepseek_v3")},
    **{m: "gemma" for m in ("gemma", "gemma2", "gemma3", "gemma3_text")},
    "gemma3n_text": "gemma3n", "olmo2": "olmo2", "cohere": "cohere", "t5": "t5",
    **{m: "layer_norm" for m in ("gpt2", "gpt_neox", "falcon", "phi", "bert")},
    "nemotron": "nemotron",  # derived from its own classes (configs/families/derived/)
    "resnet": "resnet",  # derived: inference BatchNorm2d, running statistics beside each gain
    "mamba2": "mamba2", "mask2former": "mask2former", "olmo": "olmo",  # derived: gated, GroupNorm, weightless
}


# layouts of issue 26's kinds, one block of the real model each: their names and numerics are checked against
# the real classes in tests/test_batch_norm.py and tests/test_other_kinds.py
OTHER_KINDS = {"resnet", "mamba2", "mask2former", "olmo"}


def test_every_model_type_has_a_layout():
    assert set(EXPECTED_LAYERS) == set(LAYOUTS)


@pytest.mark.parametrize("model_type", sorted(EXPECTED_LAYERS))
def test_discovers_every_norm_of_every_family(ckpt, model_type):
    path = ckpt(model_type, layers=L, eps=1e-5)
    c, fam, eps = api.load(path)
    found = discover_layers(c, fam, eps)
    assert fam.name == FAMILY[model_type]
    assert len(found.layers) == EXPECTED_LAYERS[model_type]
    assert found.unmatched == [] and found.warnings == []
    assert all(not layer.warnings for layer in found.layers)  # every dim agrees with the config


def test_layernorm_families_carry_their_bias(ckpt):
    c, fam, eps = api.load(ckpt("gpt2", layers=1))
    layers = discover_layers(c, fam, eps).layers
    assert all(l.bias is not None and l.kind == "layer_norm" for l in layers)
    c, fam, eps = api.load(ckpt("cohere", layers=1))
    assert all(l.bias is None and l.kind == "layer_norm" for l in discover_layers(c, fam, eps).layers)


def test_per_head_and_projection_dims(ckpt):
    c, fam, eps = api.load(ckpt("cohere", layers=1, hidden=64, heads=4, kv_heads=2))
    shapes = {l.name: l.shape for l in discover_layers(c, fam, eps).layers}
    assert shapes["model.layers.0.self_attn.q_norm"] == (4, 16)  # (heads, head_dim)
    assert shapes["model.layers.0.self_attn.k_norm"] == (2, 16)
    c, fam, eps = api.load(ckpt("olmo2", layers=1, hidden=64, heads=4, kv_heads=2))
    dims = {l.name: l.dim for l in discover_layers(c, fam, eps).layers}
    assert dims["model.layers.0.self_attn.q_norm"] == 64  # heads * head_dim, not per head
    assert dims["model.layers.0.self_attn.k_norm"] == 32


def test_deepseek_mla_norms_keep_their_own_eps(ckpt):
    c, fam, eps = api.load(ckpt("deepseek_v3", layers=1, eps=1e-5))
    by_name = {l.name: l.eps for l in discover_layers(c, fam, eps).layers}
    assert by_name["model.layers.0.self_attn.q_a_layernorm"].value == 1e-6
    assert by_name["model.layers.0.self_attn.kv_a_layernorm"].source.startswith("class-default")
    assert by_name["model.layers.0.input_layernorm"].value == 1e-5
    assert by_name["model.layers.0.input_layernorm"].source == "config:rms_norm_eps"


def test_eps_default_is_the_config_class_default(ckpt):
    # MixtralConfig and Phi3Config default rms_norm_eps to 1e-5, LlamaConfig to 1e-6, BertConfig layer_norm_eps to 1e-12.
    for model_type, default in (("mixtral", 1e-5), ("phi3", 1e-5), ("llama", 1e-6), ("bert", 1e-12), ("gpt2", 1e-5)):
        _, _, eps = api.load(ckpt(model_type, layers=1, eps=None))
        assert (eps.value, eps.source) == (default, "family-default"), model_type


def test_old_bert_gamma_beta_names(ckpt):
    w = torch.ones(64, dtype=torch.float32)
    path = ckpt("bert", layers=1, dtype="float32", weights={"bert.pooler.LayerNorm.gamma": w})
    c, fam, eps = api.load(path)
    found = discover_layers(c, fam, eps)
    assert found.unmatched == ["bert.pooler.LayerNorm.gamma"]  # looks like a norm, matches no pattern


def test_a_norm_with_its_own_eps_key_warns_when_defaulted(ckpt):
    # Gemma 3's projector norm takes vision_config.layer_norm_eps, not the text rms_norm_eps
    w = torch.zeros(32, dtype=torch.bfloat16)
    path = ckpt("gemma3", layers=1, eps=1e-6, config_extra={"vision_config": {"hidden_size": 32}},
                weights={"multi_modal_projector.mm_soft_emb_norm.weight": w})
    c, fam, eps = api.load(path)
    layers = {l.name: l for l in discover_layers(c, fam, eps).layers}
    proj = layers["multi_modal_projector.mm_soft_emb_norm"]
    assert proj.eps.source == "family-default" and proj.gain_offset == 1.0
    assert any("vision_config.layer_norm_eps" in w for w in proj.warnings)
    assert not layers["model.norm"].warnings


# --- transformers itself -------------------------------------------------------------------------------

# Only the tests below need transformers; the ones above run without it.
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not importable; bitwise tests need it")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, pad_token_id=0, bos_token_id=0, eos_token_id=0)
CONFIG_EXTRA = {
    "deepseek_v3": dict(q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                        n_routed_experts=4, first_k_dense_replace=1, moe_intermediate_size=32, num_experts_per_tok=2,
                        n_group=1, topk_group=1),
    "cohere": dict(use_qk_norm=True), "phi": dict(qk_layernorm=True),
    "gpt2": dict(n_embd=64, n_layer=L, n_head=4),
    "t5": dict(d_model=64, num_layers=L, num_decoder_layers=L, num_heads=4, d_kv=16, d_ff=128),
    "gemma3n_text": dict(head_dim=16, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8, laurel_rank=4,
                         num_kv_shared_layers=0, layer_types=["sliding_attention"] * L,
                         activation_sparsity_pattern=[0.0] * L),
}
NORM_NAME = re.compile(r"norm|(^|\.)ln_|LayerNorm", re.IGNORECASE)


def _hf_norm_names(model_type):
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
    )

    cfg = AutoConfig.for_model(model_type, **{**SMALL, **CONFIG_EXTRA.get(model_type, {})})
    auto = {"t5": AutoModelForSeq2SeqLM, "bert": AutoModelForMaskedLM}.get(model_type, AutoModelForCausalLM)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = auto.from_config(cfg)
    return {n for n in model.state_dict() if NORM_NAME.search(n) and n.endswith(".weight")}


@needs_transformers
# gemma3 is multimodal; resnet's synthetic layout is one stage of bottlenecks without the shortcut (its names
# and its BatchNorm numerics are checked against the real ResNetModel in tests/test_batch_norm.py)
@pytest.mark.parametrize("model_type", sorted(set(EXPECTED_LAYERS) - {"gemma3"} - OTHER_KINDS))
def test_synthetic_names_are_transformers_names(ckpt, model_type):
    """The synthetic checkpoints are only evidence if their names are the ones HF writes."""
    c, fam, eps = api.load(ckpt(model_type, layers=L))
    ours = {l.tensor for l in discover_layers(c, fam, eps).layers}
    assert ours == _hf_norm_names(model_type)


# The module class each family's HF code builds its norms with, written out here independently of configs/.
def _hf_module(model_type, layer_name, size, eps, bias):
    import importlib

    nn_layer_norm = model_type in ("gpt2", "gpt_neox", "falcon", "phi", "bert")
    if nn_layer_norm:
        return torch.nn.LayerNorm(size, eps=eps, bias=bias)
    name = {"gemma3_text": "gemma3", "gemma3n_text": "gemma3n"}.get(model_type, model_type)
    classes = {"t5": "T5LayerNorm", "cohere": "CohereLayerNorm", "gemma3n": "Gemma3nRMSNorm",
               "nemotron": "NemotronLayerNorm1P"}
    default = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3", "olmo2": "Olmo2",
               "phi3": "Phi3"}.get(name, name.capitalize()) + "RMSNorm"
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return getattr(module, classes.get(name, default))(size, eps=eps)


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", sorted(set(EXPECTED_LAYERS) - OTHER_KINDS))
def test_hf_is_bitwise_transformers(ckpt, model_type, dtype):
    c, fam, eps = api.load(ckpt(model_type, layers=1, eps=1e-5, seed=7))
    strata = list(load_strata().values())  # every stratum, extreme included
    layers = discover_layers(c, fam, eps).layers
    assert layers
    for layer in layers:
        w = layer.weight.to(dtype)
        b = None if layer.bias is None else layer.bias.to(dtype)
        size = tuple(layer.shape) if len(layer.shape) > 1 else layer.dim
        module = _hf_module(model_type, layer.name, size, layer.eps.value, b is not None).to(dtype)
        with torch.no_grad():
            module.weight.copy_(w)
            if b is not None:
                module.bias.copy_(b)
        ours = BUILTINS["hf"].prepare(layer, w, b, layer.eps.value)
        for probe in build_probes(strata, layer.dim, layer.eps.value, dtype, seed=3):
            x = probe.x.to(dtype)
            if len(layer.shape) > 1:
                x = x[:, None, :].expand(x.shape[0], *layer.shape).contiguous()
            with torch.no_grad():
                expected, got = module(x), ours(x)
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True,
                                       msg=lambda m, n=layer.name, st=probe.stratum: f"{n} {st}: {m}")


@needs_transformers
@pytest.mark.parametrize("model_type", ["llama", "gemma3", "cohere", "gpt2", "t5", "gemma3n_text"])
def test_transformers_builtin_passes(ckpt, model_type):
    # supervised as `auto` runs it for llama; in this process for the rest (the numerics are the
    # question here, and a child importing transformers costs seconds each)
    isolation = "auto" if model_type == "llama" else "none"
    report = api.check(ckpt(model_type, layers=1, eps=1e-5), candidate="transformers", isolation=isolation)
    assert report.passed, report.summary()
