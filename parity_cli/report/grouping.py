"""Layers that fail the same way are one finding: 109 identical eps diagnoses are one line.

A layer's signature is its status plus the short form of each diagnosis and finding, with the
numbers that identify the fault rounded to what a person compares (an eps of 9.99e-6 and one of
1.0e-5 are the same fault). Everything reads the report dict, so a saved report groups the same
way; the terminal, Markdown, JUnit, -q and --explain all use these groups."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


def unpadded(text: str) -> str:
    """1e-06 -> 1e-6, 3.9e+13 -> 3.9e13: how a config file (and a person) writes an exponent."""
    if "e" not in text:  # inf and nan have none
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt(value) -> str:
    """Three significant digits, exponent unpadded (1e-5, not 1e-05); '-' for no value."""
    from parity_cli.check.results import unjfloat

    value = unjfloat(value)
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return unpadded(f"{value:.3g}")


def sci(value) -> str:
    """At most two significant digits, as a config file would say it: 1e-5, 9.9e-6."""
    from parity_cli.check.results import unjfloat

    value = unjfloat(value)
    if value is None:
        return "?"
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    return unpadded(f"{value:.1e}".replace(".0e", "e"))


def g(value) -> str:
    """%g with the exponent unpadded: 1e-6."""
    return unpadded(f"{float(value):g}")


def apart(a, b) -> tuple[str, str]:
    """Two values with the fewest significant digits (two at least) that tell them apart: a read eps
    of 1.01328e-6 beside a configured 1e-6 is "1.01328e-6, configured 1e-6", never "1e-6, 1e-6"."""
    from parity_cli.check.results import unjfloat

    a, b = unjfloat(a), unjfloat(b)
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return sci(a), "?" if b is None else g(b)
    for digits in range(2, 18):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y or a == b:
            return unpadded(x) if digits > 2 or a != b else sci(a), unpadded(y) if x != y else g(b)
    return unpadded(f"{a:.17g}"), unpadded(f"{b:.17g}")


def _eps_words(d: dict) -> str:
    """eps_mismatch in a phrase: the eps the candidate uses (read from a copy, or estimated) beside the
    configured one, each with the digits that tell them apart."""
    used, configured = apart(d.get("estimated_eps"), d.get("configured_eps", 0))
    if d.get("read_from_copy"):  # a value read is exact: all its %g digits where they already differ
        read = d.get("estimated_eps")
        if isinstance(read, (int, float)) and g(read) != g(d.get("configured_eps", 0)):
            used = g(read)
        return f"uses eps {used} (read, not estimated), configured {configured}"
    return f"behaves as eps ≈ {sci(d.get('estimated_eps'))}, configured {g(d.get('configured_eps', 0))}"


def _offset_words(item: dict) -> str:
    delta, expected = item.get("offset_error", 0.0), item.get("expected_offset", 0.0)
    if item.get("stored_gain"):
        return f"gain off by {delta:+.2g} (the file stores {item['stored_gain']})"
    if expected:
        return "the +1 is missing (gain w)" if delta < 0 else "the +1 is applied twice (gain 2 + w)"
    return f"gain off by {delta:+.2g}"


# code -> the words after the code in a grouped line; numbers that differ from layer to layer
# (worst ulp, channel lists) stay out, so that they do not split a group.
SHORT = {
    "bias_mismatch": lambda d: "the bias differs",
    "residual_sum_mismatch": lambda d: "the residual sum it hands on is not its inputs' sum",
    "eps_mismatch": lambda d: _eps_words(d),
    "eps_missing": lambda d: (f"eps {g(d.get('configured_eps', 0))} rounds to 0 in {d.get('dtype')}: an all-zero row "
                              "computes 0/0" if d.get("lost_to_dtype") and d.get("dtype")
                              else "eps dropped: an all-zero row computes 0/0"),
    "eps_outside_sqrt": lambda d: f"eps outside the root: {d.get('form', 'x / (sqrt(q) + eps)')}",
    "batch_statistics": lambda d: "the batch's statistics used at inference, not the running ones",
    "running_statistics_swapped": lambda d: "running mean and variance swapped",
    "running_statistics_missing": lambda d: "running statistics not loaded (mean 0, variance 1)",
    "gate_position_mismatch": lambda d: f"the gate applied {d.get('candidate_gate')} the norm, not {d.get('gate')}",
    "gate_missing": lambda d: "the gate ignored",
    "gate_activation_mismatch": lambda d: f"{d.get('candidate_activation')}(z) gating, not {d.get('activation')}(z)",
    "group_count_mismatch": lambda d: (f"{d.get('candidate_groups')} group{'s' if d.get('candidate_groups') != 1 else ''}"
                                       f" where the layer has {d.get('groups')}"),
    "mean_subtracted": lambda d: "subtracts the mean (LayerNorm math in an RMSNorm)",
    "mean_not_subtracted": lambda d: "does not subtract the mean (RMSNorm math in a LayerNorm)",
    "variance_not_mean_square": lambda d: "divides by the variance, not the mean square",
    "reduced_precision_reduction": lambda d: "squares and sums without a float32 upcast",
    "float32_accumulation": lambda d: "accumulates in float32 with a longer rounding chain",
    "weight_offset_mismatch": _offset_words,
    "channel_gain_mismatch": lambda d: (f"every channel's gain x {d['uniform_scale']:.3g}" if "uniform_scale" in d
                                        else "the gain differs in some channels"),
    "cast_order": lambda d: f"{d.get('matched_order')}-order casts where the family uses {d.get('expected_order')}",
    "symptom_small_inputs": lambda d: "errors only at small q/eps; no known fault reproduces it",
    "symptom_large_inputs": lambda d: "errors only at large |x|; no known fault reproduces it",
    "unexplained": lambda d: "no known fault reproduces the candidate",
    "symptom_mean_rounding": lambda d: "errors only on constant rows: mean/variance rounding, not eps",
    "marginal": lambda d: "misses by less than 2x the allowance; no one cause picked",
    "bitwise_difference": lambda d: "not bitwise equal",
    "grad_mismatch": lambda d: "backward differs: " + ", ".join(sorted(d.get("parts", {}))),
    "grad_error": lambda d: "backward failed",
    "nonfinite_weight": lambda d: "non-finite values in the stored weight",
    "activation_overflow": lambda d: f"real rows up to |x| {sci(d.get('largest'))}, past {d.get('dtype')}'s range",
    "checkpoint_eps_mismatch": lambda d: (f"the copy's eps is {g(d['candidate']['value'])}, "
                                          f"the reference's {g(d['reference']['value'])}"),
    "checkpoint_weight_mismatch": lambda d: (
        f"the copy's gain is shifted by {d['uniform_shift']:+g}" if "uniform_shift" in d
        else "the copy stores the gain at lower precision" if d.get("precision_loss")
        else "the copy's gain differs"),
    "checkpoint_bias_mismatch": lambda d: "the copy's bias differs",
    "checkpoint_statistics_mismatch": lambda d: f"the copy's {d.get('statistic', 'running statistics')} differs",
    "checkpoint_layer_missing": lambda d: "missing from the candidate checkpoint",
    "checkpoint_layer_extra": lambda d: "only in the candidate checkpoint",
    "checkpoint_shape_mismatch": lambda d: "shape differs in the candidate checkpoint",
}


def short(item: dict) -> str:
    """`code, words` for one diagnosis or checkpoint finding."""
    words = SHORT.get(item["code"])
    try:
        text = words(item) if words else ""
    except (KeyError, TypeError, ValueError):
        text = ""
    return f"{item['code']}, {text}" if text else item["code"]


def _error_key(message: str) -> str:
    """Errors that differ only in numbers (a layer index, a size) are the same error."""
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", message or "")[:160]


@dataclass
class Group:
    status: str  # fail | error
    texts: list[str]  # one per diagnosis and finding, `code, words`
    layers: list[dict] = field(default_factory=list)
    new: bool | None = None  # with --baseline: a finding the baseline does not have

    @property
    def names(self) -> list[str]:
        return [layer["name"] for layer in self.layers]

    @property
    def representative(self) -> dict:
        return self.layers[0]

    @property
    def codes(self) -> list[str]:
        return [t.split(",")[0] for t in self.texts]

    @property
    def text(self) -> str:
        return "; ".join(self.texts)

    def figures(self) -> dict:
        """Failing strata, their q/eps range and the worst errors over every layer of the group."""
        from parity_cli.check.results import least, worst

        failing, compared = [], []
        for layer in self.layers:
            for s in layer["strata"] + layer.get("grad", []):
                if s["status"] == "fail":  # an errored stratum never ran: it is no failing stratum
                    compared.append(s)
                    if s["name"] not in failing:
                        failing.append(s["name"])
        qs = [s.get("failing_q_over_eps") or s["q_over_eps"] for s in compared]
        return {
            "failing": failing,
            "q_over_eps": (least(q["min"] for q in qs), worst(q["max"] for q in qs)),
            "max_abs_err": worst(s["max_abs_err"] for s in compared),
            "max_rel_err": worst(s["max_rel_err"] for s in compared),
            "max_ulp": worst(s.get("max_ulp") for s in compared),
        }


    def elements(self) -> tuple[int, int]:
        """(failing, compared) elements over every stratum of the group's layers."""
        bad = total = 0
        for layer in self.layers:
            for s in layer["strata"] + layer.get("grad", []):
                if s["status"] == "error":
                    continue
                bad += int(s.get("violations") or 0)
                total += int(s.get("elements") or 0)
        return bad, total

    def worst_element(self) -> dict | None:
        """The element furthest past what it was allowed, over the group's failing strata: where a
        person starts looking (torch.testing.assert_close prints the same)."""
        best, best_ratio = None, -1.0
        for layer in self.layers:
            for s in layer["strata"] + layer.get("grad", []):
                if s["status"] != "fail" or not s.get("worst"):
                    continue
                ratio = times_allowed(s["worst"])
                if ratio > best_ratio:
                    best, best_ratio = dict(s["worst"], layer=layer["name"], stratum=s["name"], ratio=ratio), ratio
        return best


