"""Stage 1: a Hugging Face checkpoint directory -> config, tensor index, lazily read tensors.

Only safetensors headers are parsed up front; a tensor's bytes are read when a norm layer
asks for it. Pickle files (*.bin, *.pt) are never opened: a checkpoint must not execute code."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.jsonfile import kind_words
from parity_cli.sources.localread import checked_inside, pread
from parity_cli.sources.tensors import MAX_NORM_ELEMENTS, Eps, TensorInfo  # noqa: F401  (Eps: the readers' type)

# safetensors dtype code -> (torch dtype name, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024
NORM_DTYPE_CODES = ("F64", "F32", "F16", "BF16")  # what a norm weight may be stored as
def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parses and validates the header against the file size (catches truncated files)."""
    try:
        size = path.stat().st_size
        head = pread(path, 8, 0)
        if len(head) < 8:
            raise InputError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InputError(f"{path}: not a safetensors file or truncated (header length {n} exceeds the file)")
        raw = pread(path, n, 8)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    from parity_cli.sources.jsonfile import parse

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: corrupt safetensors header: {exc}") from None
    header = parse(text, path, "the safetensors header")
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_code, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
            if not (isinstance(dtype_code, str) and all(type(d) is int and d >= 0 for d in shape)
                    and type(begin) is int and type(end) is int and begin >= 0):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: corrupt safetensors header entry for '{name}'") from None
        if dtype_code not in SAFETENSORS_DTYPES:
            dtype, itemsize = dtype_code.lower(), None
        else:
            dtype, itemsize = SAFETENSORS_DTYPES[dtype_code]
        if end > data_size or begin > end:
            raise InputError(
                f"{path}: truncated or corrupt: tensor '{name}' needs bytes {begin}..{end} "
                f"but the file holds {data_size} data bytes"
            )
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise InputError(f"{path}: corrupt: tensor '{name}' size does not match its shape {list(shape)}")
        out[name] = TensorInfo(name=name, file=path, dtype=dtype, shape=shape, offset=8 + n + begin, nbytes=end - begin,
                               code=dtype_code[:40])
    return out


# what a safetensors file's __metadata__ "format" says of the tool that wrote it -> the exporter's name
EXPORTERS = {"mlx": "mlx-lm"}  # mlx_lm.convert saves with mx.save_safetensors(..., metadata={"format": "mlx"})


def written_by(path: Path) -> str | None:
    """The exporter a safetensors file names in its header's __metadata__ (mlx-lm writes
    {"format": "mlx"}; transformers "pt"), None for one parity does not know. The header was
    checked when the file was opened; one that cannot be read again names nobody."""
    from parity_cli.sources.jsonfile import parse

    try:
        (n,) = struct.unpack("<Q", pread(path, 8, 0))
        header = parse(pread(path, min(n, MAX_HEADER_BYTES), 8).decode("utf-8"), path, "the safetensors header")
    except (OSError, InputError, UnicodeDecodeError, struct.error):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return EXPORTERS.get(meta.get("format")) if isinstance(meta, dict) else None


