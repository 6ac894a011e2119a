"""The installed transformers is the truth at run time (issue 34; parity_cli.model.installed).

A committed derived family is a cache stamped with the release it was generated with. Each test
writes one as tools/derive_families.py writes it, from the installed classes, then makes it stale
the way a release makes it stale (a class renamed, as 5.25 renamed MambaRMSNormGated to
Mamba2RMSNormGated; an eps key moved), stamps it with another release, and checks on a tiny
checkpoint written by the model's own classes what a user would get: the committed family where it
still holds (validated), a family derived again where it does not (said in one line), or one line
naming what moved where it cannot be derived again. Class names are taken from the model the
installed release builds (tests/plugins/installed_classes.py), never written here."""

import importlib.util
import shutil
from importlib import metadata

import pytest
from conftest import ROOT

pytest.importorskip("torch")
pytest.importorskip("transformers")

from plugins.installed_classes import built_class  # noqa: E402

from parity_cli import api  # noqa: E402
from parity_cli.errors import InputError  # noqa: E402
from parity_cli.model import derive as derive_module  # noqa: E402
from parity_cli.model import families, installed  # noqa: E402

INSTALLED = metadata.version("transformers")
OTHER = "5.24.0" if INSTALLED != "5.24.0" else "5.25.0"  # a release the family was "generated with"
GATED = "backbone.layers.{i}.mixer.norm"

_spec = importlib.util.spec_from_file_location("derive_families", ROOT / "tools" / "derive_families.py")
generator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generator)


@pytest.fixture
def configs(tmp_path):
    """A configs/ of this test's own (the hand-written families and none generated), and a function
    that commits a generated family file into it."""
    from parity_cli.resources import configs_dir

    root = tmp_path / "configs"
    shutil.copytree(configs_dir(), root, ignore=shutil.ignore_patterns("derived"))
    (root / "families" / "derived").mkdir()

    def commit(model_type: str, edit=lambda text: text) -> str:
        text = generator.to_toml(derive_module.derive(model_type, None, "test"))
        text = edit(text.replace(f"transformers {INSTALLED}:", f"transformers {OTHER}:"))  # another release's stamp
        (root / "families" / "derived" / f"{model_type}.toml").write_text(text)
        families.clear_caches()
        return text

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(families, "configs_dir", lambda: root)
        families.clear_caches()
        yield commit
    families.clear_caches()


def _source(report) -> str:
    return report.header["checkpoint"]["family_source"]


def _stale_name(cls: type) -> str:
    """The other of the two names Mamba2's gated norm has had, in the module it lives in."""
    old = "MambaRMSNormGated" if cls.__name__ != "MambaRMSNormGated" else "Mamba2RMSNormGated"
    return f"{cls.__module__}.{old}"


