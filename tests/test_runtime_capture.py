"""Inside llama.cpp: `parity capture MODEL.gguf --runtime llama.cpp` runs the GGUF in llama.cpp itself
(the xllamacpp wheel, its eval callback) and records each norm node's input and output rows, eps and
gain; `parity check HF_DIR --runtime-capture CAP` judges those rows against the HF checkpoint's
float64 oracle. Tiny whole transformers models (synthetic.write_runnable) converted by
synthetic.hf_to_gguf, faithfully and with planted conversion faults (eps, swapped gains, Gemma's
+1 applied twice or not at all)."""

import numpy as np
import pytest
from conftest import load_json, run_parity

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

EPS = 1e-5
HIDDEN, HEADS = 64, 4
HEAD_DIM = HIDDEN // HEADS  # 16
PROMPT = " ".join(f"w{i % 40}" for i in range(16))
# the GGUF's sentencepiece vocabulary (synthetic._whole_model): <pad> <eos> <bos> <unk> ▁ w 0..9 ▁w,
# then ▁w0..▁w39: "▁wK" is id 17 + K; llama.cpp adds BOS (id 2) and the space prefix
PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "w"] + [str(d) for d in range(10)] + ["\u2581w"] \
    + [f"\u2581w{k}" for k in range(40)]
BOS = PIECES.index("<bos>")
TOKEN_IDS = [BOS] + [PIECES.index(f"\u2581w{i % 40}") for i in range(16)]
SWAPPED = ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm")

