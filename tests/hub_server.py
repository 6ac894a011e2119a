"""An in-process fake of the Hugging Face Hub's file API for tests (stdlib only: http.server + threads).

`HubServer().add_repo("org/name", directory)` serves a directory as a model repo; `start()` binds the "Hub" (`url`,
127.0.0.1) and a "CDN" (`cdn_url`, named localhost: another origin) that LFS resolves 302 to. As huggingface_hub 2.x
parses it: model_info (`GET /api/models/{repo}[/revision/{rev}]`, `?blobs=true` adds size/blobId/lfs), list_repo_tree
(`GET .../tree/{rev}[/{path}]`, 50 entries a page, next page in `Link: <...&cursor=N>; rel="next"`), HEAD/GET
`/{repo}/resolve/{rev}/{path}` (X-Repo-Commit and ETag always, even on a 404 EntryNotFound: hf_hub_download caches the
absence from it; an LFS 302 carries X-Linked-Etag/X-Linked-Size itself: get_hf_file_metadata reads them there, as it
follows no cross-origin redirect), HEAD/GET `{cdn}/blobs/{org--name}/{sha}/{path}?sig=x` (same bytes, no X-Repo-Commit).
Range: one `bytes=a-b`, `a-` or `-n` -> 206 + Content-Range; a >= size -> 416 `bytes */size`; any other Range is
ignored (200). Errors carry X-Error-Code and a JSON {"error": ...} body, which hf_raise_for_status maps to exceptions.
LFS = over 10 MiB or .safetensors/.gguf; its sha256 is computed once, lazily, except for SPARSE files over 64 MiB
(os.truncate'd checkpoints): their "sha256" is a FAKE oid, sha256 of (path, size, mtime), stable per file as added.
Bodies stream by os.pread in 1 MiB chunks (never a whole file); `body_bytes` counts the bytes the socket took;
`requests` records (method, raw path with its query, Range header) for both servers.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_OVER, FAKE_OID_OVER, PAGE_SIZE, CHUNK = 10 << 20, 64 << 20, 50, 1 << 20


class _File:
    def __init__(self, path: Path, rel: str):
        st = path.stat()
        self.path, self.rel, self.size, self.mtime = path, rel, st.st_size, st.st_mtime_ns
        self.sparse = st.st_blocks * 512 < st.st_size
        self.lfs = self.size > LFS_OVER or path.suffix in (".safetensors", ".gguf")
        self._sha256: str | None = None
        self._blob_sha1: str | None = None

    def _hash(self, h, prefix: bytes = b""):
        h.update(prefix)
        with open(self.path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def sha256(self) -> str:
        if self._sha256 is None:
            fake = self.sparse and self.size > FAKE_OID_OVER  # hashing GiBs of holes on every test run is waste
            key = f"{self.path}\0{self.size}\0{self.mtime}".encode()
            self._sha256 = hashlib.sha256(key).hexdigest() if fake else self._hash(hashlib.sha256())
        return self._sha256

    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256()}\nsize {self.size}\n".encode()

    def blob_sha1(self) -> str:
        """The git blob id: of the content for a small file, of the LFS pointer for an LFS file."""
        if self._blob_sha1 is None:
            if self.lfs:
                self._blob_sha1 = hashlib.sha1(b"blob %d\0%s" % (len(self.pointer()), self.pointer())).hexdigest()
            else:
                self._blob_sha1 = self._hash(hashlib.sha1(), b"blob %d\0" % self.size)
        return self._blob_sha1

    def lfs_info(self, oid_key: str = "oid") -> dict:
        return {oid_key: self.sha256(), "size": self.size, "pointerSize": len(self.pointer())}


class _Rev:
    def __init__(self, branch: str, sha: str, files: dict[str, _File]):
        self.branch, self.sha, self.files = branch, sha, files
        self.dirs = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}


class _Quiet(ThreadingHTTPServer):
    """A client hanging up mid-body is what some tests do on purpose: no traceback on stderr, which
    an in-process CLI run under test would capture as its own."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass


