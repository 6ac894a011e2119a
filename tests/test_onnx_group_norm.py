"""GroupNorm in ONNX. What torch 2.13's torch.onnx.export emits for nn.GroupNorm:

- dynamo=True at opset 21: one `GroupNormalization` node (X, scale, bias per channel, num_groups,
  epsilon, stash_type=1) reading the state dict's own initializers (`<module>.weight`, `.bias`);
- dynamo=True at opset 18, and the TorchScript exporter at every opset: the decomposition
  Reshape(N, G, -1) -> InstanceNormalization(ones, zeros, epsilon) -> Reshape -> Mul(w[C, 1]) ->
  Add(b[C, 1]), read as a GroupNorm of G groups and run rebuilt over (N, C, S) maps;
- OpenVINO's convert_model: one GroupNormalization-12 op (data, scale, bias, num_groups, epsilon).

A normalisation node the reader cannot take leaves its layer "not checked", never "missing".

The GroupNorms here are the real modules of a tiny transformers Mask2Former (write_tiny_checkpoint:
GroupNorm(32, 256) in the pixel decoder), at their real module paths, loaded with the checkpoint's
weights and exported once. Every expected number is derived here: the tensors read from the
safetensors file, the outputs transcribed in float64 from GroupNorm's formula."""

import numpy as np
import pytest
from conftest import SLOW, failing, run_parity, slow_unless

from parity_cli import api
from parity_cli.errors import InputError

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("transformers")
import torch  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

EPS_LAYER = "pixel_level_module.decoder.input_projections.1.1"
GROUPS_LAYER = "pixel_level_module.decoder.layer_1.1"
GLOB = "pixel_level_module.decoder.*.1"  # the five GroupNorms; the model's LayerNorms are not in the export


def f32(value: float) -> float:
    return float(np.float32(value))


class _Tree(torch.nn.Module):
    """A module-tree node: each GroupNorm at its real path, applied to its own (N, C, H, W) input."""

    def forward(self, xs):
        outs = []
        for child in self.children():
            if isinstance(child, _Tree):
                got = child(xs[len(outs):])
                outs += got
            else:
                outs.append(child(xs[len(outs)]))
        return outs


class _GroupNorms(_Tree):
    def __init__(self, modules):
        super().__init__()
        for name, module in modules:
            parent = self
            for part in name.split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, _Tree())
                parent = getattr(parent, part)
            parent.add_module(name.split(".")[-1], module)

    def forward(self, *xs):
        return tuple(super().forward(list(xs)))


def _export(model, inputs, out, **kwargs):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, inputs, **kwargs) if kwargs.get("dynamo") else None
        if program is not None:
            program.save(str(out))
        else:
            torch.onnx.export(model, inputs, str(out), **kwargs)
    return out


@pytest.fixture(scope="module")
def m2f(tmp_path_factory):
    from safetensors.torch import load_file
    from transformers import Mask2FormerModel

    from parity_cli.model.derive import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("m2f")
    hf = root / "hf"
    write_tiny_checkpoint("mask2former", hf)
    model = Mask2FormerModel.from_pretrained(str(hf)).eval()
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.GroupNorm)]
    norms = _GroupNorms(modules).eval()
    inputs = tuple(torch.randn(1, m.num_channels, 2, 4) for _, m in modules)
    onnx_path = _export(norms, inputs, root / "dynamo21.onnx", dynamo=True, opset_version=21)
    return {"hf": hf, "root": root, "onnx": onnx_path, "norms": norms, "inputs": inputs,
            "modules": {name: (m.num_groups, m.num_channels, m.eps) for name, m in modules},
            "stored": load_file(str(hf / "model.safetensors"))}


def _reference_layers(hf):
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(hf)
    return discover_layers(ckpt, fam, eps).layers


def _transcribed(x, weight, bias, groups, eps):
    """GroupNorm in float64 on (N, C, S): each group of C/groups channels x S positions normalised
    with its own mean and (biased) variance, eps inside the root, then w * . + b per channel."""
    x = x.double()
    n, c, s = x.shape
    g = x.reshape(n, groups, -1)
    mean = g.mean(-1, keepdim=True)
    var = ((g - mean) ** 2).mean(-1, keepdim=True)
    normed = ((g - mean) / torch.sqrt(var + eps)).reshape(n, c, s)
    return normed * weight.double()[:, None] + bias.double()[:, None]


def _rows(channels, spatial, n=16, seed=0):
    """(N, C*S) rows, channel-major, at a few scales (q/eps from ~1e-2 up)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1e-2, 1.0, 30.0]).repeat(n // 4)[:, None]
    return (torch.randn(n, channels * spatial, generator=gen) * scale).float()


# --- what the exporter emits ----------------------------------------------------------------------


@SLOW
def test_dynamo_at_opset_21_emits_group_normalization_under_the_state_dict_names(m2f):
    graph = onnx.load(str(m2f["onnx"])).graph
    nodes = [n for n in graph.node if n.op_type == "GroupNormalization"]
    assert len(nodes) == len(m2f["modules"]) == 5
    for node in nodes:
        name = node.input[1].removesuffix(".weight")
        groups, channels, eps = m2f["modules"][name]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert node.input[2] == f"{name}.bias" and attrs["num_groups"] == groups == 32
        assert attrs["epsilon"] == pytest.approx(f32(eps))


def _decomposed_export(m2f, name, **kwargs):
    import contextlib
    import io

    out = m2f["root"] / f"{name}.onnx"
    if not out.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            _export(m2f["norms"], m2f["inputs"], out, **kwargs)
    return out


DECOMPOSED = {"torchscript": {"dynamo": False, "opset_version": 17}, "dynamo18": {"dynamo": True, "opset_version": 18}}


@pytest.mark.parametrize("exporter", [pytest.param(e, marks=slow_unless(e != "dynamo18")) for e in sorted(DECOMPOSED)])
def test_the_instance_norm_decomposition_is_read_and_passes(m2f, exporter):
    """Issue 35: wav2vec2's GroupNorm exported by TorchScript or dynamo at opset 18 was reported
    'missing from the candidate checkpoint'. Each of the five is read with its 32 groups (the
    InstanceNormalization's scale of ones), its epsilon and the stored w and b, and passes."""
    from parity_cli.model.onnx_layers import candidate_layers

    out = _decomposed_export(m2f, exporter, **DECOMPOSED[exporter])
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert "InstanceNormalization" in ops and "GroupNormalization" not in ops
    layers, info = candidate_layers(out, _reference_layers(m2f["hf"]))
    assert info["forms"] == {"InstanceNormalization": 5} and "unread" not in info
    for layer in layers:
        groups, channels, eps = m2f["modules"][layer.name]
        assert layer.groups == groups == 32 and layer.dim == channels and layer.eps.value == f32(eps)
        assert torch.equal(layer.weight, m2f["stored"][f"{layer.name}.weight"])
        assert torch.equal(layer.bias, m2f["stored"][f"{layer.name}.bias"])
    report = api.check(m2f["hf"], candidate_checkpoint=str(out), isolation="none", layers=GLOB)
    assert sorted(l.name for l in report.layers) == sorted(m2f["modules"])
    assert report.passed, [(l.name, l.status, l.findings) for l in report.layers if not l.passed]
    assert all(l.strata for l in report.layers)  # probed through the graph's own InstanceNormalization


def test_an_epsilon_changed_in_the_decomposition_names_its_layer(m2f):
    model = onnx.load(str(_decomposed_export(m2f, "torchscript", **DECOMPOSED["torchscript"])))
    planted = 0
    for node in model.graph.node:
        if node.op_type == "InstanceNormalization" and "/input_projections.1/" in node.name + "/":
            next(a for a in node.attribute if a.name == "epsilon").f = 1e-2
            planted += 1
    assert planted == 1
    bad = m2f["root"] / "ts_eps.onnx"
    onnx.save(model, str(bad))
    report = api.check(m2f["hf"], candidate_checkpoint=str(bad), isolation="none", layers=GLOB)
    found = failing(report)
    assert list(found) == [EPS_LAYER] and found[EPS_LAYER][0] == "fail", found
    assert "checkpoint_eps_mismatch" in found[EPS_LAYER][1], found
    eps = next(f for f in next(l for l in report.layers if l.name == EPS_LAYER).findings
               if f["code"] == "checkpoint_eps_mismatch")
    assert eps["candidate"]["value"] == f32(1e-2)


def test_a_normalisation_node_that_cannot_be_read_is_not_checked_never_missing(m2f):
    """An InstanceNormalization whose scale is not ones is no GroupNorm's decomposition the reader
    knows: its layer is 'not checked' (the verdict says so, --fail-on unchecked fails), not a
    checkpoint_layer_missing finding that asserts the copy lacks it."""
    from onnx import numpy_helper

    model = onnx.load(str(_decomposed_export(m2f, "torchscript", **DECOMPOSED["torchscript"])))
    node = next(n for n in model.graph.node if n.op_type == "InstanceNormalization"
                and "/input_projections.1/" in n.name + "/")
    for const in model.graph.node:
        if const.op_type == "Constant" and const.output[0] == node.input[1]:
            value = next(a for a in const.attribute if a.name == "value")
            value.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(value.t) * 2, value.t.name))
    odd = m2f["root"] / "ts_odd.onnx"
    onnx.save(model, str(odd))
    report = api.check(m2f["hf"], candidate_checkpoint=str(odd), isolation="none", layers=GLOB)
    assert EPS_LAYER not in {l.name for l in report.layers}
    assert not any(f["code"] == "checkpoint_layer_missing" for l in report.layers for f in l.findings)
    missed = report.header["checkpoint"]["unchecked"]
    assert [m["name"] for m in missed] == [EPS_LAYER] and "1 InstanceNormalization" in missed[0]["why"]
    assert report.passed
    r = run_parity("check", m2f["hf"], "--candidate-checkpoint", odd, "--layers", GLOB, "--fail-on", "unchecked")
    assert r.returncode == 1 and "not checked" in r.stdout, r.stdout + r.stderr


