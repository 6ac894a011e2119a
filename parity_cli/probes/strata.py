"""Stage 3: stratified probe inputs, sized to each layer and deterministic for a seed.

Each stratum targets one way implementations disagree (eps dominating small inputs, x^2
overflowing on large ones, a gain hidden by outlier channels). Probes are generated in
float64 and rounded to the candidate dtype; the reference is fed exactly the rounded
values, so input rounding never counts against a candidate."""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass, field
from functools import cache, cached_property

from parity_cli.errors import InputError
from parity_cli.resources import configs_dir, load_toml


@dataclass(frozen=True)
class StratumSpec:
    name: str
    generator: str
    description: str
    default: bool
    params: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass
class Probe:
    stratum: str
    x: object  # torch.float64 tensor (vectors, dim), values exactly representable in the candidate dtype
    # kind -> per-row q (mean square / variance), then what diagnosis computes from x alone:
    # shared by every layer of the probe set (ProbeSet.mean_square fills q)
    q: dict = field(default_factory=dict, repr=False)


@cache
def load_strata() -> dict[str, StratumSpec]:
    path = configs_dir() / "probes.toml"
    data = load_toml(path)
    strata = {}
    for name, table in data.items():
        if not isinstance(table, dict) or "generator" not in table:
            raise InputError(f"{path}: stratum '{name}' has no generator")
        if table["generator"] not in GENERATORS:
            raise InputError(f"{path}: stratum '{name}': unknown generator '{table['generator']}'")
        params = {k: v for k, v in table.items() if k not in ("generator", "description", "default")}
        strata[name] = StratumSpec(
            name=name,
            generator=table["generator"],
            description=table.get("description", ""),
            default=bool(table.get("default", True)),
            params=params,
        )
    return strata


def select_strata(names: list[str] | None) -> list[StratumSpec]:
    strata = load_strata()
    if not names:
        return [s for s in strata.values() if s.default]
    unknown = [n for n in names if n not in strata]
    if unknown:
        raise InputError(f"--strata: unknown stratum '{unknown[0]}'; known: {', '.join(strata)}")
    return [strata[n] for n in dict.fromkeys(names)]


# --- generators: (params, dim, eps, dtype, rng) -> float64 tensor (vectors, dim) -------------

def _zero(p, dim, eps, dtype, rng):
    import torch

    return torch.zeros(int(p.get("vectors", 1)), dim, dtype=torch.float64)


def _q_over_eps(p, dim, eps, dtype, rng):
    """Rows rescaled so that mean(x^2) = level * eps exactly (before rounding to the dtype)."""
    import torch

    levels = [float(v) for v in p["q_over_eps"]]
    per = int(p.get("vectors_per_level", 1))
    rows = []
    for level in levels:
        for _ in range(per):
            z = torch.randn(dim, dtype=torch.float64, generator=rng)
            q = float((z * z).mean())
            rows.append(z * math.sqrt(level * max(eps, 0.0) / q) if eps > 0 else z * 1e-6 * math.sqrt(level))
    return torch.stack(rows)


def _gaussian(p, dim, eps, dtype, rng):
    import torch

    return torch.randn(int(p.get("vectors", 4)), dim, dtype=torch.float64, generator=rng) * float(p.get("scale", 1.0))


def _constant(p, dim, eps, dtype, rng):
    import torch

    values = torch.tensor([float(v) for v in p["values"]], dtype=torch.float64)
    return values[:, None].expand(-1, dim).clone()


def _signed_log_uniform(n, dim, lo, hi, rng):
    import torch

    u = torch.rand(n, dim, dtype=torch.float64, generator=rng)
    mag = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    sign = torch.where(torch.rand(n, dim, generator=rng) < 0.5, -1.0, 1.0).to(torch.float64)
    return mag * sign


def _log_uniform(p, dim, eps, dtype, rng):
    return _signed_log_uniform(int(p.get("vectors", 4)), dim, float(p["min_magnitude"]), float(p["max_magnitude"]), rng)


def _outlier(p, dim, eps, dtype, rng):
    import torch

    n = int(p.get("vectors", 4))
    x = torch.randn(n, dim, dtype=torch.float64, generator=rng)
    k = min(int(p.get("channels", 2)), dim)
    for row in range(n):
        channels = torch.randperm(dim, generator=rng)[:k]
        x[row, channels] = _signed_log_uniform(1, k, float(p["min_magnitude"]), float(p["max_magnitude"]), rng)[0]
    return x


def _offset(p, dim, eps, dtype, rng):
    import torch

    means = torch.tensor([float(m) for m in p["means"]], dtype=torch.float64)
    means = means.repeat_interleave(int(p.get("vectors_per_mean", 1)))
    return means[:, None] + torch.randn(len(means), dim, dtype=torch.float64, generator=rng)


