"""How a check spreads over the machine: how many workers, how many threads each.

Torch-free: the CLI refuses a bad --jobs before torch loads."""

from __future__ import annotations

import os
from dataclasses import dataclass

from parity_cli.errors import InputError


def resolve_jobs(jobs) -> int:
    """--jobs: a count, or "auto" (and 0): the CPUs this process may run on (its affinity mask,
    which a container or `taskset` narrows; os.cpu_count() would count the whole machine)."""
    if jobs in ("auto", 0, "0"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return os.cpu_count() or 1
    try:
        n = int(jobs)
    except (TypeError, ValueError):
        raise InputError(f"--jobs must be a whole number >= 1 or 'auto', got {jobs!r}") from None
    if n < 1 or str(n) != str(jobs).strip():
        raise InputError(f"--jobs must be a whole number >= 1 or 'auto', got {jobs!r}")
    return n


def shardable(opts, device: str) -> bool:
    """Whether --jobs can split the layers over whole worker processes: every step of a layer is
    then our own code (the candidate a built-in that runs in-process on the CPU, the reference no
    plugin), and there is no converted copy whose layers the parent pairs. Otherwise the workers are supervised candidate
    children, driven from the parent's threads (check.layer.run_layers)."""
    from parity_cli.isolation.supervisor import reference_supervised, supervised

    return not supervised(opts.candidate, device, opts.isolation) and not opts.candidate_checkpoint and \
        not reference_supervised(opts.reference, opts.isolation)


@dataclass(frozen=True)
class Plan:
    """What every worker needs besides its share of layer names; decided once, in the parent."""

    path: str
    opts: object  # options.CheckOptions (captured rows travel with the share that reads them)
    cand_dtype: str
    tol: object
    grad_tol: object
    strata: tuple
    timeout: float | None
    family: object = None  # model.families.Family as the parent settled it (validated, derived again, classes bound)
    # a remote checkpoint's place (HF_ENDPOINT, PARITY_CACHE): the fork server's environment is from
    # before the parent's, and `path` is then the URL pinned to the commit the parent resolved
    environment: tuple = ()


def check_shards(plan: Plan, names: list[str], workers: int, progress=None) -> list:
    """Each layer's LayerResult, in `names` order, from `workers` long-lived processes forked
    from the fork server (torch already imported there). Each worker opens the checkpoint once
    and reads only the layers it is given; shares are small so that a slow layer (a failing one
    that is diagnosed) does not leave the other workers idle at the end."""
    import dataclasses
    import os

    from parity_cli.isolation.supervisor import _context, _no_main, ensure_fork_server

    chunk = max(1, -(-len(names) // (workers * 8)))
    shares = [names[k:k + chunk] for k in range(0, len(names), chunk)]
    captured = plan.opts.captured or {}
    tasks = [(plan if not captured else dataclasses.replace(
        plan, opts=dataclasses.replace(plan.opts, captured={n: captured[n] for n in share if n in captured})),
        share) for share in shares]
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    done: dict = {}
    finished = 0
    server = ensure_fork_server()
    pool = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_worker_start,
                               initargs=(server or os.getpid(),))
    try:
        with _no_main():  # the workers start as the tasks are submitted
            pending = {pool.submit(_run_share, task): k for k, task in enumerate(tasks)}
        while pending:
            ready, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in ready:
                k = pending.pop(future)
                try:
                    done[k] = future.result()
                except BrokenProcessPool:
                    # a worker died (killed, out of memory): said as such, never a hang
                    raise InputError("a --jobs worker process died (killed, out of memory, or code that "
                                     "exits the process); rerun with --jobs 1 to see where") from None
                finished += len(done[k])
                if progress is not None:
                    progress(finished, len(names), f"{finished} layers")
    except BaseException:
        # Ctrl-C / SIGTERM / a dead worker: the workers ignore SIGINT, so they are ended here
        # rather than left to finish their shares
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            try:
                proc.kill()
            except (OSError, ValueError, AttributeError):
                pass
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [result for k in range(len(tasks)) for result in done[k]]


_STATE: dict = {}


def _worker_start(parent: int) -> None:
    """A worker's first act: it dies with the fork server (and so with parity), holds none of the
    fork server's pipes, and leaves Ctrl-C to the parent, which ends it (no traceback of its own)."""
    import signal

    from parity_cli.isolation.worker import detach_from_fork_server
    from parity_cli.lifetime import die_with_parent

    die_with_parent(parent)
    detach_from_fork_server()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_share(task):
    """In a worker: the share's layers, checked exactly as the single-process loop checks them."""
    plan, share = task
    import torch

    from parity_cli import options
    from parity_cli.backends import implementations as impls
    from parity_cli.check.layer import Side, check_layer
    from parity_cli.isolation.runners import InProcessRunner
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load

    opts = plan.opts
    torch.set_num_threads(opts.threads)
    os.environ.update(dict(plan.environment))
    key = (plan.path, opts.family, opts.eps)
    if key not in _STATE:
        _STATE.clear()
        _STATE[key] = load(plan.path, opts.family, opts.eps, resolved=plan.family)
    ckpt, fam, eps = _STATE[key]
    layers = {layer.name: layer for layer in discover_layers(ckpt, fam, eps, opts.layers, names=set(share)).layers}
    reference = Side(impls.resolve(opts.reference), opts.reference, getattr(torch, options.dtype_name(opts.reference_dtype)),
                     options.reference_device(opts.reference_device, opts.device, options.is_oracle(opts)))
    impl = impls.resolve(opts.candidate, options.candidate_args(opts))
    candidate = Side(impl, opts.candidate, getattr(torch, plan.cand_dtype), opts.device, opts.candidate_eps,
                     InProcessRunner(impl, plan.timeout))
    return [check_layer(layers[name], reference, candidate, list(plan.strata), plan.tol, opts, grad_tol=plan.grad_tol)
            for name in share]
