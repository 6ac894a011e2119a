"""The `ctranslate2` built-in: the family's norm computed by CTranslate2's own LayerNorm / RMSNorm
(layers::LayerNorm: ops::LayerNorm where the norm has a beta, else ops::RMSNorm, with Gemma's 1 + gamma
as its `layer_norm_use_residual` flag), the kernels faster-whisper and CTranslate2's LLM servers run.

CTranslate2's Python API runs whole models, never one op, so each probe batch becomes a model whose
output is the norm: a pre-norm encoder (ctranslate2.specs.TransformerEncoderSpec) whose embedding
table is the probe rows (one token a row, its position encoding 0), one layer that adds exactly 0
(every weight and bias 0, one attention head of width 1, a feed-forward of width 1), and the final
norm built from the layer's gain, bias and eps. ctranslate2.Encoder.forward_batch's last hidden
state is then that norm of each row. The model is a few kilobytes beside the rows: built, saved and
loaded in a temporary directory at every call (about 30 ms).

CTranslate2's CPU computes float32 (and int8 matrix products, no norm); float16 and bfloat16 exist on
CUDA only. Its CPU LayerNorm takes the variance as E[x^2] - E[x]^2 in float32 (cpu/kernels.cc), one
pass, under -ffast-math."""

from __future__ import annotations

from parity_cli.backends import Runtime, refuse_unbuilt
from parity_cli.errors import InputError

NAME = "ctranslate2"
INSTALL = "pip install ctranslate2"
RUNTIME = Runtime(
    "ctranslate2", "CTranslate2's LayerNorm and RMSNorm (Gemma's 1 + gamma as its use_residual flag), each probe "
    "batch run as a one-norm encoder by ctranslate2.Encoder; float32 on CPU", package="ctranslate2",
    install=INSTALL, public="a model written by ct2-transformers-converter's Python API, run by ctranslate2.Generator",
    order=65)
KINDS = ("rms_norm", "layer_norm")


def _device(weight) -> str:
    return "cuda" if weight.is_cuda else "cpu"


def check_layer(layer, dtype: str | None = None, device: str | None = None) -> None:
    if dtype is not None:  # said once, before any layer runs
        _compute_type(dtype, device or "cpu")
    refuse_unbuilt("--candidate ctranslate2", layer, KINDS, "norm")
    if layer.weight is not None and layer.weight.dim() > 1:
        raise InputError(f"--candidate ctranslate2: {layer.name} has a per-head gain; CTranslate2's norms take one "
                         "value a channel")
    if layer.kind == "layer_norm" and layer.bias is None:
        raise InputError(f"--candidate ctranslate2: {layer.name} is a LayerNorm without a bias; CTranslate2 computes "
                         "a norm without a beta as an RMSNorm")


def _compute_type(dtype: str, device: str) -> str:
    """The compute type CTranslate2 is asked for: the dtype's own name, where the device has it."""
    import ctranslate2

    where = "cuda" if device.startswith("cuda") else "cpu"
    have = ctranslate2.get_supported_compute_types(where)
    if dtype not in have:
        raise InputError(f"--candidate ctranslate2: no {dtype} compute type on {where} (CTranslate2's there: "
                         f"{', '.join(sorted(have))})")
    return dtype


def describe(device: str = "cpu") -> dict:
    from importlib.metadata import version

    return {"runtime": f"ctranslate2 {version('ctranslate2')}", "device": "cuda" if device.startswith("cuda") else "cpu",
            "kernel": "layers::LayerNorm (ops::LayerNorm with a beta, else ops::RMSNorm), in a one-norm encoder",
            "computes_in": "the compute type: float32 on CPU (the variance as E[x^2] - E[x]^2)"}


def _gain(layer, weight):
    """(gamma as CTranslate2 stores it, its use_residual flag): Gemma's 1 + w as the RMSNorm's own flag,
    any other offset folded into gamma in float32."""

    if layer.gain_offset == 1.0 and layer.kind == "rms_norm":
        return weight.detach().float().cpu(), True
    return (weight.detach().double().cpu() + layer.gain_offset).float(), False