# name -> (HF model, hf_to_gguf keyword arguments)
GGUFS = {"llama": ("llama", {}), "qwen3": ("qwen3", {}), "gemma3_text": ("gemma3_text", {}),
         "eps": ("llama", {"eps": 1e-6}), "swap": ("llama", {"swap": SWAPPED}),
         "twice": ("gemma3_text", {"offset": "twice"}), "missing": ("gemma3_text", {"offset": "missing"})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Factory: the HF directory of a model type, written once for the module."""
    from parity_cli.sources.synthetic import write_runnable

    root = tmp_path_factory.mktemp("hf")
    made = {}

    def get(model_type):
        if model_type not in made:
            # a seed per type: with one seed, two types' RNG streams align and their gains coincide
            seed = ["llama", "qwen3", "gemma3_text"].index(model_type)
            made[model_type] = write_runnable(root / model_type, model_type, layers=2, hidden=HIDDEN, eps=EPS,
                                              seed=seed)
        return made[model_type]

    return get


@pytest.fixture(scope="module")
def captures(models, tmp_path_factory):
    """Factory: the llama.cpp capture of a GGUFS entry (converted, then captured once for the module)."""
    from parity_cli.sources.synthetic import hf_to_gguf

    root = tmp_path_factory.mktemp("captures")
    made = {}

    def get(name):
        if name not in made:
            model_type, kwargs = GGUFS[name]
            gguf_path = hf_to_gguf(models(model_type), root / f"{name}.gguf", full=True, **kwargs)
            out = root / f"{name}.cap.safetensors"
            r = run_parity("capture", gguf_path, "--runtime", "llama.cpp", "--prompt", PROMPT, "-o", out)
            assert r.returncode == 0 and out.is_file(), r.stdout + r.stderr
            made[name] = out
        return made[name]

    return get


def _check(hf, cap, tmp_path, *extra):
    rep = tmp_path / "r.json"
    r = run_parity("check", hf, "--runtime-capture", cap, "--json", rep, *extra)
    return r, (load_json(rep) if rep.exists() else None)


def _hf_tensors(hf):
    from safetensors.numpy import load_file

    return load_file(f"{hf}/model.safetensors")


def _norm_names(hf) -> set:
    return {k[: -len(".weight")] for k in _hf_tensors(hf) if k.endswith("norm.weight")}


def _capture_file(cap):
    """(tensors as numpy, the capture's metadata), read with safetensors alone."""
    import json

    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(str(cap), framework="np") as fh:
        meta = json.loads(fh.metadata()["parity-runtime"])
    return load_file(str(cap)), meta


def _by_name(data) -> dict:
    return {layer["name"]: layer for layer in data["layers"]}


def _codes(items) -> list:
    return [item["code"] for item in items]


# 1. faithful conversions pass inside llama.cpp

@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_a_faithful_conversion_passes_inside_llama_cpp(model_type, models, captures, tmp_path):
    hf = models(model_type)
    r, data = _check(hf, captures(model_type), tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    expected = _norm_names(hf)
    assert len(expected) == {"llama": 5, "qwen3": 9, "gemma3_text": 13}[model_type]
    layers = _by_name(data)
    assert set(layers) == expected and len(data["layers"]) == len(expected)
    assert all(layer["status"] == "pass" and not layer["findings"] for layer in layers.values()), \
        [(n, layer["status"], layer["findings"]) for n, layer in layers.items() if layer["status"] != "pass"]
    assert data["probes"]["strata"] == ["captured"]
    assert all([s["name"] for s in layer["strata"]] == ["captured"] for layer in layers.values())

    cand = data["candidate"]
    assert cand["impl"] == "runtime-capture" and cand["dtype"] == "float32"
    ckpt = cand["checkpoint"]
    assert ckpt["format"] == "runtime-capture" and not ckpt.get("unchecked")
    runtime = ckpt["runtime"]
    assert runtime["name"] == "llama.cpp" and runtime["version"].startswith("xllamacpp ")
    assert runtime["tokens"] == len(TOKEN_IDS) == 17 and runtime["computes_in"] == ["float32"]
    nodes = runtime["nodes"]
    assert set(nodes) == expected and all(n["op"] == "RMS_NORM" and n["dtype"] == "float32" for n in nodes.values())
    # llama.cpp's own node names (llm_build_*: cb(cur, "attn_norm", il) ...) and its GGUF gain tensors
    assert nodes["model.layers.0.input_layernorm"]["node"] == "attn_norm-0"
    assert nodes["model.layers.1.input_layernorm"]["node"] == "attn_norm-1"
    assert nodes["model.layers.0.input_layernorm"]["gain_tensor"] == "blk.0.attn_norm.weight"
    assert nodes["model.norm"]["node"] == "result_norm" and nodes["model.norm"]["gain_tensor"] == "output_norm.weight"
    ffn = "pre_feedforward_layernorm" if model_type == "gemma3_text" else "post_attention_layernorm"
    assert nodes[f"model.layers.0.{ffn}"]["node"] == "ffn_norm-0"
    assert nodes[f"model.layers.0.{ffn}"]["gain_tensor"] == "blk.0.ffn_norm.weight"
    # a row a token for the hidden-width norms, every one kept (fewer than the 96 a layer keeps)
    for name, node in nodes.items():
        if "q_norm" not in name and "k_norm" not in name:
            assert node["rows_seen"] == node["rows"] == len(TOKEN_IDS), (name, node)
            assert layers[name]["dim"] == HIDDEN
    if model_type != "llama":
        # the q/k norms see a row per token and head: 17 tokens x 4 heads, 17 x 2 kv heads, head_dim wide
        q = nodes["model.layers.0.self_attn.q_norm"]
        k = nodes["model.layers.0.self_attn.k_norm"]
        assert q["node"] == "Qcur_normed-0" and q["gain_tensor"] == "blk.0.attn_q_norm.weight"
        assert k["node"] == "Kcur_normed-0" and k["gain_tensor"] == "blk.0.attn_k_norm.weight"
        assert q["rows_seen"] == len(TOKEN_IDS) * HEADS == 68 and k["rows_seen"] == len(TOKEN_IDS) * 2 == 34
        assert 0 < q["rows"] <= q["rows_seen"] and k["rows"] == 34
        assert layers["model.layers.0.self_attn.q_norm"]["dim"] == HEAD_DIM == 16
        tensors, _ = _capture_file(captures(model_type))
        assert tensors["x:model.layers.0.self_attn.q_norm"].shape == (q["rows"], HEAD_DIM)


# 2. the recorded numbers, checked here without parity

@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3_text"])
def test_the_recorded_rows_are_an_rms_norm_with_the_checkpoints_gain(model_type, models, captures):
    hf = models(model_type)
    hf_tensors = _hf_tensors(hf)
    tensors, meta = _capture_file(captures(model_type))
    names = _norm_names(hf)
    assert meta["runtime"] == "llama.cpp" and meta["tokens"] == 17
    assert set(meta["nodes"]) == names
    assert {k for k in tensors} == {f"{part}:{n}" for n in names for part in ("x", "y", "gain")}
    for name in sorted(names):
        node = meta["nodes"][name]
        assert node["kind"] == "rms_norm" and node["eps"] == float(np.float32(EPS)), (name, node["eps"])
        w = hf_tensors[f"{name}.weight"]
        assert w.dtype == np.float32
        # what llama.cpp holds: w, or Gemma's 1 + w baked in float32 by the converter
        gain_expected = np.float32(1.0) + w if model_type == "gemma3_text" else w
        gain = tensors[f"gain:{name}"]
        assert gain.dtype == np.float32 and np.array_equal(gain, gain_expected), name
        x, y = tensors[f"x:{name}"], tensors[f"y:{name}"]
        assert x.dtype == y.dtype == np.float32 and x.shape == y.shape and x.shape[1] == w.shape[0]
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + EPS) * gain_expected.astype(np.float64)
        err = np.abs(y.astype(np.float64) - ref)
        allowed = 1e-6 * np.abs(ref).max(-1, keepdims=True)  # float32 arithmetic, row by row
        assert (err <= allowed).all(), (name, float((err / allowed).max()))
        # and not another eps's output: the rows are sensitive to it (q/eps is tens, not millions)
        other = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * gain_expected.astype(np.float64)
        assert not (np.abs(y - other) <= allowed).all(), name

    if model_type == "llama":  # no embedding scale: block 0's input rows are the prompt's embedding rows
        embed = hf_tensors["model.embed_tokens.weight"]
        x0 = tensors["x:model.layers.0.input_layernorm"]
        assert x0.shape == (len(TOKEN_IDS), HIDDEN)
        matched = []
        for row in x0:
            hits = np.flatnonzero((embed == row).all(-1))
            assert len(hits) == 1, "a captured row is no single embedding row"
            matched.append(int(hits[0]))
        assert sorted(matched) == sorted(TOKEN_IDS)


# 3. a planted eps

def test_an_eps_written_into_the_gguf_fails_every_layer_and_is_read_from_llama_cpp(models, captures, tmp_path):
    hf = models("llama")
    r, data = _check(hf, captures("eps"), tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    planted = float(np.float32(1e-6))  # the GGUF stores a float32; llama.cpp's op_params hold that
    layers = _by_name(data)
    assert set(layers) == _norm_names(hf)
    for name, layer in layers.items():
        assert layer["status"] == "fail", name
        finding = next(f for f in layer["findings"] if f["code"] == "checkpoint_eps_mismatch")
        assert finding["candidate"]["value"] == planted and finding["reference"]["value"] == EPS
        diag = next(d for d in layer["diagnoses"] if d["code"] == "eps_mismatch")
        assert diag["estimated_eps"] == planted and diag["read_from_copy"] is True
        assert diag["configured_eps"] == EPS
        assert "llama.cpp" in diag["message"]
    assert data["candidate"]["eps"] == planted


# 4. two layers' gains swapped

def test_swapped_gains_fail_exactly_the_two_layers(models, captures, tmp_path):
    hf = models("llama")
    r, data = _check(hf, captures("swap"), tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    layers = _by_name(data)
    assert set(layers) == _norm_names(hf)
    failing = {name for name, layer in layers.items() if layer["status"] != "pass"}
    assert failing == set(SWAPPED)
    for name in SWAPPED:
        other = next(n for n in SWAPPED if n != name)
        layer = layers[name]
        assert layer["status"] == "fail"
        finding = next(f for f in layer["findings"] if f["code"] == "checkpoint_gain_of_other_layer")
        assert finding["layers"] == [other]
        diag = next(d for d in layer["diagnoses"] if d["code"] == "channel_gain_mismatch")
        assert diag["gain_of"] == other
    for name in set(layers) - set(SWAPPED):
        assert not layers[name]["findings"], (name, layers[name]["findings"])


# 5. Gemma's + 1 twice or not at all

@pytest.mark.parametrize("offset,error", [("twice", 1.0), ("missing", -1.0)])
def test_gemmas_offset_applied_twice_or_not_at_all(offset, error, models, captures, tmp_path):
    hf = models("gemma3_text")
    r, data = _check(hf, captures(offset), tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    layers = _by_name(data)
    assert set(layers) == _norm_names(hf)
    for name, layer in layers.items():
        assert layer["status"] == "fail", name
        diag = [d for d in layer["diagnoses"] if d["code"] == "weight_offset_mismatch"]
        assert len(diag) == 1 and diag[0]["offset_error"] == error, (name, layer["diagnoses"])
        assert "checkpoint_weight_mismatch" in _codes(layer["findings"])


# 6. bad input: one line, exit 2

def _one_line(r, *words):
    """Exit 2, no traceback; the error in one line, the last of stderr (a capture's stage lines,
    `parity capture: ...`, may come before it)."""
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and lines, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    assert all(line.startswith("parity capture: ") for line in lines[:-1]), r.stderr
    assert lines[-1].startswith("parity: error: "), r.stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])
    return lines[-1]


def test_a_file_that_is_not_a_capture_is_refused(models, tmp_path):
    hf = models("llama")
    r, data = _check(hf, hf / "model.safetensors", tmp_path)
    _one_line(r, "not a runtime capture")
    assert data is None and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("extra,flag", [(("--candidate", "torch"), "--candidate"), (("--dtype", "float16"), "--dtype")])
def test_a_capture_refuses_another_candidate_or_dtype(extra, flag, models, captures, tmp_path):
    r, data = _check(models("llama"), captures("llama"), tmp_path, *extra)
    assert flag in _one_line(r, "--runtime-capture") and data is None
    assert len(r.stderr.splitlines()) == 1


def test_capture_in_llama_cpp_needs_a_gguf(models, tmp_path):
    out = tmp_path / "cap.safetensors"
    r = run_parity("capture", models("llama"), "--runtime", "llama.cpp", "--prompt", PROMPT, "-o", out)
    _one_line(r, ".gguf")
    assert not out.exists()


def test_a_capture_of_another_model(models, captures, tmp_path):
    """The llama capture checked against the qwen3 checkpoint: the block and final norms share their
    names, so they pair by name and fail (the rows are llama's, the gains llama's, not qwen3's); the
    q/k norms qwen3 has are not in the capture. Refused (2) or a failure (1), never a pass or a crash."""
    hf = models("qwen3")
    r, data = _check(hf, captures("llama"), tmp_path)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    if r.returncode == 2:
        _one_line(r)
        assert data is None
        return
    assert r.returncode == 1, r.stdout + r.stderr
    layers = _by_name(data)
    shared = {n for n in _norm_names(hf) if "q_norm" not in n and "k_norm" not in n}
    assert set(layers) <= _norm_names(hf) and shared <= set(layers)
    assert all(layers[n]["status"] == "fail" for n in shared)
    assert not any(layer["status"] == "pass" for layer in layers.values())
    # the gains are llama's, not qwen3's; qwen3's q/k norms ran in no node of the capture: not checked
    assert all("checkpoint_weight_mismatch" in _codes(layers[n]["findings"]) for n in shared)
    unchecked = {u["name"] for u in data["candidate"]["checkpoint"]["unchecked"]}
    assert unchecked == _norm_names(hf) - shared and len(unchecked) == 4


# 7. hand-edited captures: what a runtime could have done that the recorded parameters do not say

def _rewritten(cap, out, edit):
    """The capture with `edit(tensors, meta)` applied (numpy tensors, the metadata dict), written as
    `parity capture` writes one (safetensors, metadata key parity-runtime)."""
    import json

    from safetensors.numpy import save_file

    tensors, meta = _capture_file(cap)
    edit(tensors, meta)
    save_file(tensors, str(out), metadata={"parity-runtime": json.dumps(meta)})
    return out


def _rms(x, eps, gain, bias=None, centre=False):
    """The float64 norm of the rows, rounded to float32 as a runtime hands its outputs back."""
    x = x.astype(np.float64)
    if centre:
        x = x - x.mean(-1, keepdims=True)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gain.astype(np.float64)
    return (y if bias is None else y + bias).astype(np.float32)


LAYER = "model.layers.0.input_layernorm"


def _every_layer(fn):
    def edit(tensors, meta):
        for name, node in meta["nodes"].items():
            fn(name, node, tensors)
    return edit


def test_a_kernel_using_another_eps_than_its_node_records_is_estimated(models, captures, tmp_path):
    """The node records 1e-5 but computes with 1e-6: its own parameters do not reproduce its rows, the
    rows are fitted, and eps ~ 1e-6 is named as estimated, beside the 1e-5 the node records."""
    def kernel_eps(name, node, t):
        t[f"y:{name}"] = _rms(t[f"x:{name}"], 1e-6, t[f"gain:{name}"])

    cap = _rewritten(captures("llama"), tmp_path / "k.safetensors", _every_layer(kernel_eps))
    r, data = _check(models("llama"), cap, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    for layer in data["layers"]:
        assert layer["status"] == "fail" and "checkpoint_eps_mismatch" not in _codes(layer["findings"])
        eps = [d for d in layer["diagnoses"] if d["code"] == "eps_mismatch"]
        assert eps and eps[0]["estimated_eps"] == pytest.approx(1e-6, rel=0.05), layer["diagnoses"]
        assert eps[0]["recorded_eps"] == pytest.approx(float(np.float32(EPS)), rel=1e-6)
        assert not eps[0].get("read_from_copy")


def test_a_bias_and_a_mean_the_runtime_adds_are_named(models, captures, tmp_path):
    rng = np.random.default_rng(7)

    def with_bias(tensors, meta):
        b = (0.05 * rng.standard_normal(HIDDEN)).astype(np.float32)
        tensors[f"bias:{LAYER}"] = b
        meta["nodes"][LAYER]["bias_tensor"] = "blk.0.attn_norm.bias"
        tensors[f"y:{LAYER}"] = _rms(tensors[f"x:{LAYER}"], EPS, tensors[f"gain:{LAYER}"], b.astype(np.float64))

    def layer_norm(tensors, meta):
        meta["nodes"][LAYER].update(kind="layer_norm", op="NORM")
        tensors[f"y:{LAYER}"] = _rms(tensors[f"x:{LAYER}"], EPS, tensors[f"gain:{LAYER}"], centre=True)

    for edit, code in ((with_bias, "bias_mismatch"), (layer_norm, "mean_subtracted")):
        cap = _rewritten(captures("llama"), tmp_path / f"{code}.safetensors", edit)
        r, data = _check(models("llama"), cap, tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        layers = _by_name(data)
        assert _codes(layers[LAYER]["diagnoses"]) == [code]
        assert [n for n, layer in layers.items() if layer["status"] == "fail"] == [LAYER]


def test_a_kernel_fault_on_real_rows_is_not_said_to_be_about_small_inputs(models, captures, tmp_path):
    """Every output 0.4 % high on every row: all the captured rows fail, so nothing says the fault is
    confined to small q/eps (real rows sit at q/eps < 1e4, the old rule of thumb's threshold)."""
    def scaled(name, node, t):
        t[f"y:{name}"] = (t[f"y:{name}"].astype(np.float64) * 1.004).astype(np.float32)

    cap = _rewritten(captures("llama"), tmp_path / "s.safetensors", _every_layer(scaled))
    r, data = _check(models("llama"), cap, tmp_path)
    assert r.returncode == 1
    for layer in data["layers"]:
        assert layer["status"] == "fail"
        assert "symptom_small_inputs" not in _codes(layer["diagnoses"]), layer["diagnoses"]
        assert "eps_mismatch" not in _codes(layer["diagnoses"])


@pytest.mark.parametrize("case", ["nan_row", "dtype_lie", "computes_in", "rows_text", "zero_width", "duplicate",
                                  "no_runtime"])
def test_hostile_captures_are_one_line(case, models, captures, tmp_path):
    def edit(tensors, meta):
        node = meta["nodes"][LAYER]
        if case == "nan_row":
            tensors[f"x:{LAYER}"][0, 0] = np.nan
        elif case == "dtype_lie":  # float32 rows said to be bfloat16
            node["dtype"] = "bfloat16"
        elif case == "computes_in":
            meta["computes_in"] = "float32"
        elif case == "rows_text":
            node["rows"] = "many"
        elif case == "zero_width":
            for part in ("x", "y"):
                tensors[f"{part}:{LAYER}"] = np.zeros((3, 0), np.float32)
        elif case == "no_runtime":
            del meta["runtime"]
        elif case == "duplicate":  # a second node that pairs with the same layer (an export's prefix set aside)
            meta["nodes"]["m." + LAYER] = dict(node)
            for part in ("x", "y", "gain"):
                tensors[f"{part}:m.{LAYER}"] = tensors[f"{part}:{LAYER}"].copy()

    cap = _rewritten(captures("llama"), tmp_path / f"{case}.safetensors", edit)
    rep = tmp_path / "r.json"
    r = run_parity("check", models("llama"), "--runtime-capture", cap, "--json", rep)
    _one_line(r, str(cap.name))
    assert not rep.exists()


def test_a_prompt_llama_cpp_cannot_tokenize_is_one_line(captures, models, tmp_path):
    """This vocabulary has no byte pieces: llama.cpp's tokenizer throws inside C++ on "hi", which
    aborts the process it runs in; parity runs it in a child and says so in one line."""
    from parity_cli.sources.synthetic import hf_to_gguf

    gguf_path = hf_to_gguf(models("llama"), tmp_path / "m.gguf", full=True)
    out = tmp_path / "o.safetensors"
    r = run_parity("capture", gguf_path, "--runtime", "llama.cpp", "--prompt", "hi", "-o", out)
    assert r.returncode == 2 and "llama.cpp stopped" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_tokens_over_several_chunks_and_the_models_context(models, tmp_path):
    """Chunks of 5 tokens (each decoded twice, the first decode's KV cells removed): the rows of all
    four chunks are recorded and pass; tokens past the model's 512-token context are cut, and said."""
    from parity_cli import api
    from parity_cli.backends import llama_graph
    from parity_cli.probes import runtime_capture
    from parity_cli.sources.synthetic import hf_to_gguf

    gguf_path = hf_to_gguf(models("llama"), tmp_path / "m.gguf", full=True)
    raw = llama_graph.record(gguf_path, TOKEN_IDS, None, 64, chunk=5)
    assert raw["tokens"] == 17 and all(n["x"].shape[0] == 17 for n in raw["nodes"])
    tensors, meta = runtime_capture.record(gguf_path, "llama.cpp", tokens=TOKEN_IDS * 40, max_tokens=680)
    assert meta["tokens"] == 512 and "680 tokens cut to the model's context of 512" in meta["note"]
    runtime_capture.write(tensors, meta, tmp_path / "c.safetensors")
    report = api.check(models("llama"), runtime_capture=str(tmp_path / "c.safetensors"))
    assert report.exit_code == 0


def test_a_fifo_or_a_lying_header_is_one_line(models, captures, tmp_path):
    """A FIFO given as the capture or the token file is refused before anything reads it (a read
    would block); a file whose 8-byte header claims 2^60 bytes of header is no capture."""
    import os
    import struct

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r, data = _check(models("llama"), fifo, tmp_path)
    _one_line(r, "fifo")
    lying = tmp_path / "lying.safetensors"
    lying.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    r, data = _check(models("llama"), lying, tmp_path)
    _one_line(r, "not a runtime capture")
    from parity_cli.sources.synthetic import hf_to_gguf

    gguf_path = hf_to_gguf(models("llama"), tmp_path / "m.gguf", full=True)
    out = tmp_path / "o.safetensors"
    r = run_parity("capture", gguf_path, "--runtime", "llama.cpp", "--tokens", fifo, "-o", out)
    _one_line(r, "fifo")
    assert not out.exists()


def test_a_capture_keeps_its_rows_per_layer_whatever_the_tokens(models, tmp_path):
    """llama.cpp's child samples chunk by chunk: 300 tokens in chunks of 256 (the default context
    allows 512), at most 6 rows kept a node, every token seen; the library refuses 2 rows."""
    from parity_cli.errors import InputError
    from parity_cli.probes import runtime_capture
    from parity_cli.sources.synthetic import hf_to_gguf

    gguf_path = hf_to_gguf(models("llama"), tmp_path / "m.gguf", full=True)
    ids = [BOS] + [PIECES.index(f"\u2581w{i % 40}") for i in range(299)]
    tensors, meta = runtime_capture.record(gguf_path, "llama.cpp", tokens=ids, max_tokens=300, rows_per_layer=6)
    assert meta["tokens"] == 300 and set(meta["nodes"]) == _norm_names(models("llama"))
    for name, node in meta["nodes"].items():
        assert node["rows_seen"] == 300 and 1 <= node["rows"] <= 6, (name, node)
        assert tensors[f"x:{name}"].shape == (node["rows"], HIDDEN)
    with pytest.raises(InputError, match="--rows-per-layer"):
        runtime_capture.record(gguf_path, "llama.cpp", tokens=ids, rows_per_layer=2)


def test_llama_cpps_child_runs_this_parity_whatever_the_working_directory(models, tmp_path, monkeypatch):
    """The child is `python -m parity_cli.backends.llama_graph`, and `-m` puts the working directory
    first on the path: a directory holding another parity_cli (here one whose llama_graph exits 3)
    must not be what runs. A relative model path still names the file from the caller's directory."""
    from parity_cli.backends import llama_graph
    from parity_cli.sources.synthetic import hf_to_gguf

    hf_to_gguf(models("llama"), tmp_path / "m.gguf", full=True)
    other = tmp_path / "parity_cli" / "backends"
    other.mkdir(parents=True)
    (tmp_path / "parity_cli" / "__init__.py").write_text("")
    (other / "__init__.py").write_text("")
    (other / "llama_graph.py").write_text("raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    raw = llama_graph.record("m.gguf", TOKEN_IDS, None, 64)
    assert raw["tokens"] == 17 and len(raw["nodes"]) == 5