def times_allowed(worst: dict) -> float:
    """|cand - ref| / allowed for one element: inf where either side is non-finite or nothing
    was allowed (--exact) and they differ, 0 where they are equal."""
    from parity_cli.check.results import unjfloat

    vals = [unjfloat(worst.get(k)) for k in ("candidate", "reference", "allowed")]
    if any(v is None for v in vals):
        return math.inf
    cand, ref, allowed = vals
    if cand == ref or (math.isnan(cand) and math.isnan(ref)):
        return 0.0
    if not (math.isfinite(cand) and math.isfinite(ref)):
        return math.inf
    return abs(cand - ref) / allowed if allowed > 0 else math.inf


def _clusters(values: list[float], spread: float = 1.1) -> dict[float, float]:
    """Estimates within 10 % of each other are one value (their median): 9.76e-6 and 1.0e-5 are
    the same eps, whatever digit rounding would split them on."""
    import statistics

    out: dict[float, float] = {}
    run: list[float] = []
    for v in sorted(set(values)) + [math.inf]:
        if run and not (v <= run[0] * spread):
            centre = statistics.median(run)
            out.update((r, centre) for r in run)
            run = []
        run.append(v)
    return out


# diagnoses that name no fault: where a layer's findings (read from the checkpoints, not estimated) hold one,
# the headline is the finding's
VAGUE_CODES = ("unexplained", "marginal", "float32_accumulation")


