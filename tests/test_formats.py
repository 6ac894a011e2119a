"""JUnit, Markdown and re-rendered reports parsed back with standard parsers and checked
against the JSON report; the baseline and --fail-on gate."""

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import load_json, plugin, run_parity

from parity_cli import api


@pytest.fixture
def failing_run(ckpt, tmp_path):
    path = ckpt("llama", layers=1, eps=1e-6, dtype="bfloat16")
    out = {k: tmp_path / f"r.{k}" for k in ("json", "xml", "md")}
    r = run_parity("check", path, "--candidate", plugin("eps_hardcoded_1e5"), "--layers", "model.layers.*",
                   "--json", out["json"], "--junit", out["xml"], "--markdown", out["md"], "-q")
    assert r.returncode == 1, r.stderr
    return path, out, load_json(out["json"])


def test_junit_parses_and_matches_the_report(failing_run):
    path, out, rep = failing_run
    root = ET.parse(out["xml"]).getroot()
    cases = root.findall(".//testcase")
    assert [c.get("name") for c in cases] == [l["name"] for l in rep["layers"]]
    # stable from runner to runner: parity.<family>.<model_type>, no path
    assert all(c.get("classname") == "parity.llama.llama" for c in cases)
    failures = [c.find("failure") for c in cases]
    assert sum(f is not None for f in failures) == rep["summary"]["failed"] == 2
    suite = root.find("testsuite")
    assert suite.get("failures") == "2" and suite.get("tests") == "2"
    for case, layer in zip(cases, rep["layers"], strict=True):
        msg = case.find("failure").get("message")
        failing = [s["name"] for s in layer["strata"] if s["status"] == "fail"]
        assert all(name in msg for name in failing) and "eps_mismatch" in msg and "q/eps" in msg


def test_markdown_table_rows_match_the_report(failing_run):
    _, out, rep = failing_run
    text = out["md"].read_text()
    assert text.startswith("## parity: FAIL")
    assert "1e-6 (config:rms_norm_eps)" in text and "bfloat16" in text and "rtol 0.016" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    names = [row.split("|")[1].strip().strip("`") for row in rows]
    assert names == [l["name"] for l in rep["layers"] if l["status"] != "pass"]
    assert all("eps_mismatch" in row.replace("\\", "") for row in rows)  # Markdown-escaped: eps\\_mismatch
    assert "strata covered: zero, tiny, normal, constant, mixed, large, outlier" in text


