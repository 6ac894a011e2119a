"""Checkpoints read where they live (issue 39): a local server speaking the Hub's file API
(tests/hub_server.py, reached through HF_ENDPOINT) and a local S3 (tests/s3_server.py), every
byte they send counted. Expected values come from the served files themselves (their sizes,
their sha256, a local check of the same directory), never from parity's own remote code."""

from __future__ import annotations

import hashlib
import json
import re
import struct

import pytest
from conftest import SLOW

from parity_cli.sources import remote
from parity_cli.sources.synthetic import write_checkpoint, write_sparse_llama
from tests.conftest import run_parity
from tests.hub_server import HubServer

# what may differ between a remote report and the local one: where the checkpoint was read from
WHERE = ("path", "source")


@pytest.fixture(scope="module")
def hub():
    with HubServer() as server:
        yield server


@pytest.fixture
def env(hub, tmp_path):
    hub.reset_counts()
    hub.ignore_range, hub.require_token, hub.gated, hub.delay, hub.fail_times = False, None, set(), 0.0, 0
    hub.etag_override, hub.lfs_redirect, hub.redirect_to, hub.cdn_saw_authorization = {}, True, None, False
    return {"HF_ENDPOINT": hub.url, "PARITY_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"),
            "HF_TOKEN": "", "HF_HUB_OFFLINE": "", "PARITY_HTTP_TIMEOUT": "2", "PARITY_HTTP_RETRIES": "1",
            "PARITY_HTTP_BACKOFF": "0.01"}


def _repo(hub, tmp_path, name, **kwargs):
    directory = write_checkpoint(tmp_path / name.replace("/", "_"), **kwargs)
    return directory, hub.add_repo(name, directory)


def _check(target, tmp_path, env, out="r.json", *extra):
    result = run_parity("check", target, "--json", tmp_path / out, "-q", *extra, env=env)
    data = json.loads((tmp_path / out).read_text()) if (tmp_path / out).exists() else None
    return result, data


def _same_report(local: dict, remote_: dict) -> None:
    for key in local:
        if key == "checkpoint":
            assert {k: v for k, v in local[key].items() if k not in WHERE} == \
                   {k: v for k, v in remote_[key].items() if k not in WHERE}
        elif key != "environment":
            assert local[key] == remote_[key], key


def test_hub_check_is_the_local_check_and_records_the_commit_and_etags(hub, env, tmp_path):
    directory, sha = _repo(hub, tmp_path, "acme/tiny-llama", layers=3, shards=2, hidden=64)
    local, local_data = _check(directory, tmp_path, env, "local.json")
    result, data = _check("hf://acme/tiny-llama", tmp_path, env)
    assert result.returncode == local.returncode == 0, result.stderr
    _same_report(local_data, data)
    source = data["checkpoint"]["source"]
    assert data["checkpoint"]["path"] == f"hf://acme/tiny-llama@{sha}"
    assert (source["repo"], source["revision"], source["commit"]) == ("acme/tiny-llama", "main", sha)
    shards = sorted(p.name for p in directory.glob("*.safetensors"))
    assert sorted(source["files"]) == sorted(["config.json", "model.safetensors.index.json", *shards])
    for name in shards:  # an LFS file's ETag is its content's sha256
        assert source["files"][name] == {"size": (directory / name).stat().st_size,
                                         "etag": hashlib.sha256((directory / name).read_bytes()).hexdigest()}
    git_blob = (directory / "config.json").read_bytes()
    assert source["files"]["config.json"]["etag"] == \
        hashlib.sha1(b"blob %d\0" % len(git_blob) + git_blob).hexdigest()
    # what parity counts is what the server sent: the files' bytes, and the API's JSON besides
    assert source["bytes_fetched"] >= hub.body_bytes > 0


