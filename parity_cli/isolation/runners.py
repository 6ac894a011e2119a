"""Stage 4b: how a candidate is run. One layer's work for the candidate is a CandidateJob; what
comes back is a CandidateRun. The same `execute` runs in this process (trusted built-ins) and
in a supervised child process (everything else, parity_cli.isolation.supervisor), so both paths
convert, validate and word a result identically.

Why the split: a candidate is untrusted code. Whatever it returns is turned into plain
float64 values *inside* the guard, and it only ever sees copies of the probes and weights."""

from __future__ import annotations

from dataclasses import dataclass, field

# dtypes a result may travel in; anything else floating is widened to float32 first
WIRE_DTYPES = ("float16", "bfloat16", "float32", "float64")
# the kinds of implementation that run in the parent: our own code, pure functions of copies
IN_PROCESS_BUILTINS = ("oracle", "torch", "hf")


@dataclass
class CandidateJob:
    """Everything the candidate needs for one layer, as copies it may scribble on."""

    layer: object  # layers.NormLayer (the candidate's: its weight, eps and conventions)
    weight: object  # torch.Tensor at the candidate dtype, on the CPU
    bias: object
    eps: float
    device: str
    inputs: list  # probe batches at the candidate dtype, on the CPU
    upstream: list | None = None  # --grad: one upstream gradient per input


@dataclass
class Output:
    value: object = None  # float64 tensor on the CPU, or None
    error: str | None = None
    dtype: str | None = None  # what the candidate returned


@dataclass
class CandidateRun:
    """One layer's candidate results. `error` is a layer-wide fault (build failed, process
    died, timed out, memory cap): the inputs without an output share it."""

    error: str | None = None
    outputs: list[Output] = field(default_factory=list)
    grads: list[tuple] = field(default_factory=list)  # per input: (dx, dweight or None, error)
    # building it raised InputError: the implementation says its setup is at fault (no kernel for
    # the dtype, an argument it cannot take), not its math (check.layer.setup_failure)
    setup: bool = False

    def output(self, k: int) -> Output:
        return self.outputs[k] if k < len(self.outputs) else Output(error=self.error or "no output")

    def grad(self, k: int) -> tuple:
        return self.grads[k] if k < len(self.grads) else (None, None, self.error or "no gradient")


def failure(prefix: str, exc: BaseException) -> str:
    return f"{prefix}{type(exc).__name__}: {exc}".splitlines()[0][:500] if str(exc) else \
        f"{prefix}{type(exc).__name__}"[:500]


def readable(y, expected_numel: int):
    """(contiguous CPU tensor in a WIRE_DTYPES dtype, dtype it came as, error). Every way a
    return value can be unusable is a message here, never an exception later."""
    import torch

    if not isinstance(y, torch.Tensor):
        return None, None, f"returned {type(y).__name__}, not a tensor"
    try:
        y = y.detach()
        if type(y) is not torch.Tensor:  # a subclass may override .to/.cpu: read it as a plain tensor
            y = y.as_subclass(torch.Tensor)
        if y.layout != torch.strided:
            return None, None, f"returned a {str(y.layout).removeprefix('torch.')} tensor, not a dense one"
        if y.device.type == "meta":
            return None, None, "returned a meta tensor (it holds no values)"
        dtype = str(y.dtype).removeprefix("torch.")
        if y.is_complex():
            return None, dtype, f"returned {dtype}: a norm's output is real"
        if not y.is_floating_point():
            return None, dtype, f"returned {dtype}, not a floating-point tensor"
        if y.numel() > 4 * expected_numel + 1024:
            return None, dtype, f"returned shape {list(y.shape)} ({y.numel()} values for {expected_numel} inputs)"
        y = y.to("cpu").resolve_neg()  # a lazily negated view must travel as its values
        if dtype not in WIRE_DTYPES:  # float8 and friends: exactly representable in float32
            y = y.to(torch.float32)
        return y.contiguous(), dtype, None
    except Exception as exc:
        return None, None, failure("returned a tensor that cannot be read: ", exc)


