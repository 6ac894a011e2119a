"""parity_cli.testing (issue 28): assert_norm_parity and check_norm as a kernel library uses them.

The kernels are tests/kernel_examples/fused_norms.py (Liger's and vLLM's forms in torch ops, correct
and with each classic fault), transformers' own LlamaRMSNorm, GemmaRMSNorm and CohereLayerNorm,
and keras 3's RMSNormalization. Every expected figure is derived here from the formula in float64
(y = x / sqrt(q + eps) * gain, q = mean(x^2)) or from the kernel's own definition, never read off
the library's output: the library's figures are what is checked against them."""

import functools
import json
import math
import os
import re
import sys
import traceback
import types
from pathlib import Path

import pytest
import torch
from kernel_examples import fused_norms as k

import parity_cli
from parity_cli.testing import NormParityResult, assert_norm_parity, check_norm

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "parity_cli"
H = 4096
BF16_UNIT = 2.0 ** -8  # bfloat16 keeps 8 significant bits: one rounding moves a value by at most 2^-8 of it
FP32_UNIT = 2.0 ** -23
TINY_LEVELS = (0.01, 0.1, 1.0, 10.0, 100.0)  # the default tiny sweep of q/eps (the brief, section 3)


def llama(**kw):
    return {"family": "llama", "hidden_size": H, "eps": 1e-6, **kw}


def stratum(result: NormParityResult, name: str) -> dict:
    return next(s for s in result.to_dict()["layers"][0]["strata"] if s["name"] == name)


def formula_reference(worst: dict, eps: float, gain: float = 1.0) -> float:
    """The float64 reference at the worst element from its input and its row's q: x / sqrt(q + eps) * gain."""
    q = worst["q_over_eps"] * eps
    return worst["input"] / math.sqrt(q + eps) * gain


# --- the four classic faults: caught, and the cause named ---------------------------------------------


def test_eps_hard_coded_1e5_is_named_with_the_eps_it_behaves_as():
    """eps 1e-5 hard-coded where the model has 1e-6 (bf16): eps_mismatch at ~1e-5, on tiny; at the worst
    element the candidate is the reference times sqrt((q + 1e-6) / (q + 1e-5)), the attenuation ratio of
    the two eps at that row's q."""
    with pytest.raises(AssertionError) as info:
        assert_norm_parity(k.rms_norm_eps_1e5, **llama(dtype=torch.bfloat16))
    message = str(info.value)
    result = check_norm(k.rms_norm_eps_1e5, **llama(dtype=torch.bfloat16))
    assert message == result.message
    first = message.splitlines()[0]
    assert first.startswith("eps_mismatch") and "eps_mismatch" in first and "1e-5" in first and "configured 1e-6" in first
    assert "tiny" in result.failing_strata and "tiny" in message
    assert "q/eps" in message and "worst" in message
    (diag,) = [d for d in result.diagnoses if d["code"] == "eps_mismatch"]
    assert diag["estimated_eps"] == pytest.approx(1e-5, rel=0.05)
    w = stratum(result, "tiny")["worst"]
    assert any(w["q_over_eps"] == pytest.approx(level, rel=0.02) for level in TINY_LEVELS)
    assert w["reference"] == pytest.approx(formula_reference(w, 1e-6), rel=1e-12)
    q = w["q_over_eps"] * 1e-6
    assert w["candidate"] / w["reference"] == pytest.approx(math.sqrt((q + 1e-6) / (q + 1e-5)), rel=2 * BF16_UNIT)
    # the printed worst element is that element, three significant digits
    assert f"ref {w['reference']:.3g}" in message and f"cand {w['candidate']:.3g}" in message


