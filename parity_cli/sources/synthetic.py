"""Synthetic Hugging Face checkpoints with real tensor names: the demo and the tests use them.

The layouts below are transcribed from the transformers modeling code (tests check them
against transformers' own state_dict names where it is installed).
`python -m parity_cli.sources.synthetic DIR` rebuilds the bundled demo checkpoint."""

from __future__ import annotations

import array
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    """Per model_type: norm tensors per layer i (template, size), final norms, conventions."""

    per_layer: tuple[tuple[str, str], ...]
    final: tuple[tuple[str, str], ...] = (("{root}norm", "hidden"),)
    root: str = "model."
    eps_key: str = "rms_norm_eps"
    zero_centred: bool = False  # stored w around 0 (gain 1 + w)
    bias: bool = False
    statistics: bool = False  # a BatchNorm's running_mean, running_var and num_batches_tracked beside w
    config: dict = field(default_factory=dict)


_LLAMA = (("{root}layers.{i}.input_layernorm", "hidden"), ("{root}layers.{i}.post_attention_layernorm", "hidden"))
_QK = (("{root}layers.{i}.self_attn.q_norm", "head_dim"), ("{root}layers.{i}.self_attn.k_norm", "head_dim"))
_GEMMA2 = _LLAMA + (("{root}layers.{i}.pre_feedforward_layernorm", "hidden"),
                    ("{root}layers.{i}.post_feedforward_layernorm", "hidden"))

LAYOUTS = {
    "llama": Layout(_LLAMA),
    "mistral": Layout(_LLAMA),
    "mixtral": Layout(_LLAMA),
    "qwen2": Layout(_LLAMA),
    "qwen2_moe": Layout(_LLAMA),
    "phi3": Layout(_LLAMA),
    "qwen3": Layout(_QK + _LLAMA),
    "qwen3_moe": Layout(_QK + _LLAMA),
    "deepseek_v3": Layout((("{root}layers.{i}.self_attn.q_a_layernorm", "q_lora_rank"),
                           ("{root}layers.{i}.self_attn.kv_a_layernorm", "kv_lora_rank")) + _LLAMA,
                          config={"q_lora_rank": 24, "kv_lora_rank": 16}),
    "gemma": Layout(_LLAMA, zero_centred=True),
    "gemma2": Layout(_GEMMA2, zero_centred=True),
    "gemma3_text": Layout(_QK + _GEMMA2, zero_centred=True),
    "gemma3n_text": Layout(_QK + _GEMMA2 + (("{root}layers.{i}.altup.router_norm", "hidden"),
                                           ("{root}layers.{i}.laurel.post_laurel_norm", "hidden"),
                                           ("{root}layers.{i}.post_per_layer_input_norm", "hidden")),
                           final=(("{root}norm", "hidden"), ("{root}per_layer_projection_norm", "per_layer")),
                           config={"hidden_size_per_layer_input": 8}),
    "olmo2": Layout((("{root}layers.{i}.self_attn.q_norm", "heads*head_dim"),
                     ("{root}layers.{i}.self_attn.k_norm", "kv_heads*head_dim"),
                     ("{root}layers.{i}.post_attention_layernorm", "hidden"),
                     ("{root}layers.{i}.post_feedforward_layernorm", "hidden"))),
    "cohere": Layout((("{root}layers.{i}.self_attn.q_norm", "heads x head_dim"),
                      ("{root}layers.{i}.self_attn.k_norm", "kv_heads x head_dim"),
                      ("{root}layers.{i}.input_layernorm", "hidden")),
                     eps_key="layer_norm_eps", config={"use_qk_norm": True}),
    "t5": Layout((("encoder.block.{i}.layer.0.layer_norm", "hidden"), ("encoder.block.{i}.layer.1.layer_norm", "hidden"),
                  ("decoder.block.{i}.layer.0.layer_norm", "hidden"), ("decoder.block.{i}.layer.1.layer_norm", "hidden"),
                  ("decoder.block.{i}.layer.2.layer_norm", "hidden")),
                 final=(("encoder.final_layer_norm", "hidden"), ("decoder.final_layer_norm", "hidden")),
                 root="", eps_key="layer_norm_epsilon"),
    "gpt2": Layout((("{root}h.{i}.ln_1", "hidden"), ("{root}h.{i}.ln_2", "hidden")), final=(("{root}ln_f", "hidden"),),
                   root="transformer.", eps_key="layer_norm_epsilon", bias=True),
    "gpt_neox": Layout((("{root}layers.{i}.input_layernorm", "hidden"), ("{root}layers.{i}.post_attention_layernorm", "hidden")),
                       final=(("{root}final_layer_norm", "hidden"),), root="gpt_neox.", eps_key="layer_norm_eps", bias=True),
    "falcon": Layout((("{root}h.{i}.input_layernorm", "hidden"),), final=(("{root}ln_f", "hidden"),),
                     root="transformer.", eps_key="layer_norm_epsilon", bias=True),
    "phi": Layout((("{root}layers.{i}.self_attn.q_layernorm", "head_dim"), ("{root}layers.{i}.self_attn.k_layernorm", "head_dim"),
                   ("{root}layers.{i}.input_layernorm", "hidden")),
                  final=(("{root}final_layernorm", "hidden"),), eps_key="layer_norm_eps", bias=True,
                  config={"qk_layernorm": True}),
    "bert": Layout((("{root}encoder.layer.{i}.attention.output.LayerNorm", "hidden"),
                    ("{root}encoder.layer.{i}.output.LayerNorm", "hidden")),
                   final=(("{root}embeddings.LayerNorm", "hidden"), ("cls.predictions.transform.LayerNorm", "hidden")),
                   root="bert.", eps_key="layer_norm_eps", bias=True),
    # Nemotron's LayerNorm1P: a LayerNorm with bias whose gain is 1 + w (stored w around 0)
    "nemotron": Layout(_LLAMA, eps_key="norm_eps", bias=True, zero_centred=True),
    # ResNetModel's BatchNorm2d (eps 1e-5 in the model code, no config key): a bottleneck's three
    # and the stem's, running variances over decades (some channels near eps, where it shows)
    "resnet": Layout(tuple((f"{{root}}encoder.stages.0.layers.{{i}}.layer.{k}.normalization", "hidden")
                           for k in range(3)),
                     final=(("{root}embedder.embedder.normalization", "hidden"),), root="", eps_key="",
                     bias=True, statistics=True),
    # Mamba2: an RMSNorm a block and the mixer's gated norm, RMSNorm(x * silu(z)) per n_groups groups
    "mamba2": Layout((("{root}layers.{i}.norm", "hidden"), ("{root}layers.{i}.mixer.norm", "hidden")),
                     final=(("{root}norm_f", "hidden"),), root="backbone.", eps_key="layer_norm_epsilon",
                     config={"n_groups": 4}),
    # Mask2Former's pixel decoder: GroupNorm(32, C) after each input projection (eps 1e-5 in the code)
    "mask2former": Layout((), final=tuple((f"{{root}}pixel_level_module.decoder.input_projections.{k}.1", "hidden")
                                          for k in range(3)), eps_key="", bias=True),
    # OLMo-1: LayerNorms without parameters (eps 1e-5 inside forward): nothing stored, found by their blocks
    "olmo": Layout((("{root}layers.{i}.input_layernorm", "none"), ("{root}layers.{i}.post_attention_layernorm", "none")),
                   final=(("{root}norm", "none"),), eps_key=""),
}
LAYOUTS["gemma3"] = LAYOUTS["gemma3_text"]


