"""Issue 17: real activations — capture what the norms see from a real (tiny, random-weight)
transformers model, probe with them, and say what an eps fault does to them."""

import re
import shutil
from pathlib import Path

import pytest
from conftest import SLOW, load_json, run_parity

transformers = pytest.importorskip("transformers")


def _tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0], pad_token=words[1])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("m") / "llama"
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-6)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    _tokenizer(["<unk>", "<pad>"] + [f"w{i}" for i in range(98)]).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("m") / "bert"
    cfg = BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=100, layer_norm_eps=1e-12)
    BertModel(cfg).save_pretrained(d, safe_serialization=True)
    _tokenizer(["[UNK]", "[PAD]"] + [f"w{i}" for i in range(98)]).save_pretrained(d)
    return d


TEXT = " ".join(f"w{(7 * i) % 98}" for i in range(300))


def _all_inputs(model_dir, layer_name, text):
    """Every row the layer sees, collected by the test's own hook on the model transformers loads."""
    import torch
    import transformers as tf
    from transformers import AutoTokenizer

    cfg = tf.AutoConfig.from_pretrained(model_dir)
    model = getattr(tf, cfg.architectures[0]).from_pretrained(model_dir).eval()
    rows = []
    module = dict(model.named_modules()).get(layer_name) or dict(model.named_modules())[layer_name.removeprefix("model.")]
    h = module.register_forward_pre_hook(lambda m, a: rows.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    ids = AutoTokenizer.from_pretrained(model_dir)(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    return torch.cat(rows).double()


@pytest.mark.parametrize("which", ["llama", "bert"])
def test_capture_sees_every_norm_and_keeps_the_smallest_rows(which, llama, bert, tmp_path):
    import torch
    from safetensors import safe_open

    from parity_cli import api
    from parity_cli.model.layers import discover_layers

    model = {"llama": llama, "bert": bert}[which]
    out = tmp_path / "acts.safetensors"
    r = run_parity("capture", model, "--prompt", TEXT, "--rows-per-layer", "12", "-o", out)
    assert r.returncode == 0, r.stderr
    ckpt, fam, eps = api.load(model)
    names = {l.name for l in discover_layers(ckpt, fam, eps).layers}
    with safe_open(str(out), framework="pt") as fh:
        assert {k for k in fh.keys() if not k.startswith("norm:")} == names  # every norm layer was hooked
        rows = {n: fh.get_tensor(n).double() for n in names}
    first = sorted(names)[0]
    seen = _all_inputs(model, first, TEXT)
    kind_mean = seen.mean(-1, keepdim=True) if which == "bert" else 0.0
    q = ((seen - kind_mean) ** 2).mean(-1)
    smallest = seen[torch.argsort(q)[:4]]  # the 4 (= 12 // 3) smallest-q rows of the whole text
    kept = rows[first]
    assert kept.shape[0] <= 12 and seen.shape[0] == 300
    for row in smallest:
        assert torch.isclose(kept, row, rtol=0, atol=1e-6).all(-1).any()


def test_an_eps_fault_on_real_rows_matches_a_float64_recomputation(llama, tmp_path):
    import torch
    from safetensors import safe_open

    out = tmp_path / "acts.safetensors"
    assert run_parity("capture", llama, "--prompt", TEXT, "--rows-per-layer", "30", "-o", out).returncode == 0
    rep = tmp_path / "r.json"
    r = run_parity("check", llama, "--candidate-eps", "1e-5", "--activations", out, "--json", rep)
    assert r.returncode == 1 and "real rows (" in r.stdout
    data = load_json(rep)
    assert "captured" in data["probes"]["strata"]
    from safetensors.torch import load_file

    weights = load_file(str(llama / "model.safetensors"))
    with safe_open(str(out), framework="pt") as fh:
        rows = {n: fh.get_tensor(n).double() for n in fh.keys() if not n.startswith("norm:")}
    for layer in data["layers"]:
        cap = layer["captured"]
        (diag,) = [d for d in layer["diagnoses"] if d["code"] == "eps_mismatch"]
        est = diag["estimated_eps"]
        x = rows[layer["name"]].float().double()  # rounded to the candidate dtype (float32), as every probe
        g = weights[layer["name"] + ".weight"].double()

        def norm(e, x=x, g=g):
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + e) * g

        y, alt = norm(1e-6), norm(est)
        move = (alt - y).abs().amax(-1) / y.abs().amax(-1)
        (impact,) = cap["impact"]
        assert impact["share_over_rtol"] == pytest.approx(float((move > 1.3e-6).double().mean()))
        assert impact["share_over_1pct"] == pytest.approx(float((move > 0.01).double().mean()))
        assert impact["worst_row"]["move"] == pytest.approx(float(move.max()), rel=1e-9)
        q_eps = (x * x).mean(-1) / 1e-6
        assert cap["q_over_eps"]["min"] == pytest.approx(float(q_eps.min()), rel=1e-9)
        assert cap["q_over_eps"]["below_1pct_budget"] == pytest.approx(float((q_eps < 49.2512562814).double().mean()))


def test_a_capture_of_another_model_is_refused(llama, bert, tmp_path):
    out = tmp_path / "acts.safetensors"
    assert run_parity("capture", bert, "--prompt", "w1 w2 w3", "-o", out).returncode == 0
    r = run_parity("check", llama, "--activations", out)
    assert r.returncode == 2 and "captured from another model" in r.stderr and len(r.stderr.splitlines()) == 1


def test_rows_stay_bounded_by_k_whatever_the_tokens(llama):
    from parity_cli.probes.capture import capture

    for tokens in (30, 400):  # in-process: the sample, not the command, is under test here
        rows, meta = capture(llama, TEXT + " " + TEXT, max_tokens=tokens, rows_per_layer=9)
        rows = {n: t for n, t in rows.items() if not n.startswith("norm:")}  # the rows, not the norms
        assert meta["tokens"] == tokens and all(1 <= t.shape[0] <= 9 for t in rows.values())

def _write_gguf(hf, out, embedding_length=None, head_count_kv=None, nan_in=None, quantized=False, block_count=None):
    """A whole tiny Llama as a GGUF transformers can dequantize: llama.cpp's tensor names (gguf-py's
    map), its metadata keys, and a gpt2-style byte-level BPE vocabulary with merges.
    `embedding_length` writes another width in the metadata than the tensors have, `head_count_kv`
    another count of key/value heads, `nan_in` a NaN into the first value of that HF tensor;
    `quantized` stores every matrix as Q8_0 (gguf-py's quantizer), the norms as F32; `block_count` another
    count of blocks in the metadata than the tensors hold."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.load(open(f"{hf}/config.json"))
    sd = load_file(f"{hf}/model.safetensors")
    L = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(block_count or L); w.add_context_length(cfg["max_position_embeddings"]); w.add_embedding_length(embedding_length or cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"]); w.add_head_count(cfg["num_attention_heads"]); w.add_head_count_kv(cfg["num_key_value_heads"] if head_count_kv is None else head_count_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"]); w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(cfg["vocab_size"]); w.add_file_type(0)
    # a byte-level BPE vocabulary as llama.cpp writes for gpt2-style tokenizers: "Ġw12" = Ġ + w + 1 + 2 merged
    chars = ["Ġ", "w"] + [str(d) for d in range(10)]
    merges, words = ["Ġ w"], ["<|endoftext|>"] + chars + ["Ġw"]
    for i in range(40):
        nxt = f"Ġw{i}"
        if i >= 10:
            merges.append(f"Ġw{i // 10} {i % 10}") if f"Ġw{i // 10}" in words else None
        else:
            merges.append(f"Ġw {i}")
        words.append(nxt)
    words += [f"<pad{k}>" for k in range(cfg["vocab_size"] - len(words))]
    w.add_tokenizer_model("gpt2"); w.add_token_list(words); w.add_token_merges(merges)
    w.add_token_types([3] + [1] * (len(words) - 1)); w.add_bos_token_id(0); w.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, L)
    for k, t in sd.items():
        base = k[: -len(".weight")]
        g = names.get_name(base)
        if g is None:
            continue
        a = t.float().numpy().copy()
        if k == nan_in:
            a.flat[0] = float("nan")
        if quantized and a.ndim == 2:
            w.add_tensor(f"{g}.weight", gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{g}.weight", a)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    return out


def test_capture_from_a_gguf(llama, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from safetensors import safe_open

    from parity_cli import api
    from parity_cli.model.layers import discover_layers

    path = _write_gguf(llama, tmp_path / "tiny.gguf")
    out = tmp_path / "acts.safetensors"
    r = run_parity("capture", path, "--prompt", " " + " ".join(f"w{i % 40}" for i in range(200)), "-o", out)
    assert r.returncode == 0, r.stderr
    ckpt, fam, eps = api.load(path)
    names = {l.name for l in discover_layers(ckpt, fam, eps).layers}
    with safe_open(str(out), framework="pt") as fh:
        assert {k for k in fh.keys() if not k.startswith("norm:")} == names
        assert all(fh.get_tensor(n).shape[0] > 3 for n in names)
    r = run_parity("check", path, "--activations", out, "--candidate-eps", "1e-5", "-q")
    assert r.returncode == 1 and "eps_mismatch" in r.stdout


def test_hostile_captures_and_texts_are_one_line(llama, tmp_path):
    """A FIFO would block the read forever; junk, another file's metadata and rows of the wrong
    width are refused in one line, before any layer runs."""
    import os

    import torch
    from safetensors.torch import save_file

    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 8 + b"{not json")
    plain = tmp_path / "plain.safetensors"  # a safetensors file, but no capture's metadata
    save_file({"model.norm": torch.zeros(3, 64)}, str(plain))
    nested = tmp_path / "nested.safetensors"
    save_file({"model.norm": torch.zeros(3, 64)}, str(nested), metadata={"parity": "[" * 100000})
    for path, words in ((fifo, "not a regular file"), (junk, "not a readable safetensors capture"),
                        (plain, "not a parity capture"), (nested, "metadata")):
        r = run_parity("check", llama, "--activations", path)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.splitlines()) == 1, (path, r.stderr)
    text = tmp_path / "pipe.txt"
    os.mkfifo(text)
    r = run_parity("capture", llama, "--text", text, "-o", tmp_path / "a.safetensors")
    assert r.returncode == 2 and "not a regular file" in r.stderr and not (tmp_path / "a.safetensors").exists()


def test_rows_of_the_wrong_width_are_refused(llama, tmp_path):
    import torch

    bad = _capture_file(llama, tmp_path, "wide.safetensors", {"model.norm": torch.zeros(3, 65)})  # the width is 64
    r = run_parity("check", llama, "--activations", bad)
    assert r.returncode == 2 and "model.norm holds [3, 65]" in r.stderr and "rows of 64" in r.stderr


def _capture_file(llama, tmp_path, name, rows: dict, gain_scale: float = 1.0, **meta_extra):
    """A capture file of this model holding `rows`, written by the test as `parity capture` writes one:
    its fingerprint, and the norm tensors it was made with beside the rows (`gain_scale` times them:
    another model's norms under this model's fingerprint)."""
    import json

    from safetensors.torch import save_file

    from parity_cli import api
    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(llama)
    layers = discover_layers(ckpt, fam, eps).layers
    norms = {f"norm:weight:{layer.name}": (layer.weight.float() * gain_scale).contiguous() for layer in layers}
    meta = {"fingerprint": fingerprint(layers)["sha256"],
            "norms": {layer.name: {"dtype": str(layer.weight.dtype).removeprefix("torch."),
                                   "shape": list(layer.weight.shape), "gain_offset": layer.gain_offset}
                      for layer in layers}, **meta_extra}
    path = tmp_path / name
    save_file({**rows, **norms}, str(path), metadata={"parity": json.dumps(meta)})
    return path


def test_a_capture_that_claims_this_model_over_another_s_norms_is_refused(llama, tmp_path):
    """Its metadata fingerprint is this model's, the norms it carries are another's (x 1.5): the match
    is computed from the tensors carried, never read from what the file says about itself (it was
    accepted as "exact: the same norm tensors")."""
    import torch

    rows = {"model.norm": torch.randn(3, 64, generator=torch.Generator().manual_seed(0))}
    honest = _capture_file(llama, tmp_path, "honest.safetensors", rows)
    r = run_parity("check", llama, "--activations", honest, "--json", tmp_path / "ok.json")
    # the honest capture of a correct model, the default candidate: a pass, the match stated
    assert r.returncode == 0 and "exact: the same norm tensors" in (tmp_path / "ok.json").read_text(), r.stderr
    forged = _capture_file(llama, tmp_path, "forged.safetensors", rows, gain_scale=1.5)
    r = run_parity("check", llama, "--activations", forged)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "captured from another model" in r.stderr and "weight differs by up to" in r.stderr, r.stderr


def test_hostile_rows_are_refused_or_left_out(llama, tmp_path):
    """NaN rows have no q: refused in one line. Rows past float16's range (6.55e4) become inf
    when rounded for a float16 candidate: the layer cannot run at float16 on its own traffic, which
    fails it (activation_overflow, issue 47); the rows that fit are still compared. A capture holding no checked
    layer is refused rather than a silent pass; the file's metadata cannot rename its path."""
    import torch

    from parity_cli import api
    from parity_cli.errors import InputError

    nan = torch.randn(3, 64)
    nan[1, 5] = float("nan")
    with pytest.raises(InputError, match="non-finite"):
        api.check(llama, candidate="torch", activations=_capture_file(llama, tmp_path, "nan.st", {"model.norm": nan}))
    unrelated = _capture_file(llama, tmp_path, "other.st", {"lm_head.x": torch.randn(3, 64)})
    with pytest.raises(InputError, match="none of the checked layers"):
        api.check(llama, candidate="torch", activations=unrelated)
    big = torch.randn(4, 64)
    big[:2] *= 1e6  # two rows of 1e6 scale: past float16's 65504
    lying = _capture_file(llama, tmp_path, "big.st", {"model.norm": big}, path="/etc/evil", junk="x" * 1000)
    report = api.check(llama, candidate="torch", dtype="float16", activations=lying, layers="model.norm")
    (layer,) = report.layers
    assert not report.passed and [f["code"] for f in layer.findings] == ["activation_overflow"]
    (found,) = layer.findings
    # the largest |x| is the largest element of the two scaled rows, float16's limit is (2 - 2^-10) 2^15
    assert found["rows"] == 2 and found["largest"] == float(big[:2].abs().max()) and found["limit"] == 65504.0
    assert "2 of 4 real row(s) of model.norm reach |x|" in found["message"]
    assert next(s for s in layer.strata if s.name == "captured").vectors == 2
    r = run_parity("check", llama, "--dtype", "float16", "--activations", lying, "--layers", "model.norm", "-q")
    assert r.returncode == 1 and r.stdout.startswith("FAIL: 1 of 1 layer: activation_overflow (real rows up to |x|"), \
        r.stdout + r.stderr
    acts = report.header["probes"]["activations"]
    assert acts["path"].endswith("big.st") and "junk" not in acts


def test_explain_probes_with_the_real_rows_and_replays_them(llama, tmp_path):
    """The ladder runs the captured stratum too (check --explain and parity explain REPORT.json),
    and a report made with --activations replays with them."""
    out = tmp_path / "acts.safetensors"
    assert run_parity("capture", llama, "--prompt", TEXT, "--rows-per-layer", "12", "-o", out).returncode == 0
    from parity_cli import api

    ladder = api.explain(llama, candidate="torch", candidate_eps=1e-5, activations=str(out),
                         layer_names=["model.norm"])
    assert "captured" in ladder["model.norm"][0]["failing"]
    rep = tmp_path / "r.json"
    assert run_parity("check", llama, "--candidate-eps", "1e-5", "--activations", out, "--json", rep,
                      "--layers", "model.norm").returncode == 1
    r = run_parity("explain", rep, "--json", tmp_path / "ladder.json")
    assert r.returncode == 0, r.stderr


# --- one capture for every copy of a model (issue 27) -----------------------------------------------

def _copy_tokenizer(src, dst):
    for f in Path(src).iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, Path(dst) / f.name)


