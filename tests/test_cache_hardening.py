"""Issue 48: a cache nobody else can redirect. Whoever can write parity's cache (a shared or restored
CI cache) must not choose where parity writes: a link planted inside it is refused in one line and
nothing outside the cache is touched; a cache root another user owns or may write is refused; `cache
clear` removes a planted link, never what it points to."""

from __future__ import annotations

import os

import pytest
from conftest import SLOW

from parity_cli.sources import remote
from tests.test_remote import _check, _repo, env, hub  # noqa: F401  (fixtures)


def _store(tmp_path, env):  # noqa: F811
    """The one cached repository's folder (cache/hf/<host>/models--org--name)."""
    (base,) = (tmp_path / "cache" / "hf").glob("*/models--*")
    return base


def _cached(hub, env, tmp_path, name="acme/linked"):  # noqa: F811
    _, sha = _repo(hub, tmp_path, name, layers=2)
    result, _ = _check(f"hf://{name}@{sha}", tmp_path, env, "first.json")
    assert result.returncode == 0, result.stderr
    remote._OPEN.clear()
    return sha, _store(tmp_path, env)


def _refused(tmp_path, env, target, *words):  # noqa: F811
    result, data = _check(target, tmp_path, env, "bad.json")
    assert result.returncode == 2 and data is None and result.stdout == "", (result.stdout, result.stderr)
    (line,) = result.stderr.splitlines()
    for word in words:
        assert word in line, line
    return line


def test_a_snapshot_folder_linked_outside_the_cache_is_refused(hub, env, tmp_path):  # noqa: F811
    """snapshots/<commit> made a link to an outside folder: parity deleted that folder's config.json and
    wrote its own. Now: one line, and the outside folder as it was."""
    sha, base = _cached(hub, env, tmp_path)
    outside = tmp_path / "victim"
    outside.mkdir()
    (outside / "config.json").write_text("mine")
    snapshot = base / "snapshots" / sha
    import shutil

    shutil.rmtree(snapshot)
    snapshot.symlink_to(outside)
    # the snapshot folder is named as the URL it stands for
    _refused(tmp_path, env, f"hf://acme/linked@{sha}", f"hf://acme/linked@{sha}: a symbolic link inside parity's cache",
             f"(to {outside})")
    assert sorted(p.name for p in outside.iterdir()) == ["config.json"]
    assert (outside / "config.json").read_text() == "mine"


def test_a_blob_linked_to_an_outside_file_is_refused_and_the_file_untouched(hub, env, tmp_path):  # noqa: F811
    """blobs/<sha256> a link to an outside file of the right size: the fetched header was pwritten into it."""
    sha, base = _cached(hub, env, tmp_path)
    blob = max((p for p in (base / "blobs").iterdir() if "." not in p.name), key=lambda p: p.stat().st_size)
    outside = tmp_path / "victim.bin"
    outside.write_bytes(b"\xab" * blob.stat().st_size)
    blob.unlink()
    blob.with_name(blob.name + ".ranges").unlink(missing_ok=True)
    blob.symlink_to(outside)
    _refused(tmp_path, env, f"hf://acme/linked@{sha}", "a symbolic link inside parity's cache")
    assert outside.read_bytes() == b"\xab" * outside.stat().st_size


def test_a_dangling_blob_link_creates_nothing_outside_the_cache(hub, env, tmp_path):  # noqa: F811
    sha, base = _cached(hub, env, tmp_path)
    blob = next(p for p in (base / "blobs").iterdir() if "." not in p.name)
    blob.unlink()
    blob.with_name(blob.name + ".ranges").unlink(missing_ok=True)
    target = tmp_path / "elsewhere" / "made.bin"
    (tmp_path / "elsewhere").mkdir()
    blob.symlink_to(target)
    _refused(tmp_path, env, f"hf://acme/linked@{sha}", "a symbolic link inside parity's cache")
    assert not os.path.lexists(target)


def test_a_cache_root_others_may_write_is_refused(hub, env, tmp_path):  # noqa: F811
    _, sha = _repo(hub, tmp_path, "acme/shared", layers=2)
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    _refused(tmp_path, env, f"hf://acme/shared@{sha}", str(root), "may be written by others", "chmod go-w")
    assert list(root.iterdir()) == []
    os.chmod(root, 0o770)
    _refused(tmp_path, env, f"hf://acme/shared@{sha}", "may be written by its group")
    os.chmod(root, 0o700)
    result, _ = _check(f"hf://acme/shared@{sha}", tmp_path, env, "ok.json")
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_root_another_user_owns_is_refused(hub, env, tmp_path):  # noqa: F811
    _, sha = _repo(hub, tmp_path, "acme/theirs", layers=2)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    _refused(tmp_path, env, f"hf://acme/theirs@{sha}", "belongs to uid 12345", "not this user")


