"""A bounded, lazy GGUF reader: the header, the metadata and the tensor infos, every declared
length checked against what is left of the file before it is used. Arrays are skipped by
seeking, never materialised (a 262k-entry tokenizer costs a scan of its lengths), and no
tensor data is touched until a norm asks for it. gguf-py stays the source of the constants
(value and tensor types, the name map) and writes the test files; its GGUFReader parses every
metadata element eagerly, which a 105-byte file declaring 2^40 array items turns into a hang."""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.localread import open_read, pread

MAX_KV = 1 << 20  # metadata entries
MAX_TENSORS = 1 << 20
MAX_KEY = 1 << 16  # bytes of a key or a tensor name
MAX_STRING = 1 << 24  # bytes of one string value
MAX_DIMS = 8
MAX_ARRAY_DEPTH = 4
MAX_ARRAY_ITEMS = 1 << 26  # items in one array (a 262k-token vocabulary is 2^18)
MAX_STRING_TOTAL = 1 << 26  # bytes of string values kept, over the whole file

# GGUF metadata value types (gguf-py's GGUFValueType): code -> (struct format, size); strings and arrays apart
SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
           10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
STRING, ARRAY = 8, 9
# ggml tensor types a norm may be read as: code -> (name, numpy/torch dtype name, item size)
PLAIN = {0: ("F32", "float32", 4), 1: ("F16", "float16", 2), 30: ("BF16", "bfloat16", 2), 28: ("F64", "float64", 8)}


@dataclass
class Array:
    """A metadata array, recorded but not read: its item type and length."""

    item_type: int
    count: int


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: fastest-varying first
    type_code: int
    offset: int  # absolute, in the file

    @property
    def type_name(self) -> str:
        if self.type_code in PLAIN:
            return PLAIN[self.type_code][0]
        try:
            import gguf

            return gguf.GGMLQuantizationType(self.type_code).name
        except (ImportError, ValueError):
            return f"type {self.type_code}"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFFile:
    path: Path
    version: int
    byte_order: str  # "<" or ">"
    metadata: dict = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)
    alignment: int = 32
    size: int = 0


