"""Issue 29: time to verdict with `--candidate openvino` on the 405B shape (253 norm layers, dim
16384, bfloat16), against `--candidate onnxruntime` in the same run, and `--candidate torch` (the
in-parent built-in) as the floor. Each is `parity check DIR --candidate X -q --json ...` as a
subprocess, interleaved over --repeat rounds so a slow spell on the machine hits every candidate;
medians. Both runtimes run supervised (one child, one thread: the defaults); openvino compiles one
model per layer (its gain is a Constant, as in a converted model, and the CPU plugin fuses the
RMS pattern around it), onnxruntime shares one session per shape and eps.

    python benchmarks/bench_openvino.py                 # --repeat 3, ~4 min on 2 shared cores
    python benchmarks/bench_openvino.py --repeat 5 --no-torch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_ROOT, busy_note, ensure_model, interleaved_checks, median, print_machine  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quiet-wait", type=float, default=30.0, help="seconds to wait for idle CPUs before each run")
    ap.add_argument("--no-torch", action="store_true", help="leave out the torch floor")
    args = ap.parse_args(argv)
    import onnxruntime
    import openvino

    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    print_machine(model)
    print(f"openvino {openvino.get_version()}, onnxruntime {onnxruntime.__version__}")
    configs = {"openvino (CPU plugin)": ["--candidate", "openvino"],
               "onnxruntime (CPU EP)": ["--candidate", "onnxruntime"]}
    if not args.no_torch:
        configs["torch (in the parent: the floor)"] = ["--candidate", "torch"]
    res, reports = interleaved_checks(model, configs, args.repeat, args.quiet_wait)
    verdicts = {label: (data["summary"]["verdict"], data["summary"]["layers"],
                        data["candidate"].get("openvino", {}).get("inference_precision"))
                for label, data in reports.items()}
    print(f"\n== time to verdict, the 405B shape (253 norm layers, dim 16384, bfloat16), median of {args.repeat} ==")
    ov_wall = median([r["wall"] for r in res["openvino (CPU plugin)"]])
    ort_wall = median([r["wall"] for r in res["onnxruntime (CPU EP)"]])
    for label, runs in res.items():
        wall = median([r["wall"] for r in runs])
        cpu = median([r["user"] + r["sys"] for r in runs])
        walls = " ".join(f"{r['wall']:.1f}" for r in runs)
        verdict, layers, precision = verdicts[label]
        what = f"{verdict} on {layers} layers" + (f", plugin at {precision}" if precision else "")
        print(f"  {label:<34} wall {wall:6.2f}s (runs {walls}); cpu {cpu:6.1f}s; peak RSS (parent) "
              f"{median([r['maxrss_kb'] for r in runs]) / 1024:5.0f} MiB; {what}")
    print(f"  => openvino {ov_wall:.1f}s against onnxruntime {ort_wall:.1f}s: {ov_wall / ort_wall:.2f}x"
          + (f"; {1000 * (ov_wall - ort_wall) / 253:+.0f} ms a layer" if ov_wall > ort_wall else ""))
    note = busy_note()
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
