"""A family derived from the model's own transformers classes, for a model_type no family file
claims (and, by tools/derive_families.py, the committed files of configs/families/derived/).

Hand-writing one family per architecture cannot keep up with transformers, and choosing one by
eye is a trap (Gemma 4's gain is w, not Gemma's 1 + w). The knowledge is in the classes:
- the architecture is built from its config class, shrunk to a few layers and a narrow width,
  never with remote code (a config with `auto_map` is refused);
- every norm module's weight is given distinct values, the model is saved as transformers saves
  it, and each stored tensor is found by its values: the names are exactly the checkpoint's,
  after whatever key renames the class applies on save (Gemma 3's `language_model.model.`);
- each norm class is run in float64 against parity's forms (RMSNorm w or 1 + w, LayerNorm with
  or without bias) and at bfloat16 and float16 against the numerics orders (model.forms), bit
  for bit;
- every eps-like config key is given a distinct marker value before the build, so that each
  module's eps names the key it came from (`vision_config.layer_norm_eps`), or none: then the
  eps is fixed by the model code.
An inference BatchNorm is checked as one wherever its eval-mode output is exactly
(x - running_mean) / sqrt(running_var + eps) * w + b: torch's BatchNorm1d/2d/3d, and a frozen
BatchNorm that keeps its gain, bias and statistics as buffers (RT-DETR's FrozenBatchNorm2d), whose
eps, fixed inside its forward, is measured off its own output. Norms whose math parity cannot
express yet (gated, GroupNorm, LayerNorm 1 + w, weightless, ...) are listed as `unsupported`, with
why, never guessed at."""

from __future__ import annotations

import math
import re

from parity_cli.errors import InputError
from parity_cli.model.families import known_families
from parity_cli.model.kinds import ChannelsFirst, channels_first, groups_key

MAX_PARAMETERS = 60_000_000  # the shrunk model: a derivation never allocates a real model
EPS_NAME = re.compile(r"(^|_)(eps|epsilon)$|_eps_|norm_eps|eps$")
# sizes a shrunk config takes (only ever lowered); every other value keeps the class default
SHRINK = {
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "depth": 2, "num_decoder_layers": 2, "num_encoder_layers": 2, "text_layers": 2, "vision_layers": 2,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "dim": 64, "projection_dim": 64,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "ffn_dim": 128, "d_ff": 128, "n_inner": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "vocab_size": 256,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "d_kv": 16, "max_position_embeddings": 512, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
    "audio_vocab_size": 128, "vision_vocab_size": 128, "text_vocab_size": 256,
}
LAYER_LISTS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "mlp_layer_types")
TIME_LIMIT = 30.0


def needs_transformers(model_type, where: str) -> str:
    """The one line for a type no family file claims on a machine without transformers."""
    return (f"{where}: model_type '{model_type}' has no family file, and deriving one from its transformers "
            f"classes needs transformers: pip install transformers, or force a family with --family "
            f"(known: {known_families()})")


def _transformers(model_type: str, where: str):
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        raise InputError(needs_transformers(model_type, where)) from None
    if model_type not in CONFIG_MAPPING:
        raise InputError(f"{where}: model_type '{model_type}' is not known to transformers "
                         f"{transformers.__version__} nor to any family file; force one with --family "
                         f"(known: {known_families()})")
    return transformers, CONFIG_MAPPING[model_type]


FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def tagged_floats(value):
    """A config.json as transformers reads it: since 5.25 its saver writes a non-finite float as
    {"__float__": "Infinity"} (Mamba2's time_step_limit), and only its file loader turns that back."""
    if isinstance(value, dict):
        if len(value) == 1 and value.get("__float__") in FLOAT_TAGS:
            return FLOAT_TAGS[value["__float__"]]
        return {k: tagged_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tagged_floats(v) for v in value]
    return value


def _configs(cfg, path=""):
    """(dotted path, config) of the config and every sub-config under it."""
    from transformers import PretrainedConfig

    yield path, cfg
    for key, value in sorted(vars(cfg).items()):
        if isinstance(value, PretrainedConfig):
            yield from _configs(value, f"{path}{key}.")


def _mark_eps(cfg) -> dict[float, str]:
    """Every eps-like float key gets a distinct marker value: marker -> its dotted key."""
    markers = {}
    for path, sub in _configs(cfg):
        for key, value in sorted(vars(sub).items()):
            if isinstance(value, float) and not isinstance(value, bool) and EPS_NAME.search(key):
                marker = 1.0e-7 * (101 + len(markers))  # 1.01e-5, 1.02e-5, ...: no class default
                setattr(sub, key, marker)
                markers[marker] = path + key
    return markers


