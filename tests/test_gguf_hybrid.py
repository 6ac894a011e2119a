"""GGUF files of the hybrid and linear-attention models (Qwen3-Next, Mamba2, Granite 4 hybrid,
Nemotron) as llama.cpp's converter writes them, read through the families derived from their
transformers classes: the architecture's own name (qwen3next, granitehybrid), the 1 + w gains it
stores as the sum except the gated norm's, and a Mamba2 gated norm stored by group.

The files are written here with gguf-py, transcribing what convert_hf_to_gguf.py does to these
tensors (the lines are quoted in configs/gguf.toml); the checkpoints are each type's own classes'
(model.derive.write_tiny_checkpoint)."""

import json

import pytest
from conftest import failing, run_parity

from parity_cli import api

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package (the gguf extra)")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# model_type -> llama.cpp's general.architecture for it
ARCH = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "mamba2": "mamba2", "granitemoehybrid": "granitehybrid",
        "bamba": "granitehybrid", "nemotron_h": "nemotron_h_moe", "nemotron": "nemotron", "kimi_linear": "kimi-linear"}
# (NemotronHModel writes nemotron_h_moe where the config has num_experts_per_tok, as the tiny one does)
# Qwen3NextModel.modify_tensors (the Qwen 3.5 models inherit it) and NemotronModel.modify_tensors:
# `data_torch + 1` on "norm.weight" (Qwen: except "linear_attn.norm.weight")
BAKES = {"qwen3next", "qwen35", "nemotron"}


def _config(hf):
    return json.loads((hf / "config.json").read_text())


