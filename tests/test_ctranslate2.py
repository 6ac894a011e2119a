"""Issue 51, CTranslate2: what `ct2-transformers-converter --model HF_DIR --output_dir OUT` writes (its
Python API, TransformersConverter), checked as a copy of the source checkpoint: `parity check SRC
--candidate-checkpoint OUT` reads CTranslate2's own model.bin (never as a pickle), maps its decoder
norms back to the checkpoint's names, takes the eps from its config.json (or the runtime's default
where the converter wrote none) and names the exporter.

The sources are tiny whole models transformers writes at bfloat16. The faults are the converter's
own (a Gemma 3 whose eps is not 1e-6) or planted into what it wrote, as a faulty converter would:
the eps in config.json, Gemma's `layer_norm_use_residual` flag cleared (the runtime then multiplies
by gamma, not 1 + gamma)."""

import json
import shutil
import struct

import pytest
from conftest import SLOW, all_pass, check_with_report, finding_codes, run_parity

pytest.importorskip("ctranslate2", reason="needs CTranslate2: pip install ctranslate2")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Factory: (source HF directory, the CTranslate2 directory converted from it), by model type and eps."""
    from ctranslate2.converters import TransformersConverter

    from parity_cli.sources.synthetic import write_runnable

    root = tmp_path_factory.mktemp("ct2")
    made = {}

    def get(model_type, eps):
        if (model_type, eps) not in made:
            src = write_runnable(root / f"{model_type}-{eps:g}", model_type, layers=2, hidden=64, eps=eps,
                                 dtype="bfloat16", tokenizer=True)
            out = TransformersConverter(str(src)).convert(str(root / f"{model_type}-{eps:g}-ct2"), force=True)
            made[model_type, eps] = (src, root / f"{model_type}-{eps:g}-ct2")
            assert str(made[model_type, eps][1]) == str(out)
        return made[model_type, eps]

    return get


@pytest.mark.parametrize("model_type, eps, layers", [("llama", 1e-5, 5), ("gemma3_text", 1e-6, 13)])
def test_a_faithful_conversion_passes(converted, tmp_path, model_type, eps, layers):
    src, copy = converted(model_type, eps)
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    assert r.returncode == 0 and all_pass(data), r.stdout[-3000:] + r.stderr
    described = data["candidate"]["checkpoint"]
    assert described["format"] == "ctranslate2"
    assert described["exporter"] == "CTranslate2's converter (TransformerDecoderSpec)"
    assert described["findings"] == 0 and len(data["layers"]) == layers
    assert described["eps"]["value"] == eps


def test_the_converter_writes_no_eps_for_gemma_3_and_the_runtime_takes_1e_6(converted, tmp_path):
    """CTranslate2 4.8.5's Gemma3Loader never sets layer_norm_epsilon: config.json says null whatever
    the model's rms_norm_eps, and the runtime then uses 1e-6. A Gemma 3 trained at 1e-5 is converted
    into a model that computes at 1e-6: every norm fails with the eps named, and where it came from."""
    src, copy = converted("gemma3_text", 1e-5)
    assert json.loads((copy / "config.json").read_text())["layer_norm_epsilon"] is None
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    assert r.returncode == 1
    codes = finding_codes(data)
    assert all({"eps_mismatch", "checkpoint_eps_mismatch"} <= layer for layer in codes), codes
    eps = data["candidate"]["checkpoint"]["eps"]
    assert eps["value"] == 1e-6 and "default" in eps["source"] and "null" in eps["source"]


def test_the_runtime_computes_at_1e_6_where_the_config_says_null(converted, tmp_path):
    """The default, through CTranslate2's own Generator and nothing of parity's: a Llama whose
    embeddings are scaled to 1e-4 (so eps dominates the first norm) gives the same logits with
    config.json's eps null as with 1e-6, and other logits with 1e-5."""
    import ctranslate2
    import numpy as np

    src, _ = converted("llama", 1e-5)
    at = _scaled_conversion(src, tmp_path, lambda name: name == "model.embed_tokens.weight")

    def logits(eps):
        generator = ctranslate2.Generator(at(eps), device="cpu", compute_type="float32")
        return np.array(generator.forward_batch([["<s>", "w1", "w2", "w3"]]))

    null, at_1e6, at_1e5 = logits(None), logits(1e-6), logits(1e-5)
    assert np.array_equal(null, at_1e6) and np.abs(null - at_1e5).max() > 0.01

