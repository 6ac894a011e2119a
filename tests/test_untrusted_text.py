"""Issue 23 (part): text from files is data. A tensor name, a config's model_type and a saved
report's fields reached the terminal with their ESC sequences (colours, OSC 8 hyperlinks), an
OSC sequence made the JUnit XML invalid, '[/]' in a report field was a MarkupError and
'[link=...]' a live hyperlink; a 300 KB layer name hit a RecursionError mid-table. Every case
runs in this process through parity_cli.cli.main."""

import io
import json
import re
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from parity_cli.cli import main
from parity_cli.sources.synthetic import write_checkpoint
from parity_cli.text import printable

ESC = "\x1b[31mRED\x1b[0m"
OSC = "\x1b]8;;http://evil.example\x07LINK\x1b]8;;\x07"
BIDI = "\u202egnp.exe"
MARKUP = "[/][link=http://x]ml[/link][bold]"
MD = "[click](http://evil.example)<img src=x>"  # a live link and HTML in a Markdown PR comment
HOSTILE = ESC + OSC + BIDI + MARKUP + "\x00\x7f\x9b"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\x00", "\x7f")  # none of these may reach an output


def parity(*argv, env=None):
    """main(argv) in this process: (exit code, stdout, stderr)."""
    with CliRunner().isolation(env={"COLUMNS": "120", **(env or {})}) as (out, err, _):
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as exc:
            code = exc.code
        return code, out.getvalue().decode(), err.getvalue().decode()


def clean(text: str) -> None:
    for ch in RAW:
        assert ch not in text, (ch, text[:2000])
    assert "internal error" not in text and "Traceback" not in text, text[-2000:]


@pytest.fixture(scope="module")
def report_path(tmp_path_factory):
    """A failing report of a one-layer llama (every layer fails: candidate eps 1e-6, config 1e-5)."""
    root = tmp_path_factory.mktemp("rep")
    path = write_checkpoint(root / "m", "llama", layers=1, hidden=16, heads=2, eps=1e-5, dtype="float32", seed=3)
    out = root / "r.json"
    code, _, err = parity("check", path, "--candidate-eps", "1e-6", "--strata", "tiny,normal", "--json", out, "-q")
    assert code == 1 and out.exists(), err
    return out


@pytest.fixture
def hostile_report(report_path, tmp_path):
    """The report with hostile text in every kind of field a renderer prints."""
    d = json.loads(report_path.read_text())
    for i, layer in enumerate(d["layers"]):
        layer["name"] = f"model.layers.{i}.{HOSTILE}"
        for item in layer["diagnoses"]:
            item["message"] = HOSTILE
        layer["warnings"] = [HOSTILE]
        for s in layer["strata"]:
            s["name"] = "ti" + MARKUP + ESC if s["name"] == "tiny" else s["name"]
    d["probes"]["strata"] = ["ti" + MARKUP + ESC if s == "tiny" else s for s in d["probes"]["strata"]]
    d["candidate"]["impl"] = HOSTILE
    d["candidate"]["device"] = "cpu" + MARKUP
    d["candidate"]["dtype"] = "float32" + MARKUP
    d["checkpoint"]["family"] = "llama" + OSC
    d["checkpoint"]["model_type"] = HOSTILE
    d["eps"]["source"] = HOSTILE + MD
    d["candidate"]["device"] += MD
    d["warnings"] = [HOSTILE]
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(d))
    return path


# --- the one function -------------------------------------------------------------------------------

def test_printable_escapes_each_control_and_bidi_character_and_nothing_else():
    expected = {"\x1b": "\\x1b", "\x00": "\\x00", "\x07": "\\x07", "\x7f": "\\x7f", "\x80": "\\x80",
                "\x9b": "\\x9b", "\x9f": "\\x9f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
                "\u202a": "\\u202a", "\u202e": "\\u202e", "\u2066": "\\u2066", "\u2069": "\\u2069",
                "\ud800": "\\ud800", "\uffff": "\\uffff"}
    for ch, shown in expected.items():
        assert printable("a" + ch + "b") == "a" + shown + "b"
    kept = "model.layers.0.norm é 中 · ░ █ ≈ ± [/] \\ \xa0\xff"
    assert printable(kept) == kept
    once = printable(HOSTILE)
    assert printable(once) == once and not any(ch in once for ch in RAW)


