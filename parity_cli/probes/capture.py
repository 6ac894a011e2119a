"""Real activations: what each norm layer sees when the model runs on real text.

`parity capture MODEL --text FILE` runs the model with transformers (its bundled tokenizer, its
own class, never remote code), records the input of every norm layer parity checks through a
forward pre-hook, and keeps a bounded sample of rows per layer: the smallest by q (where a wrong
eps shows), the largest, and a uniform reservoir of the rest. Memory is K rows per layer
whatever the number of tokens. The rows go to a safetensors file whose metadata holds the
checkpoint's norm fingerprint (replay.fingerprint), so a check refuses rows from another model."""

from __future__ import annotations

import contextlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.model.pairing import half_step, rounding_bound
from parity_cli.sampling import RowSample, describe
from parity_cli.text import layer_count

MAX_ROWS_PER_LAYER = 4096
NORM_PREFIX = "norm:"  # beside the rows, the norm tensors the capture was made with (float32)
MAX_FILE_BYTES = 1 << 30


def _model_class(config, gguf: bool = False):
    """The checkpoint's own architecture class from transformers (config.architectures), so the
    module names are the checkpoint's tensor names; never a class the directory ships. A GGUF
    (llama.cpp's format, causal LMs) names none: its causal-LM class."""
    import transformers

    for arch in config.architectures or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM if gguf else transformers.AutoModel


@contextlib.contextmanager
def _quiet():
    """transformers' own output off while it loads: its progress bars (the GGUF dequantizer's tqdm
    is not behind its logging switch) and its warnings would land in the middle of ours. Its
    exceptions still come through, and become one line."""
    import io

    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _fast_reader_class():
    """gguf-py's GGUFReader, but an array in the metadata is read in one piece: the real one makes two
    numpy memory-map views per item (a 49,152-token vocabulary, its merges and token types: 1.7 s of a
    SmolLM2 capture). The fields are the same (tests/test_capture.py compares them); only little-endian
    files and arrays of strings or numbers take this way, anything else is gguf-py's own."""
    import struct

    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class FastReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, count, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            flat = getattr(self, "_flat", None)
            if flat is None:
                flat = self._flat = self.data.view(np.ndarray)  # plain views: no memmap bookkeeping per item
            end = flat.shape[0]
            if itype == GGUFValueType.STRING:
                parts, idxs = [raw_itype, alen], []
                for _ in range(count):  # each declared length checked against the file before it is used
                    if offs + 8 > end:
                        raise ValueError(f"string array at {orig_offs} runs past the end of the file")
                    (n,) = struct.unpack_from("<Q", flat, offs)
                    if n > end - offs - 8:
                        raise ValueError(f"string array at {orig_offs} declares a {n}-byte string")
                    parts.append(flat[offs + 8:offs + 8 + n])
                    idxs.append(len(parts) - 1)
                    offs += 8 + n
                return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY, GGUFValueType.STRING]
            np_type = self.gguf_scalar_to_np.get(GGUFValueType(itype))
            if np_type is None:  # arrays of arrays
                return super()._get_field_parts(orig_offs, raw_type)
            size = np.dtype(np_type).itemsize * count
            if size > end - offs:
                raise ValueError(f"array at {orig_offs} declares {count} items past the end of the file")
            items = flat[offs:offs + size].view(np_type).reshape(count, 1)
            return 12 + size, [raw_itype, alen, *items], list(range(2, 2 + count)), \
                [GGUFValueType.ARRAY, GGUFValueType(itype)]

    return FastReader


@contextlib.contextmanager
def _gguf_served(source: Path, reader):
    """transformers reads a GGUF whole for its config, again for its tokenizer and for the weights, and
    builds gguf-py's tensor name map anew for each of the model's modules (400 times, 17 ms each). Here
    `reader` (one parse, a read-only memory map) serves every GGUFReader(source) it makes and one map
    each name-map call; both are gguf-py's own again after."""
    import functools
    import os

    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    here = os.path.realpath(source)

    def served(path, *args, **kwargs):
        return reader if os.path.realpath(path) == here and not args and not kwargs else real_reader(path, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = served, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@dataclass
class _Loaded:
    config: object
    tokenizer: object
    cls: type
    model: object  # what the hooks are put on
    runner: object  # what runs: the model, or its base model where every norm is inside it (no output head)
    note: str | None = None  # how a GGUF was loaded, for the summary


class _Fallback(Exception):
    """The GGUF is fine but this loader cannot place its tensors: transformers' own loader takes it."""


def _config_and_tokenizer(model_dir, path: str, extra: dict):
    from transformers import AutoConfig, AutoTokenizer

    try:
        with _quiet():
            config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False, **extra)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False, **extra)
    except Exception as exc:
        raise InputError(f"{model_dir}: cannot load its config or bundled tokenizer: "
                         f"{' '.join(str(exc).split())[:200]}") from None
    return config, tokenizer


