"""The layer loop: one NormLayer through both sides, compared stratum by stratum, diagnosed.

The parent owns everything the verdict rests on: the stored weight and its statistics, the
probes, the reference outputs, the comparison and the diagnosis. The candidate gets copies
through its runner (in this process for trusted built-ins, a supervised child otherwise) and
hands back values; nothing it does can reach what this module reads."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from parity_cli.errors import InputError
from parity_cli.isolation.runners import CandidateJob, failure


@dataclass
class Batch:
    """One probe set's rows through both sides of one layer, as compared."""

    x: object
    ref: object
    cand: object
    segments: list  # (stratum, first row, end row)
    store: dict  # the probe set's: what diagnosis computes from x alone, for every layer


@dataclass
class Side:
    """One side of the comparison: an implementation at a dtype on a device."""

    impl: object  # implementations.Implementation (the reference; a candidate's name and source)
    spec: str  # as the user wrote it, for messages
    dtype: object  # torch dtype
    device: str
    eps: float | None = None  # None: the layer's own eps
    runner: object = None  # the candidate's: runners.InProcessRunner or supervisor.Supervisor; a plugin
    # reference's: supervisor.RunnerPool (None: the reference runs here)


def weight_stats(weight) -> dict:
    import torch

    w = weight.to(torch.float64)
    finite = w[torch.isfinite(w)]
    return {
        "dtype": str(weight.dtype).removeprefix("torch."),
        "min": float(finite.min()) if finite.numel() else None,
        "max": float(finite.max()) if finite.numel() else None,
        "mean": float(finite.mean()) if finite.numel() else None,
        "nonfinite": int(w.numel() - finite.numel()),
    }


def _every(t, n):
    return None if t is None else t[::n]


def first_head(layer, strata, gain, bias):
    """Diagnosis reasons about one gain vector: for per-head gains (heads, dim) it looks at the
    first head's rows (every head sees the same probes). 1-D layers pass through unchanged."""
    heads = layer.shape[:-1]
    if not heads:
        return strata, gain, bias
    n = 1
    for h in heads:
        n *= h
    first = [dataclasses.replace(s, x=_every(s.x, n), ref=_every(s.ref, n), cand=_every(s.cand, n),
                                 bad=_every(s.bad, n)) for s in strata]
    return first, gain.reshape(-1, layer.dim)[0], None if bias is None else bias.reshape(-1, layer.dim)[0]


def _probe_sets(layer, cand_layer, strata, eps: float, dtype, opts) -> tuple:
    """(the layer's probe sets, its captured real rows in float64 or None, the activation_overflow
    finding where real rows cannot be held in `dtype`): the kind's strata at the candidate dtype, and
    --activations' or a runtime capture's rows as one more set (the rows that overflow left out)."""
    import torch

    from parity_cli.probes.strata import Probe, build_probe_set, probe_set

    if layer.kind == "gated_rms_norm":
        from parity_cli.probes.strata import gated_probe_set

        sets = [gated_probe_set(strata, layer.dim, eps, dtype, opts.seed)]
    elif layer.kind == "group_norm":
        from parity_cli.probes.strata import group_norm_probe_set

        sets = [group_norm_probe_set(strata, layer.dim, layer.groups, layer.spatial, eps, dtype, opts.seed)]
    elif layer.kind == "batch_norm":
        from parity_cli.probes.strata import batch_norm_probe_set

        sets = [batch_norm_probe_set(strata, layer.running_mean, layer.running_var,
                                     layer.gain_offset + layer.weight.to(torch.float64), eps, dtype,
                                     opts.seed)]
    elif strata:
        sets = [build_probe_set(strata, layer.dim, eps, dtype, opts.seed)]
    else:  # --runtime-capture: the rows the runtime saw are the only probes
        sets = []
    real = (getattr(opts, "captured", None) or {}).get(layer.name)
    overflow = None
    if real is not None:  # --activations: real rows, rounded to the candidate dtype like every probe
        # a runtime's rows wider than the dtype it computed in are what it normalised: the reference
        # reads them as recorded (the replay looks its outputs up at the dtype)
        kept = real if cand_layer.recorded_wide else real.to(dtype)
        finite = torch.isfinite(kept).all(-1)  # a row past the dtype's range has no q there
        if not bool(finite.all()):
            overflow = _overflow(layer, real, finite, dtype)
        real = kept[finite].to(torch.float64) if overflow else kept.to(torch.float64)
        if real.shape[0]:
            sets.append(probe_set([Probe(stratum="captured", x=real)]))
        else:
            real = None
    return sets, real, overflow