def test_a_new_cache_root_is_private(hub, env, tmp_path):  # noqa: F811
    _, sha = _repo(hub, tmp_path, "acme/private", layers=2)
    result, _ = _check(f"hf://acme/private@{sha}", tmp_path, env, "ok.json")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def test_cache_clear_removes_a_planted_store_link_not_its_target(tmp_path):
    """`parity cache clear` where $PARITY_CACHE/hf is a link: OSError 'Cannot call rmtree on a symbolic
    link'. Now the link goes and the folder it named stays."""
    from tests.conftest import run_parity

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    outside = tmp_path / "keep"
    outside.mkdir()
    (outside / "data").write_text("mine")
    (root / "hf").symlink_to(outside)
    r = run_parity("cache", "clear", env={"PARITY_CACHE": str(root)})
    assert r.returncode == 0, r.stderr
    assert not os.path.lexists(root / "hf") and (outside / "data").read_text() == "mine"


# --- bytes that are not what the Hub served --------------------------------------------------------

def _norm_range(directory, name="model.norm.weight"):
    """(shard file name, offset, nbytes) of a tensor in a local safetensors checkpoint, read from its header."""
    import json
    import struct

    for shard in sorted(directory.glob("*.safetensors")):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        if name in header:
            a, b = header[name]["data_offsets"]
            return shard, 8 + n + a, b - a
    raise AssertionError(name)


def _fresh(target, tmp_path, env, out):  # noqa: F811
    """A check in a process of its own, as every real run is (this one's reader keeps what it read)."""
    import json

    from tests.conftest import run_parity

    r = run_parity("check", target, "--json", tmp_path / out, "-q", env=env, process=True)
    return r, (json.loads((tmp_path / out).read_text()) if (tmp_path / out).exists() else None)


def _cached_blob(base, size):
    (blob,) = [p for p in (base / "blobs").iterdir() if "." not in p.name and p.stat().st_size == size]
    return blob