def _from_pretrained(model_dir, cls, path: str, extra: dict):
    try:
        with _quiet():
            return cls.from_pretrained(path, local_files_only=True, trust_remote_code=False, torch_dtype="auto",
                                       **(extra or {"use_safetensors": True}))
    except Exception as exc:
        raise InputError(f"{model_dir}: transformers cannot load the model ({cls.__name__}): "
                         f"{' '.join(str(exc).split())[:200]}") from None


def _load_hf(model_dir, source: Path) -> _Loaded:
    """An HF directory, as transformers loads it, never remote code."""
    config, tokenizer = _config_and_tokenizer(model_dir, str(source), {})
    cls = _model_class(config)
    model = _from_pretrained(model_dir, cls, str(source), {})
    return _Loaded(config, tokenizer, cls, model, model)


def _gguf_via_transformers(model_dir, source: Path, note: str | None, reader=None) -> _Loaded:
    """transformers' own GGUF loader: the whole file dequantized into the model (with `reader`, one
    parse serves its calls; without, transformers parses the file for each, as it does alone)."""
    extra = {"gguf_file": source.name}
    with _gguf_served(source, reader) if reader is not None else contextlib.nullcontext():
        config, tokenizer = _config_and_tokenizer(model_dir, str(source.parent), extra)
        cls = _model_class(config, gguf=True)
        model = _from_pretrained(model_dir, cls, str(source.parent), extra)
    return _Loaded(config, tokenizer, cls, model, model, note)