def _saved_twice(model, root):
    """(the model saved in float32 with a word-level tokenizer, the same saved in bfloat16)."""
    import torch

    hf, bf16 = root / "hf32", root / "hf16"
    model.save_pretrained(hf, safe_serialization=True)
    _tokenizer(["<unk>", "<pad>"] + [f"w{i}" for i in range(98)]).save_pretrained(hf)
    model.to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    _copy_tokenizer(hf, bf16)
    return hf, bf16


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """One Llama three ways: HF float32 with gains that are not bfloat16 values, the GGUF written
    from it (float32, gguf-py's names), and the HF copy saved in bfloat16 (each gain rounded)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("copies")
    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # float32 values bfloat16 cannot hold
    hf, bf16 = _saved_twice(model, root)
    return {"hf32": hf, "gguf": _write_gguf(hf, root / "model.gguf"), "hf16": bf16}


PROMPT = " " + " ".join(f"w{i % 40}" for i in range(120))


def _rows_in(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        shapes = [fh.get_slice(k).get_shape() for k in fh.keys() if not k.startswith("norm:")]
    return sum(s[0] for s in shapes), len(shapes)


def _norms(path):
    """Every norm gain of an HF copy as float64, read from its safetensors file by the test."""
    from safetensors.torch import load_file

    return {k: v.double() for k, v in load_file(f"{path}/model.safetensors").items() if k.endswith("norm.weight")}


def _half_ulp(values, mantissa_bits):
    """Half the spacing of a binary float with `mantissa_bits` at each value: 2^(floor(log2|v|) - p - 1)
    (no value here is zero or subnormal)."""
    import math

    return [2.0 ** (math.floor(math.log2(abs(v))) - mantissa_bits - 1) for v in values]


def _assert_within_bfloat16(target, out, report, largest, share):
    """`check TARGET --activations OUT` passes with a schema-valid report whose match is a bfloat16
    rounding of the other copy: `largest` difference at `share` of the bound, both derived by the test."""
    import json

    from parity_cli.resources import schema_path

    r = run_parity("check", target, "--activations", out, "--json", report)
    assert r.returncode == 0, r.stdout + r.stderr
    data = load_json(report)
    pytest.importorskip("jsonschema").validate(data, json.loads(schema_path().read_text()))
    acts = data["probes"]["activations"]
    assert acts["match"].startswith("within bfloat16 rounding") and f"{largest:.3g}" in acts["match"]
    m = acts["norms_match"]
    assert m["kind"] == "within_rounding" and m["coarsest"] == "bfloat16"
    assert sorted(m["dtypes"]) == ["bfloat16", "float32"]
    assert m["max_abs_diff"] == largest and m["max_diff_over_bound"] == pytest.approx(share, rel=1e-12)
    assert acts["rows"] == _rows_in(out)[0] and "within bfloat16 rounding" in " ".join(r.stdout.split())


def test_a_gguf_capture_serves_the_bfloat16_hf_copy_and_back(copies, tmp_path):

    import torch


    # the copies really differ: bfloat16 gains are the float32 ones rounded, not equal
    f32, b16 = _norms(copies["hf32"]), _norms(copies["hf16"])
    assert not all(torch.equal(f32[k], b16[k]) for k in f32)
    # what the match must report, from the two files: the largest |f32 - bf16| of any gain, and its
    # share of the bound (half a float32 step at the float32 value + half a bfloat16 step at the bfloat16 one)
    diffs = [(abs(a - b), abs(a - b) / (ha + hb))
             for k in f32 for a, b, ha, hb in zip(f32[k].tolist(), b16[k].tolist(),
                                                  _half_ulp(f32[k].tolist(), 23), _half_ulp(b16[k].tolist(), 7))]
    largest, share = max(d for d, _ in diffs), max(r for _, r in diffs)
    assert 0 < largest and 0.5 < share <= 1  # somewhere close to half a bfloat16 step
    for source, target in (("gguf", "hf16"), ("hf16", "gguf")):
        out = tmp_path / f"{source}.safetensors"
        r = run_parity("capture", copies[source], "--prompt", PROMPT, "-o", out)
        assert r.returncode == 0, r.stderr
        _assert_within_bfloat16(copies[target], out, tmp_path / f"{target}.json", largest, share)
    # the float32 GGUF holds the HF float32 copy's very tensors: the same fingerprint, an exact match
    r = run_parity("check", copies["hf32"], "--activations", tmp_path / "gguf.safetensors", "--json",
                   tmp_path / "exact.json")
    assert r.returncode == 0
    acts = load_json(tmp_path / "exact.json")["probes"]["activations"]
    assert acts["match"] == "exact: the same norm tensors" and acts["norms_match"]["max_abs_diff"] == 0


def test_the_rounding_bound_is_half_a_step_of_each_dtype():
    import torch

    from parity_cli.probes.capture import rounding_bound

    one = torch.tensor([1.0, 3.0, -1.5, 0.0], dtype=torch.float64)
    # by hand: at 1 a float32 step is 2^-23 and a bfloat16 step 2^-7; at 3 (in [2, 4)) twice that; at 0 the
    # smallest normal (2^-126) times each dtype's epsilon
    want = [2**-24 + 2**-8, 2**-23 + 2**-7, 2**-24 + 2**-8, 2**-126 * (2**-24 + 2**-8)]
    assert rounding_bound(one, "float32", one, "bfloat16").tolist() == want
    torch.manual_seed(0)
    a = (torch.randn(20000) * torch.logspace(-6, 6, 20000)).to(torch.float32)
    b = a.to(torch.bfloat16)
    a64, b64 = a.double(), b.double()
    bound = rounding_bound(a64, "float32", b64, "bfloat16")
    assert bool(((a64 - b64).abs() <= bound).all())  # every bfloat16 rounding of a float32 value is within
    # one bfloat16 step away from the rounded value is out, wherever the rounding itself was small
    step = 2.0 ** (torch.floor(torch.log2(b64.abs())) - 7)
    small = (a64 - b64).abs() < step / 4
    assert bool(((a64 - (b64 + step)).abs() > bound)[small].all()) and int(small.sum()) > 5000


def test_a_copy_whose_norms_differ_beyond_rounding_is_refused(copies, llama, tmp_path):

    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path / "gguf.safetensors"
    assert run_parity("capture", copies["gguf"], "--prompt", PROMPT, "-o", out).returncode == 0
    f32 = _norms(copies["hf32"])["model.norm.weight"]
    sd = load_file(f"{copies['hf16']}/model.safetensors")
    b16 = sd["model.norm.weight"]
    # one gain moved by one bfloat16 step, where the float32 value sat within a quarter step of it
    step = 2.0 ** (torch.floor(torch.log2(b16.double().abs())) - 7)
    k = int(torch.argmin((f32 - b16.double()).abs() / step))
    assert float((f32[k] - b16.double()[k]).abs()) < float(step[k]) / 4
    for name, moved in (("one_step", b16.double()[k] + step[k]), ("one_percent", b16.double()[k] * 1.01)):
        changed = tmp_path / name
        shutil.copytree(copies["hf16"], changed)
        weights = dict(sd)
        weights["model.norm.weight"] = b16.clone()
        weights["model.norm.weight"][k] = moved.to(torch.bfloat16)
        save_file(weights, f"{changed}/model.safetensors", metadata={"format": "pt"})
        r = run_parity("check", changed, "--activations", out)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (name, r.stderr)
        assert "captured from another model" in r.stderr and "model.norm's weight differs" in r.stderr
        assert str(out) in r.stderr
    # another model altogether (another seed, the same names and shapes) is refused the same way
    r = run_parity("check", llama, "--activations", out)
    assert r.returncode == 2 and "captured from another model" in r.stderr and r.stderr.count("\n") == 1


def test_the_summary_states_the_rows_the_file_holds(copies, tmp_path):
    import json

    cfg = json.loads((copies["hf32"] / "config.json").read_text())
    layers = 2 * cfg["num_hidden_layers"] + 1  # input and post-attention norms per block, and the final norm
    out = tmp_path / "few.safetensors"
    r = run_parity("capture", copies["hf32"], "--prompt", "w1 w2 w3 w4 w5 w6 w7", "-o", out)  # 7 word tokens
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{out}: {7 * layers} rows from 7 tokens, {layers} layers x 7 each "
                                     "(at most 96 a layer)"]
    assert _rows_in(out) == (7 * layers, layers)
    # past the cap: 12 kept of 120 seen, fewer where a sampled row is also among the smallest or largest
    out = tmp_path / "many.safetensors"
    r = run_parity("capture", copies["hf32"], "--prompt", PROMPT, "--rows-per-layer", "12", "-o", out)
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as fh:
        per = sorted(fh.get_slice(k).get_shape()[0] for k in fh.keys() if not k.startswith("norm:"))
    each = f"{per[0]} each" if per[0] == per[-1] else f"{per[0]} to {per[-1]} each"
    assert r.stdout.splitlines() == [f"{out}: {sum(per)} rows from 120 tokens, {layers} layers x {each} "
                                     "(at most 12 a layer)"]
    assert per[-1] <= 12 < sum(per)


@SLOW
def test_third_party_progress_bars_and_warnings_stay_out(copies, monkeypatch, capfd, tmp_path):
    """transformers' GGUF loader draws a tqdm bar ("Converting and de-quantizing GGUF tensors...")
    and logs; neither reaches parity's output, by parity's own loader or by transformers' when it takes
    the file, and transformers' settings are its own again afterwards."""
    import transformers
    from transformers.utils import logging as hf_logging

    import parity_cli.probes.capture as c

    gguf_path = copies["gguf"]
    # the bar is real: transformers' loader alone draws it on this file
    transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    alone = capfd.readouterr()
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    _, meta = c.capture(gguf_path, PROMPT, max_tokens=32)
    quiet = capfd.readouterr()
    assert meta["loaded"].startswith("read ")
    monkeypatch.setattr(c, "_gguf_direct", lambda *a, **k: (_ for _ in ()).throw(c._Fallback("forced by the test")))
    _, meta = c.capture(gguf_path, PROMPT, max_tokens=32)
    whole = capfd.readouterr()
    assert meta["loaded"] == "the whole model loaded by transformers' GGUF loader: forced by the test"
    assert "de-quantizing" in alone.err or "%|" in alone.err  # what would leak
    for seen in (quiet, whole):
        text = seen.out + seen.err
        assert "de-quantizing" not in text and "%|" not in text and "Loading weights" not in text, text
        assert text == ""
    assert (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()) == (bars, verbosity)
    # and through a real process: stderr parity's stage lines alone, stdout its two statements, each
    # wrapped to COLUMNS
    monkeypatch.undo()
    r = run_parity("capture", gguf_path, "--prompt", PROMPT, "-o", tmp_path / "p.safetensors",
                   process=True, env={"COLUMNS": "100"})  # the process's own file descriptors, not a captured stream
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and all(len(line) <= 100 for line in lines), r.stdout + r.stderr
    err = r.stderr.splitlines()  # piped: a line a stage (wrapped: its continuations indented), parity's own
    assert all(len(line) <= 100 for line in err), err
    stages = " ".join(line.strip() if line.startswith("    ") else "\n" + line for line in err).split("\n")[1:]
    assert [s.split(":")[0] for s in stages] == ["parity capture"] * 4, stages
    assert stages[0].startswith("parity capture: reading the norm layers of") and "writing" in stages[-1], stages
    assert lines[0].startswith(f"{gguf_path}: read ") and " rows from " in " ".join(lines), r.stdout


