"""Issue 38: inside ONNX Runtime and OpenVINO. A whole tiny Llama exported by torch.onnx (and that
graph converted by OpenVINO), run by each runtime with every norm's input and output made graph
outputs; the rows judged against the HF checkpoint's oracle. The planted fault is an eps the
export holds (1e-6 written over every 1e-5 constant of the graph), which each runtime then uses."""

import json

import numpy as np
import pytest
from conftest import SLOW, load_json, run_parity

pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
# whole-model ONNX and OpenVINO exports for each case (module fixtures): `--tier slow` (issue 49)
pytestmark = SLOW

TOKENS = [2] + [17 + (7 * i) % 40 for i in range(23)]  # BOS, then "▁wK" pieces (ids 17 + K), 24 in all


def _export(hf, out):
    """The model with input_ids and an all-ones attention_mask as inputs (transformers 5.25 cannot
    export its mask creation without one), TorchScript exporter, opset 17."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits

    ids = torch.tensor([TOKENS[:5]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(model), (ids, torch.ones_like(ids)), str(out), dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"],
                          dynamic_axes={"input_ids": {1: "n"}, "attention_mask": {1: "n"}})
    return out


def _planted(src, out, old=1e-5, new=1e-6):
    """Every scalar float constant of the graph equal to float32(old) rewritten as new: the eps each
    norm adds to its mean square. Returns how many were rewritten."""
    from onnx import numpy_helper

    m = onnx.load(str(src))
    hits = 0
    tensors = list(m.graph.initializer) + [a.t for n in m.graph.node if n.op_type == "Constant" for a in n.attribute
                                           if a.name == "value"]
    for t in tensors:
        a = numpy_helper.to_array(t)
        if a.size == 1 and a.dtype == np.float32 and a.reshape(-1)[0] == np.float32(old):
            t.CopyFrom(numpy_helper.from_array(np.full(a.shape, new, np.float32), t.name))
            hits += 1
    onnx.save(m, str(out))
    return hits


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from parity_cli.sources.synthetic import write_runnable

    root = tmp_path_factory.mktemp("graphs")
    hf = write_runnable(root / "llama", "llama", eps=1e-5, seed=11)
    made = {"hf": hf, "onnx": _export(hf, root / "llama.onnx")}
    made["hits"] = _planted(made["onnx"], root / "eps.onnx")
    made["eps.onnx"] = root / "eps.onnx"
    (root / "tokens.txt").write_text(" ".join(map(str, TOKENS)))
    made["tokens"] = root / "tokens.txt"
    try:
        import openvino as ov
    except ImportError:
        return made
    for name in ("llama", "eps"):
        ov.save_model(ov.convert_model(str(root / f"{name}.onnx")), str(root / f"{name}.xml"), compress_to_fp16=False)
    ov.save_model(ov.convert_model(str(made["onnx"])), str(root / "fp16.xml"))  # OpenVINO's default: f16 weights
    made.update({"xml": root / "llama.xml", "eps.xml": root / "eps.xml", "fp16.xml": root / "fp16.xml"})
    return made


def _precision(runtime):
    """OpenVINO's CPU plugin runs bf16 by default on a CPU with avx512_bf16/AMX: these tests name f32,
    so that what they expect holds on every CPU (the precision tests below cover the others)."""
    return "f32" if runtime == "openvino" else None


def _capture(model, runtime, tokens, out, cli=False, precision=None):
    """A capture written by the library (the command itself once per runtime: cli=True)."""
    if cli:
        more = ["--precision", precision] if precision else []
        r = run_parity("capture", model, "--runtime", runtime, "--tokens", tokens, "-o", out, *more)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"{len(TOKENS)} tokens in {runtime}" in " ".join(r.stdout.split())
        if precision:
            assert f"inference precision {precision} (--precision {precision})" in " ".join(r.stdout.split())
        return out
    from parity_cli.probes import runtime_capture

    ids = [int(t) for t in open(tokens).read().split()]
    tensors, meta = runtime_capture.record(model, runtime, tokens=ids, precision=precision)
    runtime_capture.write(tensors, meta, out)
    return out


def _check(hf, cap):
    """(exit code, the JSON report as written) of `parity check HF --runtime-capture CAP`, in process."""
    from parity_cli import api
    from parity_cli.check.results import _jsonable

    report = api.check(hf, runtime_capture=str(cap))
    return report.exit_code, json.loads(json.dumps(_jsonable(report.to_dict())))


def _norm_names(hf):
    from safetensors import safe_open

    with safe_open(f"{hf}/model.safetensors", framework="pt") as fh:
        return sorted(k[: -len(".weight")] for k in fh.keys() if k.endswith("norm.weight"))


def _oracle_rows(cap, layer, eps, gain):
    """The capture's (x, y) of a layer, and y computed here in float64 from x with the given eps and gain."""
    from safetensors.numpy import load_file

    t = load_file(str(cap))
    x, y = t[f"x:{layer}"].astype(np.float64), t[f"y:{layer}"].astype(np.float64)
    return x, y, x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gain


