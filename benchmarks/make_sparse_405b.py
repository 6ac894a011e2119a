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
import array
import json
import math
import os
import shutil
import struct
import sys
from pathlib import Path

# Llama-3.1-405B (meta-llama/Llama-3.1-405B config.json)
L405 = dict(layers=126, hidden=16384, intermediate=53248, heads=128, kv_heads=8, vocab=128256, shards=191)
BF16 = 2
MARKER = ".sparse-benchmark-checkpoint"  # --force replaces only directories that carry it


def config_for(layers: int, hidden: int, intermediate: int | None = None, vocab: int = L405["vocab"]) -> dict:
    heads = max(1, hidden // 128) if hidden >= 128 else 1
    head_dim = hidden // heads
    kv_heads = min(8, heads)
    if intermediate is None:
        intermediate = hidden * L405["intermediate"] // L405["hidden"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


def tensors_for(cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) in state_dict order, as LlamaForCausalLM names them."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h), False)]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h), False),
            (p + "self_attn.k_proj.weight", (kv, h), False),
            (p + "self_attn.v_proj.weight", (kv, h), False),
            (p + "self_attn.o_proj.weight", (h, q), False),
            (p + "mlp.gate_proj.weight", (i, h), False),
            (p + "mlp.up_proj.weight", (i, h), False),
            (p + "mlp.down_proj.weight", (h, i), False),
            (p + "input_layernorm.weight", (h,), True),
            (p + "post_attention_layernorm.weight", (h,), True),
        ]
    out += [("model.norm.weight", (h,), True), ("lm_head.weight", (v, h), False)]
    return out


def nbytes(shape) -> int:
    return math.prod(shape) * BF16


def default_shards(total: int) -> int:
    """Shards of the 405B's size (its declared bytes / 191); exactly 191 for the 405B shape."""
    ref = sum(nbytes(s) for _, s, _ in tensors_for(config_for(L405["layers"], L405["hidden"])))
    return max(1, round(total * L405["shards"] / ref))


def split(tensors, shards: int):
    """Contiguous runs of tensors of about equal declared size (none empty while every
    tensor is smaller than total/shards, which holds for all Llama shapes)."""
    total = sum(nbytes(s) for _, s, _ in tensors)
    groups = [[] for _ in range(shards)]
    start = 0
    for t in tensors:
        groups[min(shards - 1, start * shards // total)].append(t)
        start += nbytes(t[1])
    return [g for g in groups if g]


def norm_bytes(name: str, n: int, seed: int) -> bytes:
    """Realistic RMSNorm gains in bf16: around 1 (0.1 spread), the final norm a bit larger."""
    import zlib

    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    centre = 1.6 if name == "model.norm.weight" else 1.0
    w = (centre + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    bits = array.array("H", w.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).tolist())
    if sys.byteorder != "little":  # safetensors is little-endian
        bits.byteswap()
    return bits.tobytes()


def write_shard(path: Path, group, seed: int) -> tuple[int, int]:
    """Writes header + norm bytes; returns (declared size, norm bytes written)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in group:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes(shape)]}
        offset += nbytes(shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8-byte alignment with spaces
    base = 8 + len(raw)
    written = 0
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape, is_norm in group:
            if is_norm:
                fh.seek(base + header[name]["data_offsets"][0])
                data = norm_bytes(name, shape[0], seed)
                fh.write(data)
                written += len(data)
        fh.truncate(base + offset)  # everything not written is a hole
    return base + offset, written


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
    cfg = config_for(layers, hidden, intermediate, vocab)
    tensors = tensors_for(cfg)
    total = sum(nbytes(s) for _, s, _ in tensors)
    groups = split(tensors, shards or default_shards(total))
    n = len(groups)
    weight_map, declared, written = {}, 0, 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        size, w = write_shard(directory / fname, group, seed)
        declared += size
        written += w
        weight_map.update({name: fname for name, _, _ in group})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    params = sum(math.prod(s) for _, s, _ in tensors)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map}, indent=2))
    on_disk = sum(p.stat().st_blocks * 512 for p in directory.iterdir())
    return {"path": str(directory), "layers": layers, "hidden": hidden, "intermediate": cfg["intermediate_size"],
            "shards": n, "parameters": params, "norm_layers": 2 * layers + 1,
            "declared_bytes": declared, "norm_bytes": written, "on_disk_bytes": on_disk}


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
