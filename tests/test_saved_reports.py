"""Issue 23 (part): a saved report is data.

- `parity explain REPORT.json` ran the code a report names: a `FILE.py:ATTR` reference in
  parity's own process, a candidate in the child, or in the parent under the report's
  `"isolation": "none"`, relative paths (../attacker/evil.py:f) followed, exit 0.
- A type fuzz of saved reports gave 1,225 internal errors in 11,900 renders: each wrong field
  must be one line naming the file and the field, from one place (parity_cli.report.saved,
  against the report's own JSON Schema).
- A candidate that writes garbage on its result pipe was a UnicodeDecodeError.

Every case runs in this process through parity_cli.cli.main, except the 10 MB name (its memory
is measured in a child)."""

import json
import os
import random

import pytest
from click.testing import CliRunner
from conftest import run_bounded

from parity_cli.cli import main
from parity_cli.report import saved as saved_report
from parity_cli.sources.synthetic import write_checkpoint


def parity(*argv, cwd=None):
    """main(argv) in this process: (exit code, stdout, stderr)."""
    old = os.getcwd()
    with CliRunner().isolation(env={"COLUMNS": "120"}) as (out, err, _):
        try:
            if cwd:
                os.chdir(cwd)
            main([str(a) for a in argv])
            code = 0
        except SystemExit as exc:
            code = exc.code
        finally:
            os.chdir(old)
        return code, out.getvalue().decode(), err.getvalue().decode()


def one_line(err: str, *words) -> None:
    assert err.count("\n") == 1 and err.startswith("parity: error: "), err
    assert "internal error" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A failing report of a one-layer llama checked with a built-in candidate (torch at eps 1e-4
    where the config says 1e-6), made in `root` with the checkpoint recorded as `m`."""
    root = tmp_path_factory.mktemp("saved")
    write_checkpoint(root / "m", "llama", layers=1, hidden=16, heads=2, eps=1e-6, dtype="float32", seed=3)
    code, _, err = parity("check", "m", "--candidate-eps", "1e-4", "--strata", "tiny,normal", "--layers",
                          "model.norm", "--json", "r.json", "-q", cwd=root)
    assert code == 1, err
    return root


def edited(saved, name: str, edit) -> str:
    """A copy of the saved report, beside it, with `edit(data)` applied; returns its name."""
    data = json.loads((saved / "r.json").read_text())
    edit(data)
    (saved / name).write_text(json.dumps(data))
    return name


# --- replay never runs code a report names ---------------------------------------------------------

EVIL = """import os
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran"), "a") as fh:
    fh.write(f"import {os.getpid()}\\n")


def f(x, weight, eps):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran"), "a") as fh:
        fh.write(f"call {os.getpid()}\\n")
    return x * 0 + 1e6  # every layer fails: there is something to explain
"""


@pytest.fixture
def evil(saved, tmp_path):
    """An attacker's plugin beside the working directory, reached by a relative path; it records
    every import and call (with the pid) in `ran` next to it."""
    attacker = saved.parent / f"attacker-{tmp_path.name}"
    attacker.mkdir()
    (attacker / "evil.py").write_text(EVIL)
    (saved / "evilmod.py").write_text(EVIL.replace("os.path.dirname(os.path.abspath(__file__))", repr(str(attacker))))
    return attacker


@pytest.mark.parametrize("role, spec", [("candidate", "../{attacker}/evil.py:f"), ("reference", "../{attacker}/evil.py:f"),
                                        ("candidate", "evilmod:f"), ("reference", "evilmod:f")])
def test_explain_never_runs_code_a_report_names(saved, evil, role, spec):
    spec = spec.format(attacker=evil.name)

    def plant(d):
        d[role]["impl"] = spec
        d["candidate"]["isolation"], d["candidate"]["timeout"] = "none", None  # in parity's own process, no limit

    name = edited(saved, f"evil-{role}.json", plant)
    code, out, err = parity("explain", name, cwd=saved)
    assert code == 2 and out == ""
    form = "FILE.py:ATTR" if spec.endswith("evil.py:f") else "MODULE:ATTR"
    one_line(err, f"{name}: the report names the {role} '{spec}'", f"--{role} {form}", "--trust-report")
    assert not (evil / "ran").exists()  # neither imported nor called, here or in a child


def test_trust_report_runs_the_named_candidate_supervised_not_as_the_report_says(saved, evil):
    """--trust-report lets the named plugin run; where it runs is still the command line's
    (--isolation auto: a supervised child), never the report's "isolation": "none"."""
    def plant(d):
        d["candidate"]["impl"] = f"../{evil.name}/evil.py:f"
        d["candidate"]["isolation"] = "none"

    name = edited(saved, "trusted.json", plant)
    code, out, err = parity("explain", name, "--trust-report", cwd=saved)
    assert code == 0, err
    assert "candidate at" in out or "conclusion" in out
    pids = {int(line.split()[1]) for line in (evil / "ran").read_text().splitlines()}
    assert pids and os.getpid() not in pids


