"""Issue 46: ONNX Runtime's gated RMSNorm (Mamba2's, Qwen3-Next's, Kimi Linear's): a probe row is
[x | z] of width 2C, the graph takes x and z apart (it fed the whole row into a graph built for C:
"Got invalid dimensions for input: x ... Got: 256 Expected: 128"). The graph is decomposed as the
module's export computes it; its values are checked here against the definition, transcribed in
float64, on gates where ONNX Runtime's Sigmoid is accurate (|z| <= 4; test_truth_onnxruntime shows
where it is not)."""

import math

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def _layer(gate, activation, order="llama", dim=8, groups=2):
    import torch

    from parity_cli.model.layers import NormLayer
    from parity_cli.sources.tensors import Eps

    return NormLayer(name="t.mixer.norm", kind="gated_rms_norm", dim=dim, order=order, gain_offset=0.0,
                     eps=Eps(1e-3, "test"), weight=torch.ones(dim), groups=groups, gate=gate, activation=activation)


@pytest.mark.parametrize("gate, activation, order", [("before", "silu", "llama"), ("after", "silu", "llama"),
                                                     ("after", "sigmoid", "gemma")])
def test_the_gated_graph_is_the_definition(gate, activation, order):
    """8 channels in 2 groups, eps 1e-3: before, RMSNorm per group of x * act(z); after, RMSNorm per
    group of x, times act(z); silu(z) = z / (1 + e^-z), sigmoid(z) = 1 / (1 + e^-z); times the gain."""
    import torch

    from parity_cli.backends.onnx_runtime import prepare

    gain = [1.0, 0.5, -2.0, 3.0, 1.5, -1.0, 0.25, 2.0]
    rows = [([0.5, -1.0, 2.0, 0.25, -3.0, 1.0, 0.75, -0.5], [1.0, -2.0, 0.5, 3.0, 0.0, -1.0, 2.0, -0.5]),
            ([4.0, 2.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0], [-4.0, 4.0, 0.25, -0.75, 1.0, 2.0, 3.0, 4.0])]

    def act(z):
        return z / (1 + math.exp(-z)) if activation == "silu" else 1 / (1 + math.exp(-z))

    want = []
    for xs, zs in rows:
        h = [x * act(z) for x, z in zip(xs, zs)] if gate == "before" else xs
        y = []
        for g in range(2):
            part = h[4 * g: 4 * g + 4]
            scale = 1 / math.sqrt(sum(v * v for v in part) / 4 + 1e-3)
            y += [v * scale for v in part]
        want.append([v * gain[i] * (act(zs[i]) if gate == "after" else 1.0) for i, v in enumerate(y)])
    layer = _layer(gate, activation, order)
    run = prepare(layer, torch.tensor(gain), None, 1e-3)
    y = run(torch.tensor([xs + zs for xs, zs in rows]))
    assert y.shape == (2, 8) and y.dtype == torch.float32
    for got, exp in zip(y.tolist(), want):
        assert got == pytest.approx(exp, rel=1e-6, abs=1e-6)


def test_a_mamba2_checkpoint_runs_its_gated_norm(tmp_path):
    """The width error of issue 46 is gone: every layer of a Mamba2 runs (its verdicts: test_truth_onnxruntime)."""
    from parity_cli import api
    from parity_cli.sources.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "m", "mamba2", layers=1, hidden=64, heads=4, eps=1e-5, dtype="float32")
    report = api.check(path, candidate="onnxruntime", dtype="float16", isolation="none")
    assert {l.kind for l in report.layers} == {"gated_rms_norm", "rms_norm"}
    assert all(l.error is None and not any(s.status == "error" for s in l.strata) for l in report.layers)


def test_kinds_check_layer_and_describe():
    from parity_cli.backends import onnx_runtime
    from parity_cli.errors import InputError

    assert onnx_runtime.KINDS == ("rms_norm", "layer_norm", "batch_norm", "group_norm", "gated_rms_norm")
    layer = _layer("before", "silu")
    onnx_runtime.check_layer(layer, "float16")
    with pytest.raises(InputError, match="8 channels in 3 groups"):
        onnx_runtime.check_layer(_layer("before", "silu", groups=3))
    with pytest.raises(InputError, match="no ONNX graph is built at int8"):
        onnx_runtime.check_layer(layer, "int8")
    info = onnx_runtime.describe("cpu")
    assert info["runtime"].startswith("onnxruntime ") and "float32" in info["computes_in"]
    assert info["provider"] == "CPUExecutionProvider"
