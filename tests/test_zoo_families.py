"""Families beyond the hand-written ones (issue 25): --family by model_type, generated family
files loaded beside the hand-written ones, the report saying where a family comes from."""

from parity_cli import api
from parity_cli.model.families import family_by_name


def test_family_accepts_a_model_type_and_says_which_family_it_chose(ckpt):
    assert family_by_name("bert").name == "layer_norm"  # BERT's norms are the layer_norm family's
    assert family_by_name("gemma3_text").name == "gemma"
    path = ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-5)
    report = api.check(path, family="mistral")  # a model_type llama claims
    assert report.header["checkpoint"]["family"] == "llama"
    assert report.header["checkpoint"]["family_source"] == "configs/families/llama.toml"


DERIVED = """
name = "{name}"
derived_from = "transformers 9.9.9: TinyForCausalLM"
model_types = ["{name}"]
kind = "rms_norm"
order = "llama"
eps_keys = ["rms_norm_eps"]
eps_default = 1e-6
roots = ["model.", ""]

[[norms]]
name = "{{root}}layers.{{i}}.input_layernorm"
"""


def _configs_with(tmp_path, monkeypatch, *derived):
    import shutil

    from parity_cli.model import families
    from parity_cli.resources import configs_dir

    root = tmp_path / "configs"
    shutil.copytree(configs_dir(), root)
    (root / "families" / "derived").mkdir(exist_ok=True)
    for name in derived:
        (root / "families" / "derived" / f"{name}.toml").write_text(DERIVED.format(name=name))
    monkeypatch.setattr(families, "configs_dir", lambda: root)
    families.clear_caches()
    return root


def test_a_generated_family_loads_beside_the_hand_written_ones(tmp_path, monkeypatch):
    from parity_cli.model import families

    try:
        _configs_with(tmp_path, monkeypatch, "tinymodel")
        fam = families.family_for_model_type("tinymodel", "config.json")
        assert fam.derived_from == "transformers 9.9.9: TinyForCausalLM"
        assert fam.match("model.layers.3.input_layernorm") and fam.match("layers.3.input_layernorm")
        assert families.family_by_name("llama").derived_from is None
    finally:
        families.clear_caches()


def test_a_generated_family_may_not_claim_a_hand_written_type(tmp_path, monkeypatch):
    import pytest

    from parity_cli.errors import InputError
    from parity_cli.model import families

    try:
        _configs_with(tmp_path, monkeypatch, "llama")
        with pytest.raises(InputError, match="already"):
            families.load_families()
    finally:
        families.clear_caches()
