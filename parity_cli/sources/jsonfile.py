"""Untrusted JSON files (config.json, the shard index, baselines, saved reports): read only
from a regular file, only up to a size cap, only to a nesting depth, and every failure is one
line naming the file. A FIFO would block forever and /dev/zero would fill the memory."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from parity_cli.errors import InputError

# a parsed JSON value's type as JSON Schema names it, and as a message says it
JSON_KINDS = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
              dict: "object"}
KIND_WORDS = {"object": "an object", "array": "an array", "string": "a string", "number": "a number",
              "integer": "an integer", "boolean": "a boolean", "null": "null"}


def json_kind(value) -> str:
    kind = JSON_KINDS.get(type(value))
    if kind is None:  # not from the JSON parser: a subclass, or no JSON type at all
        kind = next((k for t, k in JSON_KINDS.items() if t is not type(None) and isinstance(value, t)),
                    type(value).__name__)
    return kind


def kind_words(value) -> str:
    """`an array`, `a string`, ...: what a config value is, in a one-line message."""
    kind = json_kind(value)
    return KIND_WORDS.get(kind, f"a {kind}")

MAX_BYTES = {"config": 16 << 20, "index": 64 << 20, "report": 256 << 20}


def regular_file(path: str | Path, what: str, cap: int, over: str) -> int:
    """The size of `path` once it is known to be a regular file of at most `cap` bytes (a FIFO
    would block the first read, a device never end); `over` says what the cap is. Every input
    file that is not JSON (an .onnx graph, a capture, a text) is opened after this check too."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except ValueError:  # an embedded NUL: not a name the system can have
        raise InputError(f"{path}: cannot read {what}: No such file or directory") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: {what} is not a regular file (a FIFO, device or directory); refused")
    if st.st_size > cap:
        raise InputError(f"{path}: {what} is {st.st_size} bytes, {over}")
    return st.st_size


def load(path: str | Path, what: str, kind: str = "config") -> object:
    """The parsed JSON of `path`, or InputError("<path>: <what> ...") in one line."""
    path = Path(path)
    cap = MAX_BYTES[kind]
    regular_file(path, what, cap, f"over the {cap >> 20} MiB a {kind} may have")
    try:
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
    return parse(text, path, what)


def parse(text: str, path, what: str) -> object:
    """json.loads with its failures as one line. Nesting is bounded by the parser itself: it
    raises RecursionError (a scan of our own would cost 0.44 s per 15 MiB, for nothing)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: invalid JSON in {what}: {exc}") from None
    except RecursionError:
        raise InputError(f"{path}: {what} nests deeper than the JSON parser allows; refused") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InputError(f"{path}: {what} is not usable JSON: {str(exc).splitlines()[0][:200]}") from None
