"""Stage 2: checkpoint + family -> the norm layers to check, each with its full semantics.

A NormLayer carries everything a reference needs (kind, numerics order, gain offset, eps and
its source, stored weight), so later stages never look at the family or config again."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from parity_cli.errors import InputError
from parity_cli.model.families import Family
from parity_cli.model.load import resolve_eps
from parity_cli.sources.huggingface import Checkpoint
from parity_cli.sources.tensors import Eps

# Names that look like a norm: anything matching none of the family's patterns is reported.
NORM_HINT = re.compile(r"norm|(^|\.)ln_|LayerNorm", re.IGNORECASE)


@dataclass
class NormLayer:
    name: str
    kind: str  # "rms_norm" | "layer_norm"
    dim: int  # the size the norm runs over (the weight's last axis)
    order: str  # numerics order of the family's HF code (families.ORDERS)
    gain_offset: float  # effective gain = gain_offset + weight
    eps: Eps
    weight: object  # torch.Tensor as stored in the checkpoint; (heads, dim) for Cohere's q/k norms
    bias: object = None
    family: str = ""
    warnings: list[str] = field(default_factory=list)
    inverse_sqrt: str = "rsqrt"
    hf_class: str | None = None
    tensor: str = ""  # the weight tensor's full name
    semantic_offset: float | None = None  # the family's offset when gain_offset differs (GGUF Gemma: baked in)
    program: bytes | None = None  # an exported graph's own subgraph for this norm (onnx_checkpoint)
    weightless: bool = False  # no parameter stored: `weight` is ones (a gain of 1), nothing to compare
    tower: str = "main"  # language, vision, audio, projector, ... (tower_of): a multimodal model's parts
    # batch_norm: the running statistics the checkpoint stores beside the gain (as stored); eps
    # then meets running_var per channel, so q/eps is running_var / eps, a property of the layer
    running_mean: object = None
    running_var: object = None
    # group_norm: C / groups channels a group; the probes give each channel `spatial` positions (a
    # GroupNorm's statistic runs over its group's channels and every position of the feature map)
    groups: int = 1
    spatial: int = 1
    # gated_rms_norm: a probe row is [x | z], the output x's width; the gate act(z) is applied
    # "before" the statistic (Mamba) or "after" it (Qwen3-Next)
    gate: str | None = None
    activation: str | None = None
    layout: str | None = None  # "channels_first": its class is fed each row as an (N, C, 1, 1) map
    # "add": checked as a fused residual add + norm (check.fused): a row is [x | residual], an output
    # row [normed | new residual]
    fused: str | None = None
    # fused "quant": ("static", scale) or ("dynamic", None); an output row is [q | scale]
    quant: tuple | None = None
    fused_program: bytes | None = None  # an exported graph's Skip op as (x, skip) -> (y, x + skip) (onnx_checkpoint)
    # a runtime capture's (probes.runtime_capture): the (x, y) rows the runtime's own node computed,
    # which the `runtime-capture` candidate replays
    recorded: tuple | None = None
    # its x rows hold float32 values wider than the dtype the node computed in (ORT's half Skip ops
    # normalise a float32 sum; OpenVINO at bf16 hands some rows out at f32): the reference reads
    # them as recorded, not rounded to that dtype
    recorded_wide: bool = False

    @property
    def width(self) -> int:
        """A probe row's length: the channels, times the positions each has (group_norm); x and
        its gate z side by side (gated_rms_norm)."""
        return self.dim * self.spatial * (2 if self.kind == "gated_rms_norm" or self.fused == "add" else 1)

    @property
    def out_width(self) -> int:
        """An output row's length: [normed | new residual] for a fused add, [q | scale] for norm + quant."""
        if self.fused == "quant":
            return self.dim + 1
        return self.dim * self.spatial * (2 if self.fused else 1)

    @property
    def stored_dtype(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")

    @property
    def shape(self) -> tuple[int, ...]:
        """Leading axes (heads) broadcast over; the norm runs over the last one."""
        return tuple(self.weight.shape)


# a tower by what the name says, the first that matches (a projector sits between towers, so before them)
_TOWER_NAMES = (
    ("projector", r"multi_modal_projector|mm_projector|projector|connector|vision_language_adapter|aligner"),
    ("vision", r".*vision.*|visual|image_encoder|vit|img_encoder|vpm"),
    ("audio", r".*audio.*|speech_encoder|acoustic|conformer"),
    ("language", r"language_model|text_model|text_encoder|text_decoder|llm|lm"),
)
_SUBCONFIG = {"text": "language", "vision": "vision", "audio": "audio", "speech": "audio", "projector": "projector"}


def tower_of(name: str, eps_source: str = "") -> str:
    """Which part of a multimodal model a norm serves: the first name segment that says
    (`multi_modal_projector`, `model.visual`, `audio_tower`, `language_model`; a projector first,
    since Gemma 3's reads the vision config's eps), else the innermost sub-config its eps is read
    from (`config:vlm_config.vision_config.layer_norm_eps` is the vision tower's), else `main`
    (the model's one stack)."""
    parts = name.split(".")
    for tower, pattern in _TOWER_NAMES:
        if any(re.fullmatch(pattern, part) for part in parts):
            return tower
    subs = re.findall(r"([a-z0-9_]+?)_config\.", (eps_source or "").partition(":")[2])
    if subs:
        sub = subs[-1]
        return _SUBCONFIG.get(sub, next((t for t, pat in _TOWER_NAMES if re.fullmatch(pat, sub)), sub))
    return "main"


@dataclass
class Discovery:
    layers: list[NormLayer]
    unmatched: list[str]  # norm-looking tensors no pattern claims
    warnings: list[str]


def _natural_key(name: str):
    return [int(tok) if tok.isdigit() else tok for tok in re.split(r"(\d+)", name)]


def _config_int(ckpt: Checkpoint, key: str) -> int | None:
    value, _ = ckpt.config_value(key)
    if value is None and key.endswith("head_dim"):  # configs without head_dim derive it
        prefix = key[: -len("head_dim")]
        hidden, _ = ckpt.config_value(prefix + "hidden_size")
        heads, _ = ckpt.config_value(prefix + "num_attention_heads")
        if type(hidden) is int and type(heads) is int and heads:
            return hidden // heads
    return value if type(value) is int else None


def config_dim(ckpt: Checkpoint, expression: str) -> int | None:
    """Evaluates a family's dim expression: `a|b` (first present), `a*b`, `a/b` (integer division)."""
    for alternative in expression.split("|"):
        tokens = re.split(r"([*/])", alternative.strip())
        value = _config_int(ckpt, tokens[0].strip())
        for op, operand in zip(tokens[1::2], tokens[2::2]):
            other = _config_int(ckpt, operand.strip())
            if value is None or other is None or (op == "/" and other == 0):
                value = None
                break
            value = value * other if op == "*" else value // other
        if value is not None:
            return value
    return None


def _split(tensor: str, suffixes: tuple[str, ...]) -> str | None:
    for suffix in suffixes:
        if tensor.endswith("." + suffix):
            return tensor[: -len(suffix) - 1]
    return None


def _running_statistics(ckpt: Checkpoint, name: str, shape: tuple) -> dict:
    """A BatchNorm's running mean and variance, which the checkpoint must store beside its gain:
    without them there is nothing to normalise with at inference (a one-line error, not a guess)."""
    import torch

    out = {}
    for stat in ("running_mean", "running_var"):
        tensor = f"{name}.{stat}"
        if not ckpt.has(tensor):
            raise InputError(f"{ckpt.path}: BatchNorm {name} has no {tensor} (inference needs the running statistics)")
        value = ckpt.read(tensor)
        if tuple(value.shape) != shape or not value.is_floating_point():
            raise InputError(f"{ckpt.path}: {tensor} has shape {list(value.shape)} and dtype "
                             f"{str(value.dtype).removeprefix('torch.')}; its gain {list(shape)}, floating point")
        out[stat] = value
    bad = ~torch.isfinite(out["running_var"].to(torch.float64)) | (out["running_var"].to(torch.float64) < 0)
    if bool(bad.any()):
        raise InputError(f"{ckpt.path}: {name}.running_var holds {int(bad.sum())} negative or non-finite value(s); "
                         "a variance is finite and >= 0")
    return out


GROUP_ELEMENTS = 64  # a GroupNorm probe's group holds at least this many elements (channels x positions)


def _grouping(ckpt: Checkpoint, tensor: str, channels: int, groups, kind: str = "group_norm") -> dict:
    """A grouped norm's group count for this layer (an integer, one a channel, or read from the
    config) and, for a GroupNorm, the positions its probes give each channel."""
    if groups == "channels":
        count = channels
    elif isinstance(groups, str):
        count = config_dim(ckpt, groups)
        if count is None or count <= 0:
            raise InputError(f"{ckpt.path}: {tensor}: the group count is config {groups}, which the config lacks "
                             "or is not a positive integer")
    else:
        count = int(groups)
    if channels % count:
        raise InputError(f"{ckpt.path}: {tensor} has {channels} channels, not a multiple of {count} groups")
    if kind != "group_norm":
        return {"groups": count}
    per_group = channels // count
    spatial = max(2, -(-GROUP_ELEMENTS // per_group))
    return {"groups": count, "spatial": spatial}


def _weightless(ckpt: Checkpoint, family: Family) -> list:
    """(name, None, pattern) of every weightless norm: a parameterless module stores nothing, so
    an instance is found where its parent module stores something (`model.layers.3.self_attn`
    for `model.layers.3.self_attn.q_norm`)."""
    patterns = [p for p in family.norms if p.weightless]
    if not patterns:
        return []
    parents = {""}
    for tensor in ckpt.tensor_names():
        parts = tensor.split(".")
        parents.update(".".join(parts[:k]) for k in range(1, len(parts)))
    found = []
    for pattern in patterns:
        leaf = re.split(r"\.|\{root\}", pattern.name)[-1]
        if "{" in leaf:
            continue
        names = [name for name in (f"{p}.{leaf}" if p else leaf for p in sorted(parents))
                 if pattern.regex.fullmatch(name)]
        # `{root}norm` with roots "model." and "": the model's root is the one that stores something
        # under it, so "norm" beside "model.norm" is the same module seen without its root
        found += [(name, None, pattern) for name in names if not any(o.endswith("." + name) for o in names)]
    return _built(ckpt, found)


def _built(ckpt: Checkpoint, found: list) -> list:
    """The weightless norms the model really builds: a parent module that stores something need not
    hold one (Llama 4's no-RoPE layers have no q/k norm). Where the installed transformers builds the
    model from this config (on the meta device), a pattern it builds modules for keeps only the
    indices it builds; elsewhere the checkpoint's names stand."""
    if not found or ckpt.format == "gguf" or not isinstance(ckpt.model_type, str):
        return found
    from parity_cli.model.installed import built_modules

    modules = built_modules(ckpt.model_type, ckpt.config, str(ckpt.path / "config.json"))
    if modules is None:
        return found
    indices = re.compile(r"(?<=\.)\d+(?=\.|$)")
    kept = []
    for name, tensor, pattern in found:
        built = {tuple(indices.findall(m)) for m in modules if pattern.regex.fullmatch(m)}
        if not built or tuple(indices.findall(name)) in built:
            kept.append((name, tensor, pattern))
    return kept


def _weightless_layer(ckpt: Checkpoint, family: Family, name: str, pattern, override) -> NormLayer | None:
    """A weightless norm as a layer whose gain is 1: eps, the statistic and the numerics still
    decide its output. Its size is the config's (nothing stored says it)."""
    import torch

    dim = config_dim(ckpt, pattern.dim)
    if dim is None or dim <= 0:
        return None
    sem = pattern.semantics
    layer_eps = resolve_eps(ckpt, family, override, sem)
    return NormLayer(name=name, kind=sem.kind, dim=dim, order=sem.order, gain_offset=0.0, eps=layer_eps,
                     weight=torch.ones(dim, dtype=torch.float32), family=family.name,
                     inverse_sqrt=sem.inverse_sqrt, hf_class=family.hf_class_for(pattern, ckpt.model_type),
                     tensor="", semantic_offset=0.0, tower=tower_of(name, layer_eps.source), weightless=True)


def discover_layers(ckpt: Checkpoint, family: Family, eps: Eps | float | None = None,
                    layers_glob: str | None = None, names: set | None = None) -> Discovery:
    """Every tensor a pattern claims becomes a layer; every other norm-looking tensor is listed
    as unmatched, never skipped silently. `eps` is the --eps override (an Eps or a float)."""
    override = eps.value if isinstance(eps, Eps) and eps.source == "override" else (
        eps if isinstance(eps, (int, float)) else None)
    claimed: set[str] = set()
    matched = []
    for tensor in ckpt.tensor_names():
        name = _split(tensor, family.weight_names)
        pattern = None if name is None else family.match(name)
        if pattern is not None:
            matched.append((name, tensor, pattern))
            claimed.add(tensor)
            for b in family.bias_names:
                claimed.add(f"{name}.{b}")
            if pattern.semantics.kind == "batch_norm":  # read with its gain, whatever --layers selects
                claimed.update(f"{name}.{s}" for s in ("running_mean", "running_var", "num_batches_tracked"))
    unmatched = [t for t in ckpt.tensor_names() if t not in claimed and NORM_HINT.search(t)]
    weightless = _weightless(ckpt, family)
    matched += weightless
    if not matched:
        example = family.norms[0].name.replace("{root}", family.roots[0]).replace("{i}", "0").replace("{j}", "0")
        raise InputError(
            f"{ckpt.path}: no norm tensors of family '{family.name}' found "
            f"(expected names like {example}.{family.weight_names[0]})"
        )
    matched.sort(key=lambda m: _natural_key(m[0]))
    if layers_glob:
        matched = [m for m in matched if fnmatch.fnmatchcase(m[0], layers_glob)]
        if not matched:
            raise InputError(f"--layers '{layers_glob}' matches no norm layer of {ckpt.path}")
    if names is not None:  # a --jobs worker's share
        matched = [m for m in matched if m[0] in names]

    layers, warnings = [], list(getattr(ckpt, "notes", []))  # what the reader set aside (a GGUF's MTP block)
    for name, tensor, pattern in matched:
        if pattern.weightless:
            layer = _weightless_layer(ckpt, family, name, pattern, override)
            if layer is not None:
                layers.append(layer)
            else:
                warnings.append(f"{name}: weightless norm whose size (config {pattern.dim}) the config lacks; "
                                "not checked")
            continue
        info = ckpt.info(tensor)
        if len(info.shape) not in (1, 2) or 0 in info.shape:
            unmatched.append(tensor)
            warnings.append(f"{tensor}: shape {list(info.shape)} is not a gain vector (or a heads x dim "
                            "matrix); not checked")
            continue
        sem = pattern.semantics
        gain_offset = sem.gain_offset
        if getattr(ckpt, "offset_baked", False):
            gain_offset = 0.0  # llama.cpp stores 1 + w: adding 1 again would be the bug it guards against
        dim = info.shape[-1]
        layer_warnings = []
        expected = config_dim(ckpt, pattern.dim) if pattern.dim else None  # a derived family states none
        if expected is not None and dim > 8 * max(expected, 1):
            # a header may declare anything; a norm 8x wider than its config dimension is not a norm
            raise InputError(f"{getattr(info, 'file', ckpt.path)}: tensor '{tensor}' declares {dim} channels where config "
                             f"{pattern.dim} = {expected}; refused")
        if expected is not None and expected != dim:
            layer_warnings.append(f"weight has {dim} channels but config {pattern.dim} = {expected}")
        layer_eps = resolve_eps(ckpt, family, override, sem)
        tower = tower_of(name, layer_eps.source)
        tower_eps = getattr(ckpt, "tower_eps", None)  # an mmproj: one eps per tower, as the runtime reads it
        if tower_eps and override is None and tower in tower_eps:
            layer_eps = tower_eps[tower]
        if layer_eps.source == "family-default" and sem.eps_keys != family.eps_keys:
            # the family-wide eps warning does not cover a norm with its own eps key
            layer_warnings.append(f"eps is not in the config (looked for {', '.join(sem.eps_keys)}); "
                                  f"the default {layer_eps.value:g} is assumed")
        bias = None
        running = {}
        if sem.kind == "batch_norm":
            running = _running_statistics(ckpt, name, tuple(info.shape))
        if sem.kind in ("layer_norm", "batch_norm", "group_norm"):
            for b in family.bias_names:
                if ckpt.has(f"{name}.{b}"):
                    bias = ckpt.read(f"{name}.{b}")
                    if tuple(bias.shape) != tuple(info.shape):
                        raise InputError(f"{ckpt.path}: {name}.{b} has shape {list(bias.shape)}, "
                                         f"its weight {list(info.shape)}")
                    break
        if sem.kind in ("group_norm", "gated_rms_norm"):
            running = _grouping(ckpt, tensor, dim, sem.groups, sem.kind)
        if sem.kind == "gated_rms_norm":
            running.update(gate=sem.gate, activation=sem.activation)
        layers.append(
            NormLayer(
                name=name,
                kind=sem.kind,
                dim=dim,
                order=sem.order,
                gain_offset=gain_offset,
                eps=layer_eps,
                weight=ckpt.read(tensor),
                bias=bias,
                family=family.name,
                warnings=layer_warnings,
                inverse_sqrt=sem.inverse_sqrt,
                hf_class=family.hf_class_for(pattern, ckpt.model_type),
                tensor=tensor,
                semantic_offset=sem.gain_offset,
                tower=tower,
                layout=sem.layout,
                **running,
            )
        )
    return Discovery(layers=layers, unmatched=sorted(unmatched), warnings=warnings)


def unchecked(ckpt, found: Discovery, family) -> list[dict]:
    """The norms of the checkpoint that no layer checks, each once with why: a norm-like tensor no
    pattern claims (by its module: weight and bias are one norm), or a norm the family's classes
    build that parity cannot express yet (its [[unsupported]] entries), where the checkpoint holds
    it (its tensors) or, for a weightless one that stores nothing, its parent module. A verdict
    counts them."""
    from parity_cli.model.families import _compile

    out: dict[str, str] = {}
    modules = sorted({t.rsplit(".", 1)[0] for t in found.unmatched})
    for module in modules:
        why = next((w for _, regex, w in family.unsupported if regex.fullmatch(module)), None)
        out[module] = why or f"matches no pattern of family {family.name}"
    if family.unsupported:
        prefixes = {".".join(t.split(".")[:k]) for t in ckpt.tensor_names() for k in range(1, t.count(".") + 1)}
        for name, regex, why in family.unsupported:
            if any(regex.fullmatch(m) for m in modules) or "." not in name:
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = _compile(parent_name, ("",))
            # each module the pattern stands for, not the pattern: a verdict counts modules (issue 47)
            held = sorted(p for p in prefixes if regex.fullmatch(p))
            if not held and "{" not in leaf:  # a weightless norm stores nothing: its parents say it is there
                held = sorted(f"{p}.{leaf}" for p in prefixes if parent.fullmatch(p))
            elif not held and any(parent.fullmatch(p) for p in prefixes):
                held = [name]
            for module in held:
                out.setdefault(module, why)
    return [{"name": name, "why": why} for name, why in out.items()]
