"""Issue 46, item 1, and issue 51, for LiteRT: every kind parity's `litert` built-in claims at every
dtype it takes, checked through parity's adapter (one program per module class, width, dtype and eps
converted by litert_torch.convert with the tensors as program inputs, run by ai_edge_litert's
Interpreter) and through LiteRT's public path (`litert@public`: the model's own module with its
parameters, litert_torch.convert, the converted model called as litert_torch documents it). Both
give the same verdict; what the converter cannot convert is one line on both paths, the converter's
own reason on the public path."""

from importlib.util import find_spec

import pytest
from conftest import SLOW
from truth_cells import LAYERS, Cells, cases, passes

# found, not imported: litert_torch brings jax (2.4 s a worker's collection), and the default run
# has one cell of this matrix, which only one worker runs
pytestmark = [
    pytest.mark.skipif(find_spec("litert_torch") is None,
                       reason="needs LiteRT: see parity_cli/backends/litert_runtime.py's INSTALL"),
    pytest.mark.skipif(find_spec("ai_edge_litert") is None,
                       reason="needs LiteRT's interpreter: pip install --no-deps ai-edge-litert")]

from parity_cli.errors import InputError  # noqa: E402

EXPECTED = {(kind, "float32"): passes(kind) for kind in LAYERS}
EXPECTED.update({(kind, "float16"): passes(kind) for kind in ("rms_norm/llama", "rms_norm/gemma", "group_norm",
                                                               "gated_rms_norm")})
# what litert-torch 0.10.0's converter refuses, in its own words on the public path
REFUSED = {("layer_norm", "float16"): "expects operand and result to have compatible element type",
           ("batch_norm", "float16"): "Failed to export flatbuffer"}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return Cells(tmp_path_factory.mktemp("truth-litert"))


@pytest.mark.parametrize("kind, dtype", cases(EXPECTED))
def test_the_adapter_and_litert_torchs_converted_model_give_one_verdict(cells, kind, dtype):
    ours = cells.verdict(kind, "litert", dtype)
    theirs = cells.verdict(kind, "litert@public", dtype)
    assert ours == theirs == EXPECTED[kind, dtype], (ours, theirs)


@pytest.mark.parametrize("candidate", ["litert", "litert@public"])
@pytest.mark.parametrize("kind, dtype", [pytest.param(*cell, marks=SLOW) for cell in REFUSED])
def test_what_the_converter_cannot_convert_is_one_line_on_both_paths(cells, candidate, kind, dtype):
    with pytest.raises(InputError, match=REFUSED[kind, dtype]):
        cells.verdict(kind, candidate, dtype)


@SLOW
def test_no_module_holding_bfloat16_parameters_converts(cells):
    """The public path converts the module as a deployment holds it: litert_torch.convert fails on
    bfloat16 parameters ("Got unsupported ScalarType BFloat16"). parity's adapter, which feeds the
    tensors as inputs and could convert, refuses bfloat16 with that reason rather than check a program
    no deployment can make."""
    with pytest.raises(InputError, match="Got unsupported ScalarType BFloat16"):
        cells.verdict("rms_norm/llama", "litert@public", "bfloat16")
    with pytest.raises(InputError, match="converts no module holding bfloat16 parameters"):
        cells.verdict("rms_norm/llama", "litert", "bfloat16")


@SLOW
@pytest.mark.parametrize("candidate", ["litert", "litert@public"])
def test_its_layer_norm_takes_the_variance_from_x_minus_the_mean(cells, candidate):
    """`--strata offset` (N(0, 1) rows shifted by 10, -100 and 1000), where a variance taken as
    E[x^2] - E[x]^2 cancels (CTranslate2's and ExecuTorch's LayerNorms fail there): LiteRT's converted
    LayerNorm (MEAN, SQUARED_DIFFERENCE, MEAN) passes, as torch's does."""
    assert cells.verdict("layer_norm", candidate, "float32", strata=("offset",)) == passes("layer_norm")


@SLOW
def test_more_rows_than_a_program_takes_run_in_pieces(tmp_path, monkeypatch):
    """A converted program takes a fixed number of rows: the probes' 36 rows a stratum group run as
    pieces of 4, the last one padded, through both paths, and pass as they do in one piece."""
    from parity_cli.backends import litert_runtime

    monkeypatch.setattr(litert_runtime, "ROWS", 4)
    cells = Cells(tmp_path)
    assert cells.verdict("layer_norm", "litert", "float32") == cells.verdict("layer_norm", "litert@public", "float32") \
        == passes("layer_norm")