def _read_gguf(model_dir, source: Path):
    """gguf-py's parse, and its tensors' byte ranges checked apart: gguf-py checks that each lies in
    the file, not that two do not share bytes, and a model is built as large as its tensors claim
    (every quantized tensor pointing at one block would claim a model far larger than the file)."""
    try:
        reader = _fast_reader_class()(str(source))
    except Exception as exc:
        raise InputError(f"{model_dir}: gguf-py cannot read the file: {' '.join(str(exc).split())[:200]}") from None
    from parity_cli.sources.gguf_reader import first_overlap

    pair = first_overlap((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    if pair:
        raise InputError(f"{model_dir}: GGUF tensors {pair[0]} and {pair[1]} share bytes; refused")
    _blocks_held(model_dir, reader)
    return reader


def _blocks_held(model_dir, reader) -> None:
    """{arch}.block_count against the blocks the tensors hold, before transformers' config is made
    from it: the config class expands the count into per-layer lists (a count patched to 10^9 ran past
    150 s at 1.1 GB). Every block holds a tensor (blk.N.*); a converter's extra next-token blocks come
    after the model's, so the tensors may hold more, never fewer."""
    import re

    def value(key):
        field = reader.fields.get(key)
        try:
            return field.contents() if field is not None else None
        except Exception:  # a field gguf-py cannot decode is the config reader's to refuse
            return None

    name = value("general.architecture")
    declared = value(f"{name}.block_count") if isinstance(name, str) else None
    if not isinstance(declared, int) or isinstance(declared, bool):
        return
    held = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d{1,9})\.", t.name))}
    if declared > len(held):
        raise InputError(f"{model_dir}: its metadata declares {declared:,} blocks ({name}.block_count), its tensors "
                         f"hold {len(held):,}; refused")


def _runner(model, hooked) -> object:
    """The base model (no output head: a 49,152 x 576 matmul per token, and its weight, not needed)
    where every norm parity checks is inside it; else the whole model."""
    base = getattr(model, "base_model", model)
    if base is model:
        return model
    inside = {id(m) for m in base.modules()}
    modules = [m for m, _ in hooked(model)]
    return base if modules and all(id(m) in inside for m in modules) else model


def _load_gguf(model_dir, source: Path, hooked) -> _Loaded:
    """A GGUF read here: one parse (gguf-py, memory-mapped), transformers' config and tokenizer from it,
    the model built empty from the config, and only the tensors the forward up to the last norm needs
    dequantized into it (gguf-py's dequantize, transformers' own name map and tensor processors, as its
    loader does: the same values). Where this loader cannot place the tensors (an architecture whose
    modules transformers names otherwise), transformers' loader takes the whole file, and the summary
    says so."""
    reader = _read_gguf(model_dir, source)
    with _gguf_served(source, reader):
        config, tokenizer = _config_and_tokenizer(model_dir, str(source.parent), {"gguf_file": source.name})
        cls = _model_class(config, gguf=True)
        try:
            with _quiet():
                model, runner, note = _gguf_direct(model_dir, source, reader, config, cls, hooked)
            return _Loaded(config, tokenizer, cls, model, runner, note)
        except _Fallback as why:
            reason = str(why)
    return _gguf_via_transformers(model_dir, source, f"the whole model loaded by transformers' GGUF loader: {reason}",
                                  reader)


def _gguf_direct(model_dir, source: Path, reader, config, cls, hooked):
    """(model, runner, note), `hooked(model)` the modules the capture hooks; InputError for a file that declares more than it holds, _Fallback where
    transformers' internals are not as this loader expects."""
    import warnings

    import numpy as np
    import torch
    from gguf import dequantize

    try:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            load_gguf_checkpoint,
        )
    except ImportError as exc:
        raise _Fallback(f"this transformers has no {exc.name or 'GGUF helpers'}") from None
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            raise _Fallback("this transformers has no no_init_weights") from None

    def build():
        try:
            if hasattr(cls, "from_config"):  # an Auto class
                return cls.from_config(config, trust_remote_code=False)
            return cls._from_config(config)
        except Exception as exc:  # a config the metadata made that transformers cannot build
            raise InputError(f"{model_dir}: transformers cannot build the model ({cls.__name__}) its metadata "
                             f"declares: {' '.join(str(exc).split())[:200]}") from None

    # the model's size from the metadata, counted on the meta device before a byte is allocated: every
    # parameter is filled from a tensor of the same size, so it cannot need more than the tensors hold
    with torch.device("meta"):
        shell = build()
    declared = sum(p.numel() for p in shell.parameters())
    held = sum(int(t.n_elements) for t in reader.tensors)
    if declared > held:
        raise InputError(f"{model_dir}: its metadata declares a {type(shell).__name__} "
                         f"of {declared:,} parameters, its tensors hold {held:,} values; refused")
    del shell
    with no_init_weights():
        model = build()
    model = model.to(torch.float32).eval()  # what transformers' GGUF loader gives: dequantized to float32
    runner = _runner(model, hooked)
    parsed = load_gguf_checkpoint(str(source), return_tensors=False)  # the served reader: no second parse
    parsed["tensors"] = {}
    arch = str(reader.fields["general.architecture"].contents())
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    mapping = get_gguf_hf_weights_map(model, processor)
    slots = model.state_dict(keep_vars=True)  # name -> parameter or persistent buffer, tied ones under each name
    needed = {id(p) for p in runner.parameters()}
    read, skipped, filled = 0, [], set()

    def place(name, value):
        slot = slots.get(name)
        if slot is None:
            raise _Fallback(f"GGUF tensor maps to {name}, which {type(model).__name__} does not have")
        if tuple(value.shape) != tuple(slot.shape):
            raise _Fallback(f"{name} is {list(value.shape)} in the file, {list(slot.shape)} in {type(model).__name__}")
        with torch.no_grad():
            slot.copy_(value)
        filled.add(id(slot))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.from_numpy on the read-only memory map
        for tensor in reader.tensors:
            target = mapping.get(tensor.name)
            if target is not None and target in slots and id(slots[target]) not in needed:
                skipped.append(tensor.name)  # the output head of an untied model: never run
                continue
            if int(tensor.data.nbytes) != int(tensor.n_bytes):
                raise InputError(f"{model_dir}: tensor {tensor.name} holds {tensor.data.nbytes} bytes of the "
                                 f"{tensor.n_bytes} it declares; refused")
            try:
                weights = dequantize(tensor.data, tensor.tensor_type)
                result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                           parsed_parameters=parsed)
            except Exception as exc:  # a type gguf-py cannot decode, a shape the processor cannot take
                raise InputError(f"{model_dir}: tensor {tensor.name} cannot be dequantized: "
                                 f"{' '.join(str(exc).split())[:200]}") from None
            read += 1
            if result.name is None or result.name not in mapping:
                continue  # taken by the processor (into parsed["tensors"]) or not the model's
            place(mapping[result.name], torch.from_numpy(np.asarray(result.weights)))
        for name, value in parsed["tensors"].items():  # a processor's merged tensors (MoE experts)
            place(name, value)
    missing = [n for n, p in runner.named_parameters() if id(p) not in filled]
    if missing:
        raise _Fallback(f"no GGUF tensor for {len(missing)} of {type(model).__name__}'s parameters "
                        f"(e.g. {missing[0]}) under gguf-py's names")
    note = f"read {read} of {len(reader.tensors)} tensors, all the forward needs up to the last norm layer" + (
        f"; skipped {', '.join(skipped)} (the output head is not run)" if skipped else "")
    return model, runner, note


