"""Issue 14 (part): files that *declare* hostile things. What a header or a JSON file declares is
checked before anything is allocated, parsed deeply or read from: every case is exit 2 with one
line naming the file, and nothing blocks on a FIFO or reads /dev/zero."""

import json
import os
import struct
from pathlib import Path

import pytest
from conftest import run_bounded  # noqa: E402

from parity_cli.sources.synthetic import write_checkpoint

parity = run_bounded


def one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity: error: "), r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def write_safetensors(path: Path, tensors: dict) -> None:
    """name -> (dtype code, shape, data bytes or an int: that many bytes left as a hole)."""
    header, blobs, offset = {}, [], 0
    for name, (code, shape, data) in tensors.items():
        size = data if isinstance(data, int) else len(data)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        blobs.append(data)
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for blob in blobs:
            if isinstance(blob, int):
                fh.seek(blob, os.SEEK_CUR)
            else:
                fh.write(blob)
        fh.truncate()


@pytest.fixture
def llama_dir(tmp_path):
    """A one-layer llama directory whose model.norm the tests replace."""
    return write_checkpoint(tmp_path / "m", "llama", layers=1, hidden=16, heads=2, eps=1e-5, dtype="float32", seed=3)


def _replace_norm(path: Path, code: str, shape, data):
    from safetensors.torch import load_file

    tensors = {k: ("F32", list(v.shape), v.float().numpy().tobytes()) for k, v in
               load_file(path / "model.safetensors").items() if k != "model.norm.weight"}
    tensors["model.norm.weight"] = (code, shape, data)
    write_safetensors(path / "model.safetensors", tensors)


@pytest.mark.parametrize("code,itemsize", [("QINT8", 1), ("QUINT8", 1), ("QINT32", 4), ("BITS8", 1), ("C64", 8),
                                           ("U32", 4), ("I64", 8), ("F8_E4M3", 1)])
def test_a_norm_stored_in_an_unusable_dtype_is_refused_by_name(llama_dir, code, itemsize):
    _replace_norm(llama_dir, code, [16], b"\0" * (16 * itemsize))  # sizes consistent: the code alone is wrong
    r = parity("check", llama_dir)
    one_line_error(r, "model.safetensors", "model.norm.weight", code)


def test_a_norm_declaring_ten_million_channels_is_refused_before_it_is_read(llama_dir):
    _replace_norm(llama_dir, "F32", [10_000_000], 40_000_000)  # a 40 MB hole: the size is only declared
    r = parity("check", llama_dir)
    one_line_error(r, "model.norm.weight", "10000000")


@pytest.fixture
def config_of(llama_dir):
    def write(text: str | bytes):
        p = llama_dir / "config.json"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return llama_dir

    return write


