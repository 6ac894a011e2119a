"""Issue 7: GGUF checkpoints (written here with gguf's own GGUFWriter) inspected and checked like
HF directories, and HF -> GGUF conversion faults each found and named."""

import struct

import pytest
from conftest import load_json, plugin, run_parity

from parity_cli import api

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package (the gguf extra)")
from parity_cli.sources.synthetic import hf_to_gguf  # noqa: E402


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.fixture
def pair(ckpt, tmp_path):
    def make(model_type, dtype="bfloat16", eps=1e-6, layers=2, **faults):
        hf = ckpt(model_type, layers=layers, eps=eps, dtype=dtype)
        return hf, hf_to_gguf(hf, tmp_path / f"{model_type}-{len(list(tmp_path.iterdir()))}.gguf", **faults)

    return make


@pytest.mark.parametrize("model_type,per_layer", [("llama", 2), ("gemma3", 6)])
def test_gguf_inspected_with_hf_names(pair, model_type, per_layer):
    hf, g = pair(model_type, eps=1e-6)
    info = api.inspect(g)
    hf_info = api.inspect(hf)
    assert info["checkpoint"]["format"] == "gguf"
    assert [l["name"] for l in info["layers"]] == [l["name"] for l in hf_info["layers"]]
    assert len(info["layers"]) == per_layer * 2 + 1
    assert info["eps"]["value"] == f32(1e-6) != 1e-6  # the stored float32, exactly
    assert info["eps"]["decimal"] == "1e-06" and "layer_norm_rms_epsilon" in info["eps"]["source"]
    assert info["checkpoint"]["unmatched"] == []


