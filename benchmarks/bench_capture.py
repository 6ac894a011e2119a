"""Real activations (issue 17): what `parity capture` costs per 1k tokens, against the bare
forward pass of the same model in the same process, and what `--activations` adds to a check.

    python benchmarks/bench_capture.py --repeat 3

The model is a random-weight LlamaForCausalLM (hidden 512, 4 layers, vocab 1000, float32) with a
word-level tokenizer, written once under $PARITY_BENCH_DIR (default /tmp/parity-bench)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_ROOT, median, parity_cmd, print_machine, run_child  # noqa: E402


def ensure_model(path: Path) -> Path:
    if (path / "model.safetensors").exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=1000, rms_norm_eps=1e-6, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(998)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(path)
    return path


def bare_forward(model_dir: Path, tokens: int, repeat: int) -> float:
    """The model's own forward on the same tokens, no hooks: the baseline, in this process."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([[2 + (7 * i) % 998 for i in range(tokens)]])
    times = []
    with torch.no_grad():
        model(input_ids=ids[:, :16])
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - t0)
    return median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1000)
    args = ap.parse_args(argv)
    print_machine(None)
    model = ensure_model(DEFAULT_ROOT / "capture-llama-h512")
    out = Path(tempfile.mkdtemp(prefix="parity-bench-capture-"))
    text = " ".join(f"w{(7 * i) % 998}" for i in range(args.tokens))
    (out / "text.txt").write_text(text)
    acts = out / "acts.safetensors"
    cap = [run_child(parity_cmd() + ["capture", str(model), "--text", str(out / "text.txt"), "--max-tokens",
                                     str(args.tokens), "-o", str(acts)])["wall"] for _ in range(args.repeat)]
    startup = [run_child(parity_cmd() + ["inspect", str(model)])["wall"] for _ in range(args.repeat)]
    fwd = bare_forward(model, args.tokens, args.repeat)
    print(f"\n== capture: {args.tokens} tokens, 4 x 2 + 1 = 9 norm layers, 96 rows each, median of {args.repeat} ==")
    print(f"  parity capture (whole command)      {median(cap):6.2f}s  (runs {' '.join(f'{t:.2f}' for t in cap)})")
    print(f"  parity inspect (start-up + reading) {median(startup):6.2f}s")
    print(f"  bare forward in-process             {fwd:6.3f}s")
    print(f"  => capture per 1k tokens {1000 * median(cap) / args.tokens:.2f}s whole command; "
          f"{1000 * (median(cap) - median(startup)) / args.tokens:.2f}s beyond start-up, "
          f"{(median(cap) - median(startup)) / fwd:.1f}x the bare forward")
    base = parity_cmd() + ["check", str(model), "-q", "--json", str(out / "r.json")]
    runs = {"without --activations": [], "with --activations": []}
    for _ in range(args.repeat):
        runs["without --activations"].append(run_child(base)["wall"])
        runs["with --activations"].append(run_child(base + ["--activations", str(acts)])["wall"])
    for label, ts in runs.items():
        print(f"  check {label:<24} {median(ts):6.2f}s (runs {' '.join(f'{t:.2f}' for t in ts)})")
    ratio = median(runs["with --activations"]) / median(runs["without --activations"])
    print(f"  => check with / without --activations = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
