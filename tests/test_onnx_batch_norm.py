"""Issue 26 for ONNX: an inference BatchNorm as a `BatchNormalization` node (opset 15: X, scale, B,
input_mean, input_var; epsilon, default 1e-5; training_mode 0). Found in a real export of a
transformers ResNet (the tiny checkpoint write_tiny_checkpoint makes), paired with the
checkpoint's batch_norm layers by name, compared (eps, gain, bias, running statistics) and run as
the candidate; `--candidate onnxruntime` builds the op from the layer's eps and statistics.

torch.onnx.export (TorchScript, do_constant_folding=True, its default; and the dynamo exporter with
optimize=True, the default in this torch) folds every eval-mode BatchNorm into the Conv before it:
such an export has no BatchNorm left to check, which is said, never passed. The pairing tests
export with do_constant_folding=False, which keeps the nodes under the state dict's names.

Every expected number is derived here: the statistics read from the safetensors file, the
outputs transcribed in float64 from the op's formula."""

import numpy as np
import pytest
from conftest import NARROW_RESNET, SLOW, run_parity

from parity_cli import api
from parity_cli.errors import InputError

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("transformers")
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx_exports import export_resnet, fold_batch_norm, plant_batch_norm  # noqa: E402

STEM = "embedder.embedder.normalization"
EPS_LAYER = "encoder.stages.1.layers.0.layer.1.normalization"
VAR_LAYER = "encoder.stages.0.layers.1.layer.0.normalization"
MEAN_LAYER = "encoder.stages.2.layers.3.layer.2.normalization"
TRAINING_LAYER = "encoder.stages.3.layers.0.shortcut.normalization"
TORCH_EPS = torch.nn.BatchNorm2d(1).eps  # what transformers' ResNet builds its BatchNorm2d with


def f32(value: float) -> float:
    return float(np.float32(value))


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    """The tiny ResNet checkpoint, its stored tensors (read apart from the tool), its BatchNorm2d
    modules' names (from the transformers model itself), and an export that keeps BatchNormalization."""
    from safetensors.torch import load_file
    from transformers import ResNetModel

    from parity_cli.model.derive import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("resnet")
    hf = root / "hf"
    write_tiny_checkpoint("resnet", hf, config=NARROW_RESNET)
    modules = [name for name, m in ResNetModel.from_pretrained(str(hf)).named_modules()
               if isinstance(m, torch.nn.BatchNorm2d)]
    return {"hf": hf, "onnx": export_resnet(hf, root / "kept.onnx"), "root": root,
            "stored": load_file(str(hf / "model.safetensors")), "modules": modules}


def _reference_layers(hf):
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(hf)
    return discover_layers(ckpt, fam, eps).layers


def _transcribed(x, stored, layer, eps):
    """(x - running_mean) / sqrt(running_var + eps) * weight + bias in float64, per channel."""
    mean, var, w, b = (stored[f"{layer}.{t}"].double() for t in ("running_mean", "running_var", "weight", "bias"))
    return (x.double() - mean) / torch.sqrt(var + eps) * w + b


def _fold_tolerance(x, mean, var, w, b, eps, want, unit=2.0 ** -24):
    """What a float32 (unit 2^-24; float64: 2^-53) evaluation may lose: a runtime computes
    x * a + (b - mean * a) with a = w / sqrt(var + eps) (ONNX Runtime's BatchNormalization does),
    so the rounding is at the terms' size, which cancel: four units on each (a small var makes a
    large)."""
    a = w.double().abs() / torch.sqrt(var.double() + eps)
    return 4 * unit * (x.double().abs() * a + mean.double().abs() * a + b.double().abs() + want.abs())


def _probe_rows(stored, layer, n=48, seed=0):
    """Rows of (N, C) around each channel's running mean, within a few of its standard deviations."""
    mean, var = stored[f"{layer}.running_mean"], stored[f"{layer}.running_var"]
    gen = torch.Generator().manual_seed(seed)
    return (mean + torch.sqrt(var) * torch.randn(n, mean.numel(), generator=gen) * 3).float()


# --- the real export -------------------------------------------------------------------------------


