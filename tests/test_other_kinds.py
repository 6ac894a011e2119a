"""Issue 26's other norm kinds against real third-party code: GroupNorm (torch.nn.GroupNorm, wav2vec2's
and SAM 3's), gated RMSNorm (Mamba2's Mamba2RMSNormGated, Qwen3-Next's, Kimi Linear's and Falcon-H1's
gated norms) and weightless norms (OLMo's OlmoLayerNorm, Llama 4's L2Norm, Gemma 4's v_norm).

Every expected number comes from the real module, a float64 formula written here from the class's
definition, or the checkpoint's config read here; none from the tool's own output. One tiny
checkpoint per model type, written once for the module by the model's own classes; the checks run
the candidate in this process (isolation "none": process isolation is not what is tested here)."""

import copy
import fnmatch
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers")

from plugins.installed_classes import built_class, eps_of  # noqa: E402

from parity_cli import api  # noqa: E402
from parity_cli.backends.implementations import BUILTINS  # noqa: E402
from parity_cli.errors import InputError  # noqa: E402
from parity_cli.model.derive import classify, derive  # noqa: E402
from parity_cli.model.layers import NormLayer, discover_layers  # noqa: E402
from parity_cli.model.load import load  # noqa: E402
from parity_cli.probes.strata import (  # noqa: E402
    build_probe_set,
    gated_probe_set,
    group_norm_probe_set,
    select_strata,
)
from parity_cli.sources.tensors import Eps  # noqa: E402

PLUGINS = Path(__file__).resolve().parent / "plugins" / "other_kinds.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the norms of each tiny checkpoint that the end-to-end runs check (the gated norm alone in Qwen3-Next)
LAYERS = {"mamba2": None, "qwen3_next": "*.linear_attn.norm", "olmo": None, "wav2vec2": "*conv_layers.*",
          "sam3": "mask_decoder.pixel_decoder.norms.*", "poolformer": "encoder.block.0.0.*"}
# the kind each class computes, read off transformers' and torch's source
# (Mamba2's gated norm by the module it is, since transformers renames its class: see _mamba_gated)
KIND_OF_CLASS = {"Mamba2RMSNorm": "rms_norm", "Qwen3NextRMSNormGated": "gated_rms_norm", "OlmoLayerNorm": "layer_norm",
                 "GroupNorm": "group_norm"}


def _kind_of(cls) -> str | None:
    return "gated_rms_norm" if cls is _mamba_gated() else KIND_OF_CLASS.get(cls.__name__)


def _mamba_gated():
    """The class Mamba2's mixer builds its gated norm with (MambaRMSNormGated until transformers 5.24,
    Mamba2RMSNormGated since 5.25)."""
    return built_class("mamba2", "layers.0.mixer.norm")


def _llama4_qk_norm():
    """Llama 4's weightless q/k norm class (Llama4TextL2Norm until 5.24, Llama4TextWeightlessRMSNorm since)."""
    return built_class("llama4_text", "layers.0.self_attn.qk_norm")


# --- helpers --------------------------------------------------------------------------------------


def _codes(report):
    return [{d.code for d in layer.diagnoses} for layer in report.layers]


def _act(name, z):
    """silu(z) = z / (1 + e^-z), sigmoid(z) = 1 / (1 + e^-z), in float64."""
    return z / (1 + torch.exp(-z)) if name == "silu" else 1 / (1 + torch.exp(-z))


def _formula(form, x, w, b, eps):
    """The norm in float64, from its class's definition. `form`: ("group_norm", groups),
    ("gated", gate, activation, groups), ("layer_norm",) or ("rms_norm",); x: probe rows (a GroupNorm's
    C x S channel-major, a gated norm's [x | z])."""
    n = x.shape[0]
    if form[0] == "group_norm":
        g = x.reshape(n, form[1], -1)
        c = g - g.mean(-1, keepdim=True)
        h = (c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps)).reshape(n, w.numel(), -1)
        return (h * w[:, None] + (0.0 if b is None else b[:, None])).reshape(n, -1)
    if form[0] == "gated":
        _, gate, activation, groups = form
        d = w.numel()
        a = _act(activation, x[:, d:])
        h = x[:, :d] * a if gate == "before" else x[:, :d]
        g = h.reshape(n, groups, -1)
        y = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(n, d) * w
        return y * a if gate == "after" else y
    h = x - x.mean(-1, keepdim=True) if form[0] == "layer_norm" else x
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def _probes(layer, dtype):
    """Parity's own probe rows for the layer (every default stratum), float64 values exact at dtype."""
    strata, eps = select_strata(None), layer.eps.value
    if layer.kind == "gated_rms_norm":
        return gated_probe_set(strata, layer.dim, eps, dtype, 0).x
    if layer.kind == "group_norm":
        return group_norm_probe_set(strata, layer.dim, layer.groups, layer.spatial, eps, dtype, 0).x
    return build_probe_set(strata, layer.dim, eps, dtype, 0).x


