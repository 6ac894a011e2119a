"""Issue 46, item 1, and issue 51, for CTranslate2: the kinds parity's `ctranslate2` built-in claims
(rms_norm in LLaMA's and Gemma's form, layer_norm with a bias) at the dtype CTranslate2's CPU
computes, checked through parity's adapter (a one-norm encoder built with ctranslate2.specs, run by
ctranslate2.Encoder) and through CTranslate2's public path (`ctranslate2@public`: a transformers
model converted by CTranslate2's own TransformersConverter and run by ctranslate2.Generator). Both
give the same verdict with the same cause. What CTranslate2 has no kernel or compute type for is
one line on both paths."""

import pytest
from conftest import SLOW
from truth_cells import Cells, cases, fails, passes

pytest.importorskip("ctranslate2", reason="needs CTranslate2: pip install ctranslate2")

from parity_cli.errors import InputError  # noqa: E402

KINDS = ("rms_norm/llama", "rms_norm/gemma", "layer_norm", "layer_norm/256")
EXPECTED = {(kind, "float32"): passes(kind) for kind in KINDS}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return Cells(tmp_path_factory.mktemp("truth-ct2"))


@pytest.mark.parametrize("kind, dtype", cases(EXPECTED))
def test_the_adapter_and_ctranslate2s_converted_model_give_one_verdict(cells, kind, dtype):
    ours = cells.verdict(kind, "ctranslate2", dtype)
    theirs = cells.verdict(kind, "ctranslate2@public", dtype)
    assert ours == theirs == EXPECTED[kind, dtype], (ours, theirs)


@pytest.mark.parametrize("candidate", ["ctranslate2", "ctranslate2@public"])
@pytest.mark.parametrize("kind, dtype, words", [
    ("rms_norm/llama", "bfloat16", "no bfloat16 compute type on cpu"),
    ("layer_norm", "float16", "no float16 compute type on cpu"),
    ("group_norm", "float32", "has no group_norm norm here"),
    ("batch_norm", "float32", "has no batch_norm norm here"),
    ("gated_rms_norm", "float32", "has no gated_rms_norm norm here"),
])
def test_what_ctranslate2_does_not_compute_is_one_line_on_both_paths(cells, candidate, kind, dtype, words):
    with pytest.raises(InputError, match=words):
        cells.verdict(kind, candidate, dtype)


# --- the runtime fact behind the offset stratum's FAIL, through CTranslate2 alone -------------------


@SLOW
@pytest.mark.parametrize("candidate", ["ctranslate2", "ctranslate2@public"])
def test_a_mean_far_above_the_spread_fails_its_layer_norm_with_the_variance_named(cells, candidate):
    """`--strata offset` (N(0, 1) rows shifted by 10, -100 and 1000): CTranslate2's LayerNorm takes the
    variance as E[x^2] - E[x]^2 in float32 (cpu/kernels.cc), which cancels there; torch's passes."""
    assert cells.verdict("layer_norm", candidate, "float32", strata=("offset",)) == \
        fails("layer_norm", "variance_cancellation")
    assert cells.verdict("layer_norm", "torch", "float32", strata=("offset",)) == passes("layer_norm")


@SLOW
def test_its_layer_norm_of_a_row_far_from_zero_misses_by_percent(tmp_path):
    """A converted GPT-2 whose output is its final LayerNorm (one layer adding 0, an identity head):
    the transformers model is the one the public path writes (written by transformers), and from there
    only TransformersConverter and ctranslate2.Generator run it. Rows of N(0, 1) + 1000 miss the exact
    LayerNorm by more than 1e-3, the same rows centred on 0 by less than 1e-5."""
    from types import SimpleNamespace

    import ctranslate2
    import numpy as np
    import torch
    from ctranslate2.converters import TransformersConverter

    from parity_cli.backends.ctranslate2_runtime import _write_norm_model

    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    rows = torch.cat([noise + 1000, noise]).float()
    w, b = torch.ones(64), torch.zeros(64)
    _write_norm_model(tmp_path / "hf", SimpleNamespace(kind="layer_norm", gain_offset=0.0), rows, w, b, 1e-5)
    out = TransformersConverter(str(tmp_path / "hf")).convert(str(tmp_path / "ct2"))
    logits = ctranslate2.Generator(out, compute_type="float32").forward_batch([[i] for i in range(16)])
    y = torch.from_numpy(np.array(logits)).reshape(16, -1)[:, :64].double()
    x = rows.double()
    exact = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    err = (y - exact).abs().amax(-1)
    assert err[:8].max() > 1e-3 and err[8:].max() < 1e-5, err


# --- CUDA: the half compute types CTranslate2 has there -------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["rms_norm/llama", "rms_norm/gemma", "layer_norm"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_on_cuda_its_half_compute_types_give_one_verdict_on_both_paths(tmp_path, kind, dtype):
    """Where CTranslate2 was built with CUDA it computes float16 and bfloat16 (its CPU does not): both
    paths run there, the candidate's tensors and the model on the GPU, and pass."""
    import ctranslate2

    if ctranslate2.get_cuda_device_count() == 0:
        pytest.skip("needs a CUDA device and a CUDA build of CTranslate2")
    from truth_cells import LAYERS

    from parity_cli import api

    cells = Cells(tmp_path)
    verdicts = []
    for candidate in ("ctranslate2", "ctranslate2@public"):
        report = api.check(cells.checkpoint(kind), candidate=candidate, dtype=dtype, device="cuda",
                           layers=LAYERS[kind][1], isolation="none")
        assert report.header["candidate"]["device"].startswith("cuda")
        verdicts.append([(layer.status, sorted(d.code for d in layer.diagnoses)) for layer in report.layers])
    assert verdicts[0] == verdicts[1] == [("pass", [])], verdicts