@SLOW
def test_the_export_keeps_every_batch_norm_and_the_reader_finds_them(resnet):
    from parity_cli.model.onnx_layers import candidate_layers

    graph = onnx.load(str(resnet["onnx"]), load_external_data=False).graph
    assert sum(n.op_type == "BatchNormalization" for n in graph.node) == len(resnet["modules"]) == 53
    layers, info = candidate_layers(resnet["onnx"], _reference_layers(resnet["hf"]))
    assert sorted(layer.name for layer in layers) == sorted(resnet["modules"])  # by the initializers' names
    assert info["forms"] == {"BatchNormalization": 53} and info["dtype"] == "float32"
    stored = resnet["stored"]
    for layer in layers:
        assert layer.kind == "batch_norm" and layer.eps.value == f32(TORCH_EPS)
        for attr, key in (("weight", "weight"), ("bias", "bias"), ("running_mean", "running_mean"),
                          ("running_var", "running_var")):
            assert torch.equal(getattr(layer, attr), stored[f"{layer.name}.{key}"]), (layer.name, attr)
    inspected = api.inspect(resnet["onnx"])
    assert sorted((l["name"], l["kind"]) for l in inspected["layers"]) == [(n, "batch_norm") for n in sorted(resnet["modules"])]
    for item in inspected["layers"]:  # q/eps of a BatchNorm: its smallest running_var / eps, from the stored tensor
        var = stored[f"{item['name']}.running_var"].to(torch.float64)
        assert item["statistics"]["running_var_over_eps"]["min"] == pytest.approx(float(var.min()) / f32(TORCH_EPS))


@SLOW
def test_the_copy_runs_its_own_subgraph_on_rows(resnet):
    """The BatchNormalization subgraph takes (N, C, H, W): (N, C) probe rows go in as N maps of
    1 x 1, and what comes out is the op's formula with the graph's operands."""
    from parity_cli.backends.onnx_runtime import prepare
    from parity_cli.model.onnx_layers import candidate_layers

    layers, _ = candidate_layers(resnet["onnx"], _reference_layers(resnet["hf"]))
    for layer in (layers[0], layers[-1]):
        x = _probe_rows(resnet["stored"], layer.name)
        y = prepare(layer, layer.weight, layer.bias, layer.eps.value)(x)
        stored = {t: resnet["stored"][f"{layer.name}.{t}"] for t in ("running_mean", "running_var", "weight", "bias")}
        want = _transcribed(x, resnet["stored"], layer.name, f32(TORCH_EPS))
        tol = _fold_tolerance(x, stored["running_mean"], stored["running_var"], stored["weight"], stored["bias"],
                              f32(TORCH_EPS), want)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert bool(((y.double() - want).abs() <= tol).all()), float(((y.double() - want).abs() / tol).max())


def test_the_faithful_export_pairs_and_passes(resnet):
    report = api.check(resnet["hf"], candidate_checkpoint=str(resnet["onnx"]), isolation="none")
    cand = report.header["candidate"]
    assert cand["impl"] == "onnxruntime" and cand["dtype"] == "float32"
    assert cand["checkpoint"]["findings"] == 0 and cand["checkpoint"]["layers"] == len(resnet["modules"])
    assert sorted(l.name for l in report.layers) == sorted(resnet["modules"])
    assert report.passed, [(l.name, l.status, l.error, l.findings) for l in report.layers if not l.passed]