def prepare(layer, weight, bias, eps: float):
    """x -> y through a one-norm encoder in CTranslate2 (see the module doc), at the candidate's dtype."""
    import torch

    device, compute = _checked(layer, weight)
    gamma, residual = _gain(layer, weight)
    beta = None if bias is None else bias.detach().float().cpu().numpy()
    return _row_wise(lambda rows: torch.from_numpy(
        _encode(rows.numpy(), gamma.numpy(), beta, eps, residual, compute, device)))


def _checked(layer, weight) -> tuple[str, str]:
    """(the device, the compute type) of a layer both paths build, or its one line."""
    device = _device(weight)
    dtype = str(weight.dtype).removeprefix("torch.")
    check_layer(layer, None, device)
    return device, _compute_type(dtype, device)


def _row_wise(norm):
    """x -> norm(its rows as float32 on the CPU), back in x's shape, dtype and device. No rows: no
    model (CTranslate2 cannot build an empty embedding table, and its Generator dies on an empty batch)."""
    import torch

    def run(x):
        rows = x.detach().reshape(-1, x.shape[-1]).to(device="cpu", dtype=torch.float32)
        if rows.shape[0] == 0:
            return torch.empty_like(x)
        return norm(rows).to(dtype=x.dtype, device=x.device).reshape(x.shape)

    return run


def _encode(rows, gamma, beta, eps: float, residual: bool, compute: str, device: str):
    import tempfile

    import ctranslate2

    with tempfile.TemporaryDirectory(prefix="parity-ct2-") as where:
        _one_norm_encoder(rows, gamma, beta, eps, residual).save(where)
        encoder = ctranslate2.Encoder(where, device=device, compute_type=compute, intra_threads=1)
        out = encoder.forward_batch([[i] for i in range(len(rows))]).last_hidden_state
        y = _to_numpy(out, device)
        del encoder
    return y.reshape(len(rows), -1)


def _to_numpy(out, device: str):
    """A StorageView as a float32 array: on the CPU as it is, from CUDA through torch."""
    import numpy as np
    import torch

    if device == "cpu":
        return np.array(out, copy=True)
    return torch.as_tensor(out, device="cuda").float().cpu().numpy()


def _one_norm_encoder(rows, gamma, beta, eps: float, residual: bool):
    """A pre-norm encoder whose output is its final norm of the embedding rows: one layer adding 0."""
    import numpy as np
    from ctranslate2.specs import transformer_spec

    n, d = rows.shape
    rms = beta is None
    encoder = transformer_spec.TransformerEncoderSpec(1, 1, pre_norm=True, rms_norm=rms, head_dim=1)
    spec = transformer_spec.TransformerEncoderModelSpec(encoder)
    encoder.scale_embeddings = False
    encoder.embeddings[0].weight = np.ascontiguousarray(rows, dtype=np.float32)
    encoder.position_encodings.encodings = np.zeros((1, d), np.float32)
    zeros = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    layer = encoder.layer[0]
    for norm in (layer.self_attention.layer_norm, layer.ffn.layer_norm):  # x + 0 whatever they give
        norm.gamma = zeros(d)
        if not rms:
            norm.beta = zeros(d)
    attention, ffn = layer.self_attention, layer.ffn
    attention.linear[0].weight, attention.linear[0].bias = zeros(3, d), zeros(3)
    attention.linear[1].weight, attention.linear[1].bias = zeros(d, 1), zeros(d)
    ffn.linear_0.weight, ffn.linear_0.bias = zeros(1, d), zeros(1)
    ffn.linear_1.weight, ffn.linear_1.bias = zeros(d, 1), zeros(d)
    encoder.layer_norm.gamma = np.ascontiguousarray(gamma, dtype=np.float32)
    if not rms:
        encoder.layer_norm.beta = np.ascontiguousarray(beta, dtype=np.float32)
    if residual:
        encoder.layer_norm.layer_norm_use_residual = True
    spec.register_vocabulary([f"row{i}" for i in range(n)])
    spec.config.layer_norm_epsilon = float(eps)
    spec.validate()
    spec.optimize(quantization=None)
    return spec