def _shrink(cfg) -> None:
    """Few layers, narrow widths; one layer of each distinct kind a layer list names (a hybrid
    model's attention layers have norms its linear-attention layers lack)."""
    for _, sub in _configs(cfg):
        for key, value in list(vars(sub).items()):
            if key in SHRINK and type(value) is int and value > SHRINK[key]:
                setattr(sub, key, SHRINK[key])
        lists = {key: vars(sub)[key] for key in LAYER_LISTS
                 if isinstance(vars(sub).get(key), (list, str)) and len(vars(sub)[key]) > 2}
        if lists:  # one length for all of them (layer_types and mlp_layer_types must agree)
            n = max(max(2, len(dict.fromkeys(value))) for value in lists.values())
            primary = next(iter(lists.values()))
            for key, value in lists.items():
                kept = (list(dict.fromkeys(value)) * n)[:n]
                setattr(sub, key, kept if isinstance(value, list) else "".join(kept))
            if "num_hidden_layers" in vars(sub):
                sub.num_hidden_layers = n
            spec = vars(sub).get("_heterogeneity_spec")
            if spec is not None:
                # Gemma 4's per-layer overrides (a full-attention layer's head_dim), by original
                # index: each kept layer takes those of the first original layer of its kind
                overrides = dict(getattr(spec, "per_layer_overrides", None) or {})
                kinds = list(dict.fromkeys(primary))
                first = [list(primary).index(kind) for kind in (kinds * n)[:n]]
                sub.per_layer_config = {k: overrides[i] for k, i in enumerate(first) if i in overrides} or None
        _attention_types(sub)
        _mamba_heads(sub)
        heads, width = vars(sub).get("num_attention_heads"), vars(sub).get("hidden_size")
        if vars(sub).get("head_dim", 0) is None and type(heads) is int and type(width) is int and heads:
            sub.head_dim = width // heads  # None means "hidden_size // heads" to most classes, a crash to some
        if "num_key_value_heads" in vars(sub) and vars(sub)["num_key_value_heads"] is None and type(heads) is int:
            sub.num_key_value_heads = heads  # None means multi-head attention, where a class reads it at all
        vocab = getattr(sub, "vocab_size", None)
        if type(vocab) is int:  # token ids the shrunk vocabulary must still hold (a padding index)
            for key, value in list(vars(sub).items()):
                if not (key.endswith("token_id") or key.endswith("token_index")):
                    continue
                if type(value) is int and value >= vocab:
                    setattr(sub, key, vocab - 1)
                elif isinstance(value, list):
                    setattr(sub, key, [min(v, vocab - 1) if type(v) is int else v for v in value])


def _attention_types(sub) -> None:
    """GPT-Neo's layer kinds are [[kinds, repeats], ...] expanded into attention_layers, which its
    validator requires to have num_layers entries: one repeat of each kind, as many layers."""
    v = vars(sub)
    types, layers = v.get("attention_types"), v.get("attention_layers")
    if not (isinstance(types, list) and isinstance(layers, list) and type(v.get("num_layers")) is int):
        return
    kinds = list(dict.fromkeys(layers)) or ["global"]
    sub.attention_types = [[kinds, 1]]
    sub.attention_layers = list(kinds)
    sub.num_layers = len(kinds)