def _hooked(model, names: dict, family) -> list:
    """[(module, layer name)]: each module of `model` that is a checked layer, by its own name, with
    the model. prefix an AutoModel drops, or, where transformers names the module otherwise than the
    checkpoint stores it (language_model.model.layers.3 stored, model.language_model.layers.3 the
    module in transformers 5.x), the one layer of the same pattern and indices; each layer once."""
    from parity_cli.model.families import layout_lookup

    find = layout_lookup(names, family)
    out, taken = [], set()
    for qual, module in model.named_modules():
        name = next((n for n in (qual, f"model.{qual}") if n in names), None) or find(qual)
        if name is not None and name not in taken:
            taken.add(name)
            out.append((module, name))
    return out


def capture(model_dir, text: str, max_tokens: int = 512, rows_per_layer: int = 96, device: str = "cpu",
            seed: int = 0, chunk: int | None = None, stage=None) -> tuple[dict, dict]:
    """({layer name: float32 rows (k, dim)}, metadata) for the norm layers parity checks. `stage(text)`
    is told what the capture does next (the CLI's status line, or a line on stderr when piped)."""
    say = stage or (lambda text: None)
    import torch

    from parity_cli.backends.implementations import mean_square
    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load
    from parity_cli.options import check_device

    if not 3 <= rows_per_layer <= MAX_ROWS_PER_LAYER:
        raise InputError(f"--rows-per-layer must be between 3 and {MAX_ROWS_PER_LAYER}")
    if max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    say(f"reading the norm layers of {model_dir}")
    ckpt, fam, eps = load(model_dir)
    layers = discover_layers(ckpt, fam, eps).layers
    names = {layer.name: layer for layer in layers}
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise InputError("parity capture needs transformers: pip install transformers") from None
    from parity_cli.sources.gguf import is_gguf

    def hooked(model):
        return _hooked(model, names, fam)

    source = Path(model_dir)
    say(f"loading the model ({len(layers)} norm layers to hook)")
    if source.is_file() and is_gguf(source):  # transformers' config, tokenizer and classes (needs gguf)
        loaded = _load_gguf(model_dir, source, hooked)
    else:
        loaded = _load_hf(model_dir, source)
    config, tokenizer, cls = loaded.config, loaded.tokenizer, loaded.cls
    model = loaded.model.to(check_device(device)).eval()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=True)["input_ids"][0][:max_tokens]
    if ids.numel() == 0:
        raise InputError("the text has no tokens")
    # whole sequences as the model was trained on them (positions matter), up to its context
    chunk = chunk or min(int(getattr(config, "max_position_embeddings", 0) or 2048), 2048)
    rng = random.Random(seed)
    samples = {name: RowSample.of(rows_per_layer, rng, copy=lambda row: row.clone()) for name in names}
    hooks, seen = [], set()
    for module, name in hooked(model):
        layer = names[name]

        def hook(mod, args, name=name, layer=layer):
            x = args[0].detach()
            rows = x.reshape(-1, x.shape[-1]).to("cpu", torch.float32)
            if rows.shape[-1] != layer.dim:
                return
            seen.add(name)
            rows = rows[torch.isfinite(rows).all(-1)]  # a row with NaN/inf has no q: not a probe
            samples[name].add(rows, mean_square(rows, layer.kind))

        hooks.append(module.register_forward_pre_hook(hook))
    say(f"running {ids.numel()} tokens through {cls.__name__}")
    try:
        with torch.no_grad():
            for start in range(0, ids.numel(), chunk):
                loaded.runner(input_ids=ids[start:start + chunk].unsqueeze(0).to(model.device))
    finally:
        for h in hooks:
            h.remove()
    missing = sorted(set(names) - seen)
    if not seen:
        raise InputError(f"{model_dir}: no module of {cls.__name__} is a norm layer parity checks "
                         f"(looked for {', '.join(sorted(names)[:3])}, ...); nothing captured")
    kept = {name: samples[name].kept() for name in names if name in seen}
    kept = {name: torch.stack(rows) if rows else None for name, rows in kept.items()}
    empty = sorted(name for name, rows in kept.items() if rows is None)
    if empty:  # the forward reached them, but every row it gave was NaN or inf: nothing to probe with
        raise InputError(f"{model_dir}: every row {cls.__name__} gave {layer_count(len(empty))} "
                         f"({empty[0]}{', ...' if len(empty) > 1 else ''}) is NaN or inf; nothing captured")
    tensors = {name: rows.contiguous() for name, rows in kept.items()}
    for layer in layers:  # the norms themselves: a copy in another format is the same model within rounding
        for part, t in (("weight", layer.weight), ("bias", layer.bias)):
            if t is not None:
                keep = torch.float64 if t.dtype == torch.float64 else torch.float32  # exact either way
                tensors[f"{NORM_PREFIX}{part}:{layer.name}"] = t.detach().to("cpu", keep).contiguous()
    meta = {
        "fingerprint": fingerprint(layers)["sha256"],
        "checkpoint": str(model_dir),
        "model_class": cls.__name__,
        "tokens": int(ids.numel()),
        "rows_per_layer": rows_per_layer,
        "sampling": describe(rows_per_layer),
        "seed": seed,
        "device": str(device),
        "not_seen": missing,
        "loaded": loaded.note,
        "rows": int(sum(t.shape[0] for name, t in tensors.items() if not name.startswith(NORM_PREFIX))),
        "norms": {layer.name: {"dtype": str(layer.weight.dtype).removeprefix("torch."),
                               "shape": list(layer.weight.shape), "gain_offset": layer.gain_offset}
                  for layer in layers if layer.weight is not None},
    }
    return tensors, meta


