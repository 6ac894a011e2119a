"""Where a remote checkpoint lives: the Hugging Face Hub, an object store through fsspec, or a
plain HTTPS server. Each store lists files (size and ETag) and reads byte ranges, bounded: a
range is asked for with Range and never more than it is read, whatever the server sends.

Only this module talks to the network. The Hub token comes from huggingface_hub's usual places
(HF_TOKEN, `hf auth login`) and is sent only to the Hub's own origin, never printed."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urljoin, urlparse

from parity_cli.errors import InputError

MAX_REDIRECTS = 5
MAX_LISTING_BYTES = 16 << 20  # one page of a tree listing, one revision's JSON
MAX_PAGES, MAX_FILES = 100, 100_000  # a folder's listing in all (the Hub sends 1,000 entries a page)
PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
HEX40 = re.compile(r"[0-9a-f]{40}")


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise InputError(f"{name}={os.environ[name]!r}: not a number") from None


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def timeout_s() -> float:
    value = _env_float("PARITY_HTTP_TIMEOUT", 30.0)
    if not 0 < value < float("inf"):
        raise InputError(f"PARITY_HTTP_TIMEOUT={os.environ['PARITY_HTTP_TIMEOUT']!r}: seconds, finite and > 0")
    return value


def retries() -> int:
    value = _env_float("PARITY_HTTP_RETRIES", 4)
    if not 0 <= value <= 100:
        raise InputError(f"PARITY_HTTP_RETRIES={os.environ['PARITY_HTTP_RETRIES']!r}: a count from 0 to 100")
    return int(value)


def backoff_s(attempt: int) -> float:
    value = _env_float("PARITY_HTTP_BACKOFF", 1.0)
    if not 0 <= value <= 60:
        raise InputError(f"PARITY_HTTP_BACKOFF={os.environ['PARITY_HTTP_BACKOFF']!r}: seconds from 0 to 60")
    return value * (2 ** attempt)


def etag_of(value) -> str:
    """An ETag as a key: without W/ and quotes."""
    text = str(value or "").strip()
    if text.startswith("W/"):
        text = text[2:]
    return text.strip('"')


@dataclass
class Traffic:
    """What a check read from the network: counted where the bytes arrive."""

    requests: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, requests: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += nbytes


@dataclass(frozen=True)
class FileMeta:
    size: int
    etag: str


class _Retry(Exception):
    """A failure worth another try (a timeout, a dropped connection, 429, 5xx)."""


def _session():
    try:
        from huggingface_hub.utils import get_session
    except ImportError:
        raise InputError("reading a checkpoint over HTTP needs huggingface_hub: pip install huggingface_hub "
                         "(from a checkout: pip install -e '.[remote]')") from None
    return get_session()


def _httpx(session):
    """The HTTP library huggingface_hub's session comes from: httpx (1.x) or its fork httpx2 (2.x)."""
    return sys.modules[type(session).__module__.split(".")[0]]


def _origin(url: str) -> tuple:
    p = urlparse(url)
    return p.scheme, (p.hostname or "").lower(), p.port or {"http": 80, "https": 443}.get(p.scheme, 0)