def _scaled_conversion(src, tmp_path, scaled):
    """src copied with the embedding tables `scaled` names multiplied by 1e-4 (so that eps dominates
    the first norm), converted by CTranslate2: a function eps -> the converted directory with
    config.json's layer_norm_epsilon set to eps."""
    import ctranslate2
    from safetensors.torch import load_file, save_file

    small = tmp_path / "small"
    shutil.copytree(src, small)
    tensors = load_file(small / "model.safetensors")
    tensors = {k: (v.float() * 1e-4).to(v.dtype) if scaled(k) else v for k, v in tensors.items()}
    save_file(tensors, small / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "small-ct2"
    ctranslate2.converters.TransformersConverter(str(small)).convert(str(out), force=True)

    def at(eps):
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": eps}))
        return str(out)

    return at


@pytest.fixture
def planted(converted, tmp_path):
    def plant(model_type, eps, fault):
        src, copy = converted(model_type, eps)
        out = tmp_path / f"{model_type}-{fault}"
        shutil.copytree(copy, out)
        if fault == "eps":
            config = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-6}))
        else:  # every layer_norm_use_residual flag cleared: gamma alone, Gemma's + 1 dropped
            from parity_cli.sources.ctranslate2 import read_variables

            _, variables = read_variables(out / "model.bin")
            with open(out / "model.bin", "r+b") as f:
                for name, var in variables.items():
                    if name.endswith("/layer_norm_use_residual"):
                        f.seek(var.offset)
                        f.write(b"\x00")
        return src, out

    return plant


@pytest.mark.parametrize("model_type, eps, fault, code, shift", [
    ("llama", 1e-5, "eps", "eps_mismatch", None),
    ("gemma3_text", 1e-6, "residual", "weight_offset_mismatch", -1.0),
])
def test_a_fault_planted_in_the_converted_model_is_named(planted, tmp_path, model_type, eps, fault, code, shift):
    src, copy = planted(model_type, eps, fault)
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    assert r.returncode == 1 and all(code in codes for codes in finding_codes(data)), finding_codes(data)
    if shift is not None:
        finding = next(f for f in data["layers"][0]["findings"] if f["code"] == "checkpoint_weight_mismatch")
        assert finding["uniform_shift"] == shift


def _model_bin(variables: list, aliases: tuple = ()) -> bytes:
    """A model.bin as CTranslate2 serialises one (model_spec._serialize): variables (name, shape, type
    id, bytes), then aliases (alias, variable)."""
    def string(s):
        return struct.pack("<H", len(s) + 1) + s.encode() + b"\0"

    out = struct.pack("<I", 6) + string("TransformerDecoderSpec") + struct.pack("<II", 1, len(variables))
    for name, shape, type_id, data in variables:
        out += string(name) + struct.pack("<B", len(shape)) + b"".join(struct.pack("<I", d) for d in shape)
        out += struct.pack("<BI", type_id, len(data)) + data
    out += struct.pack("<I", len(aliases))
    return out + b"".join(string(a) + string(t) for a, t in aliases)


ONES, TWOS = struct.pack("<64f", *([1.0] * 64)), struct.pack("<64f", *([2.0] * 64))
GAIN = "decoder/layer_norm/gamma"


@pytest.mark.parametrize("label, variables, aliases, words", [
    # CTranslate2 keeps the first of a name registered twice: reading the second checks a gain it never uses
    ("a gain stored twice", [(GAIN, (64,), 0, ONES), (GAIN, (64,), 0, TWOS)], (), "stored twice"),
    ("an alias shadowing a gain", [(GAIN, (64,), 0, ONES), ("other/gamma", (64,), 0, TWOS)],
     ((GAIN, "other/gamma"),), "also a variable's name"),
    # the flag is an int8 scalar: as a float32 1.0 its first byte is 0, and it would read as unset
    ("a flag stored as float32", [(GAIN, (64,), 0, ONES),
                                  ("decoder/layer_norm/layer_norm_use_residual", (), 0, struct.pack("<f", 1.0))],
     (), "CTranslate2 writes the flag as one int8"),
    ("a gain past the end, its shape consistent", [(GAIN, (1 << 28,), 0, b"")], (), "corrupt or truncated"),
])
def test_a_lying_model_bin_is_one_line(converted, tmp_path, label, variables, aliases, words):
    src, _ = converted("llama", 1e-5)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({"layer_norm_epsilon": 1e-5}))
    raw = _model_bin([(n, shape, t, data) for n, shape, t, data in variables], aliases)
    if label.startswith("a gain past the end"):  # declares 2^30 bytes it does not hold
        raw = raw.replace(struct.pack("<BI", 0, 0), struct.pack("<BI", 0, 1 << 30), 1)
    (copy / "model.bin").write_bytes(raw)
    r = run_parity("check", src, "--candidate-checkpoint", copy)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0] and "model.bin" in lines[0], (label, r.stderr)


