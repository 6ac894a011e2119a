"""The full check of the 405B shape (253 norm layers, dim 16384) on idle CPUs and beside a busy
neighbour (one busy-loop process pinned to a CPU, as another job on a CI runner), with page
faults and CPU time next to the wall time. Every configuration runs in both states, interleaved
(idle, busy, idle, busy, ...), so a slow spell of the machine hits both; medians are quoted.

    python benchmarks/bench_busy.py                 # ~4 min on 2 cores
    python benchmarks/bench_busy.py --repeat 5
    python benchmarks/bench_busy.py --only default,jobs2
    git worktree add /tmp/before 6906eeb && python benchmarks/bench_busy.py --against /tmp/before

Configurations (--only NAME,...):
  default      parity check MODEL --candidate torch -q --json R (one torch thread, one process)
  threads2     the same with --threads 2 (two intra-op threads: what torch does by default)
  jobs2        --jobs 2 (two worker processes, one thread each)
  failing      --candidate-eps 1e-6 on the eps-1e-5 model: every layer fails and is diagnosed
  failing_j2   the failing check with --jobs 2
  split        two processes by hand, --layers '*.input_layernorm' and '*.post_attention_layernorm'
               (252 of the 253 layers): the ceiling for --jobs 2
  before       with --against DIR: DIR's own `parity check` (a checkout of an earlier commit, first
               on sys.path, with torch's default threads), the baseline of the same run

CPU time and page faults are the command's own and those of the children it waited for
(os.wait4): the --jobs workers are children of the fork server, whose figures reach the
command only in part, so for jobs2 they undercount; the wall time does not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_ROOT,
    busy_neighbour,
    collect,
    ensure_model,
    median,
    parity_cmd,
    print_machine,
    spawn,
)

CONFIGS = ("default", "threads2", "jobs2", "failing", "failing_j2", "split", "before")


def commands(model: Path, out: Path) -> dict:
    base = parity_cmd() + ["check", str(model), "--candidate", "torch", "-q"]

    def one(extra, name):
        return [base + extra + ["--json", str(out / f"{name}.json")]]

    return {
        "default": (one([], "d"), (0,)),
        "threads2": (one(["--threads", "2"], "t2"), (0,)),
        "jobs2": (one(["--jobs", "2"], "j2"), (0,)),
        "failing": (one(["--candidate-eps", "1e-6"], "f"), (1,)),
        "failing_j2": (one(["--candidate-eps", "1e-6", "--jobs", "2"], "fj2"), (1,)),
        "split": ([base + ["--layers", g, "--json", str(out / f"s{k}.json")]
                   for k, g in enumerate(("*.input_layernorm", "*.post_attention_layernorm"))], (0,)),
    }


def run(cmds, rc) -> dict:
    """All of cmds at once; wall from the first start to the last exit, the rest summed."""
    t0 = time.perf_counter()
    parts = [collect(p, rc) for p in [spawn(c, env={"OMP_NUM_THREADS": None}) for c in cmds]]
    return {"wall": time.perf_counter() - t0, "cpu": sum(p["user"] + p["sys"] for p in parts),
            "sys": sum(p["sys"] for p in parts), "minflt": sum(p["minflt"] for p in parts),
            "maxrss_kb": max(p["maxrss_kb"] for p in parts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration and state; medians quoted")
    ap.add_argument("--against", default=None, metavar="DIR",
                    help="a checkout of an earlier commit: its default check is the `before` baseline")
    args = ap.parse_args(argv)
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {CONFIGS}")
    print_machine(DEFAULT_ROOT if DEFAULT_ROOT.exists() else None)
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    out = Path(tempfile.mkdtemp(prefix="parity-bench-busy-"))
    cmds = commands(model, out)
    if args.against:
        before = Path(args.against).resolve()
        # -c with the tree first on sys.path: `-m` would put the working directory (this checkout) first
        launch = f"import sys; sys.path.insert(0, {str(before)!r}); from parity_cli.cli import main; main()"
        cmds["before"] = ([[sys.executable, "-c", launch, "check", str(model), "--candidate", "torch", "-q",
                            "--json", str(out / "b.json")]], (0,))
    elif "before" in wanted:
        wanted.remove("before")
    run(*cmds["default"])  # page cache and fork server files warm before anything is timed
    res: dict = {}
    for _ in range(args.repeat):
        for name in wanted:
            for state in ("idle", "busy"):
                with busy_neighbour(state == "busy"):
                    res.setdefault((name, state), []).append(run(*cmds[name]))

    def med(name, state, key):
        return median([r[key] for r in res[(name, state)]])

    print(f"\n== full check of the 405B shape (253 norm layers, dim 16384), median of {args.repeat}; "
          "busy = one busy-loop process pinned beside it ==")
    print(f"  {'':<12} {'wall idle':>9} {'wall busy':>9} {'busy/idle':>9} {'cpu idle':>8} {'cpu busy':>8} "
          f"{'minflt idle':>11} {'minflt busy':>11} {'RSS MiB':>7}")
    for name in wanted:
        wi, wb = med(name, "idle", "wall"), med(name, "busy", "wall")
        print(f"  {name:<12} {wi:8.2f}s {wb:8.2f}s {wb / wi:8.2f}x {med(name, 'idle', 'cpu'):7.1f}s "
              f"{med(name, 'busy', 'cpu'):7.1f}s {med(name, 'idle', 'minflt') / 1e3:10.0f}K "
              f"{med(name, 'busy', 'minflt') / 1e3:10.0f}K {med(name, 'idle', 'maxrss_kb') / 1024:7.0f}")
        runs = " ".join(f"{r['wall']:.2f}" for r in res[(name, 'idle')])
        runs_b = " ".join(f"{r['wall']:.2f}" for r in res[(name, 'busy')])
        print(f"  {'':<12} runs idle {runs}; busy {runs_b}")

    def ratio(a, b, state):
        if (a, state) in res and (b, state) in res:
            return med(a, state, "wall") / med(b, state, "wall")
        return None

    print()
    for state in ("idle", "busy"):
        for label, a, b, aim, lower in (("failing / passing", "failing", "default", 2.0, True),
                                        ("--jobs 1 / --jobs 2", "default", "jobs2", 1.6, False),
                                        ("failing: --jobs 1 / --jobs 2", "failing", "failing_j2", 1.6, False),
                                        ("--jobs 1 / two hand-split processes", "default", "split", None, False),
                                        ("--threads 2 / --threads 1", "threads2", "default", None, True),
                                        ("before / now (default check)", "before", "default", 1.0, False)):
            r = ratio(a, b, state)
            if r is None:
                continue
            verdict = "" if aim is None else (f" (aim {'<=' if lower else '>='} {aim:g}x: "
                                              f"{'met' if (r <= aim if lower else r >= aim) else 'NOT met'})")
            print(f"  {state:<4} {label:<38} {r:5.2f}x{verdict}")
    if ("default", "idle") in res:
        b = med("default", "busy", "wall") / med("default", "idle", "wall")
        print(f"  default check busy / idle {b:.2f}x (aim <= 2x: {'met' if b <= 2 else 'NOT met'}); "
              f"minor page faults {med('default', 'idle', 'minflt') / 1e3:.0f}K (aim < 300K: "
              f"{'met' if med('default', 'idle', 'minflt') < 3e5 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