def execute(impl, job: CandidateJob, guard=None, in_child: bool = False, copy_inputs: bool = True):
    """Runs the job, yielding ("built", error, setup), then ("out", k, tensor, dtype, error) per input,
    then ("grad", k, dx, dweight, error) per input under --grad. `guard()` runs after every
    call into candidate code (the child uses it to stop a process the candidate forked).

    In the child a KeyboardInterrupt can only come from the candidate (the child ignores SIGINT),
    so it is that call's error; here in the parent it is the user's Ctrl-C and goes up.

    `copy_inputs=False` hands the inputs over as they are: for our own built-ins, which never
    write into them, and in the child, whose inputs are its own (unless --grad reuses them)."""
    import torch

    guard = guard or (lambda: None)
    dev = job.device

    def build():
        # a fresh copy of the weight for every call: what a kernel writes into it after
        # computing one output cannot reach the next
        weight = job.weight.to(dev, copy=True)
        bias = None if job.bias is None else job.bias.to(dev, copy=True)
        try:
            return impl.prepare(job.layer, weight, bias, job.eps)
        finally:
            guard()

    try:
        fn = build()
    except BaseException as exc:  # SystemExit, KeyboardInterrupt from the candidate: findings too
        if isinstance(exc, KeyboardInterrupt) and not in_child:
            raise
        from parity_cli.errors import InputError

        yield ("built", failure("building the candidate failed: ", exc), isinstance(exc, InputError))
        return
    yield ("built", None, False)
    failed = set()
    for k, x in enumerate(job.inputs):
        try:
            if k:
                fn = build()
            with torch.no_grad():
                y = fn(x.to(dev, copy=True) if copy_inputs else x.to(dev))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and not in_child:
                raise
            y, err = None, failure("", exc)
        else:
            err = None
        finally:
            guard()
        if err is None:
            y, dtype, err = readable(y, x.numel())
        else:
            dtype = None
        if err:
            failed.add(k)
        yield ("out", k, y, dtype, err)
    for k, (x, up) in enumerate(zip(job.inputs, job.upstream or ())):
        if k in failed:
            yield ("grad", k, None, None, "the forward pass failed")
            continue
        try:
            dx, dw = autograd(impl, job, x.to(dev), up.to(dev))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and not in_child:
                raise
            yield ("grad", k, None, None, failure("backward: ", exc))
        else:
            yield ("grad", k, dx, dw, None)
        finally:
            guard()


def autograd(impl, job: CandidateJob, x, upstream):
    """(dx, dweight) by autograd of sum(upstream * fn(x)). A candidate that is not
    differentiable is a finding; dweight comes from a module's own weight when fn is one."""
    import torch

    w_leaf = job.weight.to(job.device, copy=True).requires_grad_(True)
    bias = None if job.bias is None else job.bias.to(job.device, copy=True)
    fn = impl.prepare(job.layer, w_leaf, bias, job.eps)
    xl = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        y = fn(xl)
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"returned {type(y).__name__}, not a tensor")
        if not y.requires_grad:
            raise TypeError("output does not require grad: not differentiable")
        (y.to(upstream.dtype) * upstream).sum().backward()
    w = fn.weight if isinstance(fn, torch.nn.Module) and isinstance(getattr(fn, "weight", None), torch.Tensor) \
        else w_leaf
    if xl.grad is None:
        raise TypeError("no gradient reached the input")
    dx, _, err = readable(xl.grad, x.numel())
    if err:
        raise TypeError(f"dx {err}")
    dw = None
    if w is not None and w.grad is not None:
        dw, _, err = readable(w.grad, job.weight.numel())
        if err:
            raise TypeError(f"dweight {err}")
    return dx, dw


def collect(events, run: CandidateRun) -> CandidateRun:
    """Folds execute()'s events into a CandidateRun (float64 values on the CPU)."""
    import torch

    for event in events:
        if event[0] == "built":
            run.error, run.setup = event[1], bool(event[1] and event[2])
        elif event[0] == "out":
            _, _, y, dtype, err = event
            run.outputs.append(Output(None if y is None else y.to(torch.float64), err, dtype))
        else:
            _, _, dx, dw, err = event
            run.grads.append((None if dx is None else dx.to(torch.float64),
                              None if dw is None else dw.to(torch.float64), err))
    return run


class InProcessRunner:
    """Runs a trusted built-in here. Its inputs are still copies. `timeout` can only abandon
    the work in a thread, never stop it: untrusted code goes to the Supervisor instead."""

    isolated = False

    def __init__(self, impl, timeout: float | None = None):
        from parity_cli.lifetime import say_on_crash

        self.impl = impl
        self.timeout = timeout
        say_on_crash()  # a fatal signal in this process says one line, naming what ran (crash_scope) if anything
        # our own pure functions read their input and never write it: no copy per call
        self.copy_inputs = not (impl.source == "built-in" and impl.name in IN_PROCESS_BUILTINS)

    def submit(self, job: CandidateJob) -> None:
        self._job = job

    def collect(self) -> CandidateRun:
        return self.run(self._job)

    def run(self, job: CandidateJob) -> CandidateRun:
        from parity_cli.lifetime import crash_scope

        # a crash inside the implementation's call is its own: one line names it (--isolation process makes it
        # a finding); outside the call the line blames nobody
        with crash_scope(f"implementation '{getattr(self.impl, 'name', self.impl)}' crashed parity's own process "
                         "(it ran in it: --isolation none, or a built-in); --isolation process runs it apart, where "
                         "a crash is a finding"):
            return self._run(job)

    def _run(self, job: CandidateJob) -> CandidateRun:
        if self.timeout is None:
            return collect(execute(self.impl, job, copy_inputs=self.copy_inputs), CandidateRun())
        import threading

        run = CandidateRun()
        done = threading.Event()

        def target():
            try:
                collect(execute(self.impl, job, copy_inputs=self.copy_inputs), run)
            finally:
                done.set()

        threading.Thread(target=target, daemon=True, name="parity-candidate").start()
        if not done.wait(self.timeout):
            # what arrived in time stands (copied: the abandoned thread may go on appending)
            return CandidateRun(error=f"candidate timed out after {self.timeout:g}s",
                                outputs=list(run.outputs), grads=list(run.grads))
        return run

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass
