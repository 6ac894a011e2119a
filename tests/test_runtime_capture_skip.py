"""Issue 46, item 5: ONNX Runtime's fused residual norms inside a capture. An ORT-optimised BERT
export (the all-MiniLM-L6-v2 shape: 6 layers, 13 LayerNorms; random weights from a tiny config)
holds 12 SkipLayerNormalization nodes, which normalise input + skip + bias, not their first input.
The capture records that sum as x (computed as ORT's CPU kernel computes it) and the sum the node
hands on (input_skip_bias_sum), which is judged against it. Expected values here come from the HF
model itself (its LayerNorms' own inputs, read by forward hooks) and float64 LayerNorms of them."""

import json

import numpy as np
import pytest
from conftest import SLOW, load_json, run_parity

pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

TOKENS = [2] + [5 + (11 * i) % 90 for i in range(15)]  # 16 ids of the 100-word vocabulary
HIDDEN, HEADS, LAYERS = 32, 4, 6
SWAPPED = ("encoder.layer.1.attention.output.LayerNorm", "encoder.layer.3.output.LayerNorm")


def _bert(root):
    """The HF checkpoint (every LayerNorm gain, bias and dense bias drawn at random, so no two norms
    agree and every Skip node has a bias to add) and its TorchScript export."""
    import warnings

    import torch
    import transformers

    torch.manual_seed(3)
    config = transformers.BertConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, vocab_size=100, max_position_embeddings=64,
                                     layer_norm_eps=1e-12)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:  # values float16 holds: a float16 export keeps the checkpoint's gains
                p.copy_(((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p)).half().float())
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(root / "hf")

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, mask, types):
            return self.m(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state

    ids = torch.tensor([TOKENS[:5]])
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Hidden(model).eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(root / "bert.onnx"),
                          dynamo=False, opset_version=17, input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes={n: {1: "n"} for n in names})
    return model


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from onnxruntime.transformers.optimizer import optimize_model

    root = tmp_path_factory.mktemp("bert")
    model = _bert(root)
    optimized = optimize_model(str(root / "bert.onnx"), model_type="bert", num_heads=HEADS, hidden_size=HIDDEN)
    optimized.save_model_to_file(str(root / "opt.onnx"))
    optimized.convert_float_to_float16(keep_io_types=True)
    optimized.save_model_to_file(str(root / "fp16.onnx"))
    for name in ("opt.onnx", "fp16.onnx"):
        ops = [n.op_type for n in onnx.load(str(root / name)).graph.node]
        # what this file is about: ORT's optimiser fused every residual add into its LayerNorm
        assert ops.count("SkipLayerNormalization") == 2 * LAYERS and ops.count("LayerNormalization") == 1
    (root / "tokens.txt").write_text(" ".join(map(str, TOKENS)))
    model.eval()  # an export restores the wrapper's training mode: no dropout in the rows below
    return {"root": root, "hf": root / "hf", "onnx": root / "bert.onnx", "opt": root / "opt.onnx",
            "fp16": root / "fp16.onnx",
            "tokens": root / "tokens.txt", "inputs": _norm_inputs(model)}


def _norm_inputs(model):
    """Each LayerNorm's input rows in the HF model's own forward on TOKENS (float64)."""
    import torch

    seen, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            hooks.append(module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, args[0].detach().double().reshape(-1, HIDDEN))))
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids))
    for hook in hooks:
        hook.remove()
    return {name: rows.numpy() for name, rows in seen.items()}


def _layer_norm64(x, gain, bias, eps=1e-12):
    x = x.astype(np.float64)
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * gain + bias


def _capture(model, out, tokens=TOKENS):
    from parity_cli.probes import runtime_capture

    tensors, meta = runtime_capture.record(model, "onnxruntime", tokens=list(tokens))
    runtime_capture.write(tensors, meta, out)
    return out


def _check(hf, cap):
    from parity_cli import api
    from parity_cli.check.results import _jsonable

    report = api.check(hf, runtime_capture=str(cap))
    return report.exit_code, json.loads(json.dumps(_jsonable(report.to_dict())))


def _skip_layers():
    return [f"encoder.layer.{i}.{part}.LayerNorm" for i in range(LAYERS) for part in ("attention.output", "output")]