def summary(out, tensors: dict, meta: dict) -> list[str]:
    """What `parity capture` prints: how a GGUF was loaded, then the rows the file holds, counted from
    its tensors (all layers alike: that figure per layer; else the range), against the cap."""
    per = sorted(t.shape[0] for name, t in tensors.items() if not name.startswith(NORM_PREFIX))
    rows, cap = sum(per), meta["rows_per_layer"]
    each = f"{per[0]:,} each" if per[0] == per[-1] else f"{per[0]:,} to {per[-1]:,} each"
    lines = [f"{meta['checkpoint']}: {meta['loaded']}"] if meta.get("loaded") else []
    line = (f"{out}: {rows:,} rows from {meta['tokens']:,} tokens, {len(per)} layers x {each} "
            f"(at most {cap:,} a layer)")
    if meta.get("not_seen"):
        line += f"; not reached: {', '.join(meta['not_seen'])}"
    return lines + [line]


def write(tensors: dict, meta: dict, out) -> None:
    """safetensors with the capture's settings and fingerprint as metadata, written atomically."""
    from safetensors.torch import save

    from parity_cli.outputs import write_bytes

    write_bytes(Path(out), save(tensors, metadata={"parity": json.dumps(meta)}))


def load(path, layers, all_layers, family=None) -> tuple[dict, dict]:
    """The captured rows for `layers`, after checking the file is a capture of this model. With
    `family`, a capture name is this checkpoint's layer of the same pattern and indices where the
    layouts differ (model.layers.3 and language_model.model.layers.3), so that a capture of a
    text-only copy (a GGUF, a ForCausalLM) serves the multimodal checkpoint it came from."""
    import torch
    from safetensors import safe_open

    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.sources.jsonfile import parse, regular_file

    path = Path(path)
    regular_file(path, "the activations", MAX_FILE_BYTES, f"more than a capture may have ({MAX_FILE_BYTES}); refused")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = parse((fh.metadata() or {}).get("parity", "null"), path, "the capture's metadata")
            if not isinstance(meta, dict) or "fingerprint" not in meta:
                raise InputError(f"{path}: not a parity capture (no parity metadata)")
            # the match is computed from the norm tensors the capture carries, never read from what its
            # metadata says of itself (a fingerprint copied from this model over another's norms was "exact")
            meta["match"], meta["norms_match"], mapping = _same_norms(fh, meta, all_layers, path, family)
            if meta["fingerprint"] == fingerprint(all_layers)["sha256"] and not mapping \
                    and meta["norms_match"]["kind"] == "equal_values":
                meta["match"] = "exact: the same norm tensors"
                meta["norms_match"] = {"kind": "exact", "max_abs_diff": 0.0}
            rows = {}
            by_name = {layer.name: layer for layer in layers}
            for stored_name in fh.keys():
                name = mapping.get(stored_name, stored_name)  # the capture's name, as this checkpoint names it
                if name not in by_name or stored_name.startswith(NORM_PREFIX):
                    continue
                layer = by_name[name]
                declared = fh.get_slice(stored_name)  # the header's shape and dtype, checked before a byte is read
                shape, dtype = list(declared.get_shape()), str(declared.get_dtype())
                if len(shape) != 2 or shape[-1] != layer.dim or not 0 < shape[0] <= MAX_ROWS_PER_LAYER \
                        or dtype not in ("F16", "BF16", "F32", "F64"):
                    raise InputError(f"{path}: {name} holds {shape} {dtype}, not rows of {layer.dim}")
                t = fh.get_tensor(stored_name).to(torch.float64)
                if not bool(torch.isfinite(t).all()):  # no probe: a NaN row has no q, nothing to compare
                    raise InputError(f"{path}: {name} holds non-finite values; refused")
                rows[name] = t
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: not a readable safetensors capture ({' '.join(str(exc).split())[:160]})") from None
    if not rows:
        raise InputError(f"{path}: holds rows for none of the checked layers; refused")
    return rows, meta


