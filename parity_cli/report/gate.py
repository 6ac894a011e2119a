"""The CI decision: which failures count, given a baseline of accepted findings and --fail-on.

A finding is (layer, stratum, diagnosis code): stable across reruns with the same seed, and
specific enough that a new fault in an already-failing layer is still caught. A baseline
accepts a finding only at its size or smaller: the same code with eps moved 100x, or twice the
error, is a worse fault, not the accepted one."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.report import grouping
from parity_cli.report.grouping import fmt

FAIL_ON = ("fail", "unchecked", "warn")  # each fails on what the one before does, and more
MARGIN = 0.10  # a worst |err|/allowed up to 10 % above the baseline's is the same fault (another
# machine's libm, a torch update); beyond it the fault grew


class _Bad(Exception):
    """A field the gate reads has the wrong type: the caller names the file."""


def _list(container: dict, key: str, where: str, required: bool = False) -> list:
    """container[key] as a list: absent is empty (an older report) unless required; null is not a list."""
    if key not in container and not required:
        return []
    value = container.get(key)
    if not isinstance(value, list):
        raise _Bad(f"{where} is {'null' if value is None else type(value).__name__}, not a list")
    return value


def _dict(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{where} is {'null' if value is None else type(value).__name__}, not an object")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str):
        raise _Bad(f"{where} is {'null' if value is None else type(value).__name__}, not a string")
    return value


def _num(value, where: str) -> float | None:
    """A number as the report writes it ("inf", "nan" for non-finite ones); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _Bad(f"{where} is {type(value).__name__}, not a number")
    if isinstance(value, str):
        if value not in ("inf", "-inf", "nan"):
            raise _Bad(f"{where} is the string {value[:20]!r}, not a number")
        return float(value)
    return float(value)


def _entries(report: dict, strict: bool = False) -> dict:
    """{(layer, stratum, code): its size}, every field read checked (a baseline is a file; `strict`
    for one: each size must be one a run can write)."""
    out: dict = {}
    for i, layer in enumerate(_list(report, "layers", "layers", required=True)):
        at = f"layers[{i}]"
        _dict(layer, at)
        name = _str(layer.get("name"), f"{at}.name")
        status = _str(layer.get("status"), f"{at}.status")
        if status == "pass":
            continue
        diagnoses = [_dict(d, f"{at}.diagnoses[{j}]") for j, d in enumerate(_list(layer, "diagnoses", f"{at}.diagnoses", True))]
        codes = {}
        for j, d in enumerate(diagnoses):
            codes.setdefault(_str(d.get("code"), f"{at}.diagnoses[{j}].code"),
                             _eps_size(d, f"{at}.diagnoses[{j}]", strict))
        if not codes:
            codes = {"error" if status == "error" else "unexplained": {}}
        strata = {}
        for key in ("strata", "grad"):
            for j, s in enumerate(_list(layer, key, f"{at}.{key}", key == "strata")):
                where = f"{at}.{key}[{j}]"
                _dict(s, where)
                if _str(s.get("status"), f"{where}.status") != "pass":
                    strata[_str(s.get("name"), f"{where}.name")] = _stratum_size(s, where, strict)
        for s, size in strata.items():
            out.update(((name, s, c), {**size, **eps}) for c, eps in codes.items())
        # checkpoint-vs-checkpoint differences are findings of their own, not of a stratum
        extra = _list(layer, "findings", f"{at}.findings")
        for j, f in enumerate(extra):
            where = f"{at}.findings[{j}]"
            _dict(f, where)
            out[(name, "checkpoint", _str(f.get("code"), f"{where}.code"))] = _finding_size(f, where)
        if not strata and not extra:
            out.update(((name, "*", c), eps) for c, eps in codes.items())
    for j, f in enumerate(_list(report, "findings", "findings")):
        where = f"findings[{j}]"
        _dict(f, where)
        layer = f.get("layer", "*")
        out[(_str(layer, f"{where}.layer"), "checkpoint", _str(f.get("code"), f"{where}.code"))] = \
            _finding_size(f, where)
    return out


# the widest eps interval a diagnosis gives (the 25th..75th percentile of per-element estimates): a baseline's
# wider one would accept any eps at all ([0, 1e300] let a 100,000x eps fault pass)
MAX_INTERVAL = 1e4


