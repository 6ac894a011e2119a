"""Issue 23 (part): the gate and the outputs. A baseline accepted a worse fault (eps moved 100x
under the same (layer, stratum, code)); an output that is a link was replaced, /dev/stdout
included; outputs could overwrite the run's own inputs; the plot was written after the rest of
the set; a full disk named no file; a name past NAME_MAX and a baseline with `diagnoses: null`
were internal errors. Every case runs in this process through parity_cli.cli.main."""

import errno
import json
import os
import stat

import pytest
from click.testing import CliRunner

from parity_cli import outputs
from parity_cli.cli import main
from parity_cli.errors import InputError
from parity_cli.report import gate
from parity_cli.sources.synthetic import write_checkpoint

FAST = ("--layers", "model.norm", "--strata", "tiny,constant")


def parity(*argv):
    """main(argv) in this process: (exit code, stdout, stderr)."""
    with CliRunner().isolation(env={"COLUMNS": "160"}) as (out, err, _):
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, out.getvalue().decode(), err.getvalue().decode()


def refused(result, *words):
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("parity: error: "), (code, err)
    assert "internal error" not in err
    for w in words:
        assert str(w) in lines[0], (w, err)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama", layers=1, hidden=16, heads=2, eps=1e-5)


# --- the gate: a baseline accepts a finding only at its size or smaller -------------------------------

def _layer(est=None, interval=None, ref=0.3, cand=0.6, allowed=0.005, nonfinite=0, code="eps_mismatch"):
    d = {"code": code, "message": "m"}
    if est is not None:
        d.update(estimated_eps=est, interval=interval)
    worst = {"vector": 0, "index": 0, "input": 1e-3, "reference": ref, "candidate": cand, "allowed": allowed}
    return {"name": "model.norm", "status": "fail", "diagnoses": [d], "findings": [],
            "strata": [{"name": "tiny", "status": "fail", "worst": worst,
                        "nonfinite": {"reference": 0, "candidate": nonfinite}}]}


def _report(layer, sha="a" * 64, dtype="bfloat16", impl="torch"):
    return {"layers": [layer], "findings": [], "warnings": [],
            "checkpoint": {"fingerprint": {"sha256": sha}}, "candidate": {"impl": impl, "dtype": dtype, "args": {}}}


def test_an_eps_outside_the_baselines_interval_is_a_new_finding():
    base = _report(_layer(1e-6, [0.98e-6, 1.01e-6]))
    for est, accepted in ((1e-6, True), (1.005e-6, True), (0.98e-6, True), (1e-7, False), (1e-8, False),
                          (1.02e-6, False)):
        result = gate.gate(_report(_layer(est, [est * 0.99, est * 1.01])), baseline=base, baseline_path="b.json")
        assert (result["exit_code"] == 0) == accepted, est
        if not accepted:
            (f,) = result["new_findings"]
            assert (f["layer"], f["stratum"], f["code"]) == ("model.norm", "tiny", "eps_mismatch")
            assert "eps" in f["worse"] and "baseline" in f["worse"]
            assert result["baseline"]["accepted"] == [] and result["baseline"]["gone"] == []


def test_a_larger_worst_error_is_worse_beyond_the_margin():
    # baseline: |0.6 - 0.3| / 0.005 = 60 allowances; 10 % more is 66
    base = _report(_layer(ref=0.3, cand=0.6, allowed=0.005))
    for k, accepted in ((60, True), (30, True), (65.9, True), (66.5, False), (120, False)):
        new = _report(_layer(ref=0.3, cand=0.3 + k * 0.005, allowed=0.005))
        assert (gate.gate(new, baseline=base)["exit_code"] == 0) == accepted, k
    # --exact allows nothing: |err| itself is compared (0.3 at the baseline)
    base = _report(_layer(ref=0.3, cand=0.6, allowed=0.0))
    assert gate.gate(_report(_layer(ref=0.3, cand=0.6, allowed=0.0)), baseline=base)["exit_code"] == 0
    assert gate.gate(_report(_layer(ref=0.3, cand=0.7, allowed=0.0)), baseline=base)["exit_code"] == 1
    # more non-finite outputs than the baseline had
    base = _report(_layer(nonfinite=0))
    worse = gate.gate(_report(_layer(nonfinite=3)), baseline=base)
    assert worse["exit_code"] == 1 and "non-finite" in worse["new_findings"][0]["worse"]


