"""What every torch.export-based public path shares (ExecuTorch's lowering, ONNX's dynamo exporter).

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