def test_the_gguf_loaded_here_gives_the_rows_transformers_gives(copies, monkeypatch):
    """parity's GGUF load (one parse, the tensors the forward needs, transformers' own name map and
    tensor processors) runs the same model as transformers' from_pretrained(gguf_file=...): the same
    rows, bit for bit; gguf-py's functions are its own again afterwards."""
    import gguf
    import torch

    import parity_cli.probes.capture as c

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    here, meta = c.capture(copies["gguf"], PROMPT, max_tokens=64)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    names = [t.name for t in gguf.GGUFReader(str(copies["gguf"])).tensors]  # the file's tensors, by gguf-py
    assert "output.weight" in names  # an untied head (LlamaConfig's default): the one tensor not needed
    assert meta["loaded"] == (f"read {len(names) - 1} of {len(names)} tensors, all the forward needs up to the last "
                              "norm layer; skipped output.weight (the output head is not run)")
    monkeypatch.setattr(c, "_load_gguf", lambda model_dir, source, names: c._gguf_via_transformers(model_dir, source,
                                                                                                     None))
    theirs, meta = c.capture(copies["gguf"], PROMPT, max_tokens=64)
    assert meta["loaded"] is None
    assert here.keys() == theirs.keys() and all(torch.equal(here[k], theirs[k]) for k in here)