def _mamba_heads(sub) -> None:
    """A Mamba2 mixer's heads must tile its inner width (expand * hidden_size = heads * head_dim,
    which the config classes validate): the shrunk width is re-tiled with the shrunk head size."""
    v = vars(sub)
    width = v.get("hidden_size")
    for expand, heads, head in (("expand", "num_heads", "head_dim"), ("mamba_expand", "mamba_n_heads", "mamba_d_head")):
        if not all(type(v.get(k)) is int and v.get(k) > 0 for k in (expand, heads, head)) or type(width) is not int:
            continue
        inner = v.get("mamba_d_ssm") if expand == "mamba_expand" and type(v.get("mamba_d_ssm")) is int \
            else v[expand] * width  # Falcon-H1's mamba_d_ssm overrides expand * hidden_size
        if v[heads] * v[head] == inner:
            continue
        groups = next((v[k] for k in ("n_groups", "mamba_n_groups", "mamba_ngroups") if type(v.get(k)) is int), 1)
        size = v[head] if inner % v[head] == 0 and (inner // v[head]) % max(groups, 1) == 0 else None
        if size is None:
            size = next((d for d in (16, 8, 4, 2, 1) if inner % d == 0 and (inner // d) % max(groups, 1) == 0), 1)
        setattr(sub, head, size)
        setattr(sub, heads, inner // size)


# sizes a second, harder shrink lowers when the first leaves the model over MAX_PARAMETERS (an
# entity vocabulary, a latent array, a vision tower's own widths): any int of these names over 64
_HARD = re.compile(r"(size|dim|dims|channels|latents|width|embd|features|n_words|vocab|length)$")


def _shrink_hard(cfg, tuples: bool = False) -> None:
    """`tuples`: tuples of sizes too (EfficientNet's channel tuples), only where lists alone leave
    the model too large, so that a model the list shrink fits keeps the checkpoint it had."""
    for _, sub in _configs(cfg):
        for key, value in list(vars(sub).items()):
            if not _HARD.search(key) or key.endswith("token_id"):
                continue
            floor = 256 if ("vocab" in key or key == "n_words") else 64
            if type(value) is int and value > floor:
                setattr(sub, key, floor)
            elif isinstance(value, list if not tuples else (list, tuple)) and value and \
                    all(type(v) is int for v in value) and max(value) > floor:
                setattr(sub, key, type(value)(min(v, floor) for v in value))


def _parameters(cls, cfg) -> int:
    import torch

    with torch.device("meta"):
        meta = cls._from_config(cfg)
    return sum(p.numel() for p in meta.parameters())


def _build(cls, cfg, where: str, model_type: str, seed: int = 0):
    """The shrunk model, for real (counted on the meta device first): a second, harder shrink where
    the first leaves it over MAX_PARAMETERS; refused where that fails too."""
    import copy

    import torch

    count = _parameters(cls, cfg)
    if count > MAX_PARAMETERS:
        fewer = count
        for tuples in (False, True):
            harder = copy.deepcopy(cfg)
            _shrink_hard(harder, tuples)
            try:
                fewer = _parameters(cls, harder)
            except Exception:
                fewer = count
            if fewer <= MAX_PARAMETERS:
                break
        if fewer > MAX_PARAMETERS:
            raise InputError(f"{where}: deriving {model_type}'s family would build {count:,} parameters even "
                             "shrunk; refused (force a family with --family)")
        cfg = harder
    torch.manual_seed(seed)
    return cls._from_config(cfg).eval(), cfg


def _model_class(transformers, cfg, architectures):
    for name in architectures or ():
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type):
            return cls
    from transformers.models.auto import modeling_auto as auto

    # the class a checkpoint of the type is usually saved from: a whole multimodal or encoder-decoder
    # model before a decoder-only head on it (WhisperForCausalLM has no encoder)
    for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
                    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING", "MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_MAPPING"):
        try:
            return getattr(auto, mapping)[type(cfg)]
        except (KeyError, AttributeError, ValueError):
            continue
    return None


def _is_norm(module) -> bool:
    import torch

    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm,
                           torch.nn.modules.batchnorm._BatchNorm)):
        return True
    name = type(module).__name__
    return bool(re.search(r"norm", name, re.IGNORECASE)) and not any(True for _ in module.children()) or \
        bool(re.search(r"(RMS|Layer)Norm$", name))


def _eps_of(module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "norm_eps", "var_eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _affine_only(module, weight, bias) -> str | None:
    """MobileBERT's NoNorm is `w * x + b`: named like a norm, with no statistic and no eps. Said
    as what it is, never guessed at as a norm."""
    import copy

    import torch

    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 3 + 1
    try:
        with torch.no_grad():
            y = copy.deepcopy(module).to(torch.float64)(x)
    except Exception:
        return None
    w = weight.detach().to(torch.float64)
    b = bias.detach().to(torch.float64) if isinstance(bias, torch.nn.Parameter) else 0.0
    if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, x * w + b, rtol=1e-12, atol=1e-12):
        return "not a normalisation (w * x + b: no statistic, no eps)"
    return None


def _second_input(module) -> str | None:
    """The name of a tensor input forward takes beside x (a gate z, a residual): a shrunk model
    may make such a norm look plain (one group, the gate left out), a real one is not."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    return next((n for n in names if re.search(r"gate|^z$|residual|cond|scale|shift", n)), None)


def classify(module, eps: float | None, name: str = "", size: int | None = None) -> dict:
    """The form and numerics order of one norm module, or why parity cannot express it. `name`,
    the module's path, sizes a weightless q/k/v norm that has no size of its own (head_dim)."""
    import copy

    import torch

    from parity_cli.model.kinds import gated_form, group_norm_form, weightless_form

    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if isinstance(module, torch.nn.GroupNorm):
        return group_norm_form(module, eps)
    if is_batch_norm(module):
        return _batch_norm(module, eps)
    gated = _second_input(module)
    if gated:
        form = gated_form(module, eps) if re.search(r"gate|^z$", gated) else {}
        return form if "kind" in form else {"unsupported": f"gated norm (forward takes a second input, {gated})"
                                            + (f": {form['unsupported']}" if form else "")}
    if not isinstance(module, ChannelsFirst) and channels_first(module):  # a position's C channels as a row
        form = classify(ChannelsFirst(module), eps, name, size)
        return {**form, "layout": "channels_first"} if "kind" in form else form
    grouped = next((a for a in ("group_size", "n_groups", "num_groups", "ngroups") if isinstance(
        getattr(module, a, None), int) and not isinstance(getattr(module, a), bool)), None)
    if grouped:
        return {"unsupported": f"statistics per group of channels ({grouped} = {getattr(module, grouped)})"}
    if not isinstance(weight, torch.nn.Parameter):
        form = weightless_form(module, eps, name, size)
        return form if "kind" in form else {"unsupported": f"no gain parameter (weightless norm): {form['unsupported']}"}
    if weight.dim() != 1:
        return {"unsupported": f"gain of shape {list(weight.shape)}"}
    if eps is None:
        return {"unsupported": _affine_only(module, weight, bias) or "no eps attribute"}
    dim = weight.shape[0]
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(6, dim, generator=gen, dtype=torch.float64)
    x[1] *= 1e-3  # eps shows here
    x[2] += 3.0  # a mean that RMSNorm keeps and LayerNorm removes
    m64 = copy.deepcopy(module).to(torch.float64).eval()
    try:
        with torch.no_grad():
            y = m64(x)
    except Exception as exc:  # a gate input, a channels-first layout, another signature
        return {"unsupported": f"forward(x) raises {type(exc).__name__}: {' '.join(str(exc).split())[:80]}"}
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return {"unsupported": "forward(x) does not return a tensor of the input's shape"}
    w = weight.detach().to(torch.float64)
    b = bias.detach().to(torch.float64) if isinstance(bias, torch.nn.Parameter) else None
    centred = x - x.mean(-1, keepdim=True)
    forms = {
        ("rms_norm", 0.0): x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps),
        ("layer_norm", 0.0): centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps),
    }
    found = None
    scale = float(y.abs().max()) or 1.0
    for (kind, _), h in forms.items():
        for offset in (0.0, 1.0):
            expect = h * (offset + w) + (b if b is not None else 0.0)
            if float((expect - y).abs().max()) <= 1e-5 * scale:  # float32 inside a float64 module
                found = (kind, offset)
                break
        if found:
            break
    if found is None:
        return {"unsupported": "matches no RMSNorm/LayerNorm form with gain w or 1 + w (eps placement, a gate, "
                               "another statistic)"}
    kind, offset = found
    if kind == "rms_norm" and b is not None and float(b.abs().max()) > 0:
        return {"unsupported": "RMSNorm with a bias"}
    out = {"kind": kind, "gain_offset": offset, "bias": b is not None}
    native = kind == "layer_norm" and isinstance(module, torch.nn.LayerNorm)
    candidates = [("native", "rsqrt")] if native else []
    candidates += [(o, s) for o in ("llama", "gemma", "t5") for s in ("rsqrt", "pow")]
    if kind == "layer_norm" and not native:
        candidates.append(("native", "rsqrt"))
    best = None
    # bit for bit at float32 too where one candidate is (rsqrt and pow(., -0.5) part there, rarely
    # after a cast to bf16/fp16); else at the half types alone
    for dtypes in ((torch.bfloat16, torch.float16, torch.float32), (torch.bfloat16, torch.float16)):
        best = _exact_order(module, kind, offset, b, x, eps, dim, candidates, dtypes)
        if best:
            break
    out["order"], out["inverse_sqrt"] = best or (("native" if native else "llama"), "rsqrt")
    out["order_exact"] = best is not None
    return out