def _size(spec: str, sizes: dict) -> tuple[int, ...]:
    if " x " in spec:
        return tuple(sizes[p] for p in spec.split(" x "))
    n = 1
    for part in spec.split("*"):
        n *= sizes[part]
    return (n,)


def norm_tensors(model_type: str, layers: int, sizes: dict, root: str | None = None) -> dict[str, tuple[int, ...]]:
    """Norm weight tensor name -> shape, as the family's HF modeling code names them."""
    layout = LAYOUTS[model_type]
    root = layout.root if root is None else root
    out = {}
    for i in range(layers):
        for template, size in layout.per_layer:
            if size != "none":  # a weightless norm stores nothing
                out[template.format(root=root, i=i) + ".weight"] = _size(size, sizes)
    for template, size in layout.final:
        if size != "none":
            out[template.format(root=root) + ".weight"] = _size(size, sizes)
    return out


def write_checkpoint(directory, model_type: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4,
                     eps: float | None = 1e-6, dtype: str = "bfloat16", shards: int = 1, seed: int = 0,
                     root: str | None = None, config_extra: dict | None = None, weights: dict | None = None,
                     kv_heads: int | None = None) -> Path:
    """Writes config.json and model.safetensors (or `shards` files plus an index).

    Gains are realistic: around 1 for w-gain families, around 0 (stored w) for Gemma; LayerNorm
    families get a bias around 0. Non-norm tensors are included so that tests can see they are
    never materialised."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layout = LAYOUTS[model_type]
    root = layout.root if root is None else root
    head_dim = hidden // heads
    kv_heads = kv_heads or max(1, heads // 2)
    config = {"model_type": model_type, "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "head_dim": head_dim,
              "torch_dtype": dtype, **layout.config}
    if model_type == "gpt2":
        config.update(n_embd=hidden, n_head=heads, n_layer=layers)
    if model_type == "t5":
        config.update(d_model=hidden, num_heads=heads, num_layers=layers, num_decoder_layers=layers, d_kv=head_dim)
    if eps is not None and layout.eps_key:
        config[layout.eps_key] = eps
    config.update(config_extra or {})
    sizes = {"hidden": hidden, "head_dim": head_dim, "heads": heads, "kv_heads": kv_heads,
             "q_lora_rank": config.get("q_lora_rank", 0), "kv_lora_rank": config.get("kv_lora_rank", 0),
             "per_layer": config.get("hidden_size_per_layer_input", 0)}

    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    tensors = {}
    for name, shape in norm_tensors(model_type, layers, sizes, root).items():
        w = 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        tensors[name] = (w if layout.zero_centred else 1.0 + w).to(tdtype)
        if layout.bias:
            tensors[name[: -len("weight")] + "bias"] = (0.05 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(tdtype)
        if layout.statistics:
            stem = name[: -len("weight")]
            tensors[stem + "running_mean"] = (0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(tdtype)
            decades = torch.rand(shape, generator=gen, dtype=torch.float64) * 7 - 6  # 1e-6 .. 10
            tensors[stem + "running_var"] = torch.pow(10.0, decades).to(tdtype)
            tensors[stem + "num_batches_tracked"] = torch.tensor(1000, dtype=torch.int64)
    tensors[f"{root}embed_tokens.weight"] = torch.randn(32, hidden, generator=gen).to(tdtype)
    for i in range(layers):
        tensors[f"{root}layers.{i}.self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=gen).to(tdtype)
    if weights:
        tensors.update(weights)
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
    print(write_demo(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "demo"))


# model_type -> GGUF general.architecture, as llama.cpp's converter names them
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
             "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3", "olmo2": "olmo2", "phi3": "phi3"}


def hf_to_gguf(hf_dir, out_path, *, eps: float | None = None, offset: str = "baked", drop: tuple = (),
               f16: tuple = (), norm_dtype: str = "F32", full: bool = False, swap: tuple = ()) -> Path:
    """A miniature llama.cpp conversion of a synthetic HF checkpoint's norm tensors, written with
    gguf's own GGUFWriter: metadata, every norm weight (F32, or `norm_dtype`), and one Q8_0
    projection that must never be decoded. Planted conversion faults: `eps` (the value written),
    `offset` ("baked" as the converter does for Gemma, "missing", "twice"), `drop` (HF layer
    names left out), `f16` (HF layer names stored as F16), `swap` (two HF layer names whose gains
    trade places under their own names).

    `full=True` converts a whole model llama.cpp can run (a transformers checkpoint with every
    tensor): every tensor under llama.cpp's name (Llama's q/k rows permuted as convert_hf_to_gguf.py
    does), the metadata llama.cpp's loader reads, and a sentencepiece vocabulary of `vocab_size`
    pieces ("\u2581w0" .. "\u2581w39" for the words w0 .. w39)."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    model_type = config["model_type"]
    arch = GGUF_ARCH[model_type]
    arch_enum = next(e for e, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    gemma_like = model_type in ("gemma", "gemma2", "gemma3", "gemma3_text")
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    if swap:  # two layers' gains, each stored under the other's name
        a, b = (f"{n}.weight" for n in swap)
        tensors[a], tensors[b] = tensors[b], tensors[a]
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"] if eps is None else eps)
    if full:
        _whole_model(writer, config, head_dim)
    for name, t in sorted(tensors.items()):
        if not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        gguf_name = names.get_name(base)
        if gguf_name is not None and full and "norm" not in gguf_name:
            writer.add_tensor(f"{gguf_name}.weight", _converted(name, t, config, arch).numpy())
            continue
        if gguf_name is None or "norm" not in gguf_name or base in drop:
            continue
        # llama.cpp's converter upcasts a tensor to float32 first unless it is float16 or float32, so a
        # float16 checkpoint's 1 + w is formed, and rounded, in float16
        w = t if t.dtype == torch.float16 else t.to(torch.float32)
        if gemma_like:
            w = w + {"baked": 1.0, "missing": 0.0, "twice": 2.0}[offset]
        w = w.to(torch.float32)
        dtype = "F16" if base in f16 else norm_dtype
        if dtype == "F16":
            writer.add_tensor(f"{gguf_name}.weight", w.numpy().astype(np.float16))
        elif dtype == "BF16":
            bits = (w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
            writer.add_tensor(f"{gguf_name}.weight", bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(f"{gguf_name}.weight", w.numpy().astype(np.float32))
    if not full:
        proj = np.random.default_rng(0).standard_normal((config["hidden_size"], 64)).astype(np.float32)
        writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(proj, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def _whole_model(writer, config: dict, head_dim: int) -> None:
    """The metadata llama.cpp's loader needs beyond the norms', and a sentencepiece vocabulary."""
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_file_type(0)
    vocab = config["vocab_size"]
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "w"] + [str(d) for d in range(10)] + ["\u2581w"]
    pieces += [f"\u2581w{i}" for i in range(40)]
    if vocab < len(pieces):
        raise ValueError(f"a whole-model GGUF needs a vocabulary of at least {len(pieces)} pieces")
    pieces += [f"<unused{k}>" for k in range(vocab - len(pieces))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(pieces) - 4)])
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(pieces) - 4))  # control, unknown, normal
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)