def test_the_fast_reader_reads_the_fields_gguf_py_reads(copies):
    import gguf
    import numpy as np

    from parity_cli.probes.capture import _fast_reader_class

    theirs, mine = gguf.GGUFReader(str(copies["gguf"])), _fast_reader_class()(str(copies["gguf"]))
    assert list(theirs.fields) == list(mine.fields) and len(theirs.fields["tokenizer.ggml.tokens"].data) == 100
    for key, field in theirs.fields.items():
        other = mine.fields[key]
        assert field.types == other.types and field.contents() == other.contents(), key
        assert all(np.array_equal(field.parts[i], other.parts[j]) for i, j in zip(field.data, other.data)), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in theirs.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in mine.tensors]


def error_line(r) -> str:
    """A refused capture's stderr: its stage lines (`parity capture: ...`, piped), then the error in
    one line, the last; no traceback."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and lines and "Traceback" not in r.stderr, r.stderr
    assert all(line.startswith("parity capture: ") for line in lines[:-1]), r.stderr
    assert lines[-1].startswith("parity: error: "), r.stderr
    return lines[-1]


def test_a_gguf_declaring_more_than_it_holds_is_refused(copies, tmp_path):
    """Metadata that declares a model 64x wider than its tensors: refused in one line before the
    model is allocated (the size is counted on the meta device)."""
    liar = _write_gguf(copies["hf32"], tmp_path / "liar.gguf", embedding_length=4096)
    r = run_parity("capture", liar, "--prompt", PROMPT, "-o", tmp_path / "a.safetensors")
    error = error_line(r)
    assert "its metadata declares a LlamaForCausalLM of" in error and "its tensors hold" in error
    assert not (tmp_path / "a.safetensors").exists()


# --- Gemma 3: llama.cpp's GGUF stores 1 + w, the HF copy w (gain offset 1) ----------------------------

def _write_gemma3_gguf(hf, out):
    """A whole tiny Gemma 3 as llama.cpp's convert_hf_to_gguf.py (Gemma3Model) writes it: arch "gemma3",
    its metadata keys (those transformers' GGUF_CONFIG_MAPPING["gemma3"] reads), a sentencepiece
    vocabulary (tokenizer.ggml.model "llama", no space prefix), and every "norm.weight" stored as
    w + 1 in float32 (modify_tensors: data_torch + norm_shift, on the float32 tensor)."""
    import json

    import gguf
    import torch
    from safetensors.torch import load_file

    cfg = json.load(open(f"{hf}/config.json"))
    sd = load_file(f"{hf}/model.safetensors")
    L = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(out, "gemma3")
    w.add_context_length(cfg["max_position_embeddings"]); w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(L); w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"]); w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"]); w.add_value_length(cfg["head_dim"]); w.add_file_type(0)
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"]); w.add_head_count_kv(cfg["num_key_value_heads"])
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "w"] + [str(d) for d in range(10)] + ["\u2581w"] \
        + [f"\u2581w{i}" for i in range(40)]
    pieces += [f"<unused{k}>" for k in range(cfg["vocab_size"] - len(pieces))]
    w.add_tokenizer_model("llama"); w.add_tokenizer_pre("default"); w.add_token_list(pieces)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(pieces) - 4)])
    w.add_token_types([3, 3, 3, 2] + [1] * (len(pieces) - 4))  # control, unknown, normal
    w.add_pad_token_id(0); w.add_eos_token_id(1); w.add_bos_token_id(2); w.add_unk_token_id(3)
    w.add_add_bos_token(True); w.add_add_eos_token(False); w.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, L)
    for k, t in sd.items():  # tied embeddings: no output.weight, as the converter writes Gemma 3
        g = names.get_name(k[: -len(".weight")])
        assert g is not None, k
        # the converter upcasts to float32 first unless the tensor is float16 or float32: a float16
        # checkpoint's w + 1 is formed in float16
        t = t if t.dtype == torch.float16 else t.float()
        w.add_tensor(f"{g}.weight", (t + 1.0 if k.endswith("norm.weight") else t).float().numpy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """One text-only Gemma 3 three ways: HF float32 with random gains w (not bfloat16 values, over several
    binades), the HF copy saved in bfloat16, and the GGUF written from the float32 one (1 + w stored)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    root = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(5)
    cfg = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=100, rms_norm_eps=1e-6,
                           sliding_window=32, max_position_embeddings=512)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))  # Gemma's w: zero-initialised, here anything but 0
    hf, bf16 = _saved_twice(model, root)
    return {"hf32": hf, "hf16": bf16, "gguf": _write_gemma3_gguf(hf, root / "gemma3.gguf")}