def signature(layer: dict, eps_of: dict | None = None) -> tuple[str, tuple[str, ...]]:
    texts = []
    for d in layer.get("diagnoses", []):
        est = d.get("estimated_eps")
        if eps_of and d["code"] == "eps_mismatch" and isinstance(est, (int, float)) and est in eps_of:
            d = dict(d, estimated_eps=eps_of[est])
        texts.append(short(d))
    findings = [short(f) for f in layer.get("findings", [])]
    vague = all(d["code"] in VAGUE_CODES or d["code"].startswith("symptom_") for d in layer.get("diagnoses", []))
    texts = findings + texts if findings and vague else texts + findings  # the best-supported cause first
    if layer["status"] == "error" and layer.get("error"):
        texts.append("error: " + _error_key(layer["error"]))
    if not texts:
        failing = sorted(s["name"] for s in layer["strata"] + layer.get("grad", []) if s["status"] != "pass")
        texts.append("unexplained, failing " + ", ".join(failing))
    return layer["status"], tuple(texts)


def groups(report: dict) -> list[Group]:
    """Non-passing layers grouped by signature, and the run's own checkpoint findings (layers only
    the converted copy has) by code; the largest group first, then table order."""
    bad = [layer for layer in report["layers"] if layer["status"] != "pass"]
    for f in report.get("findings", []):  # a report-level finding as a layer of its own
        bad.append({"name": f.get("layer", "*"), "status": "fail", "strata": [], "diagnoses": [], "findings": [f],
                    "report_level": True})
    estimates = [d["estimated_eps"] for l in bad for d in l.get("diagnoses", [])
                 if d["code"] == "eps_mismatch" and isinstance(d.get("estimated_eps"), (int, float))
                 and d["estimated_eps"] > 0]
    eps_of = _clusters(estimates)
    found: dict = {}
    for layer in bad:
        status, texts = signature(layer, eps_of)
        group = found.setdefault((status, texts), Group(status, [_shown(t, layer) for t in texts]))
        group.layers.append(layer)
    ordered = list(found.values())
    gate = report.get("gate") or {}
    if gate.get("baseline") is not None:  # new findings first: they are what fails the run
        new_layers = {f["layer"] for f in gate.get("new_findings", [])}
        for g in ordered:
            g.new = any(name in new_layers for name in g.names)
    ordered.sort(key=lambda g: (g.new is False, -len(g.layers)))  # stable: ties keep the table order
    return ordered


