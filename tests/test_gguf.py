"""Issue 7: GGUF checkpoints (written here with gguf's own GGUFWriter) inspected and checked like
HF directories, and HF -> GGUF conversion faults each found and named."""

import struct

import pytest
from conftest import failing, load_json, plugin, run_parity

from parity_cli import api
from parity_cli.errors import InputError

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
    layers = api.inspect(g)["layers"]
    assert sorted(l["name"] for l in layers) == sorted(by_name)
    for layer in layers:
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
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "rwkv6")  # no family, hand-written or derived
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = run_parity("inspect", tmp_path / "x.gguf")
    assert r.returncode == 2 and "rwkv6" in r.stderr and len(r.stderr.splitlines()) == 1
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


def _tiny_gguf(hf, out, arch, eps):
    """The norm tensors of a tiny transformers checkpoint as llama.cpp names them (gguf-py's own
    map for `arch`), F32, with the rms eps in the metadata as its converter writes it."""
    import json

    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((hf / "config.json").read_text())
    arch_enum = next(e for e, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_embedding_length(config["hidden_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_layer_norm_rms_eps(eps)
    written = 0
    for name, t in load_file(hf / "model.safetensors").items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and t.dim() == 1 and "norm" in base:
            w.add_tensor(names.get_name(base) + ".weight", t.float().numpy().astype(np.float32))
            written += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def test_a_gguf_of_an_architecture_only_a_derived_family_knows(tmp_path):
    """granite has no hand-written family: its GGUF reads as its HF checkpoint does, through the
    family generated from GraniteForCausalLM (gguf-py's names mapped back to the HF ones), and a
    conversion that changed eps is caught."""
    pytest.importorskip("transformers")
    import json

    from parity_cli.model.derive import write_tiny_checkpoint

    hf = tmp_path / "granite"
    write_tiny_checkpoint("granite", hf)
    eps = json.loads((hf / "config.json").read_text())["rms_norm_eps"]
    n = _tiny_gguf(hf, tmp_path / "granite.gguf", "granite", eps)
    info = api.inspect(tmp_path / "granite.gguf")
    assert info["checkpoint"]["family"] == "granite"
    assert {layer["name"] for layer in info["layers"]} == {layer["name"] for layer in api.inspect(hf)["layers"]}
    assert len(info["layers"]) == n == 5  # 2 layers x (input, post_attention) + model.norm
    assert info["eps"]["value"] == f32(eps) and info["eps"]["source"].startswith("gguf:granite.attention.")
    assert api.check(hf, candidate_checkpoint=tmp_path / "granite.gguf", candidate="torch",
                     dtype="float32").passed
    _tiny_gguf(hf, tmp_path / "wrong.gguf", "granite", eps * 10)
    bad = api.check(hf, candidate_checkpoint=tmp_path / "wrong.gguf", candidate="torch", dtype="float32")
    assert not bad.passed


def _mmproj(hf, out, eps, baked=True):
    """A miniature of llama.cpp's Gemma 3 mmproj conversion (convert_hf_to_gguf.py's
    Gemma3VisionModel): general.architecture 'clip', the vision tower and projector only, names
    from the published layout (vision_tower.vision_model.) through gguf-py's MMPROJ map, eps as
    clip.vision.attention.layer_norm_epsilon, and 1 added to soft_emb_norm alone."""
    import json

    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((hf / "config.json").read_text())["vision_config"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, config["hidden_size"])
    # a lying file's eps may be of any type
    add = {str: w.add_string, list: w.add_array}.get(type(eps), w.add_float32)
    add(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, eps)
    for name, t in load_file(hf / "model.safetensors").items():
        if t.dim() != 1 or not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        base, suffix = name.rsplit(".", 1)
        mapped = names.get_name(base)
        if mapped is None:
            continue
        data = t.float().numpy().astype(np.float32)
        if "soft_emb_norm" in name and baked:
            data = data + 1
        w.add_tensor(f"{mapped}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gemma3_without_head(tmp_path):
    """A tiny Gemma 3 as its classes save it, without the SigLIP pooling head (Gemma 3 does not
    use it; llama.cpp's converter skips it)."""
    import json

    from safetensors.torch import load_file, save_file

    from parity_cli.model.derive import write_tiny_checkpoint

    hf = tmp_path / "gemma3"
    write_tiny_checkpoint("gemma3", hf)
    tensors = {k: v for k, v in load_file(hf / "model.safetensors").items() if ".head." not in k}
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["vision_config"]["vision_use_head"] = False
    (hf / "config.json").write_text(json.dumps(config))
    return hf, config["vision_config"]["layer_norm_eps"]


def test_an_mmproj_is_checked_against_the_towers_it_holds(tmp_path):
    """An mmproj holds the vision tower and projector of the model, not its language model: read
    as that model (the reference's family picks among gguf-py's names), compared tower by tower,
    its eps from clip.vision.*; a faithful one passes, and one whose converter wrote another eps or
    forgot the projector's + 1 is caught."""
    pytest.importorskip("transformers")
    hf, eps = _gemma3_without_head(tmp_path)
    _mmproj(hf, tmp_path / "mmproj.gguf", eps)
    report = api.check(hf, candidate_checkpoint=tmp_path / "mmproj.gguf", candidate="torch", dtype="float32")
    d = report.to_dict()
    assert {layer["tower"] for layer in d["layers"]} == {"vision", "projector"}
    assert len(d["layers"]) == 2 * 2 + 1 + 1  # 2 blocks x 2 LayerNorms, post_layernorm, mm_soft_emb_norm
    assert report.passed, [(layer.name, layer.findings) for layer in report.layers if not layer.passed]
    _mmproj(hf, tmp_path / "eps.gguf", eps * 10)
    assert not api.check(hf, candidate_checkpoint=tmp_path / "eps.gguf", candidate="torch", dtype="float32").passed
    _mmproj(hf, tmp_path / "unbaked.gguf", eps, baked=False)
    bad = api.check(hf, candidate_checkpoint=tmp_path / "unbaked.gguf", candidate="torch", dtype="float32")
    found = failing(bad)  # the projector's gain stored as w where the file should hold 1 + w
    assert list(found) == ["multi_modal_projector.mm_soft_emb_norm"], found
    assert found["multi_modal_projector.mm_soft_emb_norm"][0] == "fail", found
    assert "weight_offset_mismatch" in found["multi_modal_projector.mm_soft_emb_norm"][1], found


def test_an_mmproj_alone_names_what_it_needs(tmp_path):
    pytest.importorskip("transformers")
    hf, eps = _gemma3_without_head(tmp_path)
    _mmproj(hf, tmp_path / "mmproj.gguf", eps)
    r = run_parity("inspect", tmp_path / "mmproj.gguf")
    assert r.returncode == 2 and "mmproj" in r.stderr and "--candidate-checkpoint" in r.stderr
    info = api.inspect(tmp_path / "mmproj.gguf", family="gemma3")
    assert len(info["layers"]) == 6 and {layer["eps"]["value"] for layer in info["layers"]} == {f32(eps)}


def test_an_mmproj_eps_is_checked_where_the_model_code_fixes_the_towers_eps(tmp_path):
    """Qwen2.5-VL's vision norms are built with eps 1e-6 in code, no config key: the mmproj's one
    vision eps (clip.vision.attention.layer_norm_epsilon), which llama.cpp uses for each of them,
    is compared with it all the same."""
    pytest.importorskip("transformers")
    import json

    import numpy as np
    from safetensors.torch import load_file

    from parity_cli.model.derive import write_tiny_checkpoint

    hf = tmp_path / "qwen2_5_vl"
    write_tiny_checkpoint("qwen2_5_vl", hf)
    vision = json.loads((hf / "config.json").read_text())["vision_config"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])

    def write(out, eps):
        w = gguf.GGUFWriter(str(out), "clip")
        w.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, vision["hidden_size"])
        w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, eps)
        for name, t in load_file(hf / "model.safetensors").items():
            base, suffix = name.rsplit(".", 1)
            mapped = names.get_name(base.replace("model.visual.", "visual.", 1))
            if t.dim() == 1 and "visual" in name and mapped:
                w.add_tensor(f"{mapped}.{suffix}", t.float().numpy().astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "good.gguf", 1e-6)
    good = api.check(hf, candidate_checkpoint=tmp_path / "good.gguf", candidate="torch", dtype="float32")
    assert good.passed and {layer.tower for layer in good.layers} == {"vision"} and len(good.layers) == 5
    write(tmp_path / "bad.gguf", 1e-2)
    bad = api.check(hf, candidate_checkpoint=tmp_path / "bad.gguf", candidate="torch", dtype="float32")
    assert not bad.passed
    assert all("checkpoint_eps_mismatch" in {f["code"] for f in layer.findings} for layer in bad.layers)
    # no config key to pass through here: the tower's eps is refused where it is no eps
    for value in (float("nan"), -1e-6):
        write(tmp_path / "nan.gguf", value)
        with pytest.raises(InputError, match="layer_norm_epsilon must be a finite number > 0"):
            api.check(hf, candidate_checkpoint=tmp_path / "nan.gguf", candidate="torch", dtype="float32")


@pytest.mark.parametrize("eps,said", [(float("nan"), "finite number > 0"), (-1e-6, "finite number > 0"),
                                      (0.0, "finite number > 0"), (float("inf"), "finite number > 0"),
                                      ("1e-6", "a str, not a number"), ([1e-6], "an array, not a number")])
def test_an_mmproj_eps_that_is_no_eps_is_one_line(tmp_path, eps, said):
    """An mmproj's tower eps is used for every norm of that tower, without a config key to pass
    through: NaN, 0, a negative or infinite value, a string or an array is refused, naming the key."""
    pytest.importorskip("transformers")
    hf, _ = _gemma3_without_head(tmp_path)
    _mmproj(hf, tmp_path / "mmproj.gguf", eps)
    out = tmp_path / "r.json"
    r = run_parity("check", hf, "--candidate-checkpoint", tmp_path / "mmproj.gguf", "--json", out)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "clip.vision.attention.layer_norm_epsilon" in r.stderr and said in r.stderr
    assert not out.exists()


def test_a_float16_gemma_converted_as_llama_cpp_does_is_not_a_gain_mismatch(pair):
    """llama.cpp's converter forms a float16 checkpoint's 1 + w in float16 (it upcasts only other
    dtypes first): the stored gain is fl16(1 + w), up to half a float16 step at 1 + w (2^-11) from
    1 + w itself. Conversion parity allows that rounding, and still sees a gain moved by more."""
    import torch
    from safetensors.torch import load_file

    hf, g = pair("gemma3", dtype="float16", layers=1)
    w = load_file(hf / "model.safetensors")["model.norm.weight"]
    assert w.dtype == torch.float16
    rounded = (w + 1).double() - (w.double() + 1)  # what the float16 sum loses
    assert float(rounded.abs().max()) > 2.0 ** -24  # more than float32 rounding would: the case is real
    report = api.check(hf, candidate_checkpoint=g, candidate="torch")
    codes = {f["code"] for layer in report.to_dict()["layers"] for f in layer.get("findings", [])}
    assert report.passed and "checkpoint_weight_mismatch" not in codes
    _, moved = pair("gemma3", dtype="float16", layers=1, offset="twice")
    assert not api.check(hf, candidate_checkpoint=moved, candidate="torch").passed