@pytest.mark.parametrize("dtype,unit", [(torch.float32, 8 * FP32_UNIT), (torch.bfloat16, 2 * BF16_UNIT)])
def test_eps_outside_the_sqrt_is_named_on_tiny(dtype, unit):
    """x / (sqrt(q) + eps) for x / sqrt(q + eps): at the worst element the ratio is sqrt(q + eps) / (sqrt(q) + eps)."""
    result = check_norm(k.rms_norm_eps_outside_sqrt, **llama(dtype=dtype))
    assert not result
    assert result.message.splitlines()[0].startswith("eps_outside_sqrt")
    assert "tiny" in result.failing_strata
    w = stratum(result, "tiny")["worst"]
    q = w["q_over_eps"] * 1e-6
    assert w["reference"] == pytest.approx(formula_reference(w, 1e-6), rel=1e-12)
    assert w["candidate"] / w["reference"] == pytest.approx(math.sqrt(q + 1e-6) / (math.sqrt(q) + 1e-6), rel=unit)
    with pytest.raises(AssertionError, match="eps_outside_sqrt"):
        assert_norm_parity(k.rms_norm_eps_outside_sqrt, **llama(dtype=dtype))


def test_no_upcast_is_named_and_large_rows_come_out_zero():
    """casting_mode none at float16: x^2 past |x| = 256 overflows (65536 > 65504), rsqrt(inf) = 0, so every
    output of the large stratum (|x| >= 256 in every component) is exactly 0: relative error exactly 1."""
    assert torch.tensor(256.0, dtype=torch.float16) ** 2 == math.inf
    result = check_norm(k.rms_norm_no_upcast, **llama(dtype=torch.float16))
    assert not result
    assert "reduced_precision_reduction" in result.message.splitlines()[0]
    large = stratum(result, "large")
    assert large["status"] == "fail" and large["max_rel_err"] == 1.0 and large["worst"]["candidate"] == 0.0
    with pytest.raises(AssertionError, match="without a float32 upcast"):
        assert_norm_parity(k.rms_norm_no_upcast, **llama(dtype=torch.float16))


def test_missing_one_plus_w_is_named_for_gemma():
    """A Gemma model through the Llama configuration: the stored w = 0.25 used as the gain where the model's
    is 1 + w = 1.25, so wherever the row's eps is negligible the candidate is 0.25 / 1.25 = 0.2 of the reference."""
    w = torch.full((H,), 0.25)
    result = check_norm(k.gemma_rms_norm_without_offset, family="gemma", hidden_size=H, eps=1e-6,
                        dtype=torch.bfloat16, weight=w)
    assert not result
    first = result.message.splitlines()[0]
    assert "weight_offset_mismatch" in first and "+1 is missing" in first
    normal = stratum(result, "normal")["worst"]
    assert normal["candidate"] / normal["reference"] == pytest.approx(0.2, rel=2 * BF16_UNIT)
    assert normal["reference"] == pytest.approx(formula_reference(normal, 1e-6, gain=1.25), rel=1e-6)
    fixed = check_norm(functools.partial(k.rms_norm_fwd, offset=1.0, casting_mode="gemma"), family="gemma",
                       hidden_size=H, eps=1e-6, dtype=torch.bfloat16, weight=w)
    assert fixed, fixed.message


