"""Real activations: what each norm layer sees when the model runs on real text.

`parity capture MODEL --text FILE` runs the model with transformers (its bundled tokenizer, its
own class, never remote code), records the input of every norm layer parity checks through a
forward pre-hook, and keeps a bounded sample of rows per layer: the smallest by q (where a wrong
eps shows), the largest, and a uniform reservoir of the rest. Memory is K rows per layer
whatever the number of tokens. The rows go to a safetensors file whose metadata holds the
checkpoint's norm fingerprint (replay.fingerprint), so a check refuses rows from another model."""

from __future__ import annotations

import contextlib
import heapq
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from parity_cli.errors import InputError

MAX_ROWS_PER_LAYER = 4096
NORM_PREFIX = "norm:"  # beside the rows, the norm tensors the capture was made with (float32)
MAX_FILE_BYTES = 1 << 30


@dataclass
class _Sample:
    """K rows of one layer: k_small smallest q, k_large largest q, the rest a uniform reservoir."""

    k_small: int
    k_large: int
    k_uniform: int
    rng: random.Random
    small: list = field(default_factory=list)  # max-heap by q: (-q, n, row)
    large: list = field(default_factory=list)  # min-heap by q: (q, n, row)
    uniform: list = field(default_factory=list)
    seen: int = 0

    def add(self, rows, q) -> None:
        """Rows of one forward call. Each row is its own copy: a kept view would hold the call's
        whole activation (and, for a float32 model on the CPU, alias the model's own tensor)."""
        for k, qv in enumerate(q.tolist()):
            self.seen += 1
            n = self.seen
            row = rows[k].clone()
            if self.k_small:
                if len(self.small) < self.k_small:
                    heapq.heappush(self.small, (-qv, n, row))
                elif -self.small[0][0] > qv:
                    heapq.heapreplace(self.small, (-qv, n, row))
            if self.k_large:
                if len(self.large) < self.k_large:
                    heapq.heappush(self.large, (qv, n, row))
                elif self.large[0][0] < qv:
                    heapq.heapreplace(self.large, (qv, n, row))
            if self.k_uniform:  # reservoir sampling (algorithm R)
                if len(self.uniform) < self.k_uniform:
                    self.uniform.append((qv, n, row))
                else:
                    j = self.rng.randrange(n)
                    if j < self.k_uniform:
                        self.uniform[j] = (qv, n, row)

    def rows(self):
        """The kept rows, each once (a row can be both small and in the reservoir), by q."""
        import torch

        kept = {}
        for entry in [(-a, n, r) for a, n, r in self.small] + self.large + self.uniform:
            kept[entry[1]] = entry
        ordered = sorted(kept.values(), key=lambda e: e[0])
        return torch.stack([e[2] for e in ordered]) if ordered else None


def _model_class(config, gguf: bool = False):
    """The checkpoint's own architecture class from transformers (config.architectures), so the
    module names are the checkpoint's tensor names; never a class the directory ships. A GGUF
    (llama.cpp's format, causal LMs) names none: its causal-LM class."""
    import transformers

    for arch in config.architectures or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM if gguf else transformers.AutoModel