def test_naming_the_candidate_again_runs_it_and_a_built_in_runs_as_recorded(saved, evil):
    def plant(d):
        d["candidate"]["impl"] = "somewhere/else.py:f"

    name = edited(saved, "renamed.json", plant)
    code, _, err = parity("explain", name, "--candidate", f"../{evil.name}/evil.py:f", cwd=saved)
    assert code == 0, err
    assert (evil / "ran").read_text().count("call") >= 1
    code, out, err = parity("explain", "r.json", cwd=saved)  # torch, a built-in: runs as the report says
    assert code == 0 and "eps carries the error" in out, err


def test_explain_help_documents_trust_report():
    code, out, _ = parity("explain", "--help")
    assert code == 0
    for option in ("--trust-report", "--reference", "--isolation", "--timeout"):
        assert option in out


# --- one validated schema: one line naming the file and the field ------------------------------------

CASES = [  # (command, edit, the field path the line names, what it says)
    ("report", lambda d: d["candidate"].update(checkpoint={"path": "c", "family": "llama", "eps": {"value": 1e-5, "source": "x"},
                                                           "findings": 0}),
     "candidate.checkpoint", "missing 'format'"),
    ("explain", lambda d: d["candidate"].update(timeout="120 s"), "candidate.timeout", "expected a number or null, got a string"),
    ("explain", lambda d: d["eps"].update(value="nan", source="override"), "eps.value", "expected a number, got a string"),
    ("explain", lambda d: d["candidate"].update(eps="nan", eps_source="option:--candidate-eps"), "candidate.eps",
     "expected a number, got a string"),
    ("explain", lambda d: d["layers"][0].update(diagnoses=None), "layers[0].diagnoses", "expected an array, got null"),
    ("report", lambda d: d["layers"][0].update(name="x" * 300_000), "layers[0].name",
     "a string of 300000 characters, over the 4096 allowed"),
    ("explain", lambda d: d["layers"][0].update(name="x" * 300_000), "layers[0].name",
     "a string of 300000 characters, over the 4096 allowed"),
    ("report", lambda d: d["tolerance"].update(atol=float("inf")), "tolerance.atol", "inf is not a JSON number"),
    ("report", lambda d: d["probes"].update(strata=[]), "probes.strata", "0 items, fewer than the 1 required"),
    ("report", lambda d: d["layers"][0]["strata"][0].update(worst="x"), "layers[0].strata[0].worst",
     "expected null or an object, got a string ('x')"),
]