BATCH_NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")


def is_batch_norm(module) -> bool:
    """torch's BatchNorm1d/2d/3d (any _BatchNorm), or a module holding what one holds (a gain, a
    bias and running statistics, 1-D floating tensors of one size) without being one: a frozen
    BatchNorm (torchvision's FrozenBatchNorm2d, copied by RT-DETR, D-FINE, DEIMv2, PP-DocLayout),
    its tensors buffers and its eps fixed inside forward. What either computes is then checked."""
    import torch

    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        return True
    if any(True for _ in module.children()):
        return False
    tensors = [getattr(module, a, None) for a in BATCH_NORM_TENSORS]
    return all(isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_floating_point() for t in tensors) and \
        len({t.numel() for t in tensors}) == 1


def _frozen(module) -> bool:
    import torch

    return is_batch_norm(module) and not isinstance(module, torch.nn.modules.batchnorm._BatchNorm)


def measured_eps(module) -> float | None:
    """The eps a BatchNorm adds to running_var, measured off its own output in float64: with gain 1,
    bias 0, running_mean 0 and running_var 0, an input of 1 comes out as 1 / sqrt(eps), so eps is
    y^-2 (the same in every channel), rounded to 6 significant digits (float64's error, about 1e-15
    relative, is far below that). None where the module cannot be run, the channels disagree, or
    the output is not finite (no eps at all: 1 / sqrt(0)). classify then checks the value on
    channels whose running_var is 0, 0.1, 1 and 10 times it."""
    import copy

    import torch

    m64 = copy.deepcopy(module).to(torch.float64).eval()
    n = m64.running_var.numel()
    with torch.no_grad():
        m64.weight.fill_(1.0)
        m64.bias.fill_(0.0)
        m64.running_mean.zero_()
        m64.running_var.zero_()
        try:
            y = _run_rows(m64, torch.ones(2, n, dtype=torch.float64))
        except Exception:
            return None
    if not bool(torch.isfinite(y).all()):
        return None
    eps = y.reshape(-1).pow(-2)
    if not bool((eps > 0).all()) or float(eps.max() - eps.min()) > 1e-9 * float(eps.max()):
        return None
    return float(f"{float(eps[0]):.6g}")


def module_eps(module) -> float | None:
    """A norm module's own eps: its attribute, or for a frozen BatchNorm (which keeps none, the
    value being written inside its forward) the eps its output shows (measured_eps)."""
    if _frozen(module):
        return measured_eps(module)
    return _eps_of(module)


