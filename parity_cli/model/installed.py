"""The installed transformers is the truth at run time (issue 34).

A committed derived family (configs/families/derived/) is a cache stamped with the transformers
release it was generated with. Under another installed release it is checked before use: the
model's module tree is built on the meta device from the checkpoint's config (shrunk as a
derivation shrinks it, every eps-like key marked), and every norm pattern must still find modules
of the class it names, reading the eps key it names; one module of each class is materialised and
classified (model.derive.classify) to confirm it still computes the family's form. Where anything
differs, the family is derived again from the installed classes and what moved is said in one line.

The same tree gives `--candidate transformers` its classes: the class of the module the installed
transformers builds at each pattern, never a class name alone (transformers 5.25 renamed
MambaRMSNormGated to Mamba2RMSNormGated and Llama4TextL2Norm to Llama4TextWeightlessRMSNorm)."""

from __future__ import annotations

import dataclasses
import json
import re

from parity_cli.errors import InputError
from parity_cli.model.families import Family

STAMP = re.compile(r"^transformers ([^\s:]+)")


def installed_version() -> str | None:
    """The installed transformers release, read from its metadata (nothing imported)."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def stamped_version(family: Family) -> str | None:
    """The release a generated family was derived with ("transformers 5.24.0: Mamba2ForCausalLM")."""
    found = STAMP.match(family.derived_from or "")
    return found.group(1) if found else None


@dataclasses.dataclass(frozen=True)
class Difference:
    """One way the committed family no longer describes the installed classes."""

    pattern: str
    what: str  # "renamed", "gone", "several", "eps", "form", "unmatched", "new"
    old: str = ""
    new: str = ""

    def words(self) -> str:
        short = {"old": _short(self.old), "new": ", ".join(_short(c) for c in self.new.split(", ")),
                 "pattern": self.pattern, "old_text": self.old or "fixed", "new_text": self.new or "no config key"}
        return WORDS[self.what].format(**short)


# what each kind of Difference says, after "the installed transformers X"
WORDS = {"renamed": "renamed {old} → {new}", "gone": "has no class {old}",
         "several": "builds {new} at {pattern} (not {old})",
         "eps": "reads {pattern}'s eps from {new_text} (was {old_text})",
         "form": "computes {pattern} as {new_text} (was {old_text})",
         "new": "builds a norm the family lacks ({pattern}, {new})", "unmatched": "builds nothing at {pattern}"}


def said(found: list[Difference]) -> str:
    """The differences in a few words: one phrase for the patterns that moved the same way."""
    groups: dict = {}
    for d in found:
        groups.setdefault((d.what, d.old, d.new), []).append(d)
    out = []
    for same in groups.values():
        more = f" (and {len(same) - 1} more pattern{'s' if len(same) > 2 else ''})" if len(same) > 1 else ""
        out.append(same[0].words() + more)
    return "; ".join(dict.fromkeys(out))


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _resolved(path: str | None) -> type | None:
    """The class a dotted path names, or None where it does not import (a class a release renamed)."""
    import importlib

    module, _, attr = (path or "").rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except Exception:
        return None
    return found if isinstance(found, type) else None


def _importable(path: str | None) -> bool:
    return not path or _resolved(path) is not None


def _class_path(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _meta_model(model_type: str, config: dict | None, where: str, shrunk: bool):
    """(the model the installed transformers builds from `config` on the meta device, the eps markers,
    the config it was built from): shrunk and eps-marked as a derivation builds it, or as the checkpoint
    says (which layer has which module is the config's). One build a process for a config: validation,
    the class binding and weightless discovery ask for the same tree."""
    key = (model_type, json.dumps(config, sort_keys=True, default=str), shrunk)
    if key not in _TREES:
        import torch

        from parity_cli.model import derive as d

        transformers, config_class = d._transformers(model_type, where)
        if config is not None:
            d.bounded_config(config, where)
        cfg = config_class.from_dict(d.tagged_floats(dict(config))) if config is not None else config_class()
        markers = d._mark_eps(cfg) if shrunk else {}
        if shrunk:
            d._shrink(cfg)
        cls = d._model_class(transformers, cfg, (config or {}).get("architectures"))
        if cls is None:
            raise InputError(f"{where}: transformers {transformers.__version__} has no model class for "
                             f"'{model_type}'")
        with torch.device("meta"):
            _TREES[key] = (cls._from_config(cfg), markers, cfg)
    return _TREES[key]


_TREES: dict = {}


def meta_tree(model_type: str, config: dict | None, where: str):
    """(norm modules [(name, module)], eps markers {value: dotted key}, the shrunk config they were
    built from) of the model the installed transformers builds from `config`, on the meta device: no
    memory, no weights."""
    from parity_cli.model.derive import _is_norm

    model, markers, cfg = _meta_model(model_type, config, where, shrunk=True)
    return [(name, module) for name, module in model.named_modules() if name and _is_norm(module)], markers, cfg


def built_modules(model_type: str, config: dict | None, where: str) -> set[str] | None:
    """The module names of the model the installed transformers builds from the checkpoint's own
    config, unshrunk (which layer has which module is the config's: Llama 4's no-RoPE layers have
    no q/k norm), on the meta device; None where it cannot be built (no transformers, a config it
    refuses): then nothing is judged by it."""
    try:
        model, _, _ = _meta_model(model_type, config, where, shrunk=False)
    except Exception:  # a release or config this cannot build: the checkpoint's names stand
        return None
    return {name for name, _ in model.named_modules()}


def forward_order(model_type: str, config: dict | None, names: list[str], where: str) -> dict[str, int] | None:
    """{layer name: the place its module's first call takes in the model's forward}, the model built
    from the checkpoint's own config on the meta device and run on 4 meta tokens (no memory, no
    weights; 0.1 s for a tiny model): the order a copy's graph runs its norms in. A checkpoint
    name is its module's, or the only module name one of them ends (a checkpoint saved from the base
    model); a name with no module called has no place. None where the model cannot be run so (no
    transformers, a model that needs more than token ids): then only layer indices order a copy."""
    import torch

    from parity_cli.model.derive import _is_norm

    try:
        model, _, _ = _meta_model(model_type, config, where, shrunk=False)
    except Exception:
        return None
    order: dict[str, int] = {}

    def called(name):
        def hook(*_):  # returns None: a hook's value would replace the module's output
            order.setdefault(name, len(order))
        return hook

    hooks = [module.register_forward_hook(called(name)) for name, module in model.named_modules()
             if name and _is_norm(module)]
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            try:
                model(input_ids=ids)
            except Exception:
                order.clear()
                model(input_ids=ids, decoder_input_ids=ids)  # an encoder-decoder
    except Exception:  # a model that needs pixels, audio or more than ids: its order is not known here
        return None
    finally:
        for hook in hooks:
            hook.remove()
    out = {}
    for name in names:
        if name in order:
            out[name] = order[name]
            continue
        near = [m for m in order if m.endswith("." + name) or name.endswith("." + m)]
        if len(near) == 1:
            out[name] = order[near[0]]
    return out or None


def _eps_key(module, markers: dict) -> str | None:
    import math

    from parity_cli.model.derive import _eps_of

    eps = _eps_of(module)
    return next((key for marker, key in markers.items() if eps is not None
                 and math.isclose(marker, eps, rel_tol=1e-9)), None)


def _form(module, semantics, cfg=None) -> tuple[str, str] | None:
    """(the family's form, the installed class's form) where classify says they differ (a form parity
    cannot express any more included); None where they agree or the class cannot be run apart from
    its model (a weightless norm's size, a frozen BatchNorm's eps are the model's: left to the names
    and eps checks). A grouped norm's count is
    compared with the family's, read from the config it was built with (Mamba2's gated norm is one
    group over the whole width in transformers 4.53.3 and 5.12.1 whatever n_groups says; per group in 5.24.0)."""
    import copy

    import torch

    from parity_cli.model.derive import _eps_of, classify, is_batch_norm

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or is_batch_norm(module) or weight.dim() != 1:
        return None
    eps = _eps_of(module)
    real = copy.deepcopy(module).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(weight.numel())
    with torch.no_grad():
        for name, p in real.named_parameters(recurse=False):
            p.copy_(torch.rand(p.shape, generator=gen) + (0.5 if name == "weight" else -0.5))
    sem = classify(real, eps if eps is not None else 1e-5)
    if "kind" not in sem:  # it computed the family's form once; now nothing parity can express
        return f"kind {semantics.kind}", f"unsupported ({sem.get('unsupported', '?')})"
    keys = ("kind", "gain_offset", "order", "inverse_sqrt", "gate", "activation")
    want = {"kind": semantics.kind, "gain_offset": semantics.gain_offset, "order": semantics.order,
            "inverse_sqrt": semantics.inverse_sqrt, "gate": semantics.gate, "activation": semantics.activation}
    got = {k: sem.get(k, want[k] if k in ("gate", "activation") and sem.get("kind") != "gated_rms_norm" else None)
           for k in keys}
    if not sem.get("order_exact", True):  # no order matched bit for bit: the form alone is compared
        got["order"], got["inverse_sqrt"] = want["order"], want["inverse_sqrt"]
    diff = [k for k in keys if got[k] != want[k]]
    if sem.get("kind") in ("gated_rms_norm", "group_norm") and semantics.groups is not None:
        named = _group_count(semantics.groups, cfg, weight.numel())
        if named is not None and named != _group_count(sem.get("groups"), None, weight.numel()):
            diff.append("groups")
            want["groups"], got["groups"] = semantics.groups, sem.get("groups")
    if not diff:
        return None
    return ", ".join(f"{k} {want[k]}" for k in diff), ", ".join(f"{k} {got[k]}" for k in diff)


def _group_count(groups, cfg, channels: int) -> int | None:
    """A group count as an integer: itself, `channels`, or a (dotted) config key read from `cfg`."""
    if groups == "channels":
        return channels
    if type(groups) is int:
        return groups
    if isinstance(groups, str) and cfg is not None:
        node = cfg
        for part in groups.split("."):
            node = getattr(node, part, None)
        return node if type(node) is int else None
    return None


def _eps_moved(sem, modules, markers) -> tuple[str, str] | None:
    """(the family's eps, the modules') where they part: a fixed eps the modules no longer hold, or a
    config key they no longer read (each eps-like key holds a distinct marker in the tree's config, so
    a module's eps names its key, or none: fixed by the code). A module without an eps attribute
    (measured from its output) is left to the derivation."""
    import math

    from parity_cli.model.derive import _eps_of

    family = f"fixed {sem.eps:g}" if sem.eps is not None else ", ".join(sem.eps_keys) or "no key"
    for module in modules:
        eps = _eps_of(module)
        if eps is None:
            continue
        key = _eps_key(module, markers)
        if sem.eps is not None:
            if key is not None or not math.isclose(eps, sem.eps, rel_tol=1e-9):
                return family, key or f"fixed {eps:g}"
        elif key not in sem.eps_keys:
            return family, key or f"fixed {eps:g}"
    return None


def differences(family: Family, model_type: str, norms, markers, cfg=None, check_new: bool = True) -> list[Difference]:
    """Each way `family` no longer describes the modules the installed transformers builds."""
    out: list[Difference] = []
    claimed: set[str] = set()
    formed: set[str] = set()
    for pattern in family.norms:
        named = family.hf_class_for(pattern, model_type)
        found = [(n, m) for n, m in norms if pattern.regex.fullmatch(n)]
        claimed.update(n for n, _ in found)
        if not found:
            out.append(Difference(pattern.name, "gone" if not _importable(named) else "unmatched", named or ""))
            continue
        built = {type(m) for _, m in found}
        if named and _resolved(named) not in built:
            out.append(Difference(pattern.name, "renamed" if len(built) == 1 else "several", named,
                                  ", ".join(sorted(f"{c.__module__}.{c.__qualname__}" for c in built))))
        sem = pattern.semantics
        moved = _eps_moved(sem, [m for _, m in found], markers)
        if moved:
            out.append(Difference(pattern.name, "eps", *moved))
        cls = _class_path(found[0][1])
        if cls + pattern.name not in formed and not pattern.weightless:
            formed.add(cls + pattern.name)
            moved = _form(found[0][1], sem, cfg)
            if moved:
                out.append(Difference(pattern.name, "form", *moved))
    if check_new:
        known = [regex for _, regex, _ in family.unsupported]
        for name, module in norms:
            if name not in claimed and not any(r.fullmatch(name) for r in known):
                out.append(Difference(name, "new", "", _class_path(module)))
                break  # one is enough to re-derive
    return out


def _moved(old: Family, new: Family, model_type: str) -> list[str]:
    """What differs between the committed family and the one derived now, pattern by pattern."""
    before = {p.name: p for p in old.norms}
    after = {p.name: p for p in new.norms}
    said = []
    for name in sorted(set(before) & set(after)):
        a, b = before[name].semantics, after[name].semantics
        ca, cb = old.hf_class_for(before[name], model_type), new.hf_class_for(after[name], model_type)
        if ca != cb:
            said.append(f"renamed {_short(ca or '?')} → {_short(cb or '?')}")
        for key in (f.name for f in dataclasses.fields(a)):
            if key not in ("hf_class", "eps_source") and getattr(a, key) != getattr(b, key):
                said.append(f"{name}: {key} {getattr(a, key)} → {getattr(b, key)}")
        for key in ("weightless", "dim"):
            if getattr(before[name], key) != getattr(after[name], key):
                said.append(f"{name}: {key} {getattr(before[name], key)} → {getattr(after[name], key)}")
    if set(after) - set(before):
        said.append(f"{len(set(after) - set(before))} norm pattern(s) added")
    if set(before) - set(after):
        said.append(f"{len(set(before) - set(after))} norm pattern(s) gone")
    return list(dict.fromkeys(said))


def _with_provenance(family: Family, line: str) -> Family:
    return dataclasses.replace(family, provenance=line)


def current(family: Family, model_type: str, config: dict | None, where: str, classes: bool = False) -> Family:
    """`family` as the installed transformers has it: the committed one where it was generated with
    the installed release or still describes it, else derived again; its provenance says which.
    `classes`: the run needs the family's module classes (--candidate transformers), so a class the
    release no longer has, and that a derivation cannot replace, refuses the run."""
    if not family.derived_from:
        return family
    stamped, installed = stamped_version(family), installed_version()
    if installed is None:
        return _with_provenance(family, f"{family.derived_from}; transformers is not installed: not validated")
    if stamped == installed and not other_class(family, config):
        return family
    key = (family.source, model_type, json.dumps(config, sort_keys=True, default=str), installed, where, classes)
    if key not in _CURRENT:  # one validation a process for a model and release
        _CURRENT[key] = _current(family, model_type, config, where, installed, classes)
    return _CURRENT[key]


_CURRENT: dict = {}


def other_class(family: Family, config: dict | None) -> str | None:
    """The class the checkpoint was saved from (config.json's architectures) where the family was derived
    from another of its type (DistilBertForMaskedLM against DistilBertModel): its head may hold norms
    the family's class lacks (the masked-LM head's vocab_layer_norm), so the family is validated
    against the class the checkpoint names, as under another release."""
    derived = (family.derived_from or "").partition(": ")[2]
    names = (config or {}).get("architectures") if isinstance(config, dict) else None
    if not derived or not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return None
    return None if derived in names else names[0]


def derived_family(model_type: str, config: dict, where: str) -> Family:
    from parity_cli.model.derive import derive, family_data_for_parse
    from parity_cli.model.families import parse_family

    data = derive(model_type, config, where)
    if not data["norms"]:
        kinds = "; ".join(sorted({u["why"] for u in data["unsupported"]})) or "no norm module"
        raise InputError(f"{where}: {data['derived_from']} has no norm parity can check yet ({kinds}); force a "
                         "family with --family")
    return parse_family(family_data_for_parse(data), f"{where} ({data['derived_from']})")


def _line(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"


def _first(configs, fn):
    """fn(config) on the checkpoint's config, else on the config class's defaults (what the committed
    family was derived from), where transformers cannot read or build the checkpoint's: (result, the
    config used, why the first failed)."""
    why = None
    for config in configs:
        try:
            return fn(config), config, why
        except Exception as exc:  # a config this release rejects, a class that does not build on meta
            why = why or _line(exc)
    return None, None, why


def _current(family: Family, model_type: str, config: dict | None, where: str, installed: str,
             classes: bool) -> Family:
    configs = [config, None] if config is not None else [None]
    tree, used, why = _first(configs, lambda c: meta_tree(model_type, c, where))
    found = differences(family, model_type, *tree) if tree is not None else None
    defaults = (f"; {where} is not a config transformers {installed} builds ({why}), its class defaults used"
                if tree is not None and used is None and config is not None else "")
    if found == []:
        return _with_provenance(family, f"{family.derived_from}, validated against the installed transformers "
                                        f"{installed}{defaults}")
    fresh, used, failed = _first(configs, lambda c: derived_family(model_type, c, where))
    if fresh is None:
        return _undecided(family, model_type, found or [], installed, where, why or failed, classes)
    if used is None and config is not None and not defaults:
        defaults = f"; {where} is not a config transformers {installed} builds ({failed}), its class defaults used"
    moved = _moved(family, fresh, model_type)
    if not moved:  # the tree's names are not the stored ones (a checkpoint layout), or it did not build on meta:
        # derived for real, the family is the committed one in everything a check uses
        return _with_provenance(family, f"{family.derived_from}, validated against the installed transformers "
                                        f"{installed} (derived again: the same){defaults}")
    why_now = f"transformers {installed}" if stamp_of(family) != installed else \
        f"{other_class(family, config)} (the class config.json names)"
    # what changes a number: a semantics key of a pattern both have (a class's name, a pattern added or gone
    # and a size do not), the pattern as a reader sees it ({root}layers.{i}.x: layers.*.x)
    semantic = tuple(re.sub(r"\{\w+\}", "*", m.replace("{root}", "")) for m in moved
                     if re.match(r"\S+: (?!weightless |dim )\w+ ", m))
    return dataclasses.replace(fresh, name=family.name, source=family.source, moved=semantic, provenance=(
        f"derived at run time: {why_now} " + "; ".join(moved[:4])
        + (f" (+{len(moved) - 4} more)" if len(moved) > 4 else "") + f" (committed: {family.derived_from}){defaults}"))


def _undecided(family: Family, model_type: str, found: list, installed: str, where: str, why: str,
               classes: bool) -> Family:
    """The family could not be derived again. Where the installed classes were seen to compute
    something else (an eps, a form), the committed semantics would judge the candidate by a model
    the release no longer builds: refused, saying what moved. A class gone or renamed refuses only a
    run that needs the classes; otherwise (names, or nothing seen) the committed family serves, said
    unvalidated with what was seen."""
    semantic = [d for d in found if d.what in ("eps", "form")]
    names = [d for d in found if d.what in ("gone", "renamed", "several")]
    if not names and classes and not all(_importable(family.hf_class_for(p, model_type)) for p in family.norms):
        names = [Difference("", "gone", next(family.hf_class_for(p, model_type) for p in family.norms
                                             if not _importable(family.hf_class_for(p, model_type))))]
    refuse = semantic + (names if classes else [])
    seen = said(refuse or found)
    if refuse:
        raise InputError(f"{where}: family {family.name} was derived with transformers {stamp_of(family)}; the "
                         f"installed transformers {installed} {seen}, and it cannot be derived again: {why}")
    return _with_provenance(family, f"{family.derived_from}; not validated against the installed transformers "
                                    f"{installed}" + (f" ({seen})" if seen else "") + f": {why}")


def stamp_of(family: Family) -> str:
    return stamped_version(family) or "another release"


def bind_classes(family: Family, model_type: str, config: dict | None, where: str) -> Family:
    """`family` with every norm's module class the one the installed transformers builds at its
    pattern (--candidate transformers): a hand-written family names classes too. A class that no
    longer exists is replaced by the built module's, and said; where the tree cannot be built the
    names stand (the candidate then says which class is missing)."""
    tree, _, _ = _first([config, None] if config is not None else [None], lambda c: meta_tree(model_type, c, where))
    if tree is None:
        return family
    norms = tree[0]
    patterns, renamed = [], []
    for pattern in family.norms:
        named = family.hf_class_for(pattern, model_type)
        built = {type(m) for n, m in norms if pattern.regex.fullmatch(n)}
        cls = named
        if len(built) == 1 and _resolved(named) not in built:
            (one,) = built
            cls = f"{one.__module__}.{one.__qualname__}"
            renamed.append(f"renamed {_short(named or '?')} → {_short(cls)}")
        patterns.append(dataclasses.replace(pattern, semantics=dataclasses.replace(pattern.semantics, hf_class=cls)))
    if not renamed:
        return family
    installed = installed_version()
    line = f"transformers {installed} " + "; ".join(dict.fromkeys(renamed))
    return dataclasses.replace(family, norms=tuple(patterns), hf_classes={},
                               semantics=dataclasses.replace(family.semantics, hf_class=None),
                               provenance=f"{family.source_line}; {line}")
