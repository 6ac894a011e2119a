"""Issue 15: a failing run read by a person at 80 columns and by CI — verdict first, layers that
fail the same way as one line, nothing cut, -q one line, JUnit/Markdown grouped, explain per
group, a report replayed on another machine."""

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from conftest import SLOW, load_json, run_parity

from parity_cli.report import grouping

TWO_FAULTS = f"{Path(__file__).parent / 'plugins' / 'two_faults.py'}:eps_wide_offset_narrow"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Gemma 3 shaped, 3 blocks: 3 x 6 norms + the final one = 19 layers, 6 of them q/k norms
    over the 16-wide head (hidden 64 / 4 heads), configured eps 1e-6."""
    from parity_cli.sources.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("g") / "gemma", "gemma3_text", layers=3, hidden=64, heads=4,
                            eps=1e-6)


@pytest.fixture(scope="module")
def failing(gemma, tmp_path_factory):
    """One run with two faults, its outputs: (stdout at 80 columns, report, junit, markdown)."""
    out = tmp_path_factory.mktemp("out")
    r = run_parity("check", gemma, "--candidate", TWO_FAULTS, "--json", out / "r.json", "--junit", out / "r.xml",
                   "--markdown", out / "r.md", env={"COLUMNS": "80"})
    assert r.returncode == 1, r.stderr
    return r.stdout, load_json(out / "r.json"), (out / "r.xml").read_text(), (out / "r.md").read_text()


def test_a_failing_run_fits_one_screen_with_the_verdict_first(failing):
    stdout, rep, _, _ = failing
    lines = stdout.splitlines()
    # the verdict with its cause first and last (the last line of a CI log), within 80 columns
    assert lines[0] == "FAIL: 19 of 19 layers: eps_mismatch (eps ≈ 1e-5, configured 1e-6) +1 other cause"
    assert lines[-1] == lines[0]
    assert max(len(line) for line in lines) <= 80 and "…" not in stdout
    assert len(lines) <= 40  # 37 layers, two faults: the groups and the heat grid, not 37 rows
    # one line per fault: the planted eps 1e-5 against the configured 1e-6, and the missing +1
    assert sum(line.startswith("13 layers: eps_mismatch, behaves as eps ≈ 1e-5, configured 1e-6") for line in lines) == 1
    assert sum(line.startswith("6 layers: weight_offset_mismatch") for line in lines) == 1
    assert "model.layers.*.self_attn.{k,q}_norm" in stdout
    # the per-layer detail is in the JSON, one diagnosis per layer
    assert sum(len(l["diagnoses"]) for l in rep["layers"]) == 19


def test_verbose_has_every_layer(gemma):
    r = run_parity("check", gemma, "--candidate", TWO_FAULTS, "--verbose", env={"COLUMNS": "80"})
    names = [f"model.layers.{i}.self_attn.q_norm" for i in range(3)] + ["model.norm"]
    assert all(f"{n} eps_mismatch" in r.stdout or f"{n} weight_offset_mismatch" in r.stdout for n in names)
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_quiet_is_one_line_with_the_largest_group(gemma, ckpt):
    r = run_parity("check", gemma, "--candidate", TWO_FAULTS, "-q")
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1
    # the cause first, then where it still fits the width (160 here); the group of 13 is some layers' only
    assert r.stdout == ("FAIL: 19 of 19 layers: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6) in 13, "
                        "+1 other cause\n")
    r = run_parity("check", ckpt("llama", layers=2), "-q")
    assert r.returncode == 0 and r.stdout == "PASS: all 5 layers within tolerance on 7 strata\n"


@pytest.mark.parametrize("width", [60, 80, 100, 160])
def test_nothing_is_cut_at_any_width(ckpt, width):
    """A small model shows its table; at every width each number of the report is there whole."""
    path = ckpt("llama", layers=2, eps=1e-5)
    r = run_parity("check", path, "--candidate-eps", "1e-6", "--json", "-", env={"COLUMNS": str(width)})
    rep = __import__("json").loads(r.stdout)
    text = r.stderr
    assert max(len(line) for line in text.splitlines()) <= width and "…" not in text
    for layer in rep["layers"]:
        assert layer["name"] in text
        # the worst element's |cand - ref| / allowed (the pass rule itself) and the largest error
        ratio = max(abs(s["worst"]["candidate"] - s["worst"]["reference"]) / s["worst"]["allowed"]
                    for s in layer["strata"])
        # folded (under ~100 columns) a row keeps two lines: its optional figures give way
        for value in (ratio, max(s["max_abs_err"] for s in layer["strata"]))[:1 if width < 100 else 2]:
            shown = re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{value:.3g}").replace("e+", "e")
            assert re.search(rf"(?<![\d.]){re.escape(shown)}(?![\d])", text), (layer["name"], shown)


@SLOW
def test_columns_is_honoured_on_a_pipe_and_160_is_the_default(gemma):
    wide = run_parity("check", gemma, "--candidate", TWO_FAULTS, env={"COLUMNS": "160"})
    # a real process: its fds are the pipes (no terminal to size from), where pytest -s would lend its own
    default = run_parity("check", gemma, "--candidate", TWO_FAULTS, env={"COLUMNS": ""}, process=True)
    assert wide.stdout == default.stdout  # a pipe without COLUMNS: 160
    assert 80 < max(len(line) for line in wide.stdout.splitlines()) <= 160


def test_junit_classname_is_stable_and_failures_are_grouped(failing):
    _, rep, xml, _ = failing
    suite = ET.fromstring(xml).find("testsuite")
    cases = suite.findall("testcase")
    assert {c.get("classname") for c in cases} == {"parity.gemma.gemma3_text"}
    assert [c.get("name") for c in cases] == [l["name"] for l in rep["layers"]]
    messages = {c.get("name"): c.find("failure").get("message") for c in cases}
    eps = {m.split(";")[0] for n, m in messages.items() if not n.endswith(("q_norm", "k_norm"))}
    assert eps == {"eps_mismatch, behaves as eps ≈ 1e-5, configured 1e-6"}
    assert "6 layers (model.layers.*.self_attn.{k,q}_norm)" in suite.find("system-out").text


def test_markdown_has_a_row_per_group(failing):
    _, rep, _, md = failing
    top = md.split("<details>")[0]
    assert top.startswith("## parity: FAIL — 19 of 19 layers fail")
    rows = [line for line in top.splitlines() if line.startswith("| 13: ") or line.startswith("| 6: ")]
    assert len(rows) == 2
    message = next(d["message"] for l in rep["layers"] for d in l["diagnoses"] if d["code"] == "eps_mismatch")
    assert top.replace("\\", "").count(message) == 1  # the full message once (Markdown-escaped), not per layer
    assert md.split("<details>")[1].count("| `model.") == 19


def test_explain_runs_one_ladder_per_group(gemma, tmp_path):
    out = tmp_path / "r.json"
    r = run_parity("check", gemma, "--candidate", TWO_FAULTS, "--explain", "--json", out, env={"COLUMNS": "80"})
    assert r.returncode == 1
    assert r.stdout.count("conclusion:") == 2
    rep = load_json(out)
    groups = rep["explain"]["groups"]
    assert sorted(len(g["layers"]) for g in groups) == [6, 13]
    by_size = {len(g["layers"]): g for g in groups}
    assert by_size[13]["conclusion"]["factor"] == "eps" and by_size[13]["conclusion"]["residual"]["status"] == "pass"
    # a missing +1 is the candidate's math: the family's own kernel at the same dtype passes
    assert by_size[6]["conclusion"]["factor"] == "kernel"
    assert all(l["conclusion"]["factor"] in ("eps", "kernel") for l in rep["layers"])
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_a_report_replays_on_another_copy(gemma, tmp_path):
    """CI wrote the report in its checkout; here the model lives elsewhere."""
    ci = tmp_path / "ci"
    shutil.copytree(gemma, ci / "model")
    r = run_parity("check", "model", "--candidate", TWO_FAULTS, "--layers", "model.norm", "--json", "r.json", cwd=ci)
    assert r.returncode == 1
    rep = load_json(ci / "r.json")
    assert rep["checkpoint"]["path"] == "model" and len(rep["checkpoint"]["fingerprint"]["sha256"]) == 64
    here = tmp_path / "here"
    here.mkdir()
    shutil.copy(ci / "r.json", here / "r.json")
    r = run_parity("explain", "r.json", "--candidate", TWO_FAULTS, cwd=here)
    assert r.returncode == 2 and "--checkpoint" in r.stderr and len(r.stderr.splitlines()) == 1
    shutil.copytree(gemma, here / "copy")
    r = run_parity("explain", "r.json", "--checkpoint", "copy", "--candidate", TWO_FAULTS, cwd=here)
    assert r.returncode == 0, r.stderr
    assert "eps carries the error" in r.stdout
    # another model (different weights): refused, not explained
    from parity_cli.sources.synthetic import write_checkpoint

    write_checkpoint(here / "other", "gemma3_text", layers=6, hidden=64, heads=4, eps=1e-6, seed=1)
    r = run_parity("explain", "r.json", "--checkpoint", "other", "--candidate", TWO_FAULTS, cwd=here)
    assert r.returncode == 2 and "not the same model" in r.stderr


def test_inspect_groups_conditions_normal_for_the_family(tmp_path):
    import torch

    from parity_cli.sources.synthetic import write_checkpoint

    # three layers whose stored w dips below -1: their gain 1 + w is negative somewhere
    low = {f"model.layers.{i}.input_layernorm.weight": torch.full((64,), -1.25).to(torch.bfloat16) for i in range(3)}
    path = write_checkpoint(tmp_path / "g", "gemma3_text", layers=6, hidden=64, heads=4, eps=1e-6, weights=low)
    r = run_parity("inspect", path, env={"COLUMNS": "80"})
    assert r.returncode == 0 and "warning" not in r.stdout
    notes = [line for line in r.stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "lowest -0.25" in notes[0]
    assert "3 layers" in r.stdout and "model.layers.{0..2}.input_layernorm" in r.stdout.replace("\n    ", " ")
    assert max(len(line) for line in r.stdout.splitlines()) <= 80


def test_error_rows_show_no_made_up_numbers(ckpt):
    path = ckpt("llama", layers=1)
    misbehave = f"{Path(__file__).parent / 'plugins' / 'misbehave.py'}:os_exit_1"
    r = run_parity("check", path, "--candidate", misbehave, env={"COLUMNS": "160"})
    assert r.returncode == 1
    rows = [line for line in r.stdout.splitlines() if line.startswith(" model.norm")]
    assert rows and " 0 " not in rows[0] and rows[0].split()[2] == "error" and rows[0].split()[-3:] == ["-", "-", "-"]


def test_baseline_summary_says_what_was_accepted(ckpt, tmp_path):
    path = ckpt("llama", layers=1, eps=1e-5)
    out = tmp_path / "old.json"
    run_parity("check", path, "--candidate-eps", "1e-6", "--json", out)
    r = run_parity("check", path, "--candidate-eps", "1e-6", "--baseline", out)
    assert r.returncode == 0
    assert r.stdout.splitlines()[0] == "PASS: no new finding against the baseline; 3 of 3 layers fail, as accepted"


# --- grouping, unit by unit ------------------------------------------------------------------------

def test_eps_estimates_that_round_alike_group_together():
    def layer(name, est):
        return {"name": name, "status": "fail", "strata": [], "findings": [],
                "diagnoses": [{"code": "eps_mismatch", "estimated_eps": est, "configured_eps": 1e-6}]}

    # 9.76e-6 and 1e-5 round to different 2-digit strings (9.8e-6, 1.0e-5) and are still one fault
    report = {"layers": [layer("a.0.n", 1e-5), layer("a.1.n", 9.99e-6), layer("a.3.n", 9.76e-6), layer("a.2.n", 1e-4)]}
    found = grouping.groups(report)
    assert [len(g.layers) for g in found] == [3, 1]
    assert found[0].text == "eps_mismatch, behaves as eps ≈ 1e-5, configured 1e-6"  # the median, 9.99e-6
    assert found[1].text == "eps_mismatch, behaves as eps ≈ 1e-4, configured 1e-6"


@pytest.mark.parametrize("names, universe, expected", [
    (["m.layers.0.in_norm", "m.layers.1.in_norm"], None, "m.layers.*.in_norm"),
    (["m.layers.0.in_norm", "m.layers.2.in_norm", "m.layers.3.in_norm"],
     [f"m.layers.{i}.in_norm" for i in range(5)], "m.layers.{0,2..3}.in_norm"),
    (["m.layers.4.in_norm"], [f"m.layers.{i}.in_norm" for i in range(5)], "m.layers.4.in_norm"),
    (["m.layers.0.input_layernorm", "m.layers.0.post_attention_layernorm", "m.norm"], None,
     "m.layers.*.{input,post_attention}_layernorm, m.norm"),
    (["blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"], None, "blk.*.{attn,ffn}_norm, output_norm"),
    # two indices (MoE experts, T5 blocks): '*' only where every index is in the group
    ([f"m.layers.1.experts.{j}.norm" for j in range(4)],
     [f"m.layers.{i}.experts.{j}.norm" for i in range(3) for j in range(4)], "m.layers.1.experts.*.norm"),
    (["e.block.0.layer.0.ln", "e.block.1.layer.1.ln"],
     [f"e.block.{i}.layer.{j}.ln" for i in range(3) for j in range(2)], "e.block.0.layer.0.ln, e.block.1.layer.1.ln"),
])
def test_name_pattern(names, universe, expected):
    assert grouping.name_pattern(names, universe) == expected


@pytest.mark.parametrize("args, words", [
    (("check", "/nonexistent/model"), "/nonexistent/model: no such file"),
    (("check", "CKPT", "--dtype", "fp7"), "--dtype: unknown dtype 'fp7'"),
    (("check", "CKPT", "--atol", "-1"), "--atol must be a finite number >= 0"),
    (("check", "CKPT", "--timeout", "0"), "--timeout must be > 0"),
    (("check", "CKPT", "--candidate-memory", "5XB"), "--candidate-memory: '5XB' is not a size"),
    (("check", "CKPT", "--candidate-arg", "x"), "--candidate-arg 'x': expected KEY=VALUE"),
    (("check", "CKPT", "--candidate", "no_such_impl"), "unknown implementation 'no_such_impl'"),
    (("inspect", "/nonexistent/model"), "/nonexistent/model: no such file")])
def test_bad_input_is_refused_before_torch_loads(gemma, args, words):
    """-X importtime lists every module imported: torch must not be among them. CKPT is a real
    checkpoint, so each refusal is the option's own."""
    import subprocess
    import sys

    args = [str(gemma) if a == "CKPT" else a for a in args]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "parity_cli", *args], capture_output=True, text=True)
    assert r.returncode == 2
    errors = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert len(errors) == 1 and errors[0].startswith("parity: error: ") and words in errors[0], errors
    assert not re.search(r"\|\s+torch$", r.stderr, re.M)


