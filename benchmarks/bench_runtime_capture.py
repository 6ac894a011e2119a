"""Time to capture 16 tokens inside llama.cpp (`parity capture MODEL.gguf --runtime llama.cpp`: every
norm node's input and output through llama.cpp's eval callback, two decodes) for a GGUF of
SmolLM2-135M's shape (random weights, F32, written by parity's own HF -> GGUF conversion), against
the transformers capture of the same model's HF directory, measured in the same run; and the
check of the capture against the HF directory.

    python benchmarks/bench_runtime_capture.py [--repeat 3] [--tokens 16]

Needs transformers, gguf and xllamacpp (pip install --no-deps xllamacpp). Each command runs in a
fresh interpreter (its cost includes the imports); medians of --repeat runs are printed."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_commands, print_against, smollm2_shaped, token_bench_args  # noqa: E402


def build(root: Path) -> tuple[Path, Path]:
    from parity_cli.sources.synthetic import hf_to_gguf

    hf = smollm2_shaped(root / "hf")
    return hf, hf_to_gguf(hf, root / "smollm2-135m-shaped.gguf", full=True)


def main() -> None:
    a, prompt = token_bench_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf, gguf_path = build(root)
        cap, acts = root / "cap.safetensors", root / "acts.safetensors"
        rows = {
            "capture --runtime llama.cpp (GGUF)": ["capture", str(gguf_path), "--runtime", "llama.cpp", "--prompt",
                                                   prompt, "--max-tokens", str(a.tokens), "-o", str(cap)],
            "capture (HF dir, transformers)": ["capture", str(hf), "--prompt", prompt, "--max-tokens", str(a.tokens),
                                               "-o", str(acts)],
            "check HF dir --runtime-capture": ["check", str(hf), "--runtime-capture", str(cap), "-q"],
        }
        times = interleaved_commands(rows, a.repeat, check_rc=(0, 1))
        print(f"SmolLM2-135M shape, {a.tokens} tokens, median of {a.repeat}:")
        print_against(times, "capture (HF dir, transformers)", width=38)
        import numpy as np

        from parity_cli.backends import llama_graph

        inside = []
        ids = [2] + [17 + i % 40 for i in range(a.tokens - 1)]
        for _ in range(a.repeat):  # the runtime's own part: its child interpreter, load, two decodes, rows read
            start = time.perf_counter()
            raw = llama_graph.record(gguf_path, ids, None, a.tokens)
            inside.append(time.perf_counter() - start)
        rows = sum(int(np.asarray(n["x"]).shape[0]) for n in raw["nodes"])
        print(f"  llama.cpp itself (record(), its child) {statistics.median(inside):6.2f} s "
              f"({', '.join(f'{v:.2f}' for v in inside)}), {len(raw['nodes'])} nodes, {rows} row pairs")


if __name__ == "__main__":
    main()
