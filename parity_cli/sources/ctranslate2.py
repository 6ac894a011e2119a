"""A CTranslate2 model directory (`ct2-transformers-converter --model HF_DIR --output_dir OUT`: model.bin,
config.json, the vocabulary) read as a copy of the Hugging Face checkpoint it was converted from.

model.bin is CTranslate2's own binary spec, not a pickle (ctranslate2/specs/model_spec.py,
`_serialize`): a uint32 binary version, the spec's name (a uint16 length, then that many bytes ending
in NUL), a uint32 revision, a uint32 count of variables, each a name, a uint8 rank, that many uint32
dimensions, a uint8 type (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16), a uint32 byte
count and the bytes; then a uint32 count of aliases, each two names (the alias, the variable). Every
field is checked against the file before it is used; only the norm gains and biases are read.

The norms are named by CTranslate2's spec (decoder/layer_0/self_attention/layer_norm/gamma and
/beta) and mapped back to the checkpoint's names by the layout the converter's loader read the model
in (LAYOUTS: Llama-like decoders, GPT-2, OPT, BERT-like encoders, Whisper, BART, Marian and T5), the root a checkpoint adds (bert.,
model.) settled against the reference's names. A norm whose `layer_norm_use_residual` flag is set
multiplies by 1 + gamma (Gemma's form): the copy's gain is what the runtime multiplies by, gamma plus
that 1. Variables equal to one another are stored once and the others as aliases of it (a model
whose norms all hold ones). The eps is config.json's `layer_norm_epsilon`, the one value the runtime
uses for every norm; where the converter wrote none (null), the runtime takes 1e-5 for a LayerNorm
(a norm with a beta) and 1e-6 for an RMSNorm (layers/common.cc; measured with ctranslate2 4.8.5
through its own Generator and Encoder)."""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.errors import InputError
from parity_cli.sources.localread import checked_inside, pread
from parity_cli.sources.tensors import MAX_NORM_ELEMENTS, ConvertedTensors, Eps, TensorInfo

DEFAULT_EPS = 1e-6  # what the runtime takes where config.json's layer_norm_epsilon is null: an RMSNorm's
LAYER_NORM_DEFAULT_EPS = 1e-5  # and a LayerNorm's (a norm with a beta)
TYPES = {0: ("float32", 4), 1: ("int8", 1), 2: ("int16", 2), 3: ("int32", 4), 4: ("float16", 2), 5: ("bfloat16", 2)}
MAX_VARIABLES = 1 << 20
MAX_RANK = 8
# CTranslate2's names -> the Hugging Face checkpoint's, by the layout the converter's loader read the
# model in (the `root` a checkpoint adds, bert. or model., is settled against the reference's names)
LLAMA = [
    (r"decoder/layer_norm", "model.norm"),
    (r"decoder/layer_(\d+)/self_attention/layer_norm", r"model.layers.\1.input_layernorm"),
    (r"decoder/layer_(\d+)/ffn/layer_norm", r"model.layers.\1.post_attention_layernorm"),
    (r"decoder/layer_(\d+)/input_layer_norm", r"model.layers.\1.input_layernorm"),
    (r"decoder/layer_(\d+)/post_attention_layer_norm", r"model.layers.\1.post_attention_layernorm"),
    (r"decoder/layer_(\d+)/pre_feedforward_layer_norm", r"model.layers.\1.pre_feedforward_layernorm"),
    (r"decoder/layer_(\d+)/post_feedforward_layer_norm", r"model.layers.\1.post_feedforward_layernorm"),
    (r"decoder/layer_(\d+)/self_attention/q_norm", r"model.layers.\1.self_attn.q_norm"),
    (r"decoder/layer_(\d+)/self_attention/k_norm", r"model.layers.\1.self_attn.k_norm"),
]
def _pre_norm_decoder(final: str, attention: str, ffn: str) -> list:
    """GPT-2's and OPT's loaders write the same decoder of LayerNorms; each model names them its own way."""
    return [(r"decoder/layer_norm", final), (r"decoder/layer_(\d+)/self_attention/layer_norm", attention),
            (r"decoder/layer_(\d+)/ffn/layer_norm", ffn)]


GPT2 = _pre_norm_decoder("ln_f", r"h.\1.ln_1", r"h.\1.ln_2")  # GPT2LMHeadModel's root, transformer., is settled
OPT = _pre_norm_decoder("model.decoder.final_layer_norm", r"model.decoder.layers.\1.self_attn_layer_norm",
                        r"model.decoder.layers.\1.final_layer_norm")