def _overflow(layer, real, finite, dtype) -> dict:
    """activation_overflow: real rows of the model that the candidate dtype cannot hold. The layer
    cannot run at that dtype on its own traffic: a failure, not rows to leave out."""
    import torch

    name = str(dtype).removeprefix("torch.")
    finite_real = real[torch.isfinite(real)]
    largest = float(finite_real.abs().max()) if finite_real.numel() else math.inf
    limit = float(torch.finfo(dtype).max)
    rows = int((~finite).sum())
    return {"code": "activation_overflow",
            "message": f"{rows} of {real.shape[0]} real row(s) of {layer.name} reach |x| = {largest:.4g}, past "
                       f"{name}'s largest finite value {limit:g}: the model's own activations at this layer cannot "
                       f"be represented in {name}, so it cannot run there as it is",
            "rows": rows, "largest": largest, "limit": limit, "dtype": name}


def _layer_notes(layer, stats: dict, summed: list, summed_over: int, overflow: dict | None, returned_dtypes: set,
                 dtype, eps: float) -> tuple[list, list]:
    """(the layer's warnings, its weight's findings): what the comparison alone does not say."""
    from parity_cli.check.results import weight_faults

    warnings = list(layer.warnings)
    if summed:
        from parity_cli.comparison import summation_units

        n = summed_over
        warnings.append(f"{', '.join(dict.fromkeys(summed))}: rows so ill-conditioned (max|x| / sqrt(var + eps) up to "
                        f"1/sqrt({eps:g})) that the candidate's float32 mean shows its summation order: within the "
                        f"{summation_units(n):g} u a sum of {n} terms may lose, beyond the 4 u of an exact sum")
    weight_findings = weight_faults(layer, stats["nonfinite"]) + ([overflow] if overflow else [])
    wrong_dtype = sorted(returned_dtypes - {str(dtype).removeprefix("torch.")})
    if wrong_dtype:
        warnings.append(f"candidate returned {', '.join(wrong_dtype)} for {str(dtype).removeprefix('torch.')} "
                        "input (compared after upcasting to float64)")
    return warnings, weight_findings


def _diagnoses(layer, results, strata_d, gain_d, bias_d, eps: float, tol, dtype, exact: bool) -> list:
    """The causes of a layer's failures, by its kind's own diagnosis (a bitwise check's in ulps)."""
    from parity_cli.diagnose.causes import bitwise_diagnosis, diagnose

    if layer.kind == "gated_rms_norm":
        from parity_cli.diagnose.gated import diagnose_gated

        return diagnose_gated(layer, results, gain_d, eps, tol, dtype, exact=exact)
    if layer.kind == "group_norm":
        from parity_cli.diagnose.group_norm import diagnose_group_norm

        return diagnose_group_norm(layer, results, gain_d, bias_d, eps, tol, dtype, exact=exact)
    if layer.kind == "batch_norm":
        from parity_cli.diagnose.batch_norm import diagnose_batch_norm

        return diagnose_batch_norm(layer, results, gain_d, bias_d, eps, tol, dtype, exact=exact)
    if exact:  # bitwise mode: the question is how many ulps, not which semantics
        return bitwise_diagnosis(strata_d, dtype, layer, gain_d, tol, bias_d)
    return diagnose(layer, strata_d, gain_d, tol, dtype, bias_d)