@contextlib.contextmanager
def _quiet():
    """transformers' own output off while it loads: its progress bars (the GGUF dequantizer's tqdm
    is not behind its logging switch) and its warnings would land in the middle of ours. Its
    exceptions still come through, and become one line."""
    import io

    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_parsed_once(active: bool):
    """transformers parses a GGUF whole for its config, again for its tokenizer and twice for the
    weights (3 s each with SmolLM2's 49,152-token vocabulary), and builds gguf-py's tensor name map
    anew for each of the model's modules (400 times, 17 ms each): 25 s of a 16-token capture. Here
    one parse (a read-only memory map) and one map serve every call; both are put back after."""
    if not active:
        yield
        return
    import functools

    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _load_model(model_dir, path: str, extra: dict, gguf: bool):
    """(config, tokenizer, class, model) as transformers loads them, never remote code."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        with _quiet():
            config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False, **extra)
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False, **extra)
    except Exception as exc:
        raise InputError(f"{model_dir}: cannot load its config or bundled tokenizer: "
                         f"{' '.join(str(exc).split())[:200]}") from None
    cls = _model_class(config, gguf)
    try:
        with _quiet():
            model = cls.from_pretrained(path, local_files_only=True, trust_remote_code=False, torch_dtype="auto",
                                        **(extra or {"use_safetensors": True}))
    except Exception as exc:
        raise InputError(f"{model_dir}: transformers cannot load the model ({cls.__name__}): "
                         f"{' '.join(str(exc).split())[:200]}") from None
    return config, tokenizer, cls, model


def capture(model_dir, text: str, max_tokens: int = 512, rows_per_layer: int = 96, device: str = "cpu",
            seed: int = 0, chunk: int | None = None) -> tuple[dict, dict]:
    """({layer name: float32 rows (k, dim)}, metadata) for the norm layers parity checks."""
    import torch

    from parity_cli.backends.implementations import mean_square
    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.model.layers import discover_layers
    from parity_cli.model.load import load
    from parity_cli.options import check_device

    if not 3 <= rows_per_layer <= MAX_ROWS_PER_LAYER:
        raise InputError(f"--rows-per-layer must be between 3 and {MAX_ROWS_PER_LAYER}")
    if max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    ckpt, fam, eps = load(model_dir)
    layers = discover_layers(ckpt, fam, eps).layers
    names = {layer.name: layer for layer in layers}
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise InputError("parity capture needs transformers: pip install transformers") from None
    from parity_cli.sources.gguf import is_gguf

    source = Path(model_dir)
    gguf = source.is_file() and is_gguf(source)
    path = str(source.parent if gguf else source)
    extra = {"gguf_file": source.name} if gguf else {}  # transformers dequantizes it (needs gguf, accelerate)
    with _gguf_parsed_once(gguf):
        config, tokenizer, cls, model = _load_model(model_dir, path, extra, gguf)
    model = model.to(check_device(device)).eval()
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=True)["input_ids"][0][:max_tokens]
    if ids.numel() == 0:
        raise InputError("the text has no tokens")
    # whole sequences as the model was trained on them (positions matter), up to its context
    chunk = chunk or min(int(getattr(config, "max_position_embeddings", 0) or 2048), 2048)
    k_small = k_large = rows_per_layer // 3
    rng = random.Random(seed)
    samples = {name: _Sample(k_small, k_large, rows_per_layer - k_small - k_large, rng) for name in names}
    hooks, seen = [], set()
    for qual, module in model.named_modules():
        name = next((n for n in (qual, f"model.{qual}") if n in names), None)  # AutoModel drops the prefix
        if name is None:
            continue
        layer = names[name]

        def hook(mod, args, name=name, layer=layer):
            x = args[0].detach()
            rows = x.reshape(-1, x.shape[-1]).to("cpu", torch.float32)
            if rows.shape[-1] != layer.dim:
                return
            seen.add(name)
            rows = rows[torch.isfinite(rows).all(-1)]  # a row with NaN/inf has no q: not a probe
            samples[name].add(rows, mean_square(rows, layer.kind))

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for start in range(0, ids.numel(), chunk):
                model(input_ids=ids[start:start + chunk].unsqueeze(0).to(model.device))
    finally:
        for h in hooks:
            h.remove()
    missing = sorted(set(names) - seen)
    if not seen:
        raise InputError(f"{model_dir}: no module of {cls.__name__} is a norm layer parity checks "
                         f"(looked for {', '.join(sorted(names)[:3])}, ...); nothing captured")
    tensors = {name: samples[name].rows().contiguous() for name in names if name in seen}
    for layer in layers:  # the norms themselves: a copy in another format is the same model within rounding
        for part, t in (("weight", layer.weight), ("bias", layer.bias)):
            if t is not None:
                tensors[f"{NORM_PREFIX}{part}:{layer.name}"] = t.detach().to("cpu", torch.float32).contiguous()
    meta = {
        "fingerprint": fingerprint(layers)["sha256"],
        "checkpoint": str(model_dir),
        "model_class": cls.__name__,
        "tokens": int(ids.numel()),
        "rows_per_layer": rows_per_layer,
        "sampling": f"{k_small} smallest q, {k_large} largest q, {rows_per_layer - k_small - k_large} uniform",
        "seed": seed,
        "device": str(device),
        "not_seen": missing,
        "rows": int(sum(t.shape[0] for name, t in tensors.items() if not name.startswith(NORM_PREFIX))),
        "norms": {layer.name: {"dtype": str(layer.weight.dtype).removeprefix("torch."),
                               "shape": list(layer.weight.shape)} for layer in layers if layer.weight is not None},
    }
    return tensors, meta


def write(tensors: dict, meta: dict, out) -> None:
    """safetensors with the capture's settings and fingerprint as metadata, written atomically."""
    from safetensors.torch import save

    from parity_cli.outputs import write_bytes

    write_bytes(Path(out), save(tensors, metadata={"parity": json.dumps(meta)}))


