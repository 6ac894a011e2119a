"""Synthetic Hugging Face checkpoints with real tensor names: the demo and the tests use them.

`python -m parity_cli.synthetic DIR` rebuilds the bundled demo checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Per model_type: which per-layer norms exist, the gain offset convention of the weights.
LAYOUTS = {
    "llama": (["input_layernorm", "post_attention_layernorm"], False),
    "mistral": (["input_layernorm", "post_attention_layernorm"], False),
    "qwen2": (["input_layernorm", "post_attention_layernorm"], False),
    "qwen3": (["input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"], False),
    "gemma": (["input_layernorm", "post_attention_layernorm"], True),
    "gemma2": (["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm"], True),
    "gemma3_text": (["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"], True),
}
LAYOUTS["gemma3"] = LAYOUTS["gemma3_text"]


def norm_tensors(model_type: str, layers: int, hidden: int, head_dim: int, root: str = "model.") -> dict[str, int]:
    """Norm tensor name -> size, as the family's HF modeling code names them."""
    names, _ = LAYOUTS[model_type]
    out = {}
    for i in range(layers):
        for n in names:
            out[f"{root}layers.{i}.{n}.weight"] = head_dim if n.startswith("self_attn.") else hidden
    out[f"{root}norm.weight"] = hidden
    return out


def write_checkpoint(directory, model_type: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     eps: float | None = 1e-6, dtype: str = "bfloat16", shards: int = 1, seed: int = 0,
                     root: str = "model.", config_extra: dict | None = None, weights: dict | None = None) -> Path:
    """Writes config.json and model.safetensors (or `shards` files plus an index).

    Gains are realistic: around 1 for w-gain families, around 0 (stored w) for Gemma.
    Non-norm tensors are included so that tests can see they are never materialised."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    _, zero_centred = LAYOUTS[model_type]
    tensors = {}
    for name, size in norm_tensors(model_type, layers, hidden, head_dim, root).items():
        w = 0.1 * torch.randn(size, generator=gen, dtype=torch.float64)
        tensors[name] = (w if zero_centred else 1.0 + w).to(tdtype)
    tensors[f"{root}embed_tokens.weight"] = torch.randn(32, hidden, generator=gen).to(tdtype)
    for i in range(layers):
        tensors[f"{root}layers.{i}.self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=gen).to(tdtype)
    if weights:
        tensors.update(weights)
    config = {"model_type": model_type, "hidden_size": hidden, "num_attention_heads": heads,
              "num_hidden_layers": layers, "head_dim": head_dim, "torch_dtype": dtype}
    if eps is not None:
        config["rms_norm_eps"] = eps
    config.update(config_extra or {})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if shards <= 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def write_demo(directory) -> Path:
    """The bundled demo: a 2-layer Llama with eps 1e-5, stored in bfloat16 like most HF uploads."""
    return write_checkpoint(directory, "llama", layers=2, hidden=64, heads=4, eps=1e-5, dtype="bfloat16", seed=2373)


if __name__ == "__main__":
    print(write_demo(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "demo"))
