"""Issue 46: llama.cpp's ggml builds the kinds ggml has. A GroupNorm through ggml's own
ggml_group_norm (its eps the layer's: the argument ggml takes), a gated RMSNorm as llama.cpp's
Mamba2 (silu(z) * x before the grouped statistic) and Qwen3-Next / Kimi Linear (the gate after)
graphs build it; BatchNorm, which ggml has no op for, refused in one line.

Expected values are transcribed from the definitions in float64 here, never read from the tool."""

import importlib.util
import math

import pytest
from conftest import run_parity

from parity_cli import api
from parity_cli.errors import InputError


def _ggml_loads() -> bool:
    if importlib.util.find_spec("xllamacpp") is None:
        return False
    import ctypes

    from parity_cli.backends.ggml_kernels import library

    try:
        ctypes.CDLL(str(library()))
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _ggml_loads(), reason="needs llama.cpp's ggml: pip install --no-deps xllamacpp")


def _layer(kind, dim, groups=1, spatial=1, gate=None, activation=None, eps=1e-5):
    import torch

    from parity_cli.model.layers import NormLayer
    from parity_cli.sources.tensors import Eps

    return NormLayer(name=f"t.{kind}", kind=kind, dim=dim, order="llama", gain_offset=0.0, eps=Eps(eps, "test"),
                     weight=torch.ones(dim), groups=groups, spatial=spatial, gate=gate, activation=activation)


def test_group_norm_is_ggml_group_norm_with_the_layers_eps():
    """C = 4 channels in 2 groups, 2 positions each, eps 0.25 (large, so an eps ggml ignored, or took
    as its old hard-coded 1e-6, shows). Group 0 holds [1, -1, 1, -1] (mean 0, variance 1), group 1
    [3, 3, 5, 5] (mean 4, variance 1): each normalised value is (x - mean) / sqrt(1.25)."""
    import torch

    from parity_cli.backends.ggml_kernels import prepare

    layer = _layer("group_norm", 4, groups=2, spatial=2, eps=0.25)
    gain, bias = torch.tensor([1.0, 2.0, -1.0, 0.5]), torch.tensor([0.0, 0.5, 0.0, -1.0])
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0, 3.0, 3.0, 5.0, 5.0]])  # channel-major: c0 s0, c0 s1, c1 s0, ...
    k = 1 / math.sqrt(1.25)
    normed = [k, -k, k, -k, -k, -k, k, k]
    want = [normed[i] * [1.0, 2.0, -1.0, 0.5][i // 2] + [0.0, 0.5, 0.0, -1.0][i // 2] for i in range(8)]
    y = prepare(layer, gain, bias, 0.25)(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert y[0].tolist() == pytest.approx(want, abs=2e-7)


@pytest.mark.parametrize("gate, activation", [("before", "silu"), ("after", "silu"), ("after", "sigmoid")])
def test_gated_rms_norm_is_llama_cpps_graph(gate, activation):
    """[x | z] rows, 8 channels in 2 groups: before, RMSNorm per group of x * act(z); after, RMSNorm
    per group of x, times act(z); silu(z) = z / (1 + e^-z), sigmoid(z) = 1 / (1 + e^-z)."""
    import torch

    from parity_cli.backends.ggml_kernels import prepare

    eps = 1e-3
    layer = _layer("gated_rms_norm", 8, groups=2, gate=gate, activation=activation, eps=eps)
    gain = torch.tensor([1.0, 0.5, -2.0, 3.0, 1.5, -1.0, 0.25, 2.0])
    xs = [0.5, -1.0, 2.0, 0.25, -3.0, 1.0, 0.75, -0.5]
    zs = [1.0, -2.0, 0.5, 3.0, 0.0, -1.0, 2.0, -0.5]

    def act(z):
        return z / (1 + math.exp(-z)) if activation == "silu" else 1 / (1 + math.exp(-z))

    h = [x * act(z) for x, z in zip(xs, zs)] if gate == "before" else xs
    want = []
    for g in range(2):
        part = h[4 * g: 4 * g + 4]
        scale = 1 / math.sqrt(sum(v * v for v in part) / 4 + eps)
        want += [v * scale for v in part]
    want = [w * float(gain[i]) * (act(zs[i]) if gate == "after" else 1.0) for i, w in enumerate(want)]
    y = prepare(layer, gain, None, eps)(torch.tensor([xs + zs]))
    assert y.shape == (1, 8)
    assert y[0].tolist() == pytest.approx(want, rel=2e-6, abs=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_mamba2_and_group_norm_checkpoints_pass(ckpt, dtype):
    """A correct Mamba2 (its gated norm among plain RMSNorms) and a GroupNorm model pass through ggml."""
    for model_type in ("mamba2", "mask2former"):
        src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-5, dtype=dtype)
        report = api.check(src, candidate="llama.cpp", isolation="none")
        kinds = {layer.kind for layer in report.layers}
        assert kinds == ({"gated_rms_norm", "rms_norm"} if model_type == "mamba2" else {"group_norm"})
        assert report.passed, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers if not l.passed]


def test_batch_norm_is_refused_in_one_line(ckpt):
    r = run_parity("check", ckpt("resnet", layers=1, hidden=16, eps=1e-5, dtype="float32"), "--candidate",
                   "llama.cpp")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "ggml has no BatchNorm op" in r.stderr, r.stderr


def test_kinds_and_check_layer():
    from parity_cli.backends import ggml_kernels

    assert ggml_kernels.KINDS == ("rms_norm", "layer_norm", "group_norm", "gated_rms_norm")
    for kind in ggml_kernels.KINDS:
        ggml_kernels.check_layer(_layer(kind, 8, groups=2), "float16")
    with pytest.raises(InputError, match="is a batch_norm"):
        ggml_kernels.check_layer(_layer("batch_norm", 8))
    with pytest.raises(InputError, match="8 channels in 3 groups"):
        ggml_kernels.check_layer(_layer("group_norm", 8, groups=3))
    info = ggml_kernels.describe("cpu")
    assert info["runtime"].startswith("xllamacpp ") and "float32" in info["computes_in"]
