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


def checkpoint_where(ckpt) -> dict:
    """`path` as a report records it, and for a remote checkpoint `source`: the URL pinned to
    its commit (a rerun reads the same bytes), each file's ETag and what reading it cost."""
    if getattr(ckpt, "remote", None) is None:
        return {"path": recorded_path(ckpt.path)}
    return {"path": ckpt.remote.pinned, "source": ckpt.remote.record()}


def recorded_spec(spec: str) -> str:
    """FILE.py:ATTR with the file as recorded_path gives it; other specs as typed."""
    from parity_cli.backends.implementations import is_file_target

    target, sep, attr = spec.rpartition(":")
    if sep and target and is_file_target(target):
        return f"{recorded_path(target)}:{attr}"
    return spec


def options_from_report(data: dict, where: str, checkpoint: str | None = None, candidate: str | None = None,
                        candidate_checkpoint: str | None = None, reference: str | None = None,
                        trust: bool = False, timeout: float | None = None, isolation: str = "auto"):
    """The options a saved report was produced with, to rerun it (parity explain REPORT.json).
    `checkpoint`, `candidate`, `reference` and `candidate_checkpoint` point a replay at this
    machine's copies; a recorded relative path is taken from the working directory, as it was
    recorded. A report is data: the code it names runs only when it is a built-in, when the
    user names it again, or under `trust` (--trust-report); how the candidate is supervised
    (isolation, timeout) is the caller's, never the file's."""
    from parity_cli.options import CheckOptions
    from parity_cli.report import saved as saved_report

    saved_report.check(data, where)  # every field below has its schema type from here on
    cand, ref, probes, tol = data["candidate"], data["reference"], data["probes"], data["tolerance"]
    if cand["impl"] == "runtime-capture":  # recorded rows: nothing to rerun one factor at a time
        raise InputError(f"{where}: a --runtime-capture report's candidate is the rows a runtime recorded; its causes "
                         "are read from the eps and gains that runtime used (each layer's diagnoses), and there is "
                         "no kernel here to rerun one factor at a time")
    from parity_cli.options import DTYPES

    for role, side in (("candidate", cand), ("reference", ref)):  # named here, not as an option never given
        if side["dtype"].lower().removeprefix("torch.") not in DTYPES:
            raise InputError(f"{where}: {role}.dtype '{side['dtype']}' is not a dtype parity runs at "
                             "(float32, bfloat16, float16, float64)")
    if probes.get("layers"):  # a check refuses a glob that matches no layer: a report's matches one of its own
        import fnmatch

        if not any(fnmatch.fnmatchcase(layer["name"], probes["layers"]) for layer in data["layers"]):
            raise InputError(f"{where}: probes.layers '{probes['layers']}' matches none of the report's layers")
    for role, flag, spec, given in (("candidate", "--candidate", cand["impl"], candidate),
                                    ("reference", "--reference", ref["impl"], reference)):
        if not given and not trust:
            _refuse_code(spec, role, flag, where)
    try:
        opts = CheckOptions(
            candidate=candidate or cand["impl"], reference=reference or ref["impl"], dtype=cand["dtype"],
            device=cand["device"], family=data["checkpoint"].get("family"),
            eps=data["eps"]["value"] if data["eps"]["source"] == "override" else None,
            candidate_eps=cand["eps"] if cand.get("eps_source") == "option:--candidate-eps" else None,
            # a one-sided override is recorded as "option+profile:..."; the profile's own value is harmless
            atol=tol["atol"] if tol.get("source", "").startswith("option") else None,
            rtol=tol["rtol"] if tol.get("source", "").startswith("option") else None,
            max_violation_fraction=float(tol.get("max_violation_fraction", 0.0)),
            timeout=timeout, isolation=isolation,
            # `captured` is the --activations file's stratum, recorded with its path below
            strata=[n for n in probes["strata"] if n != "captured"], seed=probes["seed"],
            layers=probes.get("layers"), activations=(probes.get("activations") or {}).get("path"),
            reference_dtype=ref["dtype"], reference_device=ref["device"],
            exact=bool(tol.get("exact", False)), candidate_args=cand.get("args") or None,
            candidate_checkpoint=candidate_checkpoint or (cand.get("checkpoint") or {}).get("path"),
        )
        path = checkpoint or data["checkpoint"]["path"]
    except (KeyError, TypeError, ValueError) as exc:  # the schema leaves none of these; kept as a net
        raise InputError(f"{where}: the report lacks what a rerun needs ({exc})") from None
    from parity_cli.backends.implementations import is_file_target

    target, sep, _ = opts.candidate.rpartition(":")
    if not candidate and sep and target and is_file_target(target) and not Path(target).is_file():
        raise InputError(f"{where}: the report's candidate {opts.candidate} is not here; point at this machine's "
                         "copy with --candidate FILE.py:ATTR")
    if opts.activations and not Path(opts.activations).is_file():
        raise InputError(f"{where}: the report's activations {opts.activations} are not here; rerun the check "
                         "without --activations, or from where the capture is")
    from parity_cli.sources.remote import is_url

    for flag, value, given in (("--checkpoint", path, checkpoint),
                               ("--candidate-checkpoint", opts.candidate_checkpoint, candidate_checkpoint)):
        # a URL (hf://ORG/NAME@<commit>) is where it lives: opened there, pinned, or from the cache
        if value and not given and not is_url(value) and not Path(value).exists():
            raise InputError(f"{where}: the report's checkpoint {value} is not here; point at this machine's copy "
                             f"with {flag} PATH")
    return path, opts


def _refuse_code(spec: str, role: str, flag: str, where: str) -> None:
    """A built-in named by a report is ours to run; anything else (FILE.py:ATTR, MODULE:ATTR, an
    entry point) is code, and a report that names code does not run it: the user names it again,
    or says they trust the file."""
    from parity_cli.backends.implementations import BUILTINS, is_file_target

    if spec in BUILTINS:
        return
    target, sep, _ = spec.rpartition(":")
    form = "FILE.py:ATTR" if sep and is_file_target(target) else "MODULE:ATTR" if sep else "NAME"
    raise InputError(f"{where}: the report names the {role} {spec!r}, code that a replay does not run; name it "
                     f"again to run it ({flag} {form}, this machine's copy), or pass --trust-report if you trust "
                     "this report")


def verify_fingerprint(data: dict, path: str, opts, where: str) -> str | None:
    """Refuse to replay a report on a different model; a report without a fingerprint (older
    versions) replays with a warning, returned."""
    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load

    recorded = (data["checkpoint"].get("fingerprint") or {}).get("sha256")
    if not recorded:
        return f"{where} has no checkpoint fingerprint (an older report): cannot check {path} is the same model"
    ckpt, fam, eps = load(path, opts.family, opts.eps)  # the tensors' fingerprint: no class is run
    here = fingerprint(discover_layers(ckpt, fam, eps).layers)["sha256"]  # the whole model's, as a report records it
    if here != recorded:
        raise InputError(f"{path}: its norm tensors differ from those {where} was made from "
                         f"(sha256 {here[:12]}... here, {recorded[:12]}... in the report); not the same model")
    return None
