"""Time to capture 16 tokens inside llama.cpp (`parity capture MODEL.gguf --runtime llama.cpp`: every
norm node's input and output through llama.cpp's eval callback, two decodes) for a GGUF of
SmolLM2-135M's shape (random weights, F32, written by parity's own HF -> GGUF conversion), against
the transformers capture of the same model's HF directory, measured in the same run; and the
check of the capture against the HF directory.

    python benchmarks/bench_runtime_capture.py [--repeat 3] [--tokens 16]

Needs transformers, gguf and xllamacpp (pip install --no-deps xllamacpp). Each command runs in a
fresh interpreter (its cost includes the imports); medians of --repeat runs are printed."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=2048,
                    tie_word_embeddings=True)


def build(root: Path) -> tuple[Path, Path]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from parity_cli.sources.synthetic import hf_to_gguf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    hf = root / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(hf)
    return hf, hf_to_gguf(hf, root / "smollm2-135m-shaped.gguf", full=True)


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "parity_cli", *args], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"parity {' '.join(args)} failed: {r.stderr.strip()[-400:]}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    prompt = " ".join(f"w{i % 40}" for i in range(a.tokens))
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
        times = {name: [] for name in rows}
        for _ in range(a.repeat):
            for name, args in rows.items():
                times[name].append(timed(args))
        base = statistics.median(times["capture (HF dir, transformers)"])
        print(f"SmolLM2-135M shape, {a.tokens} tokens, median of {a.repeat}:")
        for name, values in times.items():
            med = statistics.median(values)
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {name:38s} {med:6.2f} s ({runs})  {med / base:.2f}x the transformers capture")
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
