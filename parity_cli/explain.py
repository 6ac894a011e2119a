"""The explain ladder: for a failing layer, change one factor at a time (dtype, kernel, eps)
and see which change makes the error collapse. Each rung is a full layer check."""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path

from parity_cli.errors import InputError


def _step(label: str, factor: str, result) -> dict:
    finite = [s for s in result.strata if s.status != "error"]
    return {
        "step": label,
        "changes": factor,
        "status": result.status,
        "error": result.error or next((f"{s.name}: {s.error}" for s in result.strata if s.error), None),
        "max_abs_err": max((s.max_abs_err for s in finite), default=None),
        "max_rel_err": max((s.max_rel_err for s in finite), default=None),
        "failing": [s.name for s in result.strata if s.status != "pass"],
    }


def _skipped(label: str, factor: str, why: str) -> dict:
    return {"step": label, "changes": factor, "status": "skipped", "error": why, "max_abs_err": None,
            "max_rel_err": None, "failing": []}


def explain(path: str | Path, opts, layer_names: list[str] | None = None) -> dict:
    """The one-factor-at-a-time ladder for each failing layer (or the named ones): the check as
    run, then the candidate at the reference dtype, the family's own numerics at the candidate
    dtype, and the reference with the eps the candidate appears to use. The step whose errors
    collapse names the factor that carries them."""
    import torch

    from parity_cli import options, pipeline
    from parity_cli.backends import implementations as impls
    from parity_cli.check.layer import Side, check_layer, first_head
    from parity_cli.comparison import tolerance_for
    from parity_cli.diagnose.causes import Context, estimate_eps
    from parity_cli.isolation.runners import InProcessRunner
    from parity_cli.isolation.supervisor import close_runners, open_runners, parse_memory, timeout_of
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load
    from parity_cli.probes.strata import select_strata
    from parity_cli.report.terminal import fmt
    from parity_cli.sources.tensors import Eps

    opts = dataclasses.replace(pipeline.effective(opts), grad=False)
    if layer_names:  # the caller has the report already (check --explain, parity explain REPORT.json)
        wanted = set(layer_names)
    else:
        wanted = {l.name for l in pipeline.check(path, opts).layers if not l.passed}
        if not wanted:
            return {}
    ckpt, fam, eps = load(path, opts.family, opts.eps, classes=options.uses_transformers(opts))
    found = {l.name: l for l in discover_layers(ckpt, fam, eps).layers}
    unknown = sorted(wanted - set(found))
    if unknown:
        raise InputError(f"explain: no layer named {', '.join(unknown)} in {ckpt.path}")
    strata = select_strata(opts.strata)
    copies, copy_dtype = None, None  # --candidate-checkpoint: the candidate keeps the copy's weights and eps
    if opts.candidate_checkpoint:
        from parity_cli.model.pairing import pair

        copy_layers, _, copy_dtype = pipeline.converted(opts, list(found.values()))
        copies = pair(list(found.values()), copy_layers, opts.candidate_checkpoint).candidate_layers
    # the candidate dtype exactly as check() chooses it
    checked_layers = [l for n, l in found.items() if not opts.layers or fnmatch.fnmatchcase(n, opts.layers)]
    opts, _ = pipeline.with_captured(opts, checked_layers, lambda: list(found.values()), fam)  # the check's real rows too
    cand_dtype_name = options.dtype_name(opts.dtype) if opts.dtype else (copy_dtype or options.stored_dtype(checked_layers))
    cand_dtype = getattr(torch, cand_dtype_name)
    ref_dtype = getattr(torch, options.reference_dtype_for(opts, cand_dtype_name)[0])  # as check() resolves it
    reference = Side(impls.resolve(opts.reference), opts.reference, ref_dtype, options.reference_device(opts.reference_device, opts.device, options.is_oracle(opts)))
    device = options.check_device(opts.device)
    tol = tolerance_for(cand_dtype_name, opts.atol, opts.rtol, exact=opts.exact)
    cand_impl, runners = open_runners(opts.candidate, options.candidate_args(opts), device, opts.isolation,
                                      timeout_of(opts), parse_memory(opts.candidate_memory))
    own_runner = InProcessRunner(impls.resolve("hf"))

    def cand(dtype, eps_value=opts.candidate_eps):
        return Side(cand_impl, opts.candidate, dtype, device, eps_value, runners[0])

    out = {}
    try:
        for name in [n for n in found if n in wanted]:  # discovery (table) order
            layer = found[name]
            other = None if copies is None else copies.get(name)
            if copies is not None and other is None:
                out[name] = [_skipped("candidate checkpoint", "nothing", "the layer is missing from the candidate checkpoint")]
                continue
            steps = []
            # kept tensors: the same run also gives the rows the eps is estimated from (step 3)
            checked = check_layer(layer, reference, cand(cand_dtype), strata, tol, opts, cand_layer=other,
                                  keep_tensors=True)
            steps.append(_step(f"candidate at {cand_dtype_name} (as checked)", "nothing", checked))
            # 1. the candidate at the reference's dtype: does the error belong to the dtype?
            ref_dtype_name = str(ref_dtype).removeprefix("torch.")
            if ref_dtype == cand_dtype:  # --exact against an implementation, or --reference-dtype: nothing to change
                steps.append(_skipped(f"candidate at {ref_dtype_name}", "dtype",
                                      "the reference already runs at the candidate's dtype"))
            elif other is not None and other.program:
                steps.append(_skipped(f"candidate at {ref_dtype_name}", "dtype",
                                      "an exported graph computes in the dtype it was exported at"))
            else:
                steps.append(_step(f"candidate at {ref_dtype_name}", "dtype",
                                   check_layer(layer, reference, cand(ref_dtype), strata,
                                               tolerance_for(ref_dtype_name), opts, cand_layer=other,
                                               diagnose_failures=False)))
            # 2. the family's own numerics at the candidate dtype: the floor that dtype imposes
            own = Side(own_runner.impl, "hf", cand_dtype, "cpu", opts.candidate_eps, own_runner)
            steps.append(_step(f"{layer.family} numerics (hf) at {cand_dtype_name}", "kernel",
                               check_layer(layer, reference, own, strata, tol, opts, cand_layer=other,
                                           diagnose_failures=False)))
            # 3. the reference with the eps the candidate appears to use
            gain = layer.gain_offset + layer.weight.to(cand_dtype).double()
            bias = None if layer.bias is None else layer.bias.to(cand_dtype).double()
            kept, gain, bias = first_head(layer, checked.strata, gain, bias)
            # the diagnosis' joint fit (eps given the fitted gain) when it found one: the ladder and
            # the report then name the same eps; else the estimate with the expected gain
            fitted = next((d.evidence.get("estimated_eps") for d in checked.diagnoses if d.code == "eps_mismatch"), None)
            est = (fitted, 0.0) if fitted else estimate_eps(
                Context(layer=layer, gain=gain, bias=bias, tol=tol, dtype=cand_dtype, strata=kept))
            if est is not None and est[0] > 0:
                shifted = dataclasses.replace(layer, eps=Eps(est[0], "estimated from the candidate"))
                keep = cand(cand_dtype, opts.candidate_eps if opts.candidate_eps is not None else (other or layer).eps.value)
                steps.append(_step(f"reference with eps {fmt(est[0])} (estimated)", "eps",
                                   check_layer(shifted, reference, keep, strata, tol, opts, cand_layer=other,
                                               diagnose_failures=False)))
            else:
                steps.append(_skipped("reference with the candidate's eps", "eps",
                                      "no eps could be estimated (the tiny and constant strata show none)"))
            out[name] = steps
    finally:
        close_runners(runners)
    return out