@SLOW
def test_the_405b_layout_is_checked_from_under_a_hundredth_of_its_bytes(hub, env, tmp_path):
    """Llama 3.1 405B's layout (191 shards, 812 GB, sparse here): the same verdict and layers as
    the local check, after fetching headers and gains only; a rerun at the commit reads nothing."""
    directory = tmp_path / "405b"
    write_sparse_llama(directory)
    sha = hub.add_repo("meta-llama/Llama-3.1-405B", directory)
    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    assert total > 800e9
    strata = ("--strata", "zero,normal")  # 253 layers 16384 wide: two strata say the same of the bytes read
    local, local_data = _check(directory, tmp_path, env, "local.json", *strata)
    hub.reset_counts()
    result, data = _check("hf://meta-llama/Llama-3.1-405B", tmp_path, env, "r.json", *strata)
    assert result.returncode == local.returncode == 0, result.stderr
    _same_report(local_data, data)
    assert len(data["layers"]) == 2 * 126 + 1
    assert hub.body_bytes < total / 100
    # what has to be read: the config, the index, each gain (2 bytes a channel) and each shard's
    # header, which comes with the first 64 KiB of its shard (one request, not two)
    small = sum((directory / n).stat().st_size for n in ("config.json", "model.safetensors.index.json"))
    gains, shards = 253 * 16384 * 2, len(list(directory.glob("*.safetensors")))
    assert gains + small <= hub.body_bytes <= gains + small + shards * (64 << 10)
    assert data["checkpoint"]["source"]["bytes_total"] == total + small
    # a rerun pinned at the commit, in a fresh process's state: nothing from the network
    remote._OPEN.clear()
    hub.reset_counts()
    result, again = _check(f"hf://meta-llama/Llama-3.1-405B@{sha}", tmp_path, env, "again.json", *strata)
    assert result.returncode == 0 and hub.requests == [] and hub.body_bytes == 0
    assert again["checkpoint"]["source"]["bytes_fetched"] == 0
    _same_report(local_data, again)


def test_a_branch_rerun_asks_only_which_commit(hub, env, tmp_path):
    _repo(hub, tmp_path, "acme/branchy", layers=2)
    assert _check("hf://acme/branchy", tmp_path, env)[0].returncode == 0
    remote._OPEN.clear()
    hub.reset_counts()
    assert _check("hf://acme/branchy", tmp_path, env)[0].returncode == 0
    assert [r[1].split("?")[0] for r in hub.requests] == ["/api/models/acme/branchy/revision/main"]
    assert hub.body_bytes == 0
    remote._OPEN.clear()
    hub.reset_counts()
    assert _check("hf://acme/branchy", tmp_path, {**env, "HF_HUB_OFFLINE": "1"})[0].returncode == 0
    assert hub.requests == []


def test_inspect_and_a_candidate_checkpoint_read_remotely(hub, env, tmp_path):
    directory, sha = _repo(hub, tmp_path, "acme/copy", layers=2, eps=1e-6)
    _repo(hub, tmp_path, "acme/orig", layers=2, eps=1e-5)
    result = run_parity("inspect", "hf://acme/copy", "--json", tmp_path / "i.json", env=env)
    assert result.returncode == 0, result.stderr
    info = json.loads((tmp_path / "i.json").read_text())
    assert info["eps"]["value"] == 1e-6 and info["checkpoint"]["source"]["commit"] == sha
    # the copy's eps 1e-6 against the original's 1e-5: the copy is wrong, and says so
    result, data = _check("hf://acme/orig", tmp_path, env, "c.json", "--candidate-checkpoint", "hf://acme/copy")
    assert result.returncode == 1, result.stderr
    assert data["candidate"]["checkpoint"]["path"] == f"hf://acme/copy@{sha}"
    assert data["candidate"]["checkpoint"]["source"]["repo"] == "acme/copy"


def test_a_gguf_in_a_repository(hub, env, tmp_path):
    pytest.importorskip("gguf")
    from parity_cli.sources.synthetic import hf_to_gguf

    directory = write_checkpoint(tmp_path / "g", layers=2, hidden=64, dtype="float32")
    gguf_dir = tmp_path / "gguf_repo"
    gguf_dir.mkdir()
    hf_to_gguf(directory, gguf_dir / "tiny-F32.gguf")
    sha = hub.add_repo("acme/tiny-gguf", gguf_dir)
    local, local_data = _check(gguf_dir / "tiny-F32.gguf", tmp_path, env, "local.json")
    result, data = _check("hf://acme/tiny-gguf/tiny-F32.gguf", tmp_path, env)
    assert result.returncode == local.returncode == 0, result.stderr
    _same_report(local_data, data)
    assert data["checkpoint"]["path"] == f"hf://acme/tiny-gguf@{sha}/tiny-F32.gguf"
    # a folder of .gguf files is not a checkpoint: the file has to be named
    result, _ = _check("hf://acme/tiny-gguf", tmp_path, env, "x.json")
    assert result.returncode == 2 and "tiny-F32.gguf" in result.stderr


