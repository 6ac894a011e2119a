"""Other renderings of the JSON report for the tools CI already has: JUnit XML, Markdown.

Everything here reads the report dict only, so `parity report` can re-render a saved file."""

from __future__ import annotations

import xml.etree.ElementTree as ET


def _num(value) -> str:
    from parity_cli.report import unjfloat

    value = unjfloat(value)
    return "0" if value == 0 else f"{value:.3g}"


def layer_summary(layer: dict) -> dict:
    """Failing strata, worst errors, q/eps range of the failing probes, diagnosis codes."""
    strata = layer["strata"]
    failing = [s for s in strata if s["status"] != "pass"]
    compared = [s for s in (failing or strata) if s["status"] != "error"]

    from parity_cli.report import least, worst

    def extreme(key, pick, fn):
        values = [s[key][pick] if pick else s[key] for s in compared]
        return (worst if fn is max else least)(values)

    failing_grad = [g["name"] for g in layer.get("grad", []) if g["status"] != "pass"]
    return {
        "failing": [s["name"] for s in failing] + failing_grad + [f["code"] for f in layer.get("findings", [])],
        "max_abs_err": extreme("max_abs_err", None, max),
        "max_rel_err": extreme("max_rel_err", None, max),
        "q_over_eps": (least(q["min"] for q in _failing_q(compared)), worst(q["max"] for q in _failing_q(compared))),
        "diagnoses": [d["code"] for d in layer["diagnoses"]],
    }


def _failing_q(strata):
    """q/eps of the rows that failed where the report has it, else the strata's range."""
    return [s.get("failing_q_over_eps") or s["q_over_eps"] for s in strata]


def failure_message(layer: dict) -> str:
    s = layer_summary(layer)
    lo, hi = s["q_over_eps"]
    parts = [f"{layer['status']}: strata {', '.join(s['failing'])}"]
    if s["max_abs_err"] is not None:
        parts.append(f"max abs err {_num(s['max_abs_err'])}, max rel err {_num(s['max_rel_err'])}")
    if lo is not None:
        parts.append(f"q/eps {_num(lo)}..{_num(hi)}")
    if layer.get("error"):
        parts.append(f"error: {layer['error']}")
    if s["diagnoses"]:
        parts.append(f"diagnoses: {', '.join(s['diagnoses'])}")
    for finding in layer.get("findings", []):
        parts.append(f"{finding['code']}: {finding['message']}")
    return "; ".join(parts)


def to_junit(report: dict) -> str:
    """One testcase per layer; classname = checkpoint and family, so reporters group by model."""
    ckpt = report["checkpoint"]
    classname = f"{ckpt['path']}.{ckpt['family']}"
    summary = report["summary"]
    suites = ET.Element("testsuites", name="parity", tests=str(summary["layers"]),
                        failures=str(summary["failed"]), errors=str(summary["errors"]))
    suite = ET.SubElement(suites, "testsuite", name=f"parity {ckpt['path']} ({ckpt['family']})",
                          tests=str(summary["layers"]), failures=str(summary["failed"]),
                          errors=str(summary["errors"]), skipped="0")
    props = ET.SubElement(suite, "properties")
    for key, value in (("eps", report["eps"]["value"]), ("eps_source", report["eps"]["source"]),
                       ("candidate", report["candidate"]["impl"]), ("dtype", report["candidate"]["dtype"]),
                       ("device", report["candidate"]["device"]), ("atol", report["tolerance"]["atol"]),
                       ("rtol", report["tolerance"]["rtol"]), ("strata", ",".join(report["probes"]["strata"]))):
        ET.SubElement(props, "property", name=key, value=str(value))
    for layer in report["layers"]:
        case = ET.SubElement(suite, "testcase", classname=classname, name=layer["name"])
        if layer["status"] == "pass":
            continue
        tag = "error" if layer["status"] == "error" else "failure"
        node = ET.SubElement(case, tag, message=failure_message(layer), type=tag)
        node.text = "\n".join(f"{d['code']}: {d['message']}" for d in layer["diagnoses"]) or failure_message(layer)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict) -> str:
    s, cand, ref, tol = report["summary"], report["candidate"], report["reference"], report["tolerance"]
    verdict = "PASS" if s["verdict"] == "pass" else "FAIL"
    lines = [
        f"## parity: {verdict} — {s['passed']}/{s['layers']} layers pass",
        "",
        f"- checkpoint: `{report['checkpoint']['path']}` (family `{report['checkpoint']['family']}`)",
        f"- eps: {report['eps']['value']:g} ({report['eps']['source']})",
        f"- candidate: `{cand['impl']}` {cand['dtype']} on {cand['device']}, eps {cand['eps']:g}",
        f"- reference: `{ref['impl']}` {ref['dtype']} on {ref['device']}, eps {ref['eps']:g}",
        f"- tolerance: atol {tol['atol']:g}, rtol {tol['rtol']:g}" + (" (bitwise)" if tol.get("exact") else "")
        + (" + gradients" if report["probes"].get("grad") else ""),
        f"- strata covered: {', '.join(report['probes']['strata'])}"
        + (f" (not covered: {', '.join(report['probes'].get('not_covered', []))})"
           if report["probes"].get("not_covered") else ""),
        "",
    ]
    bad = [layer for layer in report["layers"] if layer["status"] != "pass"]
    if bad:
        lines += ["| layer | status | failing strata | max abs err | max rel err | q/eps | diagnoses |",
                  "|---|---|---|---|---|---|---|"]
        for layer in bad:
            sm = layer_summary(layer)
            lo, hi = sm["q_over_eps"]
            diag = "; ".join([f"{d['code']}: {d['message']}" for d in layer["diagnoses"]]
                             + [f"{f['code']}: {f['message']}" for f in layer.get("findings", [])]) or (layer.get("error") or "")
            lines.append("| " + " | ".join(_cell(c) for c in (
                f"`{layer['name']}`", layer["status"], ", ".join(sm["failing"]),
                "" if sm["max_abs_err"] is None else _num(sm["max_abs_err"]),
                "" if sm["max_rel_err"] is None else _num(sm["max_rel_err"]),
                "" if lo is None else f"{_num(lo)}..{_num(hi)}", diag)) + " |")
        lines.append("")
    else:
        lines += ["All layers within tolerance on every covered stratum.", ""]
    conv = cand.get("checkpoint")
    if conv:
        lines.insert(6, f"- candidate checkpoint: `{conv['path']}` ({conv['format']}), eps {conv['eps']['value']:g} "
                        f"({conv['eps']['source']}), {conv['findings']} difference(s)")
    for finding in report.get("findings", []):
        lines.append(f"> {finding['code']}: {_cell(finding['message'])}")
    for warning in report.get("warnings", []):
        lines.append(f"> warning: {_cell(warning)}")
    return "\n".join(lines).rstrip() + "\n"
