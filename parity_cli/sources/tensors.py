"""What every source hands the model stage: a tensor's place in its file, the bound on a norm's
size, and an eps with where it came from. Shared by the readers so that none imports another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_NORM_ELEMENTS = 1 << 22  # 4M channels: 8x the widest real norm (Llama-3.1-405B's q/k would be 16k)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int | None = None  # absolute byte offset of the data in the file (safetensors)
    nbytes: int | None = None
    code: str = ""  # the dtype code as the file declares it (safetensors)


@dataclass(frozen=True)
class Eps:
    """The eps a layer is built with, and where that value came from."""

    value: float
    source: str  # "config:rms_norm_eps", "family-default", "override", ...


class ConvertedTensors:
    """What a converted file's checkpoint (GGUF, CTranslate2) answers like a Hugging Face one: its
    norm tensors under the checkpoint's names (`_tensors`: name -> the reader's handle), and a flat
    config synthesised from the file, each key with where it was read (`_sources`)."""

    config: dict
    _tensors: dict
    _sources: dict

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")

    def tensor_names(self) -> list[str]:
        return sorted(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def config_value(self, key: str):
        if key in self.config:
            return self.config[key], self._sources.get(key, key)
        return None, None
