"""Issue 46's fleet: 12 unmodified tiny checkpoints of every norm kind (RMSNorm, Gemma's 1 + w,
per-head q/k norms, T5's, OLMo's weightless LayerNorm, BERT's LayerNorm, ModernBERT's bias-free one,
Whisper, ConvNeXt's channels-first LayerNorm, wav2vec2's GroupNorm, Mamba2's gated norm, ResNet's
BatchNorm) x every runtime x 3 dtypes, through `parity runtimes`, then every failing cell's layers
rerun through the runtime's own public path (NAME@public) at that dtype: a cell the public path
passes is parity's, and is printed as such. The time of each table is printed (the machine's load
included: read it as a figure, not a test).

    python benchmarks/runtime_fleet.py                      # all 12
    python benchmarks/runtime_fleet.py --types llama bert --runtimes torch openvino
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

TYPES = ["llama", "gemma2", "qwen3", "t5", "olmo", "bert", "modernbert", "whisper", "convnext", "wav2vec2", "mamba2",
         "resnet"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="*", default=TYPES)
    ap.add_argument("--runtimes", nargs="*", default=None)
    args = ap.parse_args(argv)
    from parity_cli import api, runtimes
    from parity_cli.backends.implementations import BUILTINS, PUBLIC
    from parity_cli.errors import InputError
    from parity_cli.model.derive import write_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="parity-fleet-"))
    totals = {"cells": 0, "pass": 0, "fail": 0, "refused": 0, "adapter": 0, "error": 0, "not installed": 0}
    ours = []
    for model_type in args.types:
        path = root / model_type
        write_tiny_checkpoint(model_type, path)
        started = time.monotonic()
        table = runtimes.table(path, args.runtimes)
        took = time.monotonic() - started
        print(f"\n{model_type}: {len(table.cells)} cells in {took:.1f} s")
        for c in table.cells:
            totals["cells"] += 1
            totals[c.verdict] = totals.get(c.verdict, 0) + 1
            severity = (c.vs_torch_same_dtype or {}).get("words") or ""
            print(f"  {c.runtime:<14} {c.dtype:<9} {c.verdict:<13} {severity:<28} {c.cause[:110]}")
            public = c.runtime + PUBLIC
            if c.verdict != "fail" or public not in BUILTINS:
                continue
            try:
                twin = api.check(path, candidate=public, dtype=c.dtype)
            except InputError as exc:
                print(f"    {public}: refused ({str(exc)[:100]})")
                continue
            said = "pass" if twin.passed else "fail"
            print(f"    {public}: {said}")
            if twin.passed:
                ours.append(f"{model_type} {c.runtime} {c.dtype}")
    print("\n" + ", ".join(f"{k} {v}" for k, v in totals.items()))
    print("cells the public path passes but parity's adapter fails: " + (", ".join(ours) or "none"))
    return 1 if ours else 0


if __name__ == "__main__":
    raise SystemExit(main())