@pytest.mark.parametrize("command, edit, field, what", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_a_wrong_field_is_one_line_naming_the_file_and_the_field(saved, command, edit, field, what):
    name = edited(saved, "bad.json", edit)
    code, out, err = parity(command, name, cwd=saved)
    assert code == 2 and out == ""
    one_line(err, f"{name}: {field}: {what}")


def test_a_baseline_with_null_diagnoses_is_one_line(saved):
    name = edited(saved, "baseline.json", lambda d: d["layers"][0].update(diagnoses=None))
    code, out, err = parity("check", "m", "--layers", "model.norm", "--baseline", name, cwd=saved)
    assert code == 2 and out == ""
    one_line(err, f"{name}: layers[0].diagnoses: expected an array, got null")


def test_a_10_mb_layer_name_is_refused_in_bounded_memory(saved):
    """10 MB passed 5 GiB of RSS; refused where the report is read (run_bounded: under 700 MB)."""
    name = edited(saved, "huge.json", lambda d: d["layers"][0].update(name="model." + "x" * 10_000_000))
    r = run_bounded("report", saved / name)
    assert r.returncode == 2
    one_line(r.stderr, "layers[0].name: a string of 10000006 characters, over the 4096 allowed")


def test_a_report_of_more_layers_than_a_check_writes_is_refused_first(saved):
    """Issue 35: 20,000 layers of 4 KB names (187 MB, under the size cap) took minutes in every
    format. A report holds at most the 10,000 layers a check writes; more is one line, said before
    any layer is read."""
    def grow(d):
        d["layers"] = [dict(d["layers"][0], name=f"model.layers.{k}.norm") for k in range(10_001)]

    name = edited(saved, "many.json", grow)
    code, out, err = parity("report", name, cwd=saved)
    assert code == 2 and out == ""
    one_line(err, f"{name}: layers: 10001 items, over the 10000 allowed")


def test_junit_names_a_groups_pattern_once_not_once_a_layer(saved, monkeypatch):
    """JUnit's failure text names every layer of a group as one pattern: built for each of a
    group's n layers, it cost n^2 on a report of thousands of long names."""
    from parity_cli.report import formats, grouping

    calls = []
    real = grouping.name_pattern
    monkeypatch.setattr(grouping, "name_pattern", lambda *a, **k: calls.append(1) or real(*a, **k))
    counts = []
    for n in (50, 100):
        def grow(d, n=n):
            d["layers"] = [dict(d["layers"][0], name=f"model.layers.{k}.norm") for k in range(n)]
            d["summary"].update(layers=n, failed=n)

        report = json.loads((saved / edited(saved, f"grown{n}.json", grow)).read_text())
        calls.clear()
        assert formats.to_junit(report).count("<failure") == n
        counts.append(len(calls))
    assert counts[0] == counts[1] <= 3, counts  # a few for the group and the summary, none a layer


def test_junit_of_many_groups_reads_each_name_a_bounded_number_of_times(saved, monkeypatch):
    """Issue 48: a report whose layers fail in many ways (an eps every two layers: n / 2 groups) had each
    group's pattern read every name of the report, n^2 name splits; 500 layers of 4 KB names took
    gigabytes. The work is counted, not timed: splits of a name stay a few per layer as n doubles."""
    from parity_cli.report import formats, grouping

    calls = []
    real = grouping._split
    monkeypatch.setattr(grouping, "_split", lambda name: calls.append(1) or real(name))
    per_layer = []
    for n in (50, 100):
        def grow(d, n=n):
            layer = d["layers"][0]
            d["layers"] = []
            for k in range(n):  # two layers an eps, each 1.2x the last: n / 2 groups of two
                eps = 1e-3 * 1.2 ** (k // 2)
                diagnoses = [dict(layer["diagnoses"][0], code="eps_mismatch", estimated_eps=eps,
                                  interval=[eps * 0.999, eps * 1.001], message=f"behaves as eps = {eps:.3g}")]
                d["layers"].append(dict(layer, name=f"model.layers.{k}.norm", status="fail", diagnoses=diagnoses))
            d["summary"].update(layers=n, failed=n)

        report = json.loads((saved / edited(saved, f"apart{n}.json", grow)).read_text())
        calls.clear()
        from parity_cli.report.grouping import groups

        assert len(groups(report)) == n // 2  # the case this test is about: a group every two layers
        calls.clear()
        assert formats.to_junit(report).count("<failure") == n
        per_layer.append(len(calls) / n)
    assert per_layer[1] <= per_layer[0] + 0.5 <= 6, per_layer


def _paths(node, prefix=()):
    if prefix:
        yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:2]):
            yield from _paths(v, prefix + (i,))


def _get(data, path):
    for p in path:
        data = data[p]
    return data


def _put(data, path, value):
    for p in path[:-1]:
        data = data[p]
    data[path[-1]] = value


def test_type_fuzz_is_one_line_or_a_render_never_an_internal_error(saved):
    """A bounded version of the issue's fuzz (there: every field path, 1,225 internal errors in
    11,900 renders): 30 field paths of a real report, each replaced by null, a string, an int, a
    list and an object, rendered by `parity report` in one of its formats. Either it renders
    (exit 0) or it is one line naming the file, never an internal error; and
    the reader's verdict is jsonschema's."""
    jsonschema = pytest.importorskip("jsonschema")
    base = json.loads((saved / "r.json").read_text())
    strict = jsonschema.Draft202012Validator(saved_report.schema())
    paths = list(_paths(base))
    rng = random.Random(23)
    formats = (["-q"], ["--format", "markdown"], ["--format", "junit"], [])
    refused = 0
    for k, path in enumerate(rng.sample(paths, 30)):
        for j, value in enumerate([None, "x", 7, [], {}]):
            data = json.loads(json.dumps(base))
            _put(data, path, value)
            try:
                saved_report.validate(data)
                ours = True
            except saved_report.Invalid:
                ours = False
            assert ours == strict.is_valid(data), (path, value)
            (saved / "fuzz.json").write_text(json.dumps(data))
            code, _, err = parity("report", "fuzz.json", *formats[(k + j) % len(formats)], cwd=saved)
            if ours:
                assert code == 0 and "error" not in err, (path, value, err)
            else:
                refused += 1
                assert code == 2, (path, value)
                one_line(err, "fuzz.json: ")
    assert refused > 30  # most replacements break the schema


