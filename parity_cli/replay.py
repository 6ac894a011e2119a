"""A report as a CI artifact: paths recorded so that it replays from another checkout, a
fingerprint of the checked norm tensors so that a replay knows it has the same model, and the
options of the run read back (parity explain REPORT.json --checkpoint PATH)."""

from __future__ import annotations

from pathlib import Path

from parity_cli.errors import InputError


def recorded_path(path) -> str:
    """A path as a report records it: relative to the working directory where it lies under it,
    so that a CI artifact replays from another checkout (parity explain --checkpoint)."""
    import os

    absolute = Path(os.path.abspath(Path(path).expanduser()))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def recorded_spec(spec: str) -> str:
    """FILE.py:ATTR with the file as recorded_path gives it; other specs as typed."""
    from parity_cli.implementations import is_file_target

    target, sep, attr = spec.rpartition(":")
    if sep and target and is_file_target(target):
        return f"{recorded_path(target)}:{attr}"
    return spec


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


def options_from_report(data: dict, where: str, checkpoint: str | None = None, candidate: str | None = None,
                        candidate_checkpoint: str | None = None):
    """The options a saved report was produced with, to rerun it (parity explain REPORT.json).
    `checkpoint`, `candidate` and `candidate_checkpoint` point a replay at this machine's copies;
    a recorded relative path is taken from the working directory, as it was recorded."""
    from parity_cli.api import CheckOptions

    try:
        cand, ref, probes = data["candidate"], data["reference"], data["probes"]
        opts = CheckOptions(
            candidate=candidate or cand["impl"], reference=ref["impl"], dtype=cand["dtype"], device=cand["device"],
            family=data["checkpoint"].get("family"),
            eps=data["eps"]["value"] if data["eps"]["source"] == "override" else None,
            candidate_eps=cand["eps"] if cand.get("eps_source") == "option:--candidate-eps" else None,
            # a one-sided override is recorded as "option+profile:..."; the profile's own value is harmless
            atol=data["tolerance"]["atol"] if str(data["tolerance"].get("source", "")).startswith("option") else None,
            rtol=data["tolerance"]["rtol"] if str(data["tolerance"].get("source", "")).startswith("option") else None,
            max_violation_fraction=float(data["tolerance"].get("max_violation_fraction", 0.0)),
            timeout=cand.get("timeout") if cand.get("timeout") is not None or "isolation" not in cand else float("inf"),
            isolation=cand.get("isolation", "auto"),
            # `captured` is the --activations file's stratum, recorded with its path below
            strata=[n for n in probes["strata"] if n != "captured"], seed=int(probes["seed"]),
            layers=probes.get("layers"), activations=(probes.get("activations") or {}).get("path"),
            reference_dtype=ref.get("dtype", "float64"), reference_device=ref.get("device", "cpu"),
            exact=bool(data["tolerance"].get("exact", False)), candidate_args=cand.get("args") or None,
            candidate_checkpoint=candidate_checkpoint or (cand.get("checkpoint") or {}).get("path"),
        )
        path = checkpoint or data["checkpoint"]["path"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{where}: the report lacks what a rerun needs ({exc})") from None
    from parity_cli.implementations import is_file_target

    target, sep, _ = opts.candidate.rpartition(":")
    if not candidate and sep and target and is_file_target(target) and not Path(target).is_file():
        raise InputError(f"{where}: the report's candidate {opts.candidate} is not here; point at this machine's "
                         "copy with --candidate FILE.py:ATTR")
    if opts.activations and not Path(opts.activations).is_file():
        raise InputError(f"{where}: the report's activations {opts.activations} are not here; rerun the check "
                         "without --activations, or from where the capture is")
    for flag, value, given in (("--checkpoint", path, checkpoint),
                               ("--candidate-checkpoint", opts.candidate_checkpoint, candidate_checkpoint)):
        if value and not given and not Path(value).exists():
            raise InputError(f"{where}: the report's checkpoint {value} is not here; point at this machine's copy "
                             f"with {flag} PATH")
    return path, opts


def verify_fingerprint(data: dict, path: str, opts, where: str) -> str | None:
    """Refuse to replay a report on a different model; a report without a fingerprint (older
    versions) replays with a warning, returned."""
    from parity_cli.api import load
    from parity_cli.layers import discover_layers

    recorded = (data["checkpoint"].get("fingerprint") or {}).get("sha256")
    if not recorded:
        return f"{where} has no checkpoint fingerprint (an older report): cannot check {path} is the same model"
    ckpt, fam, eps = load(path, opts.family, opts.eps)
    here = fingerprint(discover_layers(ckpt, fam, eps, opts.layers).layers)["sha256"]
    if here != recorded:
        raise InputError(f"{path}: its norm tensors differ from those {where} was made from "
                         f"(sha256 {here[:12]}... here, {recorded[:12]}... in the report); not the same model")
    return None