def test_real_third_party_faults_group_per_layer_kind(gemma):
    """ONNX Runtime's RMSNormalization with its defaults (epsilon 1e-5, the stored w as the scale)
    on Gemma 3: two faults in every layer, one group naming both; transformers' own Gemma3 class
    with a deployment eps of 1e-5: one group, one fault."""
    pytest.importorskip("onnxruntime")
    ort = f"{Path(__file__).parent / 'plugins' / 'onnx_norm.py'}:rms_normalization_defaults"
    r = run_parity("check", gemma, "--candidate", ort, "--dtype", "float32", "-q")
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1
    # both faults in every layer: one cause with two codes (the pattern of all 19 does not fit 160)
    assert r.stdout == ("FAIL: 19 of 19 layers: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6) "
                        "+ weight_offset_mismatch\n")
    pytest.importorskip("transformers")
    r = run_parity("check", gemma, "--candidate", "transformers", "--candidate-eps", "1e-5", "-q")
    assert r.returncode == 1 and r.stdout == "FAIL: 19 of 19 layers: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6)\n"


def test_layers_only_the_copy_has_are_one_group_and_fail_junit(ckpt, tmp_path):
    import torch

    src = ckpt("llama", layers=2, eps=1e-5)
    # the copy has 6 blocks' input norms where the source has 2: 4 layers only in the copy
    extra = {f"model.layers.{i}.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16) for i in range(2, 6)}
    copy = ckpt("llama", layers=2, eps=1e-5, weights=extra)
    r = run_parity("check", src, "--candidate-checkpoint", copy, "--junit", tmp_path / "j.xml", "-q")
    assert r.returncode == 1
    assert r.stdout == ("FAIL: 0 of 5 layers fail, 4 checkpoint finding(s): checkpoint_layer_extra (only in the "
                        "candidate checkpoint) | model.layers.{2..5}.input_layernorm\n")
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("failures") == "4" and suite.get("tests") == "9"  # 5 checked layers pass, 4 extra fail


def test_a_baseline_run_shows_its_new_group_first(gemma, tmp_path):
    old = tmp_path / "old.json"
    run_parity("check", gemma, "--candidate-eps", "1e-5", "--json", old)  # every layer: the eps fault
    r = run_parity("check", gemma, "--candidate", TWO_FAULTS, "--baseline", old, "--baseline-any", "-q")
    assert r.returncode == 1 and r.stdout.splitlines()[-1].startswith("FAIL: 36 new finding(s) beyond the baseline; "
                                                                        "19 of 19 layers: weight_offset_mismatch (")
    assert r.stdout.endswith(" in 6 | model.layers.*.self_attn.{k,q}_norm\n")
    r = run_parity("check", gemma, "--candidate", TWO_FAULTS, "--baseline", old, "--baseline-any")
    lines = r.stdout.splitlines()
    new = next(i for i, l in enumerate(lines) if l.startswith("new: 6 layers: weight_offset_mismatch"))
    accepted = next(i for i, l in enumerate(lines) if l.startswith("accepted by the baseline: 13 layers: eps_mismatch"))
    assert new < accepted


def test_explain_says_a_crashing_candidate_does_not_run(ckpt):
    misbehave = f"{Path(__file__).parent / 'plugins' / 'misbehave.py'}:os_exit_1"
    r = run_parity("check", ckpt("llama", layers=1), "--candidate", misbehave, "--explain")
    assert r.returncode == 1 and "conclusion: the candidate does not run: candidate process died" in r.stdout


def test_replay_names_the_missing_candidate_file(gemma, tmp_path):
    ci = tmp_path / "ci"
    (ci / "plugins").mkdir(parents=True)
    shutil.copy(TWO_FAULTS.rpartition(":")[0], ci / "plugins" / "k.py")
    r = run_parity("check", gemma, "--candidate", "plugins/k.py:eps_wide_offset_narrow", "--layers", "model.norm",
                   "--json", "r.json", cwd=ci)
    assert r.returncode == 1 and load_json(ci / "r.json")["candidate"]["impl"] == "plugins/k.py:eps_wide_offset_narrow"
    r = run_parity("explain", ci / "r.json", "--checkpoint", gemma, "--trust-report", cwd=tmp_path)
    assert r.returncode == 2 and "--candidate FILE.py:ATTR" in r.stderr
    r = run_parity("explain", ci / "r.json", "--checkpoint", gemma, "--candidate", TWO_FAULTS, cwd=tmp_path)
    assert r.returncode == 0 and "eps carries the error" in r.stdout


@pytest.mark.parametrize("read, configured, words", [
    (1.01328e-6, 1e-6, "uses eps 1.01328e-6 (read, not estimated), configured 1e-6"),
    (9.99999997e-07, 1e-6, "uses eps 9.99999997e-7 (read, not estimated), configured 1e-6"),
    (1e-5, 1e-6, "uses eps 1e-5 (read, not estimated), configured 1e-6"),
])
def test_a_read_eps_is_said_with_the_digits_that_tell_it_from_the_configured_one(read, configured, words):
    """Issue 47: "uses eps 1e-6 (read), configured 1e-6" said nothing where the file held 1.01328e-6
    (GGUF's float32 eps, #9310's kind of loss): the phrase keeps the digits that differ."""
    from parity_cli.report.grouping import SHORT

    said = SHORT["eps_mismatch"]({"estimated_eps": read, "configured_eps": configured, "read_from_copy": True})
    assert said == words