def _batch_norm(module, eps: float | None) -> dict:
    """An inference BatchNorm, checked as one: in eval mode, with running statistics of its own,
    the module must compute (x - running_mean) / sqrt(running_var + eps) * w + b in float64, on
    channels of every variance and on channels whose running_var is 0, 0.1, 1 and 10 times eps
    (where another eps, or eps outside the root, shows)."""
    import copy

    import torch

    weight = getattr(module, "weight", None)
    frozen = _frozen(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not (frozen or isinstance(
            weight, torch.nn.Parameter)):
        return {"unsupported": "BatchNorm without a gain (affine=False)"}
    if not isinstance(getattr(module, "running_var", None), torch.Tensor):
        return {"unsupported": "BatchNorm without running statistics (normalises with the batch's)"}
    if eps is None:
        return {"unsupported": "BatchNorm whose eps its output does not show (none, or not one value)" if frozen
                else "BatchNorm without an eps attribute"}
    dim = weight.shape[0]
    gen = torch.Generator().manual_seed(dim)
    m64 = copy.deepcopy(module).to(torch.float64).eval()
    with torch.no_grad():
        m64.weight.copy_(torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5)
        if isinstance(m64.bias, torch.Tensor):
            m64.bias.copy_(torch.rand(dim, generator=gen, dtype=torch.float64) - 0.5)
        m64.running_mean.copy_(torch.randn(dim, generator=gen, dtype=torch.float64))
        var = torch.rand(dim, generator=gen, dtype=torch.float64) * 2 + 1e-4
        near = torch.tensor([0.0, 0.1, 1.0, 10.0], dtype=torch.float64)[:dim] * eps
        var[: near.numel()] = near
        m64.running_var.copy_(var)
        x = torch.randn(6, dim, generator=gen, dtype=torch.float64)
        try:
            y = _run_rows(m64, x)
        except Exception as exc:
            return {"unsupported": f"BatchNorm forward raises {type(exc).__name__}: {' '.join(str(exc).split())[:80]}"}
    b = m64.bias if isinstance(m64.bias, torch.Tensor) else 0.0
    want = (x - m64.running_mean) / torch.sqrt(m64.running_var + eps) * m64.weight + b
    if not torch.allclose(y, want, rtol=1e-12, atol=1e-12):
        return {"unsupported": "BatchNorm whose eval-mode output is not (x - mean) / sqrt(var + eps) * w + b"}
    return {"kind": "batch_norm", "gain_offset": 0.0, "bias": isinstance(module.bias, torch.Tensor),
            "order": "native", "inverse_sqrt": "rsqrt", "order_exact": True}


def _run_rows(module, x):
    """The module on rows of C channels, as the feature maps it takes: 1 x 1 (x 1) maps after (N, C)
    as its class name says (_spatial), else the first layout whose output has the input's shape.
    The output comes back as rows; raises where no layout runs."""
    import torch

    first = _spatial(module)
    error = None
    for spatial in dict.fromkeys((first, 2, 0, 1, 3)):
        shape = (*x.shape, *([1] * spatial))
        try:
            y = module(x.reshape(shape))
        except Exception as exc:
            error = error or exc
            continue
        if isinstance(y, torch.Tensor) and tuple(y.shape) == shape:
            return y.reshape(x.shape)
    raise error or ValueError("its output never has the input's shape")


def _spatial(module) -> int:
    """The feature-map axes a BatchNorm class expects after (N, C), from its class name (its own or
    a base's): 2 for ...Norm2d, 3 for ...Norm3d, else 0 (BatchNorm1d takes (N, C))."""
    for cls in type(module).__mro__:
        found = re.search(r"Norm([123])d$", cls.__name__)
        if found:
            return {"1": 0, "2": 2, "3": 3}[found.group(1)]
    return 0


def _exact_order(module, kind, offset, b, x, eps, dim, candidates, dtypes):
    """The first (order, inverse_sqrt) whose transcription equals the module bit for bit at every
    dtype of `dtypes`."""
    import copy

    import torch

    from parity_cli.model.forms import hf_forward

    rows = torch.randn(64, dim, generator=torch.Generator().manual_seed(dim + 1), dtype=torch.float64)
    rows = torch.cat([x[[0, 2, 3, 4, 5]], rows * torch.logspace(-2, 1, 64, dtype=torch.float64)[:, None]]) * 0.5
    for order, inverse_sqrt in candidates:
        exact = True
        for dtype in dtypes:
            m = copy.deepcopy(module).to(dtype).eval()
            xs = rows.to(dtype)
            with torch.no_grad():
                try:
                    got = m(xs)
                    want = hf_forward(kind, order, offset, inverse_sqrt, dim, m.weight,
                                      getattr(m, "bias", None) if b is not None else None, eps)(xs)
                except Exception:
                    exact = False
                    break
            if got.dtype != want.dtype or not torch.equal(got, want):
                exact = False
                break
        if exact:
            return order, inverse_sqrt
    return None


def _saved_by_value(model, out) -> tuple[dict, list[str]]:
    """Saves the model as transformers does and indexes each stored 1-D tensor by its values:
    a norm's weight, given distinct values, is then found under the name the file really has.
    Also every stored name (a pattern must claim none of the other tensors)."""
    import os

    import torch
    from safetensors import safe_open

    model.save_pretrained(str(out), safe_serialization=True)
    stored, keys = {}, []
    for file in sorted(os.listdir(out)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(out, file), "pt") as fh:
                for key in fh.keys():
                    keys.append(key)
                    if len(fh.get_slice(key).get_shape()) != 1:  # only a 1-D tensor can be a norm's gain
                        continue
                    t = fh.get_tensor(key)
                    if t.is_floating_point():
                        stored.setdefault((t.numel(), t.to(torch.float32).numpy().tobytes()), key)
    return stored, keys


def stored_key(stored: dict, module) -> str | None:
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter if not _frozen(module) else torch.Tensor) or weight.dim() != 1:
        return None
    return stored.get((weight.numel(), weight.detach().to(torch.float32).numpy().tobytes()))