FALCON = [  # RWLoader/FalconLoader: one of three decoders by the config (FalconForCausalLM's root settled as GPT-2's)
    (r"decoder/layer_norm", "ln_f"),
    (r"decoder/layer_(\d+)/shared_layer_norm", r"h.\1.input_layernorm"),  # parallel, multi-query (7B)
    (r"decoder/layer_(\d+)/input_layer_norm", r"h.\1.ln_attn"),  # parallel, new_decoder_architecture (40B)
    (r"decoder/layer_(\d+)/post_attention_layer_norm", r"h.\1.ln_mlp"),
    (r"decoder/layer_(\d+)/self_attention/layer_norm", r"h.\1.input_layernorm"),  # sequential
    (r"decoder/layer_(\d+)/ffn/layer_norm", r"h.\1.post_attention_layernorm"),
]
BERT = [  # BertLoader: post-norm, the embeddings' LayerNorm, two a layer (BertModel: no root)
    (r"encoder/layernorm_embedding", "embeddings.LayerNorm"),
    (r"encoder/layer_(\d+)/self_attention/layer_norm", r"encoder.layer.\1.attention.output.LayerNorm"),
    (r"encoder/layer_(\d+)/ffn/layer_norm", r"encoder.layer.\1.output.LayerNorm"),
]
def _encoder_decoder(layer: str, self_attention: str, attention: str, ffn: tuple, final: str) -> list:
    """WhisperLoader's, the BART family's and T5Loader's stacks: an encoder of self-attention and
    feed-forward norms, a decoder with the cross-attention's between them, and each stack's final
    norm; `layer` and `final` name them with the stack's name, `ffn` is (the encoder's, the decoder's)."""
    out = []
    for stack, parts in (("encoder", (("self_attention", self_attention), ("ffn", ffn[0]))),
                         ("decoder", (("self_attention", self_attention), ("attention", attention), ("ffn", ffn[1])))):
        out += [(rf"{stack}/layer_(\d+)/{part}/layer_norm", layer.format(stack=stack) + name) for part, name in parts]
        out.append((f"{stack}/layer_norm", final.format(stack=stack)))
    return out


# WhisperLoader: pre-norm encoder and decoder
WHISPER = _encoder_decoder(r"model.{stack}.layers.\1.", "self_attn_layer_norm", "encoder_attn_layer_norm",
                           ("final_layer_norm", "final_layer_norm"), "model.{stack}.layer_norm")
SEQ2SEQ = WHISPER + [  # BartLoader and its kin (Marian, mBART, M2M-100, Pegasus): an embeddings norm where set
    (r"encoder/layernorm_embedding", "model.encoder.layernorm_embedding"),
    (r"decoder/layernorm_embedding", "model.decoder.layernorm_embedding"),
]
# T5Loader: RMSNorms (no beta), each sublayer's own norm (numbered within its block)
T5 = _encoder_decoder(r"{stack}.block.\1.layer.", "0.layer_norm", "1.layer_norm", ("1.layer_norm", "2.layer_norm"),
                      "{stack}.final_layer_norm")
# (the spec's name, the reference's model types) -> its names; the converter's loaders for these types
# build these specs (ctranslate2/converters/transformers.py)
LAYOUTS = [
    ("TransformerDecoderSpec", {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text",
                                "phi3"}, LLAMA),
    ("TransformerDecoderSpec", {"gpt2"}, GPT2),
    ("TransformerDecoderSpec", {"opt"}, OPT),
    ("TransformerDecoderSpec", {"falcon"}, FALCON),
    ("TransformerEncoderSpec", {"bert", "roberta", "camembert", "xlm-roberta"}, BERT),
    ("WhisperSpec", {"whisper"}, WHISPER),
    ("TransformerSpec", {"bart", "mbart", "marian", "m2m_100", "pegasus"}, SEQ2SEQ),
    ("TransformerSpec", {"t5", "mt5"}, T5),
]


def is_ctranslate2(path: Path) -> bool:
    """A directory holding a model.bin that starts as CTranslate2 writes one (a small binary version,
    then a spec's name): a pickle starts with 0x80, a torch zip with PK."""
    model = Path(path) / "model.bin"
    if not (Path(path).is_dir() and model.is_file()):
        return False
    try:
        head = pread(model, 6 + 64, 0)
        version, n = struct.unpack_from("<IH", head)
    except (OSError, struct.error):
        return False
    return 1 <= version <= 64 and 2 <= n <= 64 and head[6:6 + n - 1].endswith(b"Spec") and head[6 + n - 1:6 + n] == b"\0"


@dataclass
class Variable:
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    small: bytes = b""  # the bytes of a variable of at most 8 (a flag, a scalar), read with the header


