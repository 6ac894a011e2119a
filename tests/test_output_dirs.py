"""Issue 27 (part): an output's missing directories are made, as pytest's --junitxml makes them
(`--json out/x.json` was refused when out/ did not exist), within issue 14's output checks: only
on the name as given, never through a link to nothing, never under /proc, /sys or /dev, never
where a file stands on the way, never past NAME_MAX or in an unwritable directory. They are made
when the run writes, not before: a run refused (exit 2) leaves no empty directory behind, and a
set that fails to be written takes back the directories it made."""

import errno
import os
import stat
from pathlib import Path

import pytest
from conftest import load_json, run_parity

from parity_cli import outputs
from parity_cli.errors import InputError
from parity_cli.sources.synthetic import write_checkpoint

FAST = ("--layers", "model.norm", "--strata", "tiny,constant", "-q")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama", layers=1, hidden=16, heads=2, eps=1e-5)


def refused(r, *words):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("parity: error: "), (r.returncode, r.stderr)
    for w in words:
        assert str(w) in lines[0], (w, r.stderr)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def no_system_mkdir(monkeypatch):
    """A code without the checks must not make directories in this machine's /dev (tests run as root)."""
    real = os.mkdir

    def guarded(path, *args, **kwargs):
        assert not str(path).startswith(("/dev/", "/proc/", "/sys/")), f"mkdir {path}"
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", guarded)


# --- made where the run writes ---------------------------------------------------------------------

def test_check_makes_the_directories_of_each_output(model, tmp_path):
    json_path, junit, md = tmp_path / "out" / "x.json", tmp_path / "ci" / "a" / "b" / "j.xml", tmp_path / "out" / "s.md"
    r = run_parity("check", model, *FAST, "--json", json_path, "--junit", junit, "--markdown", md)
    assert r.returncode == 0, r.stderr
    assert load_json(json_path)["summary"]["verdict"] == "pass"
    assert junit.read_text().startswith("<?xml") and md.read_text().startswith("## parity")
    assert tree(tmp_path) == ["ci", "ci/a", "ci/a/b", "ci/a/b/j.xml", "out", "out/s.md", "out/x.json"]


def test_a_failing_run_writes_its_report_into_new_directories(model, tmp_path):
    out = tmp_path / "reports" / "r.json"
    r = run_parity("check", model, *FAST, "--candidate-eps", "1e-3", "--json", out)
    assert r.returncode == 1, r.stderr
    assert load_json(out)["summary"]["verdict"] == "fail"