_STORAGE = ("float64", "float32", "float16", "bfloat16")  # the dtypes a norm is compared as stored


def _layout(stored, here: dict, family) -> tuple[dict, list, list]:
    """({capture name: name here}, capture names with no layer here, layers here with no capture
    name): a name both have is itself; another is the one layer here of the same pattern and indices
    (model.families.layout_lookup) that the capture does not name itself."""
    from parity_cli.model.families import layout_lookup

    find = layout_lookup([n for n in here if n not in stored], family) if family is not None else lambda name: None
    mapping, unplaced = {}, []
    for name in stored:
        same = name if name in here else find(name)
        if same is not None and same not in mapping.values():
            mapping[name] = same
        else:
            unplaced.append(name)
    return mapping, sorted(unplaced), sorted(set(here) - set(mapping.values()))


def _same_norms(fh, meta: dict, layers, path, family=None) -> tuple[str, dict, dict]:
    """Another copy of the capture's model (a GGUF's float32 norms against the HF copy's bfloat16
    ones, Gemma's 1 + w baked in by llama.cpp against the HF w): the same layers, by name or by
    pattern and indices where the layout differs, the same shapes, and every effective gain (stored + offset)
    within rounding_bound of the other. This checkpoint may have towers the capture's copy lacks
    (a GGUF's language model against the multimodal checkpoint): their layers get no captured rows,
    and the match says so. Anything else is another model: refused in one line. (the match line,
    its numbers for the report, {capture name: name here} where they differ)"""
    import torch

    def other(why: str) -> InputError:
        return InputError(f"{path}: captured from another model ({why}; its norm fingerprint "
                          f"{str(meta['fingerprint'])[:12]}... is not this checkpoint's); refused")

    stored = meta.get("norms")
    if not isinstance(stored, dict):
        raise other("the capture does not record its norms")
    if not stored:
        raise other("the capture records no norm layer")
    from parity_cli.model.layers import tower_of

    here = {layer.name: layer for layer in layers if layer.weight is not None}
    mapping, unplaced, extra = _layout(stored, here, family)
    if not mapping:
        raise other("no norm layer of the capture is one of this checkpoint's")
    # the capture's copy may hold towers this one lacks (a multimodal checkpoint's capture checked on
    # its language model's GGUF): their rows are not used; a layer of a tower both hold must be here
    shared = {tower_of(name) for name in mapping}
    stray = [name for name in unplaced if tower_of(name) in shared]
    if stray:
        raise other(f"{len(stray)} norm layer(s) in the capture and not here, e.g. {stray[0]}")
    towers = sorted({here[name].tower for name in mapping.values()})
    missing = [name for name in extra if here[name].tower in towers]  # a tower the capture has, less a layer
    if missing:
        raise other(f"{len(missing)} norm layer(s) here and not in the capture, e.g. {missing[0]}")
    keys = set(fh.keys())
    worst, worst_ratio, dtypes = 0.0, 0.0, set()
    for stored_name, name in sorted(mapping.items()):
        layer, info = here[name], stored[stored_name]
        mine = str(layer.weight.dtype).removeprefix("torch.")
        theirs = info.get("dtype") if isinstance(info, dict) else None
        if theirs not in _STORAGE or mine not in _STORAGE or info.get("shape") != list(layer.weight.shape):
            raise other(f"{name} is {info} there, {mine} {list(layer.weight.shape)} here")
        offset = info.get("gain_offset")
        if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
            raise other(f"{name}'s recorded gain offset is {offset!r}")
        dtypes.update((mine, theirs))
        for part, t in (("weight", layer.weight), ("bias", layer.bias)):
            tensor = f"{NORM_PREFIX}{part}:{stored_name}"
            if t is None:
                continue
            if tensor not in keys or list(fh.get_slice(tensor).get_shape()) != list(t.shape):
                raise other(f"{name}'s {part} is not in the capture as this checkpoint has it")
            a = fh.get_tensor(tensor).to(torch.float64)  # the capture's stored values, kept as float32 (exact)
            b = t.detach().cpu().to(torch.float64)
            shift = float(offset) - layer.gain_offset if part == "weight" else 0.0
            # one value rounded once the same way: equal, or not the same model
            bound = torch.zeros_like(a) if shift == 0 and mine == theirs else rounding_bound(a, theirs, b, mine)
            a = a + shift  # the two effective gains (stored + offset), compared on this checkpoint's scale
            if shift and "float16" in (mine, theirs):
                # llama.cpp's converter adds the offset in a float16 source's own dtype (it upcasts only
                # other dtypes first): the baked 1 + w carries one more float16 rounding, at 1 + w
                bound = bound + half_step(b + layer.gain_offset, "float16")  # at the effective gain
            finite = torch.isfinite(a) & torch.isfinite(b)
            a_odd, b_odd = a[~finite], b[~finite]
            if not bool(((a_odd == b_odd) | (a_odd.isnan() & b_odd.isnan())).all()):
                raise other(f"{name}'s {part} has non-finite values that differ")
            diff, bound = (a - b).abs()[finite], bound[finite]
            over = diff > bound
            if bool(over.any()):
                k = int(torch.argmax(torch.where(over, diff - bound, torch.full_like(diff, -1.0))))
                raise other(f"{name}'s {part} differs by up to {float(diff.max()):.3g}, more than {theirs} and "
                            f"{mine} rounding allow ({float(diff[k]):.3g} where {float(bound[k]):.3g} is allowed)")
            if diff.numel() and bool((diff > 0).any()):
                worst = max(worst, float(diff.max()))
                worst_ratio = max(worst_ratio, float((diff[diff > 0] / bound[diff > 0]).max()))
    coarsest = max(dtypes, key=lambda d: torch.finfo(getattr(torch, d)).eps)
    renamed = {a: b for a, b in mapping.items() if a != b}
    names = "shapes" if not renamed else f"shapes, {len(renamed)} named as this layout names them"
    if worst == 0:
        kind = "equal_values"
        line = f"equal values: the same norm layers and {names}, stored as {' and '.join(sorted(dtypes))}"
    else:
        kind = "within_rounding"
        line = (f"within {coarsest} rounding: the same norm layers and {names}; largest difference "
                f"{worst:.3g} ({worst_ratio:.2f} of the rounding bound)")
    numbers = {"kind": kind, "dtypes": sorted(dtypes), "coarsest": coarsest, "max_abs_diff": worst,
               "max_diff_over_bound": worst_ratio,
               "bound": "per element, half a step of each copy's storage dtype at its stored value, summed"}
    if renamed:
        numbers["renamed"] = len(renamed)
    if extra:
        others = sorted({here[name].tower for name in extra})
        line += (f"; the capture's copy holds the {' and '.join(towers)} tower only: {len(extra)} layers of the "
                 f"{' and '.join(others)} tower here have no captured rows")
        numbers["without_rows"] = {"layers": len(extra), "towers": others}
    if unplaced:
        theirs = sorted({tower_of(name) for name in unplaced})
        line += (f"; this copy lacks the capture's {' and '.join(theirs)} tower: its {len(unplaced)} layers' rows "
                 "are not used")
        numbers["rows_not_used"] = {"layers": len(unplaced), "towers": theirs}
    return line, numbers, renamed


