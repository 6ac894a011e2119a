"""The failure message of parity_cli.testing: the CLI's grouped finding for the one layer checked.

The CLI's renderer says it when it can (parity_cli.report.terminal.summary_lines: the verdict with
its cause, each failing group with its worst element); until that function exists, `_lines` says the
same from parity_cli.report.grouping, which both read."""

from __future__ import annotations

import math

WIDTH = 100  # an assertion message is read in a log: lines are kept under this where the words allow


def finding_lines(d: dict, width: int = WIDTH) -> list[str]:
    """The verdict with its cause, then each failing group: its strata, q/eps range, failing share
    and worst element. Plain text, one string a line."""
    from parity_cli.report import terminal

    if hasattr(terminal, "summary_lines"):
        return list(terminal.summary_lines(d, width))
    return _lines(d)


def _fmt(value) -> str:
    """Three significant digits, the exponent unpadded (1e-5, not 1e-05); '-' for no value."""
    from parity_cli.check.results import unjfloat
    from parity_cli.report.grouping import unpadded

    value = unjfloat(value)
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return unpadded(f"{value:.3g}")


def cause(group) -> str:
    """`code (words)` of a group's first finding, its other codes after a '+'."""
    first = group.texts[0]
    if first.startswith("error: "):
        code, said = "error", first[len("error: "):]
    else:
        code, _, said = first.partition(", ")
    text = f"{code} ({said})" if said else code
    return text + "".join(f" + {t.partition(', ')[0]}" for t in group.texts[1:])


def worst_words(w: dict) -> str:
    """The element furthest past its allowance: where, its input, both outputs, what it was allowed,
    how many times that it missed by, and its row's q/eps."""
    where = f"{w['layer']} {w['stratum']} row {w.get('vector', '?')} [{w.get('index', '?')}]"
    ratio = w["ratio"]
    times = "non-finite" if not math.isfinite(ratio) else (
        "bitwise: differs" if not w.get("allowed") else f"{_fmt(ratio)}x allowed")
    row = f", row q/eps {_fmt(w['q_over_eps'])}" if w.get("q_over_eps") is not None else ""
    return (f"worst {where}: x {_fmt(w.get('input'))}, ref {_fmt(w.get('reference'))}, "
            f"cand {_fmt(w.get('candidate'))}, allowed {_fmt(w.get('allowed'))} ({times}){row}")


def _lines(d: dict) -> list[str]:
    from parity_cli.report import grouping

    found = grouping.groups(d)
    strata = d["probes"]["strata"]
    if not found:
        return [f"PASS: within tolerance on {len(strata)} strata ({', '.join(strata)})"]
    out = [f"FAIL: {cause(found[0])}" + (f", +{len(found) - 1} other cause(s)" if len(found) > 1 else "")]
    for g in found:
        out.append(f"{', '.join(g.names)}: {g.text}")
        fig = g.figures()
        parts = []
        if fig["failing"]:
            parts.append("strata " + ", ".join(fig["failing"]))
        lo, hi = fig["q_over_eps"]
        if lo is not None:
            parts.append(f"q/eps {_fmt(lo)}..{_fmt(hi)}")
        bad, total = g.elements()
        if bad:
            parts.append(f"{bad:,} of {total:,} elements fail ({100 * bad / total if total else 0.0:.3g} %)")
        if parts:
            out.append("    " + " · ".join(parts))
        w = g.worst_element()
        if w is not None:
            out.append("    " + worst_words(w))
    return out
