"""Issue 36: time to verdict per runtime built-in on the 405B shape (253 norm layers, dim 16384,
bfloat16), each as a ratio to `--candidate torch` measured in the same run. Each is
`parity check DIR --candidate X -q --json ...` as a subprocess, interleaved over --repeat rounds
so that a slow spell on the machine hits every runtime; medians. Every runtime runs supervised
(one child, one thread: the defaults). torch.compile pays inductor's compile of the model's widths
in each run (its on-disk cache is kept between runs, as a user's machine keeps it).

    python benchmarks/bench_runtimes.py --repeat 3
    python benchmarks/bench_runtimes.py --runtimes torch vllm llama.cpp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_ROOT, busy_note, ensure_model, interleaved_checks, median, print_machine  # noqa: E402

RUNTIMES = ["torch", "onnxruntime", "openvino", "vllm", "llama.cpp", "mlx", "torch.compile", "executorch"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for idle CPUs before each run")
    ap.add_argument("--runtimes", nargs="*", default=RUNTIMES)
    args = ap.parse_args(argv)
    from parity_cli.runtimes import installed, version

    chosen = [r for r in args.runtimes if installed(r)]
    if "torch" not in chosen:
        chosen.insert(0, "torch")
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    print_machine(model)
    print("runtimes: " + ", ".join(f"{r} ({version(r)})" for r in chosen))
    res, reports = interleaved_checks(model, {r: ["--candidate", r] for r in chosen}, args.repeat, args.quiet_wait)
    verdicts = {r: (data["summary"]["verdict"], data["summary"]["layers"]) for r, data in reports.items()}
    floor = median([r["wall"] for r in res["torch"]])
    print(f"\n== time to verdict, the 405B shape (253 norm layers, dim 16384, bfloat16), median of {args.repeat} ==")
    for runtime, runs in res.items():
        wall = median([r["wall"] for r in runs])
        walls = " ".join(f"{r['wall']:.1f}" for r in runs)
        verdict, layers = verdicts[runtime]
        print(f"  {runtime:<14} wall {wall:6.2f}s {wall / floor:5.2f}x torch (runs {walls}); {verdict} on {layers} layers")
    for note in filter(None, [busy_note()]):  # a run that started on busy CPUs says so
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