SIZE_KEYS = ("hidden_size", "head_dim", "d_model", "intermediate_size", "embed_dim", "dim")


def _seen_sizes(model, norms) -> dict:
    """The last-axis size each parameterless norm sees in one forward pass of a few tokens (a
    weightless RMSNorm has no size of its own): empty where the model takes other inputs, or its
    forward fails; those norms then stay unsupported, never sized by guess."""
    import torch

    targets = [(n, m) for n, m in norms if not isinstance(getattr(m, "weight", None), torch.nn.Parameter)]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not targets or type(vocab) is not int or vocab < 2:
        return {}
    sizes: dict = {}

    def seen(name):
        def hook(module, args):  # returns None: a pre-hook's value would replace the input
            if args and isinstance(args[0], torch.Tensor):
                sizes.setdefault(name, args[0].shape[-1])
        return hook

    hooks = [m.register_forward_pre_hook(seen(n)) for n, m in targets]
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(1, vocab, (1, 4), generator=torch.Generator().manual_seed(0)))
    except Exception:
        pass
    finally:
        for h in hooks:
            h.remove()
    return {n: s for n, s in sizes.items() if type(s) is int and s > 0}


def size_key(configs, size: int) -> str | None:
    """The config key (dotted, in a sub-config) giving a weightless norm's size: the usual names
    first (hidden_size, head_dim, ...), then any integer key of that value."""
    configs = list(configs)
    for wanted in SIZE_KEYS:
        for path, sub in configs:
            if vars(sub).get(wanted) == size and type(vars(sub).get(wanted)) is int:
                return path + wanted
    for path, sub in configs:  # head_dim where the config leaves it to hidden_size // num_attention_heads
        width, heads = vars(sub).get("hidden_size"), vars(sub).get("num_attention_heads")
        if vars(sub).get("head_dim") is None and type(width) is int and type(heads) is int and heads \
                and width // heads == size:
            return path + "head_dim"
    for path, sub in configs:
        for key, value in sorted(vars(sub).items()):
            if type(value) is int and value == size and not key.endswith("_id"):
                return path + key
    return None


def _pattern(name: str, others=()) -> str:
    """The name with its indices as {i}, where that claims no tensor but norms' own: Sequential
    positions (`enc_output.1` beside the Linear `enc_output.0`) stay as they are."""
    pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "{i}", name)
    if pattern == name or not others:
        return pattern
    regex = re.compile(re.escape(pattern).replace(re.escape("{i}"), r"\d+"))
    return name if any(regex.fullmatch(other) for other in others) else pattern


def derive(model_type: str, config: dict | None = None, where: str = "config.json") -> dict:
    """Family data (the configs/families TOML as a dict) for `model_type`, from its own classes:
    `config` is the checkpoint's config.json (its towers, its architectures), or None for the
    config class's defaults. The config is bounded before transformers sees it (bounded_config), and
    whatever fails on the way is one line naming the file, never an internal error."""
    if config is not None:
        bounded_config(config, where)
    try:
        return _derive(model_type, config, where)
    except InputError:
        raise
    except Exception as exc:  # a config transformers' own validation refuses after the shrink, a save that fails
        raise InputError(f"{where}: cannot derive {model_type}'s family from its transformers classes: "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}; force a family with --family") \
            from None


# what bounds a config.json before transformers builds anything from it: a config class expands layer counts
# into per-layer lists in its __init__, before any shrink can run (num_hidden_layers = 10^9 took 8 GB here)
LAYER_COUNT = re.compile(r"(^|_)(layers?|n_layers?|depth|blocks?|block_sizes|attention_types|layer_types|"
                         r"num_.*layers|num_.*blocks)$")
MAX_LAYERS = 4096  # Llama 3.1 405B has 126; a config past this is not a model
MAX_INT = 1 << 31  # ids, sizes and positions of every released model are far below
MAX_LIST = 65536


def bounded_config(config: dict, where: str) -> None:
    """Refuses, in one line, a config.json whose counts would make transformers' config classes build
    per-layer structures without bound: a layer or block count (scalar or inside a list) over
    MAX_LAYERS, any integer over MAX_INT, a list over MAX_LIST elements."""
    stack = [(config, "", False)]  # walked without recursion: a config may nest as deep as the parser allows
    while stack:
        value, path, counts = stack.pop()
        if isinstance(value, dict):
            stack.extend((item, f"{path}.{key}" if path else str(key), bool(LAYER_COUNT.search(str(key))))
                         for key, item in value.items())
        elif isinstance(value, list):
            if len(value) > MAX_LIST:
                raise InputError(f"{where}: '{path}' is a list of {len(value):,} elements (at most {MAX_LIST:,}); "
                                 "refused")
            stack.extend((item, path, counts) for item in value)
        elif type(value) is int and (value > MAX_LAYERS if counts else abs(value) > MAX_INT):
            limit = f"a layer count over {MAX_LAYERS:,}" if counts else f"an integer over {MAX_INT:,}"
            raise InputError(f"{where}: '{path}' = {value} is {limit}, more than any model has; refused")