def test_a_use_residual_flag_on_a_layer_norm_adds_nothing(tmp_path):
    """CTranslate2 hands the flag to its RMSNorm only: on a norm with a beta (a LayerNorm) the gain the
    runtime multiplies by is gamma, whatever the flag says."""
    from parity_cli.sources.ctranslate2 import open_ctranslate2

    (tmp_path / "config.json").write_text(json.dumps({"layer_norm_epsilon": 1e-5}))
    scope = "encoder/layernorm_embedding"
    raw = _model_bin([(f"{scope}/gamma", (64,), 0, ONES), (f"{scope}/beta", (64,), 0, struct.pack("<64f", *[0.0] * 64)),
                      (f"{scope}/layer_norm_use_residual", (), 1, b"\x01")])
    (tmp_path / "model.bin").write_bytes(raw.replace(b"TransformerDecoderSpec", b"TransformerEncoderSpec"))
    ckpt = open_ctranslate2(tmp_path, (None, "bert"))
    assert ckpt.read("embeddings.LayerNorm.weight").tolist() == [1.0] * 64


@pytest.mark.parametrize("eps, words", [
    (0, "must be a finite number > 0"), (-1e-5, "must be a finite number > 0"),
    ("NaN", "must be a finite number > 0"), ("1e999", "must be a finite number > 0"),
    ("9" * 400, "must be a finite number > 0"),
])
def test_an_eps_no_runtime_can_take_is_one_line(converted, tmp_path, eps, words):
    """config.json's layer_norm_epsilon is the runtime's one eps: 0, a negative, NaN, an infinity (1e999
    in JSON) and a 400-digit integer are each refused in one line naming the key, as a checkpoint's own."""
    src, made = converted("llama", 1e-5)
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)
    config = json.loads((copy / "config.json").read_text())
    text = json.dumps({**config, "layer_norm_epsilon": "EPS"}).replace('"EPS"', str(eps))
    (copy / "config.json").write_text(text)
    r = run_parity("check", src, "--candidate-checkpoint", copy)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0] and "layer_norm_epsilon" in lines[0], r.stderr


def test_a_model_bin_shorter_than_its_header_is_not_taken_for_one(tmp_path):
    """A model.bin whose spec name runs past its end: not CTranslate2's (before, an IndexError)."""
    from parity_cli.sources.ctranslate2 import is_ctranslate2

    (tmp_path / "model.bin").write_bytes(struct.pack("<IH", 6, 30) + b"abSpec")
    assert is_ctranslate2(tmp_path) is False
    (tmp_path / "model.bin").write_bytes(_model_bin([(GAIN, (64,), 0, ONES)]))
    assert is_ctranslate2(tmp_path) is True


@pytest.mark.parametrize("label, edit, words", [
    ("truncated", lambda b: b[:-20], "truncated"),
    ("bytes past the end", lambda b: b.replace(struct.pack("<BI", 0, 256), struct.pack("<BI", 0, 1 << 30)), "corrupt"),
    ("a rank of 200", lambda b: b.replace(struct.pack("<B", 1) + struct.pack("<I", 64), struct.pack("<B", 200), 1),
     "rank 200"),
])
def test_a_corrupt_model_bin_is_one_line(converted, tmp_path, label, edit, words):
    from parity_cli.sources.ctranslate2 import read_variables

    src, _ = converted("llama", 1e-5)
    good = _model_bin([("decoder/layer_norm/gamma", (64,), 0, struct.pack("<64f", *([1.0] * 64)))])
    (tmp_path / "good.bin").write_bytes(good)  # the file each case edits reads as written
    spec, variables = read_variables(tmp_path / "good.bin")
    assert spec == "TransformerDecoderSpec" and variables["decoder/layer_norm/gamma"].shape == (64,)
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps({"layer_norm_epsilon": 1e-5}))
    (copy / "model.bin").write_bytes(edit(good))
    r = run_parity("check", src, "--candidate-checkpoint", copy)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0] and "model.bin" in lines[0], (label, r.stderr)


