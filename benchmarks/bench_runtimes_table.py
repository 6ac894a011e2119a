"""Issue 46, item 7: `parity runtimes` on an all-MiniLM-L6-v2-shaped BERT (6 layers, width 384,
13 LayerNorms plus the head's: 14; random weights, same shapes) over every runtime and dtype (3 cells
a runtime, torch and transformers included), and each runtime candidate against `--candidate torch` on a SmolLM2-135M-shaped Llama (30
layers, width 576: 61 RMSNorms) at float32, measured in the same run. Every figure is a whole
process (`parity ...` under the launcher of _common), interleaved over --repeat rounds so a slow
spell hits every label; medians. The table's baseline is `parity check --candidate torch` on the
same BERT in the same rounds.

    python benchmarks/bench_runtimes_table.py --repeat 3
    python benchmarks/bench_runtimes_table.py --repeat 1 --no-candidates
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import busy_note, median, parity_cmd, print_machine, run_child, wait_quiet  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for idle CPUs before each run")
    ap.add_argument("--no-candidates", action="store_true", help="the table alone")
    args = ap.parse_args(argv)
    from parity_cli.runtimes import installed, version
    from parity_cli.sources.synthetic import write_checkpoint

    root = Path(tempfile.mkdtemp(prefix="parity-bench-table-"))
    bert = write_checkpoint(root / "minilm", "bert", layers=6, hidden=384, heads=12, eps=1e-12, dtype="float32")
    smol = write_checkpoint(root / "smollm2", "llama", layers=30, hidden=576, heads=9, kv_heads=3, eps=1e-5,
                            dtype="float32")
    print_machine(bert)
    from parity_cli.backends import registered

    chosen = [r for r in registered() if installed(r)]  # every runtime file, in the table's order
    print("runtimes: " + ", ".join(f"{r} ({version(r)})" for r in ["torch", *chosen]))
    labels = {"table": parity_cmd() + ["runtimes", str(bert), "-q"],
              "torch (bert)": parity_cmd() + ["check", str(bert), "-q", "--candidate", "torch"]}
    if not args.no_candidates:
        for r in ["torch", *chosen]:
            labels[r] = parity_cmd() + ["check", str(smol), "-q", "--candidate", r, "--dtype", "float32"]
    runs: dict = {}
    for _ in range(args.repeat):
        for label, cmd in labels.items():
            wait_quiet(args.quiet_wait)
            runs.setdefault(label, []).append(run_child(cmd, check_rc=(0, 1)))
    wall = {label: median([r["wall"] for r in rs]) for label, rs in runs.items()}
    cells = 3 * (2 + len(registered()))  # torch and transformers beside every runtime file, at 3 dtypes
    print(f"\n== parity runtimes, MiniLM-shaped BERT ({cells} cells), median of {args.repeat} ==")
    table_runs = " ".join(f"{r['wall']:.1f}" for r in runs["table"])
    print(f"  table {wall['table']:.1f} s (runs {table_runs}); "
          f"{wall['table'] / wall['torch (bert)']:.1f}x one torch check ({wall['torch (bert)']:.1f} s)")
    if not args.no_candidates:
        print(f"\n== each runtime vs --candidate torch, SmolLM2-shaped Llama (61 norms, float32), median of "
              f"{args.repeat} ==")
        for r in ["torch", *chosen]:
            walls = " ".join(f"{x['wall']:.1f}" for x in runs[r])
            print(f"  {r:<14} {wall[r]:6.2f} s {wall[r] / wall['torch']:5.2f}x torch (runs {walls})")
    for note in filter(None, [busy_note()]):
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