def q_summary(rows, eps: float, kind: str) -> dict:
    """Where real rows sit on the q/eps scale: min, 1st and 50th percentile, and the share under
    the 1 % attenuation budget (q/eps < 49.25, where sqrt(q / (q + eps)) < 0.99)."""
    import torch

    from parity_cli.backends.implementations import mean_square
    from parity_cli.options import ONE_PERCENT_Q_OVER_EPS

    r = mean_square(rows, kind) / eps if eps > 0 else torch.full((rows.shape[0],), float("inf"), dtype=torch.float64)
    return {"rows": int(r.numel()), "min": float(r.min()), "p01": float(torch.quantile(r, 0.01)),
            "p50": float(torch.quantile(r, 0.5)),
            "below_1pct_budget": float((r < ONE_PERCENT_Q_OVER_EPS).double().mean())}


def eps_impact(rows, gain, bias, eps: float, other_eps: float, kind: str, rtol: float) -> dict:
    """What an eps of `other_eps` instead of `eps` does to real rows, in float64: per row the
    largest |change| over the row's largest |output|; the share of rows moved by more than rtol
    and by more than 1 %, and the worst row."""
    from parity_cli.backends.implementations import oracle_normalize

    def out(e):
        y = oracle_normalize(rows, e, kind) * gain
        return y if bias is None else y + bias

    return {"eps": other_eps, **_moved(out(other_eps), out(eps), rtol)}