def test_an_ort_optimised_bert_passes_inside_onnxruntime(bert, tmp_path):
    cap, rep = tmp_path / "cap.safetensors", tmp_path / "r.json"
    r = run_parity("capture", bert["opt"], "--runtime", "onnxruntime", "--tokens", bert["tokens"], "-o", cap)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_parity("check", bert["hf"], "--runtime-capture", cap, "--json", rep)
    assert r.returncode == 0, r.stdout + r.stderr
    data = load_json(rep)
    assert sorted(layer["name"] for layer in data["layers"]) == sorted(["embeddings.LayerNorm"] + _skip_layers())
    assert all(layer["status"] == "pass" and not layer["findings"] for layer in data["layers"])
    nodes = data["candidate"]["checkpoint"]["runtime"]["nodes"]
    assert {n["op"] for name, n in nodes.items() if name != "embeddings.LayerNorm"} == {"SkipLayerNormalization"}

    # what each Skip node normalised is the HF LayerNorm's own input (dense(h) + bias + residual), row
    # for row (float32 matmuls in another order: 1e-5 of the row's scale), and never its first input
    from safetensors.numpy import load_file

    rows = load_file(str(cap))
    hf = load_file(str(bert["hf"] / "model.safetensors"))
    for name in _skip_layers():
        x, y, total = (rows[f"{k}:m.{name}"].astype(np.float64) for k in ("x", "y", "sum"))
        truth = bert["inputs"][name]
        nearest = np.abs(x[:, None, :] - truth[None, :, :]).max(-1).min(-1)
        assert nearest.max() <= 1e-5 * np.abs(truth).max(), name
        # ORT's kernel adds in float32 exactly as the capture does: the sum it hands on is x itself
        assert np.array_equal(total, x), name
        expected = _layer_norm64(x, hf[f"{name}.weight"], hf[f"{name}.bias"])
        assert np.abs(y - expected).max() <= 1e-5, name


def test_a_float16_export_is_judged_on_the_float32_sum_its_kernel_normalises(bert, tmp_path):
    """ORT's float16 Skip kernel widens input, skip and bias to float32, normalises their float32 sum
    and rounds only its outputs: the rows recorded are that sum (wider than float16, and said so),
    and the export of a checkpoint whose gains float16 holds passes at float16's tolerance."""
    code, data = _check(bert["hf"], _capture(bert["fp16"], tmp_path / "cap.safetensors"))
    assert code == 0, [(layer["name"], layer["diagnoses"]) for layer in data["layers"] if layer["status"] != "pass"]
    assert data["candidate"]["dtype"] == "float16" and len(data["layers"]) == 13
    assert all(layer["status"] == "pass" for layer in data["layers"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "cap.safetensors"), "np") as fh:
        nodes = json.loads(fh.metadata()["parity-runtime"])["nodes"]
        x, total = fh.get_tensor(f"x:m.{SWAPPED[0]}"), fh.get_tensor(f"sum:m.{SWAPPED[0]}")
    assert nodes[f"m.{SWAPPED[0]}"]["rows_in"] == "float32" and "rows_in" not in nodes["m.embeddings.LayerNorm"]
    assert not np.array_equal(x.astype(np.float16).astype(np.float32), x)  # float32 sums, not float16 values
    assert np.array_equal(total, x.astype(np.float16).astype(np.float32))  # the residual handed on: rounded


def test_a_swap_of_two_gains_in_the_export_fails_exactly_those_two_layers(bert, tmp_path):
    from onnx import numpy_helper

    m = onnx.load(str(bert["opt"]))
    init = {t.name: t for t in m.graph.initializer}
    a, b = (init[f"m.{name}.weight"] for name in SWAPPED)
    va, vb = numpy_helper.to_array(a).copy(), numpy_helper.to_array(b).copy()
    a.CopyFrom(numpy_helper.from_array(vb, a.name))
    b.CopyFrom(numpy_helper.from_array(va, b.name))
    onnx.save(m, str(tmp_path / "swapped.onnx"))
    code, data = _check(bert["hf"], _capture(tmp_path / "swapped.onnx", tmp_path / "cap.safetensors"))
    assert code == 1
    assert len(data["layers"]) == 13
    assert sorted(layer["name"] for layer in data["layers"] if layer["status"] != "pass") == sorted(SWAPPED)
    for layer in data["layers"]:
        if layer["name"] in SWAPPED:
            other = next(n for n in SWAPPED if n != layer["name"])
            moved = [f for f in layer["findings"] if f["code"] == "checkpoint_gain_of_other_layer"]
            assert moved and moved[0]["layers"] == [other]