def check_layer(layer, reference: Side, candidate: Side, strata, tol, opts, cand_layer=None, grad_tol=None,
                keep_tensors=False, diagnose_failures=True):
    """Probes one layer through both sides. A fault in the reference is the user's input
    (exit 2); a fault in the candidate (raise, hang, crash, garbage) is a finding in the result.

    `cand_layer` is the same layer from --candidate-checkpoint: the candidate then gets that
    checkpoint's weight, eps and conventions while the reference keeps the original's."""
    import torch

    from parity_cli.check.gradients import grad_strata, upstream_for
    from parity_cli.check.results import LayerResult
    from parity_cli.comparison import compare_batch, errored, workspace
    from parity_cli.diagnose.causes import diagnose_grad

    if layer.kind == "batch_norm":  # both sides read the statistics as the candidate's dtype stores them
        layer = _statistics_at(layer, candidate.dtype)
        cand_layer = cand_layer and _statistics_at(cand_layer, candidate.dtype)
    cand_layer = cand_layer or layer
    eps = layer.eps.value
    cand_eps = candidate.eps if candidate.eps is not None else cand_layer.eps.value
    stats = weight_stats(layer.weight)  # before anyone runs: the report states what is stored
    if layer.weightless:
        stats["stored"] = False  # a parameterless norm: checked with a gain of 1
    # Both sides see the weight as the candidate receives it (rounded to its dtype); each gets
    # its own copy, so a scribbling kernel changes nothing the other side or the report reads.
    w_ref = layer.weight.to(candidate.dtype).to(reference.dtype, copy=True)
    b_ref = None if layer.bias is None else layer.bias.to(candidate.dtype).to(reference.dtype, copy=True)

    heads = layer.shape[:-1]  # per-head gains (Cohere q/k norms): every head sees every probe
    per_row = 1
    for h in heads:
        per_row *= h

    def spread(x):
        return x if not heads else x.reshape(x.shape[0], *([1] * len(heads)), x.shape[-1]).expand(
            x.shape[0], *heads, x.shape[-1]).contiguous()

    def rows(y):
        return y if y is None or not heads else y.reshape(-1, y.shape[-1])

    sets, real, overflow = _probe_sets(layer, cand_layer, strata, eps, candidate.dtype, opts)
    probes = [p for ps in sets for p in ps.probes]
    xs = [spread(probe.x) for probe in probes]
    upstream = [upstream_for(opts.seed, probe.stratum, layer.dim, x) for probe, x in zip(probes, xs)] \
        if opts.grad else None
    # The candidate reads the probe set at its dtype, converted once for every layer; whatever
    # could write into an input gets its own copy (runners.execute, or the pipe to its process).
    inputs = [spread(ps.at(candidate.dtype)[lo:hi]) for ps in sets for _, lo, hi in ps.segments]
    job = CandidateJob(
        layer=cand_layer, weight=cand_layer.weight.to(candidate.dtype, copy=True),
        bias=None if cand_layer.bias is None else cand_layer.bias.to(candidate.dtype, copy=True),
        eps=cand_eps, device=candidate.device, inputs=inputs,
        upstream=None if upstream is None else [u.to(candidate.dtype) for u in upstream])
    candidate.runner.submit(job)  # the candidate computes while the reference does, below

    work = workspace()
    ref_grads = None
    if reference.runner is not None:  # a plugin reference, in its own supervised process
        refs, ref_grads = _supervised_reference(sets, reference, layer, w_ref, b_ref, eps, spread, rows, upstream)
    else:
        refs = [_reference_batch(ps, j, reference, layer, w_ref, b_ref, eps, spread, rows, work, keep_tensors)
                for j, ps in enumerate(sets)]
    run = candidate.runner.collect()
    layer_error = run.error

    results, grads, returned_dtypes, summed, summed_over = [], [], set(), [], 0
    k0 = 0
    gain = layer.gain_offset + w_ref.cpu().to(torch.float64)
    # a gain 1 + w may be formed at the candidate's own half dtype (Nemotron's LayerNorm1P adds at the
    # weight's): each element may then be off by |x / sqrt(q + eps)| times that sum's rounding, which
    # a bias can leave large next to |ref| (h (1 + w) + b near 0). Exactly that much is allowed.
    gain_rounding = None
    if layer.gain_offset and not heads and not opts.exact and candidate.dtype in (torch.float16, torch.bfloat16):
        formed = (torch.tensor(layer.gain_offset, dtype=candidate.dtype) + layer.weight.to(candidate.dtype))
        gain_rounding = (formed.to(torch.float64) - gain).abs()
        if not bool(gain_rounding.any()):
            gain_rounding = None
    for j, (ps, ref) in enumerate(zip(sets, refs)):
        dev = ref.device  # the comparison runs where the reference is
        x_rows = rows(spread(ps.on(dev))) if heads else ps.on(dev)
        cand = torch.empty_like(ref) if keep_tensors else work.get(f"cand{j}", ref.shape, device=dev)
        placed, valid = {}, []
        for k, (name, lo, hi) in enumerate(ps.segments):
            out = run.output(k0 + k)
            if out.dtype:
                returned_dtypes.add(out.dtype)
            expected = (*xs[k0 + k].shape[:-1], layer.out_width)  # a gated norm returns x's width, not [x | z]'s
            if out.error:
                placed[k] = errored(name, rows(xs[k0 + k]), eps, layer.kind, out.error)
            elif tuple(out.value.shape) != expected:
                placed[k] = errored(name, rows(xs[k0 + k]), eps, layer.kind,
                                    f"candidate returned shape {list(out.value.shape)}, expected {list(expected)}")
            else:
                cand[lo * per_row:hi * per_row].copy_(rows(out.value))
                valid.append((k, (name, lo * per_row, hi * per_row)))
        extra, summing = None, None
        if layer.kind in ("layer_norm", "group_norm") and tol.mean_rounding:
            extra, summing, summed_over = _mean_allowances(ps.on(dev), gain.to(dev), eps, tol, layer, spread, rows)
        if layer.kind == "gated_rms_norm" and not opts.exact and candidate.dtype in (torch.float16, torch.bfloat16):
            # the gate adds roundings at the half dtype the plain norm does not have (act(z), the product,
            # and in llama order the output rounded before the gate multiplies it): one more unit
            extra = torch.finfo(candidate.dtype).eps * ref.abs()
        if layer.kind == "batch_norm" and not opts.exact:
            from parity_cli.comparison import fold_rounding_allowance

            extra = fold_rounding_allowance(ps.on(dev), layer.running_mean.to(dev), layer.running_var.to(dev),
                                            gain.to(dev), None if b_ref is None else b_ref.to(dev), eps,
                                            candidate.dtype)
        if gain_rounding is not None:
            from parity_cli.backends.implementations import oracle_normalize

            h = oracle_normalize(spread(ps.on(dev)), eps, layer.kind).abs() * gain_rounding.to(dev)
            extra = rows(h) if extra is None else extra + rows(h)
        if layer.kind == "batch_norm":  # the layer's, not the row's
            q = layer.running_var.to(torch.float64).min().expand(ps.x.shape[0])
        elif layer.kind == "group_norm":  # a row's smallest group variance
            q = group_variances(ps.x, layer.groups).amin(-1)
        elif layer.kind == "gated_rms_norm":  # a row's smallest group mean square, the gate's part included
            q = gated_mean_squares(ps.x, layer).amin(-1)
        else:
            q = ps.mean_square(layer.kind)
        if heads:
            q = q.repeat_interleave(per_row)
        compared = compare_batch([seg for _, seg in valid], x_rows, ref, cand, eps, layer.kind, tol,
                                 opts.max_violation_fraction, extra, candidate.dtype, q, work)
        if summing is not None:
            summed += _summation_only(compared, valid, ref, cand, extra - summing, tol)
        if dev.type != "cpu" and (keep_tensors or real is not None or any(r.status != "pass" for r in compared)):
            # diagnosis (and a caller keeping the tensors) reads them on the CPU, with the gain
            x_rows, ref, cand = x_rows.cpu(), ref.cpu(), cand.cpu()
            for result, (_, (_, lo, hi)) in zip(compared, valid):
                result.x, result.ref, result.cand = x_rows[lo:hi], ref[lo:hi], cand[lo:hi]
                result.bad = None if result.bad is None else result.bad.cpu()
        batch = None
        if len(valid) == len(ps.segments) and not heads:  # diagnosis can work on the batch as a whole
            batch = Batch(x_rows, ref, cand, ps.segments, ps.cache.setdefault("fit", {}))
        if layer.kind == "batch_norm":
            for result in compared:
                per_channel_q_over_eps(result, layer.running_var, eps)
        if layer.kind == "group_norm":
            for result in compared:
                per_group_q_over_eps(result, layer.groups, eps)
        if layer.kind == "gated_rms_norm":
            for result in compared:
                per_group_q_over_eps(result, layer.groups, eps, q=gated_mean_squares(result.x, layer))
        for (k, _), result in zip(valid, compared):
            result.shared = ps.probes[k].q  # every layer of this probe set: diagnosis variants are computed once
            result.batch = batch
            placed[k] = result
        results += [placed[k] for k in range(len(ps.segments))]
        k0 += len(ps.segments)
    if opts.grad:
        for k, (probe, x) in enumerate(zip(probes, xs)):
            grads.extend(grad_strata(probe, x, upstream[k], rows, layer, reference, w_ref, b_ref, eps, grad_tol,
                                     run.grad(k), layer_error or run.output(k).error,
                                     ref_grad=None if ref_grads is None else ref_grads[k]))
    warnings, weight_findings = _layer_notes(layer, stats, summed, summed_over, overflow, returned_dtypes,
                                             candidate.dtype, eps)
    result = LayerResult(
        name=layer.name, kind=layer.kind, dim=layer.dim,
        eps={"value": eps, "source": layer.eps.source},
        weight=stats, strata=results, error=layer_error, warnings=warnings, grad=grads,
        shape=list(layer.shape), findings=weight_findings, tower=layer.tower,
    )
    result.setup_error = layer_error if run.setup else None  # read by setup_failure, never written out
    if cand_layer is not layer or candidate.eps is not None:
        result.candidate_eps = {"value": cand_eps, "source": "option:--candidate-eps" if candidate.eps is not None
                                else cand_layer.eps.source}
    bias = None if b_ref is None else b_ref.cpu().to(torch.float64)
    strata_d, gain_d, bias_d = first_head(layer, results, gain, bias)
    if layer.kind == "batch_norm":
        result.statistics = running_summary(layer, eps)
    if diagnose_failures:  # not for the explain ladder's rungs: only their figures are read
        result.diagnoses = _diagnoses(layer, results, strata_d, gain_d, bias_d, eps, tol, candidate.dtype, opts.exact)
    if opts.grad and diagnose_failures:
        result.diagnoses.extend(diagnose_grad(layer, grads, gain if not heads else None, eps))
    if real is not None:
        from parity_cli.probes.capture import captured_summary

        result.captured = captured_summary(layer, strata_d, gain_d, bias_d, eps, tol, result.diagnoses)
    if not keep_tensors:  # the raw tensors served diagnosis; a 126-layer run should not keep them
        for s in results + grads:
            s.x = s.ref = s.cand = s.shared = s.bad = s.batch = None
    return result