# --- OpenVINO ------------------------------------------------------------------------------------


def _ir(m2f, name, change=None):
    ov = pytest.importorskip("openvino")
    out = m2f["root"] / f"{name}.xml"
    norms = m2f["norms"]
    if change:
        import copy

        norms = copy.deepcopy(norms)
        mods = dict(norms.named_modules())
        for layer, (attr, value) in change.items():
            setattr(mods[layer], attr, value)
    ov.save_model(ov.convert_model(norms, example_input=m2f["inputs"]), str(out), compress_to_fp16=False)
    return out


def test_openvino_group_normalization_is_read_and_passes(m2f):
    """Issue 35: an IR of wav2vec2's GroupNorm (OpenVINO's GroupNormalization op) was reported
    missing. Read with its groups, epsilon and tensors, and run as the IR's own op on (N, C, S)."""
    from parity_cli.model.openvino_layers import candidate_layers

    out = _ir(m2f, "gn")
    layers, info = candidate_layers(out, _reference_layers(m2f["hf"]))
    assert info["forms"] == {"GroupNormalization": 5}
    for layer in layers:
        groups, channels, eps = m2f["modules"][layer.name]
        assert layer.groups == groups and layer.dim == channels and layer.eps.value == f32(eps)
        assert torch.equal(layer.weight, m2f["stored"][f"{layer.name}.weight"])
    report = api.check(m2f["hf"], candidate_checkpoint=str(out), isolation="none", layers=GLOB)
    assert report.header["candidate"]["impl"] == "openvino"
    assert report.passed and len(report.layers) == 5 and all(l.strata for l in report.layers), \
        [(l.name, l.status, l.findings) for l in report.layers if not l.passed]


def test_openvino_epsilon_and_group_count_changed_each_name_their_layer(m2f):
    out = _ir(m2f, "gn_bad", {EPS_LAYER: ("eps", 1e-2), GROUPS_LAYER: ("num_groups", 16)})
    report = api.check(m2f["hf"], candidate_checkpoint=str(out), isolation="none", layers=GLOB)
    found = failing(report)
    assert sorted(found) == sorted([EPS_LAYER, GROUPS_LAYER]) and {s for s, _ in found.values()} == {"fail"}, found
    codes = {l.name: {f["code"] for f in l.findings} for l in report.layers}
    assert "checkpoint_eps_mismatch" in codes[EPS_LAYER] and "group_count_mismatch" in codes[GROUPS_LAYER]


def test_an_ir_whose_batch_norms_were_folded_says_why_in_one_line(tmp_path):
    """OpenVINO converts an eval-mode BatchNorm after a Conv into constants folded into the
    Convolution and an Add: nothing of the norm is left, which the one line says."""
    ov = pytest.importorskip("openvino")
    from parity_cli.model.openvino_layers import candidate_layers

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8)).eval()
    ov.save_model(ov.convert_model(net, example_input=torch.randn(1, 3, 16, 16)), str(tmp_path / "r.xml"))
    with pytest.raises(InputError, match=r"no norm found in the IR \(2 BatchNorm\(s\) decomposed") as info:
        candidate_layers(tmp_path / "r.xml", [])
    assert "\n" not in str(info.value)


# --- the real export ------------------------------------------------------------------------------


def test_the_reader_finds_every_group_norm_with_its_tensors(m2f):
    from parity_cli.model.onnx_layers import candidate_layers

    layers, info = candidate_layers(m2f["onnx"], _reference_layers(m2f["hf"]))
    assert sorted(layer.name for layer in layers) == sorted(m2f["modules"])
    assert info["forms"] == {"GroupNormalization": 5}
    for layer in layers:
        groups, channels, eps = m2f["modules"][layer.name]
        assert layer.kind == "group_norm" and layer.eps.value == f32(eps) and layer.groups == groups
        assert torch.equal(layer.weight, m2f["stored"][f"{layer.name}.weight"])
        assert torch.equal(layer.bias, m2f["stored"][f"{layer.name}.bias"])
        assert not getattr(layer, "graph_findings", None)


