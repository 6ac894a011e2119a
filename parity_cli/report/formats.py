"""Other renderings of the JSON report for the tools CI already has: JUnit XML, Markdown.

Everything here reads the report dict only, so `parity report` can re-render a saved file."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from parity_cli.text import layer_count, printable, printable_tree


def layer_summary(layer: dict) -> dict:
    """Failing strata, worst errors, q/eps range of the failing probes, diagnosis codes."""
    strata = layer["strata"]
    failing = [s for s in strata if s["status"] != "pass"]
    compared = [s for s in (failing or strata) if s["status"] != "error"]

    from parity_cli.check.results import least, worst

    def extreme(key, pick, fn):
        values = [s[key][pick] if pick else s[key] for s in compared]
        return (worst if fn is max else least)(values)

    failing_grad = [g["name"] for g in layer.get("grad", []) if g["status"] != "pass"]
    return {
        "failing": [s["name"] for s in failing if s["status"] == "fail"] + failing_grad,
        "findings": [f["code"] for f in layer.get("findings", [])],
        "max_abs_err": extreme("max_abs_err", None, max),
        "max_rel_err": extreme("max_rel_err", None, max),
        "q_over_eps": (least(q["min"] for q in _failing_q(compared)), worst(q["max"] for q in _failing_q(compared))),
        "diagnoses": [d["code"] for d in layer["diagnoses"]],
    }


def _failing_q(strata):
    """q/eps of the rows that failed where the report has it, else the strata's range."""
    return [s.get("failing_q_over_eps") or s["q_over_eps"] for s in strata]


def failure_message(layer: dict) -> str:
    from parity_cli.report.terminal import fmt

    s = layer_summary(layer)
    lo, hi = s["q_over_eps"]
    parts = [layer["status"] + (f": strata {', '.join(s['failing'])}" if s["failing"] else "")]
    if s["max_abs_err"] is not None:
        parts.append(f"max abs err {fmt(s['max_abs_err'])}, max rel err {fmt(s['max_rel_err'])}")
    if lo is not None:
        parts.append(f"q/eps {fmt(lo)}..{fmt(hi)}")
    if layer.get("error"):
        parts.append(f"error: {layer['error']}")
    if s["diagnoses"]:
        parts.append(f"diagnoses: {', '.join(s['diagnoses'])}")
    for finding in layer.get("findings", []):
        parts.append(f"{finding['code']}: {finding['message']}")
    return "; ".join(parts)


def junit_classname(report: dict) -> str:
    """parity.<family>.<model_type>: stable from runner to runner (no path in it), and CI tools
    that split a classname on dots get a package tree parity > family > model type."""
    import re

    ckpt = report["checkpoint"]
    parts = [re.sub(r"[^A-Za-z0-9_-]+", "_", str(ckpt.get(k) or "unknown")) for k in ("family", "model_type")]
    return "parity." + ".".join(parts)


def _accepted(gate: dict) -> dict:
    """{layer: its codes} of the layers whose every finding the baseline accepted (none is new)."""
    if gate.get("baseline") is None:
        return {}
    new = {f["layer"] for f in gate.get("new_findings", [])}
    out: dict = {}
    for f in gate["baseline"].get("accepted", []):
        if f["layer"] not in new:
            out.setdefault(f["layer"], [])
            if f["code"] not in out[f["layer"]]:
                out[f["layer"]].append(f["code"])
    return out


