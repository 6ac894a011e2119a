"""--grad: backward parity. dx and dweight of the candidate (computed wherever it runs, see
runners.autograd) against the reference's float64 autograd, compared like outputs."""

from __future__ import annotations

from parity_cli.errors import InputError
from parity_cli.isolation.runners import CandidateJob, autograd, failure


def upstream_for(seed: int, stratum: str, dim: int, x):
    """The upstream gradient of one stratum: seeded by (seed, stratum, dim), so reruns agree."""
    from zlib import crc32

    import torch

    gen = torch.Generator().manual_seed(crc32(f"{seed}:grad:{stratum}:{dim}".encode()))
    return torch.randn(x.shape, generator=gen, dtype=torch.float64)


def grad_strata(probe, x, upstream, rows, layer, reference, w_ref, b_ref, eps, grad_tol, cand_grad,
                forward_error, ref_grad=None):
    """The "<stratum>:dx" and "<stratum>:dweight" results of one stratum. `cand_grad` is the
    candidate's (dx, dweight, error) from its runner; `ref_grad` the same from a supervised
    plugin reference (None: the reference's autograd runs here)."""
    import torch

    from parity_cli.comparison import compare, errored

    name_dx, name_dw = f"{probe.stratum}:dx", f"{probe.stratum}:dweight"
    job = CandidateJob(layer=layer, weight=w_ref, bias=b_ref, eps=eps, device=reference.device, inputs=[])
    if ref_grad is not None:
        dx_ref, dw_ref, err = ref_grad
        if err:
            raise InputError(f"--reference {reference.spec} is not differentiable on {layer.name}: "
                             f"{err.replace('candidate process', 'its process')}")
    else:
        try:
            dx_ref, dw_ref = autograd(reference.impl, job, x.to(reference.dtype).to(reference.device),
                                      upstream.to(reference.dtype).to(reference.device))
        except Exception as exc:
            raise InputError(failure(f"--reference {reference.spec} is not differentiable on {layer.name}: ",
                                     exc)) from None
    dx_ref = dx_ref.to(torch.float64)
    dw_ref = None if dw_ref is None else dw_ref.to(torch.float64)
    if forward_error:
        return [errored(name_dx, rows(x), eps, layer.kind, forward_error)]
    dx_c, dw_c, err = cand_grad
    if err:
        return [errored(name_dx, rows(x), eps, layer.kind, err if err.startswith("backward") else f"backward: {err}")]
    if tuple(dx_c.shape) != tuple(dx_ref.shape):
        return [errored(name_dx, rows(x), eps, layer.kind, f"dx has shape {list(dx_c.shape)}, expected {list(dx_ref.shape)}")]
    out = []
    dx_ref = rows(dx_ref.cpu())
    out.append(compare(name_dx, rows(x), dx_ref, rows(dx_c), eps, layer.kind, grad_tol, 0.0,
                       grad_tol.row_atol * dx_ref.abs().amax(-1, keepdim=True)))
    if dw_ref is not None:
        dw_ref = dw_ref.cpu().reshape(1, -1)
        if dw_c is None:
            out.append(errored(name_dw, rows(x)[:1], eps, layer.kind, "no gradient reached the weight"))
        elif dw_c.numel() != dw_ref.numel():
            out.append(errored(name_dw, rows(x)[:1], eps, layer.kind,
                               f"dweight has shape {list(dw_c.shape)}, expected {list(w_ref.shape)}"))
        else:
            # One "row": the weight's gradient, summed over every probe of the stratum.
            xr = rows(x)[:1] if dw_ref.shape[-1] == layer.dim else torch.ones_like(dw_ref)
            extra = grad_tol.row_atol * dw_ref.abs().amax(-1, keepdim=True)
            if layer.kind == "layer_norm" and grad_tol.mean_rounding:
                # dweight sums g * x̂ over rows, and x̂ carries the mean's rounding (tolerances.toml)
                xs = x.to(torch.float64)
                cond = xs.abs().amax(-1, keepdim=True) / torch.sqrt(xs.var(-1, unbiased=False, keepdim=True) + eps)
                extra = extra + grad_tol.mean_rounding * (upstream.abs() * cond).reshape(-1, *layer.shape).sum(0).reshape(1, -1)
            out.append(compare(name_dw, xr, dw_ref, dw_c.reshape(1, -1), eps, layer.kind, grad_tol, 0.0, extra))
    return out
