"""Classifiers for the norm kinds beyond RMSNorm/LayerNorm (issue 26), each run on the module
itself: a GroupNorm and a gated RMSNorm are named only where the module computes exactly that
form in float64, and their parameters (the group count, where the gate goes, its activation,
the numerics order) are read off what the module does, never off its name."""

from __future__ import annotations

import copy
import re


def group_norm_form(module, eps: float | None) -> dict:
    """nn.GroupNorm (or a subclass): a LayerNorm over each group of channels and all positions."""
    import torch

    weight = getattr(module, "weight", None)
    groups = getattr(module, "num_groups", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or type(groups) is not int or eps is None:
        return {"unsupported": "GroupNorm without a gain (affine=False) or without num_groups/eps"}
    channels = weight.shape[0]
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(3, channels, 5, generator=gen, dtype=torch.float64)
    x[0, : channels // groups] *= 1e-3  # a tiny group: eps shows there
    m64 = copy.deepcopy(module).to(torch.float64).eval()
    try:
        with torch.no_grad():
            y = m64(x)
    except Exception as exc:
        return {"unsupported": f"GroupNorm forward raises {type(exc).__name__}: {' '.join(str(exc).split())[:80]}"}
    g = x.reshape(3, groups, -1)
    h = ((g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + eps)).reshape(x.shape)
    b = m64.bias if isinstance(m64.bias, torch.Tensor) else 0.0
    want = h * m64.weight[:, None] + (b[:, None] if isinstance(b, torch.Tensor) else 0.0)
    if not isinstance(y, torch.Tensor) or y.shape != want.shape or not torch.allclose(y, want, rtol=1e-12, atol=1e-12):
        return {"unsupported": "GroupNorm whose output is not a LayerNorm per group of channels"}
    return {"kind": "group_norm", "groups": "channels" if groups == channels and channels > 1 else groups,
            "gain_offset": 0.0, "bias": isinstance(module.bias, torch.Tensor), "order": "native",
            "inverse_sqrt": "rsqrt", "order_exact": True}


def _call_gated(module, x, z):
    try:
        return module(x, gate=z)
    except TypeError:
        return module(x, z)


def gated_form(module, eps: float | None) -> dict:
    """A norm whose forward takes a gate z: which of the gated RMSNorm forms (gate before or after
    the statistic, silu or sigmoid, the statistic per group) it computes in float64, then which
    numerics order (llama or gemma) it matches bit for bit at bfloat16 and float16."""
    import torch

    from parity_cli.model.forms import gated_forward

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or eps is None:
        return {"unsupported": "gated norm without a 1-D gain or an eps"}
    dim = weight.shape[0]
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(6, dim, generator=gen, dtype=torch.float64)
    x[1] *= 1e-3
    z = torch.randn(6, dim, generator=gen, dtype=torch.float64) * 2
    z[2] = -30.0  # a closed gate
    m64 = copy.deepcopy(module).to(torch.float64).eval()
    with torch.no_grad():
        m64.weight.copy_(torch.rand(dim, generator=gen, dtype=torch.float64) + 0.5)
        try:
            y = _call_gated(m64, x, z)
        except Exception as exc:
            return {"unsupported": f"gated norm forward(x, gate) raises {type(exc).__name__}: "
                                   f"{' '.join(str(exc).split())[:80]}"}
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return {"unsupported": "gated norm whose forward(x, gate) is not a tensor of x's shape"}
    w = m64.weight.detach()
    group_counts = [g for g in range(1, dim + 1) if dim % g == 0 and g <= 64]
    scale = float(y.abs().max()) or 1.0
    found = None
    for gate in ("before", "after"):
        for activation in ("silu", "sigmoid"):
            act = torch.nn.functional.silu(z) if activation == "silu" else torch.sigmoid(z)
            for groups in group_counts:
                h = x * act if gate == "before" else x
                g = h.reshape(6, groups, -1)
                n = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(6, dim) * w
                want = n * act if gate == "after" else n
                if float((y - want).abs().max()) <= 1e-5 * scale:  # float32 inside a float64 module
                    found = (gate, activation, groups)
                    break
            if found:
                break
        if found:
            break
    if found is None:
        return {"unsupported": "gated norm matching no form RMSNorm(x * act(z)) or RMSNorm(x) * act(z), act silu "
                               "or sigmoid, per group"}
    gate, activation, groups = found
    out = {"kind": "gated_rms_norm", "gate": gate, "activation": activation, "groups": groups, "gain_offset": 0.0,
           "bias": False, "inverse_sqrt": "rsqrt"}
    rows = torch.randn(32, dim, generator=gen, dtype=torch.float64)
    gates = torch.randn(32, dim, generator=gen, dtype=torch.float64) * 3
    for order in ("llama", "gemma"):
        exact = True
        for dtype in (torch.bfloat16, torch.float16):
            m = copy.deepcopy(module).to(dtype).eval()
            with torch.no_grad():
                m.weight.copy_(torch.rand(dim, generator=gen) + 0.5)
                xs, zs = rows.to(dtype), gates.to(dtype)
                got = _call_gated(m, xs, zs)
                want = gated_forward(order, gate, activation, groups, dim, m.weight, eps)(torch.cat([xs, zs], -1))
            if got.dtype != want.dtype or not torch.equal(got, want):
                exact = False
                break
        if exact:
            out.update(order=order, order_exact=True)
            return out
    out.update(order="llama", order_exact=False)
    return out


# the keys that count a gated norm's groups (Mamba2's n_groups and its hybrids' spellings), not every
# key that says group: an MoE router's n_group or num_expert_group is another thing
GROUP_KEY = re.compile(r"^(mamba_)?n_?groups$", re.IGNORECASE)


def groups_key(configs, count: int) -> str | None:
    """The config key (dotted, in a sub-config) whose value is this group count, where one names
    groups (`n_groups`, `mamba_n_groups`, `mamba_ngroups`): a real checkpoint's count is its
    config's, not the shrunk model's."""
    for path, sub in configs:
        for key, value in sorted(vars(sub).items()):
            if type(value) is int and value == count and GROUP_KEY.search(key):
                return path + key
    return None


SIZE_ATTRIBUTES = ("normalized_shape", "hidden_size", "dim", "head_dim", "num_features", "d_model")


def _size_of(module) -> int | None:
    for attr in SIZE_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, (tuple, list, torch_size_type())) and len(value) == 1:
            value = value[0]
        if type(value) is int and value > 0:
            return value
    return None


def torch_size_type():
    import torch

    return torch.Size


def measured_eps(module, dim: int, centred: bool) -> float | None:
    """The eps a parameterless norm applies, measured where it shows: on a row of mean square
    ~1e-10 its output is x / sqrt(q + eps), so eps = mean((x / y)^2) - q (the module's own float32
    arithmetic included). Rounded to 3 significant digits: the model code writes a round number."""
    import math

    import torch

    x = torch.randn(1, dim, generator=torch.Generator().manual_seed(dim), dtype=torch.float64) * 1e-5
    if centred:
        x = x - x.mean()
    m64 = copy.deepcopy(module).to(torch.float64).eval()
    try:
        with torch.no_grad():
            y = m64(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    big = x.abs() > 0.5 * x.abs().max()
    q = float((x * x).mean())
    eps = float(((x[big] / y[big]) ** 2).mean()) - q
    if not math.isfinite(eps) or eps <= 0:
        return None
    return float(f"{eps:.3g}")


def weightless_form(module, eps: float | None, name: str = "", seen: int | None = None) -> dict:
    """A norm with no parameter: RMSNorm or LayerNorm with a gain of 1, its eps the module's own
    (an attribute, or measured where the model code fixes it inside forward), its size from the
    module (normalized_shape, dim, ...), else the size it was `seen` at in a forward pass of the
    model, else, for a size-free q/k/v norm, head_dim."""
    import torch

    from parity_cli.model.forms import hf_forward

    size = _size_of(module) or seen  # its own, or what it saw in a forward pass of the model
    dim_key = None
    if size is None:
        if not re.search(r"(^|\.|_)(q|k|v|qk)_?norm$", name):
            return {"unsupported": "weightless norm with no size of its own (none of "
                                   f"{', '.join(SIZE_ATTRIBUTES)})"}
        size, dim_key = 16, "head_dim"  # a q/k norm runs over each head: the shrunk config's head_dim is 16
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(6, size, generator=gen, dtype=torch.float64)
    x[1] *= 1e-3
    x[2] += 3.0
    m64 = copy.deepcopy(module).to(torch.float64).eval()
    try:
        with torch.no_grad():
            y = m64(x)
    except Exception as exc:
        return {"unsupported": f"weightless norm forward(x) raises {type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:80]}"}
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return {"unsupported": "weightless norm whose forward(x) is not a tensor of x's shape"}
    scale = float(y.abs().max()) or 1.0
    for kind in ("rms_norm", "layer_norm"):
        value = eps if eps is not None else measured_eps(module, size, kind == "layer_norm")
        if value is None:
            continue
        h = x - x.mean(-1, keepdim=True) if kind == "layer_norm" else x
        want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + value)
        if float((want - y).abs().max()) > 1e-5 * scale:
            continue
        out = {"kind": kind, "gain_offset": 0.0, "bias": False, "weightless": True, "size": size,
               "dim_key": dim_key, "measured_eps": value if eps is None else None, "inverse_sqrt": "rsqrt"}
        orders = ("native_fp32", "gemma", "llama", "native") if kind == "layer_norm" else ("gemma", "llama")
        # bit for bit at float32 too where one transcription is (rsqrt and pow part there), else at the halves
        tries = [(o, s, dtypes) for dtypes in ((torch.bfloat16, torch.float16, torch.float32),
                                               (torch.bfloat16, torch.float16))
                 for o in orders for s in ("rsqrt", "pow")]
        for order, inverse_sqrt, dtypes in tries:
            exact = True
            for dtype in dtypes:
                m = copy.deepcopy(module).to(dtype).eval()
                xs = (x * 0.5).to(dtype)
                with torch.no_grad():
                    try:
                        got = m(xs)
                        want = hf_forward(kind, order, 0.0, inverse_sqrt, size, torch.ones(size, dtype=dtype), None,
                                          value)(xs)
                    except Exception:
                        exact = False
                        break
                if got.dtype != want.dtype or not torch.equal(got, want):
                    exact = False
                    break
            if exact:
                out.update(order=order, inverse_sqrt=inverse_sqrt, order_exact=True)
                return out
        out.update(order="gemma", order_exact=False)
        return out
    return {"unsupported": "weightless norm matching no RMSNorm/LayerNorm form with a gain of 1"}


class ChannelsFirst:
    """A channels-first norm (ConvNeXt's and SAM's LayerNorm with data_format="channels_first",
    normalising over C at each position of an (N, C, H, W) map) seen as a norm of rows: each row
    is one position's C channels, fed as an (N, C, 1, 1) map. What it computes per position is then
    exactly a LayerNorm (or RMSNorm) of the row, and is classified as one."""

    def __init__(self, module):
        self.module = module

    def __getattr__(self, name):
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    def __deepcopy__(self, memo):
        return ChannelsFirst(copy.deepcopy(self.module, memo))

    def to(self, *args, **kwargs):
        self.module = self.module.to(*args, **kwargs)
        return self

    def eval(self):
        self.module.eval()
        return self

    def __call__(self, x):
        y = self.module(x.reshape(*x.shape, 1, 1))
        return y.reshape(x.shape) if hasattr(y, "reshape") and y.numel() == x.numel() else y


def channels_first(module) -> bool:
    """A norm that refuses rows but takes an (N, C, 1, 1) map and returns one (data_format
    "channels_first", or a class built for feature maps only)."""
    import torch

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return False
    if getattr(module, "data_format", None) == "channels_first":
        return True
    x = torch.randn(2, weight.shape[0], dtype=weight.dtype if weight.is_floating_point() else torch.float32)
    try:
        with torch.no_grad():
            module(x)
        return False
    except Exception:
        pass
    try:
        with torch.no_grad():
            y = module(x.reshape(2, -1, 1, 1))
    except Exception:
        return False
    return isinstance(y, torch.Tensor) and tuple(y.shape) == (2, weight.shape[0], 1, 1)