def to_junit(report: dict) -> str:
    """One testcase per layer (test history per layer), classname parity.<family>.<model_type>;
    a failure's message is its group's finding, the same words for every layer of the group.
    Strings from the report are data: XML 1.0 has no form for most control characters (an OSC's
    BEL made the file unparseable), so each is written as its escape."""
    from parity_cli.report import grouping
    from parity_cli.report.terminal import group_sentence, quiet_line

    report = printable_tree(report)
    ckpt = report["checkpoint"]
    classname = junit_classname(report)
    summary = report["summary"]
    found = grouping.groups(report)
    extra = [(g, l) for g in found for l in g.layers if l.get("report_level")]  # layers only the copy has
    gate = report.get("gate") or {}
    accepted = _accepted(gate)
    kept = [layer for layer in report["layers"] if layer["status"] != "pass" and layer["name"] not in accepted]
    failed = sum(1 for layer in kept if layer["status"] == "fail")
    errors = len(kept) - failed
    gate_case = gate.get("verdict") == "fail" and not failed + errors + len(extra)
    missed = ckpt.get("unchecked") or []  # norms no layer checked: skipped cases, so the counts say the model's
    tests = summary["layers"] + len(extra) + int(gate_case) + len(missed)
    failures = failed + len(extra) + int(gate_case)
    suites = ET.Element("testsuites", name="parity", tests=str(tests), failures=str(failures), errors=str(errors))
    suite = ET.SubElement(suites, "testsuite", name=classname, tests=str(tests), failures=str(failures),
                          errors=str(errors), skipped=str(len(accepted) + len(missed)))
    props = ET.SubElement(suite, "properties")
    for key, value in (("checkpoint", ckpt["path"]), ("fingerprint", (ckpt.get("fingerprint") or {}).get("sha256", "")),
                       ("eps", report["eps"]["value"]), ("eps_source", report["eps"]["source"]),
                       ("candidate", report["candidate"]["impl"]), ("dtype", report["candidate"]["dtype"]),
                       ("device", report["candidate"]["device"]), ("atol", report["tolerance"]["atol"]),
                       ("rtol", report["tolerance"]["rtol"]), ("strata", ",".join(report["probes"]["strata"]))):
        ET.SubElement(props, "property", name=key, value=str(value))
    universe = grouping.universe(report)
    group_of = {name: g for g in found for name in g.names}
    patterns: dict = {}
    for layer in report["layers"]:
        case = ET.SubElement(suite, "testcase", classname=classname, name=layer["name"])
        if layer["status"] == "pass":
            continue
        g = group_of[layer["name"]]
        if layer["name"] in accepted:  # the gate passed it: a CI reporter must not count it a failure
            ET.SubElement(case, "skipped", message=f"accepted by the baseline {gate['baseline'].get('path') or ''}: "
                          f"{', '.join(accepted[layer['name']])}; {g.text}")
            continue
        tag = "error" if layer["status"] == "error" else "failure"
        node = ET.SubElement(case, tag, message=f"{g.text}; {failure_message(layer)}", type=tag)
        lines = [f"{d['code']}: {d['message']}" for d in layer["diagnoses"]] or [failure_message(layer)]
        if len(g.layers) > 1:
            if id(g) not in patterns:  # once a group: a pattern of n names for each of n layers was n^2
                patterns[id(g)] = grouping.name_pattern(g.names, universe)
            lines.append(f"the same finding in {layer_count(len(g.layers))}: {patterns[id(g)]}")
        node.text = "\n".join(lines)
    for g, layer in extra:
        case = ET.SubElement(suite, "testcase", classname=classname, name=layer["name"])
        finding = layer["findings"][0]
        node = ET.SubElement(case, "failure", message=f"{g.text}; {finding['message']}", type="failure")
        node.text = f"{finding['code']}: {finding['message']}"
    for norm in missed:
        case = ET.SubElement(suite, "testcase", classname=classname, name=norm["name"])
        ET.SubElement(case, "skipped", message=f"not checked: {norm['why']}")
    if gate_case:  # every layer passed, and the gate failed the run (--fail-on warn): CI must not show green
        case = ET.SubElement(suite, "testcase", classname=classname, name="gate")
        ET.SubElement(case, "failure", message=quiet_line(report), type="failure")
    out = ET.SubElement(suite, "system-out")
    out.text = "\n".join([quiet_line(report)] + [group_sentence(g, universe) for g in found])
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _code(text) -> str:
    """A code span inside a table cell: pipes escaped (GFM reads them as the cell's end), no
    backtick to close it early; anything else in a code span is inert."""
    return "`" + printable(text).replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`"


def _cell(text) -> str:
    """Table-cell safe, and inert as Markdown/HTML: a message may hold '<', '*' or '</details>'."""
    text = printable(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for ch in "\\*_`[]|":
        text = text.replace(ch, "\\" + ch)
    return text.replace("\n", " ")