class HubServer:
    def __init__(self):
        self.url = self.cdn_url = ""
        self._repos: dict[str, dict[str, _Rev]] = {}  # repo id -> {branch or sha: revision}
        self._lock, self._stopping = threading.Lock(), threading.Event()
        self._servers: list[ThreadingHTTPServer] = []
        self.ignore_range, self.require_token, self.gated = False, None, set()
        self.delay, self.fail_times, self.etag_override = 0.0, 0, {}
        self.lfs_redirect, self.redirect_to, self.cdn_saw_authorization = True, None, False
        self.reset_counts()

    def add_repo(self, repo_id: str, directory: Path, revision: str = "main", sha: str | None = None) -> str:
        directory = Path(directory)
        files = {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*")) if p.is_file()}
        if sha is None:
            listing = "".join(f"\n{rel}\0{p.stat().st_size}" for rel, p in sorted(files.items()))
            sha = hashlib.sha1(f"{repo_id}\0{revision}{listing}".encode()).hexdigest()
        rev = _Rev(revision, sha, {rel: _File(p, rel) for rel, p in files.items()})
        with self._lock:
            self._repos.setdefault(repo_id, {}).update({revision: rev, sha: rev})
        return sha

    def reset_counts(self) -> None:
        with self._lock:
            self.requests: list[tuple[str, str, str | None]] = []
            self.body_bytes = 0

    def start(self) -> HubServer:
        self._stopping.clear()
        for cdn in (False, True):
            server = _Quiet(("127.0.0.1", 0), _Handler)
            server.hub, server.cdn = self, cdn  # type: ignore[attr-defined]
            self._servers.append(server)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        self.cdn_url = f"http://localhost:{self._servers[1].server_address[1]}"
        return self

    def stop(self) -> None:
        self._stopping.set()  # ends `delay` sleeps early
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer has a Content-Length (or closes the connection)
    timeout = 60  # the thread of an idle keep-alive connection ends after this

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:
        self._dispatch()

    do_HEAD = do_GET

    def _send(self, status: int, headers: dict, body: bytes = b"", length: int | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, status: int, data, headers: dict | None = None) -> None:
        self._send(status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(data).encode())

    def _error(self, status: int, code: str | None, message: str, headers: dict | None = None) -> None:
        self._json(status, {"error": message}, {**({"X-Error-Code": code} if code else {}), **(headers or {})})

    def _dispatch(self) -> None:
        hub: HubServer = self.server.hub  # type: ignore[attr-defined]
        with hub._lock:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
        split = urlsplit(self.path)
        segs, query = split.path.split("/")[1:], {k: v[0] for k, v in parse_qs(split.query).items()}
        try:
            if self.server.cdn:  # type: ignore[attr-defined]
                hub.cdn_saw_authorization |= self.headers.get("Authorization") is not None
                if segs[0] != "blobs" or len(segs) < 4:
                    return self._error(404, None, "Not found")
                return self._cdn(hub, unquote(segs[1]).replace("--", "/"), segs[2], unquote("/".join(segs[3:])))
            if hub.require_token and self.headers.get("Authorization") != f"Bearer {hub.require_token}":
                return self._error(401, "RepoNotFound", "Invalid username or password.")
            if segs[:2] == ["api", "models"] and self.command == "GET":
                return self._api(hub, segs[2:], query)
            for n in (2, 1):  # org/name, or a legacy id without namespace
                if len(segs) > n + 2 and segs[n] == "resolve":
                    path = unquote("/".join(segs[n + 2 :]))
                    return self._resolve(hub, "/".join(segs[:n]), unquote(segs[n + 1]), path)
            return self._error(404, None, "Not found")
        except (ConnectionError, TimeoutError):  # the client hung up or stalled: nothing to report
            self.close_connection = True

    def _lookup(self, hub: HubServer, repo_id: str, rev: str) -> _Rev | None:
        revs = hub._repos.get(repo_id)
        if revs is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if rev not in revs:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return revs[rev]

    def _api(self, hub: HubServer, segs: list[str], query: dict) -> None:
        repo_id, rest = "/".join(segs[:2]), segs[2:]
        if repo_id not in hub._repos and segs and segs[0] in hub._repos:  # a legacy id without namespace
            repo_id, rest = segs[0], segs[1:]
        if rest and not (rest[0] == "revision" and len(rest) == 2) and not (rest[0] == "tree" and len(rest) > 1):
            return self._error(404, None, "Not found")
        if (rev := self._lookup(hub, repo_id, unquote(rest[1]) if rest else "main")) is None:
            return None
        if not rest or rest[0] == "revision":
            blobs = query.get("blobs", "").lower() in ("true", "1")
            siblings = [{"rfilename": p, **({"size": f.size, "blobId": f.blob_sha1()} if blobs else {}),
                         **({"lfs": f.lfs_info("sha256")} if blobs and f.lfs else {})} for p, f in rev.files.items()]
            return self._json(200, {
                "id": repo_id, "modelId": repo_id, "sha": rev.sha, "private": hub.require_token is not None,
                "gated": "manual" if repo_id in hub.gated else False, "disabled": False, "siblings": siblings,
                "lastModified": "2026-01-01T00:00:00.000Z", "tags": [], "downloads": 0, "likes": 0})
        path = unquote("/".join(rest[2:])).strip("/")
        if path and path not in rev.dirs:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev.branch}")
        recursive, prefix = query.get("recursive", "").lower() in ("true", "1"), f"{path}/" if path else ""
        entries = []
        for p in sorted(rev.dirs | set(rev.files)):
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :]):
                if (f := rev.files.get(p)) is None:
                    dir_oid = hashlib.sha1(f"{rev.sha}\0{p}".encode()).hexdigest()
                    entries.append({"type": "directory", "oid": dir_oid, "size": 0, "path": p})
                else:
                    entries.append({"type": "file", "oid": f.blob_sha1(), "size": f.size, "path": p,
                                    **({"lfs": f.lfs_info()} if f.lfs else {})})
        start, headers = int(query.get("cursor", "0")), {}
        if start + PAGE_SIZE < len(entries):
            expand = query.get("expand", "false")
            nxt = f"{hub.url}{urlsplit(self.path).path}?recursive={str(recursive).lower()}&expand={expand}"
            headers["Link"] = f'<{nxt}&cursor={start + PAGE_SIZE}>; rel="next"'
        self._json(200, entries[start : start + PAGE_SIZE], headers)

    def _faulted(self, hub: HubServer) -> bool:
        """Applies `delay` and `fail_times` to a file request; True when it got its answer (503) already."""
        if hub.delay:
            hub._stopping.wait(hub.delay)
        with hub._lock:
            failing, hub.fail_times = hub.fail_times > 0, max(0, hub.fail_times - 1)
        if failing:
            self._error(503, None, "Service Unavailable")
        return failing

    def _resolve(self, hub: HubServer, repo_id: str, rev_name: str, path: str) -> None:
        if self._faulted(hub) or (rev := self._lookup(hub, repo_id, rev_name)) is None:
            return None
        if repo_id in hub.gated:
            msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            return self._error(403, "GatedRepo", msg)
        if (f := rev.files.get(path)) is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": rev.sha})
        etag = f'"{hub.etag_override.get(path, f.sha256() if f.lfs else f.blob_sha1())}"'
        headers = {"X-Repo-Commit": rev.sha, "ETag": etag}
        if f.lfs:
            headers.update({"X-Linked-Etag": etag, "X-Linked-Size": f.size})
            if hub.lfs_redirect:
                base = (hub.redirect_to or hub.cdn_url).rstrip("/")
                loc = f"{base}/blobs/{quote(repo_id.replace('/', '--'))}/{rev.sha}/{quote(path)}?sig=x"
                return self._send(302, {**headers, "Location": loc})
        self._serve_file(hub, f, headers)

    def _cdn(self, hub: HubServer, repo_id: str, sha: str, path: str) -> None:
        if self._faulted(hub):
            return None
        rev = hub._repos.get(repo_id, {}).get(sha)
        if rev is None or rev.sha != sha or (f := rev.files.get(path)) is None:
            return self._error(404, None, "NoSuchKey")
        self._serve_file(hub, f, {"ETag": f'"{hub.etag_override.get(path, f.sha256())}"'})

    def _serve_file(self, hub: HubServer, f: _File, headers: dict) -> None:
        start, end, rng = 0, f.size - 1, self.headers.get("Range")
        parsed = _parse_range(rng, f.size) if rng and not hub.ignore_range else None
        headers.update({"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"})
        if parsed == "unsatisfiable":
            return self._send(416, {**headers, "Content-Range": f"bytes */{f.size}"})
        if parsed is not None:
            start, end = parsed
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        if rng and hub.ignore_range:  # the client is expected to hang up early: no reuse of this connection
            headers["Connection"], self.close_connection = "close", True
        self._send(206 if parsed else 200, headers, length=end - start + 1)
        if self.command == "HEAD":
            return None
        fd = os.open(f.path, os.O_RDONLY)
        try:
            while start <= end:
                if not (chunk := os.pread(fd, min(CHUNK, end - start + 1), start)):  # the file shrank meanwhile
                    self.close_connection = True
                    return None
                view = memoryview(chunk)
                while view:  # counted before it is sent (a client that read it all sees it counted), less
                    piece = view[: 64 << 10]  # what the socket did not take: at most 64 KiB ahead in flight
                    with hub._lock:
                        hub.body_bytes += len(piece)
                    sent = 0
                    try:
                        sent = self.connection.send(piece)
                    finally:
                        with hub._lock:
                            hub.body_bytes -= len(piece) - sent
                    view, start = view[sent:], start + sent
        finally:
            os.close(fd)