def test_a_baseline_of_another_run_is_said():
    base = _report(_layer())
    assert gate.mismatch(_report(_layer()), base) == []
    said = gate.mismatch(_report(_layer(), sha="b" * 64, dtype="float16", impl="p.py:f"), base)
    assert len(said) == 3 and "sha256 aaaaaaaaaaaa" in said[0] and "bbbbbbbbbbbb" in said[0]
    assert said[1] == "dtype bfloat16, here float16" and said[2] == 'candidate "torch", here "p.py:f"'


def test_a_worse_eps_fails_the_gate_and_the_same_one_passes(model, tmp_path):
    """The issue's case: a baseline made at --candidate-eps 1e-6 on an eps-1e-5 model; the same
    finding code at 1e-8 is a worse fault, at 1e-6 again the accepted one."""
    base = tmp_path / "base.json"
    assert parity("check", model, "--candidate-eps", "1e-6", *FAST, "--json", base, "-q")[0] == 1
    out = tmp_path / "worse.json"
    code, stdout, _ = parity("check", model, "--candidate-eps", "1e-8", *FAST, "--baseline", base, "--json", out)
    assert code == 1
    new = json.loads(out.read_text())["gate"]["new_findings"]
    assert {(f["layer"], f["code"]) for f in new} == {("model.norm", "eps_mismatch")}
    assert all("behaves as eps 1e-08" in f["worse"] for f in new)
    assert stdout.splitlines()[0].startswith("FAIL: ")
    assert "worse than the baseline" in stdout and "model.norm" in stdout
    code, stdout, _ = parity("check", model, "--candidate-eps", "1e-6", *FAST, "--baseline", base, "-q")
    assert code == 0 and stdout.startswith("PASS: no new finding against the baseline"), stdout
    # another dtype: refused in one line, nothing written, unless --baseline-any (then said first)
    other = tmp_path / "other.json"
    code, stdout, stderr = parity("check", model, "--candidate-eps", "1e-6", "--dtype", "float32", *FAST,
                                  "--baseline", base, "--json", other, "-q")
    assert code == 2 and not other.exists() and len(stderr.strip().splitlines()) == 1, stderr
    assert "dtype bfloat16, here float32" in stderr and "--baseline-any" in stderr, stderr
    code, stdout, _ = parity("check", model, "--candidate-eps", "1e-6", "--dtype", "float32", *FAST,
                             "--baseline", base, "--baseline-any", "-q")
    first = stdout.splitlines()[0]
    assert first.startswith("warning: the baseline") and "dtype bfloat16, here float32" in first, stdout


@pytest.mark.parametrize("field,value,named", [
    ("diagnoses", None, "layers[0].diagnoses"),
    ("strata", {"x": 1}, "layers[0].strata"),
    ("worst", {"reference": 0.1, "candidate": "abc", "allowed": 0.1}, "layers[0].strata[0].worst"),
    ("interval", "wide", "layers[0].diagnoses[0].interval"),
    ("name", 7, "layers[0].name"),
])
def test_a_malformed_baseline_is_one_line_naming_the_field(model, tmp_path, field, value, named):
    base = tmp_path / "base.json"
    assert parity("check", model, "--candidate-eps", "1e-6", *FAST, "--json", base, "-q")[0] == 1
    data = json.loads(base.read_text())
    layer = data["layers"][0]
    if field == "worst":
        layer["strata"][0]["worst"] = value
    elif field == "interval":
        layer["diagnoses"][0]["interval"] = value
    else:
        layer[field] = value
    base.write_text(json.dumps(data))
    out = tmp_path / "r.json"
    refused(parity("check", model, "--candidate-eps", "1e-6", *FAST, "--baseline", base, "--json", out), base, named)
    assert not out.exists()


def test_the_gate_names_a_malformed_field_itself():
    """Whatever reader handed it the baseline: a field of the wrong type is one line naming it."""
    bad = _report(_layer())
    bad["layers"][0]["diagnoses"] = None
    with pytest.raises(InputError, match=r"^b.json: the baseline's layers\[0\]\.diagnoses is null, not a list$"):
        gate.gate(_report(_layer()), baseline=bad, baseline_path="b.json")
    bad = _report(_layer(1e-6, "wide"))
    with pytest.raises(InputError, match=r"layers\[0\]\.diagnoses\[0\]\.interval is not a \[low, high\] pair"):
        gate.gate(_report(_layer()), baseline=bad, baseline_path="b.json")


# --- outputs: through links, never into /proc, never onto an input -----------------------------------