def _text(text) -> str:
    """Running text outside a table: no link, image or HTML from the report's words ('[x](url)',
    '<img>'); underscores and stars stay as they are (config:rms_norm_eps reads as itself)."""
    text = printable(text).replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("[", "\\[").replace("]", "\\]")


def to_markdown(report: dict) -> str:
    """Verdict, context, one table row per group of layers that fail the same way (each
    diagnosis' full message once), then the per-layer rows folded away in <details>. Strings
    from the report reach the file with their control characters escaped."""
    from parity_cli.report import grouping
    from parity_cli.report.gate import verdict
    from parity_cli.report.terminal import captured_line, fmt, share, worst_words

    report = printable_tree(report)
    cand, ref, tol = report["candidate"], report["reference"], report["tolerance"]
    passed, what = verdict(report)
    lines = [
        f"## parity: {'PASS' if passed else 'FAIL'} — {_text(what)}",
        "",
        f"- checkpoint: {_code(report['checkpoint']['path'])} (family {_code(report['checkpoint']['family'])})",
        f"- eps: {grouping.g(report['eps']['value'])} ({_text(report['eps']['source'])})",
        f"- candidate: {_code(cand['impl'])} {_text(cand['dtype'])} on {_text(cand['device'])}, eps {grouping.g(cand['eps'])}",
        f"- reference: {_code(ref['impl'])} {_text(ref['dtype'])} on {_text(ref['device'])}, eps {grouping.g(ref['eps'])}",
        *([f"- vs torch: the worst error over torch eager's at {_text(cand['dtype'])} on the same probes: "
           f"{_text(cand['vs_torch_same_dtype']['words'])} (about 1x: a rounding order; 1000x and more: a kernel "
           "that computes something else)"] if (cand.get("vs_torch_same_dtype") or {}).get("words") else []),
        ("- pass rule: bitwise, cand == ref" if tol.get("exact") else
         f"- pass rule: \\|cand − ref\\| ≤ atol + rtol·\\|ref\\|, atol {fmt(tol['atol'])}, rtol {fmt(tol['rtol'])}")
        + (" + gradients" if report["probes"].get("grad") else ""),
        f"- strata covered: {_text(', '.join(report['probes']['strata']))}"
        + (f" (not covered: {_text(', '.join(report['probes'].get('not_covered', [])))})"
           if report["probes"].get("not_covered") else ""),
    ]
    missed = report["checkpoint"].get("unchecked") or []
    if missed:
        lines.append(f"- not checked: {len(missed)} of {report['summary']['layers'] + len(missed)} norms ("
                     + "; ".join(f"{_code(m['name'])}: {_text(m['why'])}" for m in missed[:5])
                     + (f"; +{len(missed) - 5} more" if len(missed) > 5 else "") + ")")
    conv = cand.get("checkpoint")
    if conv and grouping.runtime_words(conv):
        lines.append(f"- runtime capture: {_code(conv['path'])}, {_text(grouping.runtime_words(conv))}; "
                     f"{_text(conv['findings'])} difference(s) from this checkpoint")
    elif conv:
        by = f"{_text(conv['exporter'])}, " if conv.get("exporter") else ""
        lines.append(f"- candidate checkpoint: {_code(conv['path'])} ({by}{_text(conv['format'])}), "
                     f"eps {grouping.g(conv['eps']['value'])} ({_text(conv['eps']['source'])}), "
                     f"{_text(conv['findings'])} difference(s)")
    lines.append("")
    found = grouping.groups(report)
    universe = grouping.universe(report)
    if found:
        lines += ["| layers | finding | failing strata | q/eps | max abs err | max rel err |",
                  "|---|---|---|---|---|---|"]
        for g in found:
            fig = g.figures()
            lo, hi = fig["q_over_eps"]
            where = _code(g.names[0]) if len(g.layers) == 1 else \
                f"{len(g.layers)}: {_code(grouping.name_pattern(g.names, universe))}"
            if g.new is not None:
                where = ("new: " if g.new else "accepted: ") + where
            lines.append("| " + " | ".join([where] + [_cell(c) for c in (
                g.text, ", ".join(fig["failing"]), "" if lo is None else f"{fmt(lo)}..{fmt(hi)}",
                fmt(fig["max_abs_err"]), fmt(fig["max_rel_err"]))]) + " |")
        lines.append("")
        for g in found:
            rep = g.representative
            for item in rep["diagnoses"] + rep.get("findings", []):
                lines.append(f"- **{_text(item['code'])}** ({len(g.layers)} layer(s)): {_cell(item['message'])}")
            if rep.get("error"):
                lines.append(f"- **error** ({len(g.layers)} layer(s)): {_cell(rep['error'])}")
            if rep.get("conclusion"):
                lines.append(f"- **explain** ({_code(rep['name'])}): {_cell(rep['conclusion']['text'])}")
            w = g.worst_element()
            if w is not None:
                bad, total = g.elements()
                lines.append(f"- **{share(bad, total)}** ({len(g.layers)} layer(s)); "
                             f"{_cell(worst_words(w, tol.get('exact')))}")
            real = captured_line(g.layers)
            if real:
                lines.append(f"- **real rows** ({len(g.layers)} layer(s)): {_cell(real)}")
        bad = [layer for layer in report["layers"] if layer["status"] != "pass"]
        lines += ["", f"<details><summary>Per layer ({len(bad)} not passing)</summary>", "",
                  "| layer | status | failing strata | max abs err | max rel err | vs torch | q/eps | codes |",
                  "|---|---|---|---|---|---|---|---|"]
        for layer in bad:
            sm = layer_summary(layer)
            lo, hi = sm["q_over_eps"]
            lines.append("| " + " | ".join([_code(layer["name"])] + [_cell(c) for c in (
                layer["status"], ", ".join(sm["failing"]),
                fmt(sm["max_abs_err"]), fmt(sm["max_rel_err"]),
                (layer.get("vs_torch_same_dtype") or {}).get("words") or "",
                "" if lo is None else f"{fmt(lo)}..{fmt(hi)}",
                ", ".join(sm["diagnoses"] + [f["code"] for f in layer.get("findings", [])])
                or ("error" if layer.get("error") else ""))]) + " |")
        lines += ["", "</details>", ""]
    else:
        lines += ["All layers within tolerance on every covered stratum.", ""]
    for warning in report.get("warnings", []):
        lines.append(f"> warning: {_cell(warning)}")
    return "\n".join(lines).rstrip() + "\n"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.3g}x"