def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """One byte range -> (first, last) or "unsatisfiable"; None for a Range to ignore (several ranges, malformed)."""
    first, sep, last = header.strip().removeprefix("bytes=").partition("-")
    if not header.strip().startswith("bytes=") or "," in header or not sep:
        return None
    try:
        if not first:  # a suffix: the last N bytes
            return (max(0, size - int(last)), size - 1) if int(last) > 0 and size > 0 else "unsatisfiable"
        a, b = int(first), int(last) if last else size - 1
    except ValueError:
        return None
    if a < 0 or (last and b < a):
        return None
    return "unsatisfiable" if a >= size else (a, min(b, size - 1))


if __name__ == "__main__":  # self-test against huggingface_hub: .venv/bin/python tests/hub_server.py
    import tempfile

    import huggingface_hub as hh
    from huggingface_hub import errors
    from huggingface_hub.utils import get_session

    def expect(exc: type[Exception], fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except exc as e:
            return print(f"  raises {exc.__name__}: {str(e).splitlines()[-1]}")
        raise AssertionError(f"did not raise {exc.__name__}")

    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        d, big, repo, session = Path(tmp), 3 << 30, "org/model", get_session()
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").touch()
        os.truncate(d / "model.safetensors", big)
        with open(d / "model.safetensors", "r+b") as fh:
            fh.seek(1 << 30), fh.write(b"hello")
        (d / "shards").mkdir()
        [(d / "shards" / f"s{i:02d}.txt").write_text(str(i)) for i in range(60)]
        sha, api = hub.add_repo(repo, d), hh.HfApi(endpoint=hub.url)
        info = api.model_info(repo, revision=sha)
        assert info.sha == sha == api.model_info(repo).sha
        assert {"config.json", "model.safetensors"} <= {s.rfilename for s in info.siblings}
        print(f"model_info: sha={info.sha[:12]} siblings={len(info.siblings)}")
        hub.reset_counts()
        shards = list(api.list_repo_tree(repo, path_in_repo="shards", revision=sha, recursive=True, expand=False))
        assert [e.path for e in shards] == [f"shards/s{i:02d}.txt" for i in range(60)], shards
        assert len(hub.requests) == 2 and "cursor=50" in hub.requests[1][1], hub.requests
        tree = {e.path: e for e in api.list_repo_tree(repo, revision=sha, recursive=True)}
        assert len(tree) == 63 and type(tree["shards"]).__name__ == "RepoFolder"
        st = tree["model.safetensors"]
        assert st.lfs is not None and st.lfs.size == big and tree["config.json"].lfs is None
        print(f"list_repo_tree: {len(shards)} shards in 2 pages; {len(tree)} entries recursive; {st.lfs}")
        url = hh.hf_hub_url(repo, "model.safetensors", revision=sha, endpoint=hub.url)
        meta = hh.get_hf_file_metadata(url)
        assert (meta.commit_hash, meta.etag, meta.size) == (sha, st.lfs.sha256, big), meta
        assert meta.location.startswith(hub.cdn_url + "/blobs/org--model/"), meta.location
        print(f"get_hf_file_metadata: etag={meta.etag[:12]} size={meta.size} location={meta.location}")
        hub.reset_counts()
        r = session.get(url, headers={"Range": f"bytes={1 << 30}-{(1 << 30) + 9}"})
        assert r.status_code == 206 and r.content == b"hello" + bytes(5), (r.status_code, r.content)
        assert r.headers["Content-Range"] == f"bytes {1 << 30}-{(1 << 30) + 9}/{big}" and hub.body_bytes == 10
        assert [(m, p.split("/")[1]) for m, p, _ in hub.requests] == [("GET", "org"), ("GET", "blobs")]
        print(f"range GET via redirect: {r.status_code} {r.headers['Content-Range']} body_bytes={hub.body_bytes}")
        cfg = hh.hf_hub_url(repo, "config.json", endpoint=hub.url)
        r = session.get(cfg, headers={"Range": "bytes=100-"})
        assert r.status_code == 416 and r.headers["Content-Range"] == "bytes */18", r.headers
        r = session.get(cfg, headers={"Range": "bytes=2-"})
        assert r.status_code == 206 and r.content == b'hidden_size": 8}' and r.headers["X-Repo-Commit"] == sha
        hub.add_repo(repo, d / "shards", revision="refs/pr/1")
        assert len(api.model_info(repo, revision="refs/pr/1").siblings) == 60
        expect(errors.RevisionNotFoundError, api.model_info, repo, revision="nope")
        expect(errors.RepositoryNotFoundError, api.model_info, "org/missing")
        expect(errors.RemoteEntryNotFoundError, hh.get_hf_file_metadata, cfg.replace("config", "nope"))
        expect(errors.RemoteEntryNotFoundError, lambda: list(api.list_repo_tree(repo, path_in_repo="nope")))
        hub.require_token = "secret"
        expect(errors.RepositoryNotFoundError, api.model_info, repo)
        assert api.model_info(repo, token="secret").sha == sha
        hub.reset_counts()
        r = session.get(url, headers={"Range": "bytes=0-3", "Authorization": "Bearer secret"})
        assert r.status_code == 206 and not hub.cdn_saw_authorization and len(hub.requests) == 2
        print("require_token: 401 -> RepositoryNotFoundError; the token is accepted; the CDN saw no Authorization")
        hub.require_token = None
        hub.gated.add(repo)
        expect(errors.GatedRepoError, hh.get_hf_file_metadata, url)
        hub.gated.clear()
        hub.fail_times = 1
        assert [session.head(url, follow_redirects=False).status_code for _ in range(2)] == [503, 302]
        hub.ignore_range, hub.body_bytes = True, 0
        with session.stream("GET", url, headers={"Range": "bytes=0-9"}) as r:
            assert r.status_code == 200 and r.headers["Content-Length"] == str(big) and next(r.iter_raw(1 << 16))
        assert hub.body_bytes < big, hub.body_bytes
        print(f"ignore_range: 200 streamed, the client hung up after {hub.body_bytes} of {big} bytes")
        hub.ignore_range = False
        assert session.get(cfg, headers={"Range": "bytes=0-1"}).status_code == 206  # the pool still works
    print("hub_server self-test: OK")