def test_relative_names_are_made_under_the_working_directory(model, tmp_path):
    r = run_parity("check", model, *FAST, "--json", "out/x.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "x.json").is_file()


def test_the_mode_is_mkdirs(model, tmp_path):
    umask = os.umask(0o027)
    try:
        assert run_parity("check", model, *FAST, "--json", tmp_path / "a" / "b" / "r.json").returncode == 0
    finally:
        os.umask(umask)
    for d in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~0o027


def test_through_a_link_to_a_directory(model, tmp_path):
    """A link to an existing directory on the way (a larger disk) is followed, as the kernel
    would: the new directory is made in the link's target, the link left as it is."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "lnk").symlink_to("disk")
    r = run_parity("check", model, *FAST, "--json", tmp_path / "lnk" / "new" / "r.json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "disk" / "new" / "r.json").is_file() and (tmp_path / "lnk").is_symlink()


def test_inspect_and_explain_make_theirs(model, tmp_path):
    r = run_parity("inspect", model, "--json", tmp_path / "i" / "inspect.json")
    assert r.returncode == 0, r.stderr
    assert load_json(tmp_path / "i" / "inspect.json")["checkpoint"]["family"] == "llama"
    report = tmp_path / "r.json"
    assert run_parity("check", model, *FAST, "--candidate-eps", "1e-3", "--json", report).returncode == 1
    r = run_parity("explain", report, "--json", tmp_path / "e" / "f" / "explain.json")
    assert r.returncode == 0, r.stderr  # explain explains: its exit is 0 whatever the report's verdict
    assert "groups" in load_json(tmp_path / "e" / "f" / "explain.json")


def test_the_plot_gets_its_directory(model, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "p.svg"
    r = run_parity("check", model, *FAST, "--plot", out)
    assert r.returncode == 0, r.stderr
    assert out.read_text().lstrip().startswith("<?xml")


def test_capture_makes_its_directory(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    d = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, vocab_size=20, rms_norm_eps=1e-6)).save_pretrained(d)
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(18)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(d)
    out = tmp_path / "caps" / "one" / "a.safetensors"
    r = run_parity("capture", d, "--prompt", " ".join(f"w{i % 18}" for i in range(20)), "-o", out)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and out.stat().st_size > 0


def test_the_library_writers_make_them(tmp_path):
    outputs.write_json({"a": 1}, tmp_path / "x" / "y" / "r.json")
    outputs.write_bytes(tmp_path / "x" / "z" / "b.bin", b"\0\1")
    assert tree(tmp_path) == ["x", "x/y", "x/y/r.json", "x/z", "x/z/b.bin"]


# --- refused, one line, before the run, nothing made -----------------------------------------------

def test_a_file_on_the_way_is_refused(model, tmp_path):
    (tmp_path / "f").write_text("a file")
    r = run_parity("check", model, *FAST, "--json", tmp_path / "f" / "sub" / "r.json")
    refused(r, "--json", tmp_path / "f", "is a file, not a directory")
    assert tree(tmp_path) == ["f"] and (tmp_path / "f").read_text() == "a file"


def test_a_link_to_nothing_is_not_made_through(model, tmp_path):
    (tmp_path / "lnk").symlink_to(tmp_path / "elsewhere" / "deep")
    r = run_parity("check", model, *FAST, "--junit", tmp_path / "lnk" / "j.xml")
    refused(r, "--junit", "is a link to", "which does not exist")
    assert tree(tmp_path) == ["lnk"]


def test_an_output_that_is_a_link_into_a_missing_directory_is_refused(model, tmp_path):
    """The output's own name is a link to a file whose directory is missing: refused as every link
    is (issue 48), and nothing is made at the link's target."""
    (tmp_path / "r.json").symlink_to(tmp_path / "missing" / "r.json")
    r = run_parity("check", model, *FAST, "--json", tmp_path / "r.json")
    refused(r, "is a symbolic link")
    assert tree(tmp_path) == ["r.json"]


@pytest.mark.parametrize("where", ["/proc/parity-issue27/r.json", "/dev/parity-issue27/r.json",
                                   "/sys/parity-issue27/a/r.json", "/proc/self/parity-issue27/r.json"])
def test_never_under_proc_sys_or_dev(model, where, no_system_mkdir):
    r = run_parity("check", model, *FAST, "--json", where)
    refused(r, "--json", "a kernel or device tree; refused")
    assert not os.path.lexists(os.path.dirname(where))


def test_a_name_past_name_max_is_refused(model, tmp_path):
    long = "d" * 256  # NAME_MAX is 255 bytes on Linux filesystems
    r = run_parity("check", model, *FAST, "--json", tmp_path / long / "r.json")
    refused(r, "--json", "File name too long")  # the kernel's word, from looking the directory up
    # the file's own name under a directory still to be made: the kernel would not get that far
    r = run_parity("check", model, *FAST, "--json", tmp_path / "ok" / ("r" * 256))
    refused(r, "--json", "longer than the 255 bytes")
    assert tree(tmp_path) == []


def test_an_unwritable_directory_is_refused(model, tmp_path, monkeypatch):
    """(As root every directory is writable: access() is made to say no for this one.)"""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    r = run_parity("check", model, *FAST, "--json", locked / "new" / "r.json")
    refused(r, "--json", f"directory {locked} is not writable, so new cannot be made")
    assert tree(tmp_path) == ["locked"]


def test_a_run_refused_before_torch_leaves_no_directory(model, tmp_path):
    r = run_parity("check", model, *FAST, "--json", tmp_path / "out" / "r.json", "--candidate", "nosuch.py:Norm")
    refused(r, "nosuch.py")
    assert tree(tmp_path) == []


def test_a_run_refused_after_the_load_leaves_no_directory(model, tmp_path):
    """Refused in the pipeline (no layer matches --layers), after every output check passed."""
    r = run_parity("check", model, "--layers", "no.such.layer", "--json", tmp_path / "out" / "r.json",
                   "--markdown", tmp_path / "md" / "a" / "s.md")
    refused(r, "matches no norm layer")
    assert tree(tmp_path) == []


def test_two_outputs_one_refused_makes_neither(model, tmp_path):
    (tmp_path / "f").write_text("x")
    r = run_parity("check", model, *FAST, "--json", tmp_path / "out" / "r.json", "--junit", tmp_path / "f" / "j.xml")
    refused(r, "--junit")
    assert tree(tmp_path) == ["f"]


def test_a_set_that_fails_to_be_written_takes_its_directories_back(model, tmp_path, monkeypatch):
    """A full disk while the second file is staged: neither file, and no directory made for them
    (a directory that held something before is left as it was)."""
    (tmp_path / "kept").mkdir()
    real = outputs._stage
    calls = []

    def full(text, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(text, path)

    monkeypatch.setattr(outputs, "_stage", full)
    r = run_parity("check", model, *FAST, "--json", tmp_path / "a" / "b" / "r.json",
                   "--junit", tmp_path / "kept" / "new" / "j.xml")
    refused(r, "No space left on device")
    assert len(calls) == 2
    assert tree(tmp_path) == ["kept"]


def test_new_directories_names_them_and_makes_nothing(tmp_path):
    assert outputs.new_directories(tmp_path / "r.json") == []
    made = outputs.new_directories(tmp_path / "a" / "b" / "r.json", "--json")
    assert made == [tmp_path.resolve() / "a", tmp_path.resolve() / "a" / "b"]
    assert tree(tmp_path) == []
    assert outputs.make_directories(tmp_path / "a" / "b" / "r.json") == made
    assert outputs.make_directories(tmp_path / "a" / "b" / "r.json") == []  # already there: nothing more
    (tmp_path / "a" / "c").symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError, match="link"):
        outputs.new_directories(tmp_path / "a" / "c" / "d" / "r.json")
