"""A saved report is data from anywhere (a CI artifact, a baseline, a file someone sent): before
any field of it is used (parity report, parity explain, --baseline), it is checked against the
report's own JSON Schema, so that a wrong type ends here, in one line naming the file and the
field, and never as an internal error in a renderer or a replay.

jsonschema is not a runtime dependency: this checks the subset of JSON Schema the shipped schema
uses and refuses a schema keyword it does not know (the tests keep both in step and compare the
two verdicts). Beyond the schema, every string is bounded (a 10 MB layer name took 5 GiB to
render, 300 KB hit a RecursionError), every number is finite (the report writes non-finite
values as "inf"/"nan" strings) and every string is valid Unicode (a lone surrogate cannot be
printed)."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.jsonfile import JSON_KINDS as _KINDS
from parity_cli.sources.jsonfile import KIND_WORDS as _TYPES
from parity_cli.sources.jsonfile import json_kind as _kind

MAX_STRING = 65536  # characters in any string of a report; names have a maxLength of their own
# what a keyword of the shipped schema means here; anything else is refused (tests/test_saved_reports)
CHECKED = {"type", "required", "properties", "additionalProperties", "items", "enum", "const", "$ref",
           "anyOf", "oneOf", "minimum", "maximum", "exclusiveMinimum", "maxLength", "minItems", "maxItems"}
ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description"}


class Invalid(Exception):
    """What is wrong, and where: the field path (layers[3].diagnoses), gathered on the way out."""

    def __init__(self, what, parts: list | None = None):
        super().__init__()
        self._what, self.parts = what, parts if parts is not None else []  # innermost first

    @property
    def what(self) -> str:
        """Said only when it is shown: a oneOf's failing alternative is usually never shown."""
        if callable(self._what):
            self._what = self._what()
        return self._what

    @property
    def where(self) -> str:
        out = ""
        for part in reversed(self.parts):
            out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
        return out

    def __str__(self) -> str:
        return f"{self.where or 'the top level'}: {self.what}"


@cache
def schema() -> dict:
    import json

    from parity_cli.resources import schema_path

    return json.loads(schema_path().read_text())


def load(path: str | Path, what: str = "report") -> dict:
    """The report at `path`, read as untrusted JSON and checked against the schema; InputError
    ("<path>: <field>: <what is wrong>") otherwise."""
    from parity_cli.sources.jsonfile import load as load_json

    data = load_json(path, "the " + what, "report")
    if not isinstance(data, dict) or data.get("schema_version") != 1 or not isinstance(data.get("layers"), list):
        raise InputError(f"{path}: not a parity-cli report (schema_version 1 with layers)")
    check(data, path)
    return data


def check(data, where) -> None:
    """InputError naming `where` and the first field that breaks the schema."""
    try:
        validate(data)
    except Invalid as exc:
        raise InputError(f"{where}: {exc}") from None


def validate(data, spec: dict | None = None) -> None:
    """Raises Invalid for the first field of `data` that breaks `spec` (default: the report schema).
    What the schema does not describe is still walked: its strings bounded, its numbers finite."""
    if spec is None:
        _report_checker()(data)
    else:
        _compile(spec, spec, {})(data)


@cache
def _report_checker():
    root = schema()
    return _compile(root, root, {})




def _said(value, kind: str) -> str:
    if kind in ("string", "number", "integer", "boolean"):
        text = repr(value[:41] if kind == "string" else value)
        return f"{_TYPES[kind]} ({text[:40]}{'...' if len(text) > 40 else ''})"
    return _TYPES.get(kind, kind)


def _scalar(value, kind: str, bound: int = MAX_STRING) -> None:
    """The rules beyond the schema: finite numbers, bounded and valid strings."""
    if kind == "number" and not math.isfinite(value):
        raise Invalid(f"{value} is not a JSON number (the report writes \"inf\", \"nan\" as strings)")
    if kind == "string":
        if len(value) > bound:
            raise Invalid(f"a string of {len(value)} characters, over the {bound} allowed; refused")
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise Invalid("a string that is not valid Unicode (a lone surrogate)") from None