def _derive(model_type: str, config: dict | None, where: str) -> dict:
    import tempfile
    import time

    transformers, config_class = _transformers(model_type, where)
    if config is not None and config.get("auto_map"):
        raise InputError(f"{where}: asks for remote code (auto_map); parity never runs it: force a family with "
                         "--family")
    import torch
    from transformers.utils import logging as hf_logging

    start = time.monotonic()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        defaults = config_class()
        cfg = config_class.from_dict(tagged_floats(dict(config))) if config is not None else config_class()
    except Exception as exc:
        raise InputError(f"{where}: transformers cannot read it as a {model_type} config: "
                         f"{' '.join(str(exc).split())[:160]}") from None
    default_eps = {path + key: value for path, sub in _configs(defaults) for key, value in vars(sub).items()
                   if isinstance(value, float) and EPS_NAME.search(key)}
    given_eps = {path + key: value for path, sub in _configs(cfg) for key, value in vars(sub).items()
                 if isinstance(value, float) and EPS_NAME.search(key)}
    markers = _mark_eps(cfg)
    _shrink(cfg)
    cls = _model_class(transformers, cfg, (config or {}).get("architectures"))
    if cls is None:
        raise InputError(f"{where}: transformers has no model class for model_type '{model_type}'; force a family "
                         "with --family")
    try:
        model, cfg = _build(cls, cfg, where, model_type)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{where}: cannot build {cls.__name__} to derive its family: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}; force a family with --family") from None
    if time.monotonic() - start > TIME_LIMIT:
        raise InputError(f"{where}: deriving {model_type}'s family took over {TIME_LIMIT:.0f} s; refused "
                         "(force a family with --family)")
    norms = []
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not name or not _is_norm(module):
                continue
            for pname in ("weight", "bias"):  # a frozen BatchNorm's are buffers, saved all the same
                p = getattr(module, pname, None)
                if isinstance(p, torch.nn.Parameter if not _frozen(module) else torch.Tensor) and p.is_floating_point():
                    p.copy_(torch.rand(p.shape, generator=gen) + (0.5 if pname == "weight" else -0.5))
            norms.append((name, module))
    with tempfile.TemporaryDirectory() as tmp:
        stored, keys = _saved_by_value(model, tmp)
    norm_keys = {stored_key(stored, module) for _, module in norms} - {None}
    others = {k.rsplit(".", 1)[0] for k in keys
              if k not in norm_keys and k.rsplit(".", 1)[0] + ".weight" not in norm_keys}
    version = f"transformers {transformers.__version__}: {cls.__name__}"
    prefix = getattr(model, "base_model_prefix", "") or ""
    entries, unsupported, seen, gamma = [], [], set(), False
    sizes = _seen_sizes(model, norms)
    for name, module in norms:
        eps = module_eps(module)
        sem = classify(module, eps, name, sizes.get(name))
        if sem.get("measured_eps") is not None:  # fixed inside a weightless norm's forward: measured
            eps = sem["measured_eps"]
        key = stored_key(stored, module)
        # transformers 5 saves some legacy LayerNorms as .gamma/.beta (ESM's encoder): the norm is the module
        suffix = next((f".{w}" for w in ("weight", "gamma") if key and key.endswith(f".{w}")), None)
        tensor = key[: -len(suffix)] if suffix else (key or name)
        gamma = gamma or suffix == ".gamma"
        pattern = _pattern(tensor, others)
        hf_class = f"{type(module).__module__}.{type(module).__qualname__}"
        dim_key = None
        if sem.get("weightless"):  # nothing stored: found by its parent module, sized by a config key
            dim_key = sem.get("dim_key") or size_key(_configs(cfg), sem["size"])
            if dim_key is None:
                sem = {"unsupported": f"weightless norm of size {sem['size']}, which no config key gives"}
            else:
                key = name
        if "unsupported" in sem or key is None:
            why = sem.get("unsupported") or "its weight is not stored under a name of its own (tied or shared)"
            if pattern not in seen:
                seen.add(pattern)
                unsupported.append({"name": pattern, "class": hf_class, "why": why})
            continue
        if pattern in seen:
            continue
        seen.add(pattern)
        # a measured eps is the marker rounded to 6 digits: the marker it is (markers are 1 % apart)
        source = markers.get(eps) or next((key for marker, key in markers.items() if eps is not None
                                           and math.isclose(marker, eps, rel_tol=1e-9)), None)
        entry = {"name": pattern, "dim": "", "kind": sem["kind"], "order": sem["order"],
                 "gain_offset": sem["gain_offset"], "inverse_sqrt": sem["inverse_sqrt"], "hf_class": hf_class}
        if source is not None:
            entry["eps_keys"] = [source]
            entry["eps_default"] = float(default_eps.get(source, given_eps.get(source, eps)))
        else:  # no config key carries it: the model code fixes it
            entry["eps_keys"] = []
            entry["eps_default"] = eps
            entry["eps"] = eps
            entry["eps_source"] = f"model-code ({type(module).__name__})"
        if not sem["order_exact"]:
            entry["order_exact"] = False
        if sem["kind"] in ("group_norm", "gated_rms_norm"):
            count = sem["groups"]
            # a real checkpoint's group count is its config's (Mamba2's n_groups), not the shrunk model's
            entry["groups"] = count if count == "channels" else (
                (groups_key(_configs(cfg), count) if sem["kind"] == "gated_rms_norm" else None) or count)
        if sem["kind"] == "gated_rms_norm":
            entry["gate"], entry["activation"] = sem["gate"], sem["activation"]
        if sem.get("layout"):
            entry["layout"] = sem["layout"]
        if dim_key is not None:
            entry["weightless"] = True
            entry["dim"] = dim_key
        if prefix:  # saved from the base model or from a head on it: with or without its prefix
            bare = pattern[len(prefix) + 1:] if pattern.startswith(prefix + ".") else pattern
            entry["name"] = "{root}" + bare
            entry["roots"] = [prefix + ".", ""]
        entries.append(entry)
    if not math.isfinite(time.monotonic() - start):
        raise AssertionError
    named = {"weight_names": ["weight", "gamma"], "bias_names": ["bias", "beta"]} if gamma else {}
    return {"name": model_type, "description": f"derived from {version}", "derived_from": version,
            "model_types": [model_type], "norms": entries, "unsupported": unsupported, **named}