RUNTIMES = [("onnxruntime", "onnx", "eps.onnx"), ("openvino", "xml", "eps.xml")]


@pytest.mark.parametrize("runtime,faithful,planted", RUNTIMES)
def test_a_faithful_export_passes_inside_its_runtime(exports, tmp_path, runtime, faithful, planted):
    if faithful not in exports:
        pytest.skip("openvino is not installed")
    cap = _capture(exports[faithful], runtime, exports["tokens"], tmp_path / "cap.safetensors", cli=True,
                   precision=_precision(runtime))
    rep = tmp_path / "r.json"
    r = run_parity("check", exports["hf"], "--runtime-capture", cap, "--json", rep)
    assert r.returncode == 0, r.stdout + r.stderr
    data = load_json(rep)
    names = _norm_names(exports["hf"])
    assert sorted(layer["name"] for layer in data["layers"]) == names
    assert all(layer["status"] == "pass" for layer in data["layers"])
    recorded = data["candidate"]["checkpoint"]["runtime"]
    assert recorded["name"] == runtime and recorded["tokens"] == len(TOKENS)
    # the export names every norm inside its wrapper (m.model.layers.0...): paired by name, prefix set aside
    assert all(n["recorded_as"] == "m." + name and n["paired_by"] == "name" for name, n in recorded["nodes"].items())
    assert all(n["rows_seen"] == len(TOKENS) for n in recorded["nodes"].values())
    # the rows are the runtime's: y is the float64 norm of x with the checkpoint's own eps and gain
    from safetensors.numpy import load_file

    gains = load_file(f"{exports['hf']}/model.safetensors")
    x, y, expected = _oracle_rows(cap, "m.model.norm", 1e-5, gains["model.norm.weight"].astype(np.float64))
    assert np.abs(y - expected).max() <= 1e-6 * np.abs(expected).max()
    assert float((x * x).mean(-1).min()) > 0


@pytest.mark.parametrize("runtime,faithful,planted", RUNTIMES)
def test_an_eps_planted_in_the_export_is_named_on_every_layer(exports, tmp_path, runtime, faithful, planted):
    if planted not in exports:
        pytest.skip("openvino is not installed")
    assert exports["hits"] == 5  # one eps constant per norm: 2 blocks x 2 + the final norm
    cap = _capture(exports[planted], runtime, exports["tokens"], tmp_path / "cap.safetensors",
                   precision=_precision(runtime))
    code, data = _check(exports["hf"], cap)
    assert code == 1
    used = float(np.float32(1e-6))
    assert len(data["layers"]) == 5
    for layer in data["layers"]:
        assert layer["status"] == "fail"
        eps = [d for d in layer["diagnoses"] if d["code"] == "eps_mismatch"]
        assert eps and eps[0]["estimated_eps"] == pytest.approx(used, rel=1e-6) and eps[0]["read_from_copy"]
        assert runtime in eps[0]["message"]
        found = [f for f in layer["findings"] if f["code"] == "checkpoint_eps_mismatch"]
        assert found and found[0]["candidate"]["value"] == pytest.approx(used, rel=1e-6)


def test_openvinos_default_f16_weights_are_the_runtimes_gains(exports, tmp_path):
    """ov.save_model compresses weights to f16 by default: the runtime multiplies by gains rounded to
    float16, which parity reads from the IR and names; each recorded row follows those gains."""
    if "fp16.xml" not in exports:
        pytest.skip("openvino is not installed")
    import torch
    from safetensors.numpy import load_file

    cap = _capture(exports["fp16.xml"], "openvino", exports["tokens"], tmp_path / "cap.safetensors", precision="f32")
    code, data = _check(exports["hf"], cap)
    assert code == 1
    w = load_file(f"{exports['hf']}/model.safetensors")["model.norm.weight"]
    rounded = torch.from_numpy(w).half().double().numpy()
    assert not np.array_equal(rounded, w.astype(np.float64))  # the float32 gains are no float16 values
    _, y, expected = _oracle_rows(cap, "m.model.norm", 1e-5, rounded)
    assert np.abs(y - expected).max() <= 1e-6 * np.abs(expected).max()
    norm = next(layer for layer in data["layers"] if layer["name"] == "model.norm")
    assert [d["code"] for d in norm["diagnoses"]] == ["channel_gain_mismatch"]
    assert norm["diagnoses"][0]["lost_to"] == "float16"