def _converted(name: str, t, config: dict, arch: str):
    """A non-norm tensor as llama.cpp's converter stores it: float32, and for Llama the q/k rows
    permuted from HF's rotate-half layout to GGML's interleaved one (LlamaModel.permute)."""
    w = t.float()
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads"] if name.endswith("q_proj.weight") else config.get(
            "num_key_value_heads", config["num_attention_heads"])
        w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.contiguous()


def _decoder_config(hidden: int, layers: int, eps: float, extra: dict) -> dict:
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=hidden // 4, vocab_size=100, max_position_embeddings=512,
                rms_norm_eps=eps, **extra)


def _bert_config(hidden: int, layers: int, eps: float) -> dict:
    """position_embedding_type: as published BERT configs hold it (transformers 5 dropped the key;
    CTranslate2's converter still asserts it)."""
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                vocab_size=100, max_position_embeddings=512, layer_norm_eps=eps, position_embedding_type="absolute")


def _code_eps(model_type: str, eps: float) -> None:
    """Whisper's, BART's, Marian's and OPT's LayerNorms take nn.LayerNorm's 1e-5 in their code: another eps
    has no key to go to, and is refused rather than dropped."""
    if eps != 1e-5:
        raise ValueError(f"{model_type} fixes its LayerNorms' eps at 1e-5 in its code; {eps:g} has no config key")