def _shown(text: str, layer: dict) -> str:
    """The error's own words for display (the key has its numbers masked)."""
    if text.startswith("error: ") and layer.get("error"):
        return "error: " + layer["error"]
    return text


# --- layer names as a pattern --------------------------------------------------------------------

_INDEX = re.compile(r"(?<=\.)(\d+)(?=\.|$)")


def _ranges(indices: list[int]) -> str:
    out, start, prev = [], None, None
    for i in sorted(set(indices)):
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}..{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}..{prev}")
    return ",".join(out)


def _braced(alternatives: list[str]) -> str:
    """a_x, b_x -> {a,b}_x: the common head and tail (cut at '.' or '_') outside the braces."""
    if len(alternatives) == 1:
        return alternatives[0]
    head = _common(alternatives, reverse=False)
    tail = _common([a[len(head):] for a in alternatives], reverse=True)
    middles = [a[len(head):len(a) - len(tail)] for a in alternatives]
    if any(not m for m in middles):
        return "{" + ",".join(alternatives) + "}"
    return head + "{" + ",".join(middles) + "}" + tail


def _common(words: list[str], reverse: bool) -> str:
    seq = [w[::-1] for w in words] if reverse else list(words)
    n = 0
    while all(len(w) > n for w in seq) and len({w[n] for w in seq}) == 1:
        n += 1
    part = seq[0][:n]
    cut = max(part.rfind("."), part.rfind("_"))  # whole name parts only
    part = part[:cut + 1] if cut >= 0 else ""
    return part[::-1] if reverse else part


