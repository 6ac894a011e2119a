"""Stage 1 for llama.cpp files: a GGUF file read through the `gguf` package, presented with
the same interface as a Hugging Face checkpoint (checkpoint.Checkpoint).

Only the metadata and the norm tensors are touched: GGUFReader memory-maps the file, so a
multi-GB model with quantized blocks costs its metadata; quantized blocks are never decoded.
Tensor names are mapped back to Hugging Face names with gguf-py's own TensorNameMap, so a
report reads the same across formats."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.checkpoint import TensorInfo
from parity_cli.errors import InputError

GGUF_MAGIC = b"GGUF"
# GGUF types a norm weight may use, and the torch dtype they become.
READABLE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def float32_decimal(value: float) -> str:
    """The shortest decimal that rounds to the same float32: what the converter was given."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.pack("<f", float(text)) == packed:
            return text
    return repr(value)


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    import numpy as np

    part = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(part).decode("utf-8", "replace")
    if f.types and f.types[0].name == "ARRAY":
        return None
    value = part[0] if isinstance(part, np.ndarray) and part.size else part
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


@dataclass
class GGUFCheckpoint:
    path: Path
    format: str
    config: dict  # Hugging Face keys synthesised from the GGUF metadata
    files: tuple[Path, ...]
    architecture: str
    _reader: object = field(repr=False)
    _tensors: dict = field(repr=False)  # HF-style name -> ReaderTensor
    _sources: dict = field(default_factory=dict, repr=False)  # config key -> GGUF metadata key
    gguf_names: dict = field(default_factory=dict, repr=False)  # HF-style name -> GGUF name

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def tensor_names(self) -> list[str]:
        return sorted(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        t = self._tensors[name]
        dtype = READABLE.get(t.tensor_type.name, t.tensor_type.name)
        # ggml lists dimensions fastest-first; torch (and HF) slowest-first
        return TensorInfo(name=name, file=self.path, dtype=dtype, shape=tuple(int(d) for d in reversed(t.shape)))

    def read(self, name: str):
        """F32/F16/BF16 as stored; anything quantized is refused (never dequantized)."""
        import numpy as np
        import torch

        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind not in READABLE:
            raise InputError(f"{self.path}: norm tensor {self.gguf_names.get(name, name)} is stored as {kind}; "
                             "only F32, F16, BF16 norm weights can be checked")
        shape = [int(d) for d in reversed(t.shape)]
        from parity_cli.checkpoint import MAX_NORM_ELEMENTS

        count = 1
        for d in shape:
            count *= d
        if count > MAX_NORM_ELEMENTS:  # before the data is touched: memory stays that of a real norm
            raise InputError(f"{self.path}: norm tensor {self.gguf_names.get(name, name)} declares {count} elements; "
                             f"no norm has more than {MAX_NORM_ELEMENTS}; refused")
        raw = np.ascontiguousarray(t.data)
        if not raw.dtype.isnative:  # a big-endian GGUF: bring the bytes to this machine's order
            raw = raw.astype(raw.dtype.newbyteorder("="))
        if kind == "BF16":
            bits = raw.view(np.uint16)
            if getattr(self._reader, "byte_order", "=") == "S":  # raw bytes of a byte-swapped file
                bits = bits.byteswap()
            out = torch.from_numpy(bits.astype(np.int16).copy()).view(torch.bfloat16)
        else:
            out = torch.from_numpy(raw.copy())
        return out.reshape(shape)

    def config_value(self, key: str):
        if key in self.config:
            return self.config[key], self._sources.get(key, key)
        return None, None


def open_gguf(path: Path, families: dict) -> GGUFCheckpoint:
    try:
        import gguf
    except ImportError:
        raise InputError(f"{path}: reading GGUF needs the gguf package: pip install 'parity-cli[gguf]'") from None
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # gguf raises many kinds on a damaged file
        raise InputError(f"{path}: not a readable GGUF file: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{path}: GGUF without general.architecture")
    family, model_type = None, None
    for fam in families.values():
        if arch in fam.gguf_architectures:
            family, model_type = fam, fam.gguf_architectures[arch]
            break
    if family is None:
        known = sorted(a for f in families.values() for a in f.gguf_architectures)
        raise InputError(f"{path}: GGUF architecture '{arch}' is not a known family; known: {', '.join(known)}")

    config: dict = {"model_type": model_type}
    sources: dict = {}

    def take(hf_key, gguf_key):
        value = _field(reader, gguf_key.format(arch=arch))
        if value is not None:
            config[hf_key] = value
            sources[hf_key] = f"gguf:{gguf_key.format(arch=arch)}"

    for hf_key, gguf_key in (("hidden_size", "{arch}.embedding_length"), ("n_embd", "{arch}.embedding_length"),
                             ("d_model", "{arch}.embedding_length"), ("num_hidden_layers", "{arch}.block_count"),
                             ("num_attention_heads", "{arch}.attention.head_count"),
                             ("num_key_value_heads", "{arch}.attention.head_count_kv"),
                             ("head_dim", "{arch}.attention.key_length"),
                             ("q_lora_rank", "{arch}.attention.q_lora_rank"),
                             ("kv_lora_rank", "{arch}.attention.kv_lora_rank")):
        take(hf_key, gguf_key)
    eps_gguf = ["{arch}.attention.layer_norm_rms_epsilon", "{arch}.attention.layer_norm_epsilon"]
    if family.kind == "layer_norm":
        eps_gguf.reverse()
    for key in eps_gguf:
        value = _field(reader, key.format(arch=arch))
        if value is not None:
            for hf_key in family.eps_keys:  # what the family's eps lookup asks for
                config[hf_key] = value
                sources[hf_key] = f"gguf:{key.format(arch=arch)} (float32 of {float32_decimal(value)})"
            break

    # GGUF names -> Hugging Face names, by inverting gguf-py's own map for this architecture
    arch_enum = next((e for e, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    blocks = config.get("num_hidden_layers") or 0
    inverse: dict[str, list[str]] = {}
    if arch_enum is not None:
        mapping = gguf.get_tensor_name_map(arch_enum, max(int(blocks), 1)).mapping
        for hf_name, (_, gguf_name) in mapping.items():
            inverse.setdefault(gguf_name, []).append(hf_name)
    tensors, gguf_names = {}, {}
    for t in reader.tensors:
        base, dot, suffix = t.name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            base, suffix = t.name, ""
        hf = next((c for c in inverse.get(base, []) if family.match(c)), None)
        name = (hf or base) + (f".{suffix}" if suffix else "")
        tensors[name] = t
        gguf_names[hf or base] = base
    return GGUFCheckpoint(path=path, format="gguf", config=config, files=(path,), architecture=arch,
                          _reader=reader, _tensors=tensors, _sources=sources, gguf_names=gguf_names)