@pytest.mark.parametrize("flag", ["--json", "--junit", "--markdown"])
def test_a_report_path_that_is_a_link_is_refused_and_its_target_untouched(model, tmp_path, flag):
    """Issue 48: `ln -s ~/victim.txt link.json; parity check CKPT --json link.json` overwrote the
    victim. A report name that is a link is refused in one line, before the run: the link, its
    target (its mode included) and the directory are left as they were. A link to nowhere too:
    nothing is made at its target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    os.chmod(victim, 0o600)
    link = tmp_path / "link.out"
    link.symlink_to(victim)
    refused(parity("check", model, *FAST, flag, link, "-q"), link, "is a symbolic link", "never writes through")
    assert link.is_symlink() and victim.read_text() == "mine" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    dangling = tmp_path / "new.out"
    dangling.symlink_to(tmp_path / "sub" / "made.out")
    (tmp_path / "sub").mkdir()
    refused(parity("check", model, *FAST, flag, dangling, "-q"), dangling, "is a symbolic link")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["link.out", "new.out", "sub", "victim.txt"]


def test_a_link_in_the_directory_of_a_report_is_followed(model, tmp_path):
    """The directory is the user's choice (a link to a larger disk): only the file's own name may not
    be a link."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "out").symlink_to("disk")
    code, _, err = parity("check", model, *FAST, "--json", tmp_path / "out" / "r.json", "-q")
    assert code == 0, err
    assert json.loads((tmp_path / "disk" / "r.json").read_text())["schema_version"] == 1


@pytest.mark.parametrize("name", ["/dev/stdout", "/proc/self/fd/1", "link-to-stdout"])
def test_json_to_a_descriptor_is_refused_and_nothing_is_replaced(model, tmp_path, name, monkeypatch):
    """Run as root, `--json /dev/stdout` replaced the machine's /dev/stdout link with a file."""
    real = os.replace

    def guarded(src, dst, **kwargs):  # a code without the check must not break this machine's /dev/stdout
        assert not str(dst).startswith(("/dev/", "/proc/")), f"renamed onto {dst}"
        return real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", guarded)
    if name == "link-to-stdout":
        name = tmp_path / name
        name.symlink_to("/dev/stdout")
    before = os.readlink("/dev/stdout") if os.path.islink("/dev/stdout") else None
    refused(parity("check", model, *FAST, "--json", name, "-q"), name, "refused", "--json - for stdout")
    assert (os.readlink("/dev/stdout") if os.path.islink("/dev/stdout") else None) == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_inputs_are_never_outputs(model, tmp_path):
    """Refused before the run, one line, the input untouched: a checkpoint's files, a saved report
    given to explain, a plugin's source, --baseline, --activations, capture's --text, a GGUF file,
    and through a link to any of them."""
    plugin = tmp_path / "p.py"
    plugin.write_text("def f(x, w, eps):\n    raise AssertionError('never run')\n")
    baseline = tmp_path / "base.json"
    assert parity("check", model, "--candidate-eps", "1e-6", *FAST, "--json", baseline, "-q")[0] == 1
    act = tmp_path / "act.safetensors"
    act.write_bytes(b"not read")
    text = tmp_path / "t.txt"
    text.write_text("w1 w2")
    cases = [
        (["inspect", model, "--json", model / "model.safetensors"], model / "model.safetensors"),
        (["inspect", model, "--json", model / "config.json"], model / "config.json"),
        (["explain", baseline, "--json", baseline], baseline),
        (["check", model, *FAST, "--candidate", f"{plugin}:f", "--json", plugin], plugin),
        (["check", model, *FAST, "--reference", f"{plugin}:f", "--markdown", plugin], plugin),
        (["check", model, *FAST, "--baseline", baseline, "--junit", baseline], baseline),
        (["check", model, *FAST, "--activations", act, "--json", act], act),
        (["capture", model, "--text", text, "-o", text], text),
    ]
    for argv, victim in cases:
        before = victim.read_bytes()
        refused(parity(*argv), "would overwrite an input of this run")
        assert victim.read_bytes() == before, argv
    link = tmp_path / "cfg-link.json"  # a link to an input is refused as every link is
    link.symlink_to(model / "config.json")
    before = (model / "config.json").read_bytes()
    refused(parity("check", model, *FAST, "--json", link), "is a symbolic link")
    assert (model / "config.json").read_bytes() == before