class Http:
    """GETs with a timeout, retries with backoff, redirects followed by hand so that the token
    goes only to `trusted` origins (huggingface_hub's rule: a CDN's signed URL gets no
    Authorization), and bodies read only up to what was asked."""

    def __init__(self, label: str, headers: dict, trusted: set, traffic: Traffic, statuses):
        self.label, self.headers, self.trusted, self.traffic = label, headers, trusted, traffic
        self.statuses = statuses  # (status, response headers, what) -> InputError | None: the store's words

    def _hops(self, method: str, url: str, extra: dict):
        """The response at the end of the redirects (streamed, open) and the headers seen on the way."""
        session, seen = _session(), {}
        httpx = _httpx(session)
        for _ in range(MAX_REDIRECTS + 1):
            headers = {**extra, "Accept-Encoding": "identity"}  # an encoded body could decode to gigabytes
            if _origin(url) in self.trusted:
                headers.update(self.headers)
            request = session.build_request(method, url, headers=headers,
                                            timeout=httpx.Timeout(timeout_s()))
            response = _headers_within(lambda r=request: session.send(r, stream=True, follow_redirects=False))
            self.traffic.add(requests=1)
            for key in ("x-linked-etag", "x-linked-size", "x-repo-commit"):
                if key in response.headers and key not in seen:
                    seen[key] = response.headers[key]
            if response.status_code in (301, 302, 303, 307, 308) and "location" in response.headers:
                _drain(response)
                try:
                    url = urljoin(url, response.headers["location"])
                    if urlparse(url).scheme not in ("http", "https"):
                        raise ValueError(url)
                except ValueError:
                    raise InputError(f"{self.label}: a redirect to a malformed location; refused") from None
                continue
            return response, seen
        raise InputError(f"{self.label}: more than {MAX_REDIRECTS} redirects; refused")

    def call(self, method: str, url: str, what: str, extra: dict | None = None, body=None):
        """`body(response, seen) -> value` reads what it needs; retried on timeouts, 429 and 5xx."""
        if offline():
            raise InputError(f"{self.label}: {what}: HF_HUB_OFFLINE is set and it is not in parity's cache")
        httpx = _httpx(_session())
        tries = retries() + 1  # the first try, then the retries
        backoff_s(0)  # every setting is checked before the first request, not when a retry needs it
        for attempt in range(tries):
            try:
                response, seen = self._hops(method, url, extra or {})
                try:
                    status = response.status_code
                    if status == 429 or status >= 500:
                        raise _Retry(f"HTTP {status}")
                    failure = self.statuses(status, response.headers, what)
                    if failure is not None:
                        raise failure
                    _identity(response, self.label)  # the body read is never decoded (error bodies: drained raw)
                    return body(response, seen) if body else (response.headers, seen)
                finally:
                    _drain(response)
            except (_Retry, httpx.TimeoutException, httpx.TransportError) as exc:
                reason = "timed out" if isinstance(exc, httpx.TimeoutException) else str(exc) or type(exc).__name__
                if attempt + 1 == tries:
                    raise InputError(f"{self.label}: {what}: {reason} ({tries} tries, {timeout_s():g} s timeout "
                                     "each; PARITY_HTTP_TIMEOUT, PARITY_HTTP_RETRIES)") from None
                time.sleep(backoff_s(attempt))
        raise AssertionError("unreachable")

    def json(self, url: str, what: str):
        """A JSON document of at most MAX_LISTING_BYTES, and the next page's URL (a Link header)."""

        def read(response, seen):
            if response.status_code != 200:
                raise InputError(f"{self.label}: {what}: HTTP {response.status_code}")
            data = _bounded(response, MAX_LISTING_BYTES + 1)
            if len(data) > MAX_LISTING_BYTES:
                raise InputError(f"{self.label}: {what} is over {MAX_LISTING_BYTES >> 20} MiB; refused")
            self.traffic.add(nbytes=len(data))
            try:
                following = response.links.get("next", {}).get("url")
                return json.loads(data), urljoin(url, following) if following else None
            except ValueError as exc:
                raise InputError(f"{self.label}: {what}: not JSON ({exc})") from None
            except RecursionError:
                raise InputError(f"{self.label}: {what}: JSON nested too deeply; refused") from None

        return self.call("GET", url, what, {"Accept-Encoding": "identity"}, read)

    def range(self, url: str, start: int, end: int, meta: FileMeta, what: str) -> bytes:
        """Bytes [start, end) of a file of meta.size bytes, whose ETag must stay meta.etag."""

        def read(response, seen):
            status, n = response.status_code, end - start
            if status == 416:
                raise InputError(f"{self.label}: {what}: bytes {start}..{end} are past the file's end; refused")
            linked = etag_of(seen.get("x-linked-etag") or response.headers.get("etag"))
            if linked and meta.etag and linked != meta.etag:
                raise InputError(f"{self.label}: {what} changed: ETag {linked} where {meta.etag} was listed; refused")
            if status == 200:
                # the whole body instead of the range: usable only from byte 0, and read only as far as asked
                if start:
                    raise InputError(f"{self.label}: {what}: the server ignored Range and sent the whole file; "
                                     f"stopped after {n} bytes; refused")
            elif status == 206:
                got = _content_range(response.headers.get("content-range"))
                if got is None or got[0] != start or got[1] != end or (got[2] is not None and got[2] != meta.size):
                    raise InputError(f"{self.label}: {what}: asked for bytes {start}..{end} of {meta.size}, the "
                                     f"server sent {response.headers.get('content-range')!r}; refused")
            else:
                raise InputError(f"{self.label}: {what}: HTTP {status}")
            data = _bounded(response, n)
            self.traffic.add(nbytes=len(data))
            if len(data) != n:
                raise _Retry(f"short read: {len(data)} of {n} bytes")
            return data

        return self.call("GET", url, what, {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}, read)


