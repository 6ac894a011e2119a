"""Issue 8: a seeded sweep of damaged and hostile checkpoints. Every case that cannot be read is
exit 2 with one line naming the file and no report. A case that stays readable (a flipped byte
inside tensor data, a header flip that only renames) is checked as it is: torch against the oracle
on the very gains the file holds passes, unless a stored norm gain is no longer finite, which fails
that layer as nonfinite_weight and nothing else."""

import json
import math
import os
import random
import shutil
import struct

import pytest

from parity_cli.cli import main
from parity_cli.sources.synthetic import write_checkpoint

SEED = 20261129


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    single = write_checkpoint(root / "single", "llama", layers=1, hidden=16, heads=2, eps=1e-5, seed=3)
    sharded = write_checkpoint(root / "sharded", "llama", layers=1, hidden=16, heads=2, eps=1e-5, seed=3, shards=2)
    return single, sharded


def run(path, tmp_path, capsys):
    out = tmp_path / "report.json"
    if out.exists():
        out.unlink()
    try:
        main(["check", str(path), "--json", str(out), "-q", "--strata", "zero,tiny,normal"])
        code = 0
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    return code, err, out


def expect_input_error(code, err, out, name, tmp_path):
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity: error: "), err
    assert name in lines[0], (name, err)
    assert "internal error" not in err and "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".report")]


