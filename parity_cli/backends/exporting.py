"""What every torch.export-based path shares (ExecuTorch's lowering, LiteRT's converter, ONNX's dynamo
exporter): the CompositeImplicitAutograd op list materialised once an export, the module a prepared
callable runs (its tensors fed as program inputs, so that one program serves every layer like it),
the key of such a program, and native stderr muted around a runtime's chatter.

`run_decompositions` asks the C++ dispatcher for the list of CompositeImplicitAutograd ops and
getattr()s each into `torch.ops`, once for every op namespace (about 200 with ExecuTorch and
torchao loaded), and ExecuTorch's to_edge_transform_and_lower decomposes three times: a fifth of a
lowering's time goes to materialising the same list again and again (torch 2.13; it does not cache,
because a custom op may be registered between two exports). Materialising a list already
materialised changes nothing, so inside `cia_ops_materialized_once()` (an export) it is done once,
and again only if the dispatcher's list changes. The programs are byte for byte the same
(tests/test_exporting.py); a torch without that function runs as it always did."""

from __future__ import annotations

import contextlib
import threading

_lock = threading.Lock()
_state: dict = {"depth": 0, "original": None, "done": None}


def _materialize_when_new() -> None:
    import torch

    registrations = tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))
    if registrations != _state["done"]:
        _state["original"]()
        _state["done"] = registrations


@contextlib.contextmanager
def cia_ops_materialized_once():
    from torch._export import utils

    if not callable(getattr(utils, "_materialize_cpp_cia_ops", None)):  # another torch: nothing to spare
        yield
        return
    with _lock:
        if _state["depth"] == 0:
            _state["original"], _state["done"] = utils._materialize_cpp_cia_ops, None  # once in each export
            utils._materialize_cpp_cia_ops = _materialize_when_new
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                utils._materialize_cpp_cia_ops = _state["original"]


_muted: dict = {}  # fd -> [depth, the descriptor it is restored to]


@contextlib.contextmanager
def native_stderr_muted(*fds: int):
    """Native writes to stderr (and the other descriptors given, 1 for stdout) go to /dev/null: a
    runtime's own logging (XNNPACK's CPU probe, LiteRT's converter progress) is not parity's output.
    The descriptors are the process's: overlapping uses from two threads are counted, the first mutes
    and the last restores (two that each restored their own would leave the output muted for good)."""
    import os
    import sys

    fds = fds or (2,)
    with _lock:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in fds:
            entry = _muted.setdefault(fd, [0, None])
            if entry[0] == 0:
                entry[1] = os.dup(fd)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
            entry[0] += 1
    try:
        yield
    finally:
        with _lock:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd in fds:
                entry = _muted[fd]
                entry[0] -= 1
                if entry[0] == 0:
                    os.dup2(entry[1], fd)
                    os.close(entry[1])
                    entry[1] = None


def module_in(fn, depth: int = 3):
    """The one torch module a prepared callable runs: itself, or one its closures hold (a
    channels-first or feature-map wrapper around the family's class); None for a transcription."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return fn
    if depth == 0 or not getattr(fn, "__closure__", None):
        return None
    found = [m for m in (module_in(c.cell_contents, depth - 1) for c in fn.__closure__
                         if not isinstance(c.cell_contents, (int, float, str, bytes, type(None))))
             if m is not None]
    return found[0] if len(found) == 1 else None


def with_holder(module, call):
    """The module as a child (its tensors named module.*) beside the wrapper that calls it, so that
    functional_call can swap the tensors a closure's module holds."""
    import torch

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module, self.call = module, call

        def forward(self, x):
            return self.call(x)

    return Holder()


def program_key(module, layer, dtype, eps: float, names) -> tuple:
    """Everything the exported graph depends on but the tensors fed to it: the module's class and
    scalars, the wrapper's shapes (layout, groups, positions), the dtype and eps."""
    scalars = tuple(sorted((k, v) for k, v in vars(module).items()
                           if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple))))
    state = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in names)
    return (type(module).__module__, type(module).__qualname__, repr(module), scalars, state, layer.kind,
            layer.layout, layer.groups, layer.spatial, layer.width, str(dtype), float(eps))