def _whisper_config(hidden: int, layers: int, eps: float) -> dict:
    _code_eps("whisper", eps)
    return dict(d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=2 * hidden, decoder_ffn_dim=2 * hidden, vocab_size=100,
                num_mel_bins=80, max_source_positions=64, max_target_positions=64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])


def _seq2seq_config(hidden: int, layers: int, eps: float) -> dict:
    """BART and Marian (eps: _code_eps). normalize_before: as published BART configs hold it
    (transformers 5 dropped the key; CTranslate2's converter still reads it). The vocabulary is the
    word-level tokenizer's (43 words), which the converter takes as the model's."""
    _code_eps("bart/marian", eps)
    return dict(d_model=hidden, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=2 * hidden, decoder_ffn_dim=2 * hidden, vocab_size=43,
                max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                forced_eos_token_id=2, normalize_before=False)


def _opt_config(hidden: int, layers: int, eps: float) -> dict:
    """OPT (eps: _code_eps). The vocabulary: the word-level tokenizer's 43 words and the 5 ids
    CTranslate2's OPT loader adds."""
    _code_eps("opt", eps)
    return dict(hidden_size=hidden, num_hidden_layers=layers, ffn_dim=2 * hidden, num_attention_heads=4, vocab_size=48,
                max_position_embeddings=64, word_embed_proj_dim=hidden, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _falcon_config(h, n, e, extra) -> dict:
    # the word-level tokenizer's 43 words, which CTranslate2's converter takes as the vocabulary
    return dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=4, vocab_size=43, layer_norm_epsilon=e,
                bos_token_id=1, eos_token_id=2, **extra)