def read_variables(model: Path) -> tuple[str, dict]:
    """(the spec's name, {name: Variable}) of a model.bin, every length checked against the file, read
    through one descriptor. A name given twice, or an alias named as a variable, is refused: CTranslate2
    keeps the first of each (Model::register_variable), and reading another would check a gain the
    runtime does not use."""
    import os

    from parity_cli.sources.jsonfile import regular_file

    size = regular_file(model, "model.bin", 1 << 50, "refused")
    fd = os.open(model, os.O_RDONLY)
    try:
        return _parse(model, size, lambda n, at: os.pread(fd, n, at))
    except OSError as exc:
        raise InputError(f"{model}: cannot read model.bin: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _parse(model: Path, size: int, read) -> tuple[str, dict]:
    at = 0

    def take(fmt: str):
        nonlocal at
        n = struct.calcsize("<" + fmt)
        raw = read(n, at) if at + n <= size else b""
        if len(raw) != n:
            raise InputError(f"{model}: truncated CTranslate2 model (a field at byte {at} runs past the end)")
        at += n
        return struct.unpack("<" + fmt, raw)

    def string() -> str:
        nonlocal at
        (n,) = take("H")
        raw = read(n, at) if 0 < n and at + n <= size else b""
        if len(raw) != n or n == 0:
            raise InputError(f"{model}: corrupt CTranslate2 model (a name of {n} bytes at byte {at})")
        at += n
        if raw[-1] != 0:
            raise InputError(f"{model}: corrupt CTranslate2 model (a name at byte {at - n} is not NUL-terminated)")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{model}: corrupt CTranslate2 model (a name at byte {at - n} is not UTF-8)") from None

    take("I")  # the binary version (is_ctranslate2 bounds it)
    spec = string()
    take("I")  # the spec's revision
    (count,) = take("I")
    if count > MAX_VARIABLES:
        raise InputError(f"{model}: declares {count} variables; refused (over {MAX_VARIABLES})")
    out = {}
    for _ in range(count):
        name = string()
        (rank,) = take("B")
        if rank > MAX_RANK:
            raise InputError(f"{model}: variable '{name}' declares rank {rank}; refused")
        shape = take("I" * rank) if rank else ()
        type_id, nbytes = take("BI")
        if type_id not in TYPES:
            raise InputError(f"{model}: variable '{name}' has type {type_id}, none CTranslate2 writes")
        dtype, itemsize = TYPES[type_id]
        if nbytes != math.prod(shape) * itemsize or at + nbytes > size:
            raise InputError(f"{model}: variable '{name}' declares {nbytes} bytes for shape {list(shape)} "
                             f"{dtype}; corrupt or truncated")
        if name in out:
            raise InputError(f"{model}: variable '{name}' is stored twice; refused (CTranslate2 keeps the first)")
        out[name] = Variable(dtype, tuple(shape), at, nbytes, read(nbytes, at) if nbytes <= 8 else b"")
        at += nbytes
    if at < size:  # a variable equal to another is stored once, the others as aliases of it
        (count,) = take("I")
        if count > MAX_VARIABLES:
            raise InputError(f"{model}: declares {count} aliases; refused (over {MAX_VARIABLES})")
        for _ in range(count):
            alias, target = string(), string()
            if target not in out:
                raise InputError(f"{model}: alias '{alias}' names '{target}', which is not a variable")
            if alias in out:
                raise InputError(f"{model}: alias '{alias}' is also a variable's name; refused (CTranslate2 keeps "
                                 "the variable)")
            out[alias] = out[target]
    return spec, out


@dataclass
class CTranslate2Checkpoint(ConvertedTensors):
    path: Path
    format: str
    config: dict  # the reference's model_type (the eps is runtime_eps)
    files: tuple
    spec: str
    _tensors: dict = field(repr=False)  # HF name -> (Variable, the 1 the runtime adds: 0.0 or 1.0)
    _sources: dict = field(default_factory=dict, repr=False)
    ct2_names: dict = field(default_factory=dict, repr=False)  # HF name -> CTranslate2's
    offset_baked: bool = True  # the gain is what the runtime multiplies by (gamma, plus its own 1 where set)
    runtime_eps: Eps | None = None  # what every norm of the runtime computes with

    def info(self, name: str) -> TensorInfo:
        var, _ = self._tensors[name]
        return TensorInfo(name=name, file=self.files[0], dtype=var.dtype, shape=var.shape)

    def read(self, name: str):
        import torch

        var, plus = self._tensors[name]
        if var.dtype not in ("float32", "float16", "bfloat16"):
            raise InputError(f"{self.files[0]}: norm tensor {self.ct2_names[name]} is stored as {var.dtype}; only "
                             "float32, float16 and bfloat16 gains can be checked")
        if math.prod(var.shape) > MAX_NORM_ELEMENTS:
            raise InputError(f"{self.files[0]}: norm tensor {self.ct2_names[name]} declares {math.prod(var.shape)} "
                             f"elements; no norm has more than {MAX_NORM_ELEMENTS}; refused")
        try:
            raw = bytearray(pread(self.files[0], var.nbytes, var.offset))
        except OSError as exc:
            raise InputError(f"{self.files[0]}: cannot read {self.ct2_names[name]}: {exc.strerror or exc}") from None
        if len(raw) != var.nbytes:
            raise InputError(f"{self.files[0]}: {self.ct2_names[name]} is cut short (the file changed while read)")
        value = torch.frombuffer(raw, dtype=getattr(torch, var.dtype)).reshape(var.shape) if raw else \
            torch.zeros(var.shape, dtype=getattr(torch, var.dtype))
        return value if not plus else (value.double() + plus).to(torch.float32)


def open_ctranslate2(path: Path, model=None) -> CTranslate2Checkpoint:
    """`model` (family, model_type): the reference's, which CTranslate2's config does not record."""
    from parity_cli.sources.jsonfile import load

    path = Path(path)
    config_path = path / "config.json"
    config = {}
    if config_path.exists() or config_path.is_symlink():  # bounded, a regular file, inside the directory
        config = load(checked_inside(config_path, path, "config.json"), "the config")
        if not isinstance(config, dict):
            raise InputError(f"{config_path}: expected a JSON object")
    spec, variables = read_variables(checked_inside(path / "model.bin", path, "model.bin"))
    model_type = model[1] if model else None
    tensors, names = _norms(path / "model.bin", variables, _layout(path / "model.bin", spec, model_type))
    eps = config.get("layer_norm_epsilon")
    if eps is None:  # layers/common.cc: 1e-5 for a LayerNorm (it has a beta), 1e-6 for an RMSNorm
        said = "is null" if "layer_norm_epsilon" in config else "is not there"
        biased = any(name.endswith(".bias") for name in tensors)
        value = LAYER_NORM_DEFAULT_EPS if biased else DEFAULT_EPS
        source = (f"ctranslate2: the runtime's default for {'a LayerNorm' if biased else 'an RMSNorm'} "
                  f"(config.json's layer_norm_epsilon {said})")
    else:
        value, source = _eps(config_path, eps), "ctranslate2: config.json layer_norm_epsilon"
    # one eps for every norm, whatever a model's code fixes (Whisper's nn.LayerNorm default): the runtime's
    return CTranslate2Checkpoint(path=path, format="ctranslate2", config={"model_type": model_type},
                                 files=(path / "model.bin",), spec=spec, _tensors=tensors, ct2_names=names,
                                 runtime_eps=Eps(value, source))


def _eps(config_path: Path, eps) -> float:
    """config.json's layer_norm_epsilon as the runtime's one eps: a finite number > 0, else one line
    (eps = 0 is the bug this tool exists to catch, never a trained model's setting)."""
    try:
        value = float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else math.nan
    except OverflowError:
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise InputError(f"{config_path}: 'layer_norm_epsilon' must be a finite number > 0, got {str(eps)[:40]!r}")
    return value


def _layout(model: Path, spec: str, model_type: str | None) -> list:
    for name, types, layout in LAYOUTS:
        if name == spec and (model_type is None or model_type in types):
            return layout
    known = "; ".join(f"{name} ({', '.join(sorted(types))})" for name, types, _ in LAYOUTS)
    raise InputError(f"{model}: a CTranslate2 {spec}" + (f" of a {model_type}" if model_type else "")
                     + f"; parity maps the norms of {known}")


def _norms(model: Path, variables: dict, layout: list) -> tuple[dict, dict]:
    """({HF name: (Variable, the 1 the runtime adds)}, {HF name: CTranslate2's}) of every gain and bias."""
    tensors, names = {}, {}
    for name, var in variables.items():
        scope, _, leaf = name.rpartition("/")
        if leaf not in ("gamma", "beta"):
            continue
        for pattern, hf in layout:
            if (m := re.fullmatch(pattern, scope)):
                hf_name = m.expand(hf) + (".weight" if leaf == "gamma" else ".bias")
                plus = 1.0 if leaf == "gamma" and _use_residual(model, variables, scope) else 0.0
                tensors[hf_name], names[hf_name] = (var, plus), name
                break
    if not any(name.endswith(".weight") for name in tensors):
        raise InputError(f"{model}: no norm gain CTranslate2 names as parity knows them ({len(variables)} variables)")
    return tensors, names


def _use_residual(model: Path, variables: dict, scope: str) -> bool:
    """The norm's `layer_norm_use_residual` flag, as CTranslate2 reads it: an int8 scalar, taken by an
    RMSNorm only (a norm with a beta is a LayerNorm, which ignores it). Stored any other way, refused."""
    flag = variables.get(scope + "/layer_norm_use_residual")
    if flag is None:
        return False
    if flag.dtype != "int8" or flag.nbytes != 1:
        raise InputError(f"{model}: {scope}/layer_norm_use_residual is {flag.nbytes} bytes of {flag.dtype}; "
                         "CTranslate2 writes the flag as one int8")
    return flag.small != b"\x00" and scope + "/beta" not in variables

