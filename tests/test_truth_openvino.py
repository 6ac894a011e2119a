"""Issue 46, item 1, for OpenVINO: every kind parity's `openvino` built-in claims (rms_norm in LLaMA's
and Gemma's order, layer_norm, group_norm, batch_norm, Mamba2's gated rms_norm) at every dtype it
takes, checked through parity's adapter (the norm built from opset ops: the decomposed RMS pattern,
MVN-6, GroupNormalization-12, BatchNormInference-5) and through OpenVINO's public path
(`openvino@public`: `ov.convert_model` of the family's torch module, compiled on the CPU plugin).
OpenVINO is correct on every cell: both paths pass.

The plugin runs at its default inference precision on both paths. Where the CPU has avx512_bf16/AMX
that default is bf16 and every op rounds to it: both paths must still agree, but PASS is asserted
only where the plugin computes in f32."""

import pytest
from truth_cells import Cells, cases, passes

from parity_cli import api

ov = pytest.importorskip("openvino", reason="needs OpenVINO: pip install openvino")

DTYPES = ("float32", "bfloat16", "float16")
KINDS = ("rms_norm/llama", "rms_norm/gemma", "layer_norm", "group_norm", "batch_norm", "gated_rms_norm")
EXPECTED = {(kind, dtype): passes(kind) for kind in KINDS for dtype in DTYPES}


def _plugin_computes_f32() -> bool:
    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name() == "f32"


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return Cells(tmp_path_factory.mktemp("truth-openvino"))


@pytest.mark.parametrize("kind, dtype", cases(EXPECTED))
def test_the_adapter_and_openvinos_own_path_give_one_verdict(cells, kind, dtype):
    ours = cells.verdict(kind, "openvino", dtype)
    theirs = cells.verdict(kind, "openvino@public", dtype)
    assert ours == theirs, (ours, theirs)
    if _plugin_computes_f32():
        assert ours == EXPECTED[kind, dtype], ours


def test_the_public_path_is_the_converted_module(cells):
    """What openvino@public runs is the frontend's own translation: Mamba2's gated norm converted
    has the Swish (aten::silu) and the Slice of [x | z] that the adapter builds from the opset."""
    import warnings

    import torch

    from parity_cli.backends.deployed import norm_module
    from parity_cli.backends.openvino_runtime import build_gated_model
    from parity_cli.model.layers import discover_layers

    ckpt, fam, eps = api.load(cells.checkpoint("gated_rms_norm"))
    (layer,) = [l for l in discover_layers(ckpt, fam, eps).layers if l.kind == "gated_rms_norm"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace's deprecation, inside the frontend
        converted = ov.convert_model(norm_module(layer, layer.weight.float(), None, 1e-6),
                                     example_input=torch.zeros(2, 2 * layer.dim))
    built = build_gated_model(layer.dim, layer.groups, layer.gate, layer.activation, layer.order, "float32", 1e-6,
                              0.0, layer.inverse_sqrt, layer.weight.float())

    def ops(model):
        return {op.get_type_name() for op in model.get_ordered_ops()} & {"Swish", "Slice", "Power", "ReduceMean",
                                                                         "Sqrt", "Divide", "Reshape", "Multiply"}

    assert ops(converted) == ops(built) == {"Swish", "Slice", "Power", "ReduceMean", "Sqrt", "Divide", "Reshape",
                                            "Multiply"}