def write_tiny_checkpoint(model_type: str, out, seed: int = 0, config: dict | None = None) -> dict:
    """A tiny random-weight checkpoint of `model_type` as transformers saves it (the class a
    derivation builds, shrunk the same way), norm gains drawn from U(0.1, 0.6) and biases from
    U(-0.2, 0.2) so that a gain convention matters. `config`: values set over the shrunk ones
    (a narrower model where the shrink keeps a list of widths: ResNet's stages hold 23.5 M
    parameters, 94 MB). Returns what the zoo sweep compares against:
    the class, and every norm module with its stored weight name, its class, its eps, and why
    parity cannot express it (None where it can: classify's verdict on the module itself)."""
    import torch

    transformers, config_class = _transformers(model_type, "write_tiny_checkpoint")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = config_class()
    _shrink(cfg)
    for key, value in (config or {}).items():
        setattr(cfg, key, value)
    cls = _model_class(transformers, cfg, None)
    if cls is None:
        raise InputError(f"transformers has no model class for model_type '{model_type}'")
    cfg.architectures = [cls.__name__]
    model, cfg = _build(cls, cfg, "write_tiny_checkpoint", model_type, seed)
    gen = torch.Generator().manual_seed(seed)
    norms = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if name and _is_norm(module):
                norms.append((name, module))
                frozen = _frozen(module)  # a frozen BatchNorm's gain and bias are buffers
                for pname, lo, hi in (("weight", 0.1, 0.6), ("bias", -0.2, 0.2)):
                    p = getattr(module, pname, None)
                    if isinstance(p, torch.nn.Parameter if not frozen else torch.Tensor) and p.is_floating_point():
                        p.copy_(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
                if is_batch_norm(module) and getattr(module, "running_var", None) is not None:
                    # statistics a trained model has: means around 0, variances over decades, some
                    # channels near eps (where a wrong eps shows)
                    n = module.running_var.numel()
                    module.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
                    module.running_var.copy_(torch.exp(torch.rand(n, generator=gen) * math.log(1e7)) * 1e-6)
    stored, _ = _saved_by_value(model, out)

    sizes = _seen_sizes(model, norms)

    def described(name, module):
        eps = module_eps(module)
        sem = classify(module, eps, name, sizes.get(name))
        if sem.get("weightless") and not (sem.get("dim_key") or size_key(_configs(cfg), sem["size"])):
            sem = {"unsupported": f"weightless norm of size {sem['size']}, which no config key gives"}  # as derive
        return {"module": name, "stored": stored_key(stored, module), "class": type(module).__name__, "eps": eps,
                "plain": isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm))
                or bool(re.search(r"(RMS|Layer)Norm$", type(module).__name__)),
                "batch_norm": is_batch_norm(module), "frozen": _frozen(module),
                "kind": sem.get("kind"), "unsupported": sem.get("unsupported"),
                "weightless": bool(sem.get("weightless")), "measured_eps": sem.get("measured_eps")}

    return {"class": cls.__name__, "norms": [described(name, module) for name, module in norms]}


def family_data_for_parse(data: dict) -> dict:
    """The derived dict in the shape families._parse reads. Each norm states its own semantics in
    full; the family-wide keys (the header's eps) are those of the norms most of the model has
    that read their eps from the config: the language model's, not a vision tower's fixed 1e-5."""
    if not data["norms"]:
        return data
    from collections import Counter

    keyed = [n for n in data["norms"] if n["eps_keys"]] or data["norms"]
    common = Counter(tuple(n["eps_keys"]) for n in keyed).most_common(1)[0][0]
    # the header describes the model's plain norms where it has them (Qwen3-Next's RMSNorm, not the
    # gated norm of its linear-attention layers)
    plain = sorted(keyed, key=lambda n: (n["kind"] not in ("rms_norm", "layer_norm"), bool(n.get("weightless"))))
    first = next(n for n in plain if tuple(n["eps_keys"]) == common)
    out = dict(data)
    for key in ("kind", "order", "gain_offset", "eps_keys", "eps_default", "hf_class", "eps", "eps_source", "groups",
                "gate", "activation"):
        if key in first:
            out[key] = first[key]
    out["roots"] = [""]
    return out