# --- one ladder per group of layers that fail the same way ---------------------------------------

VERDICTS = {  # the most specific factor first: eps, then dtype, then the kernel
    "eps": "eps carries the error: the reference with the candidate's eps matches it",
    "dtype": "the dtype carries the error: the candidate passes at the reference dtype (precision, overflow)",
    "kernel": ("the candidate's math differs: the family's own numerics pass at the same dtype and eps "
               "(placement, offset, upcast, gain)"),
}


def conclude(steps: list[dict]) -> dict:
    """The factor whose change alone removes the error, with what is left after changing it;
    or, when none does, the change that comes closest and what it leaves."""
    from parity_cli.report.terminal import fmt

    def residual(st):
        return {"status": st["status"], "max_abs_err": st["max_abs_err"], "max_rel_err": st["max_rel_err"],
                "failing": st["failing"]}

    first = steps[0]
    if first["status"] == "pass":
        return {"factor": None, "residual": residual(first), "text": "the layer passes as checked: nothing to explain"}
    if first["status"] == "error" or first["max_rel_err"] is None:
        return {"factor": None, "residual": residual(first),
                "text": f"the candidate does not run: {first.get('error') or 'no output'}"}
    rungs = [st for st in steps[1:] if st["status"] in ("pass", "fail")]
    for factor in VERDICTS:
        st = next((s for s in rungs if s["changes"] == factor and s["status"] == "pass"), None)
        if st:
            return {"factor": factor, "step": st["step"], "residual": residual(st),
                    "text": f"{VERDICTS[factor]} (max rel err {fmt(first['max_rel_err'])} -> "
                            f"{fmt(st['max_rel_err'])}, within tolerance)"}
    scored = [s for s in rungs if s["max_rel_err"] is not None]
    best = min(scored, key=lambda s: s["max_rel_err"]) if scored else None
    if best is None or not best["max_rel_err"] < 0.5 * first["max_rel_err"]:
        return {"factor": None, "residual": residual(first),
                "text": "no single change of dtype, kernel or eps reduces the error: several faults, or one "
                        "outside them (compare the worst elements)"}
    return {"factor": None, "closest": best["changes"], "step": best["step"], "residual": residual(best),
            "text": f"no single factor removes the error (several faults, or one outside dtype/eps/kernel); "
                    f"changing {best['changes']} comes closest: max rel err {fmt(first['max_rel_err'])} -> "
                    f"{fmt(best['max_rel_err'])}, still failing {', '.join(best['failing']) or '-'}"}