def _eps_size(d: dict, where: str, strict: bool = False) -> dict:
    est = _num(d.get("estimated_eps"), f"{where}.estimated_eps")
    if est is None:
        return {}
    if strict and not (math.isfinite(est) and est > 0):
        raise _Bad(f"{where}.estimated_eps is {est}, not an eps a diagnosis estimates (finite, > 0)")
    interval = d.get("interval")
    if interval is None or interval == []:
        return {"eps": est}
    if not isinstance(interval, list) or len(interval) != 2:
        raise _Bad(f"{where}.interval is not a [low, high] pair")
    lo, hi = (_num(v, f"{where}.interval") for v in interval)
    if strict and not (lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)
                       and 0 < lo <= est <= hi <= lo * MAX_INTERVAL):
        raise _Bad(f"{where}.interval [{lo:g}, {hi:g}] is not an interval a diagnosis gives (finite, > 0, around "
                   f"its estimate {est:g}, within a factor of {MAX_INTERVAL:g})")
    return {"eps": est, "interval": (lo, hi)}


def _stratum_size(s: dict, where: str, strict: bool = False) -> dict:
    """The worst element's |cand - ref| / allowed (its |cand - ref| where nothing is allowed:
    --exact), and the candidate's non-finite count. `strict` (a baseline): a worst element must be
    one a run writes: a finite reference and allowance, and a non-finite candidate only where the
    stratum counts non-finite outputs (a worst of "inf" alone would accept any error at all)."""
    size = {}
    nonfinite = s.get("nonfinite")
    if nonfinite is not None:
        size["nonfinite"] = _num(_dict(nonfinite, f"{where}.nonfinite").get("candidate"), f"{where}.nonfinite.candidate")
    worst = s.get("worst")
    if worst is not None:
        _dict(worst, f"{where}.worst")
        ref, cand, allowed = (_num(worst.get(k), f"{where}.worst.{k}") for k in ("reference", "candidate", "allowed"))
        finite = all(v is None or math.isfinite(v) for v in (ref, allowed)) and (allowed is None or allowed >= 0)
        if strict and not finite:
            raise _Bad(f"{where}.worst holds a reference or allowance that is not a finite number")
        if strict and cand is not None and not math.isfinite(cand) and not (size.get("nonfinite") or 0) > 0:
            raise _Bad(f"{where}.worst.candidate is {cand} where the stratum counts no non-finite output")
        if None not in (ref, cand, allowed):
            err = abs(cand - ref)
            size["ratio"] = (err / allowed if allowed > 0 else err) if not math.isnan(err) else math.inf
            size["exact"] = not allowed > 0
    return size


def _finding_size(f: dict, where: str) -> dict:
    """A checkpoint difference's extent: channels, max |diff|, non-finite values, and the copy's eps."""
    size = {k: _num(f.get(k), f"{where}.{k}") for k in ("affected_channels", "max_abs_diff", "count")
            if f.get(k) is not None}
    if isinstance(f.get("candidate"), dict) and f["candidate"].get("value") is not None:
        size["copy_eps"] = _num(f["candidate"]["value"], f"{where}.candidate.value")
    return size


def _worse(new: dict, old: dict) -> str | None:
    """Why a finding is worse than the baseline's one of the same identity; None: same or smaller."""
    eps = new.get("eps")
    if eps is not None and old.get("eps") is not None and eps != old["eps"]:
        lo, hi = old.get("interval") or (old["eps"] / (1 + MARGIN), old["eps"] * (1 + MARGIN))
        if not lo <= eps <= hi:
            return f"behaves as eps {eps:.3g}, outside the baseline's {lo:.3g}..{hi:.3g} (estimated {old['eps']:.3g})"
    ratio, was = new.get("ratio"), old.get("ratio")
    if ratio is not None and was is not None and math.isinf(was) and math.isfinite(ratio) and not old.get("nonfinite"):
        return f"worst |err|/allowed {ratio:.3g}, where the baseline's was not finite"
    if ratio is not None and was is not None and new.get("exact") == old.get("exact") and ratio > was * (1 + MARGIN):
        unit = "|err|" if new.get("exact") else "|err|/allowed"
        return f"worst {unit} {ratio:.3g}, the baseline's {was:.3g}"
    for key, what in (("nonfinite", "non-finite outputs"), ("affected_channels", "differing channels"),
                      ("count", "non-finite weights"), ("max_abs_diff", "max |diff|")):
        if new.get(key) is not None and old.get(key) is not None and new[key] > old[key] * (1 + MARGIN):
            return f"{new[key]:.4g} {what}, the baseline's {old[key]:.4g}"
    if new.get("copy_eps") is not None and old.get("copy_eps") is not None and new["copy_eps"] != old["copy_eps"]:
        return f"the copy's eps is {new['copy_eps']:.6g}, the baseline's {old['copy_eps']:.6g}"
    return None