def test_a_rerun_after_clearing_the_cache_fetches_again(hub, env, tmp_path):
    _repo(hub, tmp_path, "acme/cached", layers=2)
    assert _check("hf://acme/cached", tmp_path, env)[0].returncode == 0
    info = run_parity("cache", "info", "--json", env=env)
    data = json.loads(info.stdout)
    assert data["path"] == env["PARITY_CACHE"] and data["bytes_fetched"] > 0
    assert [s["store"].split("/")[-1] for s in data["stores"]] == ["models--acme--cached"]
    cleared = run_parity("cache", "clear", env=env)
    assert cleared.returncode == 0 and not any((tmp_path / "cache").iterdir())
    remote._OPEN.clear()
    hub.reset_counts()
    assert _check("hf://acme/cached", tmp_path, env)[0].returncode == 0 and hub.body_bytes > 0


# -- bad input, each one line and exit 2, no report ------------------------------------------------

def _refused(target, tmp_path, env, *words, extra=()):
    result, data = _check(target, tmp_path, env, "bad.json", *extra)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert data is None and result.stdout == ""
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    for word in words:
        assert word in line, line
    return line


def test_unknown_repo_private_repo_gated_repo_and_unknown_revision(hub, env, tmp_path):
    _refused("hf://acme/nothing-here", tmp_path, env, "hf://acme/nothing-here", "not found", "hf auth login")
    _repo(hub, tmp_path, "acme/private", layers=2)
    hub.require_token = "hf_secret_token_123"
    _refused("hf://acme/private", tmp_path, env, "private", "HF_TOKEN")
    # with the token it reads, and the token is nowhere in what parity prints or writes
    result, data = _check("hf://acme/private", tmp_path, {**env, "HF_TOKEN": "hf_secret_token_123"})
    assert result.returncode == 0, result.stderr
    assert "hf_secret" not in result.stdout + result.stderr + json.dumps(data)
    assert not hub.cdn_saw_authorization  # the CDN's signed URLs get no token (huggingface_hub's rule)
    hub.require_token = None
    _repo(hub, tmp_path, "acme/gated", layers=2)
    hub.gated = {"acme/gated"}
    _refused("hf://acme/gated", tmp_path, env, "gated", "acme/gated")
    hub.gated = set()
    _refused("hf://acme/private@v9", tmp_path, env, "no revision 'v9'")


def test_the_token_never_leaves_the_hub_for_another_host(hub, env, tmp_path):
    _repo(hub, tmp_path, "acme/redirected", layers=2)
    hub.require_token = "hf_other_secret"
    hub.redirect_to = hub.cdn_url + "/elsewhere"  # a 302 to a host that is not the Hub
    _check("hf://acme/redirected", tmp_path, {**env, "HF_TOKEN": "hf_other_secret"})
    hits = [r for r in hub.requests if r[1].startswith("/elsewhere")]
    assert hits and not hub.cdn_saw_authorization


def test_a_server_that_ignores_range_is_not_read_to_the_end(hub, env, tmp_path):
    directory = tmp_path / "small"
    write_sparse_llama(directory, layers=4, hidden=1024, vocab=32000, shards=2)
    hub.add_repo("acme/no-ranges", directory)
    total = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    hub.ignore_range = True
    _refused("hf://acme/no-ranges", tmp_path, env, "ignored Range", "refused")
    assert hub.body_bytes < total / 4  # it stopped reading: the rest was never taken off the socket


