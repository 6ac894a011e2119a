"""A checkpoint where it lives (hf://, s3://, gs://, az://, https://), read by byte range.

It becomes a sparse local copy in parity's cache, laid out as huggingface_hub lays out its own
(snapshots/<commit>/ linking into blobs/<etag>), so the local readers open it unchanged: the
config and the shard index whole, each shard as a file of its true size where only the ranges
read so far are filled. sources.localread fetches any range before it is read; the norm
tensors' ranges are fetched up front, coalesced, in parallel. Blobs are keyed by ETag (an LFS
file's is its sha256), snapshots by commit, so a rerun of a pinned revision reads nothing.

Torch-free, and nothing network-related is imported until a URL is opened."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.stores import PACKAGES, hub_endpoint, offline

SCHEMES = ("hf://", "s3://", "gs://", "gcs://", "az://", "abfs://", "abfss://", "https://", "http://")
HEAD_BYTES = 64 << 10  # first fetch of a safetensors shard: its 8-byte length and (usually) the whole header
AHEAD_START, AHEAD_MAX = 256 << 10, 16 << 20  # sequential read-ahead (a GGUF header), doubling
GAP = 64 << 10  # two wanted ranges closer than this are fetched as one
MAX_SPAN = 8 << 20  # one request's bytes, at most
MAX_RANGES_BYTES = 16 << 20  # a .ranges or listing file of the cache, at most (read, never trusted further)
WORKERS = 8


def is_url(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def _escapes(path: str) -> bool:
    """Whether a name taken from a URL, an index or a listing could leave the folder it is joined
    to (absolute, a backslash, an empty, '.' or '..' part), or is no name a file system can hold
    (a NUL, as hf://org/name@a%00b decodes to)."""
    return (path.startswith("/") or "\\" in path or "\0" in path
            or any(part in ("", ".", "..") for part in path.split("/")))


def cache_root() -> Path:
    """PARITY_CACHE, or parity/ beside huggingface_hub's cache (HF_HOME, ~/.cache/huggingface)."""
    if os.environ.get("PARITY_CACHE"):
        return Path(os.environ["PARITY_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "parity"


def guarded_root() -> Path:
    """The cache root, made 0700 where it is new. Refused in one line where it is not a directory,
    another user owns it, or a group or others may write it (a shared or restored CI cache): whoever
    can write the cache could plant links that choose where parity writes (issue 48)."""
    import stat

    root = cache_root()
    try:
        if not root.exists():
            root.parent.mkdir(parents=True, exist_ok=True)
            root.mkdir(mode=0o700, exist_ok=True)
        st = os.stat(root)
    except OSError as exc:
        raise InputError(f"{root}: parity's cache: {exc.strerror or exc}") from None
    except ValueError:
        raise InputError(f"{root}: parity's cache: not a usable directory name") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{root}: parity's cache is not a directory; refused (PARITY_CACHE)")
    if st.st_uid != os.geteuid():
        raise InputError(f"{root}: parity's cache belongs to uid {st.st_uid}, not this user ({os.geteuid()}); "
                         "refused: another user could plant links in it (set PARITY_CACHE to a directory of yours)")
    if st.st_mode & 0o022:
        raise InputError(f"{root}: parity's cache may be written by {'others' if st.st_mode & 0o002 else 'its group'} "
                         f"(mode {stat.S_IMODE(st.st_mode):o}); refused: whoever can write it could plant links that "
                         f"choose where parity writes (chmod go-w {root})")
    return root


def no_link(path: Path, root: Path | None = None, allowed: str | None = None) -> Path:
    """`path` inside the cache with no symbolic link on the way from the cache root (the root itself
    may be one: the user's choice), checked with lstat; a link planted there (snapshots/<commit> to an
    outside folder, blobs/<sha> to an outside file, a dangling one) would redirect a write out of the
    cache. `allowed`: the one target `path` itself may link to (a snapshot entry's fallback link to
    its own blob where hard links fail)."""
    import stat

    root = root or cache_root()
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        raise InputError(f"{path}: outside parity's cache {root}; refused") from None
    if any(part in (".", "..") for part in parts):  # a name read from the cache itself, leading out of it
        raise InputError(f"{path}: a '..' inside parity's cache; refused")
    at = root
    for k, part in enumerate(parts):
        at = at / part
        try:
            st = os.lstat(at)
        except FileNotFoundError:
            return path
        except OSError as exc:
            raise InputError(f"{at}: parity's cache: {exc.strerror or exc}") from None
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(at)
            if k == len(parts) - 1 and allowed is not None and target == allowed:
                return path
            raise InputError(f"{at}: a symbolic link inside parity's cache (to {target}); refused: a link planted "
                             "there would send parity's writes outside it (parity cache clear removes it)")
    return path


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open inside the cache, never through a link (O_NOFOLLOW: a link that appeared since no_link)."""
    no_link(path)
    try:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the name is a link
            raise InputError(f"{path}: a symbolic link inside parity's cache; refused (parity cache clear removes "
                             "it)") from None
        raise


@dataclass(frozen=True)
class Location:
    scheme: str  # hf, s3, gs, az, https
    repo: str  # hf: org/name; fsspec: bucket/prefix; https: the base URL
    revision: str  # hf only ("main" when none is named)
    sub: str  # a folder in the repo, or a file (a .gguf, a lone .safetensors)
    url: str

    @property
    def is_file(self) -> bool:
        return self.sub.endswith(".gguf")


def parse(url: str) -> Location:
    from urllib.parse import unquote

    scheme, rest = url.split("://", 1)
    if scheme == "hf":
        m = re.fullmatch(r"(?:models/)?([\w.-]+/[\w.-]+)(?:@([^/]+))?(?:/(.*))?", rest)
        if not m or rest.startswith(("datasets/", "spaces/")):
            raise InputError(f"{url}: expected hf://ORG/NAME[@REVISION][/PATH] (a model repository)")
        revision = unquote(m[2] or "main")
        if _escapes(revision):
            raise InputError(f"{url}: revision '{revision}' is not a branch, tag or commit name")
        sub = (m[3] or "").strip("/")
        if sub and _escapes(sub):
            raise InputError(f"{url}: the path in the repository has an empty, '.' or '..' part")
        return _checked(Location("hf", m[1], revision, sub, url))
    if scheme in ("https", "http"):
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.username or parts.password or parts.query or parts.fragment:
            raise InputError(f"{parts.scheme}://{parts.hostname}/...: a URL with credentials or a query (a presigned "
                             "URL) would be written into the report and the cache; refused")
        base, _, last = url.rpartition("/")
        if last.endswith((".gguf", ".safetensors")):
            return _checked(Location("https", base + "/", "", last, url))
        return Location("https", url.rstrip("/") + "/", "", "", url)
    scheme = "gs" if scheme == "gcs" else scheme
    path = rest.strip("/")
    if not path or _escapes(path):
        raise InputError(f"{url}: expected {scheme}://BUCKET/PATH")
    if path.endswith((".gguf", ".safetensors")):
        folder, _, name = path.rpartition("/")
        return _checked(Location(scheme, folder, "", name, url))
    return Location(scheme, path, "", "", url)


def _checked(loc: Location) -> Location:
    """A URL naming a .safetensors file names no config: the folder holding both is the checkpoint."""
    if loc.sub.endswith(".safetensors"):
        folder = loc.url[: -len(loc.sub.rpartition("/")[2])].rstrip("/")
        raise InputError(f"{loc.url}: a safetensors file has no config to check against; name the folder that holds "
                         f"it and config.json: {folder}")
    return loc


@dataclass(eq=False)
class Blob:
    """One remote file's sparse copy and the byte ranges of it that are filled (a .ranges file
    beside it, so a later process knows them); fetching fills, under a lock file."""

    path: Path
    name: str  # the file's path in its repository
    meta: object  # stores.FileMeta
    fetch: object  # (start, end) -> bytes
    mirror: object
    _have: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ahead: int = AHEAD_START
    hub: bool = False  # a Hub file: its ETag names its content (an LFS file's sha256, a small file's git sha1)
    _digests: dict = field(default_factory=dict)  # (start, end) of each range fetched -> its sha256
    _verified: set = field(default_factory=set)  # ranges whose bytes this process has checked

    def __post_init__(self):
        self._have = self._read_have()

    @property
    def size(self) -> int:
        return self.meta.size

    def _ranges_file(self) -> Path:
        return self.path.with_name(self.path.name + ".ranges")

    def _read_have(self) -> list:
        """The ranges the cache holds: those a recorded digest covers (a claim without one, planted or
        from an older parity, is fetched again: a sparse blob's unfetched bytes read as zeros)."""
        try:
            fd = _open(self._ranges_file(), os.O_RDONLY)
            with os.fdopen(fd, "rb") as fh:
                data = json.loads(fh.read(MAX_RANGES_BYTES))
            digests = {(int(a), int(b)): str(h) for a, b, h in data.get("digests", [])
                       if 0 <= int(a) < int(b) <= self.size and re.fullmatch(r"[0-9a-f]{64}", str(h))}
        except (OSError, ValueError, KeyError, TypeError, RecursionError, AttributeError, OverflowError):
            return []  # a file parity did not write (a list, 1e400): no claim believed
        if sum(b - a for a, b in digests) > 2 * self.size:  # parity's ranges are disjoint but for a race: a file
            return _merged(list(self._digests))  # of overlapping claims would cost a hash of the blob each; none kept
        self._verified -= {k for k, h in digests.items() if self._digests.get(k) not in (None, h)}  # rewritten
        self._digests.update(digests)
        return _merged(list(self._digests))

    def missing(self, start: int, end: int) -> list:
        gaps, at = [], start
        for a, b in self._have:
            if b <= at:
                continue
            if a >= end:
                break
            if a > at:
                gaps.append((at, min(a, end)))
            at = max(at, b)
            if at >= end:
                break
        if at < end:
            gaps.append((at, end))
        return gaps

    def ensure(self, offset: int, n: int, ahead: bool = False) -> None:
        end = min(offset + n, self.size)
        if offset >= end:
            return
        self._checked(offset, end)  # every cached part of the read, before it is read: one that differs is a gap
        if not self.missing(offset, end):
            return
        with self._lock:
            self._have = _merged(self._have + self._read_have())  # another process may have fetched it
            if ahead:
                end = min(self.size, max(end, offset + self._ahead))
                self._ahead = min(AHEAD_MAX, self._ahead * 2)
            gaps = self.missing(offset, end)
        if not self._checked(offset, end):  # what another process recorded meanwhile is checked as well
            gaps = self.missing(offset, end)
        if gaps:
            self.fill(gaps)

    def fill(self, gaps: list) -> None:
        datas = [(a, b, self.fetch(a, b)) for a, b in gaps]
        self.store(datas)

    def store(self, datas: list) -> None:
        import fcntl

        try:
            fd = _open(self.path, os.O_WRONLY)
            try:
                for a, _, data in datas:
                    if os.pwrite(fd, data, a) != len(data):
                        raise OSError(28, "No space left on device")
                os.fsync(fd)  # the bytes are on disk before the .ranges file says they are
            finally:
                os.close(fd)
        except OSError as exc:
            raise InputError(f"{cache_root()}: cannot write parity's cache ({self.name}): {exc.strerror or exc}") \
                from None
        with self._lock:
            try:
                with os.fdopen(_open(self.path.with_name(self.path.name + ".lock"), os.O_WRONLY | os.O_CREAT |
                                     os.O_APPEND), "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # another process filling the same blob
                    self._read_have()
                    for a, b, data in datas:
                        self._digests[a, b] = hashlib.sha256(data).hexdigest()
                        self._verified.add((a, b))  # the bytes just written are these
                    self._have = _merged(list(self._digests))
                    self._write_ranges()
            except OSError as exc:
                raise InputError(f"{cache_root()}: cannot write parity's cache ({self.name}): "
                                 f"{exc.strerror or exc}") from None
        self.mirror.progress()

    def filled(self) -> int:
        return sum(b - a for a, b in self._have)

    def _checked(self, start: int, end: int) -> bool:
        """Whether the cached bytes of [start, end) are those fetched: each recorded range that overlaps
        it hashed once a process against its digest. A range that differs (a poisoned blob) loses its
        claim, said in one line, and the caller fetches it again: never a verdict on planted bytes."""
        bad = [(a, b) for a, b in self._overlapping(start, end) if not self._intact(a, b)]
        if not bad:
            return True
        self._drop(bad)
        sys.stderr.write(f"parity: warning: {self.mirror.label(self.name)}: {len(bad)} cached range(s) differ from "
                         "what was fetched (a changed or planted cache file); fetched again\n")
        return False

    def _overlapping(self, start: int, end: int) -> list:
        return [(a, b) for a, b in self._digests if a < end and b > start and (a, b) not in self._verified]

    def _intact(self, a: int, b: int) -> bool:
        try:
            fd = _open(self.path, os.O_RDONLY)
            try:
                data = os.pread(fd, b - a, a)
            finally:
                os.close(fd)
        except OSError:
            return False
        ok = len(data) == b - a and hashlib.sha256(data).hexdigest() == self._digests.get((a, b))
        if ok:
            self._verified.add((a, b))
        return ok

    def verify(self) -> tuple[int, int]:
        """(ranges checked, ranges whose claims were dropped): every recorded range, as `parity cache
        verify` asks; a blob fetched whole is also checked against the hash its ETag names."""
        self._verified.clear()
        keys = list(self._digests)
        bad = [k for k in keys if not self._intact(*k)]
        if self.whole_mismatch():
            bad = keys
        if bad:
            self._drop(bad)
        return len(keys), len(bad)

    def _drop(self, bad: list) -> None:
        """The claims of `bad` ranges forgotten here and in the .ranges file (under its lock): the next
        read of them fetches them again."""
        import fcntl

        with self._lock:
            try:
                with os.fdopen(_open(self.path.with_name(self.path.name + ".lock"), os.O_WRONLY | os.O_CREAT |
                                     os.O_APPEND), "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self._read_have()
                    for key in bad:
                        self._digests.pop(key, None)
                        self._verified.discard(key)
                    self._have = _merged(list(self._digests))
                    self._write_ranges()
            except OSError as exc:
                raise InputError(f"{cache_root()}: cannot write parity's cache ({self.name}): "
                                 f"{exc.strerror or exc}") from None

    def _write_ranges(self) -> None:
        _write_atomic(self._ranges_file(), json.dumps({
            "etag": self.meta.etag, "size": self.size, "ranges": self._have,
            "digests": [[a, b, h] for (a, b), h in sorted(self._digests.items())]}))

    def whole_mismatch(self) -> bool:
        """A blob held whole whose content is not the one its ETag names (the Hub's: an LFS file's
        sha256, a small file's git blob sha1)."""
        etag = (self.meta.etag or "").lower()
        if not self.hub or self._have != [(0, self.size)] or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", etag):
            return False
        digest = hashlib.sha256() if len(etag) == 64 else hashlib.sha1(b"blob %d\0" % self.size)
        try:
            fd = _open(self.path, os.O_RDONLY)
            try:
                for at in range(0, self.size, 1 << 22):
                    digest.update(os.pread(fd, min(1 << 22, self.size - at), at))
            finally:
                os.close(fd)
        except OSError:
            return True
        return digest.hexdigest() != etag


def _coalesced(ranges: list) -> list:
    """Wanted ranges as requests: neighbours closer than GAP share one where the gap is no larger
    than the bytes wanted (so a request fetches at most twice what it needs) and a request stays
    under MAX_SPAN: a hostile header spacing tiny tensors just under GAP apart would otherwise make
    one request of a whole shard."""
    out: list = []
    wanted = waste = 0
    for a, b in _merged(ranges):
        gap = a - out[-1][1] if out else 0
        if out and gap <= GAP and waste + gap <= wanted + (b - a) and b - out[-1][0] <= MAX_SPAN:
            out[-1] = (out[-1][0], b)
            wanted, waste = wanted + (b - a), waste + gap
        else:
            out.append((a, b))
            wanted, waste = b - a, 0
    return [(x, min(x + MAX_SPAN, b)) for a, b in out for x in range(a, b, MAX_SPAN)]


def _merged(ranges: list, gap: int = 0) -> list:
    out: list = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Mirror:
    """A remote checkpoint's sparse copy, what it was read from, and what reading it cost."""

    def __init__(self, loc: Location):
        from parity_cli.sources import stores

        self.loc, self.traffic = loc, stores.Traffic()
        self.commit = None
        if loc.scheme == "hf":
            self.store = stores.HubStore(loc.repo, loc.revision, self.traffic)
        elif loc.scheme == "https":
            self.store = stores.HttpStore(loc.repo, self.traffic)
        else:
            self.store = stores.FsspecStore(loc.scheme, loc.repo, self.traffic)
        self.base = guarded_root() / self.store.key
        self.blobs: dict[str, Blob] = {}
        self._listing: dict | None = None
        self._shown, self._shown_bytes = 0.0, -1
        self.cached_at_start = 0

    # -- where ---------------------------------------------------------------------------------
    @property
    def folder(self) -> str:
        return self.loc.sub.rpartition("/")[0] if self.loc.is_file else self.loc.sub

    @property
    def root(self) -> str:
        """The repository (at its commit), bucket or base URL that file names are relative to."""
        if self.loc.scheme == "hf":
            return f"hf://{self.loc.repo}@{self.commit}"
        return self.loc.repo.rstrip("/") if self.loc.scheme == "https" else f"{self.loc.scheme}://{self.loc.repo}"

    @property
    def pinned(self) -> str:
        if self.loc.scheme != "hf":
            return self.loc.url
        return f"hf://{self.loc.repo}@{self.commit}" + (f"/{self.loc.sub}" if self.loc.sub else "")

    def resolve(self) -> None:
        """The commit (hf: from the cache when the revision is a sha, or offline) and the listing."""
        from parity_cli.sources import stores

        if self.loc.scheme == "hf":
            rev = self.loc.revision
            ref = self.base / "refs" / rev.replace("/", "%2F")
            if stores.HEX40.fullmatch(rev):
                self.commit = rev
            elif offline() and no_link(ref).is_file():
                self.commit = ref.read_text()[:64].strip()
                if not stores.HEX40.fullmatch(self.commit):  # a planted ref naming ../../x would leave the cache
                    raise InputError(f"{ref}: not a commit sha; refused (parity cache clear removes it)")
            elif offline():
                raise InputError(f"{self.store.label}: HF_HUB_OFFLINE is set and revision '{rev}' was never resolved "
                                 "here; name its commit sha")
            else:
                self.commit = self.store.commit()
                _write_atomic(ref, self.commit)
            self.snapshot = self.base / "snapshots" / self.commit
        else:
            self.snapshot = None  # an object store has no commit: the snapshot is named by its listing
        self._listing = self._cached_listing()

    def _cached_listing(self) -> dict:
        from parity_cli.sources.stores import FileMeta

        if self.loc.scheme == "https":  # no listing: found by name with HEAD, linked to the blob of the ETag seen
            self.snapshot = self.base / "snapshots" / "latest"
            return {}
        if self.snapshot is not None:
            saved = self.snapshot / ".parity" / f"listing-{_digest(self.folder)[:24]}.json"
            try:
                with os.fdopen(_open(saved, os.O_RDONLY), "rb") as fh:
                    data = json.loads(fh.read(MAX_RANGES_BYTES))
                return {k: FileMeta(int(v["size"]), str(v["etag"])) for k, v in data.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                pass
            files = self.store.listing(self.commit, self.folder)
            _write_atomic(saved, json.dumps({k: {"size": v.size, "etag": v.etag} for k, v in files.items()}))
            return files
        files = self.store.listing(self.folder)
        import hashlib

        digest = hashlib.sha256(json.dumps(sorted((k, v.size, v.etag) for k, v in files.items())).encode())
        self.snapshot = self.base / "snapshots" / digest.hexdigest()[:16]
        return files

    def meta(self, name: str):
        """A file's size and ETag, or None where the checkpoint has no such file."""
        if self.loc.scheme == "https":
            if name not in self._listing:
                self._listing[name] = self.store.stat(name)
            return self._listing[name]
        return self._listing.get(name)

    def names(self) -> list[str]:
        return sorted(self._listing) if self._listing else []

    def label(self, name: str) -> str:
        return f"{self.root}/{name}"

    # -- bytes ---------------------------------------------------------------------------------
    def blob(self, name: str) -> Path:
        """The snapshot's path of `name`, a hard link to its blob (created sparse, of its size)."""
        from parity_cli.sources.localread import back

        if _escapes(name):
            raise InputError(f"{self.store.label}: file name {name!r} would leave the checkpoint's folder; refused")
        meta = self.meta(name)
        if meta is None:
            raise InputError(f"{self.label(name)}: no such file")
        key = _safe(meta.etag) if re.fullmatch(r"[0-9A-Za-z_-]{8,128}", meta.etag or "") else _digest(meta.etag, name)
        blob = self.base / "blobs" / key
        link = self.snapshot / name
        relative = os.path.relpath(blob, link.parent)  # the one link a snapshot entry may be (hard links failing)
        try:
            _make_dirs(blob.parent)
            _make_dirs(link.parent)
            no_link(blob)
            no_link(link, allowed=relative)
            made = False
            if not os.path.lexists(blob):
                try:
                    fd = _open(blob, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                    made = True
                except FileExistsError:  # another process made it meanwhile: it is that one's, claims and all
                    fd = None
                if fd is not None:
                    try:
                        os.ftruncate(fd, meta.size)
                    finally:
                        os.close(fd)
                if made:  # a blob deleted by hand left its claims behind: they are not this file's
                    blob.with_name(blob.name + ".ranges").unlink(missing_ok=True)
            if not made and blob.stat().st_size != meta.size:
                raise InputError(f"{self.label(name)}: the cached copy for ETag {meta.etag} has "
                                 f"{blob.stat().st_size} bytes, the file {meta.size}; run parity cache clear")
            if os.path.lexists(link) and not os.path.samefile(link, blob):  # a name whose ETag changed (https)
                link.unlink()
            if not os.path.lexists(link):
                try:
                    os.link(blob, link)
                except OSError:
                    link.symlink_to(relative)
        except OSError as exc:
            raise InputError(f"{cache_root()}: cannot write parity's cache ({name}): {exc.strerror or exc}") from None
        held = Blob(blob, name, meta, lambda a, b, n=name, m=meta: self.store.read(self.commit, n, a, b, m), self,
                    hub=self.loc.scheme == "hf")
        self.cached_at_start += held.filled()
        self.blobs[name] = held
        back(link, held)
        return link

    def whole(self, name: str, cap: int) -> Path:
        """A small file (config, index) fetched whole, at most `cap` bytes."""
        meta = self.meta(name)
        if meta is not None and meta.size > cap:
            raise InputError(f"{self.label(name)}: {meta.size} bytes, over the {cap >> 20} MiB it may have; refused")
        link = self.blob(name)
        held = self.blobs[name]
        held.ensure(0, meta.size)
        if held.whole_mismatch():  # a file held whole is the one its ETag names, or it is fetched again
            held._drop(list(held._digests))
            sys.stderr.write(f"parity: warning: {self.label(name)}: the cached copy is not the file its ETag "
                             f"{meta.etag} names; fetched again\n")
            held.ensure(0, meta.size)
            if held.whole_mismatch():
                raise InputError(f"{self.label(name)}: the server sent bytes that are not the file its ETag "
                                 f"{meta.etag} names; refused")
        return link

    def prefetch(self, wanted: list) -> None:
        """(snapshot path, offset, nbytes) ranges, coalesced per file, fetched on WORKERS threads."""
        by_link = {self.snapshot / name: held for name, held in self.blobs.items()}
        by_blob: dict = {}
        for path, offset, n in wanted:
            held = by_link.get(Path(path))
            if held is not None and n > 0:
                by_blob.setdefault(held, []).append((offset, offset + n))
        self._fetch(by_blob)

    def heads(self, names: list, nbytes: int) -> None:
        """The first bytes of several files at once (safetensors headers)."""
        self._fetch({self.blobs[n]: [(0, min(nbytes, self.blobs[n].size))] for n in names})

    def _fetch(self, by_blob: dict) -> None:
        from concurrent.futures import ThreadPoolExecutor

        tasks = []
        for held, ranges in by_blob.items():
            for a, b in _coalesced(ranges):
                tasks.extend((held, gap) for gap in held.missing(a, b))
        if not tasks:
            return
        with ThreadPoolExecutor(min(WORKERS, len(tasks))) as pool:
            done = pool.map(lambda t: (t[0], t[1][0], t[1][1], t[0].fetch(*t[1])), tasks)
            for held, a, b, data in done:
                held.store([(a, b, data)])

    # -- what it cost ----------------------------------------------------------------------------
    def total(self) -> int:
        return sum(b.size for b in self.blobs.values())

    def progress(self, final: bool = False) -> None:
        """On a terminal: bytes fetched out of the checkpoint's total ("2.1 MB of 810 GB")."""
        if not sys.stderr.isatty():
            return
        now = time.monotonic()
        if (not final and now - self._shown < 0.1) or (final and self._shown_bytes == self.traffic.bytes):
            return  # at most 10 a second; the final line once per bytes fetched (a second open prints none)
        self._shown = now
        if final:
            self._shown_bytes = self.traffic.bytes
        sys.stderr.write(f"\r{self.store.label}: fetched {human(self.traffic.bytes)} of {human(self.total())}"
                         + ("\n" if final else ""))
        sys.stderr.flush()

    def environment(self) -> tuple:
        """What another process needs to open this copy as this one does (a --jobs worker)."""
        env = {"PARITY_CACHE": str(cache_root())}
        if self.loc.scheme == "hf":
            env["HF_ENDPOINT"] = self.store.endpoint
        return tuple(sorted(env.items()))

    def record(self) -> dict:
        """What a report records: where, pinned, each file's ETag, and what reading cost."""
        out = {"url": self.loc.url, "pinned": self.pinned, "store": self.loc.scheme}
        if self.loc.scheme == "hf":
            out.update(repo=self.loc.repo, revision=self.loc.revision, commit=self.commit,
                       endpoint=self.store.endpoint)
        out["files"] = {name: {"size": b.size, "etag": b.meta.etag} for name, b in sorted(self.blobs.items())}
        out["bytes_total"] = self.total()
        out["bytes_fetched"] = self.traffic.bytes
        out["requests"] = self.traffic.requests
        out["bytes_cached"] = self.cached_at_start
        return out


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1000
    return str(n)


def _safe(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z._-]", "_", text)


def _digest(*parts: str) -> str:
    import hashlib

    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _make_dirs(path: Path) -> None:
    """mkdir -p inside the cache, each existing part checked to be no link first."""
    no_link(path)
    path.mkdir(parents=True, exist_ok=True)
    no_link(path)  # a part made by another process meanwhile: a directory, never a link


def _write_atomic(path: Path, text: str) -> None:
    """A cache file replaced whole: written to a new file beside it (O_EXCL, never through a link),
    then renamed over the name (a rename replaces a link planted there, never writes through it)."""
    try:
        _make_dirs(path.parent)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")
        if os.path.lexists(tmp):
            os.unlink(tmp)
        with os.fdopen(_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise InputError(f"{cache_root()}: cannot write parity's cache ({path.name}): {exc.strerror or exc}") from None


_OPEN: dict[str, Mirror] = {}  # (url, endpoint, cache) -> its mirror, once per process
_SHOWN: dict[str, str] = {}  # a snapshot directory -> the URL it stands for, in messages


def materialise(url: str) -> tuple[Path, Mirror]:
    """The local path the readers open (a snapshot directory, or a .gguf in it), and its mirror.
    Only the config, the index and (lazily) headers are fetched here."""
    key = f"{url}\0{hub_endpoint()}\0{cache_root()}"
    if key in _OPEN:
        mirror = _OPEN[key]
        return _entry(mirror), mirror
    from parity_cli.sources.jsonfile import MAX_BYTES

    loc = parse(url)
    mirror = Mirror(loc)
    mirror.resolve()
    if loc.is_file:
        mirror.blob(loc.sub)
    else:
        prefix = f"{loc.sub}/" if loc.sub else ""
        if mirror.meta(prefix + "config.json") is None:
            ggufs = [n for n in mirror.names() if n.endswith(".gguf")]
            hint = f"; name one of its {len(ggufs)} .gguf files: {loc.url.rstrip('/')}/{ggufs[0].rsplit('/', 1)[-1]}" \
                if ggufs else ""
            raise InputError(f"{mirror.label(prefix + 'config.json')}: no config.json{hint}")
        mirror.whole(prefix + "config.json", MAX_BYTES["config"])
        index = prefix + "model.safetensors.index.json"
        if mirror.meta(index) is not None:
            from parity_cli.sources.jsonfile import load

            data = load(mirror.whole(index, MAX_BYTES["index"]), "the index", "index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise InputError(f"{mirror.label(index)}: no valid 'weight_map' object")
            shards = sorted(set(weight_map.values()))
            bad = [s for s in shards if _escapes(s)]
            if bad:
                raise InputError(f"{mirror.label(index)}: shard {str(bad[0])!r} points outside the checkpoint's "
                                 "folder; refused")
            named = [prefix + s for s in shards if mirror.meta(prefix + s) is not None]
            for name in named:
                mirror.blob(name)
            mirror.heads(named, HEAD_BYTES)  # every shard's header at once, not one after another
        elif mirror.meta(prefix + "model.safetensors") is not None:
            mirror.blob(prefix + "model.safetensors")
            mirror.heads([prefix + "model.safetensors"], HEAD_BYTES)
        else:
            pickles = [n.rsplit("/", 1)[-1] for n in mirror.names() if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
            if pickles:
                raise InputError(f"{mirror.pinned}: only pickle weights ({', '.join(sorted(pickles)[:3])}); they are "
                                 "never unpickled, and a repository without safetensors cannot be read by range")
    _OPEN[key] = mirror
    _SHOWN[str(mirror.snapshot)] = mirror.root
    return _entry(mirror), mirror


def _entry(mirror: Mirror) -> Path:
    return mirror.snapshot / mirror.loc.sub if mirror.loc.sub else mirror.snapshot


def norm_ranges(ckpt) -> list:
    """(file, offset, nbytes) of every tensor a norm layer may read: 1-D floating tensors of at
    most MAX_NORM_ELEMENTS (gains, biases, BatchNorm statistics). One that is not among them is
    still fetched when read, one request of its own."""
    from parity_cli.sources.huggingface import NORM_DTYPE_CODES, read_safetensors_header
    from parity_cli.sources.tensors import MAX_NORM_ELEMENTS

    out = []
    if ckpt.format == "gguf":
        from parity_cli.sources.gguf_reader import PLAIN

        for t in ckpt._reader.tensors:
            if t.type_code in PLAIN and len(t.shape) == 1 and t.shape[0] <= MAX_NORM_ELEMENTS:
                out.append((ckpt.path, t.offset, t.shape[0] * PLAIN[t.type_code][2]))
        return out
    for file in ckpt.files:
        headers = ckpt._headers.get(file)
        if headers is None:
            headers = ckpt._headers[file] = read_safetensors_header(file)
        for info in headers.values():
            if info.code in NORM_DTYPE_CODES and len(info.shape) == 1 and info.shape[0] <= MAX_NORM_ELEMENTS:
                out.append((file, info.offset, info.nbytes))
    return out


def shown(text: str) -> str:
    """A message with each snapshot directory written as the URL it stands for."""
    for local, url in sorted(_SHOWN.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(local, url)
    return text


def cache_info() -> dict:
    """Each cached repository or bucket: its snapshots, and the bytes its blobs hold (fetched
    ranges) and take on disk (sparse: only the fetched blocks)."""
    root = cache_root()
    stores = []
    for blobs in sorted(root.glob("*/*/*/blobs")) + sorted(root.glob("*/*/blobs")):
        base = blobs.parent
        fetched = disk = files = 0
        for ranges in blobs.glob("*.ranges"):
            try:
                no_link(ranges, root)
                with os.fdopen(os.open(ranges, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
                    fetched += sum(int(b) - int(a) for a, b in json.loads(fh.read(MAX_RANGES_BYTES))["ranges"])
                blob = ranges.with_suffix("")
                disk += os.lstat(blob).st_blocks * 512
                files += 1
            except (OSError, ValueError, KeyError, TypeError, RecursionError, InputError, AttributeError, OverflowError):
                continue  # a file parity did not write (a link, nested JSON): not counted, never followed
        snapshots = sorted(p.name for p in (base / "snapshots").iterdir()) if (base / "snapshots").is_dir() else []
        stores.append({"store": str(base.relative_to(root)), "snapshots": snapshots, "files": files,
                       "bytes_fetched": fetched, "bytes_on_disk": disk})
    return {"path": str(root), "stores": stores, "bytes_fetched": sum(s["bytes_fetched"] for s in stores),
            "bytes_on_disk": sum(s["bytes_on_disk"] for s in stores)}


def cache_verify() -> dict:
    """Every cached range hashed against the digest recorded when it was fetched, and every Hub file
    held whole against the hash its ETag names; a range that differs loses its claim (the next run
    fetches it again). {"blobs", "ranges", "dropped": [(blob, ranges dropped)]}."""
    from parity_cli.sources.stores import FileMeta

    root = guarded_root()
    blobs_seen = ranges_seen = 0
    dropped = []
    for blobs in sorted(root.glob("*/*/*/blobs")) + sorted(root.glob("*/*/blobs")):
        for ranges in sorted(blobs.glob("*.ranges")):
            try:
                no_link(ranges, root)
                with os.fdopen(os.open(ranges, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
                    data = json.loads(fh.read(MAX_RANGES_BYTES))
                meta = FileMeta(int(data["size"]), str(data["etag"]))
            except (OSError, ValueError, KeyError, TypeError, RecursionError, InputError, AttributeError,
                    OverflowError):
                continue
            blob = ranges.with_suffix("")
            held = Blob(blob, blob.name, meta, None, None, hub=str(blobs.relative_to(root)).startswith("hf/"))
            checked, bad = held.verify()
            blobs_seen, ranges_seen = blobs_seen + 1, ranges_seen + checked
            if bad:
                dropped.append((str(blob.relative_to(root)), bad))
    return {"path": str(root), "blobs": blobs_seen, "ranges": ranges_seen, "dropped": dropped}


def cache_clear() -> int:
    """Removes parity's cache (only it: the directory must look like one parity made)."""
    import shutil

    root = cache_root()
    if not root.exists():
        return 0
    made = [p for p in root.iterdir() if p.name in ("hf", "https", *PACKAGES)]  # the stores' keys begin so
    others = [p.name for p in root.iterdir() if p not in made]
    if others:
        raise InputError(f"{root}: holds {', '.join(sorted(others)[:5])}, which parity did not write; not cleared")
    before = cache_info()["bytes_on_disk"]
    for p in made:
        if p.is_symlink():  # a link planted as a store's folder: the link goes, never what it points to
            p.unlink()
        else:
            shutil.rmtree(p)
    return before


def shown_in(data):
    """A report (dicts, lists, strings) with each snapshot directory written as its URL: a warning
    that names config.json names the repository's, not this machine's cache."""
    if not _SHOWN:
        return data
    if isinstance(data, str):
        return shown(data)
    if isinstance(data, dict):
        return {k: shown_in(v) for k, v in data.items()}
    if isinstance(data, list):
        return [shown_in(v) for v in data]
    return data


def cached_copy(path) -> bool:
    """Whether a local path lies in parity's cache: a sparse copy, whose unfetched bytes would read
    as zeros, so it is opened only through its URL."""
    try:
        real, root = Path(path).resolve(), cache_root().resolve()
    except OSError:
        return False
    return real == root or root in real.parents