@pytest.mark.parametrize("command", ["check", "inspect"])
def test_a_ctranslate2_model_alone_is_refused_in_one_line_naming_how_to_check_it(converted, command):
    _, copy = converted("llama", 1e-5)
    r = run_parity(command, copy)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"--candidate-checkpoint {copy}" in lines[0], r.stderr


def test_gains_equal_to_one_another_are_read_through_the_aliases_the_converter_writes(converted, tmp_path):
    """CTranslate2 stores a variable equal to another once and the others as aliases: a Llama whose
    norms all hold ones (as a fresh model's do) has one gain variable and four aliases of it."""
    import torch
    from ctranslate2.converters import TransformersConverter
    from safetensors.torch import load_file, save_file

    from parity_cli.sources.ctranslate2 import read_variables

    src, _ = converted("llama", 1e-5)
    ones = tmp_path / "ones"
    shutil.copytree(src, ones)
    tensors = load_file(ones / "model.safetensors")
    tensors = {k: torch.ones_like(v) if k.endswith("norm.weight") else v for k, v in tensors.items()}
    save_file(tensors, ones / "model.safetensors", metadata={"format": "pt"})
    out = TransformersConverter(str(ones)).convert(str(tmp_path / "ones-ct2"))
    _, variables = read_variables(tmp_path / "ones-ct2" / "model.bin")
    gains = [v for name, v in variables.items() if name.endswith("gamma")]
    assert len(gains) == 5 and len({v.offset for v in gains}) == 1  # one stored, four aliases of it
    r, data = check_with_report(tmp_path, ones, "--candidate-checkpoint", out)
    assert r.returncode == 0 and all_pass(data) and len(data["layers"]) == 5, r.stdout[-2000:]


@pytest.mark.parametrize("case, words", [
    ("config.json a FIFO", "not a regular file"),
    ("eps not a number", "must be a finite number > 0"),
    ("model.bin outside", "outside the checkpoint directory"),
])
def test_a_hostile_ctranslate2_directory_is_one_line(converted, tmp_path, case, words):
    """What the directory around model.bin may lie with: a config.json that would block the first
    read (before, a FIFO was skipped as absent and the default eps taken), an eps that is text, a
    model.bin that is a link to a file elsewhere."""
    import os

    src, made = converted("llama", 1e-5)
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)
    if case == "config.json a FIFO":
        (copy / "config.json").unlink()
        os.mkfifo(copy / "config.json")
    elif case == "eps not a number":
        (copy / "config.json").write_text(json.dumps({"layer_norm_epsilon": "1e-5"}))
    else:
        elsewhere = tmp_path / "elsewhere.bin"
        (copy / "model.bin").rename(elsewhere)
        (copy / "model.bin").symlink_to(elsewhere)
    r = run_parity("check", src, "--candidate-checkpoint", copy)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0], (case, r.stderr)
    assert "Traceback" not in r.stderr


# --- encoders: BERT (TransformerEncoderSpec) and Whisper (WhisperSpec) -------------------------------


def _edit_model_bin(model_bin, edit) -> None:
    """edit(variables) -> {name: new bytes}: written in place, each the variable's own size."""
    from parity_cli.sources.ctranslate2 import read_variables

    _, variables = read_variables(model_bin)
    with open(model_bin, "r+b") as f:
        for name, data in edit(variables).items():
            assert len(data) == variables[name].nbytes, name
            f.seek(variables[name].offset)
            f.write(data)


def _read(model_bin, var) -> bytes:
    with open(model_bin, "rb") as f:
        f.seek(var.offset)
        return f.read(var.nbytes)