def test_the_copy_runs_its_own_subgraph_on_rows(m2f):
    """(N, C*S) rows go into the exported GroupNormalization as (N, C, S, 1) maps."""
    from parity_cli.backends.onnx_runtime import prepare
    from parity_cli.model.onnx_layers import candidate_layers

    layers, _ = candidate_layers(m2f["onnx"], _reference_layers(m2f["hf"]))
    for layer in (layers[0], layers[-1]):
        groups, channels, eps = m2f["modules"][layer.name]
        x = _rows(channels, layer.spatial)
        y = prepare(layer, layer.weight, layer.bias, layer.eps.value)(x)
        want = _transcribed(x.reshape(len(x), channels, -1), m2f["stored"][f"{layer.name}.weight"],
                            m2f["stored"][f"{layer.name}.bias"], groups, f32(eps)).reshape(x.shape)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5), float((y.double() - want).abs().max())


def test_the_faithful_export_pairs_and_passes(m2f):
    report = api.check(m2f["hf"], candidate_checkpoint=str(m2f["onnx"]), isolation="none", layers=GLOB)
    cand = report.header["candidate"]
    assert cand["impl"] == "onnxruntime" and cand["checkpoint"]["findings"] == 0
    assert sorted(l.name for l in report.layers) == sorted(m2f["modules"])
    assert report.passed, [(l.name, l.status, l.error, l.findings) for l in report.layers if not l.passed]


def test_an_epsilon_and_a_group_count_changed_each_name_their_layer(m2f):
    model = onnx.load(str(m2f["onnx"]))
    for node in model.graph.node:
        if node.op_type != "GroupNormalization":
            continue
        name = node.input[1].removesuffix(".weight")
        for a in node.attribute:
            if name == EPS_LAYER and a.name == "epsilon":
                a.f = 1e-3
            if name == GROUPS_LAYER and a.name == "num_groups":
                a.i = 16
    bad = m2f["root"] / "bad.onnx"
    onnx.save(model, str(bad))
    report = api.check(m2f["hf"], candidate_checkpoint=str(bad), isolation="none", layers=GLOB)
    failed = sorted(l.name for l in report.layers if not l.passed)
    assert failed == sorted([EPS_LAYER, GROUPS_LAYER])
    codes = {l.name: {f.get("code") for f in l.findings} for l in report.layers}
    assert "group_count_mismatch" in codes[GROUPS_LAYER], codes[GROUPS_LAYER]
    assert "checkpoint_eps_mismatch" in codes[EPS_LAYER], codes[EPS_LAYER]
    r = run_parity("check", m2f["hf"], "--candidate-checkpoint", bad, "--layers", GLOB)
    assert r.returncode == 1 and EPS_LAYER in r.stdout and "group_count_mismatch" in r.stdout


@pytest.mark.parametrize("op", ["fused", "decomposed"])
def test_candidate_onnxruntime_passes_the_group_norm_checkpoint(m2f, op):
    r = run_parity("check", m2f["hf"], "--candidate", "onnxruntime", "--candidate-arg", f"op={op}",
                   "--dtype", "float32", "--layers", GLOB, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("op", ["fused", "decomposed"])
def test_the_built_graph_is_the_formula(op):
    from parity_cli.backends.onnx_runtime import _group_norm_graph, _session

    channels, groups, spatial, eps = 6, 3, 5, 1e-3
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
    x = _rows(channels, spatial, n=8, seed=2)
    session = _session(_group_norm_graph(channels, groups, spatial, "float32", eps, 0.0, op, True), "cpu")
    (y,) = session.run(["y"], {"x": x.numpy(), "scale": w.numpy(), "bias": b.numpy()})
    want = _transcribed(x.reshape(8, channels, spatial), w, b, groups, f32(eps)).reshape(8, -1)
    assert torch.allclose(torch.from_numpy(y).double(), want, atol=1e-5, rtol=1e-5)


def test_opset_18_group_normalization_is_refused_in_one_line(tmp_path):
    """Opset 18's scale and bias are per group: no GroupNorm's per-channel gain."""
    from parity_cli.sources.onnx_graph import find_norms

    inits = [helper.make_tensor("gn.weight", TensorProto.FLOAT, [2], [1.0, 1.0]),
             helper.make_tensor("gn.bias", TensorProto.FLOAT, [2], [0.0, 0.0])]
    node = helper.make_node("GroupNormalization", ["x", "gn.weight", "gn.bias"], ["y"], num_groups=2, epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(InputError, match="per group"):
        find_norms(model, tmp_path / "g.onnx")
