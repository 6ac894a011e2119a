"""Model families as data: what each family's norm layers compute and where their tensors are.

One TOML file per family in configs/families/; adding a family is adding a file. The files in
configs/families/derived/ are generated from each model's own transformers classes
(tools/derive_families.py) and reviewed like code; a hand-written family claims its types first. A family
states its defaults (kind, numerics order, gain offset, eps keys); a `[[norms]]` entry may
override any of them for the tensors it matches (DeepSeek-V3's fixed-eps MLA norms, Gemma 3's
LayerNorm vision tower)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

from parity_cli.errors import InputError
from parity_cli.resources import configs_dir, load_toml

# batch_norm: inference BatchNorm, (x - running_mean) / sqrt(running_var + eps) * w + b per channel,
# its statistics stored beside the gain (`{name}.running_mean`, `{name}.running_var`)
# group_norm: GroupNorm, a LayerNorm over each group of C / groups channels and every position
# gated_rms_norm: an RMSNorm with a second input z, the gate act(z) applied before the statistic
# (Mamba's x * silu(z), then RMSNorm per group) or after it (Qwen3-Next's RMSNorm(x) * w * silu(z))
KINDS = ("rms_norm", "layer_norm", "batch_norm", "group_norm", "gated_rms_norm")
GATES = ("before", "after")
ACTIVATIONS = ("silu", "sigmoid")
# Numerics orders the `hf` implementation reproduces (parity_cli.backends.implementations):
#   llama  - fp32 normalise, cast to the input dtype, multiply by the weight at its dtype
#   gemma  - fp32 normalise and gain, cast to the input dtype last
#   t5     - fp32 variance, cast to the weight dtype when it is half, multiply by the weight
#   native - torch.nn.LayerNorm / F.layer_norm (F.batch_norm in eval mode) at the parameter dtype
#   native_fp32 - F.layer_norm on the input upcast to float32, cast back last (OLMo's parameterless LayerNorm)
ORDERS = ("llama", "gemma", "t5", "native", "native_fp32")
INVERSE_SQRTS = ("rsqrt", "pow")  # torch.rsqrt(v) or torch.pow(v, -0.5): not bitwise equal in fp32


@dataclass(frozen=True)
class Semantics:
    """What a norm computes: the parts of a family a pattern may override."""

    kind: str
    order: str
    gain_offset: float  # effective gain = gain_offset + stored weight
    inverse_sqrt: str
    eps_keys: tuple[str, ...]
    eps_default: float
    eps: float | None  # fixed by the model code, whatever the config says
    eps_source: str | None
    hf_class: str | None  # dotted path of the transformers (or torch) module class
    # group_norm, gated_rms_norm: the group count, a config expression for it (`n_groups`), or
    # "channels" (one group a channel)
    groups: int | str | None = None
    gate: str | None = None  # gated_rms_norm: "before" or "after" the statistic
    activation: str | None = None  # gated_rms_norm: "silu" or "sigmoid" of z
    # "channels_first": the module normalises over C at each position of an (N, C, H, W) map (ConvNeXt's,
    # SAM's LayerNorm): its class is fed a row as an (N, C, 1, 1) map; the math is the row norm's
    layout: str | None = None


@dataclass(frozen=True)
class NormPattern:
    """One kind of norm tensor: `{root}`, `{i}`, `{j}` are placeholders in `name`."""

    name: str
    dim: str  # config expression of the size the norm runs over (a consistency check)
    regex: re.Pattern
    semantics: Semantics
    # a norm with no parameter (OLMo's LayerNorm, Llama 4's L2Norm, Gemma 4's v_norm): nothing is
    # stored, so it is found by its parent module (which stores something) and `dim` is required
    weightless: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    model_types: tuple[str, ...]
    semantics: Semantics
    roots: tuple[str, ...]
    norms: tuple[NormPattern, ...]
    source: str  # the file it came from
    weight_names: tuple[str, ...] = ("weight",)
    bias_names: tuple[str, ...] = ("bias",)
    eps_defaults: dict = field(default_factory=dict)  # model_type -> the config class's own default
    hf_classes: dict = field(default_factory=dict)  # model_type -> module class
    gguf_architectures: dict = field(default_factory=dict)  # GGUF general.architecture -> model_type
    gguf_offset_baked: bool = False  # llama.cpp's converter stores offset + w: the gain is the stored value
    derived_from: str | None = None  # "transformers 5.24.0: Qwen2ForCausalLM" for a generated family
    # the norms its classes build that parity cannot express ([[unsupported]] of a derived family): (pattern, its
    # regex, why)
    unsupported: tuple = ()
    # how the installed transformers bears on it (model.installed): validated, derived again at run time
    # ("derived at run time: transformers 5.25.0 renamed MambaRMSNormGated → Mamba2RMSNormGated"), a class rebound
    provenance: str | None = None
    # derived again: what the installed release computes otherwise than the committed family
    # ("backbone.layers.*.mixer.norm: groups n_groups → 1"), said on the verdict line: a PASS of other semantics
    moved: tuple = ()

    @property
    def source_line(self) -> str:
        """checkpoint.family_source: where the family's knowledge came from, in one line."""
        from pathlib import Path

        return self.provenance or self.derived_from or f"configs/families/{Path(self.source).name}"

    # The family-wide semantics, for tables and messages.
    @property
    def kind(self) -> str:
        return self.semantics.kind

    @property
    def order(self) -> str:
        return self.semantics.order

    @property
    def gain_offset(self) -> float:
        return self.semantics.gain_offset

    @property
    def eps_keys(self) -> tuple[str, ...]:
        return self.semantics.eps_keys

    @property
    def eps_default(self) -> float:
        return self.semantics.eps_default

    def eps_default_for(self, model_type: str | None) -> float:
        return float(self.eps_defaults.get(model_type, self.semantics.eps_default))

    def hf_class_for(self, pattern: NormPattern, model_type: str | None) -> str | None:
        if pattern.semantics.hf_class != self.semantics.hf_class:
            return pattern.semantics.hf_class  # a per-norm exception wins
        return self.hf_classes.get(model_type, self.semantics.hf_class)

    def match(self, layer_name: str) -> NormPattern | None:
        for pattern in self.norms:
            if not pattern.weightless and pattern.regex.fullmatch(layer_name):
                return pattern
        return None


