"""Issue 46, item 1, for torch.compile: every kind (it claims them all: inductor compiles whatever
the module computes) at every dtype, checked through parity's adapter (torch.compile of the family's
module as implementations builds it, dynamic=True) and through torch.compile's public path
(`torch.compile@public`: torch.compile(module) with default options of the model's module built
apart from parity's adapter, backends.deployed). Both pass, with nothing to diagnose.

Both paths really compile every cell: dynamo keeps 8 compiled variants of one code object and then
runs it eagerly *without a word*, and these 18 cells in one process (as `parity runtimes` checks a
model's kinds at three dtypes) passed that way, eager torch reported as inductor's. Both paths now
raise that limit for their calls and make hitting it an error (the last test)."""

import pytest
from truth_cells import LAYERS, Cells, cases, passes

DTYPES = ("float32", "bfloat16", "float16")
EXPECTED = {(kind, dtype): passes(kind) for kind in LAYERS if kind != "layer_norm/256" for dtype in DTYPES}


@pytest.fixture(scope="module")
def cells(tmp_path_factory):
    return Cells(tmp_path_factory.mktemp("truth-torch-compile"))


@pytest.mark.parametrize("kind, dtype", cases(EXPECTED))
def test_the_adapter_and_torch_compile_of_the_module_give_one_verdict(cells, kind, dtype):
    ours = cells.verdict(kind, "torch.compile", dtype)
    theirs = cells.verdict(kind, "torch.compile@public", dtype)
    assert ours == theirs == EXPECTED[kind, dtype], (ours, theirs)


def test_a_compile_past_dynamos_limit_is_an_error_not_eager(monkeypatch):
    """Past its limit dynamo would run the function eagerly and say nothing; the adapter makes that
    an error. With the limit at 1, a second variant of one function (another dtype) raises."""
    import torch
    from torch._dynamo.exc import FailOnRecompileLimitHit

    from parity_cli.backends import torch_compile

    monkeypatch.setattr(torch_compile, "RECOMPILE_LIMIT", 1)

    def norm(x):  # a code object of its own: no other test's variants count against it
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    run = torch_compile.prepare(None, None, None, 1e-6, norm)
    x = torch.randn(4, 8)
    assert torch.allclose(run(x), norm(x))
    with pytest.raises(FailOnRecompileLimitHit):
        run(x.double())