@SLOW
def test_a_poisoned_blob_is_fetched_again_never_judged(hub, env, tmp_path):  # noqa: F811
    """The cached blob of hf://org/good@<sha> with model.norm.weight rewritten (NaN) and its claim left in
    .ranges: the bytes differ from the digest recorded when they were fetched, so they are fetched
    again, said in one warning line, and the check is the clean one (it read NaN and failed)."""
    import json

    directory, sha = _repo(hub, tmp_path, "acme/good", layers=2)
    local, local_data = _check(directory, tmp_path, env, "local.json")
    first, _ = _check(f"hf://acme/good@{sha}", tmp_path, env, "first.json")
    assert local.returncode == first.returncode == 0, first.stderr
    remote._OPEN.clear()
    shard, offset, nbytes = _norm_range(directory)
    blob = _cached_blob(_store(tmp_path, env), shard.stat().st_size)
    with open(blob, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\xff" * nbytes)  # float NaN, all of it
    result, data = _fresh(f"hf://acme/good@{sha}", tmp_path, env, "again.json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cached range(s) differ from what was fetched (a changed or planted cache file); fetched again" in \
        result.stderr
    (layer,) = [l for l in data["layers"] if l["name"] == "model.norm"]
    (want,) = [l for l in local_data["layers"] if l["name"] == "model.norm"]
    assert layer["weight"] == want["weight"]
    with open(blob, "rb") as fh:
        fh.seek(offset)
        assert fh.read(nbytes) == shard.read_bytes()[offset:offset + nbytes]  # the cache holds the Hub's bytes again
    assert json.loads(blob.with_name(blob.name + ".ranges").read_text())["digests"]


def test_a_claim_without_a_digest_is_not_believed(hub, env, tmp_path):  # noqa: F811
    """A .ranges that claims the whole of a blob of zeros is filled (gains read as 0): no digest covers
    the claim, so the ranges are fetched; the report's gains are the served file's."""
    import json

    directory, sha = _repo(hub, tmp_path, "acme/claimed", layers=2)
    local, local_data = _check(directory, tmp_path, env, "local.json")
    assert _check(f"hf://acme/claimed@{sha}", tmp_path, env, "first.json")[0].returncode == 0
    remote._OPEN.clear()
    shard, _, _ = _norm_range(directory)
    blob = _cached_blob(_store(tmp_path, env), shard.stat().st_size)
    size = blob.stat().st_size
    blob.write_bytes(bytes(size))
    blob.with_name(blob.name + ".ranges").write_text(json.dumps({"etag": "x", "size": size, "ranges": [[0, size]]}))
    result, data = _fresh(f"hf://acme/claimed@{sha}", tmp_path, env, "again.json")
    assert result.returncode == 0, result.stderr
    assert [l["weight"] for l in data["layers"]] == [l["weight"] for l in local_data["layers"]]


def test_cache_verify_drops_a_poisoned_range_and_then_finds_none(hub, env, tmp_path):  # noqa: F811
    from tests.conftest import run_parity

    directory, sha = _repo(hub, tmp_path, "acme/verified", layers=2)
    assert _check(f"hf://acme/verified@{sha}", tmp_path, env, "first.json")[0].returncode == 0
    remote._OPEN.clear()
    clean = run_parity("cache", "verify", env=env)
    assert clean.returncode == 0 and clean.stdout.strip().endswith(", 0 dropped"), clean.stdout + clean.stderr
    shard, offset, nbytes = _norm_range(directory)
    blob = _cached_blob(_store(tmp_path, env), shard.stat().st_size)
    with open(blob, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\x00" * nbytes)
    r = run_parity("cache", "verify", env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].endswith(f"{blob.name}: 1 range(s) differ from what was fetched; dropped, fetched again when "
                             "next read") and lines[-1].endswith(", 1 dropped")
    again = run_parity("cache", "verify", env=env)
    assert again.returncode == 0 and again.stdout.strip().endswith(", 0 dropped")


def test_a_read_partly_cached_checks_the_cached_part_too(tmp_path, monkeypatch):
    """Review of issue 48: where part of a read was cached and part missing, only the gap was fetched and
    the cached part was read unchecked. A poisoned cached range is now fetched again with the gap."""
    import hashlib

    from parity_cli.sources.stores import FileMeta

    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache"))
    root = remote.guarded_root()
    served = bytes(range(256)) * 4  # the file as the server has it
    blob = root / "hf" / "host" / "models--a--b" / "blobs" / "f"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(bytes(len(served)))
    asked = []

    def fetch(a, b):
        asked.append((a, b))
        return served[a:b]

    class Mirror:
        def progress(self):
            pass

        def label(self, name):
            return f"hf://a/b/{name}"

    held = remote.Blob(blob, "f", FileMeta(len(served), hashlib.sha256(served).hexdigest()), fetch, Mirror())
    held.ensure(0, 100)
    assert asked == [(0, 100)] and blob.read_bytes()[:100] == served[:100]
    with open(blob, "r+b") as fh:  # the cached range poisoned
        fh.write(b"\xff" * 100)
    again = remote.Blob(blob, "f", held.meta, fetch, Mirror())  # another process: nothing checked yet
    asked.clear()
    again.ensure(0, 200)
    assert asked == [(0, 200)]  # the poisoned range is a gap again, fetched with the one that was missing
    assert blob.read_bytes()[:200] == served[:200]


def test_an_offline_ref_that_is_not_a_sha_is_refused(hub, env, tmp_path):  # noqa: F811
    """refs/<branch> is read from the cache when offline: a planted `../../x` would make the snapshot a
    folder outside the cache. Only a commit sha is taken."""
    _repo(hub, tmp_path, "acme/reffed", layers=2)
    assert _check("hf://acme/reffed", tmp_path, env, "first.json")[0].returncode == 0
    remote._OPEN.clear()
    ref = _store(tmp_path, env) / "refs" / "main"
    ref.write_text("../../../../outside")
    line = _refused(tmp_path, {**env, "HF_HUB_OFFLINE": "1"}, "hf://acme/reffed", "not a commit sha")
    assert not (tmp_path / "outside").exists(), line


def test_a_ranges_file_of_overlapping_claims_costs_no_hashing(tmp_path, monkeypatch):
    """A planted .ranges claiming [0, size), [0, size - 1), ... with digests: each claim would cost a hash
    of the whole blob before a read. Claims over twice the file's bytes are no file parity wrote: none
    is believed, the read is fetched."""
    import hashlib
    import json

    from parity_cli.sources.stores import FileMeta

    monkeypatch.setenv("PARITY_CACHE", str(tmp_path / "cache"))
    root = remote.guarded_root()
    served = bytes(range(256)) * 16
    blob = root / "hf" / "host" / "models--a--b" / "blobs" / "f"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(bytes(len(served)))
    fake = hashlib.sha256(b"").hexdigest()
    blob.with_name("f.ranges").write_text(json.dumps({"digests": [[0, len(served) - k, fake] for k in range(64)]}))
    hashed = []
    real = remote.Blob._intact
    monkeypatch.setattr(remote.Blob, "_intact", lambda self, a, b: hashed.append((a, b)) or real(self, a, b))
    asked = []

    class Mirror:
        def progress(self):
            pass

        def label(self, name):
            return name

    held = remote.Blob(blob, "f", FileMeta(len(served), "x"), lambda a, b: asked.append((a, b)) or served[a:b],
                       Mirror())
    held.ensure(0, 64)
    assert hashed == [] and asked == [(0, 64)] and blob.read_bytes()[:64] == served[:64]