def _mean_allowances(x, gain, eps: float, tol, layer, spread, rows):
    """(the LayerNorm/GroupNorm allowance for a mean summed in any order, how much of it goes beyond an
    exact sum's, n): a mean of n terms summed in order may lose (n + 1) u where an exact sum loses 4 u
    (comparison.mean_rounding_allowance); n is a row's (a head's where gains are per head) or a group's."""
    from parity_cli.comparison import mean_rounding_allowance

    if layer.kind == "layer_norm":
        x, g = spread(x), gain
        shape = None
    else:  # a LayerNorm per group: the same conditioning, over a group's channels and positions
        shape = (x.shape[0], -1)
        x = x.reshape(x.shape[0], layer.groups, -1)
        g = gain.repeat_interleave(layer.spatial).reshape(layer.groups, -1)
    full = mean_rounding_allowance(x, g, eps, tol)
    exact = mean_rounding_allowance(x, g, eps, tol, exact_sum=True)
    if shape is not None:
        return full.reshape(shape), (full - exact).reshape(shape), x.shape[-1]
    return rows(full), rows(full - exact), x.shape[-1]


def _summation_only(compared, valid, ref, cand, tight, tol) -> list[str]:
    """The strata that pass only by the summation-order part of the mean allowance: a correct float32
    runtime (a sum in order) there, and what a user should still see, as a warning."""
    import torch

    out = []
    for result, (_, (name, lo, hi)) in zip(compared, valid):
        if result.status != "pass":
            continue
        r, c = ref[lo:hi], cand[lo:hi]
        finite = torch.isfinite(r) & torch.isfinite(c)
        allowed = tol.atol + tol.rtol * r.abs() + tight[lo:hi]
        if bool(((c - r).abs() > allowed)[finite].any()):
            out.append(name)
    return out


