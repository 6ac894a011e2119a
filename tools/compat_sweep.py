"""The range of transformers releases parity works with, measured (issue 34): each given release
installed into a throwaway venv beside the locked torch, parity installed there from this tree, and
the zoo sample run in it (benchmarks/zoo_sweep.py: the most deployed LLM/VLM types, the encoders,
vision and audio models, every norm kind). Writes the version table into COVERAGE.md between its
markers and tools/compat_sweep.json.

    python tools/compat_sweep.py 4.53.3 5.12.1 5.24.0 5.25.0        # ~5-10 min a release here
    python tools/compat_sweep.py 5.26.0 --venvs /tmp/compat --keep   # a new release, venv kept

A type a release does not ship is "absent" (not a failure). The families committed under
configs/families/derived/ were generated with one release; under any other, parity validates each
against the installed classes at run time and re-derives where they differ, so the sweep measures
exactly what a user with that release pinned gets."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tools" / "compat_sweep.json"
COVERAGE = ROOT / "COVERAGE.md"
BEGIN, END = "<!-- compat-sweep:begin -->", "<!-- compat-sweep:end -->"
# what parity itself needs beside transformers (the package's own dependencies and accelerate, which
# some model classes import); torch from the lock, so that only transformers moves
PACKAGES = ["numpy", "safetensors", "click", "rich", "accelerate", "sentencepiece", "protobuf"]
# types whose classes need a package the test extra does not bring (timm needs torchvision, whose PyPI
# build does not load beside the locked CPU torch): set apart with that reason, as tests/test_zoo_sweep.py does
NEEDS = {"gemma3n": "timm"}


def _locked(name: str) -> str | None:
    for line in (ROOT / "constraints" / "test.txt").read_text().splitlines():
        if line.split("==")[0].strip().lower() == name:
            return line.strip()
    return None


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def venv_for(version: str, venvs: Path) -> Path:
    """A venv holding transformers==version, the locked torch and parity from this tree (--no-deps)."""
    where = venvs / f"transformers-{version}"
    python = where / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        _pip(python, _locked("torch") or "torch==2.13.0")
        _pip(python, f"transformers=={version}", *PACKAGES)
        _pip(python, "--no-deps", "-e", str(ROOT))
    return python


def sweep(version: str, venvs: Path, sample: int, seed: int, jobs: int) -> dict:
    python = venv_for(version, venvs)
    out = venvs / f"zoo-{version}.md"
    run = subprocess.run([str(python), str(ROOT / "benchmarks" / "zoo_sweep.py"), "--sample", str(sample),
                          "--seed", str(seed), "--jobs", str(jobs), "--out", str(out)],
                         capture_output=True, text=True)
    if run.returncode != 0 or not out.with_suffix(".json").exists():
        return {"version": version, "error": (run.stderr.strip().splitlines() or ["?"])[-1][:300]}
    rows = json.loads(out.with_suffix(".json").read_text())
    return {"version": version, "rows": rows}


def _moved_words(source: str) -> str:
    """What a run-time derivation said moved, without its frame ("derived at run time: transformers X ...
    (committed: ...)")."""
    words = re.sub(r"^derived at run time: transformers \S+ ", "", source)
    return re.sub(r" \(committed: [^)]*\).*$", "", words)


def summary(result: dict, sample: list[str]) -> dict:
    """Types fully correct of those the release ships with a norm parity can express; the rest, why."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo_sweep import _why, fully_correct

    rows = result.get("rows", [])
    swept = {r["model_type"] for r in rows}
    absent = [t for t in sample if t not in swept]  # zoo_sweep sweeps the types the release ships
    scope = [r for r in rows if not (r.get("outcome") == "checked" and not r.get("expressible"))]
    needs = {t: p for t, p in NEEDS.items() if any(r["model_type"] == t and p in str(r.get("error", "")).lower()
                                                    for r in scope)}
    scope = [r for r in scope if r["model_type"] not in needs]
    correct = [r["model_type"] for r in scope if fully_correct(r)]
    gaps = {r["model_type"]: _why(r) for r in scope if not fully_correct(r)}
    rederived = {r["model_type"]: _moved_words(r["family_source"]) for r in rows
                 if str(r.get("family_source", "")).startswith("derived at run")}
    return {"version": result["version"], "error": result.get("error"), "swept": len(rows), "absent": absent,
            "needs": needs, "in_scope": len(scope), "correct": len(correct), "gaps": gaps, "rederived": rederived}


def table(summaries: list[dict], sample: int, seed: int) -> str:
    lines = [BEGIN, "", "## transformers releases (tools/compat_sweep.py)", "",
             f"The zoo sample (`benchmarks/zoo_sweep.py --sample {sample} --seed {seed}`: the most deployed LLM/VLM "
             "types, encoders, vision and audio models, and a type of every other norm kind: gated RMSNorm both ways, "
             "GroupNorm, weightless) under each release, in a venv of its own with the locked "
             "torch. The committed families were generated with one release (their stamp); under each other one "
             "parity validated them against the installed classes and derived again, at run time, those whose "
             "classes, eps keys or forms had moved: the re-derived column says what moved. Absent: types the "
             "release does not ship.", "",
             "| transformers | types in the sample it ships | fully correct | re-derived at run time | not correct, why |",
             "|---|---|---|---|---|"]
    for s in summaries:
        if s.get("error"):
            lines.append(f"| {s['version']} | | | | the sweep did not run: {s['error']} |")
            continue
        why = "; ".join(f"{t}: {w}" for t, w in sorted(s["gaps"].items())).replace("|", "/") or ""
        moved = "; ".join(f"{t}: {w}" for t, w in sorted(s["rederived"].items())).replace("|", "/")
        lines.append(f"| {s['version']} | {s['in_scope']} | {s['correct']} of {s['in_scope']} | {moved} | {why} |")
    absent = {s["version"]: s["absent"] for s in summaries if s.get("absent")}
    if absent:
        lines += [""] + [f"- absent from {v}: {', '.join(a)}" for v, a in absent.items()]
    needs = sorted({f"{t} (its classes need {p}, not in the test extra)" for s in summaries
                    for t, p in s.get("needs", {}).items()})
    if needs:
        lines.append(f"- set apart: {', '.join(needs)}")
    return "\n".join(lines + ["", END]) + "\n"


def write_coverage(text: str) -> None:
    body = COVERAGE.read_text()
    if BEGIN in body and END in body:
        head, rest = body.split(BEGIN, 1)
        body = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        body = body.rstrip("\n") + "\n\n" + text
    COVERAGE.write_text(body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="+")
    ap.add_argument("--sample", type=int, default=0, help="others drawn beside the most deployed types")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--venvs", help="where the venvs go (default: a temporary folder, removed)")
    ap.add_argument("--no-coverage", action="store_true", help="print the table, leave COVERAGE.md as it is")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        venvs = Path(args.venvs or tmp)
        venvs.mkdir(parents=True, exist_ok=True)
        results = [sweep(v, venvs, args.sample, args.seed, args.jobs) for v in args.versions]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo_sweep import KINDS, MOST_DEPLOYED, OTHERS

    summaries = [summary(r, MOST_DEPLOYED + OTHERS + KINDS) for r in results]
    OUT.write_text(json.dumps(summaries, indent=1) + "\n")
    text = table(summaries, args.sample, args.seed)
    print(text)
    if not args.no_coverage:
        write_coverage(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