def _plugin_runs(precision):
    """The inference precision OpenVINO's CPU plugin itself reports for a one-op model compiled with
    this hint (None: none given), read from OpenVINO, not from parity."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as op

    x = op.parameter([-1, 4], ov.Type.f32)
    compiled = ov.Core().compile_model(ov.Model([op.multiply(x, op.constant(np.float32(3.0)))], [x]), "CPU",
                                       {} if precision is None else {"INFERENCE_PRECISION_HINT": precision})
    return compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()


DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


@pytest.mark.parametrize("asked", [None, "bf16", "f16"])
def test_an_openvino_capture_is_judged_at_the_precision_its_plugin_ran(exports, tmp_path, asked):
    """The plugin's own precision (its default, or the one asked for: a CPU without bf16 or f16
    support runs f32 whatever is asked) is recorded, stated, and is the dtype the rows are judged at:
    never a refusal of parity's own capture. At f32 the faithful export passes."""
    if "xml" not in exports:
        pytest.skip("openvino is not installed")
    runs = _plugin_runs(asked)
    cap = tmp_path / "cap.safetensors"
    more = ["--precision", asked] if asked else []
    r = run_parity("capture", exports["xml"], "--runtime", "openvino", "--tokens", exports["tokens"], "-o", cap, *more)
    assert r.returncode == 0, r.stdout + r.stderr
    said = " ".join(r.stdout.split())
    if asked and runs != asked:
        assert f"--precision {asked} was asked; the CPU plugin ran at {runs}" in said
    else:
        assert f"ran at inference precision {runs} ({f'--precision {asked}' if asked else 'the plugin'}" in said
    from safetensors import safe_open

    with safe_open(str(cap), "pt") as fh:
        meta = json.loads(fh.metadata()["parity-runtime"])
    assert meta["precision"]["runs"] == runs and meta["precision"]["asked"] == asked
    assert meta["computes_in"] == [DTYPES[runs]]
    code, data = _check(exports["hf"], cap)
    assert code != 2  # a verdict, never a refusal of parity's own capture
    assert data["candidate"]["dtype"] == DTYPES[runs]
    assert sorted(layer["name"] for layer in data["layers"]) == _norm_names(exports["hf"])
    # weak-ok: below f32 the verdict is the CPU's (bf16/f16 kernels differ by ISA); what holds on every CPU is a
    # verdict with no finding of the capture itself, never a refusal; at f32 it is a pass (below)
    assert all(not layer["findings"] and layer["status"] in ("pass", "fail") for layer in data["layers"])
    if runs == "f32":  # the kernels at full precision: the faithful export passes
        assert code == 0 and all(layer["status"] == "pass" for layer in data["layers"])