def _module_rows(module, layer, x):
    """The real module on probe rows: [x | z] split and called as module(x, gate=z); a GroupNorm's
    row fed as the (C, S) map it is; a row norm as it is."""
    with torch.no_grad():
        if layer.kind == "gated_rms_norm":
            return module(x[:, : layer.dim], gate=x[:, layer.dim:])
        if layer.kind == "group_norm":
            return module(x.reshape(x.shape[0], layer.dim, -1)).reshape(x.shape[0], -1)
        return module(x)


ALL_DTYPES = tuple(DTYPES.values())


def _assert_hf_is_the_module(layer, module, form, dtypes=ALL_DTYPES, oracle=True):
    """`hf` (and the `transformers` built-in, which builds the layer's class itself) bit for bit equal
    to the module cast to each dtype, on parity's probes at that dtype; the float64 oracle within
    1e-12 of the formula written here, and the formula within float32's rounding of the module run
    at float64 (each class computes in float32 inside)."""
    eps = layer.eps.value
    for dtype in dtypes:
        x = _probes(layer, dtype).to(dtype)
        m = copy.deepcopy(module).to(dtype).eval()
        want = _module_rows(m, layer, x)
        bias = None if layer.bias is None else layer.bias.to(dtype)
        for impl in ("hf", "transformers"):
            got = BUILTINS[impl].prepare(layer, layer.weight.to(dtype), bias, eps)(x)
            assert got.dtype == dtype and torch.equal(got, want), \
                (layer.name, impl, dtype, float((got.double() - want.double()).abs().max()))
        if dtype == torch.float32:  # the probes see eps: the same transcription at 100 eps is another function
            other = BUILTINS["hf"].prepare(layer, layer.weight.to(dtype), bias, eps * 100)(x)
            assert not torch.equal(other, want), layer.name
    if not oracle:
        return
    x = _probes(layer, torch.float64)
    w = layer.weight.double()
    b = None if layer.bias is None else layer.bias.double()
    want = _formula(form, x, w, b, eps)
    got = BUILTINS["oracle"].prepare(layer, w, b, eps)(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=layer.name)
    m64 = copy.deepcopy(module).double().eval()
    scale = float(want.abs().max())
    torch.testing.assert_close(_module_rows(m64, layer, x).double(), want, rtol=1e-5, atol=1e-6 * scale,
                               msg=layer.name)


def _layer(kind, dim, weight, eps, order, hf_class, bias=None, **kwargs):
    return NormLayer(name=f"test.{kind}", kind=kind, dim=dim, order=order, gain_offset=0.0, eps=Eps(eps, "test"),
                     weight=weight, bias=bias, hf_class=hf_class, **kwargs)


def _gain(module, seed):
    """Gains (and biases) as a trained model has them, in the module and returned for the layer."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.rand(module.weight.shape, generator=gen) + 0.3)
        if isinstance(getattr(module, "bias", None), torch.Tensor):
            module.bias.copy_(torch.rand(module.bias.shape, generator=gen) - 0.5)
    bias = getattr(module, "bias", None)
    return module.weight.detach().clone(), None if bias is None else bias.detach().clone()


def _real_model(path):
    """The tiny checkpoint loaded back by the class that wrote it (its config's architectures)."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cls = getattr(transformers, json.loads((Path(path) / "config.json").read_text())["architectures"][0])
    return cls.from_pretrained(path).eval()


def _by_name(data):
    return {n["name"].removeprefix("{root}"): n for n in data["norms"]}


def _pattern(name):
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "{i}", name)


def _sam3_pixel_decoder(path):
    """SAM 3's real pixel decoder (its three GroupNorms) built from the checkpoint's config, its norms'
    gains and biases loaded from the file (the whole Sam3Model takes seconds to load)."""
    from safetensors.torch import load_file
    from transformers.models.sam3.configuration_sam3 import Sam3MaskDecoderConfig
    from transformers.models.sam3.modeling_sam3 import Sam3PixelDecoder

    config = json.loads((Path(path) / "config.json").read_text())["mask_decoder_config"]
    decoder = Sam3PixelDecoder(Sam3MaskDecoderConfig(**config)).eval()
    prefix = "mask_decoder.pixel_decoder."
    state = {k[len(prefix):]: v for k, v in load_file(str(Path(path) / "model.safetensors")).items()
             if k.startswith(prefix + "norms.")}
    missing = decoder.load_state_dict(state, strict=False).missing_keys
    assert not [k for k in missing if k.startswith("norms.")], missing
    return decoder