# --- assert_close on randn passes two of them (the README's comparison) -----------------------------------


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 at each |v| (8 significant bits): 2^(floor(log2 |v|) - 7)."""
    return torch.exp2(torch.floor(torch.log2(v.abs())) - 7)


def randn_case(dtype):
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(0)).to(dtype)
    return x, torch.ones(H, dtype=dtype)


@pytest.mark.parametrize("fault,dtype", [(k.rms_norm_eps_1e5, torch.bfloat16),
                                         (k.rms_norm_eps_outside_sqrt, torch.float32),
                                         (k.rms_norm_eps_outside_sqrt, torch.bfloat16)])
def test_assert_close_on_randn_passes_what_parity_fails_on_tiny(fault, dtype):
    """The kernel test a library has today: randn(4, 4096), the correct kernel as reference, assert_close with
    its default tolerances. On randn q ~ 1, so q/eps ~ 1e6: eps 1e-5 instead of 1e-6 moves an output by a
    factor sqrt((q + 1e-6)/(q + 1e-5)) ~ 1 - 4.5e-6, eps outside the root by sqrt(q + eps)/(sqrt(q) + eps)
    ~ 1 - 5e-7; both under float32's rtol (1.3e-6) or under bfloat16's rounding. assert_close passes; here
    they fail, on the tiny stratum."""
    x, w = randn_case(dtype)
    want, got = k.fused_rms_norm(x, w, 1e-6), fault(x, w, 1e-6)
    torch.testing.assert_close(got, want)  # passes: the fault is invisible on randn
    q = x.double().pow(2).mean(-1, keepdim=True)
    if fault is k.rms_norm_eps_1e5:
        factor = torch.sqrt((q + 1e-6) / (q + 1e-5))
    else:
        factor = torch.sqrt(q + 1e-6) / (torch.sqrt(q) + 1e-6)
    assert float((1 - factor).abs().max()) < 1e-5  # what the fault does on these rows: nothing assert_close sees
    if dtype == torch.float32:  # the fault's factor, up to float32 roundings of both sides
        assert torch.allclose(got.double() / want.double(), factor.expand_as(want), rtol=0, atol=8 * FP32_UNIT)
    else:  # a difference below bfloat16's rounding: at most one ulp where the factor crosses a rounding edge
        assert bool(((got.double() - want.double()).abs() <= bf16_ulp(want.double())).all())
    result = check_norm(fault, **llama(dtype=dtype))
    assert not result and "tiny" in result.failing_strata
    assert stratum(result, "tiny")["violations"] > 0


def readme_section() -> str:
    """The docs page for kernel authors (docs/kernel-tests.md; the README's section before issue 50)."""
    return (ROOT / "docs" / "kernel-tests.md").read_text(encoding="utf-8")


def test_readme_example_runs_and_catches_the_fault(monkeypatch):
    """The section's first Python block, run as a test module with its `my_kernels` import served by the
    example kernels: the correct kernel passes, eps hard-coded at 1e-5 fails with the cause named, and
    the failure shown under it is that failure's first line and worst element."""
    shown = re.findall(r"^```text\n(.*?)^```", readme_section(), re.M | re.S)[0]
    message = check_norm(k.rms_norm_eps_1e5, **llama(dtype=torch.bfloat16)).message
    assert shown.splitlines()[0] == "E       AssertionError: " + message.splitlines()[0]
    unfolded = re.sub(r"\n +", " ", message)  # the worst element's line may be folded at the width
    worst = re.search(r"x \S+, ref \S+, cand \S+, allowed \S+ \(\S+ allowed\)", unfolded).group(0)
    assert worst in re.sub(r"\n(E )? +", " ", shown)
    blocks = re.findall(r"^```python\n(.*?)^```", readme_section(), re.M | re.S)
    assert blocks, "no python block in the section"
    example = blocks[0]
    assert len([line for line in example.splitlines() if line.strip()]) <= 6  # "the five-line example"
    for kernel, passes in ((k.fused_rms_norm, True), (k.rms_norm_eps_1e5, False)):
        monkeypatch.setitem(sys.modules, "my_kernels", types.SimpleNamespace(fused_rms_norm=kernel))
        namespace: dict = {}
        exec(compile(example, "docs/kernel-tests.md", "exec"), namespace)
        tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
        assert len(tests) == 1
        if passes:
            tests[0]()
        else:
            with pytest.raises(AssertionError, match="eps_mismatch"):
                tests[0]()


README_ROWS = [(k.rms_norm_eps_1e5, torch.bfloat16), (k.rms_norm_eps_outside_sqrt, torch.float32),
               (k.rms_norm_eps_outside_sqrt, torch.bfloat16), (k.rms_norm_eps_1e5, torch.float32),
               (k.rms_norm_no_upcast, torch.float16)]


def test_readme_numbers_are_the_measured_ones():
    """The comparison table states what this test measures: how many of randn(4, 4096)'s 16,384 outputs
    differ from the correct kernel's, the largest relative difference, assert_close's verdict, and where
    the row names it, the parity check's worst element on tiny (times allowed) and its row's q/eps."""
    from parity_cli.report.grouping import unpadded

    section = readme_section()
    for fault, dtype in README_ROWS:
        x, w = randn_case(dtype)
        want, got = k.fused_rms_norm(x, w, 1e-6), fault(x, w, 1e-6)
        differ = int((got.double() != want.double()).sum())
        rel = float(((got.double() - want.double()).abs() / want.double().abs()).max())
        try:
            torch.testing.assert_close(got, want)
            verdict = "passes"
        except AssertionError:
            verdict = "fails"
        name = str(dtype).removeprefix("torch.")
        row = next((line for line in section.splitlines() if line.startswith(f"| `{fault.__name__}`")
                    and f"| {name} |" in line), None)
        assert row is not None, (fault.__name__, name)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == f"{differ:,} of 16,384", row
        assert cells[3] == (unpadded(f"{rel:.1e}") if rel else "0"), (row, rel)
        assert cells[4].split()[0] == verdict, row
        result = check_norm(fault, **llama(dtype=dtype))
        assert not result and cells[5].startswith("fails")
        assert f"`{result.diagnoses[0]['code']}`" in cells[5]
        if "worst on tiny" in cells[5]:
            tiny = stratum(result, "tiny")["worst"]
            ratio = abs(tiny["candidate"] - tiny["reference"]) / tiny["allowed"]
            assert f"worst on tiny {unpadded(f'{ratio:.3g}')}x allowed, at q/eps {tiny['q_over_eps']:.2g}" in cells[5]


# --- correct kernels and real third-party classes pass -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_correct_kernels_in_every_form(dtype):
    """A function, a partial, a module class and a module instance: each the correct kernel, each passes,
    and assert_norm_parity returns the result."""
    for candidate in (k.fused_rms_norm, functools.partial(k.rms_norm_fwd, casting_mode="llama"), k.FusedRMSNorm,
                      k.FusedRMSNorm(H, eps=1e-6), k.rms_norm_from_fused_add):
        result = assert_norm_parity(candidate, **llama(dtype=dtype, weight="random"))
        assert isinstance(result, NormParityResult) and result and result.status == "pass"
        assert result.worst_ratio <= 1.0


def test_module_instance_keeps_its_own_eps_and_is_not_touched():
    """An instance built with the library's default eps (1e-5) for a model with 1e-6 fails as eps_mismatch; the
    caller's module is copied, never moved, cast or refilled."""
    module = k.FusedRMSNorm(H, eps=1e-5)
    before = module.weight.detach().clone()
    result = check_norm(module, **llama(dtype=torch.bfloat16, weight="random"))
    assert not result and "eps_mismatch" in result.message.splitlines()[0]
    assert module.weight.dtype == torch.float32 and torch.equal(module.weight.detach(), before)


def test_module_instance_weight_is_read_as_stored():
    """weight=None takes a module instance's own weight: a trained gain of 1.5 with the correct kernel passes,
    and the reference then has gain 1.5: at a normal row's worst element ref = x / sqrt(q + eps) * 1.5."""
    module = k.FusedRMSNorm(H, eps=1e-6)
    with torch.no_grad():
        module.weight.fill_(1.5)
    result = assert_norm_parity(module, **llama(dtype=torch.float32))
    w = stratum(result, "normal")["worst"]
    assert w["reference"] == pytest.approx(formula_reference(w, 1e-6, gain=1.5), rel=1e-12)
    assert result.to_dict()["testing"]["weight"] == "the module's own"


def test_transformers_classes_as_candidates():
    pytest.importorskip("transformers")
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert_norm_parity(LlamaRMSNorm, **llama(dtype=dtype, weight="random"))
        assert_norm_parity(GemmaRMSNorm, family="gemma", hidden_size=H, eps=1e-6, dtype=dtype, weight="random")
        assert_norm_parity(CohereLayerNorm, family="cohere", hidden_size=128, heads=8, eps=1e-5, dtype=dtype,
                           weight="random")
    # Llama's class on a Gemma checkpoint: the gain w where the model's is 1 + w
    with pytest.raises(AssertionError, match=r"weight_offset_mismatch.*\+1 is missing"):
        assert_norm_parity(LlamaRMSNorm, family="gemma", hidden_size=H, eps=1e-6, dtype=torch.bfloat16,
                           weight="random")
    # Gemma's class built with eps 1e-5 for a model with 1e-6
    result = check_norm(GemmaRMSNorm(H, eps=1e-5), family="gemma", hidden_size=H, eps=1e-6, dtype=torch.bfloat16)
    (diag,) = [d for d in result.diagnoses if d["code"] == "eps_mismatch"]
    assert diag["estimated_eps"] == pytest.approx(1e-5, rel=0.05)


def keras_rms(epsilon=None):
    """keras 3's RMSNormalization on its torch backend as fn(x, weight, eps), the way a user wraps it."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("keras runs on another backend in this process")

    def run(x, weight, eps):
        layer = keras.layers.RMSNormalization(epsilon=eps if epsilon is None else epsilon)
        layer.build((None, x.shape[-1]))
        layer.set_weights([weight.float().numpy()])
        return torch.as_tensor(keras.ops.convert_to_numpy(layer(x))).to(x.dtype)

    return keras, run


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_keras_rms_normalization():
    """With the model's eps it passes; left at its own default epsilon on an OLMo 2 norm (eps 1e-5) it is an
    eps_mismatch at that default."""
    keras, with_eps = keras_rms()
    default = keras.layers.RMSNormalization().epsilon  # keras' documented default, read off the class
    _, with_default = keras_rms(epsilon=default)
    for dtype in (torch.bfloat16, torch.float32):
        assert_norm_parity(with_eps, **llama(dtype=dtype, weight="random"))
    result = check_norm(with_default, family="olmo2", hidden_size=H, eps=1e-5, dtype=torch.float32, weight="random")
    (diag,) = [d for d in result.diagnoses if d["code"] == "eps_mismatch"]
    assert diag["estimated_eps"] == pytest.approx(default, rel=0.05)


def test_per_head_layer_norm():
    """Cohere's q/k norm: a (heads, head_dim) gain, each head normalised over head_dim. The fused LayerNorm
    passes; the same kernel fed the first head's gain for every head does not."""
    assert_norm_parity(k.fused_layer_norm, family="cohere", hidden_size=128, heads=8, eps=1e-5,
                       dtype=torch.bfloat16, weight="random")

    def first_head_gain(x, weight, eps, bias=None):
        return k.fused_layer_norm(x, weight[:1].expand_as(weight), eps, bias)

    result = check_norm(first_head_gain, family="cohere", hidden_size=128, heads=8, eps=1e-5, dtype=torch.bfloat16,
                        weight="random")
    assert not result and {"normal", "large"} <= set(result.failing_strata)


def test_layer_norm_family_with_bias():
    """nn.LayerNorm's family gets a bias by default; a kernel that drops it fails wherever h * g + b differs
    from h * g: with bias 0.5 everywhere, the zero rows (h = 0) are b = 0.5 in the reference and 0 here."""
    b = torch.full((H,), 0.5)
    assert_norm_parity(k.fused_layer_norm, family="layer_norm", hidden_size=H, eps=1e-5, dtype=torch.float32,
                       weight="random", bias=b)
    result = check_norm(lambda x, w, eps, bias=None: k.fused_layer_norm(x, w, eps), family="bert", hidden_size=H,
                        eps=1e-12, dtype=torch.float32, bias=b)
    zero = stratum(result, "zero")
    assert zero["status"] == "fail" and zero["worst"]["reference"] == 0.5 and zero["worst"]["candidate"] == 0.0


def test_grad_compares_a_hand_written_backward():
    """grad=True: the backward written out (dx = rstd (g - n mean(g n))) passes; dropping the shared term fails
    on dx and is named grad_mismatch."""
    kw = dict(family="olmo2", hidden_size=H, eps=1e-5, dtype=torch.float32, weight="random", grad=True)
    assert_norm_parity(k.rms_norm_custom_backward, **kw)
    result = check_norm(k.rms_norm_backward_drops_shared_term, **kw)
    assert not result and "grad_mismatch" in result.message.splitlines()[0]
    assert any(s.endswith(":dx") for s in result.failing_strata)
    assert not any(s.endswith(":dweight") for s in result.failing_strata)


# --- the result --------------------------------------------------------------------------------------------


def test_result_bool_dict_and_repr():
    jsonschema = pytest.importorskip("jsonschema")
    from parity_cli.resources import schema_path

    good = check_norm(k.fused_rms_norm, **llama(dtype=torch.bfloat16))
    bad = check_norm(k.rms_norm_eps_1e5, **llama(dtype=torch.bfloat16))
    assert bool(good) is True and bool(bad) is False
    schema = json.loads(schema_path().read_text())
    for result in (good, bad):
        d = result.to_dict()
        json.loads(json.dumps(d, allow_nan=False))  # JSON as it is, no NaN or inf left in
        jsonschema.validate(d, schema)
        assert d["summary"]["verdict"] == ("pass" if result else "fail")
        assert d["layers"][0]["status"] == result.status
        assert d["probes"]["strata"] == ["zero", "tiny", "normal", "constant", "mixed", "large", "outlier"]
        text = repr(result)
        assert text.startswith("NormParityResult(") and "llama" in text and "bfloat16" in text
        assert "tensor(" not in text and "tensor(" not in result.message and "\n" not in text
    assert "PASS" in repr(good) and "FAIL" in repr(bad) and "eps_mismatch" in repr(bad)
    assert str(bad) == bad.message
    bad.to_dict()["layers"].clear()  # a copy each time: the result stays as it was
    assert bad.to_dict()["layers"]


def test_message_goes_through_summary_lines_when_the_cli_has_it(monkeypatch):
    """The finding is the CLI's renderer's where parity_cli.report.terminal.summary_lines exists."""
    from parity_cli.report import terminal

    seen = []

    def summary_lines(d, width):
        seen.append((d["layers"][0]["name"], width))
        return ["FAIL: rendered by the CLI", "second line"]

    monkeypatch.setattr(terminal, "summary_lines", summary_lines, raising=False)
    result = check_norm(k.rms_norm_eps_1e5, **llama(dtype=torch.bfloat16))
    lines = result.message.splitlines()
    assert lines[0] == "rendered by the CLI" and "second line" in lines  # the cause first, no "FAIL: "
    assert seen and seen[0][0] == "llama:rms_norm[4096]"


def test_strata_tolerance_and_seed_arguments():
    """strata picks the rows, atol/rtol replace the profile (the report says so), seed picks other probes."""
    result = assert_norm_parity(k.fused_rms_norm, **llama(dtype=torch.float32, strata="tiny,zero"))
    assert result.to_dict()["probes"]["strata"] == ["tiny", "zero"]
    # eps 1e-5 for 1e-6 only shows where eps is not negligible: the normal rows alone pass it at float32's
    # tolerance widened to 1e-5 relative (the factor is 1 - 4.5e-6 at q ~ 1)
    assert check_norm(k.rms_norm_eps_1e5, **llama(dtype=torch.float32, strata=["normal"], rtol=1e-5))
    tol = check_norm(k.fused_rms_norm, **llama(dtype=torch.float32, atol=1e-4, rtol=1e-3)).to_dict()["tolerance"]
    assert (tol["atol"], tol["rtol"], tol["source"]) == (1e-4, 1e-3, "option")
    a = stratum(check_norm(k.fused_rms_norm, **llama(dtype=torch.float32, seed=1)), "normal")["worst"]
    b = stratum(check_norm(k.fused_rms_norm, **llama(dtype=torch.float32, seed=2)), "normal")["worst"]
    assert a["input"] != b["input"]


def test_model_type_and_family_object():
    from parity_cli.model.families import find_family

    r1 = check_norm(k.fused_rms_norm, family="qwen3", hidden_size=128, eps=1e-6, dtype=torch.bfloat16)
    r2 = check_norm(k.fused_rms_norm, family=find_family("llama"), hidden_size=128, eps=1e-6, dtype=torch.bfloat16)
    assert r1 and r2 and r1.to_dict()["testing"]["family"] == "llama" == r2.to_dict()["testing"]["family"]
    assert r1.to_dict()["checkpoint"]["family_from"] == "family='qwen3': a model type of llama"


# --- from a checkpoint -------------------------------------------------------------------------------------


def test_checkpoint_layer(ckpt):
    path = ckpt("llama", eps=1e-6, hidden=64)
    layer = "model.layers.0.input_layernorm"
    result = assert_norm_parity(k.fused_rms_norm, checkpoint=path, layer=layer)
    d = result.to_dict()
    assert d["testing"]["dtype"] == "bfloat16" and d["eps"]["source"] == "config:rms_norm_eps"
    assert d["layers"][0]["name"] == layer
    assert Path(d["checkpoint"]["path"]).resolve() == Path(path).resolve()
    assert (d["checkpoint"]["format"], d["checkpoint"]["model_type"]) == ("safetensors", "llama")
    with pytest.raises(AssertionError, match="eps_mismatch"):
        assert_norm_parity(k.rms_norm_eps_1e5, checkpoint=path, layer=layer)
    # eps given overrides the config's (the checkpoint's 1e-6, checked as if it were 1e-5): the kernel then passes
    assert check_norm(k.rms_norm_eps_1e5, checkpoint=path, layer=layer, eps=1e-5, dtype="float32")
    gemma = ckpt("gemma", eps=1e-6, hidden=64)
    with pytest.raises(AssertionError, match="weight_offset_mismatch"):
        assert_norm_parity(k.gemma_rms_norm_without_offset, checkpoint=gemma, layer=layer)
    with pytest.raises(ValueError, match="^layer: .*no norm layer named 'model.layers.9.input_layernorm'"):
        check_norm(k.fused_rms_norm, checkpoint=path, layer="model.layers.9.input_layernorm")
    with pytest.raises(ValueError, match="^hidden_size: "):
        check_norm(k.fused_rms_norm, checkpoint=path, layer=layer, hidden_size=64)
    with pytest.raises(ValueError, match="^checkpoint: "):
        check_norm(k.fused_rms_norm, checkpoint=path.parent / "nothing-here", layer=layer)


# --- bad input: one clear error naming the argument -----------------------------------------------------------


def shallow(exc: BaseException) -> None:
    """One error, not a chain, and no deep traceback from inside parity_cli."""
    assert exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__)
    inside = [f for f in traceback.extract_tb(exc.__traceback__) if str(PACKAGE) in f.filename]
    assert len(inside) <= 4, [f"{f.filename}:{f.name}" for f in inside]


