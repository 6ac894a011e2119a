"""Issue 48, internal errors instead of one line: JSON parity did not write is parsed to a bounded
depth everywhere (a --candidate-arg value, a capture's metadata, a .ranges file of the cache), and a
NUL in a name is refused; each is one line, exit 2 (cache info: the file is not counted)."""

from __future__ import annotations

import json

from tests.conftest import run_parity

DEEP = "[" * 100_000 + "]" * 100_000


def _one_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("parity: error: "), (r.returncode, r.stderr)
    assert "internal error" not in r.stderr
    return lines[0]


def test_a_candidate_arg_nested_past_the_parser_is_one_line(ckpt):
    r = run_parity("check", ckpt("llama", layers=1), "--candidate-arg", f"fused={DEEP}")
    assert "--candidate-arg fused: the value is nested too deeply" in _one_line(r)


def test_a_runtime_capture_with_deep_metadata_is_one_line(ckpt, tmp_path):
    import torch
    from safetensors.torch import save_file

    from parity_cli.probes.runtime_capture import META_KEY

    cap = tmp_path / "cap.safetensors"
    save_file({"x:a": torch.zeros(1, 4)}, str(cap), metadata={META_KEY: DEEP})
    r = run_parity("check", ckpt("llama", layers=1), "--runtime-capture", cap)
    assert "the capture's metadata nests deeper than the JSON parser allows" in _one_line(r)


def test_a_nul_in_a_revision_is_one_line(tmp_path):
    r = run_parity("check", "hf://org/good@a%00b", env={"PARITY_CACHE": str(tmp_path / "c")})
    assert "is not a branch, tag or commit name" in _one_line(r)


def test_cache_info_skips_a_deep_ranges_file(tmp_path):
    blobs = tmp_path / "cache" / "hf" / "host" / "models--a--b" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc.ranges").write_text(DEEP)
    (blobs / "abc").write_bytes(b"")
    (blobs / "def.ranges").write_text(json.dumps({"ranges": [[0, 8]]}))
    (blobs / "def").write_bytes(b"12345678")
    r = run_parity("cache", "info", "--json", env={"PARITY_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bytes_fetched"] == 8  # the readable file alone


def test_cache_info_skips_ranges_files_of_the_wrong_shape(tmp_path):
    blobs = tmp_path / "cache" / "hf" / "host" / "models--a--b" / "blobs"
    blobs.mkdir(parents=True)
    for name, text in (("list", "[1, 2]"), ("huge", '{"ranges": [[0, 1e400]]}')):
        (blobs / f"{name}.ranges").write_text(text)
        (blobs / name).write_bytes(b"")
    for command in ("info", "verify"):
        r = run_parity("cache", command, env={"PARITY_CACHE": str(tmp_path / "cache")})
        assert r.returncode == 0 and "internal error" not in r.stderr, (command, r.stderr)