MAX_DEPTH = 64  # the nesting README states for a saved report or a baseline
LOOSE_DEPTH = MAX_DEPTH - 8  # what the schema's own parts leave to the loose ones (a diagnosis' evidence sits 4 deep)


def _loose(value) -> None:
    """A part the schema does not describe (environment, a diagnosis' evidence): only the rules
    beyond the schema, walked without recursion, to the depth the report may nest."""
    stack = [(value, ())]
    while stack:
        node, parts = stack.pop()
        if len(parts) > LOOSE_DEPTH:
            exc = Invalid(f"nests deeper than the {MAX_DEPTH} levels a report may have; refused")
            exc.parts.extend(reversed(parts[:3]))
            raise exc
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, item in items:
            kind = _KINDS.get(type(item))
            try:
                if isinstance(key, str) and len(key) > MAX_STRING:
                    raise Invalid(f"a key of {len(key)} characters, over the {MAX_STRING} allowed; refused")
                if kind == "object" or kind == "array":
                    stack.append((item, parts + (key,)))
                elif kind == "number" or kind == "string":
                    _scalar(item, kind)
            except Invalid as exc:
                exc.parts.append(key)
                exc.parts.extend(reversed(parts))
                raise


def _resolve(root: dict, ref: str) -> dict:
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix):] not in root.get("$defs", {}):
        raise ValueError(f"schema: unsupported $ref {ref}")
    return root["$defs"][ref[len(prefix):]]


def _compile(spec: dict, root: dict, memo: dict):
    """A function that raises Invalid where a value breaks `spec`; compiled once, so that reading
    a report of thousands of layers costs a walk, not a schema interpretation per field."""
    if id(spec) in memo:
        return memo[id(spec)]
    body = []
    memo[id(spec)] = lambda value: body[0](value)  # a $ref cycle resolves through this
    unknown = set(spec) - CHECKED - ANNOTATIONS
    if unknown:  # a schema change this reader does not follow: a bug of ours, said as one
        raise ValueError(f"schema keyword(s) {', '.join(sorted(unknown))} are not checked")
    ref = _compile(_resolve(root, spec["$ref"]), root, memo) if "$ref" in spec else None
    types = None
    if "type" in spec:
        types = set(spec["type"] if isinstance(spec["type"], list) else [spec["type"]])
        wanted = " or ".join(_TYPES[t] for t in sorted(types, key=list(_TYPES).index))
        if "number" in types:
            types.add("integer")
    has_const, const = "const" in spec, spec.get("const")
    enum = spec.get("enum")
    enum_set = None if enum is None else {(_json_kind(e), e) for e in enum}
    bound = spec.get("maxLength", MAX_STRING)
    low, high, above = spec.get("minimum"), spec.get("maximum"), spec.get("exclusiveMinimum")
    alts = [(key == "oneOf", [(_quick(o, root), _compile(o, root, memo)) for o in spec[key]])
            for key in ("anyOf", "oneOf") if key in spec]
    required = spec.get("required", ())
    props = {k: _compile(v, root, memo) for k, v in spec.get("properties", {}).items()}
    extra = _compile(spec["additionalProperties"], root, memo) if isinstance(spec.get("additionalProperties"), dict) else None
    items = _compile(spec["items"], root, memo) if "items" in spec else None
    min_items, max_items = spec.get("minItems"), spec.get("maxItems")

    def run(value):
        kind = _KINDS.get(type(value)) or _kind(value)
        if ref is not None:
            ref(value)
        if kind == "number" or kind == "string":
            _scalar(value, kind, bound)
        if types is not None and kind not in types:
            raise Invalid(lambda: f"expected {wanted}, got {_said(value, kind)}")
        if has_const and not _same(value, const):
            raise Invalid(lambda: f"expected {const!r}, got {_said(value, kind)}")
        if enum_set is not None and (_json_kind(kind), value if kind in _SCALARS else None) not in enum_set:
            raise Invalid(lambda: f"expected one of {', '.join('null' if e is None else str(e) for e in enum)}, "
                                  f"got {_said(value, kind)}")
        if kind == "integer" or kind == "number":
            if low is not None and not value >= low:
                raise Invalid(f"{value} is below the minimum {low}")
            if high is not None and not value <= high:
                raise Invalid(f"{value} is above the maximum {high}")
            if above is not None and not value > above:
                raise Invalid(f"{value} is not above {above}")
        for exactly_one, options in alts:
            _one_of(value, options, exactly_one)
        if kind == "object":
            for key in required:
                if key not in value:
                    raise Invalid(f"missing '{key}'")
            for key, item in value.items():
                try:
                    if len(key) > MAX_STRING:
                        raise Invalid(f"a key of {len(key)} characters, over the {MAX_STRING} allowed; refused")
                    sub = props.get(key, extra)
                    if sub is not None:
                        sub(item)
                    elif isinstance(item, (dict, list)):
                        _loose(item)
                    else:
                        _scalar(item, _KINDS.get(type(item)) or _kind(item))
                except Invalid as exc:
                    exc.parts.append(key)
                    raise
        elif kind == "array":
            if max_items is not None and len(value) > max_items:
                raise Invalid(f"{len(value)} items, over the {max_items} allowed")
            if min_items is not None and len(value) < min_items:
                raise Invalid(f"{len(value)} items, fewer than the {min_items} required")
            if items is None:
                _loose(value)
            else:
                for i, item in enumerate(value):
                    try:
                        items(item)
                    except Invalid as exc:
                        exc.parts.append(i)
                        raise

    body.append(run)
    return run