@dataclass
class Checkpoint:
    path: Path
    format: str  # "safetensors" | "safetensors-sharded"
    config: dict
    files: tuple[Path, ...]
    _weight_map: dict[str, Path]
    _headers: dict[Path, dict[str, TensorInfo]] = field(default_factory=dict, repr=False)
    _handles: dict[Path, object] = field(default_factory=dict, repr=False)
    remote: object = field(default=None, repr=False)  # sources.remote.Mirror: where it was read from

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def tensor_names(self) -> list[str]:
        return sorted(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def info(self, name: str) -> TensorInfo:
        file = self._weight_map[name]
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)
        infos = self._headers[file]
        if name not in infos:
            raise InputError(f"{file}: tensor '{name}' is listed in the index but missing from the shard")
        return infos[name]

    def read(self, name: str):
        """The tensor as stored (dtype untouched). Exactly its byte range is read with pread: an
        mmap would make the kernel read megabytes around each small norm tensor."""
        import torch

        info = self.info(name)
        # What the header declares is checked before a byte is read: an unknown or quantised
        # code (QINT8 crashed the safetensors reader) or an absurd size is refused, one line.
        if info.code not in NORM_DTYPE_CODES:
            raise InputError(f"{info.file}: tensor '{name}' is stored as {info.code!r}; a norm weight must be "
                             f"{', '.join(NORM_DTYPE_CODES)}; refused")
        if math.prod(info.shape) > MAX_NORM_ELEMENTS:
            raise InputError(f"{info.file}: tensor '{name}' declares {math.prod(info.shape)} elements; no norm has "
                             f"more than {MAX_NORM_ELEMENTS}; refused")
        dtype = getattr(torch, info.dtype)
        try:
            buf = pread(info.file, info.nbytes, info.offset)
        except OSError as exc:
            raise InputError(f"{info.file}: cannot read tensor '{name}': {exc.strerror or exc}") from None
        if len(buf) != info.nbytes:
            raise InputError(f"{info.file}: truncated while reading tensor '{name}'")
        if not info.nbytes:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(info.shape)

    def config_value(self, key: str):
        """A config value and the path it was found at. A dotted key walks nested configs
        (vision_config.layer_norm_eps); a plain key missing at the top level is looked up in
        text_config, where multimodal configs keep the decoder's settings."""
        if "." in key:
            node: object = self.config
            walked = []
            for part in key.split("."):
                if node is None:  # "vision_config": null, a model saved without that tower
                    return None, None
                if not isinstance(node, dict):  # a sub-config that is not one: never a silent default
                    raise InputError(f"{self._config_file()}: '{'.'.join(walked)}' is {kind_words(node)}, not an object "
                                     f"(reading {key})")
                if part not in node:
                    return None, None
                walked.append(part)
                node = node[part]
            return node, key
        if key in self.config:
            return self.config[key], key
        text = self.config.get("text_config")
        if text is not None and not isinstance(text, dict):
            raise InputError(f"{self._config_file()}: 'text_config' is {kind_words(text)}, not an object (reading {key})")
        if isinstance(text, dict) and key in text:
            return text[key], f"text_config.{key}"
        return None, None

    def _config_file(self):
        return self.path / "config.json" if self.path.is_dir() else self.path


def _load_json(path: Path, kind: str = "config") -> object:
    from parity_cli.sources.jsonfile import load

    return load(path, "the config" if kind == "config" else "the index", kind)


def open_directory(path: Path) -> Checkpoint:
    """A Hugging Face model directory (parity_cli.model.load.open_checkpoint dispatches files)."""
    if not path.is_dir():
        raise InputError(f"{path}: not a checkpoint directory (expected a Hugging Face model directory)")
    config_path = path / "config.json"
    if not config_path.exists():
        raise InputError(f"{path}: no config.json in the checkpoint directory")
    config = _load_json(checked_inside(config_path, path, "config.json"))
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: expected a JSON object")

    index_path = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index_path.exists():
        index = _load_json(checked_inside(index_path, path, "the index"), "index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise InputError(f"{index_path}: no valid 'weight_map' object")
        files = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise InputError(f"{index_path}: shard '{shard}' points outside the checkpoint directory")
            if not shard_path.is_file():
                raise InputError(f"{index_path}: names shard '{shard}', which does not exist")
            files[shard] = checked_inside(shard_path, path, f"shard '{shard}'")
        return Checkpoint(
            path=path,
            format="safetensors-sharded",
            config=config,
            files=tuple(files.values()),
            _weight_map={k: files[v] for k, v in weight_map.items()},
        )
    if single.is_file():
        headers = read_safetensors_header(checked_inside(single, path, "model.safetensors"))
        ckpt = Checkpoint(
            path=path,
            format="safetensors",
            config=config,
            files=(single,),
            _weight_map={k: single for k in headers},
        )
        ckpt._headers[single] = headers
        return ckpt
    pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles:
        raise InputError(
            f"{path}: only pickle weights ({', '.join(sorted(pickles))}); they are never unpickled, "
            "convert the checkpoint to safetensors"
        )
    raise InputError(f"{path}: no model.safetensors or model.safetensors.index.json")