# --- checkpoints, one per model type --------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tiny):
    """Factory: the tiny checkpoint's model as transformers loads it back (once per type)."""
    loaded = {}

    def get(model_type):
        if model_type not in loaded:
            loaded[model_type] = _real_model(tiny(model_type))
        return loaded[model_type]

    return get


# --- 1. `hf` bit for bit against the real modules, the oracle against the formula -----------------


def _direct(case):
    """(layer, module, form) for a module built here, the layer stated from the class's source."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated

    if case.startswith("group_norm"):
        groups = 8 if case == "group_norm_8_of_64" else 64
        module = torch.nn.GroupNorm(groups, 64, eps=1e-5)
        w, b = _gain(module, groups)
        # the probes give each channel enough positions that a group holds 64 elements
        layer = _layer("group_norm", 64, w, 1e-5, "native", "torch.nn.GroupNorm", bias=b, groups=groups,
                       spatial=max(2, 64 // (64 // groups)))
        return layer, module, ("group_norm", groups)
    if case == "gemma4_v_norm":  # Gemma4RMSNorm(head_dim, with_scale=False): x * pow(q + eps, -0.5), cast last
        module = Gemma4RMSNorm(16, eps=1e-6, with_scale=False)
        layer = _layer("rms_norm", 16, torch.ones(16), 1e-6, "gemma", f"{Gemma4RMSNorm.__module__}.Gemma4RMSNorm",
                       inverse_sqrt="pow", weightless=True)
        return layer, module, ("rms_norm",)
    gated = {  # class, its arguments, (gate, activation, groups, order) as its forward computes them
        "mamba2_4_groups": (_mamba_gated(), {"group_size": 16, "eps": 1e-5}, ("before", "silu", 4, "llama")),
        "kimi_linear": (KimiLinearRMSNormGated, {"eps": 1e-6}, ("after", "sigmoid", 1, "gemma")),
        "falcon_h1_norm_before_gate": (FalconH1RMSNormGated, {"eps": 1e-6, "n_groups": 2, "norm_before_gate": True},
                                       ("after", "silu", 2, "gemma")),
        "falcon_h1_gate_before_norm": (FalconH1RMSNormGated, {"eps": 1e-6, "n_groups": 2, "norm_before_gate": False},
                                       ("before", "silu", 2, "gemma")),
    }
    cls, kwargs, (gate, activation, groups, order) = gated[case]
    module = cls(64, **kwargs)
    w, _ = _gain(module, 64)
    layer = _layer("gated_rms_norm", 64, w, kwargs["eps"], order, f"{cls.__module__}.{cls.__qualname__}",
                   gate=gate, activation=activation, groups=groups)
    return layer, module, ("gated", gate, activation, groups)


@pytest.mark.parametrize("case", ["group_norm_8_of_64", "group_norm_one_a_channel", "mamba2_4_groups", "kimi_linear",
                                  "falcon_h1_norm_before_gate", "falcon_h1_gate_before_norm", "gemma4_v_norm"])
def test_hf_is_the_module_bit_for_bit_on_modules_built_here(case):
    layer, module, form = _direct(case)
    _assert_hf_is_the_module(layer, module, form)


def _form_of(model_type, module, config):
    """What the class computes, from its source and the model's config (not from the tool)."""
    if model_type == "mamba2":  # RMSNorm(x * silu(z)) per group of hidden_size * expand / n_groups
        assert module.weight.numel() // module.group_size == config.n_groups > 1
        return _mamba_gated().__name__, ("gated", "before", "silu", config.n_groups)
    if model_type == "qwen3_next":  # RMSNorm(x) * w * act(z), act = ACT2FN[self.activation]
        assert module.activation == "silu"
        return "Qwen3NextRMSNormGated", ("gated", "after", "silu", 1)
    if model_type == "llama4_text":
        return _llama4_qk_norm().__name__, ("rms_norm",)
    assert module.num_groups == module.num_channels  # wav2vec2's GroupNorm(conv_dim[0], conv_dim[0])
    return "GroupNorm", ("group_norm", module.num_groups)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_hf_is_olmo_layer_norm_bit_for_bit(tiny, real, dtype):
    """OLMo's weightless LayerNorms as discovery builds them, against OlmoLayerNorm: F.layer_norm on
    x.float(), cast last (order native_fp32), bit for bit at every dtype."""
    ckpt, family, eps = load(tiny("olmo"))
    layers = discover_layers(ckpt, family, eps).layers
    model = real("olmo")
    assert len(layers) == 5
    for layer in layers:
        module = model.get_submodule(layer.name)
        assert type(module).__name__ == "OlmoLayerNorm" and not list(module.parameters())
        assert layer.weightless and torch.equal(layer.weight, torch.ones(layer.dim))
        _assert_hf_is_the_module(layer, module, ("layer_norm",), dtypes=(DTYPES[dtype],), oracle=dtype == "float32")