def _dtype_extreme(p, dim, eps, dtype, rng):
    import torch

    top = torch.finfo(dtype).max
    return _signed_log_uniform(int(p.get("vectors", 2)), dim, math.sqrt(top), top / 4, rng)


GENERATORS = {
    "zero": _zero,
    "q_over_eps": _q_over_eps,
    "gaussian": _gaussian,
    "constant": _constant,
    "log_uniform": _log_uniform,
    "outlier": _outlier,
    "dtype_extreme": _dtype_extreme,
    "offset": _offset,
}


@dataclass
class ProbeSet:
    """Every stratum's rows in one float64 batch, built once per (strata, dim, eps, dtype, seed)
    and shared by every layer that has them: the reference normalises it once and each layer
    multiplies by its gain; the comparison runs over the whole batch in a few passes.

    Nobody writes into it: a candidate gets copies (parity_cli.isolation.runners), the reference reads."""

    x: object  # float64 (rows, dim)
    probes: list  # one Probe per stratum, its x a view of the batch rows
    cache: dict = field(default_factory=dict, repr=False)  # per probe set: q, normalised rows, dtype copies

    @cached_property
    def segments(self) -> list[tuple[str, int, int]]:
        """(stratum, first row, end row) of each probe in the batch."""
        out, start = [], 0
        for p in self.probes:
            out.append((p.stratum, start, start + p.x.shape[0]))
            start += p.x.shape[0]
        return out

    def mean_square(self, kind: str):
        """q of every row of the batch (float64, rows); each probe's q is its view of it."""
        key = ("q", kind)
        if key not in self.cache:
            from parity_cli.backends.implementations import mean_square

            self.cache[key] = mean_square(self.x, kind)
            for p, (_, lo, hi) in zip(self.probes, self.segments):
                p.q.setdefault(kind, self.cache[key][lo:hi])
        return self.cache[key]

    def on(self, device):
        """The batch on `device`: one transfer per probe set, whatever the number of layers."""
        device = canonical(device)
        if device == "cpu":
            return self.x
        key = ("on", device)
        if key not in self.cache:
            self.cache[key] = self.x.to(device)
        return self.cache[key]

    def normalised(self, eps: float, kind: str, normalise, device="cpu"):
        """normalise(x, eps, kind) of the batch: the gain-free part of a reference that is
        y = N(x) * gain (+ bias), computed once for every layer of this probe set."""
        key = ("normalised", eps, kind, normalise, canonical(device))
        if key not in self.cache:
            self.cache[key] = normalise(self.on(device), eps, kind)
        return self.cache[key]

    def at(self, dtype):
        """The batch rounded to `dtype` (exact: the probes are representable in it)."""
        key = ("at", str(dtype))
        if key not in self.cache:
            self.cache[key] = self.x.to(dtype)
        return self.cache[key]


def canonical(device) -> str:
    """"cuda" and "cuda:0" (the current device) are one device, and one cache entry."""
    text = str(device)
    if text == "cuda":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return text


def probe_set(rows: list[Probe]) -> ProbeSet:
    """A one-off set (the captured rows of one layer): not cached."""
    import torch

    x = torch.cat([p.x for p in rows]) if len(rows) > 1 else rows[0].x
    out, start = [], 0
    for p in rows:
        out.append(Probe(stratum=p.stratum, x=x[start:start + p.x.shape[0]]))
        start += p.x.shape[0]
    return ProbeSet(x=x, probes=out)


_CACHE: dict = {}
_CACHE_SIZE = 8
_LOCK = threading.Lock()


def build_probe_set(strata: list[StratumSpec], dim: int, eps: float, dtype, seed: int) -> ProbeSet:
    """One batch per stratum list; each stratum has its own stream, so adding one changes no other.

    Every layer with the same dim, eps and dtype gets the same set: built once, read by all."""
    key = (tuple((s.name, s.generator, repr(sorted(s.params.items()))) for s in strata), dim, eps, str(dtype), seed)
    with _LOCK:  # --jobs threads share the cache: one builds a set, none sees it evicted half-way
        ps = _CACHE.get(key)
        if ps is None:
            if len(_CACHE) >= _CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            ps = _CACHE[key] = probe_set(_build(strata, dim, eps, dtype, seed))
    return ps


def build_probes(strata: list[StratumSpec], dim: int, eps: float, dtype, seed: int) -> list[Probe]:
    """The set's probes (views of its batch: read them, copy before writing)."""
    return build_probe_set(strata, dim, eps, dtype, seed).probes