@SLOW
def test_planted_faults_each_name_their_layer(resnet):
    """One copy, four BatchNorms changed: epsilon 1e-3 (Keras' default) in one node, one channel's
    running variance x4 in another, one running mean negated in a third, training_mode=1 in a
    fourth. Each fails with its own finding; the other 49 pass."""
    from parity_cli.backends.onnx_runtime import prepare
    from parity_cli.model.onnx_layers import candidate_layers

    stored = resnet["stored"]
    var3 = float(stored[f"{VAR_LAYER}.running_var"][3])
    mean5 = float(stored[f"{MEAN_LAYER}.running_mean"][5])
    assert mean5 != 0.0
    path = plant_batch_norm(resnet["onnx"], resnet["root"] / "planted.onnx", eps={EPS_LAYER: 1e-3},
                            scale={(VAR_LAYER, "running_var", 3): 4.0, (MEAN_LAYER, "running_mean", 5): -1.0},
                            training=(TRAINING_LAYER,))
    report = api.check(resnet["hf"], candidate_checkpoint=str(path), isolation="none")
    bad = {l.name: l for l in report.layers if not l.passed}
    assert sorted(bad) == sorted([EPS_LAYER, VAR_LAYER, MEAN_LAYER, TRAINING_LAYER])
    assert all(not l.findings for l in report.layers if l.passed)

    (eps,) = bad[EPS_LAYER].findings
    assert eps["code"] == "checkpoint_eps_mismatch"
    assert eps["candidate"]["value"] == f32(1e-3) and eps["reference"]["value"] == TORCH_EPS
    diagnoses = {d.code: d for d in bad[EPS_LAYER].diagnoses}
    assert "eps_mismatch" in diagnoses  # and the graph computes with it: the probes see eps 1e-3
    assert abs(diagnoses["eps_mismatch"].evidence["estimated_eps"] - 1e-3) / 1e-3 < 0.05

    (var,) = bad[VAR_LAYER].findings
    assert var["code"] == "checkpoint_statistics_mismatch" and var["statistic"] == "running variance"
    assert var["channels"] == [{"channel": 3, "reference": var3, "candidate": f32(var3 * 4.0)}]
    (mean,) = bad[MEAN_LAYER].findings
    assert mean["code"] == "checkpoint_statistics_mismatch" and mean["statistic"] == "running mean"
    assert mean["channels"] == [{"channel": 5, "reference": mean5, "candidate": -mean5}]
    assert [f["code"] for f in bad[TRAINING_LAYER].findings] == ["batch_statistics"]

    # what runs is the graph's own node: eps 1e-3, and a training-mode node's batch statistics
    layers = {l.name: l for l in candidate_layers(path, _reference_layers(resnet["hf"]))[0]}
    x = _probe_rows(stored, EPS_LAYER)
    y = prepare(layers[EPS_LAYER], layers[EPS_LAYER].weight, layers[EPS_LAYER].bias, TORCH_EPS)(x)
    want = _transcribed(x, stored, EPS_LAYER, f32(1e-3))
    tol = _fold_tolerance(x, *(stored[f"{EPS_LAYER}.{t}"] for t in ("running_mean", "running_var", "weight", "bias")),
                          f32(1e-3), want)
    assert bool(((y.double() - want).abs() <= tol).all())
    layer = layers[TRAINING_LAYER]
    x = _probe_rows(stored, TRAINING_LAYER)
    y = prepare(layer, layer.weight, layer.bias, TORCH_EPS)(x)
    x64, w, b = x.double(), stored[f"{TRAINING_LAYER}.weight"].double(), stored[f"{TRAINING_LAYER}.bias"].double()
    batch = (x64 - x64.mean(0)) / torch.sqrt(x64.var(0, unbiased=False) + f32(TORCH_EPS)) * w + b
    assert torch.allclose(y.double(), batch, rtol=1e-4, atol=1e-4)


def test_a_batch_norm_folded_into_its_conv_is_missing(resnet):
    """One BatchNorm folded into its Conv (W * s / sqrt(var + eps), the bias shifted): the copy
    computes the same model, but that layer has nothing left to compare, so it is missing."""
    path = fold_batch_norm(resnet["onnx"], resnet["root"] / "one_folded.onnx", VAR_LAYER)
    report = api.check(resnet["hf"], candidate_checkpoint=str(path), isolation="none")
    status = {l.name: (l.status, [f["code"] for f in l.findings]) for l in report.layers}
    assert status.pop(VAR_LAYER) == ("fail", ["checkpoint_layer_missing"])
    assert all(s == ("pass", []) for s in status.values()), status
    folded = report.header["candidate"]["checkpoint"]["onnx"]["batch_norm_folded"]
    assert folded["layers"] == [VAR_LAYER] and folded["missing"] == 1
    assert folded["batch_normalization_nodes"] == 52 and folded["conv_nodes"] == 53
    (missing,) = next(l.findings for l in report.layers if l.name == VAR_LAYER)
    assert missing["folded"] and folded["message"] in missing["message"]  # the layer says why it is missing


def test_the_exporters_default_folds_every_batch_norm_and_says_so(resnet):
    """torch.onnx.export's default constant folding leaves Convs and no BatchNormalization: the
    check cannot pair anything, and says why in one line (exit 2), never a pass."""
    path = export_resnet(resnet["hf"], resnet["root"] / "folded.onnx", fold=True)
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    assert "Conv" in ops and "BatchNormalization" not in ops
    r = run_parity("check", str(resnet["hf"]), "--candidate-checkpoint", str(path), "--isolation", "none")
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert "no norm found" in line and f"{len(resnet['modules'])} BatchNorm layer(s)" in line
    assert "do_constant_folding=False" in line


# --- --candidate onnxruntime ---------------------------------------------------------------------