@pytest.mark.parametrize("model_type,glob", [("mamba2", "*.mixer.norm"), ("qwen3_next", "*.linear_attn.norm"),
                                             ("llama4_text", "*.qk_norm"), ("wav2vec2", "feature_extractor.*")])
def test_hf_is_the_module_bit_for_bit_on_layers_found_in_checkpoints(tiny, real, model_type, glob):
    """Each layer as discovery builds it from the tiny checkpoint (its gain read from the file, its
    groups from the config), against the module transformers loads from that checkpoint."""
    ckpt, family, eps = load(tiny(model_type))
    layers = discover_layers(ckpt, family, eps, layers_glob=glob).layers
    model = real(model_type)
    assert layers
    for layer in layers:
        module = model.get_submodule(layer.name)
        cls, form = _form_of(model_type, module, model.config)
        assert type(module).__name__ == cls, (layer.name, type(module))
        params = dict(module.named_parameters())
        if layer.weightless:
            assert not params and torch.equal(layer.weight, torch.ones(layer.dim))
        else:
            assert torch.equal(layer.weight, params["weight"].detach()), layer.name
            if "bias" in params:
                assert torch.equal(layer.bias, params["bias"].detach()), layer.name
        _assert_hf_is_the_module(layer, module, form)


# --- 2. families derived from the real classes --------------------------------------------------------


def test_mamba2_mixer_norm_is_derived_gated_before_silu_over_n_groups(tiny, real):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    entry = _by_name(derive("mamba2"))["layers.{i}.mixer.norm"]
    model = real("mamba2")
    module = model.backbone.layers[0].mixer.norm
    assert entry["hf_class"] == f"{type(module).__module__}.{type(module).__qualname__}"
    assert (entry["kind"], entry["gate"], entry["activation"]) == ("gated_rms_norm", "before", "silu")
    # its group count is the config's n_groups: the module's width over its group_size
    assert entry["groups"] == "n_groups" and module.weight.numel() // module.group_size == model.config.n_groups > 1
    # its eps is the config's layer_norm_epsilon: a model built with another value carries it
    config = Mamba2Config.from_pretrained(tiny("mamba2"), layer_norm_epsilon=3e-4)
    assert Mamba2ForCausalLM(config).backbone.layers[0].mixer.norm.variance_epsilon == 3e-4
    assert entry["eps_keys"] == ["layer_norm_epsilon"] and entry["order"] == "llama"
    # gate before the statistic, silu, per group: the module in float64 is that formula and no other
    gen = torch.Generator().manual_seed(5)
    d, groups = module.weight.numel(), model.config.n_groups
    x2 = torch.randn(4, 2 * d, generator=gen, dtype=torch.float64) * 2
    m64 = copy.deepcopy(module).double()
    with torch.no_grad():
        got = m64(x2[:, :d], gate=x2[:, d:])
    w, eps = m64.weight.detach(), module.variance_epsilon
    torch.testing.assert_close(got, _formula(("gated", "before", "silu", groups), x2, w, None, eps), rtol=1e-5, atol=1e-6)
    for other in [("gated", "after", "silu", groups), ("gated", "before", "sigmoid", groups), ("gated", "before", "silu", 1)]:
        assert float((got - _formula(other, x2, w, None, eps)).abs().max()) > 1e-2, other