def _gguf_norms(path, hf_names):
    """The GGUF's stored norm gains (float64 of its F32), by gguf-py, under the HF names."""
    import gguf
    import torch

    reader = gguf.GGUFReader(str(path))
    blocks = int(reader.fields["gemma3.block_count"].contents())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, blocks)
    by_name = {t.name: t for t in reader.tensors}
    out = {}
    for k in hf_names:
        t = by_name[names.get_name(k[: -len(".weight")]) + ".weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, k
        out[k] = torch.from_numpy(t.data.copy()).double()
    return out


def _against(stored, stored_bits, offset, other, other_bits):
    """(largest |(stored + offset) - other|, its largest share of the bound: half a step of each copy's
    dtype at its own stored value, summed) over every gain; the bound from the formula, by math.log2."""
    pairs = []
    for k in other:
        a, b = stored[k].tolist(), other[k].tolist()
        for x, y, hx, hy in zip(a, b, _half_ulp(a, stored_bits), _half_ulp(b, other_bits)):
            pairs.append((abs(x + offset - y), abs(x + offset - y) / (hx + hy)))
    return max(d for d, _ in pairs), max(r for _, r in pairs)


def test_a_gemma3_gguf_capture_serves_the_bfloat16_hf_copy_and_back(gemma3, tmp_path):
    """llama.cpp bakes Gemma's 1 + w into the GGUF (read with gain offset 0), the HF copies store w (offset
    1): a capture from either is accepted on the other, the gains compared as 1 + w within rounding."""
    import json

    import torch
    from safetensors import safe_open


    f32, b16 = _norms(gemma3["hf32"]), _norms(gemma3["hf16"])
    g = _gguf_norms(gemma3["gguf"], f32)
    assert len(f32) == 2 * 6 + 1  # 4 norms, q_norm and k_norm per block, and the final norm
    for k in f32:  # the file is as the converter writes it: float32(w + 1), nowhere w itself
        assert torch.equal(g[k], (f32[k].float() + 1).double()) and bool(((g[k] - f32[k]).abs() > 0.5).all())
    assert not all(torch.equal(f32[k], b16[k]) for k in f32) and all(bool((b16[k] != 0).all()) for k in b16)
    # what the match must report, from the files: 1 + w of the GGUF against w + 1 of the bfloat16 copy
    largest, share = _against(g, 23, -1.0, b16, 7)
    assert 0 < largest and 0.5 < share <= 1  # somewhere close to the bound: a bfloat16 rounding of w
    assert _against(b16, 7, 1.0, g, 23) == (largest, share)  # the same figures from the other side
    for source, target, offset in (("gguf", "hf16", 0.0), ("hf16", "gguf", 1.0)):
        out = tmp_path / f"{source}.safetensors"
        r = run_parity("capture", gemma3[source], "--prompt", PROMPT, "-o", out)
        assert r.returncode == 0, r.stderr
        with safe_open(str(out), framework="pt") as fh:  # the offset each copy's gains are read with
            norms = json.loads(fh.metadata()["parity"])["norms"]
        assert set(norms) == {k[: -len(".weight")] for k in f32}
        assert {n["gain_offset"] for n in norms.values()} == {offset}
        _assert_within_bfloat16(gemma3[target], out, tmp_path / f"{target}.json", largest, share)
    # the float32 HF copy: both float32, yet 1 + w was rounded once more in the GGUF; within float32 rounding
    largest32, share32 = _against(g, 23, -1.0, f32, 23)
    assert 0 < largest32 and share32 <= 1
    r = run_parity("check", gemma3["hf32"], "--activations", tmp_path / "gguf.safetensors", "--json",
                   tmp_path / "hf32.json")
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_json(tmp_path / "hf32.json")["probes"]["activations"]["norms_match"]
    assert m["kind"] == "within_rounding" and m["dtypes"] == ["float32"] and m["coarsest"] == "float32"
    assert m["max_abs_diff"] == largest32 and m["max_diff_over_bound"] == pytest.approx(share32, rel=1e-12)


def test_a_gemma3_hf_copy_one_bfloat16_step_off_is_refused(gemma3, tmp_path):
    """One gain of the bfloat16 copy moved by one bfloat16 step (where the float32 value sat within a
    quarter step of it): another model, refused either way, with the figures the files give. The gain
    picked is the smallest such w: its step is smaller than the rounding differences of larger gains
    in the same layer, so only a bound per element refuses it."""

    import torch
    from safetensors.torch import load_file, save_file

    name = "model.norm.weight"
    f32, g = _norms(gemma3["hf32"])[name], _gguf_norms(gemma3["gguf"], [name])[name]
    sd = load_file(f"{gemma3['hf16']}/model.safetensors")
    b16 = sd[name].double()
    binade = torch.floor(torch.log2(b16.abs()))
    step = 2.0 ** (binade - 7)  # one bfloat16 step at each stored value
    moved = b16 + step
    near = ((f32 - b16).abs() < step / 4) & (torch.floor(torch.log2(moved.abs())) == binade)
    k = int(torch.argmin(torch.where(near, b16.abs(), torch.inf)))  # one step within the binade
    changed = tmp_path / "one_step"
    shutil.copytree(gemma3["hf16"], changed)
    weights = dict(sd)
    weights[name] = sd[name].clone()
    weights[name][k] = moved[k].to(torch.bfloat16)
    assert float(weights[name][k]) == float(moved[k])  # a bfloat16 value: stored exactly
    save_file(weights, f"{changed}/model.safetensors", metadata={"format": "pt"})
    # 1 + w as the GGUF stores it against the moved w + 1: over the bound (half a float32 step at the
    # GGUF's value and half a bfloat16 step at the moved one), yet under the layer's largest difference
    diff = abs(float(g[k]) - 1 - float(moved[k]))
    bound = _half_ulp([float(g[k])], 23)[0] + _half_ulp([float(moved[k])], 7)[0]
    largest = float((g - 1 - weights[name].double()).abs().max())
    assert bool(near[k]) and bound < diff < largest
    captures = {}
    for source in ("gguf", "changed"):
        captures[source] = tmp_path / f"{source}.safetensors"
        path = gemma3["gguf"] if source == "gguf" else changed
        assert run_parity("capture", path, "--prompt", PROMPT, "-o", captures[source]).returncode == 0
    for capture, target in ((captures["gguf"], changed), (captures["changed"], gemma3["gguf"])):
        r = run_parity("check", target, "--activations", capture)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "captured from another model" in r.stderr and "model.norm's weight differs" in r.stderr
        assert f"differs by up to {largest:.3g}" in r.stderr
        assert f"({diff:.3g} where {bound:.3g} is allowed)" in r.stderr


def _gemma3_multimodal(text_dir, out, extra_layers=0):
    """A Gemma3ForConditionalGeneration (a one-layer SigLIP tower, its projector) whose language model
    holds the text-only copy's weights, saved as transformers saves it (language_model.model.*);
    `extra_layers` blocks more than the copy has, left at their own random gains."""

    import torch
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = Gemma3ForCausalLM.from_pretrained(text_dir, torch_dtype=torch.float32)
    text_cfg = text.config.to_dict()
    text_cfg["num_hidden_layers"] += extra_layers
    text_cfg.pop("layer_types", None)  # rebuilt for the new depth
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text_cfg, vision_config=vision.to_dict(), mm_tokens_per_image=4)
    torch.manual_seed(11)
    model = Gemma3ForConditionalGeneration(cfg)
    missing = model.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing.unexpected_keys and all(k.startswith("layers.") for k in missing.missing_keys)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" not in name and name.endswith("norm.weight") or ".layers.2." in name:
                p.copy_(0.1 * torch.randn_like(p))  # the towers' (and any extra block's) own gains
    model.save_pretrained(out, safe_serialization=True)
    _copy_tokenizer(text_dir, out)
    return Path(out)