def _moved(changed, base, rtol: float) -> dict:
    """Per row the largest |change| over the row's largest |output| (a NaN row counts as moved
    without bound): how many rows move past rtol and past 1 %, and the worst."""
    import torch

    scale = base.abs().amax(-1).clamp_min(torch.finfo(torch.float64).tiny)
    move = (changed - base).abs().amax(-1) / scale
    move = torch.where(torch.isnan(move), torch.full_like(move, float("inf")), move)
    worst = int(torch.argmax(move))
    return {"rows": int(move.numel()), "share_over_rtol": float((move > rtol).double().mean()),
            "share_over_1pct": float((move > 0.01).double().mean()),
            "worst_row": {"index": worst, "move": float(move[worst])}}


def captured_summary(layer, strata, gain, bias, eps: float, tol, diagnoses) -> dict | None:
    """For the report: the real rows' q/eps, what the candidate does to them (measured), and what
    each diagnosed eps would do to them on its own (computed in float64)."""
    s = next((s for s in strata if s.name == "captured"), None)
    if s is None or s.x is None:
        return None
    out = {"q_over_eps": q_summary(s.x, eps, layer.kind)}
    if s.cand is not None and s.ref is not None:
        out["candidate"] = _moved(s.cand, s.ref, tol.rtol)
    impacts = []
    for d in diagnoses:
        est = d.evidence.get("estimated_eps") if d.code == "eps_mismatch" else None
        if isinstance(est, (int, float)) and est > 0:
            impacts.append({"code": d.code, **eps_impact(s.x, gain, bias, eps, est, layer.kind, tol.rtol)})
    out["impact"] = impacts
    return out