def load(path, layers, all_layers) -> tuple[dict, dict]:
    """The captured rows for `layers`, after checking the file is a capture of this model."""
    import torch
    from safetensors import safe_open

    from parity_cli.model.fingerprint import fingerprint
    from parity_cli.sources.jsonfile import parse, regular_file

    path = Path(path)
    regular_file(path, "the activations", MAX_FILE_BYTES, f"more than a capture may have ({MAX_FILE_BYTES}); refused")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = parse((fh.metadata() or {}).get("parity", "null"), path, "the capture's metadata")
            if not isinstance(meta, dict) or "fingerprint" not in meta:
                raise InputError(f"{path}: not a parity capture (no parity metadata)")
            if meta["fingerprint"] == fingerprint(all_layers)["sha256"]:
                meta["match"] = "exact: the same norm tensors"
            else:
                meta["match"] = _same_norms(fh, meta, all_layers, path)
            rows = {}
            by_name = {layer.name: layer for layer in layers}
            for name in fh.keys():
                if name not in by_name:
                    continue
                layer = by_name[name]
                declared = fh.get_slice(name)  # the header's shape and dtype, checked before a byte is read
                shape, dtype = list(declared.get_shape()), str(declared.get_dtype())
                if len(shape) != 2 or shape[-1] != layer.dim or not 0 < shape[0] <= MAX_ROWS_PER_LAYER \
                        or dtype not in ("F16", "BF16", "F32", "F64"):
                    raise InputError(f"{path}: {name} holds {shape} {dtype}, not rows of {layer.dim}")
                t = fh.get_tensor(name).to(torch.float64)
                if not bool(torch.isfinite(t).all()):  # no probe: a NaN row has no q, nothing to compare
                    raise InputError(f"{path}: {name} holds non-finite values; refused")
                rows[name] = t
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{path}: not a readable safetensors capture ({' '.join(str(exc).split())[:160]})") from None
    if not rows:
        raise InputError(f"{path}: holds rows for none of the checked layers; refused")
    return rows, meta


_MANTISSA = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}


def _same_norms(fh, meta: dict, layers, path) -> str:
    """Another copy of the capture's model (a GGUF's float32 norms against the HF copy's bfloat16
    ones): the same layer names and shapes, and every stored value equal once both are rounded to
    the coarser of the two storage dtypes. Anything else is another model: refused in one line."""
    import torch

    def other(why: str) -> InputError:
        return InputError(f"{path}: captured from another model ({why}; its norm fingerprint "
                          f"{str(meta['fingerprint'])[:12]}... is not this checkpoint's); refused")

    stored = meta.get("norms")
    if not isinstance(stored, dict):
        raise other("the capture does not record its norms")
    here = {layer.name: layer for layer in layers if layer.weight is not None}
    if set(stored) != set(here):
        only = sorted(set(stored) ^ set(here))
        raise other(f"{len(only)} norm layer(s) in one and not the other, e.g. {only[0]}")
    keys = set(fh.keys())
    worst, coarsest = 0.0, "float64"
    for name, layer in here.items():
        info = stored[name]
        mine = str(layer.weight.dtype).removeprefix("torch.")
        theirs = info.get("dtype") if isinstance(info, dict) else None
        if theirs not in _MANTISSA or mine not in _MANTISSA or info.get("shape") != list(layer.weight.shape):
            raise other(f"{name} is {info} there, {mine} {list(layer.weight.shape)} here")
        coarse = min((mine, theirs), key=_MANTISSA.get)
        coarsest = min((coarsest, coarse), key=_MANTISSA.get)
        for part, t in (("weight", layer.weight), ("bias", layer.bias)):
            key = f"{NORM_PREFIX}{part}:{name}"
            if t is None:
                continue
            if key not in keys or list(fh.get_slice(key).get_shape()) != list(t.shape):
                raise other(f"{name}'s {part} is not in the capture as this checkpoint has it")
            a, b = fh.get_tensor(key).to(torch.float64), t.detach().cpu().to(torch.float64)
            dt = getattr(torch, coarse)
            if not torch.equal(a.to(dt), b.to(dt)):
                diff = float((a - b).abs().max())
                raise other(f"{name}'s {part} differs by up to {diff:.3g}, more than {coarse} rounding")
            worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
    return (f"the same norm layers, names and shapes, values equal within {coarsest} rounding "
            f"(largest difference {worst:.3g})")


