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

MAX_STRING = 65536  # characters in any string of a report; names have a maxLength of their own
# what a keyword of the shipped schema means here; anything else is refused (tests/test_saved_reports)
CHECKED = {"type", "required", "properties", "additionalProperties", "items", "enum", "const", "$ref",
           "anyOf", "oneOf", "minimum", "maximum", "exclusiveMinimum", "maxLength", "maxItems"}
ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description"}
_TYPES = {"object": "an object", "array": "an array", "string": "a string", "number": "a number",
          "integer": "an integer", "boolean": "a boolean", "null": "null"}


class Invalid(Exception):
    """Where (a field path such as layers[3].diagnoses) and what is wrong."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where or 'the top level'}: {what}")
        self.where, self.what = where, what


@cache
def schema() -> dict:
    import json

    from parity_cli.resources import schema_path

    return json.loads(schema_path().read_text())


def load(path: str | Path, what: str = "report") -> dict:
    """The report at `path`, read as untrusted JSON and checked against the schema; InputError
    ("<path>: <field>: <what is wrong>") otherwise."""
    from parity_cli.jsonfile import load as load_json

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
    """Raises Invalid for the first field of `data` that breaks `spec` (default: the report schema)."""
    root = schema() if spec is None else spec
    _check(data, root, root, "")


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _is(value, kind: str, t: str) -> bool:
    return kind == t or (t == "number" and kind == "integer")


def _said(value, kind: str) -> str:
    if kind in ("string", "number", "integer", "boolean"):
        text = repr(value)
        return f"{_TYPES[kind]} ({text[:40]}{'...' if len(text) > 40 else ''})"
    return _TYPES.get(kind, kind)


def _resolve(root: dict, ref: str) -> dict:
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix):] not in root.get("$defs", {}):
        raise ValueError(f"schema: unsupported $ref {ref}")
    return root["$defs"][ref[len(prefix):]]


def _check(value, spec: dict, root: dict, where: str) -> None:
    unknown = set(spec) - CHECKED - ANNOTATIONS
    if unknown:  # a schema change this reader does not follow: a bug of ours, said as one
        raise ValueError(f"schema keyword(s) {', '.join(sorted(unknown))} at {where or 'the top'} are not checked")
    if "$ref" in spec:
        _check(value, _resolve(root, spec["$ref"]), root, where)
    kind = _kind(value)
    if kind == "number" and not math.isfinite(value):
        raise Invalid(where, f"{value} is not a JSON number (the report writes \"inf\", \"nan\" as strings)")
    if kind == "string":
        bound = spec.get("maxLength", MAX_STRING)
        if len(value) > bound:
            raise Invalid(where, f"a string of {len(value)} characters, over the {bound} allowed; refused")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise Invalid(where, "a string that is not valid Unicode (a lone surrogate)") from None
    if "type" in spec:
        types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        if not any(_is(value, kind, t) for t in types):
            want = " or ".join(_TYPES[t] for t in types)
            raise Invalid(where, f"expected {want}, got {_said(value, kind)}")
    if "const" in spec and not _same(value, spec["const"]):
        raise Invalid(where, f"expected {spec['const']!r}, got {_said(value, kind)}")
    if "enum" in spec and not any(_same(value, e) for e in spec["enum"]):
        listed = ", ".join("null" if e is None else str(e) for e in spec["enum"])
        raise Invalid(where, f"expected one of {listed}, got {_said(value, kind)}")
    if kind in ("integer", "number"):
        if "minimum" in spec and not value >= spec["minimum"]:
            raise Invalid(where, f"{value} is below the minimum {spec['minimum']}")
        if "maximum" in spec and not value <= spec["maximum"]:
            raise Invalid(where, f"{value} is above the maximum {spec['maximum']}")
        if "exclusiveMinimum" in spec and not value > spec["exclusiveMinimum"]:
            raise Invalid(where, f"{value} is not above {spec['exclusiveMinimum']}")
    for key in ("anyOf", "oneOf"):
        if key in spec:
            _one_of(value, spec[key], root, where, key == "oneOf")
    if kind == "object":
        for key in spec.get("required", ()):
            if key not in value:
                raise Invalid(where, f"missing '{key}'")
        props = spec.get("properties", {})
        extra = spec.get("additionalProperties")
        for key, item in value.items():
            if len(key) > MAX_STRING:
                raise Invalid(where, f"a key of {len(key)} characters, over the {MAX_STRING} allowed; refused")
            if key in props:
                _check(item, props[key], root, _join(where, key))
            elif isinstance(extra, dict):
                _check(item, extra, root, _join(where, key))
    elif kind == "array":
        if "maxItems" in spec and len(value) > spec["maxItems"]:
            raise Invalid(where, f"{len(value)} items, over the {spec['maxItems']} allowed")
        if "items" in spec:
            for i, item in enumerate(value):
                _check(item, spec["items"], root, f"{where}[{i}]")


def _one_of(value, options: list, root: dict, where: str, exactly_one: bool) -> None:
    failures, matched = [], 0
    for option in options:
        try:
            _check(value, option, root, where)
            matched += 1
        except Invalid as exc:
            failures.append(exc)
    if matched == 0:
        # the option that got furthest into the value says the most (a nested field, not the type)
        best = max(failures, key=lambda e: len(e.where))
        if best.where != where:
            raise best
        raise Invalid(where, "; or ".join(dict.fromkeys(e.what for e in failures)))
    if exactly_one and matched > 1:
        raise Invalid(where, "matches more than one of the schema's alternatives")


def _same(a, b) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    if type(a) in (int, float) and type(b) in (int, float):
        return a == b
    return type(a) is type(b) and a == b


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