@pytest.mark.parametrize("model_type, eps, spec, layers, eps_source", [
    # BERT's 1e-12, which the converter writes into config.json
    ("bert", 1e-12, "TransformerEncoderSpec", 5, "config.json layer_norm_epsilon"),
    # Whisper's code fixes nn.LayerNorm's 1e-5; the converter writes no eps and the runtime takes its
    # LayerNorm default, 1e-5 (layers/common.cc): the two agree
    ("whisper", 1e-5, "WhisperSpec", 12, "the runtime's default for a LayerNorm"),
    # OpenNMT's own use: translation models, post-norm; BART with its embeddings' norms
    ("bart", 1e-5, "TransformerSpec", 12, "the runtime's default for a LayerNorm"),
    ("marian", 1e-5, "TransformerSpec", 10, "the runtime's default for a LayerNorm"),
    # GPT-2: a pre-norm decoder of LayerNorms; the converter writes no eps, the runtime's 1e-5 is GPT-2's
    pytest.param("gpt2", 1e-5, "TransformerDecoderSpec", 5, "the runtime's default for a LayerNorm", marks=SLOW),
    pytest.param("opt", 1e-5, "TransformerDecoderSpec", 5, "the runtime's default for a LayerNorm", marks=SLOW),
    # Falcon's three decoders (one shared LayerNorm a layer in 7B's, ln_attn and ln_mlp in 40B's, two in
    # sequence): no eps written, the runtime's 1e-5 is Falcon's default
    pytest.param("falcon", 1e-5, "TransformerDecoderSpec", 3, "the runtime's default for a LayerNorm", marks=SLOW),
    pytest.param("falcon_2ln", 1e-5, "TransformerDecoderSpec", 5, "the runtime's default for a LayerNorm",
                 marks=SLOW),
    pytest.param("falcon_seq", 1e-5, "TransformerDecoderSpec", 5, "the runtime's default for a LayerNorm",
                 marks=SLOW),
    # T5's RMSNorms: no eps written, the runtime's RMSNorm default 1e-6 is T5's (checked as RMSNorms below)
    pytest.param("t5", 1e-6, "TransformerSpec", 12, "the runtime's default for an RMSNorm", marks=SLOW),
])
def test_a_faithful_encoder_conversion_passes(converted, tmp_path, model_type, eps, spec, layers, eps_source):
    src, copy = converted(model_type, eps)
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    assert r.returncode == 0 and all_pass(data), r.stdout[-3000:] + r.stderr
    described = data["candidate"]["checkpoint"]
    assert described["exporter"] == f"CTranslate2's converter ({spec})"
    assert described["findings"] == 0 and len(data["layers"]) == layers
    assert described["eps"]["value"] == eps and eps_source in described["eps"]["source"]
    kind = "rms_norm" if model_type == "t5" else "layer_norm"
    assert all(layer["kind"] == kind for layer in data["layers"])


def _zero_betas(variables):
    return {name: bytes(var.nbytes) for name, var in variables.items() if name.endswith("/beta")}


def _swap_first_two_gains(model_bin):
    def edit(variables):
        a, b = (variables[f"encoder/layer_0/{part}/layer_norm/gamma"] for part in ("self_attention", "ffn"))
        return {"encoder/layer_0/self_attention/layer_norm/gamma": _read(model_bin, b),
                "encoder/layer_0/ffn/layer_norm/gamma": _read(model_bin, a)}
    return edit


@pytest.mark.parametrize("model_type, eps, fault, layer, codes", [
    # a converter that writes no eps for BERT: the runtime then takes 1e-5, not BERT's 1e-12
    ("bert", 1e-12, "eps null", "embeddings.LayerNorm", {"eps_mismatch", "checkpoint_eps_mismatch"}),
    ("bert", 1e-12, "betas zeroed", "embeddings.LayerNorm", {"checkpoint_bias_mismatch"}),
    # Whisper run at an RMSNorm's default
    ("whisper", 1e-5, "eps 1e-6", "model.encoder.layer_norm", {"eps_mismatch", "checkpoint_eps_mismatch"}),
    ("whisper", 1e-5, "gains swapped", "model.encoder.layers.0.self_attn_layer_norm",
     {"checkpoint_weight_mismatch", "checkpoint_gain_of_other_layer"}),
    ("marian", 1e-5, "eps 1e-6", "model.decoder.layers.1.final_layer_norm",
     {"eps_mismatch", "checkpoint_eps_mismatch"}),
    # GPT-2 at an RMSNorm's default, and its LayerNorms' betas dropped
    pytest.param("gpt2", 1e-5, "eps 1e-6", "transformer.h.1.ln_2", {"eps_mismatch", "checkpoint_eps_mismatch"},
                 marks=SLOW),
    pytest.param("gpt2", 1e-5, "betas zeroed", "transformer.ln_f", {"checkpoint_bias_mismatch"}, marks=SLOW),
    pytest.param("opt", 1e-5, "eps 1e-6", "model.decoder.final_layer_norm", {"eps_mismatch", "checkpoint_eps_mismatch"},
                 marks=SLOW),
    # Falcon-40B's ln_attn betas dropped; Falcon-7B's shared norm run at an RMSNorm's default
    pytest.param("falcon_2ln", 1e-5, "betas zeroed", "transformer.h.0.ln_attn", {"checkpoint_bias_mismatch"},
                 marks=SLOW),
    pytest.param("falcon", 1e-5, "eps 1e-6", "transformer.h.1.input_layernorm",
                 {"eps_mismatch", "checkpoint_eps_mismatch"}, marks=SLOW),
    # a converter that writes a LayerNorm's 1e-5 for T5's RMSNorms (trained at 1e-6)
    pytest.param("t5", 1e-6, "eps 1e-5", "encoder.final_layer_norm", {"eps_mismatch", "checkpoint_eps_mismatch"},
                 marks=SLOW),
])
def test_a_fault_planted_in_a_converted_encoder_is_named(converted, tmp_path, model_type, eps, fault, layer, codes):
    src, made = converted(model_type, eps)
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)
    config = json.loads((copy / "config.json").read_text())
    if fault.startswith("eps"):
        (copy / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": None if fault == "eps null"
                                                      else float(fault.split()[1])}))
    else:
        _edit_model_bin(copy / "model.bin", _zero_betas if fault == "betas zeroed" else
                        _swap_first_two_gains(copy / "model.bin"))
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    found = dict(zip((entry["name"] for entry in data["layers"]), finding_codes(data)))
    assert r.returncode == 1 and codes <= found[layer], (fault, found)
    if fault == "eps null":
        eps = data["candidate"]["checkpoint"]["eps"]
        assert eps["value"] == 1e-5 and "default for a LayerNorm" in eps["source"] and "null" in eps["source"]


