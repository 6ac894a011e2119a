"""Model families as data: what each family's norm layers compute and where their tensors are.

One TOML file per family in configs/families/; adding a family is adding a file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from parity_cli.errors import InputError
from parity_cli.resources import configs_dir, load_toml

KINDS = ("rms_norm", "layer_norm")
# Numerics orders the `hf` implementation knows how to reproduce (see implementations.py).
ORDERS = ("llama", "gemma")


@dataclass(frozen=True)
class NormPattern:
    """One kind of norm tensor in a family: `{root}` and `{i}` (layer index) are placeholders."""

    name: str
    dim: str  # config key of the size the norm runs over (a consistency check)
    regex: re.Pattern


@dataclass(frozen=True)
class Family:
    name: str
    description: str
    model_types: tuple[str, ...]
    kind: str
    order: str
    gain_offset: float  # effective gain = gain_offset + stored weight
    eps_keys: tuple[str, ...]
    eps_default: float
    roots: tuple[str, ...]
    norms: tuple[NormPattern, ...]
    source: str  # the file it came from

    def match(self, layer_name: str) -> NormPattern | None:
        for pattern in self.norms:
            if pattern.regex.fullmatch(layer_name):
                return pattern
        return None


def _compile(template: str, roots: tuple[str, ...]) -> re.Pattern:
    root_alt = "|".join(re.escape(r) for r in roots) or ""
    parts = re.split(r"(\{root\}|\{i\})", template)
    out = []
    for part in parts:
        if part == "{root}":
            out.append(f"(?:{root_alt})")
        elif part == "{i}":
            out.append(r"\d+")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out))


def _parse(path) -> Family:
    data = load_toml(path)

    def need(key, typ):
        if key not in data:
            raise InputError(f"{path}: missing key '{key}'")
        value = data[key]
        if not isinstance(value, typ):
            raise InputError(f"{path}: key '{key}' has the wrong type")
        return value

    kind = need("kind", str)
    if kind not in KINDS:
        raise InputError(f"{path}: kind '{kind}' is not one of {', '.join(KINDS)}")
    order = need("order", str)
    if order not in ORDERS:
        raise InputError(f"{path}: order '{order}' is not one of {', '.join(ORDERS)}")
    roots = tuple(data.get("roots", [""]))
    norms = tuple(
        NormPattern(name=n["name"], dim=n.get("dim", "hidden_size"), regex=_compile(n["name"], roots))
        for n in need("norms", list)
    )
    return Family(
        name=need("name", str),
        description=data.get("description", ""),
        model_types=tuple(need("model_types", list)),
        kind=kind,
        order=order,
        gain_offset=float(data.get("gain_offset", 0.0)),
        eps_keys=tuple(need("eps_keys", list)),
        eps_default=float(need("eps_default", (int, float))),
        roots=roots,
        norms=norms,
        source=str(path),
    )


@lru_cache(maxsize=None)
def load_families() -> dict[str, Family]:
    families = {}
    for path in sorted((configs_dir() / "families").glob("*.toml")):
        family = _parse(path)
        families[family.name] = family
    return families


def family_by_name(name: str) -> Family:
    families = load_families()
    if name not in families:
        raise InputError(f"unknown family '{name}'; known families: {', '.join(sorted(families))}")
    return families[name]


def family_for_model_type(model_type: str | None, where: str) -> Family:
    families = load_families()
    for family in families.values():
        if model_type in family.model_types:
            return family
    known = ", ".join(f"{f.name} ({', '.join(f.model_types)})" for f in families.values())
    raise InputError(
        f"{where}: model_type '{model_type}' is not a known family; known: {known}; "
        "use --family to force one"
    )