def test_qwen3_next_linear_attention_norm_is_derived_gated_after(real):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    data = _by_name(derive("qwen3_next"))
    entry = data["layers.{i}.linear_attn.norm"]
    model = real("qwen3_next")
    module = model.model.layers[0].linear_attn.norm
    assert type(module) is Qwen3NextRMSNormGated and module.activation == "silu"
    assert entry["hf_class"] == f"{Qwen3NextRMSNormGated.__module__}.Qwen3NextRMSNormGated"
    assert (entry["kind"], entry["gate"], entry["activation"], entry["groups"]) == ("gated_rms_norm", "after", "silu", 1)
    assert module.variance_epsilon == model.config.rms_norm_eps and entry["eps_keys"] == ["rms_norm_eps"]
    # its plain norms are found beside it as what they are
    assert data["layers.{i}.input_layernorm"]["kind"] == "rms_norm"
    gen = torch.Generator().manual_seed(6)
    d = module.weight.numel()
    x2 = torch.randn(4, 2 * d, generator=gen, dtype=torch.float64) * 2
    with torch.no_grad():
        got = copy.deepcopy(module).double()(x2[:, :d], x2[:, d:])
    w = module.weight.detach().double()
    want = _formula(("gated", "after", "silu", 1), x2, w, None, module.variance_epsilon)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert float((got - _formula(("gated", "before", "silu", 1), x2, w, None, 1e-6)).abs().max()) > 1e-2


def _olmo_eps():
    """The eps OlmoLayerNorm fixes inside its forward, read off its source."""
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    (literal,) = re.findall(r"eps\s*=\s*([0-9.]+e-?[0-9]+)", inspect.getsource(OlmoLayerNorm.forward))
    return float(literal)


def test_olmo_layer_norms_are_derived_weightless_with_the_eps_of_their_forward(real):
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    model = real("olmo")
    modules = {_pattern(n).removeprefix("model."): m for n, m in model.named_modules() if isinstance(m, OlmoLayerNorm)}
    assert set(modules) == {"layers.{i}.input_layernorm", "layers.{i}.post_attention_layernorm", "norm"}
    data = _by_name(derive("olmo"))
    for name, module in modules.items():
        entry = data[name]
        assert not list(module.parameters()) and module.normalized_shape == (model.config.hidden_size,)
        assert entry["weightless"] is True and entry["kind"] == "layer_norm" and entry["dim"] == "hidden_size"
        assert entry["eps"] == _olmo_eps() == 1e-5 and entry["eps_keys"] == [], entry
        assert entry["eps_source"] == "model-code (OlmoLayerNorm)"


def test_llama4_l2_norm_is_derived_weightless_over_head_dim(tiny, real):
    entry = _by_name(derive("llama4_text"))["model.layers.{i}.self_attn.qk_norm"]
    model = real("llama4_text")
    norms = {n: m for n, m in model.named_modules() if isinstance(m, _llama4_qk_norm())}
    assert norms and all(not list(m.parameters()) and eps_of(m) == model.config.rms_norm_eps for m in norms.values())
    assert entry["weightless"] is True and entry["kind"] == "rms_norm" and entry["eps_keys"] == ["rms_norm_eps"]
    # the size it runs over is what it sees in a forward pass: each head's, head_dim
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[-1])) for m in norms.values()]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    finally:
        for h in hooks:
            h.remove()
    assert seen and set(seen) == {model.config.head_dim} and entry["dim"] == "head_dim"
    assert model.config.head_dim != model.config.hidden_size


def test_group_norms_are_derived_with_their_group_count(tiny, real):
    """wav2vec2 (feat_extract_norm "group": GroupNorm(C, C), one group a channel) and SAM 3's pixel
    decoder (GroupNorm(8, C)), each entry checked against the module and the eps it holds."""
    from transformers import Wav2Vec2Config

    assert Wav2Vec2Config().feat_extract_norm == "group"
    entry = _by_name(derive("wav2vec2"))["feature_extractor.conv_layers.{i}.layer_norm"]
    module = real("wav2vec2").feature_extractor.conv_layers[0].layer_norm
    assert type(module) is torch.nn.GroupNorm and module.num_groups == module.num_channels > 1
    assert (entry["kind"], entry["groups"], entry["eps"]) == ("group_norm", "channels", module.eps)
    assert entry["hf_class"] == "torch.nn.modules.normalization.GroupNorm"
    # SAM 3: the discovered layers (the family the checkpoint resolves to) against its real decoder
    decoder = _sam3_pixel_decoder(tiny("sam3"))
    ckpt, family, eps = load(tiny("sam3"))
    layers = discover_layers(ckpt, family, eps, layers_glob=LAYERS["sam3"]).layers
    assert [layer.name.rsplit(".", 1)[1] for layer in layers] == [str(i) for i in range(len(decoder.norms))]
    for layer, norm in zip(layers, decoder.norms):
        assert (layer.kind, layer.groups, layer.dim, layer.eps.value) == ("group_norm", norm.num_groups,
                                                                           norm.num_channels, norm.eps)
        assert 1 < norm.num_groups < norm.num_channels
        assert torch.equal(layer.weight, norm.weight.detach()) and torch.equal(layer.bias, norm.bias.detach())


