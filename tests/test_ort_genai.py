"""Issue 51, ONNX Runtime GenAI's model builder: what `python -m onnxruntime_genai.models.builder -m
HF_DIR -o OUT -p fp32|fp16 -e cpu` writes (model.onnx with SimplifiedLayerNormalization and
SkipSimplifiedLayerNormalization, external data, genai_config.json), its `python -m` entry point run
with its own arguments, then
checked two ways against the source: as a copy (`--candidate-checkpoint OUT/model.onnx`, the builder
named from the graph's producer) and inside ONNX Runtime on tokens (`parity capture
OUT/model.onnx --runtime onnxruntime`, at the precision it was built for).

The source is a tiny Llama transformers writes at bfloat16, with a word-level tokenizer the builder
copies beside the graph. The builder's GroupQueryAttention takes an empty KV cache whose head axis
the graph leaves symbolic (kv_cache_dim): the capture reads the head size from genai_config.json."""

import pytest
from conftest import all_pass, capture_inside, check_with_report
from exporters import ort_genai_build

pytest.importorskip("onnxruntime_genai", reason="needs onnxruntime-genai: pip install onnxruntime-genai")

PROMPT = " ".join(f"w{i % 40}" for i in range(12))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Factory: (source, the builder's output directory) for a precision, built once for the module."""
    from parity_cli.sources.synthetic import write_runnable

    root = tmp_path_factory.mktemp("ort-genai")
    src = write_runnable(root / "llama", "llama", layers=2, hidden=64, eps=1e-5, dtype="bfloat16", tokenizer=True)
    made = {}

    def get(precision):
        if precision not in made:
            out = root / f"llama-{precision}"
            ort_genai_build("-m", src, "-o", out, "-p", precision, "-e", "cpu", "-c", root / "cache")
            assert (out / "model.onnx").is_file() and (out / "genai_config.json").is_file()
            made[precision] = out
        return src, made[precision]

    return get


@pytest.mark.parametrize("precision, computes_in", [("fp32", "float32"), ("fp16", "float16")])
def test_a_built_model_passes_as_a_copy_and_inside_onnx_runtime(built, tmp_path, precision, computes_in):
    src, out = built(precision)
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", out / "model.onnx")
    assert r.returncode == 0 and all_pass(data), r.stdout[-3000:]
    described = data["candidate"]["checkpoint"]
    assert described["exporter"].startswith("onnxruntime-genai ")
    # the Llama's five norms (two blocks of two, and the final one), each of them passing
    norms = ["model.norm"] + [f"model.layers.{i}.{n}_layernorm" for i in (0, 1) for n in ("input", "post_attention")]
    assert {layer["name"]: layer["status"] for layer in data["layers"]} == dict.fromkeys(norms, "pass")
    cap = capture_inside("onnxruntime", out / "model.onnx", tmp_path, PROMPT)
    r, data = check_with_report(tmp_path, src, "--runtime-capture", cap)
    assert r.returncode == 0 and all_pass(data), r.stdout[-3000:]
    runtime = data["candidate"]["checkpoint"]["runtime"]
    assert runtime["name"] == "onnxruntime" and runtime["computes_in"] == [computes_in]
    assert {layer["name"]: layer["status"] for layer in data["layers"]} == dict.fromkeys(norms, "pass")


def test_an_eps_planted_in_the_built_graph_is_named_as_a_copy_and_inside_onnx_runtime(built, tmp_path):
    """Every norm node's epsilon attribute set to 1e-6 on a model trained at 1e-5 (the external data
    file is left where the graph names it)."""
    import shutil

    import onnx

    src, out = built("fp32")
    copy = tmp_path / "planted"
    shutil.copytree(out, copy)
    model = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    planted = 0
    for node in model.graph.node:
        if node.op_type.endswith("SimplifiedLayerNormalization"):
            for attribute in node.attribute:
                if attribute.name == "epsilon":
                    attribute.f, planted = 1e-6, planted + 1
    assert planted == 5
    onnx.save(model, str(copy / "model.onnx"))
    r, data = check_with_report(tmp_path, src, "--candidate-checkpoint", copy / "model.onnx")
    assert r.returncode == 1 and all("eps_mismatch" in {d["code"] for d in layer["diagnoses"]}
                                     for layer in data["layers"]), r.stdout[-2000:]
    cap = capture_inside("onnxruntime", copy / "model.onnx", tmp_path, PROMPT)
    r, data = check_with_report(tmp_path, src, "--runtime-capture", cap)
    assert r.returncode == 1
    for layer in data["layers"]:
        diagnosis = next(d for d in layer["diagnoses"] if d["code"] == "eps_mismatch")
        assert diagnosis["estimated_eps"] == pytest.approx(1e-6) and diagnosis["read_from_copy"] is True


def test_a_genai_config_that_is_a_fifo_is_one_line_not_a_hang(built, tmp_path):
    """The head size is read from genai_config.json beside the graph: a FIFO there would block the
    first read for ever; it is refused in one line naming the file, before ONNX Runtime runs."""
    import os
    import shutil

    from conftest import run_parity

    _, out = built("fp32")
    copy = tmp_path / "fifo"
    shutil.copytree(out, copy)
    (copy / "genai_config.json").unlink()
    os.mkfifo(copy / "genai_config.json")
    r = run_parity("capture", copy / "model.onnx", "--runtime", "onnxruntime", "--prompt", PROMPT,
                   "-o", tmp_path / "c.safetensors")
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and lines[-1].startswith("parity: error: "), r.stderr
    assert "genai_config.json" in lines[-1] and "not a regular file" in lines[-1], r.stderr
    assert not (tmp_path / "c.safetensors").exists()