def convert(hf, out, *, bake=True, bake_gated=False, rows=None, group_count=None, nextn=0, floats=None):
    """The norm tensors of `hf` as llama.cpp's converter writes them (gguf-py's name map), F32.
    Faults: `bake=False` (the + 1 left out), `bake_gated` (a + 1 on the gated norm too), `rows`
    (the gated gain stored by another group count), `group_count` (another count in the metadata).
    `nextn` appends that many next-token-prediction blocks after the model's own, as Qwen 3.5's
    converter does by default (_Qwen35MtpMixin: mtp.layers.K -> blk.{n_layers + K}). `floats`
    writes metadata keys as float32 values, in place of what the converter writes (hostile files)."""
    config = _config(hf)
    arch = ARCH[config["model_type"]]
    arch_enum = next(e for e, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    floats = {k.format(arch=arch): v for k, v in (floats or {}).items()}
    blocks = config.get("num_hidden_layers") or len(config["layers_block_type"])  # NemotronH: its pattern's length
    names = gguf.get_tensor_name_map(arch_enum, blocks + nextn)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(blocks + nextn)
    if nextn and f"{arch}.nextn_predict_layers" not in floats:
        w.add_nextn_predict_layers(nextn)
    w.add_embedding_length(config["hidden_size"])
    if arch == "nemotron":
        w.add_layer_norm_eps(config["norm_eps"])
    else:
        w.add_layer_norm_rms_eps(config.get("rms_norm_eps", config.get("layer_norm_epsilon")))
    groups = config.get("n_groups", config.get("mamba_n_groups"))
    if groups is not None and f"{arch}.ssm.group_count" not in floats:  # Mamba2Model: add_ssm_group_count(n_group)
        w.add_ssm_group_count(group_count or groups)
    for key, value in floats.items():
        w.add_float32(key, value)
    for name, t in load_file(hf / "model.safetensors").items():
        base, _, suffix = name.rpartition(".")
        if "norm" not in base or t.dim() != 1:
            continue
        t = t.float()
        gated = name.endswith("linear_attn.norm.weight")
        if arch in BAKES and name.endswith("norm.weight") and (bake and not gated or bake_gated and gated):
            t = t + 1
        target = names.get_name(base)
        if target.endswith("ssm_norm") and groups is not None:  # Mamba2Model: reshape((n_group, d_inner // n_group))
            t = t.reshape(rows or groups, -1)
        w.add_tensor(f"{target}.{suffix}", t.numpy().astype(np.float32))
    for k in range(nextn):  # the MTP block's own norms (ones: the converter's + 1 on a zero-initialised w)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            target = names.get_name(f"model.layers.{blocks + k}.{norm}")
            w.add_tensor(f"{target}.weight", np.ones(config["hidden_size"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _layers(report):
    return {layer.name: layer for layer in report.layers}


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "mamba2", "granitemoehybrid", "bamba",
                                        "nemotron_h", "nemotron", "kimi_linear"])
def test_a_correct_conversion_reads_as_its_checkpoint_and_passes(tiny, tmp_path, model_type):
    path = tiny(model_type)
    g = convert(path, tmp_path / "m.gguf")
    info, hf_info = api.inspect(g), api.inspect(path)
    # read as the model type configs/gguf.toml names first for the architecture (Bamba's file alone
    # reads as Granite 4's, whose norms it shares but one name); beside its model, as that model
    alone = {"bamba": "granitemoehybrid"}.get(model_type, model_type)
    assert info["checkpoint"]["model_type"] == alone
    if alone != model_type:
        info = api.inspect(g, family=model_type)
    assert info["checkpoint"]["family"] == hf_info["checkpoint"]["family"]
    mine = {layer["name"]: layer for layer in info["layers"]}
    theirs = {layer["name"]: layer for layer in hf_info["layers"]}
    assert mine.keys() == theirs.keys() and info["checkpoint"]["unmatched"] == []
    for name, layer in theirs.items():
        assert (mine[name]["kind"], mine[name]["shape"]) == (layer["kind"], layer["shape"])
        # what the file stores is the effective gain: 1 + w read as the stored sum, w as w
        assert mine[name]["gain_offset"] == 0.0
        assert mine[name]["gain"]["min"] == pytest.approx(layer["gain"]["min"], abs=1e-6)
    report = api.check(path, candidate_checkpoint=g, candidate="torch", dtype="float32")
    assert report.passed and len(report.layers) == len(theirs)
    assert report.header["candidate"]["checkpoint"]["model_type"] == model_type


def test_qwen3_next_stores_1_plus_w_except_on_its_gated_norm(tiny, tmp_path):
    path = tiny("qwen3_next")
    offsets = {layer["name"]: layer["gain_offset"] for layer in api.inspect(path)["layers"]}
    baked = {n for n, o in offsets.items() if o == 1.0}
    gated = {n for n in offsets if n.endswith("linear_attn.norm")}
    assert gated and baked == set(offsets) - gated  # the class's own: Qwen3NextRMSNorm 1 + w, the gated w
    # the converter left out the + 1: every 1 + w layer, and only they, are the offset missing
    report = api.check(path, candidate_checkpoint=convert(path, tmp_path / "plain.gguf", bake=False),
                       candidate="torch", dtype="float32")
    found = failing(report)
    assert set(found) == baked and {s for s, _ in found.values()} == {"fail"}, found
    for name in baked:
        codes = {d.code for d in _layers(report)[name].diagnoses}
        assert "weight_offset_mismatch" in codes
    # a + 1 on the gated norm, whose gain is w: that layer alone, the shift named as such
    report = api.check(path, candidate_checkpoint=convert(path, tmp_path / "gated.gguf", bake_gated=True),
                       candidate="torch", dtype="float32")
    found = failing(report)
    assert set(found) == gated and {s for s, _ in found.values()} == {"fail"}, found
    (layer,) = [layer for layer in report.to_dict()["layers"] if layer["name"] in gated]
    text = json.dumps(layer)
    assert "uniform_shift" in text and "a gain that is w (this norm has no 1 + w)" in text


@pytest.mark.parametrize("model_type", ["mamba2", "granitemoehybrid", "nemotron_h"])
def test_a_gated_norm_stored_by_group_is_read_flat_with_the_metadata_group_count(tiny, tmp_path, model_type):
    path = tiny(model_type)
    config = _config(path)
    groups = config.get("n_groups", config.get("mamba_n_groups"))
    info = api.inspect(convert(path, tmp_path / "m.gguf"))
    gated = [layer for layer in info["layers"] if layer["kind"] == "gated_rms_norm"]
    assert gated and all(layer["groups"] == groups for layer in gated)
    # read flat: the shape the transformers checkpoint holds, the gain's values in its order
    theirs = {layer["name"]: layer for layer in api.inspect(path)["layers"]}
    for layer in gated:
        assert layer["shape"] == theirs[layer["name"]]["shape"] and layer["gain"] == theirs[layer["name"]]["gain"]
    assert api.check(path, candidate_checkpoint=tmp_path / "m.gguf", candidate="torch", dtype="float32").passed


def test_a_group_count_the_stored_shape_contradicts_is_refused(tiny, tmp_path):
    path = tiny("mamba2")
    groups = _config(path)["n_groups"]
    bad = convert(path, tmp_path / "bad.gguf", group_count=groups // 2)
    r = run_parity("check", path, "--candidate-checkpoint", bad, "--candidate", "torch")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"is stored as {groups} x " in r.stderr and f"mamba2.ssm.group_count says {groups // 2}" in r.stderr


def test_a_conversion_with_another_group_count_is_group_count_mismatch(tiny, tmp_path):
    path = tiny("mamba2")
    groups = _config(path)["n_groups"]
    other = convert(path, tmp_path / "other.gguf", rows=groups // 2, group_count=groups // 2)
    report = api.check(path, candidate_checkpoint=other, candidate="torch", dtype="float32")
    assert not report.passed
    bad = [layer for layer in report.layers if not layer.passed]
    assert bad and all(layer.kind == "gated_rms_norm" and layer.status == "fail" for layer in bad)
    text = json.dumps(report.to_dict())
    assert text.count('"group_count_mismatch"') >= len(bad)
    assert f'"groups": {groups // 2}, "checkpoint_groups": {groups}' in text


def test_an_architecture_with_1_plus_w_that_configs_does_not_list_is_still_refused(tiny, tmp_path, monkeypatch):
    import parity_cli.sources.gguf as source

    path = tiny("qwen3_next")
    g = convert(path, tmp_path / "m.gguf")
    rules = dict(source.conventions())
    rules["offset_baked"] = {"architectures": []}
    monkeypatch.setattr(source, "conventions", lambda: rules)
    r = run_parity("inspect", g)
    assert r.returncode == 2 and "whether its converter stored w or 1 + w is not known" in r.stderr


def test_a_qwen3_5_gguf_with_its_mtp_block_reads_as_the_model_and_says_so(tiny, tmp_path):
    """Qwen 3.5's converter appends the multi-token-prediction block after the model's own
    (qwen35.nextn_predict_layers = 1, block_count one more): transformers builds no such layer, so
    its norms are set aside with a note, and a correct conversion passes."""
    path = tiny("qwen3_5_text")
    blocks = _config(path)["num_hidden_layers"]
    g = convert(path, tmp_path / "mtp.gguf", nextn=1)
    info = api.inspect(g)
    assert {layer["name"] for layer in info["layers"]} == {layer["name"] for layer in api.inspect(path)["layers"]}
    assert [w for w in info["warnings"] if "next-token-prediction" in w] == [
        f"GGUF block {blocks} (2 tensors): the model's next-token-prediction layers (qwen35.nextn_predict_layers = 1), "
        "which the transformers model does not build; not checked"]
    report = api.check(path, candidate_checkpoint=g, candidate="torch", dtype="float32")
    assert report.passed and not report.findings


@pytest.mark.parametrize("model_type,key,value", [
    ("mamba2", "{arch}.ssm.group_count", float("nan")), ("mamba2", "{arch}.ssm.group_count", float("inf")),
    ("mamba2", "{arch}.ssm.group_count", 0.0), ("mamba2", "{arch}.ssm.group_count", 2.5),
    ("qwen3_5_text", "{arch}.nextn_predict_layers", 7.0), ("qwen3_5_text", "{arch}.nextn_predict_layers", -1.0),
    ("qwen3_5_text", "{arch}.nextn_predict_layers", float("nan"))])
def test_lying_counts_in_the_metadata_are_one_line(tiny, tmp_path, model_type, key, value):
    """A group count or a number of next-token-prediction blocks that is no count (NaN, inf, 0, a
    fraction, more blocks than the file has): refused in one line naming the key, exit 2."""
    path = tiny(model_type)
    g = convert(path, tmp_path / "lying.gguf", nextn=1 if "nextn" in key else 0, floats={key: value})
    r = run_parity("inspect", g)
    name = key.format(arch=ARCH[model_type])
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"GGUF metadata {name} must be" in r.stderr and "Traceback" not in r.stderr
