"""What the installed transformers costs a check (issue 34): `load()` of a tiny checkpoint whose
committed family was generated with the installed release (used as it is), with another release's
stamp that still holds (validated on the meta device), with a renamed class (derived again), and
`--candidate transformers`'s class binding; each as a ratio to the first, measured in this run.

    python benchmarks/bench_installed.py --repeat 15

In one process, as a check runs it: transformers is imported once before timing (a check of a
derived family imports it anyway), and each timed call starts with parity's own caches cleared."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def cell(v, base) -> str:
    return f"{v * 1e3:7.1f} ms {v / base:5.1f}x" if v is not None else f"{'-':>16}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--types", nargs="*", default=["smollm3", "mamba2", "llama4"])
    args = ap.parse_args(argv)
    import transformers  # noqa: F401  (imported by any check of a derived family)

    from parity_cli.model import families, installed
    from parity_cli.model.derive import write_tiny_checkpoint
    from parity_cli.model.load import load
    from parity_cli.resources import configs_dir

    print_machine()
    version = installed.installed_version()
    other = "0.0.0"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root = tmp / "configs"
        shutil.copytree(configs_dir(), root)
        families.configs_dir = lambda: root
        print(f"{'type':10} {'as committed':>13} {'validated':>16} {'derived again':>16} {'bind classes':>16}")
        for model_type in args.types:
            ckpt = tmp / model_type
            write_tiny_checkpoint(model_type, ckpt)
            target = root / "families" / "derived" / f"{model_type}.toml"
            committed = target.read_text()
            stale = committed.replace(f"transformers {version}:", f"transformers {other}:")
            gated = committed.replace("Mamba2RMSNormGated", "MambaRMSNormGated").replace(
                "Llama4TextWeightlessRMSNorm", "Llama4TextL2Norm").replace(f"transformers {version}:",
                                                                          f"transformers {other}:")
            rows = {}
            for label, text, classes in (("committed", committed, False), ("validated", stale, False),
                                         ("derived", gated if gated != stale else None, False),
                                         ("bind", committed, True)):
                if text is None:
                    rows[label] = None
                    continue
                target.write_text(text)
                times = []
                for _ in range(args.repeat + 1):
                    families.clear_caches()
                    installed._CURRENT.clear()
                    t0 = time.perf_counter()
                    load(ckpt, classes=classes)
                    times.append(time.perf_counter() - t0)
                rows[label] = median(times[1:])  # the first call imports the model's module
            target.write_text(committed)
            base = rows["committed"]

            print(f"{model_type:10} {base * 1e3:10.1f} ms {cell(rows['validated'], base)} {cell(rows['derived'], base)} "
                  f"{cell(rows['bind'], base)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