def test_an_onnx_graphs_external_data_is_an_input(model, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    gain = helper.make_tensor("model.norm.weight", TensorProto.FLOAT, [16], [1.0] * 16)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    gain.ClearField("float_data")
    gain.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", "64")):
        entry = gain.external_data.add()
        entry.key, entry.value = key, value
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "model.norm.weight"], ["y"], epsilon=1e-5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])], initializer=[gain])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path))
    refused(parity("inspect", path, "--json", tmp_path / "weights.bin"), "would overwrite an input")
    refused(parity("check", model, *FAST, "--candidate-checkpoint", path, "--json", tmp_path / "weights.bin"),
            "would overwrite an input")
    assert (tmp_path / "weights.bin").read_bytes() == b"\0" * 64
    # a file beside the graph that it does not name is no input
    from parity_cli.cli import _inputs

    (tmp_path / "r.json").write_text("{}")
    wanted = {(tmp_path / "r.json").resolve(), (tmp_path / "weights.bin").resolve()}
    assert _inputs([path], wanted) == {(tmp_path / "weights.bin").resolve()}


def test_a_gguf_file_is_an_input(model, tmp_path):
    pytest.importorskip("gguf")
    from parity_cli.sources.synthetic import hf_to_gguf

    g = hf_to_gguf(model, tmp_path / "m.gguf")
    before = g.read_bytes()
    refused(parity("inspect", g, "--json", g), "would overwrite an input")
    refused(parity("check", model, *FAST, "--candidate-checkpoint", g, "--json", g), "would overwrite an input")
    assert g.read_bytes() == before


# --- the set is whole or absent; failures name the file ---------------------------------------------