def findings(report: dict) -> set[tuple[str, str, str]]:
    return set(_entries(report))


def all_warnings(report: dict) -> list[str]:
    return list(report.get("warnings", [])) + [
        f"{layer['name']}: {w}" for layer in report["layers"] for w in layer.get("warnings", [])
    ]


def load_report(path: str | Path, what: str = "report") -> dict:
    """A saved report checked against its schema (parity_cli.report.saved) before any field is used."""
    from parity_cli.report import saved as saved_report

    return saved_report.load(Path(path), what)


def load_baseline(path: str | Path) -> dict:
    """A baseline, with every field the gate reads checked now, before the run: a wrong type is
    one line naming the file and the field, not an internal error after minutes of checking."""
    data = load_report(path, "baseline")
    try:
        _entries(data, strict=True)
        for key in ("checkpoint", "candidate"):
            _dict(data[key], key)
    except _Bad as exc:
        raise InputError(f"{path}: the baseline's {exc}") from None
    return data


def _missing_keys(data: dict) -> str | None:
    """The first field that breaks the report's schema (parity_cli.report.saved), or None."""
    from parity_cli.report import saved as saved_report

    try:
        saved_report.validate(data)
    except saved_report.Invalid as exc:
        return str(exc)
    return None


def mismatch(report: dict, baseline: dict) -> list[str]:
    """What makes the baseline another run's: another model (its norm tensors' fingerprint),
    dtype or candidate. Its findings then say little about this run's."""
    def get(d, *keys):
        for k in keys:
            d = d.get(k) if isinstance(d, dict) else None
        return d

    out = []
    old, new = get(baseline, "checkpoint", "fingerprint", "sha256"), get(report, "checkpoint", "fingerprint", "sha256")
    if old != new:
        out.append(f"another checkpoint (norm tensors sha256 {str(old)[:12]}..., here {str(new)[:12]}...)"
                   if old and new else "a checkpoint without a fingerprint to compare")
    old, new = get(baseline, "candidate", "dtype"), get(report, "candidate", "dtype")
    if old != new:
        out.append(f"dtype {old}, here {new}")
    for key, what in (("impl", "candidate"), ("args", "candidate arguments")):
        old, new = get(baseline, "candidate", key) or None, get(report, "candidate", key) or None
        if old != new:
            out.append(f"{what} {json.dumps(old)}, here {json.dumps(new)}")
    old = get(baseline, "candidate", "checkpoint", "fingerprint", "sha256") or get(baseline, "candidate", "checkpoint", "path")
    new = get(report, "candidate", "checkpoint", "fingerprint", "sha256") or get(report, "candidate", "checkpoint", "path")
    if old != new:
        out.append("another candidate checkpoint")
    return out


def gate(report: dict, fail_on: str = "fail", baseline: dict | None = None, baseline_path: str | None = None) -> dict:
    if fail_on not in FAIL_ON:
        raise InputError(f"--fail-on must be one of {', '.join(FAIL_ON)}")
    found = _entries(report)
    try:
        known = _entries(baseline, strict=True) if baseline is not None else {}
    except _Bad as exc:
        raise InputError(f"{baseline_path}: the baseline's {exc}") from None
    worse = {key: why for key in found.keys() & known.keys() if (why := _worse(found[key], known[key]))}
    new = sorted(found.keys() - known.keys() | worse.keys())
    warnings = all_warnings(report)
    missed = len((report.get("checkpoint") or {}).get("unchecked") or [])
    failed = bool(new) or (fail_on in ("unchecked", "warn") and bool(missed)) or (fail_on == "warn" and bool(warnings))
    result = {
        "verdict": "fail" if failed else "pass",
        "exit_code": 1 if failed else 0,
        "fail_on": fail_on,
        "warnings": len(warnings),
        "unchecked": missed,
        "new_findings": [{"layer": l, "stratum": s, "code": c, **({"worse": worse[l, s, c]} if (l, s, c) in worse else {})}
                         for l, s, c in new],
    }
    if baseline is not None:
        result["baseline"] = {
            "path": baseline_path,
            "accepted": [{"layer": l, "stratum": s, "code": c} for l, s, c in sorted(found.keys() & known.keys() - worse.keys())],
            "gone": [{"layer": l, "stratum": s, "code": c} for l, s, c in sorted(known.keys() - found.keys())],
            "mismatch": mismatch(report, baseline),
        }
    return result