def test_a_renamed_class_is_derived_again_and_said(tiny, configs):
    """The 5.24 -> 5.25 Mamba2 break: the committed file names a gated norm class the installed release
    does not have. The check re-derives, passes with the model's own class, and says what moved."""
    built = built_class("mamba2", "layers.0.mixer.norm")
    stale = _stale_name(built)
    text = configs("mamba2", lambda t: t.replace(f"{built.__module__}.{built.__qualname__}", stale))
    assert stale in text and f"transformers {OTHER}: Mamba2ForCausalLM" in text
    report = api.check(tiny("mamba2"), candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and {layer.kind for layer in report.layers} == {"rms_norm", "gated_rms_norm"}
    assert _source(report) == (f"derived at run time: transformers {INSTALLED} renamed {stale.rsplit('.', 1)[1]} → "
                               f"{built.__name__} (committed: transformers {OTHER}: Mamba2ForCausalLM)")
    assert report.header["environment"]["transformers"] == INSTALLED


def test_a_planted_gated_norm_fault_keeps_its_cause_under_a_renamed_class(tiny, configs):
    built = built_class("mamba2", "layers.0.mixer.norm")
    configs("mamba2", lambda t: t.replace(f"{built.__module__}.{built.__qualname__}", _stale_name(built)))
    plugin = f"{ROOT / 'tests' / 'plugins' / 'other_kinds.py'}:mamba_sigmoid"
    report = api.check(tiny("mamba2"), candidate=plugin, dtype="float32", isolation="none", layers="*.mixer.norm")
    assert not report.passed and report.layers
    # the cause comes from the family derived again from the installed classes, not the stale file
    assert _source(report).startswith(f"derived at run time: transformers {INSTALLED} renamed ")
    assert [{d.code for d in layer.diagnoses} for layer in report.layers] == [{"gate_activation_mismatch"}] * 2


def test_a_family_that_still_holds_is_used_and_said_validated(tiny, configs):
    text = configs("smollm3")
    report = api.check(tiny("smollm3"), candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and report.layers
    assert _source(report) == (f"transformers {OTHER}: SmolLM3ForCausalLM, validated against the installed "
                               f"transformers {INSTALLED}")
    assert "rms_norm_eps" in text and all(layer.eps["source"] == "config:rms_norm_eps" for layer in report.layers)


def test_an_eps_key_that_moved_is_derived_again(tiny, configs):
    """A committed family reading eps from a key the installed classes no longer read would use the
    family default (1e-6 here) where the model runs at its config's: derived again, it reads the
    key the modules do."""
    text = configs("smollm3", lambda t: t.replace('eps_keys = ["rms_norm_eps"]', 'eps_keys = ["norm_eps_moved"]'))
    assert "norm_eps_moved" in text
    report = api.check(tiny("smollm3"), candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and all(layer.eps["source"] == "config:rms_norm_eps" for layer in report.layers)
    assert _source(report).startswith(f"derived at run time: transformers {INSTALLED} ")
    assert "eps_keys ('norm_eps_moved',) → ('rms_norm_eps',)" in _source(report)


def test_a_class_gone_that_cannot_be_derived_again_is_one_line(tiny, configs, monkeypatch):
    built = built_class("mamba2", "layers.0.mixer.norm")
    stale = _stale_name(built)
    configs("mamba2", lambda t: t.replace(f"{built.__module__}.{built.__qualname__}", stale))
    monkeypatch.setattr(derive_module, "MAX_PARAMETERS", 10)  # the derivation refuses to build the model
    with pytest.raises(InputError) as err:
        api.check(tiny("mamba2"), candidate="transformers", dtype="float32", isolation="none")
    line = str(err.value)
    assert "\n" not in line and "config.json" in line and f"derived with transformers {OTHER}" in line
    assert f"renamed {stale.rsplit('.', 1)[1]} → {built.__name__}" in line and "cannot be derived again" in line
    assert "too old" not in line


def test_without_transformers_the_committed_family_is_used_and_said_unvalidated(tiny, configs, monkeypatch):
    configs("smollm3")
    monkeypatch.setattr(installed, "installed_version", lambda: None)
    report = api.check(tiny("smollm3"), dtype="float32", isolation="none")
    assert report.passed
    assert _source(report) == f"transformers {OTHER}: SmolLM3ForCausalLM; transformers is not installed: not validated"


def test_a_hand_written_family_s_class_is_the_one_the_installed_release_builds(tiny, configs):
    """--candidate transformers runs the class the model builds at each pattern: a hand-written
    family naming a class the release renamed still runs the model's own, and says so."""
    from parity_cli.resources import load_toml

    llama = families.configs_dir() / "families" / "llama.toml"
    text = llama.read_text()
    named = load_toml(llama)["hf_class"]
    assert named.endswith(".LlamaRMSNorm") and named in text
    llama.write_text(text.replace(f'"{named}"', f'"{named}Before"', 1))
    families.clear_caches()
    report = api.check(tiny("llama"), candidate="transformers", dtype="bfloat16", isolation="none")
    assert report.passed and report.layers
    assert _source(report).endswith(f"; transformers {INSTALLED} renamed LlamaRMSNormBefore → LlamaRMSNorm")


def test_tagged_non_finite_floats_are_read_as_transformers_reads_them():
    config = {"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "NaN"},
              "y": {"__float__": "-Infinity"}, "z": {"__float__": "1.0"}, "w": {"a": 1}}
    got = derive_module.tagged_floats(config)
    assert got["time_step_limit"] == [0.0, float("inf")] and got["y"] == float("-inf") and got["x"] != got["x"]
    assert got["z"] == {"__float__": "1.0"} and got["w"] == {"a": 1}  # not a tag transformers writes: as it is


def _gemma3n_with_audio(path):
    """A Gemma 3n checkpoint of its language model, audio tower and audio embedder, written from their
    own classes (its vision tower needs timm, which the test extra lacks), gains randomised: {stored
    name: module} of every RMSNorm with a gain (the class its language model's final norm is built with;
    the audio tower's cumulative GroupNorms are a kind parity cannot express yet)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma3nAudioConfig, Gemma3nConfig, Gemma3nTextConfig
    from transformers.models.gemma3n import modeling_gemma3n as g

    text = Gemma3nTextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=256, vocab_size_per_layer_input=256,
                             hidden_size_per_layer_input=16, layer_types=["sliding_attention", "full_attention"],
                             num_kv_shared_layers=0, laurel_rank=8, activation_sparsity_pattern=[0.0, 0.0],
                             rms_norm_eps=2e-6)
    audio = Gemma3nAudioConfig(hidden_size=64, conf_num_hidden_layers=2, conf_num_attention_heads=4, rms_norm_eps=3e-6,
                               vocab_size=128)
    config = Gemma3nConfig(text_config=text.to_dict(), audio_config=audio.to_dict())
    config.architectures = ["Gemma3nForConditionalGeneration"]
    rms_norm = built_class("gemma3n_text", "norm")
    torch.manual_seed(0)
    parts = {"model.language_model.": g.Gemma3nTextModel(config.text_config),
             "model.audio_tower.": g.Gemma3nAudioEncoder(config.audio_config),
             "model.embed_audio.": g.Gemma3nMultimodalEmbedder(config.audio_config, config.text_config)}
    tensors, norms = {}, {}
    for prefix, part in parts.items():
        for name, module in part.named_modules():
            if type(module) is rms_norm and module.with_scale:
                with torch.no_grad():
                    module.weight.copy_(torch.rand(module.weight.shape) * 0.5 + 0.1)
                norms[prefix + name] = module
        tensors.update({prefix + k: v.contiguous() for k, v in part.state_dict().items()})
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config.save_pretrained(path)
    return norms


def test_mamba2_llama4_and_gemma3n_pass_with_the_installed_classes(tiny, tmp_path):
    """Issue 34's three breaks, each checked end to end with --candidate transformers on the installed
    release: every norm with a gain found and checked, at the module's own eps."""
    from plugins.installed_classes import eps_of

    for model_type in ("mamba2", "llama4"):
        report = api.check(tiny(model_type), candidate="transformers", dtype="float32", isolation="none")
        assert report.passed and report.layers, (model_type, [layer.error for layer in report.layers])
    norms = _gemma3n_with_audio(tmp_path / "gemma3n")
    report = api.check(tmp_path / "gemma3n", candidate="transformers", dtype="float32", isolation="none")
    assert report.passed, [(layer.name, layer.error) for layer in report.layers if layer.status != "pass"]
    checked = {layer.name: layer.eps["value"] for layer in report.layers}
    assert set(norms) <= set(checked), sorted(set(norms) - set(checked))[:4]
    assert {name: eps_of(m) for name, m in norms.items()} == {name: checked[name] for name in norms}
    assert {2e-6, 3e-6} <= set(checked.values())  # the language model's eps and the audio tower's


def test_an_eps_the_code_fixes_that_moved_is_derived_again(tiny, configs):
    """Whisper's LayerNorms take torch's default eps (1e-5, no config key): a committed file saying the
    code fixes 1e-6 no longer describes them and is derived again."""
    text = configs("whisper", lambda t: t.replace("eps = 1e-05", "eps = 1e-06"))
    assert "eps = 1e-06" in text and "eps = 1e-05" not in text
    report = api.check(tiny("whisper"), candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and {layer.eps["value"] for layer in report.layers} == {1e-5}
    assert "eps 1e-06 → 1e-05" in _source(report), _source(report)


def test_a_class_that_stops_computing_any_form_parity_knows_is_refused(tiny, configs, monkeypatch):
    """SmolLM3's RMSNorm made to divide by sqrt(q) + eps (eps outside the root): parity cannot express
    that form, so a committed family of it is neither validated nor derived again; the check is refused
    in one line saying what the installed class computes now."""
    import torch

    cls = built_class("smollm3", "norm")
    configs("smollm3")

    def outside(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (self.weight * (x.float() / (torch.sqrt(v) + self.variance_epsilon))).to(x.dtype)

    monkeypatch.setattr(cls, "forward", outside)
    with pytest.raises(InputError) as err:
        api.check(tiny("smollm3"), candidate="hf", dtype="float32", isolation="none")
    line = str(err.value)
    assert "\n" not in line and "cannot be derived again" in line and "as unsupported (" in line, line
    assert line.count("matches no RMSNorm") <= 2, line  # the patterns that moved alike said once


def test_a_torch_layer_norm_named_by_its_short_path_is_the_class_built(tiny):
    """The layer_norm family names torch.nn.LayerNorm; BERT builds torch.nn.modules.normalization.LayerNorm,
    the same class: nothing was renamed."""
    report = api.check(tiny("bert"), candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and _source(report) == "configs/families/layer_norm.toml"


def test_a_type_the_installed_release_does_not_know_runs_unvalidated_unless_its_classes_are_needed(
        tiny, configs, tmp_path):
    """A family committed from a newer release for a type the installed one does not ship: a check
    that runs no transformers class goes on, said unvalidated; --candidate transformers needs a class
    the release lacks and is refused in one line."""
    import json

    def other_type(text):
        return text.replace('"smollm3"', '"smollm9"').replace("SmolLM3RMSNorm", "SmolLM9RMSNorm")

    configs("smollm3", other_type)
    root = families.configs_dir() / "families" / "derived"
    (root / "smollm3.toml").rename(root / "smollm9.toml")
    families.clear_caches()
    path = tmp_path / "smollm9"
    shutil.copytree(tiny("smollm3"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "smollm9"}))
    report = api.check(path, candidate="hf", dtype="float32", isolation="none")
    assert report.passed and report.layers
    source = _source(report)
    assert source.startswith(f"transformers {OTHER}: SmolLM3ForCausalLM; not validated against the installed "
                             f"transformers {INSTALLED}") and "'smollm9' is not known to transformers" in source
    with pytest.raises(InputError) as err:
        api.check(path, candidate="transformers", dtype="float32", isolation="none")
    assert "has no class SmolLM9RMSNorm" in str(err.value) and "\n" not in str(err.value)


def test_a_weightless_norm_the_model_does_not_build_is_not_a_layer(tiny, tmp_path):
    """Llama 4's q/k norm has no parameter, so it is found by its parent module; a no-RoPE layer
    (no_rope_layers = [1, 0]: layer 1) has the parent and no q/k norm. The model the installed
    transformers builds from the config (on the meta device) says which layers have one."""
    import json

    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load

    path = tmp_path / "llama4_text"
    shutil.copytree(tiny("llama4_text"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "no_rope_layers": [1, 0]}))
    ckpt, family, eps = load(path)
    names = [layer.name for layer in discover_layers(ckpt, family, eps).layers if layer.name.endswith("qk_norm")]
    assert names == ["model.layers.0.self_attn.qk_norm"]
    report = api.check(path, candidate="transformers", dtype="float32", isolation="none")
    assert report.passed and "model.layers.1.self_attn.qk_norm" not in {layer.name for layer in report.layers}


def test_validation_and_class_binding_build_one_tree(tiny, configs):
    """The committed family's validation and --candidate transformers's class binding ask for the same
    meta-device tree of the same config: it is built once (a work bound, not a time)."""
    from parity_cli.model.load import load

    built = built_class("mamba2", "layers.0.mixer.norm")
    configs("mamba2", lambda t: t.replace(f"{built.__module__}.{built.__qualname__}", _stale_name(built)))
    installed._TREES.clear()
    installed._CURRENT.clear()
    load(tiny("mamba2"), classes=True)
    assert [shrunk for (_, _, shrunk) in installed._TREES] == [True]


def test_semantics_the_installed_release_changed_are_on_the_verdict_line(tiny, configs):
    """The committed family normalises Mamba2's gated norm as one group over the whole width (what
    transformers 4.53 computes whatever n_groups says); the installed release computes n_groups groups.
    Derived again, the check passes by the installed semantics, and says so on the one line -q prints
    (issue 47: a plain PASS hid which semantics it was of)."""
    from conftest import run_parity

    text = configs("mamba2", lambda t: t.replace('groups = "n_groups"', "groups = 1"))
    assert "groups = 1" in text
    r = run_parity("check", tiny("mamba2"), "--candidate", "transformers", "--dtype", "float32", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = r.stdout.splitlines()
    assert line.startswith("PASS: ") and line.endswith(
        f" (as transformers {INSTALLED} computes it: layers.*.mixer.norm: groups 1 → n_groups)"), line