@pytest.mark.parametrize("cls,kwargs,want", [
    ("kimi_linear.modeling_kimi_linear.KimiLinearRMSNormGated", {}, ("after", "sigmoid", 1, "gemma")),
    ("falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated", {"n_groups": 2}, ("after", "silu", 2, "gemma")),
    ("falcon_h1.modeling_falcon_h1.FalconH1RMSNormGated", {"n_groups": 4, "norm_before_gate": False},
     ("before", "silu", 4, "gemma")),
    ("zamba2.modeling_zamba2.Zamba2RMSNormGated", {"group_size": 16}, ("before", "silu", 4, "llama")),
])
def test_gated_classes_are_classified_as_their_source_computes(cls, kwargs, want):
    """Classes no tiny checkpoint here holds: the form and order classify finds are those their forward
    states (Kimi: sigmoid, the gain in float32; Falcon-H1: n_groups, norm_before_gate)."""
    import importlib

    module_name, _, name = f"transformers.models.{cls}".rpartition(".")
    module = getattr(importlib.import_module(module_name), name)(64, eps=1e-6, **kwargs)
    sem = classify(module, 1e-6)
    assert (sem["gate"], sem["activation"], sem["groups"], sem["order"]) == want and sem["order_exact"] is True


# --- 3. end to end on the tiny checkpoints -----------------------------------------------------------


def _expected_layers(model_type, tiny, real):
    """{name: (kind, eps, weightless)} of the norms a run checks, from the real model (SAM 3: its
    pixel decoder, named as the checkpoint stores it)."""
    if model_type == "sam3":
        decoder = _sam3_pixel_decoder(tiny("sam3"))
        return {f"mask_decoder.pixel_decoder.norms.{i}": ("group_norm", n.eps, False) for i, n in enumerate(decoder.norms)}
    out = {}
    for name, module in real(model_type).named_modules():
        kind = _kind_of(type(module))
        if kind is None or (LAYERS[model_type] and not fnmatch.fnmatchcase(name, LAYERS[model_type])):
            continue
        eps = next((getattr(module, a) for a in ("variance_epsilon", "eps") if hasattr(module, a)), None)
        out[name] = (kind, _olmo_eps() if eps is None else eps, not list(module.parameters()))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("candidate", ["transformers", "hf"])
@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_next", "olmo", "wav2vec2", "sam3"])
def test_check_passes_with_the_model_class_and_hf(tiny, real, model_type, candidate, dtype):
    report = api.check(tiny(model_type), candidate=candidate, dtype=dtype, isolation="none",
                       layers=LAYERS[model_type])
    expected = _expected_layers(model_type, tiny, real)
    assert sorted(layer.name for layer in report.layers) == sorted(expected)
    for layer in report.layers:
        kind, eps, weightless = expected[layer.name]
        assert (layer.kind, layer.eps["value"], layer.status) == (kind, eps, "pass"), (layer.name, layer.error)
        assert layer.diagnoses == []
        assert layer.weight.get("stored", True) is not weightless, layer.weight
    assert report.passed
    assert any(kind != "rms_norm" for kind, _, _ in expected.values())


