"""Start-up: `parity --help` and `parity --version` must not import torch (aim: under 0.3 s).

    python benchmarks/bench_startup.py --repeat 15

Each command runs as a fresh subprocess; medians are quoted, with ratios to `python -c pass`
and `python -c "import torch"` measured in the same run. `parity` is measured twice: as the
installed console script next to sys.executable, and as whatever `parity` resolves to on PATH
(on a pyenv machine a bash shim that re-execs pyenv, which adds its own ~0.1 s).

torch is confirmed absent two ways: `python -X importtime -m parity_cli --help` (no line
mentions torch) and `sys.modules` after the click command ran in-process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import busy_note, median, parity_cmd, print_machine, run_child, wait_quiet  # noqa: E402

PY = sys.executable


def timed(cmd, repeat, env=None, quiet_wait=20.0):
    walls, rss = [], []
    run_child(cmd, env=env)  # warm the OS file cache; not counted
    for _ in range(repeat):
        wait_quiet(quiet_wait, threshold=0.3)
        r = run_child(cmd, env=env)
        walls.append(r["wall"])
        rss.append(r["maxrss_kb"])
    return median(walls), min(walls), median(rss)


def torch_imported_by(args) -> tuple[bool, int, list[str]]:
    """(torch in sys.modules after the click command ran, -X importtime lines naming torch,
    the five slowest top-level imports)."""
    code = ("import sys\nfrom parity_cli.cli import cli\n"
            f"try:\n    cli.main(args={args!r}, prog_name='parity', standalone_mode=False)\n"
            "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    in_modules = "TORCH" in r.stdout.split() and "NO-TORCH" not in r.stdout
    t = subprocess.run([PY, "-X", "importtime", "-m", "parity_cli", *args], capture_output=True, text=True)
    lines = [ln for ln in t.stderr.splitlines() if ln.startswith("import time:")]
    torch_lines = [ln for ln in lines if "torch" in ln.split("|")[-1]]
    top = []
    for ln in lines[1:]:
        parts = ln.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit() and not parts[2].startswith("  "):  # top level only
            top.append((int(parts[1]), parts[2].strip()))
    top = [f"{n} {us / 1000:.0f} ms" for us, n in sorted(top, reverse=True)[:5]]
    return in_modules, len(torch_lines), top


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15, help="runs per command; medians are quoted")
    ap.add_argument("--quiet-wait", type=float, default=20.0)
    args = ap.parse_args(argv)
    print_machine()

    script = parity_cmd()
    cache = Path(tempfile.mkdtemp(prefix="parity-pycache-"))
    warm_env = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(cache)}
    cases = [
        ("python -c pass", [PY, "-c", "pass"], None),
        ('python -c "import torch"', [PY, "-c", "import torch"], None),
        ("parity --help", script + ["--help"], None),
        ("parity --version", script + ["--version"], None),
        ("python -m parity_cli --help", [PY, "-m", "parity_cli", "--help"], None),
    ]
    seen = {Path(script[0]).resolve()}
    for d in os.environ.get("PATH", "").split(os.pathsep):
        exe = Path(d or ".") / "parity"
        if exe.is_file() and os.access(exe, os.X_OK) and exe.resolve() not in seen:
            seen.add(exe.resolve())  # e.g. a pyenv shim, which a user's shell finds first
            cases.append((f"{exe} --help", [str(exe), "--help"], None))
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        # This environment forbids .pyc files, so the editable package is compiled on every start;
        # the same command with a bytecode cache (outside the repo) shows what that costs.
        cases.append(("parity --help, bytecode cache on", script + ["--help"], warm_env))
    print(f"\nwall time, median of {args.repeat} fresh processes (min in brackets); peak RSS")
    res = {}
    for name, cmd, env in cases:
        med, lo, rss = timed(cmd, args.repeat, env, args.quiet_wait)
        res[name] = med
        print(f"  {name:<44} {med * 1000:7.1f} ms  [{lo * 1000:6.1f}]  {rss / 1024:6.1f} MiB")
    base, torch_t = res["python -c pass"], res['python -c "import torch"']
    print("\nratios")
    for name in res:
        if name not in ("python -c pass", 'python -c "import torch"'):
            print(f"  {name:<44} {res[name] / base:5.1f}x python -c pass; {res[name] / torch_t:5.2f}x import torch; "
                  f"aim 300 ms: {'met' if res[name] < 0.3 else 'NOT met'}")
    print("\ntorch imported?")
    for a in (["--help"], ["--version"], ["check", "--help"]):
        in_mod, n_lines, top = torch_imported_by(a)
        print(f"  parity {' '.join(a):<14} torch in sys.modules: {in_mod}; -X importtime lines naming torch: {n_lines}; "
              f"slowest top-level imports: {', '.join(top)}")
    shutil.rmtree(cache, ignore_errors=True)
    print("\n" + busy_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