def public_path(layer, weight, bias, eps: float):
    """The same norm through CTranslate2's public path, as a deployment gets it, written apart from
    prepare (issue 46's differential truth): a transformers model whose output is the norm, written
    by transformers, converted by CTranslate2's own converter (TransformersConverter, what
    ct2-transformers-converter runs) and run by ctranslate2.Generator.forward_batch, whose logits are
    the final norm times an identity projection. A Llama for an RMSNorm, a Gemma 3 for 1 + w (its
    embeddings scaled by sqrt(d) in the runtime: the rows are written divided by it), a GPT-2 for a
    LayerNorm with a bias; one decoder layer whose weights are all 0. config.json's layer_norm_epsilon
    is the layer's eps, as the converter writes it for Llama and BERT (its GPT-2 and Gemma 3 loaders
    write none, and the runtime takes its defaults: sources.ctranslate2 reads that of a real export)."""

    device, compute = _checked(layer, weight)
    if layer.gain_offset not in (0.0, 1.0) or (layer.gain_offset and layer.kind != "rms_norm"):
        raise InputError(f"--candidate ctranslate2@public: {layer.name}'s gain is {layer.gain_offset:g} + w; the "
                         "converter writes 1 + w only as Gemma's RMSNorm")
    w = weight.detach().float().cpu()
    b = None if bias is None else bias.detach().float().cpu()
    return _row_wise(lambda rows: _converted_logits(layer, rows, w, b, eps, compute, device))


def _converted_logits(layer, rows, w, b, eps: float, compute: str, device: str):
    import json
    import tempfile
    from pathlib import Path

    import ctranslate2
    import torch
    from ctranslate2.converters import TransformersConverter

    n, d = rows.shape
    with tempfile.TemporaryDirectory(prefix="parity-ct2-public-") as where:
        source = Path(where) / "hf"
        _write_norm_model(source, layer, rows, w, b, eps)
        out = TransformersConverter(str(source)).convert(str(Path(where) / "ct2"), quantization=None)
        config = Path(out) / "config.json"  # the eps as the converter writes it for Llama and BERT
        config.write_text(json.dumps({**json.loads(config.read_text()), "layer_norm_epsilon": float(eps)}))
        generator = ctranslate2.Generator(out, device=device, compute_type=compute, intra_threads=1)
        y = torch.from_numpy(_to_numpy(generator.forward_batch([[i] for i in range(n)]), device))
        del generator
    return y.reshape(n, -1)[:, :d]


def _write_norm_model(directory, layer, rows, w, b, eps: float) -> None:
    """A transformers decoder of one layer that adds 0: its embeddings the rows, its final norm the
    layer's, an untied head that is the identity on the first d logits; a word-level tokenizer."""
    import math

    import torch
    import transformers

    from parity_cli.sources.synthetic import write_word_tokenizer

    n, d = rows.shape
    vocab = max(n, d, 4)  # a word a token: the converter takes its vocabulary from the tokenizer
    common = dict(vocab_size=vocab, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if layer.kind == "layer_norm":
        config = transformers.GPT2Config(n_embd=d, n_layer=1, n_head=1, n_inner=1, n_positions=8,
                                         layer_norm_epsilon=eps, **common)
        model = transformers.GPT2LMHeadModel(config)
        final, embed = model.transformer.ln_f, model.transformer.wte
    else:
        kwargs = dict(hidden_size=d, intermediate_size=1, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=2, max_position_embeddings=8, rms_norm_eps=eps, **common)
        gemma = layer.gain_offset == 1.0
        config = transformers.Gemma3TextConfig(**kwargs, sliding_window=8) if gemma else \
            transformers.LlamaConfig(**kwargs)
        model = (transformers.Gemma3ForCausalLM if gemma else transformers.LlamaForCausalLM)(config)
        final, embed = model.model.norm, model.model.embed_tokens
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        table = torch.zeros(vocab, d, dtype=torch.float64)
        table[:n] = rows.double()
        if layer.kind == "rms_norm" and layer.gain_offset == 1.0:  # Gemma: the runtime multiplies by sqrt(d) first
            table /= math.sqrt(d)
        embed.weight.copy_(table.float())
        final.weight.copy_(w)
        if b is not None:
            final.bias.copy_(b)
        model.lm_head.weight.copy_(torch.eye(vocab, d))
    model.float().save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, words=vocab - 3)