def test_report_command_rerenders_without_rerunning(failing_run):
    _, out, rep = failing_run
    as_json = run_parity("report", out["json"], "--format", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == rep
    assert as_json.stdout == out["json"].read_text()  # byte for byte: one serialisation
    assert run_parity("report", out["json"], "--format", "junit").stdout == out["xml"].read_text()
    assert run_parity("report", out["json"], "--format", "markdown").stdout == out["md"].read_text()
    table = run_parity("report", out["json"])
    assert table.returncode == 0 and "model.layers.0.input_layernorm" in table.stdout and "FAIL" in table.stdout


def test_report_command_rejects_non_reports(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    r = run_parity("report", bad)
    assert r.returncode == 2 and "not a parity-cli report" in r.stderr and len(r.stderr.splitlines()) == 1


def test_baseline_accepts_known_findings_and_lists_gone_ones(failing_run, tmp_path):
    path, out, rep = failing_run
    again = tmp_path / "again.json"
    r = run_parity("check", path, "--candidate", plugin("eps_hardcoded_1e5"), "--layers", "model.layers.*",
                   "--baseline", out["json"], "--json", again, "-q")
    assert r.returncode == 0, r.stderr
    gate = load_json(again)["gate"]
    expected = {(l["name"], s["name"], "eps_mismatch") for l in rep["layers"] for s in l["strata"] if s["status"] == "fail"}
    assert {(f["layer"], f["stratum"], f["code"]) for f in gate["baseline"]["accepted"]} == expected
    assert gate["new_findings"] == [] and gate["baseline"]["gone"] == []

    # A different fault: new findings fail, the old ones are listed as gone.
    other = tmp_path / "other.json"
    r = run_parity("check", path, "--candidate", plugin("eps_outside_sqrt"), "--layers", "model.layers.*",
                   "--baseline", out["json"], "--baseline-any", "--json", other, "-q")  # another candidate: said so
    assert r.returncode == 1
    gate = load_json(other)["gate"]
    assert "eps_outside_sqrt" in {f["code"] for f in gate["new_findings"]}
    # a layer still read as eps_mismatch behaves as another eps: worse than the accepted one, not it
    assert all("worse" in f for f in gate["new_findings"] if f["code"] == "eps_mismatch")
    still = {(f["layer"], f["stratum"], f["code"]) for f in gate["new_findings"]}
    assert gate["baseline"]["accepted"] == []
    assert {(f["layer"], f["stratum"], f["code"]) for f in gate["baseline"]["gone"]} == expected - still

    # Fixed: everything in the baseline is gone, exit 0.
    fixed = tmp_path / "fixed.json"
    r = run_parity("check", path, "--candidate", "hf", "--layers", "model.layers.*", "--baseline", out["json"],
                   "--baseline-any", "--json", fixed, "-q")
    assert r.returncode == 0 and len(load_json(fixed)["gate"]["baseline"]["gone"]) == len(expected)


def test_fail_on_warn(ckpt):
    path = ckpt("llama", layers=1, eps=None)  # eps defaulted: a warning
    assert run_parity("check", path, "-q").returncode == 0
    assert run_parity("check", path, "-q", "--fail-on", "warn").returncode == 1
    assert run_parity("check", ckpt("llama", layers=1), "-q", "--fail-on", "warn").returncode == 0


def test_heat_grid_has_a_cell_per_layer_and_stratum(ckpt):
    from rich.console import Console

    from parity_cli.report.terminal import render_heat

    path = ckpt("llama", layers=3, eps=1e-5)
    report = api.check(path, candidate="torch", candidate_eps=1e-6).to_dict()
    console = Console(width=60, record=True, color_system=None)
    render_heat(report, console)
    names = set(report["probes"]["strata"])
    rows = {line.split()[0]: line.split()[1] for line in console.export_text().splitlines()
            if line.split() and line.split()[0] in names}
    assert set(rows) == set(report["probes"]["strata"])
    assert all(len(cells) == len(report["layers"]) == 7 for cells in rows.values())
    # the eps fault shows on tiny in every layer and nowhere on normal
    assert set(rows["tiny"]) <= {"▓", "█"} and set(rows["normal"]) <= {"·", "░", "▒"}


def test_heat_grid_is_one_line_a_stratum_under_120_columns_and_wraps_at_120():
    from rich.console import Console

    from parity_cli.report.terminal import render_heat

    passing = {"name": "normal", "status": "pass", "nonfinite": {"reference": 0, "candidate": 0},
               "worst": {"candidate": 1.0, "reference": 1.0, "allowed": 0.1}}
    failing = dict(passing, status="fail", worst={"candidate": 2.0, "reference": 1.0, "allowed": 0.01})  # 100x
    layers = [{"name": f"l{k}", "strata": [failing if k == 125 else passing]} for k in range(126)]
    data = {"layers": layers, "probes": {"strata": ["normal"]}}

    def rows(width):
        console = Console(width=width, record=True, color_system=None)
        render_heat(data, console)
        lines = console.export_text().splitlines()
        assert max(len(line) for line in lines) <= width
        return lines, [line.split()[1] for line in lines if line.split()[:1] == ["normal"]]

    # 80 columns less the label ("normal" + 1) and 1 spare leave 72 cells: 2 layers a cell, 63 cells
    lines, cells = rows(80)
    assert len(lines) == 2 and cells == ["·" * 62 + "█"]  # the legend, the row; the worst of a pair shows
    assert "2 layers a cell" in lines[0]
    # at 120, a cell per layer: 120 - 7 - 2 = 111 a line, 126 layers in 2 blocks
    lines, cells = rows(120)
    assert "".join(cells) == "·" * 125 + "█" and len(cells) == 2


def test_no_color_is_honoured(ckpt):
    path = ckpt("llama", layers=1)
    colour = run_parity("check", path, env={"FORCE_COLOR": "1", "TERM": "xterm-256color"})
    assert "\x1b[" in colour.stdout  # forced colour does colour...
    plain = run_parity("check", path, env={"FORCE_COLOR": "1", "TERM": "xterm-256color", "NO_COLOR": "1"})
    assert "\x1b[3" not in plain.stdout and "PASS" in plain.stdout  # ...and NO_COLOR removes it


def test_no_progress_bar_when_not_a_terminal(ckpt):
    r = run_parity("check", ckpt("llama", layers=2))
    assert r.returncode == 0 and r.stderr == ""


def test_plot_is_written(ckpt, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    import xml.etree.ElementTree as ET

    out = tmp_path / "p.svg"
    r = run_parity("check", ckpt("llama", layers=1, eps=1e-5), "--candidate-eps", "1e-6", "--plot", out, "-q")
    assert r.returncode == 1 and out.stat().st_size > 1000
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    assert "attenuation" in out.read_text()


def test_plot_bad_suffix_is_input_error(ckpt, tmp_path):
    r = run_parity("check", ckpt("llama", layers=1), "--plot", tmp_path / "p.pdf")
    assert r.returncode == 2 and ".svg or .png" in r.stderr and not (tmp_path / "p.pdf").exists()


def test_non_finite_numbers_are_one_representation_in_every_output(ckpt, tmp_path):
    """eps = 0 makes the all-zero row 0/0 = NaN: the JSON carries "inf"/"nan" strings (valid
    against the schema), and the terminal, Markdown and JUnit read them back as numbers."""
    from tests.test_cli import validate

    path = ckpt("llama", layers=1)
    out, md, xml = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.xml"
    r = run_parity("check", path, "--candidate-eps", "0", "--json", out, "--markdown", md, "--junit", xml,
                   env={"COLUMNS": "200"})
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    data = load_json(out)
    validate(data)
    zero = next(s for s in data["layers"][0]["strata"] if s["name"] == "zero")
    assert zero["max_abs_err"] in ("inf", "nan") and zero["nonfinite"]["candidate"] > 0
    first = data["layers"][0]["name"]
    row = next(line for line in r.stdout.splitlines() if line.strip().startswith(first))
    assert "inf" in row or "nan" in row  # the worst error of the layer, not the largest finite one
    md_row = next(line for line in md.read_text().splitlines() if f"`{first}`" in line)
    assert "| inf |" in md_row or "| nan |" in md_row, md_row
    r2 = run_parity("report", out)
    assert r2.returncode == 0 and "internal error" not in r2.stderr, r2.stderr


def test_a_baseline_of_the_whole_model_gates_a_run_of_some_of_its_layers(ckpt, tmp_path):
    """Issue 47: `--baseline` with `--layers` was refused as "another checkpoint": the fingerprint
    counted the layers --layers picked. It is the whole model's, so the same checkpoint gates; a
    checkpoint whose gains differ is still another one."""
    path = ckpt("llama", layers=1, eps=1e-6, dtype="float32")
    base = tmp_path / "base.json"
    assert run_parity("check", path, "--json", base, "-q").returncode == 0
    r = run_parity("check", path, "--layers", "model.norm", "--baseline", base, "-q")
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr
    other = ckpt("llama", layers=1, eps=1e-6, dtype="float32", seed=1)
    r = run_parity("check", other, "--layers", "model.norm", "--baseline", base, "-q")
    assert r.returncode == 2 and "another checkpoint (norm tensors sha256" in r.stderr, r.stdout + r.stderr