def test_the_plot_is_part_of_the_set(model, tmp_path, monkeypatch):
    """A full disk while the plot is written: no report, no JUnit either (they were already there)."""
    pytest.importorskip("matplotlib")
    real = outputs._stage

    def full_on_plot(text, path):
        if str(path).endswith(".svg"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(text, path)

    monkeypatch.setattr(outputs, "_stage", full_on_plot)
    out = {k: tmp_path / f"r.{k}" for k in ("json", "xml", "svg")}
    refused(parity("check", model, *FAST, "--json", out["json"], "--junit", out["xml"], "--plot", out["svg"], "-q"),
            out["svg"], "cannot write", "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["write", "rename"])
def test_a_full_disk_names_the_file(tmp_path, monkeypatch, where):
    """ENOSPC from write() carries no file name: the message named none (': cannot write report')."""
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # no filename, as the kernel's errno gives

    if where == "write":
        real = outputs.os.fdopen

        class Full:
            def __init__(self, *args, **kwargs):
                self.fh = real(*args, **kwargs)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.fh.close()

            write = no_space

        monkeypatch.setattr(outputs.os, "fdopen", Full)
    else:
        monkeypatch.setattr(outputs.os, "replace", no_space)
    out = tmp_path / "r.json"
    with pytest.raises(InputError) as exc:
        outputs.write_files({out: "{}\n", tmp_path / "r.xml": "<x/>\n"})
    assert str(exc.value) == f"{out}: cannot write report: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_names_past_name_max(model, tmp_path):
    """Past NAME_MAX: one line before the run. Just under it: written (the temporary file's name
    was the output's plus 13 characters, and went past the limit itself)."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    long = tmp_path / ("a" * (limit + 1))
    refused(parity("check", model, *FAST, "--json", long, "-q"), "a" * 50, "too long")
    refused(parity("inspect", model, "--json", long), "too long")
    near = tmp_path / ("b" * (limit - 5) + ".json")
    code, _, err = parity("check", model, *FAST, "--json", near, "-q")
    assert code == 0 and json.loads(near.read_text())["schema_version"] == 1, err


# --- one verdict everywhere (issue 35) ----------------------------------------------------------------------------


def test_a_baseline_that_accepts_every_finding_says_pass_in_all_four_outputs(model, tmp_path):
    """JSON, JUnit, Markdown and the terminal agree with the exit code: the accepted findings are
    skipped with their reason in JUnit, marked in Markdown, and the JSON's top-level verdict is the gate's
    (summary.verdict, the comparison's alone, says so)."""
    import xml.etree.ElementTree as ET

    args = ("check", model, "--candidate-eps", "1e-6", "--layers", "model.*")
    base = tmp_path / "base.json"
    assert parity(*args, "--json", base, "-q")[0] == 1
    failing = [layer["name"] for layer in json.loads(base.read_text())["layers"] if layer["status"] != "pass"]
    assert len(failing) == 3  # the eps fault in every layer
    out = {k: tmp_path / f"r.{k}" for k in ("json", "xml", "md")}
    code, stdout, _ = parity(*args, "--baseline", base, "--json", out["json"], "--junit", out["xml"],
                             "--markdown", out["md"])
    assert code == 0 and stdout.splitlines()[-1].startswith("PASS: no new finding against the baseline"), stdout
    data = json.loads(out["json"].read_text())
    assert data["verdict"] == data["gate"]["verdict"] == "pass" and data["summary"]["verdict"] == "fail"
    assert "before --baseline" in data["summary"]["verdict_is"]
    suite = ET.parse(out["xml"]).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("3", "0", "0", "3")
    for case in suite.findall("testcase"):
        (skipped,) = case.findall("skipped")
        assert case.find("failure") is None and "accepted by the baseline" in skipped.get("message")
        assert "eps_mismatch" in skipped.get("message")
    md = out["md"].read_text()
    assert md.startswith("## parity: PASS") and "| accepted: " in md and "| new: " not in md


def _crafted(base, edit):
    data = json.loads(base.read_text())
    edit(data)
    crafted = base.with_name("crafted.json")
    crafted.write_text(json.dumps(data))
    return crafted


def _eps_diagnoses(data):
    return [d for layer in data["layers"] for d in layer["diagnoses"] if d["code"] == "eps_mismatch"]


@pytest.mark.parametrize("label,edit,words", [
    ("an eps interval of [0, 1e300]", lambda d: [x.update(interval=[0, 1e300]) for x in _eps_diagnoses(d)],
     "is not an interval a diagnosis gives"),
    ("an eps interval not around its estimate", lambda d: [x.update(interval=[1.0, 2.0]) for x in _eps_diagnoses(d)],
     "is not an interval a diagnosis gives"),
    ("a worst candidate of inf with no non-finite output",
     lambda d: [s["worst"].update(candidate="inf") for layer in d["layers"] for s in layer["strata"] if s.get("worst")],
     "worst.candidate is inf where the stratum counts no non-finite output"),
])
def test_a_crafted_baseline_is_refused_in_one_line(model, tmp_path, label, edit, words):
    """The issue's catch-all baseline let a 100,000x eps fault pass: each crafted size is refused before
    the run, naming the field."""
    base = tmp_path / "base.json"
    assert parity("check", model, "--candidate-eps", "1e-6", *FAST, "--json", base, "-q")[0] == 1
    crafted = _crafted(base, edit)
    out = tmp_path / "r.json"
    code, _, err = parity("check", model, "--candidate-eps", "1.0", *FAST, "--baseline", crafted, "--json", out)
    assert code == 2 and not out.exists() and len(err.strip().splitlines()) == 1, err
    assert str(crafted) in err and words in err, err


def test_a_baseline_of_another_checkpoint_never_gates(model, tmp_path):
    """Another checkpoint's baseline (its norm tensors' fingerprint) is exit 2 in one line, nothing written;
    --baseline-any gates with it, saying so first."""
    other = write_checkpoint(tmp_path / "other", "llama", layers=1, hidden=16, heads=2, eps=1e-5, seed=9)
    base = tmp_path / "base.json"
    assert parity("check", other, "--candidate-eps", "1e-6", *FAST, "--json", base, "-q")[0] == 1
    out = tmp_path / "r.json"
    code, _, err = parity("check", model, "--candidate-eps", "1e-6", *FAST, "--baseline", base, "--json", out, "-q")
    assert code == 2 and not out.exists() and "another checkpoint" in err and len(err.strip().splitlines()) == 1
    code, stdout, _ = parity("check", model, "--candidate-eps", "1e-6", *FAST, "--baseline", base, "--baseline-any",
                             "-q")
    assert stdout.splitlines()[0].startswith("warning: the baseline") and "another checkpoint" in stdout


def test_a_baseline_nested_past_64_levels_is_refused(model, tmp_path):
    base = tmp_path / "base.json"
    parity("check", model, "--candidate-eps", "1e-6", *FAST, "--json", base, "-q")
    deep = _crafted(base, lambda d: d["environment"].update(x=json.loads("[" * 70 + "]" * 70)))
    code, _, err = parity("check", model, *FAST, "--baseline", deep)
    assert code == 2 and "nests deeper than the 64 levels" in err and len(err.strip().splitlines()) == 1, err