def _nonfinite_norms(d) -> set:
    """The norm gains of the damaged file that are no longer finite, read with safetensors itself
    (empty where it cannot read the file: nothing there says a gain broke)."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            return {k.removesuffix(".weight") for k in f.keys()
                    if k.endswith("norm.weight") and not bool(torch.isfinite(f.get_tensor(k).float()).all())}
    except Exception:
        return set()


def expect_verdict(code, err, out, d):
    assert "internal error" not in err and "Traceback" not in err, err
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and not out.exists(), err
        return
    assert out.exists(), (code, err)
    report = json.loads(out.read_text())
    failing = {layer["name"]: {f["code"] for f in layer["findings"]} for layer in report["layers"]
               if layer["status"] != "pass"}
    broken = _nonfinite_norms(d)
    assert code == (1 if broken else 0), (code, failing, broken)
    assert set(failing) == broken and all(codes == {"nonfinite_weight"} for codes in failing.values()), failing


def _header_len(path):
    with open(path, "rb") as fh:
        return struct.unpack("<Q", fh.read(8))[0]


def _copy(src, dst):
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _cases():
    """(id, kind, mutation) with kind 'strict' (must be exit 2) or 'lenient' (may stay readable)."""
    rng = random.Random(SEED)
    cases = []

    def add(kind, fn):
        cases.append((f"{len(cases):03d}-{fn.__name__}", kind, fn))

    # truncation anywhere: the header's claims no longer fit the file
    for _ in range(80):
        frac = rng.random()

        def truncate(d, frac=frac):
            p = d / "model.safetensors"
            size = p.stat().st_size
            cut = max(0, min(size - 1, int(size * frac)))
            with open(p, "r+b") as fh:
                fh.truncate(cut)
            return "model.safetensors"
        add("strict", truncate)
    # flipped bytes in the header JSON (usually unreadable, sometimes a harmless rename), and in
    # tensor data (stays readable)
    for region, count in (("header", 70), ("data", 60)):
        for _ in range(count):
            seed = rng.randrange(1 << 30)

            def flip(d, seed=seed, region=region):
                p = d / "model.safetensors"
                n = _header_len(p)
                r = random.Random(seed)
                data = bytearray(p.read_bytes())
                i = 8 + r.randrange(n) if region == "header" else 8 + n + r.randrange(len(data) - 8 - n)
                data[i] ^= 1 << r.randrange(8)
                p.write_bytes(bytes(data))
                return "model.safetensors"
            flip.__name__ = f"flip_{region}"
            add("lenient", flip)
    # header length field beyond the file, or huge (refused before reading)
    for value in [10**6, 2**31, 2**40, 2**63, 100 * 1024 * 1024 + 1, 0] + [rng.randrange(10**4, 10**9) for _ in range(9)]:
        def big_length(d, value=value):
            p = d / "model.safetensors"
            data = bytearray(p.read_bytes())
            data[:8] = struct.pack("<Q", value)
            p.write_bytes(bytes(data))
            return "model.safetensors"
        add("strict", big_length)
    # header JSON replaced: garbage, not an object, wrong entries
    bad_headers = [b"\xff\xfe" * 10, b"[1, 2, 3]", b'"text"', b"null", b"{", b"{}garbage"]
    entry_faults = [
        {"dtype": 5}, {"shape": "16"}, {"shape": [-1]}, {"data_offsets": [10, 2]}, {"data_offsets": [0, 10**12]},
        {"data_offsets": "0,32"}, {"data_offsets": [0]}, {"shape": [17]}, {"shape": [4, 4, 4]}, {"dtype": "F32"},
        {"data_offsets": [-4, 28]}, {"shape": [1.5]}, {"data_offsets": [0, 31]},
    ]
    for raw in bad_headers:
        def garbage(d, raw=raw):
            p = d / "model.safetensors"
            n = _header_len(p)
            data = bytearray(p.read_bytes())
            body = raw.ljust(n, b" ")[:n]
            data[8:8 + n] = body
            p.write_bytes(bytes(data))
            return "model.safetensors"
        add("strict", garbage)
    for k in range(len(entry_faults) * 3):
        fault = entry_faults[k % len(entry_faults)]
        which = k // len(entry_faults)  # 0: a norm tensor, 1: the final norm, 2: a projection

        def bad_entry(d, fault=fault, which=which):
            p = d / "model.safetensors"
            n = _header_len(p)
            raw = p.read_bytes()
            header = json.loads(raw[8:8 + n])
            name = ["model.layers.0.input_layernorm.weight", "model.norm.weight",
                    "model.layers.0.self_attn.q_proj.weight"][which]
            header[name] = {**header[name], **fault}
            body = json.dumps(header).encode()
            p.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
            return "model.safetensors"
        add("strict", bad_entry)
    # config.json: not JSON, not an object, bad eps, bad model_type
    for text in ["{", "not json", "\xff", "[]", "42", '"llama"', "null", '{"model_type": 7}', '{"model_type": null}',
                 '{"model_type": ["llama"]}', '{"model_type": "llama_v9"}']:
        def bad_config(d, text=text):
            (d / "config.json").write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff\xfe")
            return "config.json"
        add("strict", bad_config)
    for eps in [-1e-5, 0, 0.0, float("nan"), float("inf"), "1e-5", "abc", True, None if False else [1e-5],
                {"v": 1}, -0.0, 1e400, -float("inf"), ""]:
        def bad_eps(d, eps=eps):
            cfg = json.loads((d / "config.json").read_text())
            cfg["rms_norm_eps"] = eps
            (d / "config.json").write_text(json.dumps(cfg, allow_nan=True))
            return "rms_norm_eps"
        add("strict", bad_eps)
    return cases


def _index_cases():
    cases = []

    def add(kind, fn):
        cases.append((f"idx{len(cases):03d}-{fn.__name__}", kind, fn))

    def rewrite(d, edit):
        idx = d / "model.safetensors.index.json"
        data = json.loads(idx.read_text())
        edit(data)
        idx.write_text(json.dumps(data))
        return "model.safetensors.index.json"

    targets = ["missing-00001.safetensors", "../outside.safetensors", "/etc/passwd", "/tmp/x.safetensors",
               "sub/../../x.safetensors", "..", "", "./../model-00001-of-00002.safetensors"]
    for k in range(len(targets) * 4):
        target = targets[k % len(targets)]
        tensor = ["model.norm.weight", "model.layers.0.input_layernorm.weight",
                  "model.layers.0.post_attention_layernorm.weight", "model.embed_tokens.weight"][k // len(targets)]

        def bad_shard(d, target=target, tensor=tensor):
            return rewrite(d, lambda data: data["weight_map"].__setitem__(tensor, target))
        add("strict", bad_shard)
    for value in [[], "x", 5, None, {"a": 5}, {"a": None}]:
        def bad_map(d, value=value):
            return rewrite(d, lambda data: data.__setitem__("weight_map", value))
        add("strict", bad_map)
    for text in ["{", "[]", "\x00\x01"]:
        def bad_index(d, text=text):
            (d / "model.safetensors.index.json").write_text(text)
            return "model.safetensors.index.json"
        add("strict", bad_index)

    def symlinked_shard(d):
        outside = d.parent / f"{d.name}-outside.safetensors"
        shard = next(d.glob("model-00001-*.safetensors"))
        shutil.copy(shard, outside)
        shard.unlink()
        shard.symlink_to(outside)
        return shard.name
    add("strict", symlinked_shard)

    def symlinked_config(d):
        outside = d.parent / f"{d.name}-config.json"
        shutil.copy(d / "config.json", outside)
        (d / "config.json").unlink()
        (d / "config.json").symlink_to(outside)
        return "config.json"
    add("strict", symlinked_config)
    return cases


CASES = _cases()
INDEX_CASES = _index_cases()


def test_the_sweep_is_at_least_300_cases():
    assert len(CASES) + len(INDEX_CASES) >= 300


# single-file cases run on the one-file checkpoint, index cases on the sharded one (base[1])
ALL_CASES = [(0, *c) for c in CASES] + [(1, *c) for c in INDEX_CASES]


@pytest.mark.parametrize("case", ALL_CASES, ids=[c[1] for c in ALL_CASES])
def test_corrupted_checkpoint(base, tmp_path, capsys, case):
    which, _, kind, mutate = case
    d = _copy(base[which], tmp_path / "ckpt")
    name = mutate(d)
    code, err, out = run(d, tmp_path, capsys)
    if kind == "strict":
        expect_input_error(code, err, out, name, tmp_path)
    else:
        expect_verdict(code, err, out, d)


def test_pickle_checkpoints_are_refused_without_unpickling(tmp_path, capsys, monkeypatch):
    import pickle

    d = tmp_path / "pkl"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "rms_norm_eps": 1e-5}))
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"x": 1}))

    def never(*a, **k):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(pickle, "loads", never)
    code, err, out = run(d, tmp_path, capsys)
    expect_input_error(code, err, out, "pytorch_model.bin", tmp_path)
    assert "safetensors" in err
    code, err, out = run(d / "pytorch_model.bin", tmp_path, capsys)
    expect_input_error(code, err, out, "pytorch_model.bin", tmp_path)


def test_huge_header_is_refused_before_it_is_read(base, tmp_path, capsys, monkeypatch):
    d = _copy(base[0], tmp_path / "ckpt")
    p = d / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[:8] = struct.pack("<Q", 200 * 1024 * 1024)
    p.write_bytes(bytes(data))
    with open(p, "ab") as fh:  # make the file big enough that only the limit can refuse it
        fh.truncate(210 * 1024 * 1024)
    code, err, out = run(d, tmp_path, capsys)
    expect_input_error(code, err, out, "model.safetensors", tmp_path)
    assert os.path.getsize(p) > 200 * 1024 * 1024 and math.isfinite(code)


def test_hf_cache_snapshot_symlinks_into_blobs_are_allowed(base, tmp_path):
    """~/.cache/huggingface/hub/models--x/snapshots/<rev>/ links every file into ../../blobs/."""
    from parity_cli import api

    repo = tmp_path / "models--org--name"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in base[0].iterdir():
        blob = blobs / f"sha-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    assert api.check(snap, candidate="hf").passed