def _one_of(value, options: list, exactly_one: bool) -> None:
    failures, matched = [], 0
    kind = _KINDS.get(type(value))
    for quick, option in options:
        if quick is not None and kind is not None and quick(value, kind):  # no exception to raise
            matched += 1
            continue
        try:
            option(value)
            matched += 1
        except Invalid as exc:
            failures.append(exc)
    if matched == 0:
        # the option that got furthest into the value says the most (a nested field, not the type)
        best = max(failures, key=lambda e: len(e.parts))
        if best.parts:
            raise best
        raise Invalid(lambda: _merged([e.what for e in failures]))
    if exactly_one and matched > 1:
        raise Invalid("matches more than one of the schema's alternatives")


_SCALARS = ("null", "boolean", "integer", "number", "string")


def _json_kind(kind_or_value) -> str:
    """integer and number are one kind for equality (1 == 1.0), true is not 1."""
    kind = kind_or_value if isinstance(kind_or_value, str) and kind_or_value in _TYPES else _kind(kind_or_value)
    return "number" if kind == "integer" else kind


def _quick(spec: dict, root: dict):
    """For an alternative that is only a type or only an enum of scalars (after its $ref): a test
    without exceptions, so that the common case of a oneOf costs a lookup."""
    while set(spec) - ANNOTATIONS == {"$ref"}:
        spec = _resolve(root, spec["$ref"])
    keys = set(spec) - ANNOTATIONS
    if keys == {"type"}:
        types = set(spec["type"] if isinstance(spec["type"], list) else [spec["type"]])
        if "number" in types:
            types.add("integer")
        if "string" in types:
            return None  # a string's bound is checked by the full path
        return lambda value, kind: kind in types
    if keys == {"enum"} and all(_kind(e) in _SCALARS for e in spec["enum"]):
        allowed = {(_json_kind(e), e) for e in spec["enum"]}
        return lambda value, kind: kind in _SCALARS and (_json_kind(kind), value) in allowed
    return None


def _merged(whats: list[str]) -> str:
    """The alternatives' complaints as one: "expected null or an object, got a string ('x')"."""
    whats = list(dict.fromkeys(whats))
    got = {w.partition(", got ")[2] for w in whats}
    if len(got) == 1 and all(w.startswith("expected ") and ", got " in w for w in whats):
        wanted = " or ".join(w.removeprefix("expected ").partition(", got ")[0] for w in whats)
        return f"expected {wanted}, got {got.pop()}"
    return "; or ".join(whats)


def _same(a, b) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if type(a) in (int, float) and type(b) in (int, float):
        return a == b
    return type(a) is type(b) and a == b