def test_gguf_gemma_gain_is_the_stored_value(pair):
    hf, g = pair("gemma3")
    by_name = {l["name"]: l for l in api.inspect(hf)["layers"]}
    for layer in api.inspect(g)["layers"]:
        assert layer["gain_offset"] == 0.0  # 1 + w is stored; adding 1 again is the bug
        expected = by_name[layer["name"]]["gain"]
        assert layer["gain"]["min"] == pytest.approx(expected["min"], abs=1e-6)
        assert layer["gain"]["max"] == pytest.approx(expected["max"], abs=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
@pytest.mark.parametrize("candidate", ["hf", "torch"])
def test_gguf_check_passes(pair, model_type, candidate):
    _, g = pair(model_type)
    report = api.check(g, candidate=candidate)
    assert report.passed and report.header["checkpoint"]["format"] == "gguf"
    assert report.header["candidate"]["dtype"] == "float32"  # GGUF norms are F32


def test_gguf_cli_inspect_and_check(pair, tmp_path):
    _, g = pair("gemma3")
    r = run_parity("inspect", g)
    assert r.returncode == 0 and "model.layers.0.self_attn.q_norm" in r.stdout
    out = tmp_path / "r.json"
    assert run_parity("check", g, "--json", out).returncode == 0
    assert load_json(out)["eps"]["decimal"] == "1e-06"


def test_quantized_blocks_are_never_decoded(pair, monkeypatch):
    _, g = pair("llama")

    def refuse(*a, **k):
        raise AssertionError("a quantized block was decoded")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    assert api.check(g, candidate="hf").passed


def test_bf16_and_f16_norm_tensors_are_read(pair):
    hf, g = pair("llama", norm_dtype="BF16")
    info = api.inspect(g)
    assert {l["weight"]["dtype"] for l in info["layers"]} == {"bfloat16"}
    assert api.check(hf, candidate="hf", candidate_checkpoint=str(g)).passed  # bf16 -> BF16 is exact


def test_conversion_parity_of_a_faithful_conversion(pair):
    for model_type in ("llama", "gemma3"):
        hf, g = pair(model_type)
        report = api.check(hf, candidate="hf", candidate_checkpoint=str(g))
        assert report.passed, [(l.name, l.findings) for l in report.layers if l.findings]
        assert report.header["candidate"]["checkpoint"]["format"] == "gguf"


def test_eps_rounded_to_1e5_is_found(pair):
    hf2, g2 = pair("llama", eps=1e-6)
    g2 = hf_to_gguf(hf2, g2.with_name("rounded.gguf"), eps=1e-5)  # the #9310 converter
    report = api.check(hf2, candidate="hf", candidate_checkpoint=str(g2))
    assert not report.passed
    for layer in report.layers:
        (finding,) = layer.findings
        assert finding["code"] == "checkpoint_eps_mismatch"
        assert finding["candidate"]["value"] == f32(1e-5) and finding["reference"]["value"] == 1e-6


@pytest.mark.parametrize("offset,shift", [("missing", -1.0), ("twice", 1.0)])
def test_gemma_offset_faults_are_named(pair, offset, shift):
    hf, g = pair("gemma3", offset=offset)
    report = api.check(hf, candidate="hf", candidate_checkpoint=str(g))
    assert not report.passed
    for layer in report.layers:
        (finding,) = layer.findings
        assert finding["code"] == "checkpoint_weight_mismatch" and finding["uniform_shift"] == shift


def test_dropped_layer_is_found(pair):
    hf, g = pair("gemma3", drop=("model.layers.1.self_attn.k_norm",))
    report = api.check(hf, candidate="hf", candidate_checkpoint=str(g))
    missing = {l.name for l in report.layers for f in l.findings if f["code"] == "checkpoint_layer_missing"}
    assert missing == {"model.layers.1.self_attn.k_norm"}
    assert not report.passed


def test_f16_norm_losing_precision_is_found(pair):
    # float32 gains near 1 need 24 bits; F16 keeps 11: the conversion rounds them
    hf, g = pair("llama", dtype="float32", f16=("model.layers.0.input_layernorm",))
    report = api.check(hf, candidate="hf", candidate_checkpoint=str(g))
    flagged = {l.name: l.findings for l in report.layers if l.findings}
    assert set(flagged) == {"model.layers.0.input_layernorm"}
    (finding,) = flagged["model.layers.0.input_layernorm"]
    assert finding["code"] == "checkpoint_weight_mismatch" and finding["precision_loss"]
    assert 0 < finding["max_abs_diff"] <= 2 ** -11  # at most half an F16 ulp at |gain| < 2


def test_unknown_architecture_and_corrupt_gguf_are_input_errors(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_parity("inspect", tmp_path / "x.gguf")
    assert r.returncode == 2 and "mamba" in r.stderr and len(r.stderr.splitlines()) == 1
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 7)
    r = run_parity("inspect", tmp_path / "bad.gguf")
    assert r.returncode == 2 and "bad.gguf" in r.stderr and len(r.stderr.splitlines()) == 1


def test_transformers_builtin_on_a_gguf_gemma_does_not_add_one_twice(pair):
    pytest.importorskip("transformers", reason="the transformers built-in needs transformers")
    _, g = pair("gemma3")
    assert api.check(g, candidate="transformers").passed


def test_big_endian_gguf_is_read(pair, tmp_path):
    import numpy as np

    hf, little = pair("llama")
    w = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_embedding_length(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("output_norm.weight", np.array([1.0, 2.0, 0.5, 0.25], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = api.inspect(tmp_path / "be.gguf")
    (layer,) = info["layers"]
    assert layer["name"] == "model.norm" and (layer["weight"]["min"], layer["weight"]["max"]) == (0.25, 2.0)
    assert info["eps"]["decimal"] == "1e-05"


def test_a_module_adding_its_own_one_to_a_gguf_gemma_is_told_the_file_stores_it(pair):
    """The HF-style Gemma module adds 1 to what it is given; a GGUF Gemma stores 1 + w already.
    The message must state this file's convention, not "the family does not use +1"."""
    _, g = pair("gemma3", layers=1)
    report = api.check(g, candidate=plugin("GemmaRMSNorm"), layers="model.norm")
    (diag,) = report.layers[0].diagnoses
    assert diag.code == "weight_offset_mismatch" and diag.evidence["offset_error"] == 1.0
    assert "this file already stores 1 + w" in diag.message and "does not use" not in diag.message
