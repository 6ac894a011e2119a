"""The `runtime-capture` candidate: what a runtime's own norm node computed, replayed. Each probe
row is one the runtime saw (a capture's `x`); its output is the row the runtime gave (`y`),
looked up by the row's bytes, so nothing here computes a norm."""

from __future__ import annotations

NAME = "runtime-capture"


def prepare(layer, weight, bias, eps: float):
    import torch

    if layer.recorded is None:
        raise RuntimeError(f"{layer.name}: no rows recorded by the runtime")
    x, y = layer.recorded
    x = x.to(torch.float32).contiguous()
    table = {}
    for k, row in enumerate(x.numpy()):
        table.setdefault(row.tobytes(), k)

    def replay(h):
        rows = h.reshape(-1, h.shape[-1]).to(torch.float32).cpu().contiguous().numpy()
        out = torch.full((rows.shape[0], y.shape[1]), float("nan"), dtype=torch.float32)
        for k, row in enumerate(rows):
            j = table.get(row.tobytes())
            if j is not None:
                out[k] = y[j]
        return out.to(dtype=h.dtype, device=h.device).reshape(*h.shape[:-1], y.shape[1])

    return replay