def _edited(cap, out, dtype, rows_in, y_of):
    """The capture with every node said to compute in `dtype` (rows handed out as `rows_in`) and its
    y rows replaced by y_of(layer, x)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(cap), "pt") as fh:
        meta, tensors = json.loads(fh.metadata()["parity-runtime"]), {k: fh.get_tensor(k) for k in fh.keys()}
    for name, node in meta["nodes"].items():
        node["dtype"] = dtype
        if rows_in:
            node["rows_in"] = rows_in
        tensors[f"y:{name}"] = y_of(name, tensors[f"x:{name}"].double()).float()
    meta["computes_in"] = [dtype]
    save_file(tensors, str(out), metadata={"parity-runtime": json.dumps(meta)})
    return out


def test_float32_rows_of_a_bf16_plugin_are_judged_at_bf16_not_refused(exports, tmp_path):
    """What OpenVINO hands out at bf16 on an AMX CPU, on any CPU: a node computing in bf16 whose input
    rows come out as float32 values (the plugin keeps some nodes at f32). With rows_in float32 the
    rows are judged as recorded at bfloat16's tolerance; y here is a correct bf16 RMSNorm's (the
    float64 norm of those rows with the gain rounded to bfloat16, rounded once to bfloat16). A
    capture that says its rows are bf16 values when they are not is still refused."""
    if "xml" not in exports:
        pytest.skip("openvino is not installed")
    import torch
    from safetensors.numpy import load_file

    gains = {f"m.{k.removesuffix('.weight')}": torch.from_numpy(v).double()
             for k, v in load_file(f"{exports['hf']}/model.safetensors").items() if k.endswith("norm.weight")}

    def bf16_rms_norm(name, x):
        out = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * gains[name].to(torch.bfloat16).double()
        return out.to(torch.bfloat16)

    cap = _capture(exports["xml"], "openvino", exports["tokens"], tmp_path / "cap.safetensors", precision="f32")
    x = load_file(str(cap))["x:m.model.norm"]
    assert not np.array_equal(torch.from_numpy(x).bfloat16().float().numpy(), x)  # float32 rows, no bf16 values
    judged = _edited(cap, tmp_path / "bf16.safetensors", "bfloat16", "float32", bf16_rms_norm)
    code, data = _check(exports["hf"], judged)
    assert code == 0 and data["candidate"]["dtype"] == "bfloat16"
    assert len(data["layers"]) == 5 and all(layer["status"] == "pass" for layer in data["layers"])
    lying = _edited(cap, tmp_path / "lying.safetensors", "bfloat16", None, bf16_rms_norm)
    r = run_parity("check", exports["hf"], "--runtime-capture", lying)
    assert r.returncode == 2 and "x rows are said to be computed in bfloat16 but hold other values" in r.stderr
    bad = _edited(cap, tmp_path / "bad.safetensors", "bfloat16", "float16", bf16_rms_norm)
    r = run_parity("check", exports["hf"], "--runtime-capture", bad)
    assert r.returncode == 2 and "'rows_in' is 'float16'" in r.stderr and "Traceback" not in r.stderr


def test_precision_is_openvinos_alone_and_one_of_its_three(exports, tmp_path):
    out = tmp_path / "c.safetensors"
    r = run_parity("capture", exports["onnx"], "--runtime", "onnxruntime", "--tokens", exports["tokens"], "-o", out,
                   "--precision", "f32")
    assert r.returncode == 2 and "--precision" in r.stderr and "openvino" in r.stderr and not out.exists()
    r = run_parity("capture", exports["onnx"], "--runtime", "openvino", "--tokens", exports["tokens"], "-o", out,
                   "--precision", "f64")
    assert r.returncode == 2 and "f64" in r.stderr and "Traceback" not in r.stderr and not out.exists()
    from parity_cli.errors import InputError
    from parity_cli.probes import runtime_capture

    with pytest.raises(InputError, match="--precision: onnxruntime has no inference precision"):
        runtime_capture.record(exports["onnx"], "onnxruntime", tokens=TOKENS, precision="bf16")


def test_bad_graph_captures_are_one_line(exports, tmp_path):
    out = tmp_path / "c.safetensors"
    r = run_parity("capture", exports["hf"], "--runtime", "onnxruntime", "--tokens", exports["tokens"], "-o", out)
    assert r.returncode == 2 and "runs an .onnx file" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    r = run_parity("capture", exports["onnx"], "--runtime", "onnxruntime", "--prompt", "w1 w2", "-o", out)
    assert r.returncode == 2 and "tokenizer.json" in r.stderr and not out.exists()
    bad = tmp_path / "bad.txt"
    bad.write_text("2 17 x")
    r = run_parity("capture", exports["onnx"], "--runtime", "onnxruntime", "--tokens", bad, "-o", out)
    assert r.returncode == 2 and "whitespace-separated integers" in r.stderr and not out.exists()


def test_an_export_with_external_data_runs_where_its_data_lies(exports, tmp_path):
    """Weights in a file beside the graph (how exports past protobuf's 2 GB are stored): the copy
    with the extra outputs reads them where they are, and passes as the inline export does."""
    m = onnx.load(str(exports["onnx"]))
    onnx.save(m, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    assert (tmp_path / "ext.data").stat().st_size > (tmp_path / "ext.onnx").stat().st_size
    cap = _capture(tmp_path / "ext.onnx", "onnxruntime", exports["tokens"], tmp_path / "cap.safetensors")
    code, data = _check(exports["hf"], cap)
    assert code == 0 and len(data["layers"]) == 5


def test_a_tokenizer_that_is_a_fifo_or_too_large_is_one_line(exports, tmp_path):
    import os
    import shutil

    model = tmp_path / "llama.onnx"
    shutil.copy(exports["onnx"], model)
    os.mkfifo(tmp_path / "tokenizer.json")
    out = tmp_path / "c.safetensors"
    r = run_parity("capture", model, "--runtime", "onnxruntime", "--prompt", "w1 w2", "-o", out)
    assert r.returncode == 2 and "tokenizer.json" in r.stderr and "Traceback" not in r.stderr and not out.exists()
    os.remove(tmp_path / "tokenizer.json")
    with open(tmp_path / "tokenizer.json", "wb") as fh:  # sparse: 65 MiB declared, nothing written
        fh.truncate((64 << 20) + (1 << 20))
    r = run_parity("capture", model, "--runtime", "onnxruntime", "--prompt", "w1 w2", "-o", out)
    assert r.returncode == 2 and "64 MiB" in r.stderr and not out.exists()
