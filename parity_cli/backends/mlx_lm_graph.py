"""Inside MLX-LM: `parity capture MLX_DIR --runtime mlx-lm` loads a directory `mlx_lm.convert` wrote
with mlx-lm's own `mlx_lm.load` (the model class mlx-lm picks for the config's model_type, its
tokenizer), runs the tokens through the model on MLX's default device, and records every norm
module's input and output rows, the eps the module holds and the gain it multiplies by.

A module is a norm when its class is named like one and holds a `weight`; what it multiplies by is
read from the module as MLX runs it: Gemma's classes in mlx-lm compute `mx.fast.rms_norm(x, 1.0 +
self.weight, eps)`, so their gain is `1.0 + weight` evaluated by MLX at the weight's dtype (a
bfloat16 model rounds that sum to bfloat16). Each recorded module is the model's own instance, its
class swapped for a subclass whose __call__ keeps (x, y) and returns y unchanged.

mlx-lm names its modules as the Hugging Face checkpoint names its parameters (model.layers.0.
input_layernorm), so a node is the layer of the same name."""

from __future__ import annotations

import inspect
from pathlib import Path

from parity_cli.backends import distribution_version
from parity_cli.errors import InputError


def version() -> str | None:
    return distribution_version("mlx-lm")


def _offset(cls) -> float:
    """1.0 where the class adds one to its weight before the kernel (mlx-lm's Gemma norms)."""
    try:
        source = inspect.getsource(cls.__call__)
    except (OSError, TypeError):
        return 0.0
    return 1.0 if "1.0 + self.weight" in source or "1 + self.weight" in source else 0.0


def _norms(model) -> list[tuple[str, object]]:
    return [(name, m) for name, m in model.named_modules()
            if "norm" in type(m).__name__.lower() and "weight" in m and getattr(m, "eps", None) is not None]


def _record_calls(modules, seen: dict) -> None:
    for name, module in modules:
        cls = type(module)

        def call(self, x, *args, _name=name, _cls=cls, **kwargs):
            y = _cls.__call__(self, x, *args, **kwargs)
            seen.setdefault(_name, []).append((x, y))
            return y

        module.__class__ = type(f"Recorded{cls.__name__}", (cls,), {"__call__": call})


def _numpy(a, dim: int):
    import mlx.core as mx
    import numpy as np

    return np.array(a.astype(mx.float32), copy=True).reshape(-1, dim)


def record(path, text: str | None, tokens: list[int] | None, max_tokens: int) -> dict:
    """{"nodes": [...], "tokens": n, "version", "backend"}: what runtime_capture.record keeps."""
    import mlx.core as mx
    import numpy as np

    path = Path(path)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise InputError(f"{path}: --runtime mlx-lm loads a directory mlx_lm.convert wrote (config.json and its "
                         "safetensors)")
    from mlx_lm import load

    try:
        # a config's model_file, a tokenizer's auto_map: code the directory holds, never run
        model, tokenizer = load(str(path), tokenizer_config={"trust_remote_code": False}, trust_remote_code=False)
    except Exception as exc:
        raise InputError(f"{path}: mlx-lm could not load it: {' '.join(str(exc).split())[:240]}") from None
    if tokens is None:
        tokens = list(tokenizer.encode(text))
    tokens = tokens[:max_tokens]
    if not tokens:
        raise InputError("the text has no tokens")
    norms = _norms(model)
    seen: dict = {}
    _record_calls(norms, seen)
    try:
        mx.eval(model(mx.array([tokens])))
    except Exception as exc:
        raise InputError(f"{path}: mlx-lm could not run it: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:240]}") from None
    nodes = []
    for name, module in norms:
        if name not in seen:
            continue
        cls = type(module).__mro__[1]  # the model's own class (under the recording subclass)
        weight = module.weight
        dim = weight.shape[-1]
        offset = _offset(cls)
        gain = (1.0 + weight) if offset else weight
        kind = "layer_norm" if "layernorm" in cls.__name__.lower() else "rms_norm"
        bias = module.get("bias") if kind == "layer_norm" else None
        op = "mx.fast.layer_norm" if kind == "layer_norm" else "mx.fast.rms_norm"
        dtype = str(seen[name][0][0].dtype).removeprefix("mlx.core.")
        stored = str(weight.dtype).removeprefix("mlx.core.")
        nodes.append({
            "layer": name, "node": f"{cls.__module__}.{cls.__qualname__} {name}", "op": op, "kind": kind,
            "eps": float(module.eps), "eps_source": f"mlx-lm: {name}.eps, from the model's config",
            "chain": [f"{cls.__qualname__}: {op}(x, {'1.0 + weight' if offset else 'weight'}, eps)"],
            "gain": (f"{name}.weight", np.array(gain.astype(mx.float32)), stored),
            "bias": None if bias is None else (f"{name}.bias", np.array(bias.astype(mx.float32)), stored),
            "dtype": dtype,
            "x": np.concatenate([_numpy(x, dim) for x, _ in seen[name]]),
            "y": np.concatenate([_numpy(y, dim) for _, y in seen[name]])})
    return {"nodes": nodes, "tokens": len(tokens), "version": version(),
            "backend": f"MLX ({distribution_version('mlx')}) on {mx.default_device()}"}