# --- one verdict for every command ----------------------------------------------------------------
# `check`, `fused` and `runtimes` each come down to units (layers, runtime cells) that passed, failed
# or could not run, the norms no unit covered, and what the semantics rest on (a forced family, an
# assumed eps, a family the installed transformers computes otherwise). The rules here turn them into
# one exit code and one last line, in forms from the fullest to the shortest: `line(width)` prints the
# fullest that fits (80 columns in a CI log), the cause before the details.

EXIT_PASS, EXIT_FAIL, EXIT_INPUT = 0, 1, 2


@dataclass(frozen=True)
class Verdict:
    word: str  # PASS, FAIL, or ERROR (parity's own fault: an adapter that disagrees with its runtime)
    exit_code: int
    forms: tuple  # the whole line, fullest first

    @property
    def passed(self) -> bool:
        return self.word == "PASS"

    def line(self, width: int | None = None) -> str:
        if width is None:
            return self.forms[0]
        return next((f for f in self.forms if len(f) <= width), self.forms[-1])


def _forms(word: str, bodies: list[str], tails: list[str]) -> tuple:
    """Each body with each tail, body-major: a shorter tail is tried before a shorter cause."""
    return tuple(dict.fromkeys(f"{word}: {b}{t}" for b in bodies for t in tails))


def tails(basis: dict, unchecked: list, checked: int) -> list[str]:
    """What the verdict did not cover and what its semantics rest on, in full then short: the same
    words after every command's verdict. `basis`: {"checkpoint": {...}, "eps": {...}} as check's report
    has them."""
    return list(dict.fromkeys(not_checked(unchecked, checked, level) + assumed_eps(basis, short=level != "full")
                              for level in ("full", "name", "short")))


def not_checked(missed: list, checked: int, level: str = "full") -> str:
    """`; 1 of 5 norms not checked (name: why)`, or nothing: every command's verdict line says it.
    Shorter: the first name alone (`name`), the count alone (`short`)."""
    if not missed:
        return ""
    said = f"; {len(missed)} of {checked + len(missed)} norms not checked"
    if level == "short":
        return said
    first = missed[0]
    more = f", +{len(missed) - 1} more" if len(missed) > 1 else ""
    return f"{said} ({first['name']}" + (f": {first['why']}" if level == "full" else "") + f"{more})"


def assumed_eps(d: dict, short: bool = False) -> str:
    """What the verdict's semantics rest on, where they are not simply the checkpoint's: semantics the
    installed transformers changed (Mamba2's gated norm over the whole width in 4.53 whatever n_groups
    says), a forced family the model type contradicts, an eps assumed (lxmert forced to `layer_norm`
    would otherwise pass against 1e-5 where its modules use 1e-12)."""
    eps, ck = d.get("eps") or {}, d.get("checkpoint") or {}
    if not isinstance(ck, dict):
        return ""
    words = ""
    moved = ck.get("family_moved") or {}
    what = moved.get("what") if isinstance(moved, dict) else None
    if isinstance(what, list) and what and all(isinstance(w, str) for w in what):  # a saved report's, checked
        more = f", +{len(what) - 1} more" if len(what) > 1 else ""
        words += f" (as transformers {moved.get('transformers')} computes it" + (
            ")" if short else f": {what[0]}{more})")
    if ck.get("family_contradiction"):  # --family-force: the verdict is of the forced semantics, said on its line
        words += f" (family {ck.get('family')} forced" + (
            ")" if short else f" over model_type '{ck.get('model_type')}', which it contradicts)")
    if eps.get("source") == "family-default":
        forced = "forced " if ck.get("family_forced") else ""
        words += f" (eps {fmt(eps.get('value'))} assumed)" if short else (
            f" (eps {fmt(eps.get('value'))} is {forced}family {ck.get('family')}'s default, assumed: "
            "the config has no eps key it reads)")
    return words


def _fail_count(bad: int, n: int) -> str:
    return f"{bad} of {n} layer fails" if n == 1 else f"{bad} of {n} layers fail"


def _all(n: int) -> str:
    return "the 1 layer is" if n == 1 else f"all {n} layers"


def unchecked_words(d: dict) -> str:
    """What the verdict did not cover: `; 4 of 6 norms not checked (name: why, +3)`. A PASS over 2 of
    6 norms is not a PASS over the model."""
    return not_checked((d.get("checkpoint") or {}).get("unchecked") or [], d["summary"]["layers"])


