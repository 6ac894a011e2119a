"""Issue 46, item 1, for ONNX Runtime: every kind parity's `onnxruntime` built-in claims (rms_norm in
LLaMA's and Gemma's order, layer_norm, group_norm, batch_norm, Mamba2's gated rms_norm) at every
dtype, checked through parity's adapter (the norm as an ONNX graph built from ops: RMSNormalization
or its decomposition, LayerNormalization, GroupNormalization, BatchNormalization, a decomposed gated
norm) and through ONNX Runtime's public path (`onnxruntime@public`: `torch.onnx.export` of the
family's torch module, run by an InferenceSession on the CPU provider).

Both paths give one verdict, cause included. Two runtime facts stand behind the cells that are not
a PASS, each shown again below with ONNX Runtime alone:
- the CPU provider has no bfloat16 kernel for Mul, BatchNormalization or InstanceNormalization, so a
  bfloat16 export of a Llama-order norm (its gain product at bfloat16), a BatchNorm, a GroupNorm or
  Mamba2's gated norm cannot run: the adapter refuses the cell in one line, the export fails to load;
- its Sigmoid (what an exported SiLU computes) returns 0 for every input at or below -18 and is off
  by up to 6e-8 absolutely above it, so x * silu(z) with a large x and a z near -20 loses all of
  itself: Mamba2's gated norm fails the `large` and `outlier` strata, unexplained, on both paths."""

import pytest
from truth_cells import Cells, fails, passes

from parity_cli import api

pytest.importorskip("onnxruntime", reason="needs ONNX Runtime: pip install onnx onnxruntime")
pytest.importorskip("onnx", reason="needs onnx: pip install onnx onnxruntime")

from parity_cli.errors import InputError  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
KINDS = ("rms_norm/llama", "rms_norm/gemma", "layer_norm", "group_norm", "batch_norm", "gated_rms_norm")
REFUSED = "refused"
EXPECTED = {(kind, dtype): passes(kind) for kind in KINDS for dtype in DTYPES}
EXPECTED.update({(kind, "bfloat16"): REFUSED for kind in ("rms_norm/llama", "group_norm", "batch_norm",
                                                           "gated_rms_norm")})
EXPECTED.update({("gated_rms_norm", dtype): fails("gated_rms_norm", "unexplained") for dtype in ("float32", "float16")})
# what the adapter names as the kernel the CPU provider lacks, and what loading the export says
MISSING = {"rms_norm/llama": ("bfloat16 Mul", "NOT_IMPLEMENTED"), "gated_rms_norm": ("bfloat16 Mul", "NOT_IMPLEMENTED"),
           "batch_norm": ("bfloat16 BatchNormalization", "NOT_IMPLEMENTED"),
           "group_norm": ("bfloat16 InstanceNormalization", "INVALID_GRAPH")}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return Cells(tmp_path_factory.mktemp("truth-onnxruntime"))


def _cell(cells, kind, candidate, dtype):
    try:
        return cells.verdict(kind, candidate, dtype)
    except InputError as exc:
        return REFUSED, str(exc)


@pytest.mark.parametrize("kind, dtype", list(EXPECTED))
def test_the_adapter_and_onnxruntimes_own_path_give_one_verdict(cells, kind, dtype):
    ours = _cell(cells, kind, "onnxruntime", dtype)
    theirs = _cell(cells, kind, "onnxruntime@public", dtype)
    if EXPECTED[kind, dtype] == REFUSED:
        assert ours[0] == theirs[0] == REFUSED, (ours, theirs)
        ours_said, theirs_said = MISSING[kind]
        assert f"the CPU provider has no {ours_said} kernel" in ours[1] and "compute=float32" in ours[1], ours[1]
        assert "torch.onnx.export" in theirs[1] and theirs_said in theirs[1], theirs[1]
        assert "\n" not in ours[1] + theirs[1]
    else:
        assert ours == theirs == EXPECTED[kind, dtype], (ours, theirs)


def test_the_failing_gated_cells_fail_where_x_is_large_on_both_paths(cells):
    """The FAIL is in the strata of big activations (`large`: |x| up to about 6e4; `outlier`: a few
    huge channels among normal ones) and nowhere else, on both paths alike."""
    from truth_cells import LAYERS

    for dtype in ("float32", "float16"):
        failing = []
        for candidate in ("onnxruntime", "onnxruntime@public"):
            report = api.check(cells.checkpoint("gated_rms_norm"), candidate=candidate, dtype=dtype,
                               layers=LAYERS["gated_rms_norm"][1], isolation="none")
            failing.append([s.name for s in report.layers[0].strata if s.status != "pass"])
        assert failing == [["large", "outlier"], ["large", "outlier"]], (dtype, failing)