def _bounded(response, n: int) -> bytes:
    """At most n bytes of the body: a server that sends more is not read further. A body of
    exactly what was asked is read to its end, so that the connection goes back to the pool.
    The whole read has a deadline (the timeout, plus 64 KiB/s): a server that drips a byte
    just inside each read's timeout does not hold the check for days."""
    out, deadline = bytearray(), time.monotonic() + timeout_s() + n / (64 << 10)
    whole = response.headers.get("content-length", "").isdigit() and int(response.headers["content-length"]) <= n
    for chunk in response.iter_raw():
        out += chunk[: n - len(out)]
        if time.monotonic() > deadline:
            raise _Retry(f"under 64 KiB/s ({len(out)} of {n} bytes)")
        if len(out) >= n and not whole:
            break
    return bytes(out)


def _drain(response, limit: int = 64 << 10) -> None:
    """Closes a response, reading a small unread body first (a redirect's, an error's) so that
    its connection is reused rather than dropped: raw bytes only (never decoded), at most `limit`,
    within the deadline every body has; a body that is larger or slower only costs the connection."""
    try:
        if not response.is_stream_consumed and response.headers.get("content-length", "x").isdigit() \
                and int(response.headers["content-length"]) <= limit:
            _bounded(response, limit)
    except Exception:
        pass
    response.close()


