"""A model's identity as a report records it, so that a replay or a capture knows it has the same model."""

from __future__ import annotations


def fingerprint(layers) -> dict:
    """What a replay checks it has the same model: sha256 over each checked norm tensor's name,
    dtype, shape and stored bytes (not the file: a re-saved or re-sharded copy matches)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for layer in sorted(layers, key=lambda l: l.name):
        for part, t in (("weight", layer.weight), ("bias", layer.bias)):
            if t is None:
                continue
            t = t.detach().contiguous().cpu()
            h.update(f"{layer.name}.{part}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return {"sha256": h.hexdigest(), "layers": len(layers),
            "over": "each checked norm tensor's name, dtype, shape and stored bytes, in name order"}