def test_a_deeply_nested_config_is_one_line(config_of):
    r = parity("check", config_of('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"))
    one_line_error(r, "config.json", "nests deeper")


def test_an_integer_of_five_thousand_digits_is_one_line(config_of):
    r = parity("check", config_of('{"model_type": "llama", "x": ' + "9" * 5000 + "}"))
    one_line_error(r, "config.json")


def test_an_oversized_config_is_refused_unread(config_of):
    r = parity("check", config_of(b'{"model_type": "llama", "pad": "' + b"x" * (17 << 20) + b'"}'))
    one_line_error(r, "config.json", "MiB")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_config_does_not_block(llama_dir):
    (llama_dir / "config.json").unlink()
    os.mkfifo(llama_dir / "config.json")
    r = parity("check", llama_dir, timeout=30)
    one_line_error(r, "config.json", "not a regular file")


@pytest.mark.skipif(not Path("/dev/zero").exists() or not hasattr(os, "mkfifo"), reason="needs /dev/zero and FIFOs")
def test_reports_from_devices_and_fifos_are_refused(llama_dir, tmp_path):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    for args in (("check", llama_dir, "--baseline", "/dev/zero"), ("explain", "/dev/zero"), ("report", fifo)):
        r = parity(*args, timeout=30)
        one_line_error(r, "not a regular file")


def test_markup_in_paths_and_names_is_printed_as_text(tmp_path):
    """'[/red]' in a checkpoint path was taken for a rich closing tag (MarkupError) after the
    report had been written."""
    path = write_checkpoint(tmp_path / "we[/red]ird[bold]", "llama", layers=1, hidden=16, heads=2, eps=1e-5)
    out = tmp_path / "r.json"
    r = parity("check", path, "--candidate-eps", "1e-6", "--json", out)
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    unfolded = r.stdout.replace("\n    ", "")  # a path wider than the line folds at '/'
    assert "we[/red]ird[bold]" in unfolded and out.exists()
    r = parity("inspect", path)
    assert r.returncode == 0 and "we[/red]ird[bold]" in r.stdout.replace("\n    ", ""), r.stderr


# --- outputs --------------------------------------------------------------------------------------------

def test_json_dash_is_stdout_and_the_table_goes_to_stderr(llama_dir):
    r = parity("check", llama_dir, "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["summary"]["verdict"] == "pass" and "PASS" in r.stderr
    assert not (Path.cwd() / "-").exists()


@pytest.mark.parametrize("make_args,words", [
    (lambda d, t: ["--json", d / "config.json"], "input of this run"),
    (lambda d, t: ["--json", t / "r.out", "--junit", t / "r.out"], "given to both"),
    (lambda d, t: ["--json", "/dev/stdout"], "--json - for stdout"),
    (lambda d, t: ["--json", d / "config.json" / "such" / "r.json"], "is a file, not a directory"),
    (lambda d, t: ["--markdown", t], "directory"),
])
def test_bad_outputs_are_refused_before_the_run(llama_dir, tmp_path, make_args, words):
    config = (llama_dir / "config.json").read_bytes()
    r = parity("check", llama_dir, "--candidate", "tests/plugins/misbehave.py:sleeps_forever",
                     *make_args(llama_dir, tmp_path))
    one_line_error(r, words)
    assert (llama_dir / "config.json").read_bytes() == config


def test_a_path_with_a_newline_is_still_one_line(tmp_path):
    r = parity("check", tmp_path / "two\nlines")
    one_line_error(r, "two\\nlines")


def test_a_norm_far_wider_than_its_config_dimension_is_refused(llama_dir):
    _replace_norm(llama_dir, "F32", [4096], b"\0" * 4 * 4096)  # hidden_size is 16
    r = parity("check", llama_dir)
    one_line_error(r, "model.norm.weight", "4096 channels")


# --- a config.json transformers would build without bound (issue 35) ---------------------------------------------

HOSTILE_CONFIGS = [
    ("10^9 layers", {"model_type": "laguna", "num_hidden_layers": 10**9}, "'num_hidden_layers' = 1000000000"),
    ("10^9 layers of another type", {"model_type": "cohere_compass_text", "num_hidden_layers": 10**9},
     "'num_hidden_layers' = 1000000000"),
    ("GPT-Neo's layer kinds repeated 5e8 times", {"model_type": "gpt_neo", "num_layers": 2,
                                                  "attention_types": [[["global", "local"], 500_000_000]]},
     "'attention_types' = 500000000"),
    ("a block of 10^9 layers", {"model_type": "funnel", "block_sizes": [10**9]}, "'block_sizes' = 1000000000"),
    ("70,000 layer kinds", {"model_type": "laguna", "layer_types": ["full_attention"] * 70_000}, "70,000 elements"),
    ("an integer of 2^40", {"model_type": "laguna", "vocab_size": 1 << 40}, "'vocab_size' = 1099511627776"),
]


@pytest.mark.parametrize("label,config,words", HOSTILE_CONFIGS, ids=[c[0] for c in HOSTILE_CONFIGS])
def test_a_config_that_would_build_without_bound_never_reaches_transformers(label, config, words):
    """A config class expands its layer counts into per-layer lists in its own __init__, before any shrink
    (10^9 layers took 8 GB and ran past 60 s): the count is refused from the JSON itself, by the run-time
    derivation and by the validation of a committed family alike."""
    from parity_cli.errors import InputError
    from parity_cli.model.derive import derive
    from parity_cli.model.installed import meta_tree

    for build in (derive, meta_tree):
        with pytest.raises(InputError) as err:
            build(config["model_type"], config, "m/config.json")
        assert str(err.value).startswith("m/config.json: ") and words in str(err.value), (build, err.value)


def test_a_hostile_config_of_a_type_derived_at_run_time_is_one_line(config_of):
    r = parity("inspect", config_of(json.dumps({"model_type": "laguna", "num_hidden_layers": 10**9})))
    one_line_error(r, "config.json", "num_hidden_layers", "layer count over 4,096")


def test_gpt_neo_derives_with_its_layer_kinds_shrunk_alike():
    """GPT-Neo validates len(attention_layers) == num_layers on save: the shrink sets both (it was an
    internal error for every GPT-Neo checkpoint without a family file)."""
    from parity_cli.model.derive import derive

    norms = derive("gpt_neo", {"model_type": "gpt_neo"}, "m/config.json")["norms"]
    assert norms and {n["kind"] for n in norms} == {"layer_norm"}


def test_a_config_nested_past_the_recursion_limit_is_walked_without_recursion():
    """bounded_config walks what the JSON parser accepted, however deep (a recursive walk would raise
    RecursionError, an internal error, on what the parser took): an integer 5,000 levels down is found."""
    from parity_cli.errors import InputError
    from parity_cli.model.derive import bounded_config

    deep: list = [1 << 40]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(InputError, match="'x' = 1099511627776 is an integer over"):
        bounded_config({"model_type": "laguna", "x": deep}, "m/config.json")
    bounded_config({"model_type": "laguna", "x": [[[[1]]]] * 10}, "m/config.json")  # nothing to refuse
