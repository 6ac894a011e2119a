"""A checkpoint as a model: whichever file it is, its family and its resolved eps. The one
place a source is chosen, so that no reader imports another or the families above it."""

from __future__ import annotations

import math
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.model.families import Family, family_by_name, family_for_model_type
from parity_cli.sources.huggingface import Checkpoint, open_directory
from parity_cli.sources.tensors import Eps


def open_checkpoint(path: str | Path, model=None) -> Checkpoint:
    """`model` (family, model_type): what an mmproj GGUF is read as (sources.gguf). A URL
    (hf://, s3://, ...) is read where it lives, by range (sources.remote)."""
    from parity_cli.sources.remote import cached_copy, is_url

    if is_url(path):
        return _open_remote(str(path), model)
    if cached_copy(path):
        raise InputError(f"{path}: a sparse copy in parity's cache, whose unfetched bytes read as zeros; check the "
                         "URL it was read from (hf://..., s3://...), which fills what it needs")
    return _open_local(Path(path), model)


def _open_local(path: Path, model) -> Checkpoint:
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_file():
        from parity_cli.model.families import find_family, written_families
        from parity_cli.sources.gguf import is_gguf, open_gguf

        if is_gguf(path):
            return open_gguf(path, written_families(), derived=lambda arch: find_family(arch, by_name=False),
                             model=model)
        if path.suffix in (".bin", ".pt", ".pth", ".ckpt"):
            raise InputError(f"{path}: a pickle file; it is never unpickled, convert the checkpoint to safetensors")
        raise InputError(f"{path}: not a checkpoint (expected a Hugging Face model directory or a .gguf file)")
    from parity_cli.sources.ctranslate2 import is_ctranslate2, open_ctranslate2

    if is_ctranslate2(path):  # its model.bin is CTranslate2's own format, not a pickle
        return open_ctranslate2(path, model)
    return open_directory(path)


def _open_remote(url: str, model) -> Checkpoint:
    """The sparse copy opened as a local one, then every norm tensor's bytes fetched at once."""
    from parity_cli.sources import remote

    local, mirror = remote.materialise(url)
    ckpt = _open_local(local, model)
    mirror.prefetch(remote.norm_ranges(ckpt))
    mirror.progress(final=True)
    ckpt.remote = mirror
    return ckpt


def load(path: str | Path, family: str | None = None, eps: float | None = None, model=None, classes: bool = False,
         resolved: Family | None = None):
    """Checkpoint, its family and its resolved eps (the part `inspect` and `check` share); `model`
    (family, model_type) is the model an mmproj holds the towers of (--candidate-checkpoint's).
    `classes` (--candidate transformers, or that reference): each norm's module class is the one the
    installed transformers builds at its pattern, not the name the family file holds. `resolved`: the
    family the parent process settled on (a --jobs worker), used as it is, never validated again."""
    forced = family_by_name(family) if family else None
    if forced is not None and model is None:
        model = (forced, family if family in forced.model_types else forced.model_types[0])
    ckpt = open_checkpoint(path, model)
    where = str(ckpt.path) if ckpt.format == "gguf" else str(ckpt.path / "config.json")
    if resolved is not None:
        return ckpt, resolved, resolve_eps(ckpt, resolved, eps)
    fam = forced or _family(ckpt, where)
    if fam.derived_from and isinstance(ckpt.model_type, str) and ckpt.model_type in fam.model_types:
        from parity_cli.model.installed import current

        # a committed derived family is a cache of one transformers release: under another, the installed
        # classes decide (validated, or derived again), never the file alone
        fam = current(fam, ckpt.model_type, ckpt.config if ckpt.format != "gguf" else None, where, classes)
    if classes and isinstance(ckpt.model_type, str) and ckpt.model_type:
        from parity_cli.model.installed import bind_classes

        fam = bind_classes(fam, ckpt.model_type, ckpt.config if ckpt.format != "gguf" else None, where)
    return ckpt, fam, resolve_eps(ckpt, fam, eps)


