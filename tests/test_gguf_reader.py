"""Issue 14 (part): the bounded GGUF reader. Differential against gguf-py's own GGUFReader on
files gguf-py writes, and hostile files that only *declare* huge things."""

import random
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package")

from conftest import run_bounded  # noqa: E402

from parity_cli.sources.gguf_reader import Array, read_gguf  # noqa: E402
from parity_cli.sources.synthetic import hf_to_gguf, write_checkpoint  # noqa: E402


def _theirs(path):
    """Scalars and strings as gguf-py reads them; arrays as (item type, length)."""
    reader = gguf.GGUFReader(str(path), "r")
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = f.types[0].name
        if kind == "ARRAY":
            meta[key] = ("array", int(f.types[1]) if len(f.types) > 1 else None, len(f.data))
        elif kind == "STRING":
            meta[key] = bytes(f.parts[f.data[0]]).decode()
        else:
            meta[key] = f.parts[f.data[0]][0].item()
    tensors = {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type), np.asarray(t.data).tobytes())
               for t in reader.tensors}
    return meta, tensors


def _ours(path):
    from parity_cli.sources.gguf_reader import PLAIN, read_tensor

    gf = read_gguf(path)
    meta = {k: (("array", v.item_type, v.count) if isinstance(v, Array) else v) for k, v in gf.metadata.items()}
    tensors = {}
    for t in gf.tensors:
        data = read_tensor(gf, t).numpy().tobytes() if t.type_code in PLAIN and t.type_code != 30 else None
        tensors[t.name] = (t.shape, t.type_code, data)
    return meta, tensors


@pytest.mark.parametrize("model_type", ["llama", "gemma3"])
def test_the_reader_agrees_with_gguf_py(tmp_path, model_type):
    hf = write_checkpoint(tmp_path / "hf", model_type, layers=2, eps=1e-6)
    path = hf_to_gguf(hf, tmp_path / "m.gguf")
    meta_t, tensors_t = _theirs(path)
    meta_o, tensors_o = _ours(path)
    assert set(meta_o) == set(meta_t)
    for key, value in meta_t.items():
        if isinstance(value, float):
            assert meta_o[key] == pytest.approx(value, rel=0, abs=0), key  # the same float32, exactly
        elif isinstance(value, tuple):
            assert meta_o[key][2] == value[2], key  # arrays: the same length, never read
        else:
            assert meta_o[key] == value, key
    assert set(tensors_o) == set(tensors_t)
    for name, (shape, code, data) in tensors_o.items():
        assert (shape, code) == tensors_t[name][:2], name
        if data is not None:
            assert data == tensors_t[name][2], name


def _gguf_bytes(kv: bytes, n_kv: int, tensors: bytes = b"", n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + tensors


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


parity = run_bounded


@pytest.mark.parametrize("label,blob", [
    ("array of 2^40 bytes", _gguf_bytes(_key("general.architecture") + struct.pack("<I", 9) + struct.pack("<IQ", 0, 1 << 40), 1)),
    ("array of 2^40 strings", _gguf_bytes(_key("x") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 1 << 40), 1)),
    ("2^60 metadata entries", _gguf_bytes(b"", 1 << 60)),
    ("a 2^50-byte string", _gguf_bytes(_key("x") + struct.pack("<IQ", 8, 1 << 50), 1)),
    ("2^40 tensors", _gguf_bytes(b"", 0, b"", 1 << 40)),
    ("a tensor of rank 1000", _gguf_bytes(b"", 0, _key("t") + struct.pack("<I", 1000), 1)),
    ("unknown value type", _gguf_bytes(_key("x") + struct.pack("<I", 77), 1)),
])
def test_what_a_gguf_declares_is_checked_first(tmp_path, label, blob):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(blob)
    r = parity("inspect", path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (label, r.stderr)
    assert str(path) in r.stderr and "internal error" not in r.stderr, (label, r.stderr)


def _writer(path, eps_kind="float", block_count=1, misalign=False):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(4)
    if eps_kind == "float":
        w.add_layer_norm_rms_eps(1e-5)
    elif eps_kind == "string":
        w.add_string("llama.attention.layer_norm_rms_epsilon", "1e-5")
    else:
        w.add_array("llama.attention.layer_norm_rms_epsilon", [1e-5])
    w.add_tensor("output_norm.weight", np.array([1.0, 2.0, 0.5, 0.25], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("eps_kind", ["string", "array"])
def test_eps_of_the_wrong_type_is_one_line(tmp_path, eps_kind):
    r = parity("inspect", _writer(tmp_path / "e.gguf", eps_kind))
    assert r.returncode == 2 and "layer_norm_rms_epsilon" in r.stderr and "not a number" in r.stderr, r.stderr


def test_a_huge_declared_block_count_costs_nothing(tmp_path):
    """The name map is built for the blocks the file holds (none here), not the 10^7 it claims."""
    r = parity("inspect", _writer(tmp_path / "b.gguf", block_count=10**7))
    assert r.returncode == 0, r.stderr


def test_the_name_map_is_built_for_the_blocks_present(tmp_path, monkeypatch):
    """The work bound behind the test above: gguf-py's name map is asked for the blocks the tensors
    hold (one, here), never the 10^7 the metadata declares (each block is a few hundred names)."""
    from parity_cli import api

    asked = []
    real = gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda arch, blocks: asked.append(blocks) or real(arch, blocks))
    api.inspect(_writer(tmp_path / "b.gguf", block_count=10**7))
    assert asked == [1]


def test_a_block_index_far_beyond_the_tensors_is_refused_at_once(tmp_path):
    """blk.5000000 in a one-tensor file would have the name map built for 5e6 blocks (minutes)."""
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("blk.5000000.attn_norm.weight", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = parity("inspect", tmp_path / "k.gguf")
    assert r.returncode == 2 and "block 5000000" in r.stderr, r.stderr


def test_an_unaligned_tensor_offset_is_refused(tmp_path):
    path = _writer(tmp_path / "u.gguf")
    data = bytearray(path.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4 + 8 + 4  # rank, one dim, type: then the offset
    struct.pack_into("<Q", data, at, 3)
    path.write_bytes(bytes(data))
    r = parity("inspect", path)
    assert r.returncode == 2 and "alignment" in r.stderr, r.stderr


SEED = 20261130


def test_gguf_bit_flip_sweep(tmp_path):
    """Seeded byte flips in the header, metadata and tensor infos of a real small GGUF: each
    run ends 0, 1 or 2 with one line, never an internal error."""
    hf = write_checkpoint(tmp_path / "hf", "llama", layers=1, hidden=16, heads=2, eps=1e-5)
    good = hf_to_gguf(hf, tmp_path / "good.gguf").read_bytes()
    gf = read_gguf(tmp_path / "good.gguf")
    end_of_infos = min(t.offset for t in gf.tensors)
    rng = random.Random(SEED)
    for k in range(12):
        data = bytearray(good)
        at = rng.randrange(4, end_of_infos)
        data[at] ^= 1 << rng.randrange(8)
        path = tmp_path / f"flip{k}.gguf"
        path.write_bytes(bytes(data))
        r = parity("inspect", path)
        # weak-ok: a fuzz of a file's bytes; a flip may leave it readable (0) or make it refused (2), both checked below
        assert r.returncode in (0, 2), (at, r.stderr)
        assert "internal error" not in r.stderr and "Traceback" not in r.stderr, (at, r.stderr)
        if r.returncode == 2:
            assert len(r.stderr.strip().splitlines()) == 1, (at, r.stderr)