def test_printable_tree_escapes_keys_and_nested_values_and_nothing_else():
    from parity_cli.text import printable_tree

    clean_report = {"layers": [{"name": "model.norm", "q": 1.5, "s": ["a\\nb", None]}], "n": (1, "x")}
    assert printable_tree(clean_report) == clean_report  # a literal backslash-n is text, not a newline
    tree = {"a\x1b": [{"b": ("c\n", 2, "\u202e")}], "d": "\x85", "e": 1.0}
    assert printable_tree(tree) == {"a\\x1b": [{"b": ("c\\n", 2, "\\u202e")}], "d": "\\x85", "e": 1.0}


# --- checkpoints ---------------------------------------------------------------------------------------

def test_a_tensor_name_with_escapes_is_printed_escaped(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = write_checkpoint(tmp_path / "m", "llama", layers=1, hidden=16, heads=2, eps=1e-5, dtype="float32")
    tensors = load_file(path / "model.safetensors")
    tensors[f"model.layers.0.post_{ESC}{OSC}{MARKUP}_norm.weight"] = torch.ones(16)  # norm-like, unmatched
    save_file(tensors, path / "model.safetensors")
    code, out, err = parity("inspect", path)
    assert code == 0, err
    clean(out + err)
    assert "post_\\x1b[31mRED" in out and MARKUP in out.replace("\n    ", "")
    md, xml = tmp_path / "r.md", tmp_path / "r.xml"
    code, out, err = parity("check", path, "--strata", "normal", "--markdown", md, "--junit", xml)
    assert code == 0, err
    clean(out + err)
    assert "post_\\x1b[31mRED" in out.replace("\n    ", "")  # the warning naming the unmatched tensor
    clean(md.read_text())
    assert "\\\\x1b\\[31mRED" in md.read_text()  # '\' and '[' escaped for Markdown
    ET.parse(xml)


def test_an_unknown_model_type_with_escapes_is_refused_in_one_clean_line(tmp_path):
    path = write_checkpoint(tmp_path / "m", "llama", layers=1, hidden=16, heads=2, eps=1e-5, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "x" + ESC + OSC + "\r\n" + BIDI
    (path / "config.json").write_text(json.dumps(config))
    for command in ("inspect", "check"):
        code, out, err = parity(command, path)
        assert code == 2 and out == "", (code, err)
        clean(err)
        lines = err.strip().split("\n")
        assert len(lines) == 1 and lines[0].startswith("parity: error: "), err
        assert "model_type 'x\\x1b[31mRED\\x1b[0m\\x1b]8;;http://evil.example\\x07LINK" in lines[0]
        assert "\\r\\n\\u202egnp.exe'" in lines[0]
    code, out, err = parity("inspect", path, "--family", "llama")  # forced: the model_type is still printed
    assert code == 0, err
    clean(out + err)
    assert "(model_type x\\x1b[31mRED" in re.sub(r"\n +", " ", out)


def test_an_internal_error_quoting_file_text_is_one_clean_line(report_path, monkeypatch):
    """The last-resort line (an input no check anticipated) quotes the exception, which may
    quote the file."""
    import parity_cli.report.gate

    def boom(*args, **kwargs):
        raise ValueError("bad field " + HOSTILE + "\nsecond line")

    monkeypatch.setattr(parity_cli.report.gate, "load_report", boom)
    code, out, err = parity("report", report_path)
    assert code == 2 and out == ""
    for ch in RAW:
        assert ch not in err, (ch, err)
    assert err.startswith("parity: internal error: ValueError: bad field \\x1b[31mRED") and err.count("\n") == 1


# --- saved reports -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [(), ("-v",), ("-q",)])
def test_a_hostile_report_renders_inert_on_the_terminal(hostile_report, flags):
    code, out, err = parity("report", hostile_report, *flags)
    assert code == 0, err
    clean(out + err)
    unfolded = re.sub(r"\n +", "", out)
    if flags == ("-q",):  # one line, the verdict and its cause; the names only where they fit
        assert out.startswith("FAIL: ") and out.count("\n") == 1
        return
    assert "\\x1b[31mRED" in unfolded and "\\u202egnp.exe" in unfolded
    assert MARKUP in unfolded  # printed as text: no MarkupError, no tag taken away


def test_a_link_tag_in_a_report_is_no_hyperlink_on_a_colour_terminal(hostile_report):
    code, out, err = parity("report", hostile_report, "-v", env={"FORCE_COLOR": "1"})
    assert code == 0, err
    assert "\x1b[" in out  # colours on: rich writes its own SGR sequences
    assert "\x1b]" not in out and "\x07" not in out  # no OSC: no hyperlink, no title, nothing from the file
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert "\x1b" not in plain and MARKUP in re.sub(r"\n +", "", plain)


def test_a_hostile_report_renders_to_valid_junit_and_inert_markdown(hostile_report):
    code, out, err = parity("report", hostile_report, "--format", "junit")
    assert code == 0, err
    clean(out + err)
    root = ET.fromstring(out.encode())  # an OSC's BEL (\x07) is not allowed in XML 1.0
    names = [c.get("name") for c in root.iter("testcase")]
    assert names == [f"model.layers.{i}." + printable(HOSTILE) for i in range(len(names))] and names
    code, out, err = parity("report", hostile_report, "--format", "markdown")
    assert code == 0, err
    clean(out + err)
    assert "\\\\x1b\\[31mRED" in out and "\\[link=http://x\\]" in out
    assert not re.search(r"(?<!\\)\]\(", out) and "<img" not in out  # no link: every ']' escaped and "\\[click\\](http://evil.example)&lt;img" in out


def test_a_lone_surrogate_is_rendered_as_its_escape(report_path):
    """'\\ud800' is valid JSON with no UTF-8 form: printed or written raw it raised
    UnicodeEncodeError. (A report reader may refuse it first; the renderers do not depend on it.)"""
    from rich.console import Console

    from parity_cli.report.formats import to_junit, to_markdown
    from parity_cli.report.terminal import render

    d = json.loads(report_path.read_text())
    d["layers"][0]["name"] = "model.\ud800.norm"
    buf = io.StringIO()
    render(d, Console(file=buf, width=100, highlight=False, soft_wrap=False), verbose=True)
    for text in (buf.getvalue(), to_junit(d), to_markdown(d)):
        text.encode("utf-8")  # no lone surrogate left
        assert "model.\\ud800.norm" in text.replace("\\\\", "\\")  # Markdown escapes the backslash


# --- long names ------------------------------------------------------------------------------------------

def test_a_300_kb_layer_name_renders_without_recursion(report_path):
    """The renderer itself, whatever bound a report reader puts on names: a name of 300,000
    characters (no '.', so nothing to fold at) was a RecursionError after part of the table."""
    from rich.console import Console

    from parity_cli.report.formats import to_junit, to_markdown
    from parity_cli.report.terminal import quiet_line, render

    d = json.loads(report_path.read_text())
    d["layers"][0]["name"] = "model." + "x" * 300_000 + ESC
    buf = io.StringIO()
    render(d, Console(file=buf, width=100, highlight=False, soft_wrap=False), verbose=True)
    text = buf.getvalue()
    assert text.count("x") >= 300_000 and "\x1b" not in text
    assert max(len(line) for line in text.split("\n")) <= 100
    assert quiet_line(d) and ET.fromstring(to_junit(d).encode()) is not None and to_markdown(d)


def test_a_report_nested_deeper_than_the_call_stack_renders(report_path):
    """A key no renderer reads may nest as deep as the JSON parser allows: escaping the
    report's strings must not recurse into it."""
    from rich.console import Console

    from parity_cli.report.formats import to_junit, to_markdown
    from parity_cli.report.terminal import quiet_line, render

    d = json.loads(report_path.read_text())
    deep = [ESC]
    for _ in range(5000):
        deep = [(deep,), 1.0]
    d["extra"] = {"deep": deep}
    buf = io.StringIO()
    render(d, Console(file=buf, width=100, highlight=False, soft_wrap=False))
    assert "FAIL" in buf.getvalue() and quiet_line(d).startswith("FAIL")
    assert ET.fromstring(to_junit(d).encode()) is not None and to_markdown(d)


def test_wrap_folds_a_megabyte_word_into_lines_of_the_width():
    from parity_cli.report.layout import wrap

    word = ("a" * 97 + "/") * 10_000 + "b" * 100_000  # 1.08 MB: folds at '/', then at the width
    lines = wrap(word, 100)
    assert "".join(line.plain.strip() for line in lines) == word  # no space put inside the word
    assert max(len(line) for line in lines) == 100 and len(lines) >= len(word) // 96