class NotAModule:
    def __init__(self, n, eps=1e-6):
        pass


class NoEps(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))


BAD = [
    (dict(family="nonexistent"), k.fused_rms_norm, ValueError, r"^family: unknown family 'nonexistent'"),
    (dict(family=3), k.fused_rms_norm, TypeError, r"^family: "),
    (dict(), 42, TypeError, r"^candidate: 42 is not callable"),
    (dict(), NotAModule, TypeError, r"^candidate: .*not a torch.nn.Module subclass"),
    (dict(), NoEps, TypeError, r"^candidate: building .*NoEps failed.*cls\(4096, eps=1e-06\)"),
    (dict(), lambda x, w, eps: x[..., :-1], ValueError, r"^candidate: .* returned shape \[.*, 4095\] for input"),
    (dict(), lambda x, w, eps: None, TypeError, r"^candidate: .*returned NoneType, not a tensor"),
    (dict(), lambda x, w, eps: x.to(torch.int32), TypeError, r"^candidate: .*int32, not a floating-point tensor"),
    (dict(), lambda x, w: x, TypeError, r"^candidate: calling .* failed .*fn\(x, weight, eps\)"),
    (dict(dtype="int8"), k.fused_rms_norm, ValueError, r"^dtype: 'int8' is not a dtype"),
    (dict(dtype=torch.float8_e4m3fn), k.fused_rms_norm, ValueError, r"^dtype: torch.float8_e4m3fn is not a dtype"),
    (dict(device="mps"), k.fused_rms_norm, ValueError, r"^device: "),
    (dict(strata=["tinny"]), k.fused_rms_norm, ValueError, r"^strata: unknown stratum 'tinny'"),
    (dict(strata=3), k.fused_rms_norm, TypeError, r"^strata: "),
    (dict(hidden_size=None), k.fused_rms_norm, TypeError, r"^hidden_size: required"),
    (dict(hidden_size=0), k.fused_rms_norm, ValueError, r"^hidden_size: expected a positive integer"),
    (dict(eps=None), k.fused_rms_norm, TypeError, r"^eps: required"),
    (dict(eps=-1e-6), k.fused_rms_norm, ValueError, r"^eps: "),
    (dict(eps=math.nan), k.fused_rms_norm, ValueError, r"^eps: "),
    (dict(weight=torch.ones(7)), k.fused_rms_norm, ValueError, r"^weight: shape \[7\]"),
    (dict(weight="ones"), k.fused_rms_norm, ValueError, r"^weight: "),
    (dict(bias=torch.ones(H)), k.fused_rms_norm, ValueError, r"^bias: family 'llama' is an RMSNorm"),
    (dict(atol=-1.0), k.fused_rms_norm, ValueError, r"^atol: "),
    (dict(seed="0"), k.fused_rms_norm, TypeError, r"^seed: "),
    (dict(layer="model.norm"), k.fused_rms_norm, TypeError, r"^checkpoint: "),
    (dict(family="mobilenet_v2"), k.fused_rms_norm, ValueError, r"^family: 'mobilenet_v2' is a batch_norm"),
]


