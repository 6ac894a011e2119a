"""Untrusted JSON files (config.json, the shard index, baselines, saved reports): read only
from a regular file, only up to a size cap, only to a nesting depth, and every failure is one
line naming the file. A FIFO would block forever and /dev/zero would fill the memory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from parity_cli.errors import InputError

MAX_BYTES = {"config": 16 << 20, "index": 64 << 20, "report": 256 << 20}
MAX_DEPTH = 64  # a real config nests a few levels; a report about ten


def _depth_ok(raw: str, limit: int) -> bool:
    """Bracket depth outside strings, counted before json.loads can recurse into it."""
    depth = 0
    in_string = escaped = False
    for ch in raw:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def load(path: str | Path, what: str, kind: str = "config") -> object:
    """The parsed JSON of `path`, or InputError("<path>: <what> ...") in one line."""
    path = Path(path)
    cap = MAX_BYTES[kind]
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: {what} is not a regular file (a FIFO, device or directory); refused")
        if st.st_size > cap:
            raise InputError(f"{path}: {what} is {st.st_size} bytes, over the {cap >> 20} MiB a {kind} may have")
        with open(path, "rb") as fh:
            data = fh.read(cap + 1)
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > cap:  # it grew while we looked
        raise InputError(f"{path}: {what} is over the {cap >> 20} MiB a {kind} may have")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: {what} is not UTF-8 text: {exc}") from None
    if not _depth_ok(text, MAX_DEPTH):
        raise InputError(f"{path}: {what} nests deeper than {MAX_DEPTH} levels; refused")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON in {what}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits
        raise InputError(f"{path}: {what} is not usable JSON: {str(exc).splitlines()[0][:200]}") from None
