"""JUnit, Markdown and re-rendered reports parsed back with standard parsers and checked
against the JSON report; the baseline and --fail-on gate."""

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import load_json, plugin, run_parity


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
    assert all(c.get("classname") == f"{rep['checkpoint']['path']}.llama" for c in cases)
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
    assert "1e-06 (config:rms_norm_eps)" in text and "bfloat16" in text and "rtol 0.016" in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    names = [row.split("|")[1].strip().strip("`") for row in rows]
    assert names == [l["name"] for l in rep["layers"] if l["status"] != "pass"]
    assert all("eps_mismatch" in row for row in rows)
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
                   "--baseline", out["json"], "--json", other, "-q")
    assert r.returncode == 1
    gate = load_json(other)["gate"]
    assert {f["code"] for f in gate["new_findings"]} == {"eps_outside_sqrt"}
    assert {(f["layer"], f["stratum"], f["code"]) for f in gate["baseline"]["gone"]} == expected

    # Fixed: everything in the baseline is gone, exit 0.
    fixed = tmp_path / "fixed.json"
    r = run_parity("check", path, "--candidate", "hf", "--layers", "model.layers.*", "--baseline", out["json"],
                   "--json", fixed, "-q")
    assert r.returncode == 0 and len(load_json(fixed)["gate"]["baseline"]["gone"]) == len(expected)


def test_fail_on_warn(ckpt):
    path = ckpt("llama", layers=1, eps=None)  # eps defaulted: a warning
    assert run_parity("check", path, "-q").returncode == 0
    assert run_parity("check", path, "-q", "--fail-on", "warn").returncode == 1
    assert run_parity("check", ckpt("llama", layers=1), "-q", "--fail-on", "warn").returncode == 0
