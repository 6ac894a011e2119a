"""Stage 1 for llama.cpp files: a GGUF file, presented with the same interface as a Hugging
Face checkpoint (sources.huggingface.Checkpoint).

Only the metadata and the norm tensors are touched (parity_cli.sources.gguf_reader: bounded, lazy,
arrays skipped); quantized blocks are never decoded.
Tensor names are mapped back to Hugging Face names with gguf-py's own TensorNameMap, so a
report reads the same across formats."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.localread import pread
from parity_cli.sources.tensors import MAX_NORM_ELEMENTS, ConvertedTensors, Eps, TensorInfo

GGUF_MAGIC = b"GGUF"
# GGUF types a norm weight may use, and the torch dtype they become.
READABLE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def is_gguf(path: Path) -> bool:
    try:
        return pread(path, 4, 0) == GGUF_MAGIC
    except OSError:
        return False


def float32_decimal(value: float) -> str:
    """The shortest decimal that rounds to the same float32: what the converter was given."""
    try:
        packed = struct.pack("<f", value)
    except (OverflowError, struct.error):  # not a float32 at all (a float64 GGUF value out of range)
        return repr(value)
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.pack("<f", float(text)) == packed:
            return text
    return repr(value)


def _field(gf, key: str):
    """A scalar or string metadata value; arrays (recorded, never read) count as absent."""
    from parity_cli.sources.gguf_reader import Array

    value = gf.metadata.get(key)
    return None if isinstance(value, Array) else value


def _number(gf, key: str, path) -> float | int | None:
    """A numeric metadata value, or None where absent; anything else is one line naming the key."""
    value = gf.metadata.get(key)
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        kind = "an array" if type(value).__name__ == "Array" else f"a {type(value).__name__}"
        raise InputError(f"{path}: GGUF metadata {key} is {kind}, not a number")
    return value


def _count(gf, key: str, path, most: float = math.inf, what: str = "") -> int | None:
    """An integer metadata value from 1 to `most` (a group count, a number of blocks), or None where
    absent; a fraction, NaN, inf, 0 or more than `most` is one line naming the key."""
    value = _number(gf, key, path)
    if value is not None and not (math.isfinite(value) and value == int(value) and 1 <= value <= most):
        bound = f"an integer from 1{what}" if math.isfinite(most) else "a positive integer"
        raise InputError(f"{path}: GGUF metadata {key} must be {bound}, got {value!r}")
    return None if value is None else int(value)


@dataclass
class GGUFCheckpoint(ConvertedTensors):
    path: Path
    format: str
    config: dict  # Hugging Face keys synthesised from the GGUF metadata
    files: tuple[Path, ...]
    architecture: str
    _reader: object = field(repr=False)  # gguf_reader.GGUFFile
    _tensors: dict = field(repr=False)  # HF-style name -> gguf_reader.GGUFTensor
    _sources: dict = field(default_factory=dict, repr=False)  # config key -> GGUF metadata key
    gguf_names: dict = field(default_factory=dict, repr=False)  # HF-style name -> GGUF name
    # an mmproj's one eps per tower (tower -> Eps): what llama.cpp's clip code uses for each of that
    # tower's norms, whatever eps the model's classes fix (Qwen2.5-VL's vision norms: 1e-6 in code)
    tower_eps: dict = field(default_factory=dict, repr=False)
    # HF-style name -> the (rows, columns) a gain is stored as where the converter reshaped it (a
    # Mamba2 gated norm's (n_group, d_inner / n_group)); read flat, as the transformers checkpoint holds it
    _reshaped: dict = field(default_factory=dict, repr=False)
    remote: object = field(default=None, repr=False)  # sources.remote.Mirror: where it was read from
    # the file's converter stores a 1 + w gain as the sum (a hand-written family's [gguf] offset_baked,
    # or configs/gguf.toml for an architecture only a derived family knows): the gain is the stored value
    offset_baked: bool = False
    notes: list = field(default_factory=list, repr=False)  # what reading the file set aside, and why

    def info(self, name: str) -> TensorInfo:
        t = self._tensors[name]
        dtype = READABLE.get(t.type_name, t.type_name)
        if name in self._reshaped:
            rows, cols = self._reshaped[name]
            return TensorInfo(name=name, file=self.path, dtype=dtype, shape=(rows * cols,))
        # ggml lists dimensions fastest-first; torch (and HF) slowest-first
        return TensorInfo(name=name, file=self.path, dtype=dtype, shape=tuple(int(d) for d in reversed(t.shape)))

    def read(self, name: str):
        """F32/F16/BF16/F64 as stored; anything quantized is refused (never dequantized)."""
        from parity_cli.sources.gguf_reader import check_extent, read_tensor

        t = self._tensors[name]
        if t.type_name not in READABLE:
            raise InputError(f"{self.path}: norm tensor {self.gguf_names.get(name, name)} is stored as {t.type_name}; "
                             "only F32, F16, BF16 norm weights can be checked")
        if t.numel > MAX_NORM_ELEMENTS:  # before the data is touched: memory stays that of a real norm
            raise InputError(f"{self.path}: norm tensor {self.gguf_names.get(name, name)} declares {t.numel} elements; "
                             f"no norm has more than {MAX_NORM_ELEMENTS}; refused")
        check_extent(self._reader, [t] + [o for o in self._tensors.values() if o is not t and o.type_name in READABLE])
        value = read_tensor(self._reader, t)
        return value.reshape(-1) if name in self._reshaped else value



@cache
def conventions() -> dict:
    """configs/gguf.toml: what llama.cpp's converter writes differently for architectures only a
    derived family knows (their names, a baked-in 1 + w, a gated norm's stored shape)."""
    from parity_cli.resources import configs_dir, load_toml

    return load_toml(configs_dir() / "gguf.toml")


MMPROJ = "clip"  # general.architecture of llama.cpp's multimodal projector files (mmproj-*.gguf)
# an mmproj's eps and widths per tower, and the config keys of the HF model they stand for
MMPROJ_KEYS = {"vision_config.": ("clip.vision.attention.layer_norm_epsilon", "clip.vision.embedding_length"),
               "audio_config.": ("clip.audio.attention.layer_norm_epsilon", "clip.audio.embedding_length")}


def open_gguf(path: Path, families: dict, derived=None, model=None) -> GGUFCheckpoint:
    """`families` the hand-written ones (their [gguf] tables map architectures); `derived` looks up a
    generated family by model_type, for an architecture none maps: llama.cpp names most of them as
    transformers does (granite, exaone4, smollm3). `model` (family, model_type) is the model an
    mmproj file is read as: it holds that model's vision and audio towers, under no name of its own."""
    try:
        import gguf  # noqa: F401  (the name map below; said here, before the file is read)
    except ImportError:
        raise InputError(f"{path}: reading GGUF needs the gguf package: pip install gguf") from None
    from parity_cli.sources.gguf_reader import read_gguf

    reader = read_gguf(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise InputError(f"{path}: GGUF without general.architecture")
    if arch == MMPROJ:
        return _open_mmproj(path, reader, model)
    family, model_type = None, None
    for fam in families.values():
        if arch in fam.gguf_architectures:
            family, model_type = fam, fam.gguf_architectures[arch]
            break
    rules = conventions()
    baked = tuple(rules.get("offset_baked", {}).get("architectures", ()))
    if family is None and derived is not None:
        named = rules.get("architectures", {}).get(arch, arch)
        types = [named] if isinstance(named, str) else list(named)  # one architecture, several model types
        # a copy checked against a model of one of them reads as that model (Bamba's GGUF beside Bamba)
        model_type = model[1] if model is not None and model[1] in types else types[0]
        family = derived(model_type)
        offset = family is not None and (family.gain_offset or any(p.semantics.gain_offset for p in family.norms))
        if offset and arch not in baked:
            # for an architecture configs/gguf.toml does not list, nothing records whether the
            # converter stored w or 1 + w
            raise InputError(f"{path}: GGUF architecture '{arch}' has a family derived from transformers with a "
                             "1 + w gain, and whether its converter stored w or 1 + w is not known; force a "
                             "family with --family")
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
        value = _number(reader, key.format(arch=arch), path)
        if value is not None:
            for hf_key in family.eps_keys:  # what the family's eps lookup asks for
                config[hf_key] = value
                sources[hf_key] = f"gguf:{key.format(arch=arch)} (float32 of {float32_decimal(value)})"
            break

    tensors, gguf_names = _hf_names(path, reader, arch, family)
    notes = _set_aside_nextn(path, reader, arch, tensors, gguf_names)
    reshaped = _gated_groups(path, reader, arch, family, tensors, gguf_names, config, sources,
                             rules.get("gated_norm", {}).get("group_count"))
    return GGUFCheckpoint(path=path, format="gguf", config=config, files=(path,), architecture=arch,
                          _reader=reader, _tensors=tensors, _sources=sources, gguf_names=gguf_names,
                          _reshaped=reshaped, offset_baked=family.gguf_offset_baked or arch in baked, notes=notes)


def _set_aside_nextn(path, reader, arch: str, tensors: dict, gguf_names: dict) -> list[str]:
    """The next-token-prediction (MTP) blocks a converter appends after the model's own
    (`{arch}.nextn_predict_layers` of the `{arch}.block_count` blocks: Qwen 3.5's, GLM-4.5's): the
    transformers model builds no such layer, so their norms are not the checkpoint's layers.
    Removed from `tensors`; the note says which blocks and why."""
    import re

    blocks = _count(reader, f"{arch}.block_count", path)
    nextn = _count(reader, f"{arch}.nextn_predict_layers", path, blocks or 0,
                   f" to {arch}.block_count ({blocks})") if blocks else None
    if not nextn:
        return []
    first = blocks - nextn
    aside = []
    for name in list(tensors):
        stored = gguf_names.get(name.rsplit(".", 1)[0], name)
        m = re.match(r"blk\.(\d+)\.", stored)
        if m and int(m.group(1)) >= first:
            aside.append(stored)
            del tensors[name]
    if not aside:
        return []
    span = f"block {first}" if nextn == 1 else f"blocks {first} to {blocks - 1}"
    return [f"GGUF {span} ({len(aside)} tensors): the model's next-token-prediction layers "
            f"({arch}.nextn_predict_layers = {nextn}), which the transformers model does not build; not checked"]


def _gated_groups(path, reader, arch: str, family, tensors: dict, gguf_names: dict, config: dict, sources: dict,
                  count_key: str | None) -> dict:
    """A gated norm's group count from the metadata (`{arch}.ssm.group_count`) under the config key
    the family's pattern names, and its gain read flat where the converter stored it as
    (n_group, d_inner / n_group); a file whose stored rows and group count disagree is refused.
    Returns {HF name: (rows, columns)} of the reshaped gains."""
    gated = {}
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        pattern = family.match(base) if name.endswith(".weight") else None
        if pattern is not None and pattern.semantics.kind == "gated_rms_norm":
            gated[name] = (pattern.semantics.groups, t)
    if not gated:
        return {}
    key = count_key.format(arch=arch) if count_key else None
    count = _count(reader, key, path) if key else None
    if count is not None:  # under each config key the family's gated norms name for their group count
        for groups in {groups for groups, _ in gated.values() if isinstance(groups, str)}:
            config[groups] = count
            sources[groups] = f"gguf:{key}"
    reshaped = {}
    for name, (groups, t) in sorted(gated.items()):
        stored = gguf_names.get(name.removesuffix(".weight"), name)
        if len(t.shape) != 2:
            continue
        cols, rows = (int(d) for d in t.shape)  # ggml's order: fastest first
        want = int(groups) if not isinstance(groups, str) else config.get(groups)
        if want is not None and rows != want:
            where = f"metadata {key}" if isinstance(groups, str) else f"the {family.name} family"
            raise InputError(f"{path}: gated norm tensor {stored} is stored as {rows} x {cols}, for {rows} groups, "
                             f"where {where} says {want}; refused")
        reshaped[name] = (rows, cols)
    return reshaped


def _hf_names(path: Path, reader, arch: str, family) -> tuple[dict, dict]:
    """Each tensor under its Hugging Face name (the one of gguf-py's candidates the family claims):
    gguf-py's own map for this architecture inverted, built for the blocks the file holds (blk.N),
    not the block_count it declares."""
    import re

    import gguf

    arch_enum = next((e for e, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    # blk.N, or v.blk.N / a.blk.N in an mmproj
    present = [int(m.group(1)) for t in reader.tensors if (m := re.match(r"(?:[va]\.)?blk\.(\d{1,7})\.", t.name))]
    blocks = max(present) + 1 if present else 1
    if blocks > len(reader.tensors):  # every block holds a tensor: a larger index is declared, not present
        raise InputError(f"{path}: corrupt GGUF: a tensor of block {blocks - 1} among only {len(reader.tensors)} "
                         "tensors; refused")
    inverse: dict[str, list[str]] = {}
    if arch_enum is not None:
        mapping = gguf.get_tensor_name_map(arch_enum, blocks).mapping
        for hf_name, (_, gguf_name) in mapping.items():
            inverse.setdefault(gguf_name, []).append(hf_name)
    tensors, gguf_names = {}, {}
    for t in reader.tensors:
        base, dot, suffix = t.name.rpartition(".")
        if not dot or suffix not in ("weight", "bias"):
            base, suffix = t.name, ""
        hf = next((c for c in inverse.get(base, []) if family.match(c)), None)
        name = (hf or base) + (f".{suffix}" if suffix else "")
        if name in tensors:  # two GGUF names for one HF name would shadow each other
            raise InputError(f"{path}: GGUF tensors {gguf_names.get(hf or base, base)!r} and {t.name!r} both map to "
                             f"{name}; refused")
        tensors[name] = t
        gguf_names[hf or base] = base
    return tensors, gguf_names


def _open_mmproj(path: Path, reader, model) -> GGUFCheckpoint:
    """An mmproj: a model's vision (and audio) towers and projector, read as that model's (its
    family's patterns pick among gguf-py's HF names), eps from clip.vision / clip.audio."""
    if model is None:
        raise InputError(f"{path}: a multimodal projector (mmproj) holds the towers of a model it does not name; "
                         "check it against that model (parity check HF_DIR --candidate-checkpoint "
                         f"{path.name}), or give --family")
    family, model_type = model
    config: dict = {"model_type": model_type}
    sources: dict = {}
    keys = {k for sem in [family.semantics, *(p.semantics for p in family.norms)] for k in sem.eps_keys}
    tower_eps = {}
    for prefix, (eps_key, width_key) in MMPROJ_KEYS.items():
        value = _number(reader, eps_key, path)
        if value is not None:
            if not (math.isfinite(value) and value > 0):  # what resolve_eps refuses of a config's eps
                raise InputError(f"{path}: GGUF metadata {eps_key} must be a finite number > 0, got {value!r}")
            eps = Eps(float(value), f"gguf:{eps_key} (float32 of {float32_decimal(value)})")
            for tower in ("vision", "projector") if prefix == "vision_config." else ("audio",):
                tower_eps.setdefault(tower, eps)
            for hf_key in sorted(k for k in keys if k.startswith(prefix)):
                config[hf_key], sources[hf_key] = value, eps.source
        width = _field(reader, width_key)
        if isinstance(width, int) and not isinstance(width, bool):  # keys as config_value is asked them
            config[prefix + "hidden_size"] = width
            sources[prefix + "hidden_size"] = f"gguf:{width_key}"
    tensors, gguf_names = _hf_names(path, reader, MMPROJ, family)
    return GGUFCheckpoint(path=path, format="gguf", config=config, files=(path,), architecture=MMPROJ,
                          _reader=reader, _tensors=tensors, _sources=sources, gguf_names=gguf_names,
                          tower_eps=tower_eps, offset_baked=family.gguf_offset_baked)