def _compile(template: str, roots: tuple[str, ...]) -> re.Pattern:
    root_alt = "|".join(re.escape(r) for r in roots)
    out = []
    for part in re.split(r"(\{root\}|\{i\}|\{j\})", template):
        if part == "{root}":
            out.append(f"(?:{root_alt})")
        elif part in ("{i}", "{j}"):
            out.append(r"\d+")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def _semantics(table: dict, base: Semantics | None, where: str) -> Semantics:
    def get(key, typ, default=None, required=False):
        if key not in table:
            if required and base is None:
                raise InputError(f"{where}: missing key '{key}'")
            return default
        value = table[key]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise InputError(f"{where}: key '{key}' has the wrong type")
        return value

    def pick(key, typ, fallback):
        value = get(key, typ, None, required=fallback is None)
        return fallback if value is None else value

    b = base
    kind = pick("kind", str, b and b.kind)
    if kind not in KINDS:
        raise InputError(f"{where}: kind '{kind}' is not one of {', '.join(KINDS)}")
    order = pick("order", str, b and b.order)
    if order not in ORDERS:
        raise InputError(f"{where}: order '{order}' is not one of {', '.join(ORDERS)}")
    groups = table.get("groups", b.groups if b else None)
    if kind == "gated_rms_norm" and groups is None:
        groups = 1
    if kind in ("group_norm", "gated_rms_norm") and not (
            (isinstance(groups, str) and groups) or (type(groups) is int and groups > 0)):
        raise InputError(f"{where}: a {kind} needs groups = a positive integer, a config key or \"channels\"")
    gate = table.get("gate", b.gate if b else None)
    activation = table.get("activation", b.activation if b else None) or "silu"
    if kind == "gated_rms_norm" and (gate not in GATES or activation not in ACTIVATIONS):
        raise InputError(f"{where}: a gated_rms_norm needs gate = {' or '.join(GATES)} and activation = "
                         f"{' or '.join(ACTIVATIONS)}")
    if kind == "gated_rms_norm" and order not in ("llama", "gemma"):
        raise InputError(f"{where}: a gated_rms_norm runs in order llama or gemma, not '{order}'")
    if kind in ("batch_norm", "group_norm") and order != "native":
        raise InputError(f"{where}: a {kind} runs in order 'native' (torch's functional op at the parameter "
                         f"dtype), not '{order}'")
    inverse_sqrt = get("inverse_sqrt", str, b.inverse_sqrt if b else "rsqrt")
    if inverse_sqrt not in INVERSE_SQRTS:
        raise InputError(f"{where}: inverse_sqrt '{inverse_sqrt}' is not one of {', '.join(INVERSE_SQRTS)}")
    eps = get("eps", float)
    if eps is not None and not eps >= 0:
        raise InputError(f"{where}: eps must be >= 0")
    eps_default = get("eps_default", float, b.eps_default if b else None, required=True)
    if not eps_default >= 0:
        raise InputError(f"{where}: eps_default must be >= 0")
    keys = get("eps_keys", list, list(b.eps_keys) if b else None, required=True)
    return Semantics(
        kind=kind,
        order=order,
        gain_offset=get("gain_offset", float, b.gain_offset if b else 0.0),
        inverse_sqrt=inverse_sqrt,
        eps_keys=tuple(str(k) for k in keys),
        eps_default=eps_default,
        eps=eps,
        eps_source=get("eps_source", str, "model-code" if eps is not None else None),
        hf_class=get("hf_class", str, b.hf_class if b else None),
        groups=groups if kind in ("group_norm", "gated_rms_norm") else None,
        gate=gate if kind == "gated_rms_norm" else None,
        activation=activation if kind == "gated_rms_norm" else None,
        layout=_layout(table, b, where),
    )