def _split(name: str) -> tuple[str, tuple[int, ...]]:
    """model.layers.3.mlp.experts.7.norm -> ('model.layers.*.mlp.experts.*.norm', (3, 7))."""
    return _INDEX.sub("*", name), tuple(int(m.group(1)) for m in _INDEX.finditer(name))


def _fill(template: str, parts: list[str]) -> str:
    it = iter(parts)
    return re.sub(r"(?<=\.)\*(?=\.|$)", lambda m: next(it), template)


def _spans(values) -> str:
    text = _ranges(sorted(values))
    return text if text.isdigit() else "{" + text + "}"


def _templates(names) -> dict[str, set]:
    full: dict[str, set] = {}
    for name in names:
        template, idx = _split(name)
        full.setdefault(template, set()).add(idx)
    return full


class Names(list):
    """A report's every layer name (universe()), its templates computed once: name_pattern runs once
    a group, and over a fresh universe each time 1,000 groups of 4 KB names took minutes."""

    _full: dict | None = None

    def templates(self) -> dict[str, set]:
        if self._full is None:
            self._full = _templates(self)
        return self._full


def name_pattern(names: list[str], universe: list[str] | None = None) -> str:
    """model.layers.{0..5}.input_layernorm, model.layers.*.self_attn.{k,q}_norm, model.norm:
    '*' only where every index the model has there is in the group, ranges where some are; a
    group that is no grid of indices (some experts of some layers) is listed name by name."""
    universe = universe if universe is not None else names
    full = universe.templates() if isinstance(universe, Names) else _templates(universe)
    mine: dict[str, set] = {}
    for name in names:
        template, idx = _split(name)
        mine.setdefault(template, set()).add(idx)
    rendered = []
    for template, tuples in mine.items():
        width = len(next(iter(tuples)))
        if not width or tuples == full.get(template, set()):
            rendered.append(template)
            continue
        per = [{t[i] for t in tuples} for i in range(width)]
        size = 1
        for values in per:
            size *= len(values)
        if size != len(tuples):  # not a grid: no pattern would be true
            rendered.extend(_fill(template, [str(i) for i in t]) for t in sorted(tuples))
            continue
        everywhere = [{t[i] for t in full.get(template, ())} for i in range(width)]
        rendered.append(_fill(template, ["*" if per[i] == everywhere[i] else _spans(per[i]) for i in range(width)]))
    # one brace group per head (the part up to the last index) and per last name part
    heads: dict[tuple[str, str], list[str]] = {}
    for text in rendered:
        cut = max(text.rfind("}."), text.rfind("*."))
        cut = cut + 2 if cut >= 0 else 0
        head, rest = text[:cut], text[cut:]
        last = re.split(r"[._]", rest)[-1] if cut else rest
        heads.setdefault((head, last), []).append(rest)
    return ", ".join(head + _braced(rests) for (head, _), rests in heads.items())


def universe(report: dict) -> list[str]:
    """Every name a pattern may stand for: the checked layers and those only the copy has."""
    return Names([l["name"] for l in report["layers"]]
                 + [f["layer"] for f in report.get("findings", []) if f.get("layer")])




def runtime_words(conv: dict) -> str | None:
    """A runtime capture's one line of context: which runtime, which build, how many tokens, the
    dtype it computed in; None for any other copy (or a capture whose fields are not there)."""
    rt = conv.get("runtime") if conv.get("format") == "runtime-capture" else None
    if not isinstance(rt, dict) or not rt.get("name"):
        return None
    version = str(rt.get("version") or "")
    who = str(rt["name"]) if not version else version if version.startswith(str(rt["name"])) else (
        f"{rt['name']} ({version})")
    where = f", {rt['backend']}" if rt.get("backend") else ""
    dtypes = ", ".join(str(d) for d in rt.get("computes_in") or [])
    return (f"recorded inside {who}{where} on {rt.get('tokens', '?')} tokens"
            + (f", computing in {dtypes}" if dtypes else ""))