@pytest.mark.parametrize("kwargs,candidate,error,match", BAD, ids=[m.split(":")[0].strip("^") + str(i)
                                                                      for i, (_, _, _, m) in enumerate(BAD)])
def test_bad_input_is_one_clear_error(kwargs, candidate, error, match):
    args = {**llama(dtype=torch.bfloat16), **kwargs}
    for fn in (assert_norm_parity, check_norm):
        with pytest.raises(error, match=match) as info:
            fn(candidate, **args)
        shallow(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_that_is_not_there():
    with pytest.raises(ValueError, match="^device cuda: no CUDA device is available") as info:
        assert_norm_parity(k.fused_rms_norm, **llama(dtype=torch.bfloat16, device="cuda"))
    shallow(info.value)


def test_a_candidate_that_raises_raises_its_own_error():
    """The kernel's own exception and traceback, its frames and none of the check's."""

    def kernel(x, weight, eps):
        raise RuntimeError("no kernel for this shape")

    with pytest.raises(RuntimeError, match="^no kernel for this shape$") as info:
        assert_norm_parity(kernel, **llama(dtype=torch.bfloat16))
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "kernel" and frames[-1].filename == __file__
    # none of the check's own frames (parity_cli/check/, parity_cli/isolation/), wherever the clone lies
    package = Path(parity_cli.__file__).resolve().parent
    inside = [Path(f.filename).resolve() for f in frames]
    assert not [p for p in inside if p.is_relative_to(package / "check") or p.is_relative_to(package / "isolation")]


def test_probes_cross_to_a_device_once_per_probe_set():
    """On a GPU each stratum's rows are views of one probe batch: the batch goes to the device once and
    every view is cut from that copy at its own offset (here with the CPU standing in for the device)."""
    import gc

    from parity_cli.testing import api

    base = torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5).clone()  # a batch of its own, not a view
    views = [base[0:1], base[1:4], base[4:6]]
    placed = [api._on_device(v, "cpu") for v in views]
    for v, p in zip(views, placed):
        assert torch.equal(v, p) and p.shape == v.shape
    assert len([key for key in api._DEVICE_COPIES if key[0] == id(base)]) == 1  # one copy for the three
    key = (id(base), "cpu")
    del views, placed, v, p, base
    gc.collect()
    assert key not in api._DEVICE_COPIES  # gone with its batch