def _norm_gains_by_tower(path):
    """(the language model's norm gains, every other tower's) of a saved Gemma 3 multimodal model, by
    the names in its safetensors file (language_model.model.* as transformers saves it)."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        stored = [k for k in fh.keys() if k.endswith(("norm.weight", "layernorm.weight", "layer_norm1.weight",
                                                       "layer_norm2.weight"))]
    return [k for k in stored if "language_model." in k], [k for k in stored if "language_model." not in k]


def test_a_capture_of_the_language_model_serves_the_multimodal_checkpoint(gemma3, tmp_path):
    """The GGUF of a multimodal Gemma 3 holds its language model only (the towers go to an mmproj), under
    gguf-py's names (model.layers.N); the HF checkpoint names them language_model.model.layers.N and has a
    vision tower and a projector besides. A capture from the GGUF serves it: the same layers by their
    pattern and indices, the towers it lacks without captured rows, said so."""
    mm = _gemma3_multimodal(gemma3["hf32"], tmp_path / "mm")
    language, others = _norm_gains_by_tower(mm)
    assert len(language) == len(_norms(gemma3["hf32"])) == 13 and others  # the vision tower's and the projector's
    out = tmp_path / "gguf.safetensors"
    assert run_parity("capture", gemma3["gguf"], "--prompt", PROMPT, "-o", out).returncode == 0
    report = tmp_path / "mm.json"
    r = run_parity("check", mm, "--activations", out, "--json", report)
    assert r.returncode == 0, r.stdout + r.stderr
    acts = load_json(report)["probes"]["activations"]
    m = acts["norms_match"]
    assert m["renamed"] == 13 and m["without_rows"]["layers"] == len(others)
    assert set(m["without_rows"]["towers"]) == {"vision", "projector"}
    assert "13 named as this layout names them" in acts["match"] and "have no captured rows" in acts["match"]
    # the rows went to the language model's layers, under this checkpoint's names, and to no other
    assert sorted(acts["layers"]) == sorted(k.removesuffix(".weight") for k in language)


def test_a_multimodal_checkpoint_with_a_block_the_capture_lacks_is_refused(gemma3, tmp_path):
    mm = _gemma3_multimodal(gemma3["hf32"], tmp_path / "mm3", extra_layers=1)
    out = tmp_path / "gguf.safetensors"
    assert run_parity("capture", gemma3["gguf"], "--prompt", PROMPT, "-o", out).returncode == 0
    r = run_parity("check", mm, "--activations", out)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "captured from another model" in r.stderr and "here and not in the capture" in r.stderr
    assert "language_model.model.layers.2." in r.stderr



def _share_bytes(path, first, second):
    """The GGUF with tensor `second` pointed at `first`'s bytes (both the same size): each lies within
    the file, as gguf-py checks, but they overlap. The offset is the last field of a tensor's info:
    name (u64 length + bytes), n_dims (u32), dims (u64 each), type (u32), offset (u64)."""
    import struct

    import gguf

    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    a, b = by_name[first], by_name[second]
    assert a.n_bytes == b.n_bytes and a.tensor_type == b.tensor_type
    where = b.field.offset + 8 + len(second.encode()) + 4 + 8 * len(b.shape) + 4
    data = bytearray(path.read_bytes())
    assert struct.unpack_from("<Q", data, where)[0] == b.data_offset - reader.data_offset  # the field found
    struct.pack_into("<Q", data, where, a.data_offset - reader.data_offset)
    path.write_bytes(bytes(data))
    return path


def test_hostile_ggufs_are_one_line_and_write_nothing(copies, tmp_path):
    """A GGUF is untrusted: tensors sharing bytes (which let the metadata declare a model far larger
    than the file), metadata transformers cannot build a model from, and weights whose every row is
    NaN are each refused in one line, exit 2, with no capture written."""
    hf = copies["hf32"]
    overlapping = _share_bytes(_write_gguf(hf, tmp_path / "overlap.gguf", quantized=True),
                               "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")
    no_kv = _write_gguf(hf, tmp_path / "kv0.gguf", head_count_kv=0)
    nan = _write_gguf(hf, tmp_path / "nan.gguf", nan_in="model.layers.0.self_attn.o_proj.weight")
    # 10^9 blocks declared: transformers' config class would expand them into per-layer lists before any check
    blocks = _write_gguf(hf, tmp_path / "blocks.gguf", block_count=10**9)
    for path, words in ((overlapping, "GGUF tensors blk.0.ffn_gate.weight and blk.0.ffn_up.weight share bytes"),
                        (blocks, "declares 1,000,000,000 blocks (llama.block_count), its tensors hold 2"),
                        (no_kv, "transformers cannot build the model"),
                        (nan, "is NaN or inf; nothing captured")):
        out = tmp_path / f"{path.stem}.safetensors"
        r = run_parity("capture", path, "--prompt", PROMPT, "-o", out)
        assert words in error_line(r), (path.name, r.stderr)
        assert "Traceback" not in r.stderr and not out.exists()


def test_a_quantized_gguf_loaded_here_gives_the_rows_transformers_gives(copies, tmp_path, monkeypatch):
    """Q8_0 matrices (llama.cpp's most common 8-bit type) dequantized by parity's loader: the rows are
    those of transformers' own GGUF loader, bit for bit, and differ from the float32 file's."""
    import torch

    import parity_cli.probes.capture as c

    q8 = _write_gguf(copies["hf32"], tmp_path / "q8.gguf", quantized=True)
    here, meta = c.capture(q8, PROMPT, max_tokens=64)
    assert meta["loaded"].startswith("read ")  # parity's own loader, not the fallback
    monkeypatch.setattr(c, "_load_gguf", lambda model_dir, source, names: c._gguf_via_transformers(model_dir, source,
                                                                                                     None))
    theirs, _ = c.capture(q8, PROMPT, max_tokens=64)
    assert here.keys() == theirs.keys() and all(torch.equal(here[k], theirs[k]) for k in here)
    monkeypatch.undo()
    f32, _ = c.capture(copies["gguf"], PROMPT, max_tokens=64)
    rows = [k for k in here if not k.startswith("norm:")]
    assert any(not torch.equal(here[k], f32[k]) for k in rows)  # the quantization shows in the rows



def test_a_float16_gemma3_capture_serves_its_gguf(gemma3, tmp_path):
    """A float16 checkpoint's GGUF holds fl16(w + 1) (the converter adds the 1 in float16): up to half
    a float16 step at 1 + w from w + 1, more than float32 and float16 rounding of w allow. A capture
    from the float16 copy is accepted on that GGUF, and the figures say how close it came."""

    import torch
    from transformers import Gemma3ForCausalLM

    f16 = tmp_path / "hf_f16"
    Gemma3ForCausalLM.from_pretrained(gemma3["hf32"], torch_dtype=torch.float16).save_pretrained(f16)
    _copy_tokenizer(gemma3["hf32"], f16)
    g = _write_gemma3_gguf(f16, tmp_path / "f16.gguf")
    w = _norms(f16)
    stored = _gguf_norms(g, w)
    # the file holds fl16(w + 1), and somewhere that is further from w + 1 than half a float32 step
    # at 1 + w plus half a float16 step at w
    excess = [abs(a - (b + 1)) - (hs + hw) for k in w
              for a, b, hs, hw in zip(stored[k].tolist(), w[k].tolist(), _half_ulp([1 + v for v in w[k].tolist()], 23),
                                      _half_ulp(w[k].tolist(), 10))]
    assert max(excess) > 0
    out = tmp_path / "f16.safetensors"
    assert run_parity("capture", f16, "--prompt", PROMPT, "-o", out).returncode == 0
    r = run_parity("check", g, "--activations", out, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    m = load_json(tmp_path / "r.json")["probes"]["activations"]["norms_match"]
    assert m["kind"] == "within_rounding" and sorted(m["dtypes"]) == ["float16", "float32"]


def test_a_capture_of_the_multimodal_checkpoint_serves_its_language_models_gguf(gemma3, tmp_path):
    """The other way: a capture made on the multimodal checkpoint (text run through it: the towers
    the text does not reach hold no rows) checked on the GGUF of its language model. The towers the
    GGUF lacks are said to be unused; the language model's layers get the rows."""
    mm = _gemma3_multimodal(gemma3["hf32"], tmp_path / "mm")
    out = tmp_path / "mm.safetensors"
    r = run_parity("capture", mm, "--prompt", PROMPT, "-o", out)
    assert r.returncode == 0, r.stderr
    report = tmp_path / "gguf.json"
    r = run_parity("check", gemma3["gguf"], "--activations", out, "--json", report)
    assert r.returncode == 0, r.stdout + r.stderr
    acts = load_json(report)["probes"]["activations"]
    unused = acts["norms_match"]["rows_not_used"]
    _, others = _norm_gains_by_tower(mm)
    assert set(unused["towers"]) == {"vision", "projector"} and unused["layers"] == len(others)
    assert acts["norms_match"]["renamed"] == 13 and "rows are not used" in acts["match"]
    assert sorted(acts["layers"]) == sorted(k.removesuffix(".weight") for k in _norms(gemma3["hf32"]))



@pytest.mark.parametrize("offset", [None, float("nan"), "1", True])
def test_a_capture_whose_recorded_gain_offset_is_no_number_is_refused(copies, tmp_path, offset):
    """The capture's metadata is untrusted: a norm's recorded gain offset that is missing, NaN, a
    string or a bool is one line naming the layer, not a comparison that passes."""
    import json as jsonlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    out = tmp_path / "c.safetensors"
    assert run_parity("capture", copies["gguf"], "--prompt", PROMPT, "-o", out).returncode == 0
    with safe_open(str(out), framework="pt") as fh:
        meta = jsonlib.loads(fh.metadata()["parity"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    info = meta["norms"]["model.norm"]
    if offset is None:
        del info["gain_offset"]
    else:
        info["gain_offset"] = offset
    lying = tmp_path / "lying.safetensors"
    save_file(tensors, str(lying), metadata={"parity": jsonlib.dumps(meta)})
    r = run_parity("check", copies["hf16"], "--activations", lying)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "model.norm's recorded gain offset is" in r.stderr


def test_the_last_line_fits_80_columns(copies, tmp_path):
    """Issue 47: at 80 columns the path goes on a line of its own and the last line is what the file
    holds, whole (it was folded at a space, its count split from its unit)."""
    import json

    cfg = json.loads((copies["hf32"] / "config.json").read_text())
    layers = 2 * cfg["num_hidden_layers"] + 1
    out = tmp_path / ("a-long-directory-name-" * 3) / "few.safetensors"
    out.parent.mkdir()
    r = run_parity("capture", copies["hf32"], "--prompt", "w1 w2 w3 w4 w5 w6 w7", "-o", out, env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == f"{7 * layers} rows from 7 tokens, {layers} layers x 7 each (at most 96 a layer)"
    assert all(len(line) <= 80 for line in lines) and re.sub(r"\n", "", r.stdout).startswith(f"wrote {out}")