def verdict(d: dict) -> tuple[bool, str]:
    """(passed, the sentence after PASS/FAIL) of a check, with what it did not cover and rests on."""
    passed, what = _compared(d)
    return passed, what + unchecked_words(d) + assumed_eps(d)


def _compared(d: dict) -> tuple[bool, str]:
    s = d["summary"]
    gate = d.get("gate") or {}
    passed = gate.get("verdict", s["verdict"]) == "pass"
    bad = s["failed"] + s["errors"]
    counts = _fail_count(bad, s["layers"]) + (f" ({s['errors']} with an error)" if s["errors"] else "")
    extra = len(d.get("findings", []))
    conv = (d.get("candidate") or {}).get("checkpoint") or {}
    every = conv.get("findings") if isinstance(conv.get("findings"), int) else extra  # the copy's line says the same
    if every:
        counts += f", {every} checkpoint finding(s)"
    other = next((f for f in d.get("findings", []) if f.get("code") == "checkpoint_model_mismatch"), None)
    if other is not None:  # every other finding follows from it: said first
        counts = f"{other.get('message')}; {counts}"
    baseline = gate.get("baseline")
    if baseline is not None:
        new = len(gate.get("new_findings", []))
        if passed:
            what = f"no new finding against the baseline; {counts}, as accepted" if bad or extra else \
                f"{_all(s['layers'])} pass"
        else:
            what = f"{new} new finding(s) beyond the baseline; {counts}"
        return passed, what
    if passed:
        return True, f"{_all(s['layers'])} within tolerance on {len(d['probes']['strata'])} strata"
    if not bad and not extra and gate.get("fail_on") == "unchecked":
        return False, f"--fail-on unchecked; {_all(s['layers'])} pass"
    if not bad and not extra and gate.get("fail_on") == "warn":
        return False, f"--fail-on warn and {gate.get('warnings', 0)} warning(s); {_all(s['layers'])} pass"
    return False, counts


def cause(g: grouping.Group, words: str = "full") -> str:
    """A group's finding as the verdict line names it: `code (words)`, the group's other codes
    after a '+'. words: full, terse (the figures alone where the code says the rest) or none."""
    first = g.texts[0]
    if first.startswith("error: "):
        code, said = "error", first[len("error: "):]
    else:
        code, _, said = first.partition(", ")
    if words == "terse":
        said = said.replace("behaves as ", "")
    if words == "code":  # the first code alone: the line's shortest form
        return code
    text = f"{code} ({said})" if words != "none" and said else code
    return text + "".join(f" + {t.partition(', ')[0]}" for t in g.texts[1:])


def check_verdict(d: dict) -> Verdict:
    """`check`'s verdict: its exit code the gate's (after --baseline and --fail-on), its line the
    verdict with its cause, what the last line of a CI log says:
    `FAIL: 109 of 109 layers: eps_mismatch (behaves as eps ≈ 1e-5, configured 1e-6)`. The largest
    new group's finding names the cause, `+N other causes` counts the rest; within a width the
    cause's words go first, then its code, never the verdict's own words."""
    passed, what = _compared(d)
    gate_ = d.get("gate") or {}
    code = gate_.get("exit_code", EXIT_PASS if passed else EXIT_FAIL)
    ends = tails(d, (d.get("checkpoint") or {}).get("unchecked") or [], d["summary"]["layers"])
    word = "PASS" if passed else "FAIL"
    found = [] if passed else [g for g in grouping.groups(d) if g.new is not False]
    if found:
        sm = d["summary"]
        if sm["errors"] and sm["errors"] == sm["failed"] + sm["errors"] and found[0].status == "error":
            what = what.replace(f" ({sm['errors']} with an error)", "")  # the cause says it: error (...)
        for verb in (" layers fail", " layer fails"):
            if what.endswith(verb):
                what = what[:-len(verb)] + " " + verb.split()[0]
        others = len(found) - 1
        more = f"+{others} other cause{'s' if others > 1 else ''}" if others else ""
        where = f"in {len(found[0].layers)}" if len(grouping.groups(d)) > 1 else ""  # some layers' cause only

        def body(words: str, where: str) -> str:
            tail = ", ".join(t for t in (where, more) if t)
            return f"{what}: {cause(found[0], words)}" + (f" {tail}" if tail else "")

        bodies = [body(words, w) for words, w in (("full", where), ("terse", where), ("terse", ""),
                                                  ("none", where), ("none", ""))]
        # the shortest: the counts of failing layers alone, the first code, how many causes besides
        sm_bad = sm["failed"] + sm["errors"]
        codes = sum(len(g.texts) for g in found) - 1
        bodies.append(f"{sm_bad} of {sm['layers']} layer{'s' if sm['layers'] != 1 else ''}: {cause(found[0], 'code')}"
                      + (f" +{codes} other cause{'s' if codes > 1 else ''}" if codes else ""))
    elif not passed and gate_.get("fail_on") == "warn" and all_warnings(d):
        bodies = [f"{what}: warning: {all_warnings(d)[0]}", what]
    else:
        bodies = [what]
    return Verdict(word, code, _forms(word, bodies, ends))


