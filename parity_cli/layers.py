"""Stage 2: checkpoint + family -> the norm layers to check, each with its full semantics.

A NormLayer carries everything a reference needs (kind, numerics order, gain offset, eps and
its source, stored weight), so later stages never look at the family or config again."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from parity_cli.checkpoint import Checkpoint, Eps
from parity_cli.errors import InputError
from parity_cli.families import Family

# Names that look like a norm: anything matching none of the family's patterns is reported.
NORM_HINT = re.compile(r"norm|(^|\.)ln_|LayerNorm", re.IGNORECASE)


@dataclass
class NormLayer:
    name: str
    kind: str  # "rms_norm" | "layer_norm"
    dim: int
    order: str  # numerics order of the family's HF code ("llama", "gemma")
    gain_offset: float  # effective gain = gain_offset + weight
    eps: Eps
    weight: object  # torch.Tensor as stored in the checkpoint
    bias: object = None
    family: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def stored_dtype(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")


@dataclass
class Discovery:
    layers: list[NormLayer]
    unmatched: list[str]  # norm-looking tensors no pattern claims
    warnings: list[str]


def _natural_key(name: str):
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]


def _config_dim(ckpt: Checkpoint, key: str) -> int | None:
    value, _ = ckpt.config_value(key)
    if value is None and key == "head_dim":
        hidden, _ = ckpt.config_value("hidden_size")
        heads, _ = ckpt.config_value("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads:
            return hidden // heads
    return value if isinstance(value, int) else None


def discover_layers(ckpt: Checkpoint, family: Family, eps: Eps, layers_glob: str | None = None) -> Discovery:
    matched, unmatched, warnings = [], [], []
    for tensor in ckpt.tensor_names():
        if not tensor.endswith(".weight"):
            continue
        name = tensor[: -len(".weight")]
        pattern = family.match(name)
        if pattern is None:
            if NORM_HINT.search(name):
                unmatched.append(tensor)
            continue
        matched.append((name, tensor, pattern))
    if not matched:
        raise InputError(
            f"{ckpt.path}: no norm tensors of family '{family.name}' found "
            f"(expected names like {family.norms[0].name.replace('{root}', family.roots[0]).replace('{i}', '0')}.weight)"
        )
    matched.sort(key=lambda m: _natural_key(m[0]))
    if layers_glob:
        matched = [m for m in matched if fnmatch.fnmatchcase(m[0], layers_glob)]
        if not matched:
            raise InputError(f"--layers '{layers_glob}' matches no norm layer of {ckpt.path}")

    layers = []
    for name, tensor, pattern in matched:
        info = ckpt.info(tensor)
        if len(info.shape) != 1 or info.shape[0] < 1:
            unmatched.append(tensor)
            warnings.append(f"{tensor}: shape {list(info.shape)} is not a 1-D gain vector; not checked")
            continue
        dim = info.shape[0]
        layer_warnings = []
        expected = _config_dim(ckpt, pattern.dim)
        if expected is not None and expected != dim:
            layer_warnings.append(f"weight has {dim} channels but config {pattern.dim} = {expected}")
        bias = None
        if family.kind == "layer_norm" and ckpt.has(f"{name}.bias"):
            bias = ckpt.read(f"{name}.bias")
        layers.append(
            NormLayer(
                name=name,
                kind=family.kind,
                dim=dim,
                order=family.order,
                gain_offset=family.gain_offset,
                eps=eps,
                weight=ckpt.read(tensor),
                bias=bias,
                family=family.name,
                warnings=layer_warnings,
            )
        )
    return Discovery(layers=layers, unmatched=sorted(unmatched), warnings=warnings)