@pytest.mark.parametrize("op, dtype", [("fused", "float32"), ("decomposed", "float32"), ("fused", "float16")])
def test_onnxruntime_passes_the_resnet_checkpoint(resnet, op, dtype):
    report = api.check(resnet["hf"], candidate="onnxruntime", candidate_args={"op": op}, dtype=dtype,
                       isolation="none")
    assert report.passed and len(report.layers) == len(resnet["modules"]), \
        [(l.name, l.status, l.error) for l in report.layers if not l.passed]


def test_onnxruntime_with_another_eps_is_caught(resnet):
    report = api.check(resnet["hf"], candidate="onnxruntime", candidate_eps=1e-3, dtype="float32",
                       isolation="none", layers="encoder.stages.0.layers.0.*")
    assert not report.passed and all(not l.passed for l in report.layers)
    for layer in report.layers:
        (diag,) = layer.diagnoses
        assert diag.code == "eps_mismatch" and abs(diag.evidence["estimated_eps"] - 1e-3) / 1e-3 < 0.05


@pytest.mark.parametrize("op", ["fused", "decomposed"])
@pytest.mark.parametrize("dtype, bias, offset", [("float32", True, 0.0), ("float32", False, 1.0),
                                                 ("float16", True, 0.0), ("float64", True, 0.0)])
def test_the_built_graph_is_the_formula(op, dtype, bias, offset):
    """build_graph's BatchNorm against its float64 transcription, on the rounded inputs."""
    from parity_cli.backends.onnx_runtime import _session, build_graph

    c, eps = 16, 1e-5
    gen = torch.Generator().manual_seed(1)
    t = getattr(torch, dtype)
    mean = (torch.randn(c, generator=gen) * 0.5).to(t)
    var = (torch.exp(torch.rand(c, generator=gen) * 12) * 1e-6).to(t)
    w = (torch.rand(c, generator=gen) + 0.1).to(t)
    b = (torch.rand(c, generator=gen) - 0.5).to(t)
    x = (mean.float() + torch.sqrt(var.float()) * torch.randn(32, c, generator=gen) * 2).to(t)
    session = _session(build_graph("batch_norm", "native", c, (), dtype, eps, offset, op, bias), "cpu")
    feeds = {"x": x.numpy(), "scale": w.numpy(), "mean": mean.numpy(), "var": var.numpy()}
    if bias:
        feeds["bias"] = b.numpy()
    (y,) = session.run(["y"], feeds)
    shift = b if bias else torch.zeros_like(b)
    # the op's epsilon attribute is a 32-bit float; the decomposed graph's constant has the compute type
    e = eps if (op, dtype) == ("decomposed", "float64") else f32(eps)
    want = (x.double() - mean.double()) / torch.sqrt(var.double() + e) * (offset + w.double()) + shift.double()
    tol = _fold_tolerance(x, mean, var, offset + w.double(), shift, e, want,
                          2.0 ** -53 if dtype == "float64" else 2.0 ** -24)
    if dtype == "float16":  # computed in float32, then rounded once: half a float16 ulp more (2^-25 subnormal)
        tol = tol * (1 + 2.0 ** -11) + 2.0 ** -11 * want.abs() + 2.0 ** -25
    assert y.dtype == np.dtype(dtype)
    assert bool(((torch.from_numpy(y).double() - want).abs() <= tol).all())


# --- hand-written graphs: the reader's limits ----------------------------------------------------


