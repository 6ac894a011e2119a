"""The command line as CI and users meet it: exit codes, one-line errors, the JSON contract."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import PARITY, load_json, plugin, run_parity

from parity_cli.resources import schema_path


def validate(report):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(report, json.loads(schema_path().read_text()))


def test_help_does_not_import_torch():
    code = ("import sys; from parity_cli.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'safetensors' not in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
    sub = subprocess.run([sys.executable, "-c", code.replace("'--help'", "'check', '--help'")],
                         capture_output=True, text=True)
    assert sub.returncode == 0 and "--candidate-eps" in sub.stdout, sub.stderr


def test_pass_exit_0_and_report_matches_the_contract(ckpt, tmp_path):
    path = ckpt("llama", layers=2, eps=1e-5)
    out = tmp_path / "r.json"
    r = run_parity("check", path, "--json", out, "--seed", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = load_json(out)
    validate(rep)
    assert rep["schema_version"] == 1
    assert rep["eps"] == {"value": 1e-5, "source": "config:rms_norm_eps"}
    assert rep["checkpoint"]["family"] == "llama" and rep["checkpoint"]["files"] == ["model.safetensors"]
    assert rep["candidate"]["impl"] == "torch" and rep["reference"]["impl"] == "oracle"
    assert rep["candidate"]["dtype"] == "bfloat16" and rep["reference"]["dtype"] == "float64"
    assert rep["tolerance"]["atol"] == 1e-5 and rep["tolerance"]["rtol"] == 1.6e-2
    assert rep["probes"] == {**rep["probes"], "seed": 5,
                             "strata": ["zero", "tiny", "normal", "constant", "mixed", "large", "outlier"]}
    assert rep["summary"] == {"layers": 5, "passed": 5, "failed": 0, "errors": 0, "verdict": "pass", "unchecked": 0,
                              "verdict_is": rep["summary"]["verdict_is"]}
    assert rep["verdict"] == rep["gate"]["verdict"] == "pass" and "top-level verdict" in rep["summary"]["verdict_is"]
    tiny = [s for s in rep["layers"][0]["strata"] if s["name"] == "tiny"][0]
    assert tiny["q_over_eps"]["min"] == pytest.approx(0.01, rel=0.02)
    assert tiny["q_over_eps"]["max"] == pytest.approx(100, rel=0.02)
    assert tiny["attenuation"]["min"] == pytest.approx(0.099504, rel=0.01)
    zero = [s for s in rep["layers"][0]["strata"] if s["name"] == "zero"][0]
    assert zero["q_over_eps"] == {"min": 0.0, "max": 0.0} and zero["attenuation"]["max"] == 0.0
    assert "PASS" in r.stdout


def test_fail_exit_1_and_the_report_explains(ckpt, tmp_path):
    path = ckpt("llama", layers=1, eps=1e-6)
    out = tmp_path / "r.json"
    r = run_parity("check", path, "--candidate", plugin("eps_missing"), "--dtype", "float32", "--json", out, "-q")
    # -q: one line, the verdict with its counts and the largest group of findings
    assert r.returncode == 1 and len(r.stdout.splitlines()) == 1
    assert r.stdout == ("FAIL: 3 of 3 layers: eps_missing (eps dropped: an all-zero row computes 0/0) | "
                        "model.layers.*.{input,post_attention}_layernorm, model.norm\n")
    rep = load_json(out)
    validate(rep)
    assert rep["summary"]["verdict"] == "fail" and rep["summary"]["failed"] == 3
    zero = [s for s in rep["layers"][0]["strata"] if s["name"] == "zero"][0]
    assert zero["status"] == "fail" and zero["nonfinite"]["candidate"] == 64
    assert zero["worst"]["candidate"] == "nan" and zero["worst"]["reference"] == 0.0
    assert "eps_missing" in {d["code"] for d in rep["layers"][0]["diagnoses"]}


def test_candidate_error_is_exit_1_with_a_valid_report(ckpt, tmp_path):
    out = tmp_path / "r.json"
    r = run_parity("check", ckpt("llama", layers=1), "--candidate", plugin("raises"), "--json", out)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    rep = load_json(out)
    validate(rep)
    assert rep["layers"][0]["status"] == "error" and "RuntimeError" in rep["layers"][0]["error"]


def test_layers_glob_and_strata(ckpt, tmp_path):
    out = tmp_path / "r.json"
    r = run_parity("check", ckpt("qwen3", layers=2), "--layers", "*.q_norm", "--strata", "tiny,zero",
                   "--json", out, "-q")
    assert r.returncode == 0, r.stderr
    rep = load_json(out)
    assert [l["name"] for l in rep["layers"]] == ["model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.q_norm"]
    assert [s["name"] for s in rep["layers"][0]["strata"]] == ["tiny", "zero"]
    assert rep["layers"][0]["dim"] == 16


def bad_inputs(ckpt, tmp_path):
    good = ckpt("llama", layers=1)
    no_cfg = ckpt("llama", layers=1)
    (no_cfg / "config.json").unlink()
    bad_json = ckpt("llama", layers=1)
    (bad_json / "config.json").write_text("{")
    truncated = ckpt("llama", layers=1)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])
    sharded = ckpt("llama", layers=1, shards=2)
    next(sharded.glob("model-00001-*")).unlink()
    unknown = ckpt("llama", layers=1, config_extra={"model_type": "mystery"})
    import torch

    three_d = ckpt("llama", layers=1, weights={"model.norm.weight": torch.ones(2, 4, 16, dtype=torch.bfloat16)})
    return {
        "missing path": ["check", tmp_path / "nope"],
        "no config": ["check", no_cfg],
        "invalid json": ["check", bad_json],
        "truncated": ["check", truncated],
        "missing shard": ["check", sharded],
        "unknown model_type": ["check", unknown],
        "bad dtype": ["check", good, "--dtype", "float7"],
        "bad float": ["check", good, "--atol", "abc"],
        "negative eps": ["check", good, "--candidate-eps", "-1"],
        "bad stratum": ["check", good, "--strata", "tiny,bogus"],
        "bad glob": ["check", good, "--layers", "nothing*"],
        "bad candidate": ["check", good, "--candidate", "no_such_module_xyz:fn"],
        "bad builtin": ["check", good, "--candidate", "tritonx"],
        "no cuda": ["check", good, "--device", "cuda:7"],
        "bad fraction": ["check", good, "--max-violation-fraction", "2"],
        "unknown option": ["check", good, "--frobnicate"],
        "bad json dir": ["check", good, "--json", good / "config.json" / "dir" / "r.json"],  # a file on the way
        "no checkable layer": ["check", three_d, "--layers", "model.norm"],
        "inspect bad eps": ["inspect", good, "--eps", "-1"],
    }


def test_bad_input_is_one_line_exit_2_and_no_report(ckpt, tmp_path):
    cases = bad_inputs(ckpt, tmp_path)
    assert len(cases) > 10
    for label, args in cases.items():
        out = tmp_path / f"{label.replace(' ', '_')}.json"
        if "--json" not in args:
            args = [*args, "--json", out]
        r = run_parity(*args)
        if label == "no cuda" and r.returncode == 0:
            continue  # a machine with 8 GPUs
        assert r.returncode == 2, (label, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("parity: error:"), (label, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == "", label
        assert not out.exists(), label
        assert not list(tmp_path.glob(".*.tmp")), label


def test_error_names_the_file(ckpt, tmp_path):
    bad = ckpt("llama", layers=1)
    (bad / "config.json").write_text("{")
    r = run_parity("check", bad)
    assert str(bad / "config.json") in r.stderr and "invalid JSON" in r.stderr


def test_demo_shows_a_pass_and_a_fail():
    r = run_parity("demo")
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout and "FAIL" in r.stdout and "eps_mismatch" in r.stdout and "q/eps" in r.stdout


def test_module_entry_point_and_version():
    r = run_parity("--version", process=True)  # `python -m parity_cli` itself: the module entry point
    assert r.returncode == 0 and "parity" in r.stdout


def test_ctrl_c_exits_130_and_leaves_no_report(ckpt, tmp_path):
    import os
    import signal
    import time

    out = tmp_path / "r.json"
    marker = tmp_path / "started"
    # the candidate holds the run until the signal (issue 49: under load the run could end first, exit 0)
    proc = subprocess.Popen([*PARITY, "check", str(ckpt("llama", layers=4)),
                             "--candidate", plugin("held"), "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PARITY_TEST_MARKER": str(marker),
                                 "PARITY_TEST_RELEASE": str(tmp_path / "never")})
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline:  # inside the probe loop, not in imports
        time.sleep(0.05)
    assert marker.exists()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_reference_can_be_any_implementation(ckpt, tmp_path):
    out = tmp_path / "r.json"
    r = run_parity("check", ckpt("gemma", layers=1), "--reference", "hf", "--candidate", plugin("GemmaRMSNorm"),
                   "--json", out, "-q")
    assert r.returncode == 0, r.stderr
    assert load_json(out)["reference"]["impl"] == "hf"


def test_inspect_reports_eps_gain_and_the_one_percent_rms(ckpt, tmp_path):
    import math

    import torch

    w = torch.full((64,), -0.25, dtype=torch.float64)
    w[3] = -1.5  # effective gain 1 + w = -0.5: a note (trained weights have them), not a warning
    path = ckpt("gemma", layers=1, eps=None, weights={"model.norm.weight": w.to(torch.bfloat16)})
    out = tmp_path / "i.json"
    r = run_parity("inspect", path, "--json", out)
    assert r.returncode == 0, r.stderr
    info = load_json(out)
    assert info["eps"] == {"value": 1e-6, "source": "family-default"}
    norm = [l for l in info["layers"] if l["name"] == "model.norm"][0]
    assert norm["weight"]["min"] == -1.5 and norm["weight"]["max"] == -0.25
    assert norm["gain"] == {"min": -0.5, "max": 0.75}
    assert norm["rms_1pct"] == pytest.approx(math.sqrt(49.2512562814 * 1e-6), rel=1e-9)
    assert any("gain <= 0" in n and "lowest -0.5" in n for n in info["notes"])
    assert not any("gain <=" in w for w in info["warnings"]) and any("family default" in w for w in info["warnings"])
    assert "model.norm" in r.stdout and "family-default" in r.stdout


def test_families_command_lists_every_family():
    r = run_parity("families", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["family"]: row for row in json.loads(r.stdout)}
    assert {"llama", "gemma", "gemma3n", "olmo2", "t5", "cohere", "layer_norm"} <= set(rows)
    assert rows["gemma"]["gain"] == "1 + w" and rows["llama"]["gain"] == "w"
    assert rows["cohere"]["kind"] == "layer_norm" and rows["t5"]["eps_keys"] == ["layer_norm_epsilon"]
    assert "model.layers.{i}.self_attn.q_a_layernorm".replace("model.", "{root}") in rows["llama"]["exceptions"]
    table = run_parity("families")
    assert table.returncode == 0 and "cohere" in table.stdout and "layer_norm" in table.stdout
    # the generated ones are counted, and listed on request with the classes they came from
    assert "families derived from" in table.stdout and "qwen2_5_vl" not in table.stdout
    every = {row["family"]: row for row in json.loads(run_parity("families", "--json", "--all").stdout)}
    assert set(rows) < set(every) and all(rows[f]["derived_from"] is None for f in rows)
    assert every["qwen2_5_vl"]["derived_from"].endswith("Qwen2_5_VLForConditionalGeneration")


def test_inspect_lists_unmatched_and_per_head_shapes(ckpt, tmp_path):
    path = ckpt("cohere", layers=1, weights={"model.layers.0.mlp.norm_x.weight": torch.ones(3)})
    out = tmp_path / "i.json"
    r = run_parity("inspect", path, "--json", out)
    assert r.returncode == 0, r.stderr
    assert "unmatched: model.layers.0.mlp.norm_x.weight" in r.stdout
    data = load_json(out)
    assert data["checkpoint"]["unmatched"] == ["model.layers.0.mlp.norm_x.weight"]
    q = [l for l in data["layers"] if l["name"].endswith("q_norm")][0]
    assert q["shape"] == [4, 16] and q["dim"] == 16 and q["kind"] == "layer_norm"


def test_grad_and_conversion_reports_validate(ckpt, tmp_path):
    src = ckpt("llama", layers=1, eps=1e-6)
    copy = ckpt("llama", layers=1, eps=1e-5)
    out = tmp_path / "r.json"
    r = run_parity("check", src, "--candidate", plugin("dropped_shared_term"), "--grad",
                   "--candidate-checkpoint", copy, "--json", out, "--explain")
    assert r.returncode == 1
    rep = load_json(out)
    validate(rep)
    layer = rep["layers"][0]
    assert layer["findings"][0]["code"] == "checkpoint_eps_mismatch"
    assert any(g["name"] == "normal:dx" and g["status"] == "fail" for g in layer["grad"])
    # one ladder for the group, a conclusion for every layer of it
    assert set(rep["explain"]["layers"]) == {l["name"] for l in rep["layers"]}
    assert all(l["conclusion"]["explained_by"] == rep["explain"]["groups"][0]["representative"] for l in rep["layers"])
    # the gate sees both kinds of finding: a baseline of this very report accepts all of them
    again = run_parity("check", src, "--candidate", plugin("dropped_shared_term"), "--grad",
                       "--candidate-checkpoint", copy, "--baseline", out)
    assert again.returncode == 0, again.stdout


def test_jobs_gives_the_same_report(ckpt, tmp_path):
    path = ckpt("llama", layers=3, eps=1e-5)
    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"r{jobs}.json"
        r = run_parity("check", path, "--candidate-eps", "1e-6", "--jobs", jobs, "--json", out, "-q")
        assert r.returncode == 1, r.stderr
        outs.append(load_json(out))
    assert outs[0]["layers"] == outs[1]["layers"] and len(outs[0]["layers"]) == 7
