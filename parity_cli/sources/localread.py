"""Reads of checkpoint bytes, which a remote checkpoint may back.

A checkpoint opened from hf:// or s3:// is a sparse copy in parity's cache: every byte not
fetched yet is a hole that reads as zero. So every reader of checkpoint bytes (safetensors
headers and tensors, GGUF headers and tensors) reads through here, and a backed file fetches the
range first. A backing is keyed by the file's inode: the copy is reached through a hard link."""

from __future__ import annotations

import io
import os
from pathlib import Path

from parity_cli.errors import InputError

# (st_dev, st_ino) -> an object with ensure(offset, n, ahead: bool) (sources.remote.Blob)
_BACKED: dict[tuple[int, int], object] = {}


def back(path, backing) -> None:
    st = os.stat(path)
    _BACKED[(st.st_dev, st.st_ino)] = backing


def backing(path):
    if not _BACKED:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _BACKED.get((st.st_dev, st.st_ino))


def pread(path, n: int, offset: int) -> bytes:
    """n bytes at offset (fewer at the end of the file); OSError as os.pread raises it."""
    held = backing(path)
    if held is not None and n > 0:
        held.ensure(offset, n, ahead=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


class _Backed(io.RawIOBase):
    """Sequential reads of a backed file: each read first fetches what it needs, with read-ahead
    (a GGUF header is parsed a few bytes at a time)."""

    def __init__(self, path, held):
        self._fd, self._pos, self._held = os.open(path, os.O_RDONLY), 0, held

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        want = len(buf)
        if want:
            self._held.ensure(self._pos, want, ahead=True)
        data = os.pread(self._fd, want, self._pos)
        buf[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = offset
        elif whence == 1:
            self._pos += offset
        else:
            self._pos = os.fstat(self._fd).st_size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def open_read(path, buffering: int = 1 << 16):
    """A binary file object for sequential reading (seek works too)."""
    held = backing(path)
    if held is None:
        return open(path, "rb", buffering=buffering)
    return io.BufferedReader(_Backed(path, held), buffer_size=buffering)


# --- files a checkpoint directory names ------------------------------------------------------------

def inside(path: Path, root: Path) -> bool:
    """Whether a file (after following symlinks) stays inside the checkpoint directory. A Hugging
    Face cache snapshot (…/snapshots/<rev>/) links into its repository's blobs/, which counts."""
    target = path.resolve()
    roots = [root.resolve()]
    if root.resolve().parent.name == "snapshots":
        roots.append(root.resolve().parent.parent / "blobs")
    return any(target == r or r in target.parents for r in roots)


def checked_inside(path: Path, root: Path, what: str) -> Path:
    """`path`, where it stays inside the checkpoint directory `root` (else one line, refused)."""
    if not inside(path, root):
        raise InputError(f"{path}: {what} resolves to {path.resolve()}, outside the checkpoint directory {root}; refused")
    return path