def runtimes_markdown(data: dict) -> str:
    """`parity runtimes`' table as Markdown: a row a runtime and dtype, what it computes in, the
    verdict, the worst element's distance past its allowance, the worst error over torch eager's at
    the same dtype, and the cause."""
    from parity_cli.report.gate import runtimes_verdict

    data = printable_tree(data)
    word, _, what = runtimes_verdict(data).line().partition(": ")
    lines = [f"# Runtimes for {_code(data['checkpoint'])}", "",
             f"Verdict: **{word}**: {_text(what)} (a failing cell fails it; refused and not installed do not)", "",
             "*vs torch*: the cell's worst error over torch eager's at the same dtype on the same probes "
             "(about 1x: a rounding order; 1000x and more: a kernel that computes something else).", "",
             "| runtime | version | dtype | runs in | verdict | layers failing | worst/allowed | vs torch | cause |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    for c in data["cells"]:
        failing = f"{c['failed']} of {c['layers']}" if c["layers"] else ""
        worst = "non-finite" if c.get("nonfinite") else _ratio(c.get("worst_over_allowed"))
        severity = (c.get("vs_torch_same_dtype") or {}).get("words") or ""
        lines.append(f"| {_cell(c['runtime'])} | {_cell(c.get('runtime_version') or '')} | {c['dtype']} | "
                     f"{_cell(c.get('computes_in') or '')} | {c['verdict']} | {failing} | {worst} | "
                     f"{_cell(severity)} | {_cell(c['cause'])} |")
    return "\n".join(lines) + "\n"
