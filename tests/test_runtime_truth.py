"""Issue 46, item 2: a suspect red cell checks itself. A runtime candidate's failure that is
non-finite, far past its allowance or unexplained is rerun through the runtime's own public path
(NAME@public) on that layer; where the two disagree the fault is parity's adapter: exit 2 for
`check`, an `adapter` cell in `parity runtimes`, never the runtime's FAIL.

The adapter fault planted here is the one issue 46 found in parity's OpenVINO adapter, on MLX:
the gain the runtime is handed is not the checkpoint's (a Constant built over freed memory read
back as [1.19e-07, 0, 91.3, 0] and values up to 1e40). The runtime itself is untouched."""

import importlib.util

import pytest
from conftest import run_parity

from parity_cli import api, runtimes
from parity_cli.errors import AdapterError

needs_mlx = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="needs mlx: pip install mlx mlx-cpu")


@pytest.fixture
def corrupt_gain(monkeypatch):
    """parity's mlx adapter handing MLX a gain of 1e30 x the checkpoint's: the kernel is MLX's own."""
    from parity_cli.backends import mlx_runtime

    real = mlx_runtime.prepare
    monkeypatch.setattr(mlx_runtime, "prepare", lambda layer, weight, bias, eps, **kw: real(
        layer, weight * 1e30, bias, eps, **kw))


@needs_mlx
def test_an_adapter_that_disagrees_with_the_runtimes_own_path_is_parity_s_fault(ckpt, corrupt_gain):
    src = ckpt("llama", layers=1, eps=1e-5, dtype="float32")
    with pytest.raises(AdapterError) as found:
        api.check(src, candidate="mlx", dtype="float32", isolation="none")
    said = str(found.value)
    assert said.startswith("parity's mlx adapter disagrees with mlx.nn's norm modules on model.layers.0.input_layernorm")
    assert "the runtime's own path pass" in said and "the fault is parity's, not mlx's" in said
    table = runtimes.table(src, ["torch", "mlx"], ["float32"], isolation="none")
    assert [(c.runtime, c.verdict) for c in table.cells] == [("torch", "pass"), ("mlx", "adapter")]
    assert not table.passed


@needs_mlx
def test_the_cli_says_an_adapter_fault_in_one_line_with_exit_2(ckpt, corrupt_gain):
    r = run_parity("check", ckpt("llama", layers=1, eps=1e-5, dtype="float32"), "--candidate", "mlx",
                   "--isolation", "none")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "parity's mlx adapter disagrees with mlx.nn's norm modules" in r.stderr


@needs_mlx
def test_the_public_path_is_a_candidate_of_its_own_and_passes_a_correct_model(ckpt):
    """NAME@public runs the runtime as a deployment builds it, apart from parity's adapter."""
    for dtype in ("float32", "bfloat16"):
        report = api.check(ckpt("gemma3_text", layers=1, eps=1e-6, dtype="float32"), candidate="mlx@public",
                           dtype=dtype, isolation="none")
        assert report.passed and report.layers, [(l.name, [d.code for d in l.diagnoses]) for l in report.layers]


@needs_mlx
def test_the_table_names_an_adapter_cell_and_exits_2(ckpt, corrupt_gain):
    """In this process (--isolation none), where the planted adapter fault is."""
    r = run_parity("runtimes", ckpt("llama", layers=1, eps=1e-5, dtype="float32"), "--runtimes", "torch,mlx",
                   "--dtypes", "float32", "--isolation", "none")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == ("ERROR: parity's adapter disagrees with the runtime's own path in 1 of 2 "
                                         "runtime checks: mlx float32")
    assert "[1] parity's mlx adapter disagrees with mlx.nn's norm modules" in r.stdout


@needs_mlx
def test_a_rounding_order_reads_as_a_few_times_torch_in_every_output(ckpt):
    """MLX's LayerNorm at bfloat16 rounds h, w*h and +b each (three roundings where torch rounds once):
    a red cell of rounding order, whose worst error is a few times torch's on the same probes, never
    the thousands a broken kernel shows. The JSON, the terminal table and the Markdown all say so."""
    from parity_cli.report.formats import to_markdown

    src = ckpt("bert", layers=1, hidden=64, heads=4, eps=1e-12, dtype="float32")
    report = api.check(src, candidate="mlx", dtype="bfloat16", isolation="none")
    assert not report.passed and {d.code for layer in report.layers for d in layer.diagnoses} == {
        "affine_in_input_dtype"}
    data = report.to_dict()
    severity = data["candidate"]["vs_torch_same_dtype"]
    assert 1 < severity["ratio"] < 10 and not severity["nonfinite"], severity
    assert severity["words"].endswith("x torch bf16")
    assert all(1 <= layer["vs_torch_same_dtype"]["ratio"] < 10 for layer in data["layers"])
    assert f"- vs torch: the worst error over torch eager's at bfloat16 on the same probes: {severity['words']}" \
        in to_markdown(data)
    r = run_parity("check", src, "--candidate", "mlx", "--dtype", "bfloat16", "--isolation", "none",
                   env={"COLUMNS": "200"})
    assert r.returncode == 1 and "vs torch" in r.stdout
