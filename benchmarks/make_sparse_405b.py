"""Write a Llama-3.1-405B-shaped sharded Hugging Face checkpoint as sparse files.

Every shard is a valid safetensors file (8-byte little-endian header length, JSON header
with dtype/shape/data_offsets, contiguous data), but only the bytes of the norm tensors
(input_layernorm, post_attention_layernorm of every layer, model.norm) are written; every
other tensor (q/k/v/o projections, MLP gate/up/down, embed_tokens, lm_head) is a hole left by
seek()/truncate(). The full shape declares ~812 GB and takes ~9 MB on disk.

    python benchmarks/make_sparse_405b.py /tmp/llama405b                 # the 405B shape, 191 shards
    python benchmarks/make_sparse_405b.py /tmp/l8 --layers 8 --hidden 4096  # smaller variants

Smaller variants keep head_dim 128 (heads = hidden / 128, kv heads = min(8, heads)),
intermediate = 3.25 x hidden (53248 at 16384) and the vocabulary, and split into as many
shards as keep the 405B shard size (~4.25 GB declared), so shard count grows with the model.
Only the standard library and torch (for bf16 rounding) are used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# the writer is parity's own (tests serve the same checkpoint over HTTP): parity_cli.sources.synthetic
from parity_cli.sources.synthetic import L405, write_sparse_llama  # noqa: E402

MARKER = ".sparse-benchmark-checkpoint"  # --force replaces only directories that carry it


def make(directory, layers: int = L405["layers"], hidden: int = L405["hidden"], intermediate: int | None = None,
         shards: int | None = None, vocab: int = L405["vocab"], seed: int = 0, force: bool = False) -> dict:
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        if not force:
            raise SystemExit(f"{directory}: exists and is not empty (use --force to replace it)")
        if not (directory / MARKER).is_file():
            raise SystemExit(f"{directory}: not made by this script (no {MARKER}); refusing to delete it")
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text("written by benchmarks/make_sparse_405b.py; safe to delete\n")
    return write_sparse_llama(directory, layers, hidden, intermediate, shards, vocab, seed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--layers", type=int, default=L405["layers"], help="decoder layers (default 126)")
    ap.add_argument("--hidden", type=int, default=L405["hidden"], help="hidden size (default 16384)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default 3.25 x hidden)")
    ap.add_argument("--vocab", type=int, default=L405["vocab"], help="vocabulary (default 128256)")
    ap.add_argument("--shards", type=int, default=None, help="shard count (default: the 405B's shard size; 191)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="replace DIRECTORY if this script made it")
    ap.add_argument("--verify", action="store_true", help="compare du with ls -l and run 'parity inspect' on it")
    args = ap.parse_args(argv)
    info = make(args.directory, args.layers, args.hidden, args.intermediate, args.shards, args.vocab, args.seed,
                args.force)
    print(f"{info['path']}: {info['parameters'] / 1e9:.1f}B parameters, {info['layers']} layers, hidden "
          f"{info['hidden']}, intermediate {info['intermediate']}, {info['shards']} shards, "
          f"{info['norm_layers']} norm tensors")
    print(f"declared {info['declared_bytes'] / 1e9:.1f} GB, on disk {info['on_disk_bytes'] / 1e6:.1f} MB "
          f"(norm data {info['norm_bytes'] / 1e6:.1f} MB); sparse ratio "
          f"{info['declared_bytes'] / max(1, info['on_disk_bytes']):.0f}x")
    if args.verify:
        import subprocess

        for cmd in (["du", "-sh", args.directory], ["du", "-sh", "--apparent-size", args.directory]):
            print("$", " ".join(cmd), "->", subprocess.run(cmd, capture_output=True, text=True).stdout.strip())
        first = sorted(Path(args.directory).glob("*.safetensors"))[0]
        print("$ ls -ls", first.name, "->", subprocess.run(["ls", "-ls", str(first)], capture_output=True,
                                                          text=True).stdout.strip())
        from safetensors import safe_open

        with safe_open(str(first), framework="pt") as f:  # safetensors' own validation of the header
            print(f"safe_open({first.name}) ok: {len(list(f.keys()))} tensors")
        cmd = ["parity", "inspect", args.directory, "--json", os.devnull]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print("$", " ".join(cmd), "-> exit", r.returncode, (r.stderr.strip().splitlines() or [""])[-1])
        return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
