"""Time to capture 16 tokens from a llama.cpp GGUF of SmolLM2-135M's shape (random weights, F16 as
llama.cpp's converter writes the big matrices, F32 norms), against the same model as an HF directory,
measured in the same run, and against transformers' own GGUF loader (the whole file dequantized).

    python benchmarks/bench_capture_gguf.py [--repeat 3] [--tokens 16]

Builds the files under a temporary directory with gguf-py and transformers (no download), runs
`parity capture` in a fresh interpreter for each (a capture's cost includes transformers' import),
and prints medians and their ratios; the baselines are the same GGUF capture through transformers'
loader, parsing the file for each of its calls (what `parity capture` did first) or once."""

from __future__ import annotations

import argparse
import json
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
    import gguf
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_135M)
    model = LlamaForCausalLM(cfg)
    hf = root / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    vocab = ["<|endoftext|>", "Ġ", "w"] + [str(d) for d in range(10)] + ["Ġw"] + [f"Ġw{i}" for i in range(100)]
    merges = ["Ġ w"] + [f"Ġw {i}" for i in range(10)] + [f"Ġw{i // 10} {i % 10}" for i in range(10, 100)]
    vocab += [f"<pad{k}>" for k in range(cfg.vocab_size - len(vocab))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab[:200])}, unk_token=vocab[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=vocab[0]).save_pretrained(hf)
    out = root / "smollm2-135m-shaped.gguf"
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_merges(merges)
    w.add_token_types([3] + [1] * (len(vocab) - 1))
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for k, t in model.state_dict().items():
        g = names.get_name(k[: -len(".weight")])
        if g is None:
            continue
        arr = t.float().numpy()
        w.add_tensor(f"{g}.weight", arr if arr.ndim == 1 else arr.astype("float16"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out, hf


# the baselines, in the same run: transformers' own GGUF loader on the whole file, parsing it for each
# of its calls (what `parity capture` did first), and with one parse lent to those calls (the step after)
AS_TRANSFORMERS = """
import sys
import parity_cli.probes.capture as c
SHARED = {shared}
def load(model_dir, source, names):
    return c._gguf_via_transformers(model_dir, source, None, c._read_gguf(model_dir, source) if SHARED else None)
c._load_gguf = load
from parity_cli.cli import main
main(sys.argv[1:])
"""
BASELINES = {"gguf_transformers_each_call": AS_TRANSFORMERS.format(shared=False),
             "gguf_transformers_one_parse": AS_TRANSFORMERS.format(shared=True)}


def timed(model: Path, tokens: int, out: Path, baseline: str | None = None) -> float:
    prompt = " " + " ".join(f"w{i % 100}" for i in range(tokens))
    start = time.perf_counter()
    head = [sys.executable, "-c", BASELINES[baseline]] if baseline else [sys.executable, "-m", "parity_cli"]
    r = subprocess.run(head + ["capture", str(model), "--prompt", prompt,
                               "--max-tokens", str(tokens), "-o", str(out)], capture_output=True, text=True)
    took = time.perf_counter() - start
    if r.returncode:
        raise SystemExit(f"capture failed: {r.stderr.strip()}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="parity-bench-capture-") as tmp:
        root = Path(tmp)
        gguf_path, hf = build(root)
        names = ("gguf", *BASELINES, "hf")
        times = {name: [] for name in names}
        for k in range(args.repeat):  # interleaved: a load on the machine hits all alike
            for name in names:
                model = hf if name == "hf" else gguf_path
                times[name].append(timed(model, args.tokens, root / f"{name}{k}.safetensors",
                                         baseline=name if name in BASELINES else None))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"tokens": args.tokens, "repeat": args.repeat, "median_s": med,
                          "gguf_over_hf": med["gguf"] / med["hf"],
                          **{f"{b}_over_gguf": med[b] / med["gguf"] for b in BASELINES},
                          "runs_s": times}, indent=2))

if __name__ == "__main__":
    main()