def _from_findings(layer: dict, conclusion: dict | None) -> dict | None:
    """A converted copy whose eps or gains differ: the copy is what to fix, whatever the ladder
    (its rungs keep the copy's weights, so no rung removes an error that is in them)."""
    findings = layer.get("findings", [])
    if not findings or (conclusion and conclusion.get("factor")):
        return conclusion
    from parity_cli.report.grouping import short

    what = "; ".join(short(f) for f in findings)
    return {"factor": "checkpoint", "residual": (conclusion or {}).get("residual"),
            "text": f"the candidate checkpoint differs from the reference: {what}"}


def explain_groups(path, opts, report: dict, layer_names: list[str] | None = None) -> dict:
    """The ladder for one representative layer of each group (grouping.groups): layers that fail
    the same way share its conclusion, and a 109-layer failure costs a handful of ladders.
    Returns {"groups": [...], "layers": {name: conclusion}}; layers without strata (the
    candidate never ran, or only the checkpoints differ) have no ladder."""
    from parity_cli.report import grouping

    wanted = set(layer_names) if layer_names else None
    if wanted:
        known = {l["name"] for l in report["layers"]}
        unknown = sorted(wanted - known)
        if unknown:
            raise InputError(f"explain: no layer named {', '.join(unknown)} in the report")
    # a passing layer named on the command line gets a ladder of its own
    view = dict(report, findings=[],
                layers=[dict(l, status="fail") if l["status"] == "pass" else l for l in report["layers"]
                        if (l["status"] != "pass" or wanted) and (wanted is None or l["name"] in wanted)])
    found = grouping.groups(view)
    runnable = [g.representative["name"] for g in found if g.representative["strata"]]
    ladders = explain(path, opts, runnable) if runnable else {}
    out = {"groups": [], "layers": {}}
    for g in found:
        rep = g.representative["name"]
        steps = ladders.get(rep, [])
        conclusion = _from_findings(g.representative, conclude(steps) if steps else None)
        out["groups"].append({"representative": rep, "layers": g.names, "finding": g.text, "steps": steps,
                              "conclusion": conclusion})
        for name in g.names:
            if conclusion is not None:
                out["layers"][name] = dict(conclusion, explained_by=rep)
    return out