@SLOW
def test_timeouts_are_retried_then_one_line(hub, env, tmp_path):
    _repo(hub, tmp_path, "acme/slow", layers=2)
    hub.fail_times = 1  # one 503, then answers: retried, and the check passes
    assert _check("hf://acme/slow", tmp_path, env)[0].returncode == 0
    remote._OPEN.clear()
    _repo(hub, tmp_path, "acme/slower", layers=2)
    hub.delay = 3.0  # over PARITY_HTTP_TIMEOUT=2 every time
    _refused("hf://acme/slower", tmp_path, env, "timed out", "2 tries")


def test_a_file_that_changed_under_its_commit_is_refused(hub, env, tmp_path):
    directory, sha = _repo(hub, tmp_path, "acme/changing", layers=2, shards=2)
    shard = sorted(p.name for p in directory.glob("*.safetensors"))[0]
    hub.etag_override = {shard: "f" * 64}  # the tree lists one sha256, the file now answers with another
    _refused(f"hf://acme/changing@{sha}", tmp_path, env, shard, "changed", "refused")


def test_headers_past_the_cap_and_ranges_past_the_file(hub, env, tmp_path):
    directory, _ = _repo(hub, tmp_path, "acme/huge-header", layers=2)
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 200 << 20)  # a 200 MiB header: over the 100 MiB cap
    path.write_bytes(bytes(data))
    hub.add_repo("acme/huge-header", directory)
    _refused("hf://acme/huge-header", tmp_path, env, "model.safetensors", "header length")
    directory, _ = _repo(hub, tmp_path, "acme/short", layers=2)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])  # the header's last tensor now ends past the file
    hub.add_repo("acme/short", directory)
    _refused("hf://acme/short", tmp_path, env, "hf://acme/short@", "model.safetensors", "truncated")


def test_bad_urls_and_capture(hub, env, tmp_path):
    _refused("hf://just-a-name", tmp_path, env, "hf://ORG/NAME")
    _refused("hf://acme/x/../y", tmp_path, env, "'..'")
    result = run_parity("capture", "hf://acme/tiny-llama", "--prompt", "hi", "-o", tmp_path / "c.safetensors", env=env)
    assert result.returncode == 2 and "all of its weights" in result.stderr and "hf download" in result.stderr
    assert not (tmp_path / "c.safetensors").exists()


def test_progress_is_bytes_fetched_out_of_the_checkpoint(monkeypatch):
    """"2.1 MB of 810 GB": decimal units, as the Hub shows sizes."""
    assert remote.human(2_100_000) == "2.1 MB"
    assert remote.human(811_707_014_130) == "812 GB"
    assert remote.human(999) == "999 B"


def test_the_parsed_locations():
    loc = remote.parse("hf://meta-llama/Llama-3.1-405B@refs%2Fpr%2F3/original")
    assert (loc.scheme, loc.repo, loc.revision, loc.sub) == ("hf", "meta-llama/Llama-3.1-405B", "refs/pr/3", "original")
    loc = remote.parse("s3://bucket/models/llama/model-Q4_K_M.gguf")
    assert (loc.scheme, loc.repo, loc.sub, loc.is_file) == ("s3", "bucket/models/llama", "model-Q4_K_M.gguf", True)
    assert remote.parse("hf://org/name").revision == "main"
    assert remote.parse("https://host/models/m").repo == "https://host/models/m/"


def test_jobs_workers_open_the_pinned_commit_from_the_cache(hub, env, tmp_path):
    """--jobs 2: each worker opens the checkpoint again, at the commit the parent resolved, from
    the cache: the server sees one revision request in all (the parent's)."""
    _repo(hub, tmp_path, "acme/parallel", layers=4)
    result, data = _check("hf://acme/parallel", tmp_path, env, "r.json", "--jobs", "2")
    assert result.returncode == 0, result.stderr
    assert sum("/revision/" in r[1] for r in hub.requests) == 1
    assert data["environment"]["jobs"] == 2