class _Cursor:
    """Reads with a running check against the file size: a declared length that cannot fit
    in what is left is the file's fault, found before anything is allocated for it."""

    def __init__(self, fh, size: int, path: Path):
        self.fh, self.size, self.path, self.order = fh, size, path, "<"
        self.kept = 0  # bytes of string values materialised so far

    @property
    def left(self) -> int:
        return self.size - self.fh.tell()

    def fail(self, what: str):
        raise InputError(f"{self.path}: corrupt GGUF: {what} (at byte {self.fh.tell()} of {self.size})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left:
            self.fail(f"{what} declares {n} bytes, {self.left} are left")
        data = self.fh.read(n)
        if len(data) != n:
            self.fail(f"{what} is truncated")
        return data

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.left:
            self.fail(f"{what} declares {n} bytes, {self.left} are left")
        self.fh.seek(n, io.SEEK_CUR)

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        return struct.unpack(self.order + fmt, self.take(size, what))[0]

    def string(self, what: str, cap: int = MAX_STRING) -> str:
        n = self.scalar("Q", what)
        if n > cap:
            self.fail(f"{what} declares a {n}-byte string")
        return self.take(n, what).decode("utf-8", "replace")

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in SCALARS:
            fmt, _ = SCALARS[vtype]
            return self.scalar(fmt, what)
        if vtype == STRING:
            text = self.string(what)
            self.kept += len(text)
            if self.kept > MAX_STRING_TOTAL:
                self.fail(f"string values over {MAX_STRING_TOTAL} bytes in all")
            return text
        if vtype == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
            item, count = self.scalar("I", what), self.scalar("Q", what)
            if count > MAX_ARRAY_ITEMS and item not in SCALARS:
                self.fail(f"{what} declares {count} items")
            if item in SCALARS:
                self.skip(count * SCALARS[item][1], f"{what} ({count} items)")
            elif item == STRING:
                if count * 8 > self.left:
                    self.fail(f"{what} declares {count} strings, {self.left} bytes are left")
                for _ in range(count):  # lengths only: the strings are seeked over
                    self.skip(self.scalar("Q", what), what)
            elif item == ARRAY:
                if count * 12 > self.left:
                    self.fail(f"{what} declares {count} arrays, {self.left} bytes are left")
                for _ in range(count):
                    self.value(ARRAY, what, depth + 1)
            else:
                self.fail(f"{what} has items of unknown type {item}")
            return Array(item, count)
        self.fail(f"{what} has unknown value type {vtype}")


def read_gguf(path: Path) -> GGUFFile:
    """Header, metadata and tensor infos of a GGUF file, checked; no tensor data is read."""
    import os

    path = Path(path)
    try:
        size = os.stat(path).st_size
        fh = open_read(path, buffering=1 << 16)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with fh:
        cur = _Cursor(fh, size, path)
        if cur.take(4, "magic") != b"GGUF":
            cur.fail("no GGUF magic")
        raw_version = cur.take(4, "version")
        version = struct.unpack("<I", raw_version)[0]
        if version & 0xFFFF == 0:  # written big-endian: every field after the magic is
            cur.order, version = ">", struct.unpack(">I", raw_version)[0]
        if version not in (2, 3):
            cur.fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = cur.scalar("Q", "tensor count"), cur.scalar("Q", "metadata count")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > cur.left:
            cur.fail(f"declares {n_tensors} tensors")
        if n_kv > MAX_KV or n_kv * 13 > cur.left:
            cur.fail(f"declares {n_kv} metadata entries")
        out = GGUFFile(path=path, version=version, byte_order=cur.order, size=size)
        for _ in range(n_kv):
            key = cur.string("a metadata key", MAX_KEY)
            if key in out.metadata:
                cur.fail(f"metadata key {key!r} appears twice")
            vtype = cur.scalar("I", f"the type of {key!r}")
            out.metadata[key] = cur.value(vtype, f"metadata {key!r}")
        alignment = out.metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            cur.fail(f"general.alignment {alignment!r} is not a power of two")
        out.alignment = alignment
        infos = []
        for _ in range(n_tensors):
            name = cur.string("a tensor name", MAX_KEY)
            n_dims = cur.scalar("I", f"the rank of {name!r}")
            if n_dims > MAX_DIMS:
                cur.fail(f"tensor {name!r} declares {n_dims} dimensions")
            shape = tuple(cur.scalar("Q", f"the shape of {name!r}") for _ in range(n_dims))
            infos.append((name, shape, cur.scalar("I", f"the type of {name!r}"), cur.scalar("Q", f"the offset of {name!r}")))
        data_start = -(-fh.tell() // alignment) * alignment
    for name, shape, code, offset in infos:
        if offset % alignment:
            raise InputError(f"{path}: corrupt GGUF: tensor {name!r} is at offset {offset}, not a multiple of "
                             f"the alignment {alignment}")
        out.tensors.append(GGUFTensor(name, shape, code, data_start + offset))
    return out


def check_extent(gf: GGUFFile, tensors: list[GGUFTensor]) -> None:
    """The tensors about to be read lie inside the file and do not overlap one another."""
    spans = []
    for t in tensors:
        if t.type_code not in PLAIN:
            continue
        end = t.offset + t.numel * PLAIN[t.type_code][2]
        if end > gf.size:
            raise InputError(f"{gf.path}: truncated or corrupt GGUF: tensor {t.name!r} needs bytes {t.offset}..{end} "
                             f"of a {gf.size}-byte file")
        spans.append((t.offset, end, t.name))
    pair = first_overlap(spans)
    if pair:
        raise InputError(f"{gf.path}: corrupt GGUF: tensors {pair[0]!r} and {pair[1]!r} overlap")


def first_overlap(spans) -> tuple[str, str] | None:
    """The names of two (start, end, name) byte ranges that share bytes, or None. A file may declare
    each tensor inside it and still point two at the same bytes (a model claimed far larger than the
    file it comes in)."""
    reach, owner = 0, None  # the furthest end so far: an empty tensor in between hides nothing
    for start, end, name in sorted(spans):
        if end > start and start < reach:
            return owner, name
        if end > reach:
            reach, owner = end, name
    return None


def read_tensor(gf: GGUFFile, t: GGUFTensor):
    """A plain (F32/F16/BF16/F64) tensor as a torch tensor in this machine's byte order, torch
    (slowest-first) shape."""
    import torch

    _, dtype_name, itemsize = PLAIN[t.type_code]
    nbytes = t.numel * itemsize
    try:
        buf = pread(gf.path, nbytes, t.offset)
    except OSError as exc:
        raise InputError(f"{gf.path}: cannot read tensor {t.name!r}: {exc.strerror or exc}") from None
    if len(buf) != nbytes:
        raise InputError(f"{gf.path}: truncated while reading tensor {t.name!r}")
    dtype = getattr(torch, dtype_name)
    if not nbytes:
        return torch.empty(tuple(reversed(t.shape)), dtype=dtype)
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    if gf.byte_order != "<" and itemsize > 1:  # a big-endian file: reverse the bytes of each item
        raw = raw.reshape(-1, itemsize).flip(-1).reshape(-1).contiguous()
    return raw.view(dtype).reshape(tuple(reversed(t.shape)))
