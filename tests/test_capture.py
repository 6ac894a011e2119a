"""Issue 17: real activations — capture what the norms see from a real (tiny, random-weight)
transformers model, probe with them, and say what an eps fault does to them."""

import pytest
from conftest import load_json, run_parity

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

def _write_gguf(hf, out):
    """A whole tiny Llama as a GGUF transformers can dequantize: llama.cpp's tensor names (gguf-py's
    map), its metadata keys, and a gpt2-style byte-level BPE vocabulary with merges."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.load(open(f"{hf}/config.json"))
    sd = load_file(f"{hf}/model.safetensors")
    L = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(L); w.add_context_length(cfg["max_position_embeddings"]); w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"]); w.add_head_count(cfg["num_attention_heads"]); w.add_head_count_kv(cfg["num_key_value_heads"])
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
        w.add_tensor(f"{g}.weight", t.float().numpy())
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
    import json

    import torch
    from safetensors.torch import save_file

    from parity_cli import api
    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(llama)
    meta = {"parity": json.dumps({"fingerprint": fingerprint(discover_layers(ckpt, fam, eps).layers)["sha256"]})}
    bad = tmp_path / "wide.safetensors"
    save_file({"model.norm": torch.zeros(3, 65)}, str(bad), metadata=meta)  # the model's width is 64
    r = run_parity("check", llama, "--activations", bad)
    assert r.returncode == 2 and "model.norm holds [3, 65]" in r.stderr and "rows of 64" in r.stderr


def _capture_file(llama, tmp_path, name, rows: dict, **meta_extra):
    """A capture file of this model (its fingerprint) holding `rows`, written by the test."""
    import json

    from safetensors.torch import save_file

    from parity_cli import api
    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(llama)
    meta = {"fingerprint": fingerprint(discover_layers(ckpt, fam, eps).layers)["sha256"], **meta_extra}
    path = tmp_path / name
    save_file(rows, str(path), metadata={"parity": json.dumps(meta)})
    return path


def test_hostile_rows_are_refused_or_left_out(llama, tmp_path):
    """NaN rows have no q: refused in one line. Rows past float16's range (6.55e4) become inf
    when rounded for a float16 candidate: left out with a warning. A capture holding no checked
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
    assert any("2 captured row(s) overflow float16" in w for w in layer.warnings)
    assert next(s for s in layer.strata if s.name == "captured").vectors == 2
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

@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """One Llama three ways: HF float32 with gains that are not bfloat16 values, the GGUF written
    from it (float32, gguf-py's names), and the HF copy saved in bfloat16 (each gain rounded)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import shutil

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
    hf = root / "hf32"
    model.save_pretrained(hf, safe_serialization=True)
    _tokenizer(["<unk>", "<pad>"] + [f"w{i}" for i in range(98)]).save_pretrained(hf)
    bf16 = root / "hf16"
    model.to(torch.bfloat16).save_pretrained(bf16, safe_serialization=True)
    for f in hf.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, bf16 / f.name)
    return {"hf32": hf, "gguf": _write_gguf(hf, root / "model.gguf"), "hf16": bf16}


PROMPT = " " + " ".join(f"w{i % 40}" for i in range(120))


def _rows_in(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        shapes = [fh.get_slice(k).get_shape() for k in fh.keys() if not k.startswith("norm:")]
    return sum(s[0] for s in shapes), len(shapes)


def test_a_gguf_capture_serves_the_bfloat16_hf_copy_and_back(copies, tmp_path):
    from safetensors.torch import load_file

    # the copies really differ: bfloat16 gains are the float32 ones rounded, not equal
    a = load_file(f"{copies['hf32']}/model.safetensors")["model.norm.weight"]
    b = load_file(f"{copies['hf16']}/model.safetensors")["model.norm.weight"]
    assert b.dtype.is_floating_point and not (a == b.float()).all() and (a.bfloat16() == b).all()
    for source, target in (("gguf", "hf16"), ("hf16", "gguf")):
        out = tmp_path / f"{source}.safetensors"
        r = run_parity("capture", copies[source], "--prompt", PROMPT, "-o", out)
        assert r.returncode == 0, r.stderr
        # the summary's count is the rows the file holds, not the per-layer cap
        rows, layers = _rows_in(out)
        assert f"{rows:,} rows from " in r.stdout and f" in {layers} layers (at most 96 a layer)" in r.stdout
        # no third-party progress bar or warning in either stream
        assert "de-quantizing" not in r.stdout + r.stderr and "%|" not in r.stdout + r.stderr and r.stderr == ""
        report = tmp_path / f"{target}.json"
        r = run_parity("check", copies[target], "--activations", out, "--json", report)
        assert r.returncode == 0, r.stdout + r.stderr
        acts = load_json(report)["probes"]["activations"]
        assert acts["match"].startswith("the same norm layers") and "bfloat16 rounding" in acts["match"]
        assert acts["rows"] == rows
        assert f"{rows:,} real rows from " in r.stdout and "within bfloat16 rounding" in r.stdout
    # the float32 GGUF holds the HF float32 copy's very tensors: the same fingerprint, an exact match
    r = run_parity("check", copies["hf32"], "--activations", tmp_path / "gguf.safetensors", "--json",
                   tmp_path / "exact.json")
    assert r.returncode == 0
    assert load_json(tmp_path / "exact.json")["probes"]["activations"]["match"] == "exact: the same norm tensors"


def test_a_copy_whose_norms_differ_beyond_rounding_is_refused(copies, llama, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / "gguf.safetensors"
    assert run_parity("capture", copies["gguf"], "--prompt", PROMPT, "-o", out).returncode == 0
    # one gain moved by 1 %, far past bfloat16's half step (2**-8 relative)
    changed = tmp_path / "changed"
    shutil.copytree(copies["hf16"], changed)
    sd = load_file(f"{changed}/model.safetensors")
    sd["model.norm.weight"] = sd["model.norm.weight"].clone()
    sd["model.norm.weight"][5] *= 1.01
    save_file(sd, f"{changed}/model.safetensors", metadata={"format": "pt"})
    r = run_parity("check", changed, "--activations", out)
    assert r.returncode == 2 and "captured from another model" in r.stderr and "model.norm's weight differs" in r.stderr
    # another model altogether (another seed, the same names and shapes) is refused the same way
    r = run_parity("check", llama, "--activations", out)
    assert r.returncode == 2 and "captured from another model" in r.stderr and r.stderr.count("\n") == 1


def test_a_gguf_parsed_once_gives_the_rows_transformers_alone_gives(copies, monkeypatch):
    """One parse of the GGUF serves transformers' four loads (benchmarks/bench_capture_gguf.py: 2x
    faster on a SmolLM2-135M shape): the same rows as when it parses the file for each, and
    gguf-py's functions are its own again afterwards."""
    import gguf
    import torch

    import parity_cli.probes.capture as c

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    once, _ = c.capture(copies["gguf"], PROMPT, max_tokens=64)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    real = c._gguf_parsed_once
    monkeypatch.setattr(c, "_gguf_parsed_once", lambda active: real(False))
    each, _ = c.capture(copies["gguf"], PROMPT, max_tokens=64)
    assert once.keys() == each.keys() and all(torch.equal(once[k], each[k]) for k in once)