def test_plain_https_finds_files_by_name(hub, env, tmp_path):
    """https:// (here http:// on the loopback): no listing, each file found with HEAD; the Hub's
    resolve URLs serve as such a server, redirects and all."""
    directory, sha = _repo(hub, tmp_path, "acme/plain", layers=2, shards=2)
    local, local_data = _check(directory, tmp_path, env, "local.json")
    base = f"{hub.url}/acme/plain/resolve/{sha}/"
    result, data = _check(base, tmp_path, env)
    assert result.returncode == local.returncode == 0, result.stderr
    _same_report(local_data, data)
    assert data["checkpoint"]["source"]["store"] == "https" and data["checkpoint"]["path"] == base
    result, _ = _check(f"{hub.url}/acme/plain/resolve/{sha}/nothing/", tmp_path, env, "x.json")
    assert result.returncode == 2 and "no config.json" in result.stderr


def test_progress_on_a_terminal(hub, env, tmp_path, monkeypatch, capsys):
    import io

    _repo(hub, tmp_path, "acme/progress", layers=2)
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    from parity_cli.model.load import open_checkpoint

    ckpt = open_checkpoint("hf://acme/progress")
    # the total is the served files' size, in decimal kB as the Hub shows sizes (a tiny model: all of it read)
    total = sum(p.stat().st_size for p in (tmp_path / "acme_progress").iterdir())
    assert 1000 <= total < 100_000
    last = err.getvalue().rstrip("\n").split("\r")[-1]
    assert re.fullmatch(rf"hf://acme/progress: fetched \d+\.\d kB of {total / 1000:.1f} kB", last), last
    assert ckpt.remote.traffic.bytes >= hub.body_bytes >= total  # it did read the files: the line counts them
    open_checkpoint("hf://acme/progress")  # opened again (preflight, then the check): no second final line
    assert err.getvalue().count("\n") == 1


# -- object stores ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.s3_server import S3Server

    with S3Server() as server:
        yield server


@SLOW
def test_s3_check_is_the_local_check_from_a_fraction_of_the_bytes(s3, tmp_path):
    directory = tmp_path / "s3model"
    write_sparse_llama(directory, layers=2, hidden=1024, intermediate=2816, vocab=8000, shards=2)
    s3.put_tree("models", "llama-small", directory)
    env = {**s3.env(), "PARITY_CACHE": str(tmp_path / "cache")}
    total = sum(p.stat().st_size for p in directory.iterdir())
    local, local_data = _check(directory, tmp_path, env, "local.json")
    s3.reset_counts()
    result, data = _check("s3://models/llama-small", tmp_path, env)
    assert result.returncode == local.returncode == 0, result.stderr
    _same_report(local_data, data)
    assert s3.bytes_sent() < total / 100
    source = data["checkpoint"]["source"]
    assert source["store"] == "s3" and source["bytes_fetched"] == s3.bytes_sent()
    for p in directory.iterdir():  # S3's ETag of a single-part upload is its MD5
        assert source["files"][p.name]["etag"] == hashlib.md5(p.read_bytes()).hexdigest()
    # a rerun lists the prefix (one request) and reads no object byte
    remote._OPEN.clear()
    s3.reset_counts()
    result, _ = _check("s3://models/llama-small", tmp_path, env, "again.json")
    assert result.returncode == 0 and s3.bytes_sent() == 0 and len(s3.requests) == 1


def test_s3_missing_and_forbidden_are_one_line(s3, tmp_path):
    env = {**s3.env(), "PARITY_CACHE": str(tmp_path / "cache")}
    _refused("s3://no-such-bucket/model", tmp_path, env, "s3://no-such-bucket/model", "not found")
    _refused("s3://models/llama-small", tmp_path, {**env, "AWS_ACCESS_KEY_ID": "someone-else"},
             "access denied", "s3fs")