def _layout(table: dict, base, where: str) -> str | None:
    layout = table.get("layout", base.layout if base else None)
    if layout not in (None, "channels_first"):
        raise InputError(f"{where}: layout '{layout}' is not channels_first")
    return layout


def _parse(path) -> Family:
    return parse_family(load_toml(path), str(path))


def parse_family(data: dict, where: str) -> Family:
    """A family from its data: a configs/families file, or one derived from the model's classes."""
    for key, typ in (("name", str), ("model_types", list), ("norms", list)):
        if not isinstance(data.get(key), typ):
            raise InputError(f"{where}: missing or invalid key '{key}'")
    base = _semantics(data, None, where)
    roots = tuple(data.get("roots", [""]))
    norms = []
    for k, entry in enumerate(data["norms"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InputError(f"{where}: norms[{k}] needs a 'name'")
        entry_roots = tuple(entry.get("roots", roots))
        weightless = entry.get("weightless", False)
        if not isinstance(weightless, bool) or (weightless and not str(entry.get("dim", "")).strip()):
            raise InputError(f"{where}: norms[{k}] ({entry['name']}): a weightless norm states its dim (a config key)")
        norms.append(NormPattern(
            name=entry["name"],
            dim=str(entry.get("dim", "hidden_size")),
            regex=_compile(entry["name"], entry_roots),
            semantics=_semantics(entry, base, f"{where}: norms[{k}] ({entry['name']})"),
            weightless=weightless,
        ))
    return Family(
        name=data["name"],
        description=data.get("description", ""),
        model_types=tuple(data["model_types"]),
        semantics=base,
        roots=roots,
        norms=tuple(norms),
        source=where,
        weight_names=tuple(data.get("weight_names", ["weight"])),
        bias_names=tuple(data.get("bias_names", ["bias"])),
        eps_defaults={str(k): float(v) for k, v in data.get("eps_defaults", {}).items()},
        hf_classes={str(k): str(v) for k, v in data.get("hf_classes", {}).items()},
        gguf_architectures={str(k): str(v) for k, v in data.get("gguf", {}).get("architectures", {}).items()},
        gguf_offset_baked=bool(data.get("gguf", {}).get("offset_baked", False)),
        derived_from=str(data["derived_from"]) if "derived_from" in data else None,
        unsupported=tuple((u["name"], _compile(u["name"], ("",)), str(u.get("why", "")))
                          for u in data.get("unsupported", []) if isinstance(u, dict) and isinstance(u.get("name"), str)),
    )


def load_families() -> dict[str, Family]:
    """Every family, hand-written and generated, each name and model_type claimed once."""
    return _load(True)


def clear_caches() -> None:
    """Forget every family read (a test that points configs_dir elsewhere)."""
    for f in (_load, _derived_stems, _derived):
        f.cache_clear()


def known_families() -> str:
    """The families a user can force, as a message names them: the hand-written ones by name and
    the generated ones counted (there are hundreds; `parity inspect --family TYPE` takes any
    model_type one claims)."""
    written = sorted(written_families())
    derived = derived_count()
    more = f", and {derived} derived from transformers classes (configs/families/derived/)" if derived else ""
    return ", ".join(written) + more


def written_families() -> dict[str, Family]:
    """The hand-written families (configs/families/*.toml), which claim their types first."""
    return _load(False)


@cache
def _load(derived: bool) -> dict[str, Family]:
    """Hand-written families (configs/families/*.toml), or those and the generated ones."""
    families = {}
    owner: dict[str, str] = {}
    root = configs_dir() / "families"
    paths = sorted(root.glob("*.toml")) + (sorted((root / "derived").glob("*.toml")) if derived else [])
    for path in paths:
        family = _parse(path)
        if family.name in families:
            raise InputError(f"{path}: family '{family.name}' is already defined in {families[family.name].source}")
        for mt in family.model_types:
            if mt in owner:
                raise InputError(f"{path}: model_type '{mt}' is already claimed by family '{owner[mt]}'")
            owner[mt] = family.name
        families[family.name] = family
    return families


@cache
def _derived_stems() -> frozenset[str]:
    return frozenset(p.stem for p in (configs_dir() / "families" / "derived").glob("*.toml"))


@cache
def _derived(model_type: str) -> Family | None:
    """A generated file is named by the one model_type it claims: a lookup parses that file only
    (all of them take most of a second, more than the preflight's budget)."""
    if model_type not in _derived_stems():
        return None
    family = _parse(configs_dir() / "families" / "derived" / f"{model_type}.toml")
    return family if model_type in family.model_types else None


def find_family(name, by_name: bool = True) -> Family | None:
    """The family named `name` (where `by_name`: --family's), or claiming it as a model_type;
    hand-written ones first. A config's model_type is looked up as a type only: `layer_norm`
    there is no model."""
    if not isinstance(name, str) or not name:
        return None
    written = written_families()
    if by_name and name in written:
        return written[name]
    for family in written.values():
        if name in family.model_types:
            return family
    return _derived(name)


def family_by_name(name: str) -> Family:
    """--family takes a family's name or any model_type it claims (`--family bert` is layer_norm:
    the report's `family` then says which family that is)."""
    family = find_family(name)
    if family is None:
        import difflib

        names = list(written_families()) + sorted(_derived_stems()) + [
            t for f in written_families().values() for t in f.model_types]
        close = difflib.get_close_matches(str(name), list(dict.fromkeys(names)), n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise InputError(f"unknown family '{name}' (neither a family nor a model_type one claims); {hint}known "
                         f"families: {known_families()}")
    return family


def layout_lookup(names, family: Family):
    """name -> the one of `names` that is the same layer under another layout, or None (none, or
    several): the same pattern of the family claims both, with the same indices. A checkpoint stores
    language_model.model.layers.3, transformers 5.x names the module model.language_model.layers.3,
    a GGUF model.layers.3."""

    def key(name):
        pattern = family.match(name)
        return (pattern.name, tuple(re.findall(r"(?<=\.)\d+(?=\.|$)", name))) if pattern else None

    by_key: dict = {}
    for name in names:
        by_key.setdefault(key(name), []).append(name)

    def find(name):
        k = key(name)
        found = by_key.get(k, []) if k is not None else []
        return found[0] if len(found) == 1 else None

    return find


def family_choice(given: str | None, family: Family, model_type=None, fmt: str | None = None,
                  architecture: str | None = None) -> str:
    """How the family was chosen, one phrase for the report's checkpoint.family_from and the
    header: `--family layer_norm`, `--family bert: a model type of layer_norm`, `--family albert:
    a model type, its derived family`, or from the checkpoint: `model_type 'bert' in config.json`
    (`in the GGUF metadata`), with `; no family file claims it, derived from its transformers
    classes` where the family was derived as the check ran."""
    if given:
        written = written_families()
        if given in written and written[given].source == family.source:
            return f"--family {given}"
        if family.derived_from and given == family.name:
            return f"--family {given}: a model type, its derived family"
        return f"--family {given}: a model type of {family.name}"
    where = "the GGUF metadata" if fmt == "gguf" else "config.json"
    live = "" if family.source.endswith(".toml") else "; no family file claims it, derived from its transformers classes"
    if fmt == "gguf" and architecture and architecture != model_type:  # llama.cpp's own name for the model
        return f"GGUF architecture '{architecture}', read as model_type '{model_type}'{live}"
    return f"model_type '{model_type}' in {where}{live}"


def derived_count() -> int:
    """How many generated families there are, without parsing one."""
    return len(_derived_stems())


def family_for_model_type(model_type: str | None, where: str) -> Family:
    family = find_family(model_type, by_name=False)
    if family is None:
        raise InputError(f"{where}: model_type '{model_type}' is not a known family; force one with --family "
                         f"(known: {known_families()})")
    return family