def test_compute_float32_runs_a_refused_bfloat16_cell(cells):
    """--candidate-arg compute=float32 feeds the graph float32 (bfloat16 values, exactly): it runs. The
    checkpoint is stored in bfloat16 (the candidate's dtype when --dtype is not given)."""
    from truth_cells import LAYERS

    report = api.check(cells.checkpoint("batch_norm"), candidate="onnxruntime", candidate_args={"compute": "float32"},
                       layers=LAYERS["batch_norm"][1], isolation="none")
    (layer,) = report.layers
    assert layer.status == "pass" and report.header["candidate"]["dtype"] == "bfloat16"


# --- the runtime facts behind the cells that are not a PASS, with ONNX Runtime alone --------------------


def _session(nodes, inputs, outputs):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph(nodes, "fact", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_onnxruntimes_cpu_sigmoid_is_zero_at_and_below_minus_18():
    """Sigmoid(z) = 1 / (1 + e^-z): 1.523e-08 at -18, 2.061e-09 at -20, 6.914e-13 at -28, all
    representable in float32 (its smallest normal is 1.18e-38). The CPU provider returns 0 for each,
    and at -16 returns 5.96e-08 where the value is 1.125e-07."""
    import math

    import numpy as np
    from onnx import TensorProto, helper

    session = _session([helper.make_node("Sigmoid", ["z"], ["s"])],
                       [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None])],
                       [helper.make_tensor_value_info("s", TensorProto.FLOAT, [None])])
    z = np.array([-16.0, -18.0, -20.0, -28.0], dtype=np.float32)
    (s,) = session.run(None, {"z": z})
    exact = [1 / (1 + math.exp(-v)) for v in z.tolist()]
    assert s[1:].tolist() == [0.0, 0.0, 0.0] and min(exact[1:]) > 1e-13
    assert abs(s[0] - exact[0]) > 0.4 * exact[0]  # off by about half of itself at -16


def test_a_gated_norms_silu_gate_vanishes_where_x_is_large():
    """x * silu(z), z * Sigmoid(z) as an export computes SiLU, for x = 6e4, z = -20: the value is
    6e4 * -20 * 2.061e-09 = -2.47e-03; ONNX Runtime returns -0."""
    import math

    import numpy as np
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    session = _session([helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["z", "s"], ["silu"]),
                        helper.make_node("Mul", ["x", "silu"], ["y"])],
                       [helper.make_tensor_value_info("x", f, [None]), helper.make_tensor_value_info("z", f, [None])],
                       [helper.make_tensor_value_info("y", f, [None])])
    (y,) = session.run(None, {"x": np.array([6e4], dtype=np.float32), "z": np.array([-20.0], dtype=np.float32)})
    exact = 6e4 * -20 / (1 + math.exp(20))
    assert exact == pytest.approx(-2.4734e-3, rel=1e-4) and y.tolist() == [0.0]


@pytest.mark.parametrize("op", ["Mul", "BatchNormalization"])
def test_the_cpu_provider_has_no_bfloat16_kernel_for(op):
    """A bfloat16 graph of one op: loading it is NOT_IMPLEMENTED (what a bfloat16 export meets)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    b = TensorProto.BFLOAT16
    if op == "Mul":
        nodes = [helper.make_node("Mul", ["x", "x"], ["y"])]
        inputs = [helper.make_tensor_value_info("x", b, [None, 4])]
    else:
        nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])]
        inputs = [helper.make_tensor_value_info("x", b, [None, 4])] + [helper.make_tensor_value_info(n, b, [4])
                                                                      for n in "sbmv"]
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.NotImplemented, match=f"{op}"):
        _session(nodes, inputs, [helper.make_tensor_value_info("y", b, [None, 4])])


def test_a_layer_without_a_class_is_exported_by_dynamo(cells):
    """A layer that names no class is deployed as torch.nn.RMSNorm, whose aten::rms_norm the TorchScript
    exporter cannot export at opset 18: the public path takes the dynamo exporter. Its output is the
    definition x / sqrt(mean(x^2) + eps) * w, to float32's rounding."""
    import dataclasses

    import torch

    from parity_cli.backends.onnx_runtime import public_path
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(cells.checkpoint("rms_norm/llama"))
    layer = dataclasses.replace(discover_layers(ckpt, fam, eps).layers[0], hf_class=None)
    w = layer.weight.float()
    x = torch.linspace(-3, 3, 5 * layer.dim).reshape(5, layer.dim)
    y = public_path(layer, w, None, 1e-6)(x)
    exact = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert y.dtype == torch.float32 and (y.double() - exact).abs().max() < 4 * 2.0 ** -24 * exact.abs().max()