def q_summary(rows, eps: float, kind: str) -> dict:
    """Where real rows sit on the q/eps scale: min, 1st and 50th percentile, and the share under
    the 1 % attenuation budget (q/eps < 49.25, where sqrt(q / (q + eps)) < 0.99)."""
    import torch

    from parity_cli.backends.implementations import mean_square
    from parity_cli.options import ONE_PERCENT_Q_OVER_EPS

    r = mean_square(rows, kind) / eps if eps > 0 else torch.full((rows.shape[0],), float("inf"), dtype=torch.float64)
    return {"rows": int(r.numel()), "min": float(r.min()), "p01": float(torch.quantile(r, 0.01)),
            "p50": float(torch.quantile(r, 0.5)),
            "below_1pct_budget": float((r < ONE_PERCENT_Q_OVER_EPS).double().mean())}


def eps_impact(rows, gain, bias, eps: float, other_eps: float, kind: str, rtol: float) -> dict:
    """What an eps of `other_eps` instead of `eps` does to real rows, in float64: per row the
    largest |change| over the row's largest |output|; the share of rows moved by more than rtol
    and by more than 1 %, and the worst row."""
    from parity_cli.backends.implementations import oracle_normalize

    def out(e):
        y = oracle_normalize(rows, e, kind) * gain
        return y if bias is None else y + bias

    return {"eps": other_eps, **_moved(out(other_eps), out(eps), rtol)}


def _moved(changed, base, rtol: float) -> dict:
    """Per row the largest |change| over the row's largest |output| (a NaN row counts as moved
    without bound): how many rows move past rtol and past 1 %, and the worst."""
    import torch

    scale = base.abs().amax(-1).clamp_min(torch.finfo(torch.float64).tiny)
    move = (changed - base).abs().amax(-1) / scale
    move = torch.where(torch.isnan(move), torch.full_like(move, float("inf")), move)
    worst = int(torch.argmax(move))
    return {"rows": int(move.numel()), "share_over_rtol": float((move > rtol).double().mean()),
            "share_over_1pct": float((move > 0.01).double().mean()),
            "worst_row": {"index": worst, "move": float(move[worst])}}


def captured_summary(layer, strata, gain, bias, eps: float, tol, diagnoses) -> dict | None:
    """For the report: the real rows' q/eps, what the candidate does to them (measured), and what
    each diagnosed eps would do to them on its own (computed in float64)."""
    s = next((s for s in strata if s.name == "captured"), None)
    if s is None or s.x is None:
        return None
    out = {"q_over_eps": q_summary(s.x, eps, layer.kind)}
    if s.cand is not None and s.ref is not None:
        out["candidate"] = _moved(s.cand, s.ref, tol.rtol)
    impacts = []
    for d in diagnoses:
        est = d.evidence.get("estimated_eps") if d.code == "eps_mismatch" else None
        if isinstance(est, (int, float)) and est > 0:
            impacts.append({"code": d.code, **eps_impact(s.x, gain, bias, eps, est, layer.kind, tol.rtol)})
    out["impact"] = impacts
    return out