def verdict_line(d: dict, width: int | None = None) -> str:
    return check_verdict(d).line(width)


def _causes(units: list[dict]) -> list[str]:
    """The codes of the units that did not pass, each once, the most frequent first."""
    from collections import Counter

    counts = Counter(code for u in units for code in dict.fromkeys(u.get("codes") or ["error"]))
    return [code for code, _ in counts.most_common()]


def fused_verdict(data: dict) -> Verdict:
    """`fused`'s verdict from its layers, by check's rules: a layer that failed or raised fails the run
    (its stored gain's own faults included), the norms it did not check and what its semantics rest
    on are said after."""
    layers = data["layers"]
    bad = [{"codes": [d["code"] for d in layer.get("findings", []) + layer["diagnoses"]]} for layer in layers
           if layer["verdict"] != "pass"]
    holds = ("the dequantized output within half a step" if data.get("fused") == "quant"
             else "both outputs within tolerance")
    ends = tails(data.get("basis") or {}, data.get("unchecked") or [], len(layers))
    if not bad:
        return Verdict("PASS", EXIT_PASS, _forms("PASS", [f"{_all(len(layers))}, {holds}"], ends))
    causes = _causes(bad)
    counts = f"{len(bad)} of {len(layers)} layer{'s' if len(layers) > 1 else ''}"
    bodies = [f"{counts}: {', '.join(causes)}", f"{counts}: {causes[0]}" + (
        f" +{len(causes) - 1} other cause{'s' if len(causes) > 2 else ''}" if len(causes) > 1 else "")]
    return Verdict("FAIL", EXIT_FAIL, _forms("FAIL", bodies, ends))


def runtimes_verdict(data: dict) -> Verdict:
    """`runtimes`' verdict from its cells: an `adapter` cell (parity's adapter disagrees with the
    runtime's own path) outranks any verdict, exit 2; a cell that failed or raised fails the run;
    refused and absent cells did not run and count for nothing. The cells that failed are named,
    as many as fit."""
    cells = data["cells"]
    ran = [c for c in cells if c["verdict"] in ("pass", "fail", "error", "adapter")]
    ours = [c for c in ran if c["verdict"] == "adapter"]
    bad = [c for c in ran if c["verdict"] in ("fail", "error")]
    layers = next((c["layers"] for c in ran if c.get("layers")), 0)
    ends = tails(data.get("basis") or {}, data.get("unchecked") or [], layers)
    checks = f"{len(ran)} runtime check{'s' if len(ran) != 1 else ''}"

    def named(which: list) -> list[str]:  # every cell, then fewer and a count of the rest
        names = [f"{c['runtime']} {c['dtype']}" for c in which]
        out = [", ".join(names)]
        for k in range(len(names) - 1, 0, -1):
            out.append(", ".join(names[:k]) + f", +{len(names) - k} more")
        return out + [f"{len(names)} cell{'s' if len(names) > 1 else ''}"]

    if not ran:  # runtimes.table refuses such a table first; a saved one read back says it too
        return Verdict("ERROR", EXIT_INPUT, ("ERROR: no runtime check ran",))
    if ours:
        bodies = [f"parity's adapter disagrees with the runtime's own path in {len(ours)} of {checks}: {n}"
                  for n in named(ours)]
        return Verdict("ERROR", EXIT_INPUT, _forms("ERROR", bodies, ends))
    if bad:
        return Verdict("FAIL", EXIT_FAIL, _forms("FAIL", [f"{len(bad)} of {checks}: {n}" for n in named(bad)], ends))
    return Verdict("PASS", EXIT_PASS, _forms("PASS", [f"all {checks}"], ends))