def test_type_fuzz_of_what_explain_reads_is_one_line_or_a_ladder(saved):
    """The same for `parity explain`, on the fields a replay reads (options, paths, layers): 12
    replacements (half of them of the same type with an odd value), each a ladder (exit 0) or one
    line (exit 2), never an internal error."""
    base = json.loads((saved / "r.json").read_text())
    read = ("candidate", "reference", "probes", "tolerance", "eps", "checkpoint", "layers")
    paths = [p for p in _paths(base) if p[0] in read]
    rng = random.Random(17)
    codes = []
    for k, path in enumerate(rng.sample(paths, 12)):
        data = json.loads(json.dumps(base))
        old = _get(data, path)
        same_type = {str: "x", int: 7, float: 0.5, list: [], dict: {}}.get(type(old), old)  # type-valid, value odd
        _put(data, path, same_type if k % 2 else [None, "x", 7, [], {}][k % 5])
        (saved / "fuzz-explain.json").write_text(json.dumps(data))
        code, _, err = parity("explain", "fuzz-explain.json", cwd=saved)
        # weak-ok: a fuzz; each replacement is a ladder or one line, and both are asserted to occur below
        assert code in (0, 2), (path, err)
        if code == 2:
            one_line(err, "fuzz-explain.json")
        codes.append(code)
    assert 0 in codes and 2 in codes, codes  # both outcomes were exercised


def test_the_reader_checks_every_keyword_the_shipped_schema_uses():
    """A keyword the reader does not know would pass anything: every one in the schema is checked."""
    def walk(node):
        if isinstance(node, dict):
            yield node
            for key, value in node.items():
                if key not in ("properties", "$defs", "enum", "const", "required"):
                    yield from walk(value)
            for value in list(node.get("properties", {}).values()) + list(node.get("$defs", {}).values()):
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for spec in walk(saved_report.schema()):
        assert set(spec) <= saved_report.CHECKED | saved_report.ANNOTATIONS, set(spec) - saved_report.CHECKED


def test_the_reader_follows_the_keywords_as_json_schema_does():
    """Each keyword on a tiny schema, against jsonschema's verdict: true is not an integer, NaN is
    not above a minimum, oneOf means exactly one, a $ref reaches into $defs."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"$defs": {"n": {"type": "integer", "minimum": 0}},
              "type": "object", "required": ["a"],
              "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"enum": [1, "x", None]},
                             "c": {"oneOf": [{"type": "number"}, {"type": "integer"}]},
                             "d": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 1, "maxItems": 2},
                             "e": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "f": {"const": 1},
                             "g": {"type": "object", "additionalProperties": {"type": "boolean"}}}}
    cases = [{"a": 1}, {}, {"a": True}, {"a": -1}, {"a": 1.5}, {"a": 0, "b": 1}, {"a": 0, "b": True},
             {"a": 0, "b": None}, {"a": 0, "b": 2}, {"a": 0, "c": 1.5}, {"a": 0, "c": 1}, {"a": 0, "d": ["ab"]},
             {"a": 0, "d": ["abc"]}, {"a": 0, "d": ["a", "b", "c"]}, {"a": 0, "d": []}, {"a": 0, "e": 0}, {"a": 0, "e": 1},
             {"a": 0, "e": 1.01}, {"a": 0, "f": 1.0}, {"a": 0, "f": True}, {"a": 0, "g": {"k": True}},
             {"a": 0, "g": {"k": 1}}, {"a": 0, "x": [None]}, []]
    for case in cases:
        try:
            saved_report.validate(case, schema)
            ours = True
        except saved_report.Invalid:
            ours = False
        assert ours == jsonschema.Draft202012Validator(schema).is_valid(case), case
    with pytest.raises(saved_report.Invalid, match="not a JSON number"):  # the report writes "nan"
        saved_report.validate({"a": 0, "e": float("nan")}, schema)


# --- a candidate that corrupts its result channel --------------------------------------------------

GARBAGE = """import os, struct, sys


def f(x, weight, eps):
    frame = sys._getframe()  # the worker's pipe to the parent, found as hostile code would
    while "wfd" not in frame.f_locals:
        frame = frame.f_back
    os.write(frame.f_locals["wfd"], struct.pack("<I", 8) + b"\\x80\\xff\\xfe not UTF-8")
    return x
"""


def test_garbage_on_the_result_pipe_is_a_corrupted_channel_not_a_decode_error(tmp_path):
    from parity_cli import api

    (tmp_path / "garbage.py").write_text(GARBAGE)
    model = write_checkpoint(tmp_path / "m", "llama", layers=1, hidden=16, heads=2, dtype="float32")
    report = api.check(model, candidate=f"{tmp_path / 'garbage.py'}:f", layers="model.norm", strata=["normal"])
    (layer,) = report.layers
    assert layer.status == "error" and "the candidate corrupted its result channel" in layer.error, layer.error
    assert "Decode" not in layer.error
