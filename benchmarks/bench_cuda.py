"""Time to verdict for the 405B shape (253 norm layers, dim 16384) with the candidate on a GPU.

    python benchmarks/bench_cuda.py               # needs a CUDA device; says so and exits 0 without one
    python benchmarks/bench_cuda.py --repeat 5 --dtype bfloat16

The candidate is the `torch` built-in on `cuda` (a GPU candidate always runs supervised: its
child owns the CUDA context). Compared, in the same run, interleaved, medians quoted:
  reference cpu    the float64 oracle and the comparison on the CPU: every layer's candidate
                   output comes back over the bus and is compared there
  reference auto   what `parity check` does by default: on the GPU when it has fast float64
                   (parity_cli.api.FAST_FLOAT64: A100, H100/H200, B200), the probe set crossing
                   the bus once; on other GPUs this is the CPU again, and the line says so
and the same two with --candidate-eps 1e-6 (every layer fails and is diagnosed on the CPU).
The time to verdict is the wall time of the whole command, start-up included; the line after
it subtracts `parity check --layers model.norm` (one layer) to show the per-layer part.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_ROOT, ensure_model, median, parity_cmd, print_machine, run_child  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="candidate dtype (default: as stored, bfloat16)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device on this machine; nothing to measure (run it where a GPU is)")
        return 0
    from parity_cli.api import FAST_FLOAT64

    props = torch.cuda.get_device_properties(0)
    fast = (props.major, props.minor) in FAST_FLOAT64
    print_machine(DEFAULT_ROOT if DEFAULT_ROOT.exists() else None)
    print(f"GPU: {props.name}, capability {props.major}.{props.minor}, "
          f"{props.total_memory / 2 ** 30:.0f} GiB; fast float64: {'yes' if fast else 'no (auto = cpu)'}")
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    out = Path(tempfile.mkdtemp(prefix="parity-bench-cuda-"))
    base = parity_cmd() + ["check", str(model), "--candidate", "torch", "--device", "cuda", "-q",
                           "--json", str(out / "r.json")] + (["--dtype", args.dtype] if args.dtype else [])
    configs = {
        "reference cpu": (["--reference-device", "cpu"], (0,)),
        "reference auto": ([], (0,)),
        "failing, reference cpu": (["--reference-device", "cpu", "--candidate-eps", "1e-6"], (1,)),
        "failing, reference auto": (["--candidate-eps", "1e-6"], (1,)),
        "one layer (start-up)": (["--layers", "model.norm"], (0,)),
    }
    run_child(base + ["--layers", "model.norm"])  # fork server, CUDA context and page cache warm
    res: dict = {}
    for _ in range(args.repeat):
        for label, (extra, rc) in configs.items():
            res.setdefault(label, []).append(run_child(base + extra, check_rc=rc))
    floor = median([r["wall"] for r in res["one layer (start-up)"]])
    ref = median([r["wall"] for r in res["reference cpu"]])
    print(f"\n== time to verdict, 405B shape on {props.name}, median of {args.repeat} ==")
    for label, runs in res.items():
        wall = median([r["wall"] for r in runs])
        walls = " ".join(f"{r['wall']:.2f}" for r in runs)
        per_layer = "" if label.startswith("one layer") else f"; {1000 * (wall - floor) / 252:.2f} ms per layer past start-up"
        print(f"  {label:<26} {wall:7.2f}s (runs {walls}); {ref / wall:4.2f}x the CPU reference{per_layer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