def _reference_batch(ps, j, reference: Side, layer, w_ref, b_ref, eps, spread, rows, work, fresh):
    """The reference's outputs for a probe set as one float64 batch (rows, dim). The oracle is
    N(x) * gain (+ bias) on its device, with N(x) computed once per probe set; any other
    reference runs stratum by stratum and comes back to the CPU; a fault in it is the user's."""
    import torch

    normalise = getattr(reference.impl, "normalise", None)
    if normalise is not None and reference.dtype == torch.float64 and layer.kind in ("rms_norm", "layer_norm"):
        dev = reference.device  # a GPU with fast float64 (options.reference_device), or the CPU
        n = ps.normalised(eps, layer.kind, normalise, dev)
        gain = (layer.gain_offset + w_ref).to(dev)
        if gain.dim() > 1:  # per-head gains: every head of a row sees the row
            n = n.reshape(n.shape[0], *([1] * (gain.dim() - 1)), n.shape[-1])
        shape = (n.shape[0] * (gain.numel() // gain.shape[-1]), n.shape[-1])
        out = torch.empty(shape, dtype=torch.float64, device=dev) if fresh else work.get(f"ref{j}", shape, device=dev)
        y = torch.mul(n, gain, out=out.view(n.shape[0], *gain.shape))
        if b_ref is not None:
            y.add_(b_ref.to(dev))
        return out
    try:
        ref_fn = reference.impl.prepare(layer, w_ref.to(reference.device),
                                        None if b_ref is None else b_ref.to(reference.device), eps)
    except Exception as exc:
        raise InputError(failure(f"--reference {reference.spec}: cannot build {layer.name}: ", exc)) from None
    return torch.cat([rows(_reference(ref_fn, spread(p.x), reference, layer, p)) for p in ps.probes])


def _supervised_reference(sets, reference: Side, layer, w_ref, b_ref, eps, spread, rows, upstream):
    """A plugin reference's outputs per probe set (float64, CPU) and, under --grad, its (dx,
    dweight, error) per probe, from its supervised process. Whatever it does there (raise, exit,
    hang, take the memory) ends the run as the user's input: exit 2, never a finding."""
    import torch

    probes = [p for ps in sets for p in ps.probes]
    xs = [spread(p.x) for p in probes]
    job = CandidateJob(layer=layer, weight=w_ref.cpu(), bias=None if b_ref is None else b_ref.cpu(), eps=eps,
                       device=reference.device, inputs=[x.to(reference.dtype) for x in xs],
                       upstream=None if upstream is None else [u.to(reference.dtype) for u in upstream])
    run = reference.runner.run(job)

    def said(text):  # the runner words it for a candidate
        return text.replace("building the candidate failed: ", "").replace("candidate process", "its process")

    if run.error:
        raise InputError(f"--reference {reference.spec}: cannot run {layer.name}: {said(run.error)}")
    outs = []
    for k, (probe, x) in enumerate(zip(probes, xs)):
        out = run.output(k)
        if out.error is None and tuple(out.value.shape) != (*x.shape[:-1], layer.out_width):
            out.error = f"returned shape {list(out.value.shape)} for input {list(x.shape)}"
        if out.error:
            raise InputError(f"--reference {reference.spec} failed on {layer.name}, stratum {probe.stratum}: "
                             f"{said(out.error)}")
        outs.append(rows(out.value))
    refs, k = [], 0
    for ps in sets:
        refs.append(torch.cat(outs[k:k + len(ps.probes)]))
        k += len(ps.probes)
    return refs, None if upstream is None else [run.grad(k) for k in range(len(probes))]


def _reference(ref_fn, x, reference: Side, layer, probe):
    """The reference's output as float64 on the CPU; any fault in it is the user's input."""
    import torch

    try:
        with torch.no_grad():
            y = ref_fn(x.to(device=reference.device, dtype=reference.dtype, copy=True))
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"returned {type(y).__name__}, not a tensor")
        if tuple(y.shape) != (*x.shape[:-1], layer.out_width):
            raise TypeError(f"returned shape {list(y.shape)} for input {list(x.shape)}")
        return y.detach().to("cpu", torch.float64)
    except Exception as exc:
        raise InputError(failure(f"--reference {reference.spec} failed on {layer.name}, "
                                 f"stratum {probe.stratum}: ", exc)) from None


def _statistics_at(layer, dtype):
    """The layer with its running statistics rounded to `dtype` (kept at their stored dtype): what
    a model cast to that dtype holds in its buffers, and so what both sides normalise with."""
    import torch

    def rounded(t):
        return t.to(dtype).to(t.dtype) if t.dtype != torch.float64 or dtype != torch.float64 else t

    return dataclasses.replace(layer, running_mean=rounded(layer.running_mean), running_var=rounded(layer.running_var))


def per_channel_q_over_eps(result, running_var, eps: float) -> None:
    """A BatchNorm's q/eps is running_var / eps per channel, whatever the input: the stratum's range
    is the layer's, its failing range that of the channels where an element failed."""
    import torch

    from parity_cli.comparison import attenuation

    ratio = running_var.to(torch.float64) / eps if eps > 0 else torch.where(
        running_var > 0, torch.full_like(running_var, float("inf"), dtype=torch.float64), 0.0)
    lo, hi = float(ratio.min()), float(ratio.max())
    result.q_over_eps = (lo, hi)
    result.attenuation = (attenuation(lo), attenuation(hi))
    if result.bad is not None and bool(result.bad.any()):
        failing = ratio[result.bad.reshape(-1, ratio.shape[-1]).any(0).to(ratio.device)]
        result.failing_q_over_eps = (float(failing.min()), float(failing.max()))
    result.row_q_over_eps = [lo] * result.vectors


def group_variances(x, groups: int):
    """Each row's variance per group (float64, rows x groups): a GroupNorm's q."""
    from parity_cli.backends.implementations import mean_square

    n = x.shape[0]
    return mean_square(x.reshape(n, groups, -1), "layer_norm")


def gated_mean_squares(x2, layer):
    """A gated norm's q per (row, group): the mean square of what its statistic sees, x * act(z)
    for a gate before it, x for a gate after."""
    from parity_cli.backends.implementations import gate_activation, mean_square, split_gate

    x, z = split_gate(x2, layer)
    h = x * gate_activation(layer.activation, z) if layer.gate == "before" else x
    return mean_square(h.reshape(h.shape[0], layer.groups, -1), "rms_norm")


def per_group_q_over_eps(result, groups: int, eps: float, q=None) -> None:
    """A GroupNorm's q is each group's variance: the stratum's q/eps range runs over every (row,
    group), its failing range over the groups holding a failing element."""
    import torch

    from parity_cli.comparison import attenuation

    if result.x is None:
        return
    q = group_variances(result.x, groups) if q is None else q
    ratio = q / eps if eps > 0 else torch.where(q > 0, torch.full_like(q, float("inf")), q)
    lo, hi = float(ratio.min()), float(ratio.max())
    result.q_over_eps = (lo, hi)
    result.attenuation = (attenuation(lo), attenuation(hi))
    if result.bad is not None and bool(result.bad.any()):
        failing = ratio[result.bad.reshape(result.bad.shape[0], groups, -1).any(-1).to(ratio.device)]
        result.failing_q_over_eps = (float(failing.min()), float(failing.max()))
    result.row_q_over_eps = ratio.amin(-1).tolist()


def running_summary(layer, eps: float) -> dict:
    """Per BatchNorm, what its checkpoint says of eps: the smallest running_var / eps and its
    channel (where a wrong eps shows first, as a tiny row does for an RMSNorm), and how many
    channels have running_var / eps under 49.25 (eps attenuates them by more than 1 %)."""
    import torch

    var = layer.running_var.to(torch.float64)
    channel = int(torch.argmin(var))
    smallest = float(var[channel])
    ratio = smallest / eps if eps > 0 else (float("inf") if smallest > 0 else 0.0)
    below = int((var < 49.2512562814 * eps).sum()) if eps > 0 else 0
    return {"running_var_over_eps": {"min": ratio, "channel": channel, "running_var": smallest},
            "channels_attenuated_over_1pct": below, "channels": int(var.numel())}


SETUP_PREFIX = "building the candidate failed: InputError: "


def setup_failure(results, spec: str) -> str | None:
    """The one line of a setup error, or None. Every checked layer failed to build its candidate
    with InputError (the implementation saying its input is at fault: no kernel for the dtype, an
    argument it cannot take) and the same message, layer names and numbers aside, so no output
    exists anywhere: that is the run's input, not 61 parity failures. A candidate whose build
    or forward call raises anything else stays a finding on every layer."""
    import re

    checked = [r for r in results if r.strata or r.error]  # a layer missing from a converted copy was not
    errors = [getattr(r, "setup_error", None) for r in checked]
    if not checked or not all(errors):
        return None

    def shape(r, text):
        return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", text.replace(r.name, "<layer>"))

    if len({shape(r, e) for r, e in zip(checked, errors)}) != 1:
        return None
    text = errors[0].removeprefix(SETUP_PREFIX)
    layers = f"all {len(checked)} layers" if len(checked) > 1 else "its only layer"
    who = "--candidate " + (text if text.startswith(f"{spec}: ") else f"{spec}: {text}")
    return f"{who} (the same on {layers}, before any output)"


def missing_layer(layer):
    """A layer the --candidate-checkpoint lacks: nothing to probe, the pairing's findings say why."""
    from parity_cli.check.results import LayerResult

    return LayerResult(name=layer.name, kind=layer.kind, dim=layer.dim,
                       eps={"value": layer.eps.value, "source": layer.eps.source},
                       weight=weight_stats(layer.weight), strata=[], shape=list(layer.shape), tower=layer.tower)


def at_node_dtype(other, candidate: Side, tol, grad_tol, opts):
    """A copy's node that computes in a narrower dtype than the probes (a mixed-precision
    converter's float16 LayerNormalization inside a float32 graph) is judged at its own dtype: its
    input is rounded there before the node sees it, and float32's allowance would fail what
    float16 computes correctly. (side, tol, grad_tol, (dtype, words) or None)."""
    import torch

    from parity_cli.comparison import grad_tolerance_for, tolerance_for

    node = getattr(torch, getattr(other, "computes_in", None) or "", None)
    if (not isinstance(node, torch.dtype) or not node.is_floating_point or opts.exact
            or torch.finfo(node).eps <= torch.finfo(candidate.dtype).eps):
        return candidate, tol, grad_tol, None
    name, probes = str(node).removeprefix("torch."), str(candidate.dtype).removeprefix("torch.")
    words = (f"judged at {name}: the copy's node computes in {name} inside a {probes} graph, so its input is "
             f"rounded to {name} before it and {name}'s allowance applies")
    tol_at = tol if tol.source == "option" else tolerance_for(name, opts.atol, opts.rtol)
    return (dataclasses.replace(candidate, dtype=node), tol_at,
            grad_tol and grad_tolerance_for(name), (name, words))


def run_layers(layers, pairing, reference: Side, candidates: list[Side], strata, tol, opts, grad_tol,
               progress=None):
    """Every layer, in order. With several candidate sides (--jobs N: N supervised children),
    layers go to whichever is free; the parent's work for a layer runs in that side's thread."""

    def one(layer, candidate):
        if pairing is None:
            return check_layer(layer, reference, candidate, strata, tol, opts, grad_tol=grad_tol)
        other = pairing.candidate_layers.get(layer.name)
        if other is None:
            result = missing_layer(layer)
        else:
            side, tol_at, grad_at, note = at_node_dtype(other, candidate, tol, grad_tol, opts)
            result = check_layer(layer, reference, side, strata, tol_at, opts, cand_layer=other, grad_tol=grad_at)
            if note:
                result.judged_at, result.warnings = note[0], [note[1], *result.warnings]
        result.findings = result.findings + pairing.layer_findings.get(layer.name, [])
        if other is not None and other.recorded is not None and (not result.passed or result.findings):
            from parity_cli.diagnose.recorded import recorded_diagnoses

            result.diagnoses = recorded_diagnoses(layer, other, result.diagnoses, result.findings, tol,
                                                  candidate.impl.description)
        elif not result.passed or result.findings:
            from parity_cli.diagnose.causes import with_copy_eps

            result.diagnoses = with_copy_eps(result.diagnoses, result.findings, layer)
        return result

    if len(candidates) == 1 or len(layers) == 1:
        results = []
        for k, layer in enumerate(layers):
            if progress is not None:
                progress(k, len(layers), layer.name)
            results.append(one(layer, candidates[0]))
        return results
    return _threaded(layers, candidates, one, progress, reference.runner)


def _threaded(layers, candidates, one, progress, reference_runner=None):
    import queue
    import threading

    todo: queue.Queue = queue.Queue()
    for k, layer in enumerate(layers):
        todo.put((k, layer))
    done: dict = {}
    failed: list = []
    stop = threading.Event()

    def work(candidate):
        while not stop.is_set():
            try:
                k, layer = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done[k] = one(layer, candidate)
            except BaseException as exc:  # an InputError from the reference: the whole run stops
                failed.append(exc)
                stop.set()
                return

    threads = [threading.Thread(target=work, args=(c,), daemon=True, name=f"parity-layers-{i}")
               for i, c in enumerate(candidates)]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.1)
            if progress is not None:
                progress(len(done), len(layers), f"{len(done)} layers")
    except BaseException:
        # Ctrl-C / SIGTERM: no new layer starts, the children die (their readers see EOF), and
        # every thread is joined before the exit, so no torch call is cut off by the shutdown
        import time

        stop.set()
        for candidate in candidates:
            candidate.runner.stop()
        if reference_runner is not None:
            reference_runner.stop()
        deadline = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        raise
    if failed:
        raise failed[0]
    return [done[k] for k in range(len(layers))]