def _bn_graph(tmp_path, name, shapes=(4, 4, 4, 4), epsilon=1e-5, computed_var=False, attrs=None):
    c = shapes[0]
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.0, n).astype(np.float32), f"bn.{k}")
             for k, n in zip(("weight", "bias", "running_mean", "running_var"), shapes)]
    nodes = []
    var = "bn.running_var"
    if computed_var:  # the variance computed from an input: no stored statistic
        nodes.append(helper.make_node("Abs", ["v_in"], ["v_abs"]))
        var = "v_abs"
    node = helper.make_node("BatchNormalization", ["x", "bn.weight", "bn.bias", "bn.running_mean", var], ["y"],
                            name="bn_node")
    if epsilon is not None:
        node.attribute.append(helper.make_attribute("epsilon", epsilon))
    for key, value in (attrs or {}).items():
        node.attribute.append(helper.make_attribute(key, value))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", c, 1, 1])]
    if computed_var:
        inputs.append(helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [c]))
    graph = helper.make_graph(nodes + [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_hand_written_batch_norms(tmp_path):
    from parity_cli.sources.onnx_graph import find_norms, load_model

    def found(path):
        return find_norms(load_model(path), path)

    (norm,) = found(_bn_graph(tmp_path, "default.onnx", epsilon=None))  # the op's default epsilon
    assert norm.kind == "batch_norm" and norm.eps == 1e-5 and norm.eps_source == "onnx:BatchNormalization default"
    assert norm.name == "bn" and norm.running_var.tolist() == np.linspace(0.5, 1.0, 4).astype(np.float32).tolist()
    assert found(_bn_graph(tmp_path, "computed.onnx", computed_var=True)) == []  # nothing stored to compare
    (norm,) = found(_bn_graph(tmp_path, "training.onnx", attrs={"training_mode": 1}))
    assert norm.training
    (norm,) = found(_bn_graph(tmp_path, "is_test.onnx", attrs={"is_test": 0}))  # opsets 1-6: training
    assert norm.training
    assert found(_bn_graph(tmp_path, "spatial.onnx", attrs={"spatial": 0})) == []  # opsets 7-8: per (C, H, W)
    with pytest.raises(InputError, match=r"scale, B, input_mean, input_var of shapes \[4\], \[4\], \[4\], \[3\]"):
        found(_bn_graph(tmp_path, "shapes.onnx", shapes=(4, 4, 4, 3)))
    with pytest.raises(InputError, match="epsilon attribute that is not a float"):
        found(_bn_graph(tmp_path, "eps.onnx", epsilon="1e-5"))
    with pytest.raises(InputError, match="training_mode attribute that is not an integer"):
        found(_bn_graph(tmp_path, "mode.onnx", attrs={"training_mode": "1"}))


def test_a_norm_of_another_kind_under_a_batch_norms_name_is_not_its_copy(resnet, tmp_path):
    """A LayerNormalization whose gain carries a BatchNorm layer's name: no copy of it (that layer
    is missing, the norm extra), not a BatchNorm compared without running statistics."""
    from parity_cli.model.onnx_layers import candidate_layers

    c = resnet["stored"][f"{STEM}.weight"].numel()
    inits = [numpy_helper.from_array(resnet["stored"][f"{STEM}.{t}"].numpy(), f"{STEM}.{t}") for t in ("weight", "bias")]
    node = helper.make_node("LayerNormalization", ["x", f"{STEM}.weight", f"{STEM}.bias"], ["y"], axis=-1,
                            epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", c])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "ln.onnx"))
    (layer,), _ = candidate_layers(tmp_path / "ln.onnx", _reference_layers(resnet["hf"]))
    assert layer.name == f"{STEM} (layer_norm)" and layer.kind == "layer_norm" and layer.running_var is None


def test_gains_swapped_between_two_batch_norms_name_the_other_layers_gain(resnet):
    """Issue 35: two BatchNormalization nodes reading each other's scale were blamed on their bias
    and statistics (each norm took the name of the gain it reads). Three of its four operands say
    which layer a node is; the gain it holds is then the other layer's."""
    stored = resnet["stored"]
    sizes = {}
    for name in resnet["modules"]:
        sizes.setdefault(stored[f"{name}.weight"].numel(), []).append(name)
    a, b = next(names for names in sizes.values()
                if len(names) >= 2 and not torch.equal(stored[f"{names[0]}.weight"], stored[f"{names[1]}.weight"]))[:2]
    model = onnx.load(str(resnet["onnx"]))
    nodes = {n.input[1].removesuffix(".weight"): n for n in model.graph.node if n.op_type == "BatchNormalization"}
    nodes[a].input[1], nodes[b].input[1] = f"{b}.weight", f"{a}.weight"
    path = resnet["root"] / "gains_swapped.onnx"
    onnx.save(model, str(path))
    report = api.check(resnet["hf"], candidate_checkpoint=str(path), isolation="none")
    codes = {l.name: [f["code"] for f in l.findings] for l in report.layers}
    assert codes.pop(a) == codes.pop(b) == ["checkpoint_weight_mismatch", "checkpoint_gain_of_other_layer"]
    assert all(c == [] for c in codes.values()), {k: v for k, v in codes.items() if v}
    moved = {l.name: f["layers"] for l in report.layers for f in l.findings if f["code"] == "checkpoint_gain_of_other_layer"}
    assert moved == {a: [b], b: [a]}
    # the headline is the best-supported cause: the finding read off the two files, never a vague diagnosis
    # of the outputs beside it (issue 47: it led with `unexplained`)
    from parity_cli.report.terminal import quiet_line

    line = quiet_line(report.to_dict())
    assert line.partition(": ")[2].partition(": ")[2].startswith(
        "checkpoint_weight_mismatch (the copy's gain differs) + checkpoint_gain_of_other_layer"), line