def batch_norm_probe_set(strata: list[StratumSpec], mean, var, gain, eps: float, dtype, seed: int) -> ProbeSet:
    """A BatchNorm's probes, in the units of its own running statistics: a stratum's row z becomes
    x = running_mean + z * sqrt(running_var + eps) per channel, so that the reference's normalised
    value is z itself. `normal` is then the activations the statistics describe, `tiny` sits at the
    running mean (where w h + b is all bias), `large` is 256..6e4 deviations out, `outlier` a few
    channels 1e3..1e4 out; `zero` stays x = 0. Every channel is excited at its own scale, the
    smallest-variance ones, where eps shows, included. A BatchNorm's output is not bounded as a
    norm's row is (h = z, not z / rms(z)): a row whose exact output w h would pass a sixteenth of
    the dtype's range is scaled back, since no implementation at that dtype could hold it. Built
    per layer: the statistics are the layer's."""
    import torch

    mean = mean.to(torch.float64)
    scale = torch.sqrt(var.to(torch.float64) + eps)
    limit = torch.finfo(dtype).max / 16
    gain = gain.to(torch.float64).abs().clamp_min(1e-300)
    dim = mean.shape[-1]
    rows = []
    for probe in _build(strata, dim, eps, torch.float64, seed):
        z = probe.x
        if probe.stratum != "zero":
            reach = (z.abs() * gain).amax(-1, keepdim=True)
            z = torch.where(reach > limit, z * (limit / reach), z)
            z = mean + z * scale
        x = z.to(dtype)
        # an input past the dtype's range (a huge mean plus deviations) cannot be fed: left at 0
        x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).to(torch.float64)
        rows.append(Probe(stratum=probe.stratum, x=x))
    return probe_set(rows)


def group_norm_probe_set(strata: list[StratumSpec], channels: int, groups: int, spatial: int, eps: float, dtype,
                         seed: int) -> ProbeSet:
    """A GroupNorm's probes: rows of `channels` x `spatial` positions (channel-major), each group
    a contiguous run. Every stratum is the usual one at that width, except where one group is the
    point: in `tiny` and `constant` rows a single group (a different one each row) is tiny (its
    variance at the stratum's multiples of eps) or constant (variance 0, where eps alone sets the
    output) while every other group holds N(0, 1) activations, as a silent channel group of a real
    feature map does. A group's statistic is its own: the others must not hide it."""
    import torch

    width = channels * spatial
    size = width // groups
    rows = []
    for probe in _build(strata, width, eps, torch.float64, seed):
        x = probe.x
        if probe.stratum in ("tiny", "constant") and groups > 1:
            rng = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{probe.stratum}:groups:{width}".encode()))
            own = x.clone()
            x = torch.randn(x.shape, generator=rng, dtype=torch.float64)
            for r in range(x.shape[0]):
                g = r % groups
                x[r, g * size:(g + 1) * size] = own[r, g * size:(g + 1) * size]
        rows.append(Probe(stratum=probe.stratum, x=x.to(dtype).to(torch.float64)))
    return probe_set(rows)


# a gated norm's gates, crossed with every x stratum: act(z) of N(0, 1), of 0 (silu(0) = 0: the gate
# closes, and a gate before the statistic leaves an all-zero row), of very negative z (silu and
# sigmoid ~ 1e-13: a gated row whose q/eps is ~0, where eps alone sets the output) and of large z
GATES = (("normal", None), ("zero", 0.0), ("closed", -30.0), ("open", 12.0))


def gated_probe_set(strata: list[StratumSpec], dim: int, eps: float, dtype, seed: int) -> ProbeSet:
    """A gated norm's probes: rows [x | z], each x row of every stratum once with each gate of
    GATES. Where the gate goes (before or after the statistic) decides which rows show eps: a
    closed gate before it makes q tiny whatever x is."""
    import torch

    rows = []
    for probe in _build(strata, dim, eps, torch.float64, seed):
        rng = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{probe.stratum}:gate:{dim}".encode()))
        x = probe.x
        parts = []
        for _, value in GATES:
            z = torch.randn(x.shape, generator=rng, dtype=torch.float64) if value is None else \
                torch.full_like(x, value) + 0.1 * torch.rand(x.shape, generator=rng, dtype=torch.float64) * (value != 0)
            parts.append(torch.cat([x, z], dim=-1))
        rows.append(Probe(stratum=probe.stratum, x=torch.cat(parts).to(dtype).to(torch.float64)))
    return probe_set(rows)


def _build(strata: list[StratumSpec], dim: int, eps: float, dtype, seed: int) -> list[Probe]:
    import torch

    probes = []
    for spec in strata:
        rng = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{spec.name}:{dim}".encode()))
        x = GENERATORS[spec.generator](spec.params, dim, eps, dtype, rng)
        probes.append(Probe(stratum=spec.name, x=x.to(dtype).to(torch.float64)))
    return probes