# model type -> (its config class, the model class written, its config's keyword arguments (hidden, layers, eps))
RUNNABLE = {"llama": ("LlamaConfig", "LlamaForCausalLM", lambda h, n, e: _decoder_config(h, n, e, {})),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", lambda h, n, e: _decoder_config(h, n, e, {})),
            "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                            lambda h, n, e: _decoder_config(h, n, e, {"sliding_window": 32})),
            "bert": ("BertConfig", "BertModel", _bert_config),
            "opt": ("OPTConfig", "OPTForCausalLM", _opt_config),
            # T5's RMSNorms; a vocabulary of the tokenizer's 43 words and the 5 ids CTranslate2's loader adds
            "t5": ("T5Config", "T5ForConditionalGeneration",
                   lambda h, n, e: dict(d_model=h, d_kv=h // 4, d_ff=2 * h, num_layers=n, num_decoder_layers=n,
                                        num_heads=4, vocab_size=48, layer_norm_epsilon=e, pad_token_id=0,
                                        eos_token_id=2, decoder_start_token_id=0)),
            "gpt2": ("GPT2Config", "GPT2LMHeadModel",
                     # the word-level tokenizer's vocabulary (43 words), which CTranslate2's converter takes
                     lambda h, n, e: dict(n_embd=h, n_layer=n, n_head=4, n_positions=64, vocab_size=43,
                                          bos_token_id=1, eos_token_id=2, layer_norm_epsilon=e)),
            # Falcon-7B's layout (multi-query, attention and MLP in parallel off one shared LayerNorm);
            # falcon_2ln Falcon-40B's (new_decoder_architecture: ln_attn and ln_mlp); falcon_seq the
            # sequential one (input_layernorm, post_attention_layernorm)
            "falcon": ("FalconConfig", "FalconForCausalLM", lambda h, n, e: _falcon_config(h, n, e, {})),
            "falcon_2ln": ("FalconConfig", "FalconForCausalLM", lambda h, n, e: _falcon_config(
                h, n, e, {"new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": False})),
            "falcon_seq": ("FalconConfig", "FalconForCausalLM", lambda h, n, e: _falcon_config(
                h, n, e, {"parallel_attn": False, "multi_query": False})),
            "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", _whisper_config),
            "bart": ("BartConfig", "BartForConditionalGeneration", _seq2seq_config),
            # Marian's converter takes a vocabulary one shorter than the model's (its pad is added back)
            "marian": ("MarianConfig", "MarianMTModel",
                       lambda h, n, e: {**_seq2seq_config(h, n, e), "vocab_size": 44})}


def write_runnable(directory, model_type: str = "llama", *, layers: int = 2, hidden: int = 64, eps: float = 1e-5,
                   seed: int = 0, dtype: str = "float32", tokenizer: bool = False) -> Path:
    """A whole tiny transformers model (random weights, stored at `dtype`) that runs: every norm gain
    drawn around its family's value (1 for w, 0 for Gemma's stored w), and every norm bias around 0,
    so that no two layers' gains agree. `tokenizer`: a word-level tokenizer.json beside it (words w0 ..
    w39), what exporters such as mlx_lm.convert load with the model. Needs transformers."""
    import torch
    import transformers

    config_cls, model_cls, arguments = RUNNABLE[model_type]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**arguments(hidden, layers, eps))
    model = getattr(transformers, model_cls)(config).eval()
    zero_centred = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.lower().endswith(("norm.weight", "norm.bias")) or name.split(".")[-2].startswith("ln_")
            if norm and name.endswith(".weight"):  # LayerNorm.weight (BERT), ln_1.weight (GPT-2) too
                p.copy_((0.0 if zero_centred else 1.0) + 0.1 * torch.randn_like(p))
            elif norm and name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
    directory = Path(directory)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    if tokenizer:
        write_word_tokenizer(directory)
    return directory


def write_word_tokenizer(directory, words: int = 40) -> Path:
    """tokenizer.json and tokenizer_config.json of a word-level tokenizer: <unk> <s> </s>, then the
    words w0 .. w{words-1} split on whitespace (the `tokenizers` library's files: data, no code)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": 3 + i for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        directory)
    return Path(directory)



# Llama-3.1-405B (meta-llama/Llama-3.1-405B config.json)
L405 = dict(layers=126, hidden=16384, intermediate=53248, heads=128, kv_heads=8, vocab=128256, shards=191)
BF16 = 2


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


def write_sparse_llama(directory, layers: int = L405["layers"], hidden: int = L405["hidden"],
                       intermediate: int | None = None, shards: int | None = None, vocab: int = L405["vocab"],
                       seed: int = 0) -> dict:
    """A Llama checkpoint of a true layout and size (the 405B's by default: 191 shards, 812 GB
    declared) as sparse files: every header is real, the norm gains are real values, every other
    tensor is a hole. What a remote check should fetch of it is the headers and the gains."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
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