def forced_contradiction(ckpt: Checkpoint, forced: Family, eps, family: str) -> str | None:
    """Where --family forced a family whose semantics the checkpoint's own model type contradicts (the
    norm's kind, the gain offset, the eps its config gives), what differs, in words; None where they
    agree, or the model type claims no family to compare with. The oracle and the candidate both take
    the forced semantics, so a PASS under them says nothing about this model unless the user meant it."""
    from parity_cli.model.families import find_family

    if not isinstance(ckpt.model_type, str) or not ckpt.model_type:
        return None
    own = find_family(ckpt.model_type, by_name=False)
    if own is None or own.source == forced.source:
        return None
    differ = []
    if own.kind != forced.kind:
        differ.append(f"{forced.name} normalises as a {forced.kind}, {own.name} as a {own.kind}")
    if own.gain_offset != forced.gain_offset:
        differ.append(f"{forced.name}'s gain is {forced.gain_offset:g} + w, {own.name}'s {own.gain_offset:g} + w")
    if eps.source != "override":
        try:
            theirs = resolve_eps(ckpt, own, None)
        except InputError:
            theirs = None
        if theirs is not None and theirs.value != eps.value:
            differ.append(f"{forced.name} reads eps {eps.value:g} ({eps.source}), {own.name} {theirs.value:g} "
                          f"({theirs.source})")
    if not differ:
        return None
    where = "the GGUF metadata" if ckpt.format == "gguf" else "config.json"
    return (f"--family {family} contradicts model_type '{ckpt.model_type}' in {where} (family {own.name}): "
            + "; ".join(differ))


def _family(ckpt: Checkpoint, where: str) -> Family:
    """The family file that claims the model_type; without one, the family derived from the
    model's own transformers classes (model.derive), when transformers is installed."""
    from parity_cli.model.families import find_family

    claimed = find_family(ckpt.model_type, by_name=False)
    if claimed is not None:
        return claimed
    if ckpt.format == "gguf" or not isinstance(ckpt.model_type, str) or not ckpt.model_type:
        return family_for_model_type(ckpt.model_type, where)  # the one line naming what is known
    from parity_cli.model.installed import derived_family

    return derived_family(ckpt.model_type, ckpt.config, where)


def resolve_eps(ckpt: Checkpoint, family: Family, override: float | None = None, semantics=None) -> Eps:
    """The checkpoint's own eps wins over the family default; a defaulted eps is a warning.

    `semantics` is a norm pattern's: an eps fixed by the model code (DeepSeek-V3's MLA norms)
    is reported as its own source and is not affected by the config or an override."""
    sem = semantics or family.semantics
    own = getattr(ckpt, "runtime_eps", None)  # a runtime's copy: what it computes every norm with
    if own is not None and override is None:
        return own
    if sem.eps is not None:
        return Eps(float(sem.eps), sem.eps_source or "model-code")
    if override is not None:
        if not (math.isfinite(override) and override >= 0):
            raise InputError(f"--eps must be a finite number >= 0, got {override}")
        return Eps(float(override), "override")
    for key in sem.eps_keys:
        value, where = ckpt.config_value(key)
        if value is None:
            continue
        try:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:
            number = math.inf
        if not math.isfinite(number) or number <= 0:
            # eps = 0 is the bug this tool exists to catch, never a trained model's setting
            config = ckpt.path if ckpt.format == "gguf" else ckpt.path / "config.json"
            raise InputError(f"{config}: '{where}' must be a finite number > 0, got {value!r}")
        return Eps(number, where if where.startswith("gguf:") else f"config:{where}")
    inherited = sem.eps_keys == family.eps_keys and sem.eps_default == family.eps_default
    return Eps(family.eps_default_for(ckpt.model_type) if inherited else sem.eps_default, "family-default")