@SLOW
def test_the_converter_writes_no_eps_for_falcon_so_one_trained_at_1e_6_runs_at_1e_5(converted, tmp_path):
    """CTranslate2 4.8.5's Falcon loader sets no layer_norm_epsilon (config.json: null), so the runtime
    takes its LayerNorm default, 1e-5: Falcon's own default, but not a Falcon-architecture model's
    trained at 1e-6. Every layer fails, behaving as 1e-5, with the eps's source named."""
    src, copy = converted("falcon", 1e-6)
    assert json.loads((copy / "config.json").read_text())["layer_norm_epsilon"] is None
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy)
    assert r.returncode == 1 and len(data["layers"]) == 3, r.stderr
    assert all({"eps_mismatch", "checkpoint_eps_mismatch"} <= codes for codes in finding_codes(data))
    eps = data["candidate"]["checkpoint"]["eps"]
    assert eps["value"] == 1e-5 and "default for a LayerNorm" in eps["source"] and "null" in eps["source"]


@SLOW
def test_the_converter_cannot_convert_a_falcon_40b_config_that_leaves_multi_query_at_its_default(converted, tmp_path):
    """A fact of CTranslate2 4.8.5's converter, on its own API: Falcon-40B's layout
    (new_decoder_architecture, num_kv_heads) with multi_query left at FalconConfig's default, True
    (transformers ignores it under the new architecture), is read as a multi-query model whose layers
    share one norm, and the converter fails on the layer's ln_attn. Nothing is written to check."""
    from ctranslate2.converters import TransformersConverter

    src, _ = converted("falcon_2ln", 1e-5)
    model = tmp_path / "falcon-40b-layout"
    shutil.copytree(src, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("multi_query")
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttributeError, match="has no attribute 'input_layer_norm'"):
        TransformersConverter(str(model)).convert(str(tmp_path / "out"), force=True)
    assert not (tmp_path / "out" / "model.bin").exists()


def test_the_runtime_computes_a_layer_norm_at_1e_5_where_the_config_says_null(converted, tmp_path):
    """The LayerNorm default, through CTranslate2's own Encoder and nothing of parity's: a BERT whose
    embeddings are scaled to 1e-4 (so eps dominates the embeddings' LayerNorm) gives the same hidden
    states with config.json's eps null as with 1e-5, and others with BERT's 1e-12."""
    import ctranslate2
    import numpy as np

    src, _ = converted("bert", 1e-12)
    at = _scaled_conversion(src, tmp_path, lambda name: name.endswith("_embeddings.weight"))

    def hidden(eps):
        encoder = ctranslate2.Encoder(at(eps), device="cpu", compute_type="float32")
        return np.array(encoder.forward_batch([["<s>", "w1", "w2", "w3"]]).last_hidden_state)

    null, at_1e5, at_1e12 = hidden(None), hidden(1e-5), hidden(1e-12)
    assert np.array_equal(null, at_1e5) and np.abs(null - at_1e12).max() > 0.01