def _identity(response, label: str) -> None:
    """A body that will be read must be sent as it is: identity was asked for, and an encoded one
    (`gzip, gzip`: kilobytes on the wire, gigabytes decoded) is refused, never decoded."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InputError(f"{label}: the server sent a body encoded as '{encoding[:40]}' though only identity was "
                         "asked for; an encoded body is never decoded (its size after decoding is unbounded); refused")


def _headers_within(send):
    """send() (a request, streamed: it returns once the headers are in) within the whole-read
    deadline every body has: httpx's timeout is per read, so a server that drips its headers a byte
    at a time, just inside it, would hold the run forever. The request runs on a daemon thread;
    past the deadline it is abandoned (its connection with it) and the try counts as timed out."""
    box: dict = {}
    lock = threading.Lock()

    def run():
        try:
            response = send()
        except BaseException as exc:  # handed to the caller's thread as it is
            box["error"] = exc
            return
        with lock:
            late = box.get("abandoned", False)
            box["response"] = response
        if late:  # its try gave up on it: closed, so its connection is not held
            response.close()

    worker = threading.Thread(target=run, daemon=True, name="parity-http")
    worker.start()
    worker.join(timeout_s() + 1.0)
    with lock:
        if "response" not in box and "error" not in box:
            box["abandoned"] = True
    if box.get("abandoned"):
        raise _Retry(f"no response headers within {timeout_s() + 1.0:g} s")
    if "error" in box:
        raise box["error"]
    return box["response"]


def _content_range(value):
    m = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if not m:
        return None
    return int(m[1]), int(m[2]) + 1, None if m[3] == "*" else int(m[3])


class HubStore:
    """A model repository on the Hub (HF_ENDPOINT, or huggingface.co): the revision endpoint
    pins a branch or tag to its commit, the tree endpoint lists files with their sizes and
    ETags (an LFS file's is its sha256), resolve/<commit> serves ranges."""

    def __init__(self, repo: str, revision: str, traffic: Traffic):
        self.repo, self.revision, self.traffic = repo, revision, traffic
        self.endpoint = hub_endpoint()
        self.label = f"hf://{repo}" + (f"@{revision}" if revision != "main" else "")
        try:
            from huggingface_hub import get_token
        except ImportError:
            _session()  # the one line naming the package
        # the user's token (HF_TOKEN, the token file `hf auth login` wrote): sent to the Hub's origin
        # only, never shown. Not build_hf_headers: it also asks the Hub which agent harness runs us.
        token = get_token()
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._has_token = bool(token)
        trusted = {_origin(self.endpoint)}  # not huggingface.co when HF_ENDPOINT names another Hub
        self.http = Http(self.label, headers, trusted, traffic, self._status)

    @property
    def key(self) -> str:
        host = urlparse(self.endpoint).netloc.replace(":", "_")
        return f"hf/{host}/models--{self.repo.replace('/', '--')}"

    def _status(self, status: int, headers, what: str):
        code = headers.get("x-error-code", "")
        if status < 400:
            return None
        if code == "GatedRepo" or (status == 403 and "gated" in headers.get("x-error-message", "").lower()):
            return InputError(f"{self.label}: gated: accept its terms at {self.endpoint}/{self.repo} and log in "
                              "with that account (hf auth login, or HF_TOKEN)")
        if code == "RevisionNotFound":
            return InputError(f"{self.label}: no revision '{self.revision}' (a branch, a tag or a commit sha)")
        if code == "EntryNotFound" or (status == 404 and code not in ("RepoNotFound", "")):
            return InputError(f"{self.label}: {what}: no such file at {self.revision}")
        if status in (401, 404) or code == "RepoNotFound":
            why = ("this token cannot read it" if self._has_token else
                   "no token was found: log in (hf auth login) or set HF_TOKEN")
            return InputError(f"{self.label}: repository not found, or private and {why}")
        if status == 403:
            return InputError(f"{self.label}: {what}: forbidden (HTTP 403): this token cannot read it")
        return InputError(f"{self.label}: {what}: HTTP {status}")

    def _api(self, *parts: str) -> str:
        return f"{self.endpoint}/api/models/{self.repo}/" + "/".join(parts)

    def commit(self) -> str:
        data, _ = self.http.json(self._api("revision", quote(self.revision, safe="")), "the revision")
        sha = data.get("sha") if isinstance(data, dict) else None
        if not isinstance(sha, str) or not HEX40.fullmatch(sha):
            raise InputError(f"{self.label}: the revision endpoint gave no commit sha")
        return sha

    def listing(self, commit: str, folder: str) -> dict[str, FileMeta]:
        """The files directly in `folder` (the repo's root: ""), with sizes and ETags."""
        url = self._api("tree", commit, *([quote(folder)] if folder else [])) + "?recursive=false&expand=false"
        files, pages = {}, 0
        while url:
            pages += 1
            if pages > MAX_PAGES or len(files) > MAX_FILES:
                raise InputError(f"{self.label}: the tree listing of {folder or 'the repository'} has over "
                                 f"{MAX_FILES:,} files or {MAX_PAGES} pages; refused")
            entries, url = self.http.json(url, f"the file list of {folder or 'the repository'}")
            if not isinstance(entries, list):
                raise InputError(f"{self.label}: the tree endpoint gave no list")
            for entry in entries:
                if not isinstance(entry, dict) or entry.get("type") != "file":
                    continue
                lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else None
                etag = (lfs or {}).get("oid") or (lfs or {}).get("sha256") or entry.get("oid")
                size = entry.get("size")
                if not isinstance(entry.get("path"), str) or type(size) is not int or size < 0:
                    raise InputError(f"{self.label}: the tree endpoint gave a malformed entry")
                files[entry["path"]] = FileMeta(size, etag_of(etag))
        return files

    def url(self, commit: str, path: str) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{commit}/{quote(path)}"

    def read(self, commit: str, path: str, start: int, end: int, meta: FileMeta) -> bytes:
        return self.http.range(self.url(commit, path), start, end, meta, path)


class HttpStore:
    """A checkpoint behind plain HTTPS (a mirror, a presigned URL's host): files are found by
    name with HEAD; no token is sent."""

    def __init__(self, base: str, traffic: Traffic):
        self.base, self.traffic, self.label = base, traffic, base
        self.http = Http(base, {}, set(), traffic, self._status)

    @property
    def key(self) -> str:
        import hashlib

        p = urlparse(self.base)
        return f"https/{p.netloc.replace(':', '_')}/{hashlib.sha256(self.base.encode()).hexdigest()[:16]}"

    def _status(self, status: int, headers, what: str):
        if status < 400:
            return None
        if status == 404:
            return _Missing(f"{self.label}: {what}: not found (HTTP 404)")
        if status in (401, 403):
            return InputError(f"{self.label}: {what}: HTTP {status}: the server refuses it without credentials")
        return InputError(f"{self.label}: {what}: HTTP {status}")

    def stat(self, path: str) -> FileMeta | None:
        try:
            headers, seen = self.http.call("HEAD", urljoin(self.base, quote(path)), path,
                                           {"Accept-Encoding": "identity"})
        except _Missing:
            return None
        size = seen.get("x-linked-size") or headers.get("content-length")
        if size is None or not str(size).isdigit():
            raise InputError(f"{self.label}: {path}: the server gives no size; refused")
        etag = etag_of(seen.get("x-linked-etag") or headers.get("etag"))
        if not etag:  # no ETag: the size and Last-Modified stand for the content (a blob per version, not per name)
            etag = f"size-{size}-{headers.get('last-modified', '')}"
        return FileMeta(int(size), etag)

    def read(self, commit, path: str, start: int, end: int, meta: FileMeta) -> bytes:
        return self.http.range(urljoin(self.base, quote(path)), start, end, meta, path)


class _Missing(InputError):
    pass


class FsspecStore:
    """s3://, gs://, az:// through fsspec and the backend the user installed (s3fs, gcsfs,
    adlfs), with its own credentials chain and retries."""

    def __init__(self, protocol: str, root: str, traffic: Traffic):
        self.kind, self.root, self.traffic = protocol, root.rstrip("/"), traffic
        self.label = f"{protocol}://{self.root}"
        try:
            import fsspec

            self.fs = fsspec.filesystem(protocol, skip_instance_cache=True)  # the environment may have changed
        except ImportError:
            package = PACKAGES.get(protocol, "its fsspec backend")
            raise InputError(f"{self.label}: reading {protocol}:// needs {package}: pip install {package}") from None
        except ValueError as exc:
            raise InputError(f"{self.label}: {exc}") from None

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.root.replace('/', '--')}"

    def _fail(self, exc: Exception, what: str) -> InputError:
        if isinstance(exc, FileNotFoundError):
            return InputError(f"{self.label}: {what}: not found")
        if isinstance(exc, PermissionError):
            return InputError(f"{self.label}: {what}: access denied: check the credentials "
                              f"{PACKAGES.get(self.kind, 'the backend')} finds")
        first = (str(exc).splitlines() or [""])[0][:200]
        return InputError(f"{self.label}: {what}: {type(exc).__name__}: {first}")

    def listing(self, folder: str) -> dict[str, FileMeta]:
        path = f"{self.root}/{folder}".rstrip("/") if folder else self.root
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except Exception as exc:
            raise self._fail(exc, folder or "the listing") from None
        self.traffic.add(requests=1)
        files = {}
        for entry in entries:
            if entry.get("type") != "file":
                continue
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            etag = entry.get("ETag") or entry.get("etag") or entry.get("md5Hash") or entry.get("generation")
            if not etag:
                etag = f"size-{entry.get('size')}-{entry.get('LastModified') or entry.get('mtime') or ''}"
            size = entry.get("size")
            if type(size) is not int or size < 0:  # what the backend says of the object, as it says it
                raise InputError(f"{self.label}: {name}: the listing gives no size ({size!r}); refused")
            files[(f"{folder}/" if folder else "") + name] = FileMeta(size, etag_of(etag))
        return files

    def read(self, commit, path: str, start: int, end: int, meta: FileMeta) -> bytes:
        full = f"{self.root}/{path}"
        try:
            data = self.fs.cat_file(full, start=start, end=end)
        except Exception as exc:
            raise self._fail(exc, path) from None
        self.traffic.add(requests=1, nbytes=len(data))
        if len(data) != end - start:
            raise InputError(f"{self.label}: {path}: asked for bytes {start}..{end}, got {len(data)} bytes; refused")
        return data