@pytest.fixture
def without_family_files(tmp_path):
    """No configs/families/derived: a type's family is derived at run time from its classes."""
    from parity_cli.model import families
    from parity_cli.resources import configs_dir

    root = tmp_path / "configs"
    shutil.copytree(configs_dir(), root, ignore=shutil.ignore_patterns("derived"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(families, "configs_dir", lambda: root)
        families.clear_caches()
        yield
    families.clear_caches()


# mamba2's config.json holds time_step_limit's inf as transformers 5 saves it, {"__float__": "Infinity"}, which
# Mamba2Config.from_dict rejects: derive decodes it as transformers' file loader does (model.derive.tagged_floats)
@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_next", "olmo", "wav2vec2"])
def test_a_checkpoint_whose_type_has_no_family_file_is_derived_at_run_time(tiny, real, without_family_files,
                                                                         model_type):
    report = api.check(tiny(model_type), candidate="transformers", dtype="bfloat16", isolation="none",
                       layers=LAYERS[model_type])
    assert report.header["checkpoint"]["family_source"].startswith("transformers ")
    expected = _expected_layers(model_type, tiny, real)
    assert {layer.name: layer.kind for layer in report.layers} == {n: k for n, (k, _, _) in expected.items()}
    assert report.passed


# --- 4. planted faults, named ------------------------------------------------------------------------


def _plugin(name):
    return f"{PLUGINS}:{name}"


@pytest.mark.parametrize("model_type,plugin,dtype,code", [
    ("mamba2", "falcon_h1_default", "float32", "gate_position_mismatch"),
    ("mamba2", "falcon_h1_default", "bfloat16", "gate_position_mismatch"),
    ("qwen3_next", "mamba_for_qwen3_next", "bfloat16", "gate_position_mismatch"),
    ("mamba2", "mamba_sigmoid", "float32", "gate_activation_mismatch"),
    ("mamba2", "mamba_sigmoid", "float16", "gate_activation_mismatch"),
    ("qwen3_next", "kimi", "float32", "gate_activation_mismatch"),
    ("mamba2", "mamba_one_group", "float32", "group_count_mismatch"),
    ("mamba2", "mamba_one_group", "bfloat16", "group_count_mismatch"),
])
def test_gated_norm_faults_are_named(tiny, real, model_type, plugin, dtype, code):
    glob = "*.mixer.norm" if model_type == "mamba2" else LAYERS[model_type]
    report = api.check(tiny(model_type), candidate=_plugin(plugin), dtype=dtype, isolation="none", layers=glob)
    assert not report.passed and report.layers
    assert _codes(report) == [{code}] * len(report.layers), _codes(report)
    model = real(model_type)
    for layer in report.layers:
        (diagnosis,) = layer.diagnoses
        module = model.get_submodule(layer.name)
        if code == "group_count_mismatch":  # the model's n_groups, the candidate's one group
            assert diagnosis.evidence["groups"] == module.weight.numel() // module.group_size == model.config.n_groups
            assert diagnosis.evidence["candidate_groups"] == 1
        if code == "gate_activation_mismatch":
            assert diagnosis.evidence["candidate_activation"] == "sigmoid"


@pytest.mark.parametrize("model_type,candidate,dtype", [
    ("mamba2", "hf", "float32"), ("mamba2", "transformers", "bfloat16"),
    ("qwen3_next", "transformers", "float32"), ("qwen3_next", "hf", "bfloat16"),
])
def test_candidate_eps_on_a_gated_norm_is_eps_mismatch(tiny, real, model_type, candidate, dtype):
    glob = "*.mixer.norm" if model_type == "mamba2" else LAYERS[model_type]
    report = api.check(tiny(model_type), candidate=candidate, dtype=dtype, isolation="none", layers=glob,
                       candidate_eps=1e-3)
    assert not report.passed and report.layers
    assert _codes(report) == [{"eps_mismatch"}] * len(report.layers), _codes(report)
    model = real(model_type)
    for layer in report.layers:
        ev = layer.diagnoses[0].evidence
        assert ev["estimated_eps"] == pytest.approx(1e-3, rel=0.03), ev
        assert ev["configured_eps"] == model.get_submodule(layer.name).variance_epsilon


@pytest.mark.parametrize("candidate,dtype", [("hf", "float32"), ("torch", "bfloat16")])
def test_candidate_eps_on_olmo_weightless_norms_is_eps_mismatch(tiny, candidate, dtype):
    report = api.check(tiny("olmo"), candidate=candidate, dtype=dtype, isolation="none", candidate_eps=1e-3)
    assert not report.passed and len(report.layers) == 5  # input, post-attention per layer; the final norm
    assert _codes(report) == [{"eps_mismatch"}] * 5, _codes(report)
    for layer in report.layers:
        ev = layer.diagnoses[0].evidence
        assert ev["estimated_eps"] == pytest.approx(1e-3, rel=0.03), ev
        assert ev["configured_eps"] == 1e-5 and layer.weight["stored"] is False


def test_candidate_eps_is_refused_for_a_weightless_class_that_fixes_its_eps(tiny):
    with pytest.raises(InputError, match="OlmoLayerNorm"):
        api.check(tiny("olmo"), candidate="transformers", dtype="float32", isolation="none", layers="model.norm",
                  candidate_eps=1e-3)


@pytest.mark.parametrize("model_type,plugin,dtype", [
    ("sam3", "group_norm_32", "float32"),
    ("sam3", "group_norm_32", "bfloat16"),
    ("wav2vec2", "group_norm_32", "float32"),
    ("sam3", "instance_norm", "float32"),
    ("poolformer", "group_norm_4", "float32"),  # PoolFormerGroupNorm is GroupNorm(1, C): 4 is no common count
])
def test_group_norm_faults_are_named(tiny, real, model_type, plugin, dtype):
    report = api.check(tiny(model_type), candidate=_plugin(plugin), dtype=dtype, isolation="none",
                       layers=LAYERS[model_type])
    assert not report.passed and report.layers
    assert _codes(report) == [{"group_count_mismatch"}] * len(report.layers), _codes(report)
    if model_type == "sam3":
        modules = dict(zip((layer.name for layer in report.layers), _sam3_pixel_decoder(tiny("sam3")).norms))
    else:
        modules = {layer.name: real(model_type).get_submodule(layer.name) for layer in report.layers}
    for layer in report.layers:
        ev, module = layer.diagnoses[0].evidence, modules[layer.name]
        # the model's group count (SAM 3's GroupNorm(8, C), wav2vec2's one a channel), and the candidate's
        assert ev["groups"] == module.num_groups
        want = {"group_norm_32": 32, "group_norm_4": 4}.get(plugin, module.num_channels)
        assert ev["candidate_groups"] == want != module.num_groups


def test_candidate_eps_on_a_group_norm_is_eps_mismatch(tiny):
    report = api.check(tiny("sam3"), candidate=_plugin("group_norm"), dtype="bfloat16", isolation="none",
                       layers=LAYERS["sam3"], candidate_eps=1e-3)
    assert _codes(report) == [{"eps_mismatch"}] * 3, _codes(report)
    for layer in report.layers:
        assert layer.diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-3, rel=0.03)


@pytest.mark.parametrize("model_type,candidate,dtype", [
    ("mamba2", _plugin("mamba"), "float32"),
    ("mamba2", _plugin("mamba"), "bfloat16"),
    # Falcon-H1's class as a module plugin, built as its signature asks (n_groups, norm_before_gate=False)
    ("mamba2", "transformers.models.falcon_h1.modeling_falcon_h1:FalconH1RMSNormGated", "bfloat16"),
    ("qwen3_next", _plugin("qwen3_next"), "float16"),
    ("sam3", _plugin("group_norm"), "float32"),
    ("sam3", _plugin("group_norm"), "float16"),
    # one group a channel: an InstanceNorm is right (at float32: at bfloat16 InstanceNorm1d rounds the normalised
    # value before its affine, which parity reports near zero outputs as the real difference it is)
    ("wav2vec2", _plugin("instance_norm"), "float32"),
])
def test_a_correct_plugin_passes_without_a_diagnosis(tiny, model_type, candidate, dtype):
    glob = "*.mixer.norm" if model_type == "mamba2" else LAYERS[model_type]
    report = api.check(tiny(model_type), candidate=candidate, dtype=dtype, isolation="none", layers=glob)
    assert report.layers and report.passed, [(layer.name, layer.error, _codes(report)) for layer in report.layers]
    assert _codes(report) == [set()] * len(report.layers)


@pytest.mark.parametrize("model_type,module,glob", [
    ("olmo", "layers.0.input_layernorm", None),
    ("llama4_text", "layers.0.self_attn.qk_norm", "*.qk_norm"),
])
def test_the_model_s_own_weightless_class_as_a_module_plugin_passes(tiny, model_type, module, glob):
    cls = built_class(model_type, module)  # OlmoLayerNorm; Llama 4's q/k norm under whichever name it has
    candidate = f"{cls.__module__}:{cls.__qualname__}"
    report = api.check(tiny(model_type), candidate=candidate, dtype="bfloat16", isolation="none", layers=glob)
    assert report.layers and report.passed, [layer.error for layer in report.layers]


@pytest.mark.parametrize("model_type,router_key", [("kimi_linear", "num_expert_group")])
def test_an_moe_routers_group_count_is_not_a_gated_norms(tiny, tmp_path, model_type, router_key):
    """KimiLinearRMSNormGated normalises the whole head (its class has no groups); the config's
    num_expert_group counts the MoE router's expert groups. A checkpoint whose router has 4 groups
    keeps one group in its gated norm, and the model's own class passes against the oracle."""
    path = tmp_path / model_type
    shutil.copytree(tiny(model_type), path)
    config = json.loads((path / "config.json").read_text())
    config[router_key] = 4
    (path / "config.json").write_text(json.dumps(config))
    ckpt, family, eps = load(path)
    gated = [layer for layer in discover_layers(ckpt, family, eps).layers if layer.kind == "gated_rms_norm"]
    assert gated and all(layer.groups == 1 for layer in gated)
    report = api.check(path, candidate="transformers", dtype="float32", isolation="none", layers="*o_norm")
    assert report.passed and len(report.layers) == len(gated)