def test_a_residual_the_node_hands_on_that_is_not_its_inputs_sum_fails_that_layer(bert, tmp_path):
    """The sum output against the sum normalised: one that lost its bias (a fault the normalised
    output does not show) fails its layer; one a float32 rounding away does not."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    good = _capture(bert["opt"], tmp_path / "cap.safetensors")
    with safe_open(str(good), "pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    broken, rounded = "encoder.layer.2.output.LayerNorm", "encoder.layer.4.attention.output.LayerNorm"
    dense = torch.from_numpy(_dense_bias(bert, broken))
    tensors[f"sum:m.{broken}"] = tensors[f"sum:m.{broken}"] - dense
    x = tensors[f"sum:m.{rounded}"]
    tensors[f"sum:m.{rounded}"] = torch.nextafter(x, torch.full_like(x, torch.inf))
    save_file(tensors, str(tmp_path / "edited.safetensors"), metadata=meta)
    code, data = _check(bert["hf"], tmp_path / "edited.safetensors")
    assert code == 1
    failed = {layer["name"]: layer for layer in data["layers"] if layer["status"] != "pass"}
    assert list(failed) == [broken]
    assert [f["code"] for f in failed[broken]["findings"]] == ["residual_sum_mismatch"]
    found = failed[broken]["findings"][0]
    n = tensors[f"x:m.{broken}"].shape[0]  # every row lost the bias: each channel whose bias is not tiny is off
    assert int((dense.abs() > 1e-5).sum()) * n <= found["elements"] <= dense.numel() * n
    assert found["max_abs_err"] == pytest.approx(float(dense.abs().max()), rel=1e-4)


def _dense_bias(bert, name):
    """The dense layer's bias that ORT folded into this Skip node (the HF checkpoint's)."""
    from safetensors.numpy import load_file

    hf = load_file(str(bert["hf"] / "model.safetensors"))
    return hf[name.replace("LayerNorm", "dense.bias")].astype(np.float32)


def _skip_graph(path, op, dtype, bias: bool, own_sum: bool):
    """input_ids -> two embedding tables (the input and the residual) -> one Skip op with gain
    `model.norm.weight` (and a bias): the smallest graph a capture runs. `own_sum`: the graph itself
    reads the op's input_skip_bias_sum (as a decoder's next layer does)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    np_type, elem = (np.float16, TensorProto.FLOAT16) if dtype == "float16" else (np.float32, TensorProto.FLOAT)
    tables = {k: rng.normal(0, 1, (50, 16)).astype(np_type) for k in ("E", "F")}
    params = {"model.norm.weight": (1 + 0.1 * rng.normal(size=16)).astype(np_type),
              "dense.bias": (0.3 * rng.normal(size=16)).astype(np_type)}
    inputs = ["h", "s", "model.norm.weight"]
    if op == "SkipLayerNormalization":
        params["model.norm.bias"] = (0.1 * rng.normal(size=16)).astype(np_type)
        inputs.append("model.norm.bias")
    if bias:  # the dense layer's bias ORT folds in: input 4 of SkipLayerNormalization, 3 of the simplified op
        inputs += ["dense.bias"]
    outputs = ["y", "", "", "residual"] if own_sum else ["y"]
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["h"]), helper.make_node("Gather", ["F", "input_ids"], ["s"]),
             helper.make_node(op, inputs, outputs, domain="com.microsoft", epsilon=1e-6)]
    graph_out = ["y"]
    if own_sum:
        nodes.append(helper.make_node("Mul", ["residual", "y"], ["z"]))
        graph_out = ["z"]
    inits = [numpy_helper.from_array(v, k) for k, v in {**tables, **params}.items()]
    g = helper.make_graph(nodes, "skip", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "n"])],
                          [helper.make_tensor_value_info(n, elem, None) for n in graph_out], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(m, str(path))
    return tables, params