def test_a_missing_fsspec_backend_names_its_package(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    _refused("gs://bucket/model", tmp_path, {"PARITY_CACHE": str(tmp_path / "cache")}, "gs://bucket/model",
             "pip install gcsfs")


def test_an_index_naming_shards_outside_the_folder_is_refused(hub, env, tmp_path):
    """The index is the repository's: a shard named '../x' or '/etc/x' would make the cache write
    or unlink outside itself. Refused before any file is linked."""
    for k, shard in enumerate(("../../outside.safetensors", "/tmp/outside.safetensors")):
        directory, _ = _repo(hub, tmp_path, f"acme/hostile-index-{k}", layers=2, shards=2)
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        first = next(iter(index["weight_map"]))
        index["weight_map"][first] = shard
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        hub.add_repo(f"acme/hostile-index-{k}", directory)
        _refused(f"hf://acme/hostile-index-{k}", tmp_path, env, "model.safetensors.index.json", "outside", "refused")
    assert not (tmp_path / "outside.safetensors").exists()


def test_explain_replays_a_remote_report_at_its_commit(hub, env, tmp_path):
    """A report of hf://... records the URL at its commit; explain opens it there (from the cache)."""
    _repo(hub, tmp_path, "acme/explained", layers=2, eps=1e-5)
    result, data = _check("hf://acme/explained", tmp_path, env, "r.json", "--candidate-eps", "1e-6")
    assert result.returncode == 1, result.stderr
    remote._OPEN.clear()
    hub.reset_counts()
    result = run_parity("explain", tmp_path / "r.json", env=env)
    assert result.returncode == 0, result.stderr
    assert "the candidate's eps matches it" in result.stdout and hub.body_bytes == 0


def test_a_repository_of_pickles_only(hub, env, tmp_path):
    directory = tmp_path / "pickles"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    hub.add_repo("acme/pickles", directory)
    _refused("hf://acme/pickles", tmp_path, env, "pytorch_model.bin", "never unpickled")
    assert not any(r[1].endswith("pytorch_model.bin") for r in hub.requests)


# -- the review's cases (issue 39 re-read) ---------------------------------------------------------

def test_the_cache_is_not_a_local_checkpoint(hub, env, tmp_path):
    """A snapshot in parity's cache holds holes where nothing was fetched: opened as a directory it
    would read them as zero gains. It is refused, naming what to do."""
    _repo(hub, tmp_path, "acme/holes", layers=2)
    result, data = _check("hf://acme/holes", tmp_path, env)
    assert result.returncode == 0
    snapshot = next((tmp_path / "cache").glob("hf/*/models--acme--holes/snapshots/*"))
    _refused(snapshot, tmp_path, env, "parity's cache", "URL")


def test_a_blob_deleted_by_hand_is_fetched_again(hub, env, tmp_path):
    directory, sha = _repo(hub, tmp_path, "acme/deleted", layers=2)
    assert _check(f"hf://acme/deleted@{sha}", tmp_path, env)[0].returncode == 0
    blobs = tmp_path / "cache" / "hf"
    for blob in blobs.glob("*/models--acme--deleted/blobs/*"):
        if not blob.name.endswith((".ranges", ".lock")):
            blob.unlink()  # its .ranges file stays, claiming bytes that are gone
    for link in blobs.glob("*/models--acme--deleted/snapshots/*/*"):
        if link.is_file():
            link.unlink()
    remote._OPEN.clear()
    result, data = _check(f"hf://acme/deleted@{sha}", tmp_path, env, "again.json")
    assert result.returncode == 0, result.stderr
    assert data["checkpoint"]["source"]["bytes_fetched"] > 0


def test_a_folder_in_a_repository_and_its_messages(hub, env, tmp_path):
    """hf://ORG/NAME@REV/FOLDER: files named once in messages (the folder not doubled), warnings
    name the repository's config.json, never this machine's cache, and two folders whose names
    differ only by '/' and '_' are two listings."""
    root = tmp_path / "foldered"
    write_checkpoint(root / "a" / "b", layers=2, eps=None)  # no eps in config.json: a warning names the file
    write_checkpoint(root / "a_b", layers=3)
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    sha = hub.add_repo("acme/foldered", root)
    result, data = _check("hf://acme/foldered/a/b", tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert data["checkpoint"]["path"] == f"hf://acme/foldered@{sha}/a/b"
    text = json.dumps(data) + result.stdout + result.stderr
    assert env["PARITY_CACHE"] not in text
    assert f"hf://acme/foldered@{sha}/a/b/config.json" in " ".join(data["warnings"])
    result, other = _check("hf://acme/foldered/a_b", tmp_path, env, "other.json")
    assert result.returncode == 0 and len(other["layers"]) == 7
    line = _refused("hf://acme/foldered/broken", tmp_path, env, "invalid JSON")
    assert f"hf://acme/foldered@{sha}/broken/config.json:" in line and "broken/broken" not in line


@pytest.mark.parametrize("weight_map", [[1, 2], {"model.norm.weight": 3}])
def test_a_malformed_weight_map_is_one_line(hub, env, tmp_path, weight_map):
    directory, _ = _repo(hub, tmp_path, "acme/bad-map", layers=2, shards=2)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hub.add_repo("acme/bad-map", directory)
    _refused("hf://acme/bad-map", tmp_path, env, "model.safetensors.index.json", "weight_map")


def test_environment_and_url_mistakes_are_one_line(hub, env, tmp_path):
    _repo(hub, tmp_path, "acme/envs", layers=2)
    (tmp_path / "a-file").write_text("")
    _refused("hf://acme/envs", tmp_path, {**env, "PARITY_CACHE": str(tmp_path / "a-file")}, "is not a directory",
             "cache")
    _refused("hf://acme/envs@..", tmp_path, env, "'..'", "not a branch")
    _refused("hf://acme/envs@" + "0" * 40, tmp_path, {**env, "HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE",
             "not in parity's cache")
    line = _refused("https://alice:s3cretpw@example.invalid/models/m/", tmp_path, env, "credentials", "refused")
    assert "s3cretpw" not in line
    _refused("https://example.invalid/m/model.gguf?X-Amz-Signature=abc", tmp_path, env, "presigned")


def test_coalescing_never_fetches_more_than_twice_what_it_needs():
    """A header spacing 300 tiny tensors just under 64 KiB apart must not turn into one request of
    the whole shard; adjacent ranges (a gain and its bias) share one."""
    spaced = [(k * 65_000, k * 65_000 + 64) for k in range(300)]
    requests = remote._coalesced(spaced)
    wanted = sum(b - a for a, b in spaced)
    assert sum(b - a for a, b in requests) <= 2 * wanted
    assert remote._coalesced([(0, 4096), (4096, 8192)]) == [(0, 8192)]
    assert remote._coalesced([(0, 4096), (6000, 10096)]) == [(0, 10096)]  # 1,904 bytes between 8,192 wanted
    big = [(k * (1 << 20), k * (1 << 20) + (1 << 20)) for k in range(20)]  # 20 MiB contiguous
    assert all(b - a <= remote.MAX_SPAN for a, b in remote._coalesced(big))


def test_a_server_that_drips_is_cut_off(monkeypatch):
    """Each socket read inside its timeout, the whole body far slower: the read has a deadline."""
    import time

    from parity_cli.sources import stores

    monkeypatch.setenv("PARITY_HTTP_TIMEOUT", "0.3")

    class Dripping:
        headers = {"content-length": "1000000"}

        def iter_raw(self):
            while True:
                time.sleep(0.05)
                yield b"x"

    with pytest.raises(stores._Retry, match="64 KiB/s"):
        stores._bounded(Dripping(), 65_536)


@pytest.mark.parametrize("name,value", [("PARITY_HTTP_TIMEOUT", "-1"), ("PARITY_HTTP_TIMEOUT", "nan"),
                                        ("PARITY_HTTP_TIMEOUT", "soon"), ("PARITY_HTTP_RETRIES", "1e9"),
                                        ("PARITY_HTTP_BACKOFF", "-3")])
def test_hostile_http_settings_are_one_line(hub, env, tmp_path, name, value):
    _repo(hub, tmp_path, "acme/settings", layers=2)
    _refused("hf://acme/settings", tmp_path, {**env, name: value}, name, repr(value))


def test_a_url_naming_a_safetensors_file_names_its_folder(tmp_path, env):
    line = _refused("hf://acme/tiny-llama/model.safetensors", tmp_path, env, "no config", "hf://acme/tiny-llama")
    assert "model.safetensors:" in line.split("no config")[0]
    _refused("s3://bucket/models/m/model-00001-of-00002.safetensors", tmp_path, env, "s3://bucket/models/m")
