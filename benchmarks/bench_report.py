"""What `parity report` costs a layer as a saved report grows (issue 35: with 4 KB names, 2,000
layers took 56 s and 5,000 over 120 s; JUnit built a name pattern of the whole group for each of
its layers). A real report of a small model (a synthetic BERT checked with --candidate-eps 1e-5,
every layer failing in one group) is replicated to N layers with 4,000-character names; each
format's time per layer is printed as a ratio to the smallest N's, measured in this run. Linear
is a ratio near 1 across N.

    python benchmarks/bench_report.py --repeat 3 --sizes 500 1000 2000 4000

Each run is a fresh `parity report` process (its JSON read, validated against the schema, and
rendered), as a user or a CI step runs it."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_machine  # noqa: E402

FORMATS = ("table", "markdown", "junit", "json")


def base_report(tmp: Path) -> dict:
    from parity_cli.sources.synthetic import write_checkpoint

    src = write_checkpoint(tmp / "bert", "bert", layers=6, eps=1e-12)
    out = tmp / "base.json"
    subprocess.run([sys.executable, "-m", "parity_cli", "check", str(src), "--candidate-eps", "1e-5", "--json", str(out),
                    "-q"], check=False, capture_output=True)
    return json.loads(out.read_text())


def grown(base: dict, n: int) -> dict:
    layers = []
    for k in range(n):
        layer = copy.deepcopy(base["layers"][k % len(base["layers"])])
        layer["name"] = f"model.{'x' * 4000}.layers.{k}.input_layernorm"
        layers.append(layer)
    out = dict(base, layers=layers)
    out["summary"] = dict(base["summary"], layers=n, failed=n)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="*", default=[500, 1000, 2000, 4000])
    args = ap.parse_args(argv)
    print_machine()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base = base_report(tmp)
        per_layer: dict = {}
        for n in args.sizes:
            path = tmp / f"r{n}.json"
            path.write_text(json.dumps(grown(base, n)))
            for fmt in FORMATS:
                times = []
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "parity_cli", "report", str(path), "--format", fmt],
                                   capture_output=True, check=False)
                    times.append(time.perf_counter() - start)
                per_layer[(n, fmt)] = median(times) / n
        first = args.sizes[0]
        print(f"{'layers':>7} " + " ".join(f"{fmt:>22}" for fmt in FORMATS))
        for n in args.sizes:
            cells = [f"{per_layer[(n, f)] * 1e3:7.2f} ms/layer {per_layer[(n, f)] / per_layer[(first, f)]:5.2f}x"
                     for f in FORMATS]
            print(f"{n:>7} " + " ".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