@pytest.mark.parametrize("op,dtype,bias,own_sum", [
    ("SkipSimplifiedLayerNormalization", "float32", True, False),
    ("SkipSimplifiedLayerNormalization", "float16", True, True),
    ("SkipLayerNormalization", "float32", False, True),
])
def test_a_skip_node_records_the_sum_it_normalises(tmp_path, op, dtype, bias, own_sum):
    """x is E[t] + F[t] (+ the folded bias) as ORT's CPU kernel adds: in float32, the skip first; a
    float16 graph's operands are widened to float32 and added there: x is that float32 sum (wider
    than the node's dtype, and said so), the sum handed on is it rounded to float16. y is the
    float64 norm of the float32 sum within the dtype's rounding."""
    from safetensors.numpy import load_file

    from parity_cli.probes import runtime_capture

    tokens = [3, 7, 7, 19, 42, 0, 11]
    tables, params = _skip_graph(tmp_path / "g.onnx", op, dtype, bias, own_sum)
    tensors, meta = runtime_capture.record(tmp_path / "g.onnx", "onnxruntime", tokens=tokens, rows_per_layer=96)
    runtime_capture.write(tensors, meta, tmp_path / "cap.safetensors")
    rows = load_file(str(tmp_path / "cap.safetensors"))
    assert list(meta["nodes"]) == ["model.norm"]
    node = meta["nodes"]["model.norm"]
    assert node["op"] == op and node["dtype"] == dtype and node["rows"] == len(tokens)
    assert node["sum_output"] == ("residual" if own_sum else "input_skip_bias_sum (output 3, added by parity)")
    wide = (tables["E"][tokens].astype(np.float32) + tables["F"][tokens].astype(np.float32))
    if bias:
        wide = wide + params["dense.bias"].astype(np.float32)
    handed_on = wide.astype(np.float16).astype(np.float32) if dtype == "float16" else wide
    assert node.get("rows_in") == ("float32" if dtype == "float16" else None)
    x, y, total = rows["x:model.norm"], rows["y:model.norm"], rows["sum:model.norm"]
    order = np.lexsort(x.T[::-1])  # the capture keeps rows in its own order: compare as sets of rows
    expect_order = np.lexsort(wide.T[::-1])
    assert np.array_equal(x[order], wide[expect_order])
    assert np.array_equal(total[order], handed_on[expect_order])
    v = wide[expect_order].astype(np.float64)  # what the kernel normalised: the float32 sum
    g = params["model.norm.weight"].astype(np.float64)
    if op == "SkipLayerNormalization":
        expected = _layer_norm64(v, g, params["model.norm.bias"].astype(np.float64), 1e-6)
    else:
        expected = v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * g
    limit = 2.0 ** -10 if dtype == "float16" else 1e-6
    assert np.abs(y[order] - expected).max() <= limit * np.abs(expected).max()


@SLOW
def test_openvino_names_each_norm_by_the_models_own_names(bert, tmp_path):
    """OpenVINO's ONNX frontend drops the name of the last LayerNorm's gain (its output is the model's
    output): the IR holds it as a made-up Constant_N. The capture names that norm by the model's name
    for its output, keeps the constant as the tensor it multiplied by, and the check pairs it by value."""
    import re

    ov = pytest.importorskip("openvino")
    from parity_cli.probes import runtime_capture

    xml = tmp_path / "bert.xml"
    ov.save_model(ov.convert_model(str(bert["onnx"])), str(xml), compress_to_fp16=False)
    tensors, meta = runtime_capture.record(xml, "openvino", tokens=TOKENS, precision="f32")
    made_up = re.compile(r"[A-Za-z]+_\d+(_compressed)?")
    assert not [name for name in meta["nodes"] if made_up.fullmatch(name)]
    last = meta["nodes"]["last_hidden_state"]
    assert made_up.fullmatch(last["gain_tensor"]) and last["node"] == f"{last['op']} last_hidden_state"
    runtime_capture.write(tensors, meta, tmp_path / "cap.safetensors")
    code, data = _check(bert["hf"], tmp_path / "cap.safetensors")
    assert code == 0 and len(data["layers"]) == 13
    nodes = data["candidate"]["checkpoint"]["runtime"]["nodes"]
    assert nodes["encoder.layer.5.output.LayerNorm"]["recorded_as"] == "last_hidden_state"
    assert nodes["encoder.layer.5.output.LayerNorm"]["paired_by"] == "value"
    assert all(n["recorded_as"] == f"m.{name}" for name, n in nodes.items() if name != "encoder.layer.5.output.LayerNorm")
