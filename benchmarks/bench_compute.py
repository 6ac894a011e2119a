"""Compute: per-layer reference + comparison cost against bare F.rms_norm in float64, the full
check of the 405B-shaped model, scaling with layers and dim, peak RSS, threads.

    python benchmarks/bench_compute.py                  # everything, ~4-5 min on 2 cores
    python benchmarks/bench_compute.py --repeat 5 --only micro,full
    python benchmarks/bench_compute.py --profile        # + cProfile of one api.check on the 405B shape

Sections (--only NAME,...; all but `profile` by default):
  micro    one layer's work on its probe batch (default strata, dim 16384, bf16 candidate):
           bare torch.nn.functional.rms_norm in float64 on the same probe tensors is the
           baseline; reference (oracle), comparison (comparison.compare), both, the candidate
           and probe generation are ratios to it. Torch intra-op threads 1 and 2.
  full     `parity check DIR --candidate torch -q --json ...` on the 405B shape as a subprocess:
           --threads 2 vs 1 (the default), --jobs 2, and the layers split by hand over two
           processes (--layers '*.input_layernorm' | '*.post_attention_layernorm': 252 of 253).
           Busy-neighbour figures: benchmarks/bench_busy.py.
  scaling  api.check in-process on sparse models of 4..32 layers (dim 16384) and dim
           2048..16384 (8 layers): least-squares line, R^2, worst residual.
  rss      peak RSS of `parity check` (subprocess) on 8 and 126 layers at dim 16384, against
           the floor `python -c "import torch, safetensors, parity_cli.api"`.
  failing  a failing check (--candidate-eps 1e-6 on an eps-1e-5 model: every layer fails and
           diagnosis runs) against the passing one, per layer, in-process.
  explain  the failing 405B-shaped check (every layer fails the same way) with --explain against
           without it, as a user runs it: one ladder per group of layers that fail the same way.
  profile  cProfile of one in-process api.check on the 405B shape, top 25 by cumulative time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_ROOT,
    busy_note,
    collect,
    ensure_model,
    fit_line,
    median,
    parity_cmd,
    print_machine,
    run_child,
    spawn,
    wait_quiet,
)

SECTIONS = ("micro", "full", "isolation", "scaling", "rss", "failing", "explain")


def timeit(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of one call."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


# --- micro -------------------------------------------------------------------------------------

def bench_layer(dim: int, iters: int, eps: float = 1e-5):
    """One layer's work as check_layer does it: the probe set is one batch, its N(x) computed
    once for every layer (each layer multiplies by its gain), the comparison one batched pass
    per quantity into reused buffers. Also the oracle from scratch, for what the cache saves."""
    import torch
    import torch.nn.functional as F

    from parity_cli.backends.implementations import BUILTINS, oracle_normalize
    from parity_cli.comparison import compare_batch, tolerance_for, workspace
    from parity_cli.model.layers import NormLayer
    from parity_cli.probes.strata import _build, probe_set, select_strata
    from parity_cli.sources.tensors import Eps

    bf16 = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    w = (1 + 0.1 * torch.randn(dim, generator=gen, dtype=torch.float64)).to(bf16)
    layer = NormLayer(name="bench", kind="rms_norm", dim=dim, order="llama", gain_offset=0.0,
                      eps=Eps(eps, "bench"), weight=w, family="llama")
    strata = select_strata(None)
    tol = tolerance_for("bfloat16")
    ps = probe_set(_build(strata, dim, eps, bf16, 0))
    probes = ps.probes
    w64 = w.to(torch.float64)  # what the reference gets: the weight rounded to the candidate dtype
    cand_impl = BUILTINS["torch"]
    cand_fn = cand_impl.prepare(layer, w, None, eps)
    n = ps.normalised(eps, "rms_norm", oracle_normalize)
    ref = n * w64
    cand = torch.cat([cand_fn(p.x.to(bf16)).to(torch.float64) for p in probes])
    q = ps.mean_square("rms_norm")
    work = workspace()
    out = torch.empty_like(ref)

    def bare():
        for p in probes:
            F.rms_norm(p.x, (dim,), w64, eps)

    def reference():
        torch.mul(ps.normalised(eps, "rms_norm", oracle_normalize), w64, out=out)

    def comparison():
        compare_batch(ps.segments, ps.x, ref, cand, eps, "rms_norm", tol, 0.0, None, bf16, q, work)

    def ref_and_compare():
        r = torch.mul(ps.normalised(eps, "rms_norm", oracle_normalize), w64, out=out)
        compare_batch(ps.segments, ps.x, r, cand, eps, "rms_norm", tol, 0.0, None, bf16, q, work)

    def candidate():
        xc = ps.at(bf16)
        for _, lo, hi in ps.segments:
            cand_fn(xc[lo:hi].clone()).to(torch.float64)

    fns = {
        "bare": bare,
        "bare_batched": lambda: F.rms_norm(ps.x, (dim,), w64, eps),
        "oracle_scratch": lambda: BUILTINS["oracle"].prepare(layer, w64, None, eps)(ps.x),
        "reference": reference,
        "comparison": comparison,
        "ref+compare": ref_and_compare,
        "candidate": candidate,
        "probes": lambda: _build(strata, dim, eps, bf16, 0),
    }
    # Interleaved: every iteration times each function once, so that all of them see the same
    # machine state (allocator, caches, a neighbour's load); medians per function.
    times = {k: [] for k in fns}
    with torch.no_grad():
        for it in range(3 + iters):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                if it >= 3:
                    times[k].append(time.perf_counter() - t0)
    res = {k: median(v) for k, v in times.items()}
    res["ratio_runs"] = sorted(a / b for a, b in zip(times["ref+compare"], times["bare"]))
    res["rows"] = int(ps.x.shape[0])
    return res


def section_micro(args):
    import torch

    print(f"\n== micro: one layer, dim {args.dim}, default strata, bf16 candidate; median of {args.iters} "
          "iterations, ms per layer ==")
    results = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        wait_quiet(args.quiet_wait)
        results[threads] = bench_layer(args.dim, args.iters)
    torch.set_num_threads(args.threads_default)
    r1, r2 = results[1], results[2]
    print(f"  probe batch: {r2['rows']} rows x {args.dim} (float64, {r2['rows'] * args.dim * 8 / 1e6:.1f} MB) in "
          "7 strata")
    print(f"  {'':<36} {'1 thread':>9} {'2 threads':>10} {'ratio to bare (1 thr)':>22} {'2 vs 1 thr':>11}")
    labels = [("bare", "bare F.rms_norm f64 (7 calls)"), ("bare_batched", "bare F.rms_norm f64 (1 batched call)"),
              ("oracle_scratch", "oracle from scratch (one batch)"),
              ("reference", "reference (N(x) shared x gain)"), ("comparison", "comparison (compare_batch)"),
              ("ref+compare", "reference + comparison"),
              ("candidate", "candidate (torch, bf16)"),
              ("probes", "probe generation (once per probe set)")]
    for key, label in labels:
        print(f"  {label:<36} {1000 * r1[key]:8.2f} {1000 * r2[key]:10.2f} {r1[key] / r1['bare']:18.1f}x    "
              f"{r1[key] / r2[key]:8.2f}x")
    ratio = r1["ref+compare"] / r1["bare"]
    rr = r1["ratio_runs"]
    print(f"  per-iteration ratio (ref+compare / bare, 1 thread, the default): min {rr[0]:.1f}x, "
          f"median {median(rr):.1f}x, max {rr[-1]:.1f}x")
    print(f"  => reference + comparison = {ratio:.1f}x bare rms_norm in 7 calls (1 thread), "
          f"{r1['ref+compare'] / r1['bare_batched']:.1f}x the batched call (aim: within 3x: "
          f"{'met' if ratio <= 3 else 'NOT met'}); at 2 threads {r2['ref+compare'] / r2['bare']:.1f}x")
    return results


# --- full check ----------------------------------------------------------------------------------

def section_full(args):
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    out = Path(tempfile.mkdtemp(prefix="parity-bench-full-"))
    base = parity_cmd() + ["check", str(model), "--candidate", "torch", "-q"]
    print(f"\n== full: parity check of the 405B shape (253 norm layers, dim 16384), median of {args.repeat} ==")
    res = {}
    for label, threads in (("1 process, --threads 2", "2"), ("1 process, --threads 1 (default)", "1")):
        runs = []
        for _ in range(args.repeat):
            wait_quiet(args.quiet_wait)
            runs.append(run_child(base + ["--threads", threads, "--json", str(out / "r.json")]))
        res[label] = runs
    runs = []
    for _ in range(args.repeat):
        wait_quiet(args.quiet_wait)
        t0 = time.perf_counter()
        ps = [spawn(base + ["--layers", glob, "--json", str(out / f"s{k}.json")])
              for k, glob in enumerate(("*.input_layernorm", "*.post_attention_layernorm"))]
        parts = [collect(p) for p in ps]
        runs.append({"wall": time.perf_counter() - t0, "user": sum(p["user"] for p in parts),
                     "sys": sum(p["sys"] for p in parts), "maxrss_kb": max(p["maxrss_kb"] for p in parts),
                     "minflt": sum(p["minflt"] for p in parts)})
    res["2 processes x 1 thread (252 layers)"] = runs
    runs = []
    for _ in range(args.repeat):
        wait_quiet(args.quiet_wait)
        runs.append(run_child(base + ["--jobs", "2", "--json", str(out / "j.json")]))
    res["--jobs 2 (2 worker processes)"] = runs
    ref = median([r["wall"] for r in res["1 process, --threads 1 (default)"]])
    for label, runs in res.items():
        wall = median([r["wall"] for r in runs])
        cpu = median([r["user"] + r["sys"] for r in runs])
        walls = " ".join(f"{r['wall']:.1f}" for r in runs)
        print(f"  {label:<38} wall {wall:6.2f}s (runs {walls}); cpu {cpu:6.1f}s; minor faults "
              f"{median([r['minflt'] for r in runs]) / 1e3:5.0f}K; peak RSS "
              f"{median([r['maxrss_kb'] for r in runs]) / 1024:5.0f} MiB; {ref / wall:4.2f}x the default")
    print(f"  => default full check {ref:.1f}s (aim: under 60 s on 2 cores: {'met' if ref < 60 else 'NOT met'})")
    args.full_rss_kb = median([r["maxrss_kb"] for r in res["1 process, --threads 1 (default)"]])
    return res


# --- isolation ---------------------------------------------------------------------------------

def section_isolation(args):
    """Issue 12: what running the candidate in a supervised child costs on the full check. The
    baseline is the `torch` built-in in the parent (the default); the same kernel supervised
    (`--isolation process`), and as a user plugin (always supervised), are timed in the same run."""
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    out = Path(tempfile.mkdtemp(prefix="parity-bench-iso-"))
    plugin = str(Path(__file__).resolve().parent / "plugins" / "fused.py") + ":rms_norm"
    base = parity_cmd() + ["check", str(model), "-q", "--json", str(out / "r.json")]
    configs = {
        "torch built-in, in the parent (default)": ["--candidate", "torch"],
        "torch built-in, --isolation process": ["--candidate", "torch", "--isolation", "process"],
        "the same kernel as a plugin (supervised)": ["--candidate", plugin],
        "plugin, --jobs 2 (2 supervised workers)": ["--candidate", plugin, "--jobs", "2"],
    }
    print(f"\n== isolation: full check of the 405B shape (253 norm layers, dim 16384), median of {args.repeat} ==")
    res = {}
    for _ in range(args.repeat):  # interleaved, so a slow spell on the machine hits every config
        for label, extra in configs.items():
            wait_quiet(args.quiet_wait)
            res.setdefault(label, []).append(run_child(base + extra))
    ref = median([r["wall"] for r in res[next(iter(configs))]])
    for label, runs in res.items():
        wall = median([r["wall"] for r in runs])
        walls = " ".join(f"{r['wall']:.1f}" for r in runs)
        print(f"  {label:<42} wall {wall:6.2f}s (runs {walls}); peak RSS (parent) "
              f"{median([r['maxrss_kb'] for r in runs]) / 1024:5.0f} MiB; {wall / ref:4.2f}x the in-parent time")
    return res


# --- scaling ---------------------------------------------------------------------------------------

def timed_check(model, repeat, quiet_wait, **kw):
    from parity_cli import api

    ts = []
    for _ in range(repeat):
        wait_quiet(quiet_wait)
        t0 = time.perf_counter()
        report = api.check(str(model), candidate="torch", **kw)
        ts.append(time.perf_counter() - t0)
    return median(ts), report


def section_scaling(args):
    from parity_cli import api

    print(f"\n== scaling: api.check in-process, median of {args.repeat} ==")
    warm = ensure_model(DEFAULT_ROOT / "l4-h2048", 4, 2048)
    api.check(str(warm), candidate="torch")  # imports, config caches
    layer_counts = [4, 8, 16, 32]
    xs, ys = [], []
    for n in layer_counts:
        m = ensure_model(DEFAULT_ROOT / f"l{n}-h16384", n, 16384)
        t, rep = timed_check(m, args.repeat, args.quiet_wait)
        xs.append(len(rep.layers))
        ys.append(t)
        print(f"  layers {n:3d} ({len(rep.layers):3d} norm layers), dim 16384: {t:6.2f}s = "
              f"{1000 * t / len(rep.layers):5.1f} ms per norm layer")
    a, b, r2, worst = fit_line(xs, ys)
    print(f"  fit: t = {a:.3f}s + {1000 * b:.1f} ms x norm layers; R^2 = {r2:.5f}; worst residual "
          f"{100 * worst:.1f} %; t({xs[-1]})/t({xs[0]}) = {ys[-1] / ys[0]:.2f} for {xs[-1] / xs[0]:.1f}x the layers")
    print(f"  extrapolated to 253 norm layers: {a + 253 * b:.1f}s in-process (no interpreter/torch start-up)")
    dims = [2048, 4096, 8192, 16384]
    dx, dy = [], []
    for d in dims:
        m = ensure_model(DEFAULT_ROOT / f"l8-h{d}", 8, d)
        t, rep = timed_check(m, args.repeat, args.quiet_wait)
        dx.append(d)
        dy.append(t / len(rep.layers))
        print(f"  dim {d:6d}, 8 layers ({len(rep.layers)} norm layers): {t:6.2f}s = {1000 * t / len(rep.layers):6.2f} ms "
              "per norm layer")
    a2, b2, r22, worst2 = fit_line(dx, dy)
    print(f"  fit: per layer = {1000 * a2:.2f} ms + {1e6 * b2:.3f} us x dim; R^2 = {r22:.5f}; worst residual "
          f"{100 * worst2:.1f} %; per-layer cost x{dy[-1] / dy[0]:.2f} for x{dx[-1] / dx[0]:.0f} the dim")
    return {"layers": (xs, ys, a, b, r2), "dims": (dx, dy, a2, b2, r22)}


# --- peak RSS ---------------------------------------------------------------------------------------

def section_rss(args):
    print(f"\n== rss: peak RSS of `parity check` (subprocess, ru_maxrss), median of {args.repeat} ==")
    out = Path(tempfile.mkdtemp(prefix="parity-bench-rss-"))
    floor = [run_child([sys.executable, "-c", "import torch, safetensors, parity_cli.api, parity_cli.cli"])
             for _ in range(args.repeat)]
    fl = median([r["maxrss_kb"] for r in floor]) / 1024
    print(f"  floor: python -c 'import torch, safetensors, parity_cli.api, parity_cli.cli': {fl:6.0f} MiB")
    res = {}
    for layers, dim in ((8, 16384), (126, 16384), (126, 4096)):
        m = ensure_model(DEFAULT_ROOT / ("llama405b" if (layers, dim) == (126, 16384) else f"l{layers}-h{dim}"),
                         layers, dim)
        if (layers, dim) == (126, 16384) and getattr(args, "full_rss_kb", None):
            rss = args.full_rss_kb / 1024  # measured by the full section (median of its default runs)
        else:
            runs = []
            for _ in range(args.repeat if layers < 126 else 1):
                wait_quiet(args.quiet_wait)
                runs.append(run_child(parity_cmd() + ["check", str(m), "--candidate", "torch", "-q", "--json",
                                                      str(out / "r.json")]))
            rss = median([r["maxrss_kb"] for r in runs]) / 1024
        res[(layers, dim)] = rss
        probe_mb = 36 * dim * 8 / 2 ** 20
        print(f"  {layers:3d} layers ({2 * layers + 1:3d} norm layers), dim {dim:5d}: peak RSS {rss:6.0f} MiB "
              f"({rss - fl:+5.0f} MiB over the floor; one layer's probe batch is {probe_mb:.1f} MiB in float64)")
    small, big = res[(8, 16384)], res[(126, 16384)]
    print(f"  => 15.8x the layers: peak RSS x{big / small:.2f} (over the floor: {small - fl:.0f} -> {big - fl:.0f} MiB)")
    return res


# --- failing check ------------------------------------------------------------------------------------

def section_failing(args):
    m = ensure_model(DEFAULT_ROOT / "l8-h16384", 8, 16384)
    print(f"\n== failing: every layer fails (--candidate-eps 1e-6, checkpoint eps 1e-5), diagnosis runs; "
          f"8 layers, dim 16384, median of {args.repeat} ==")
    t_pass, rep_p = timed_check(m, args.repeat, args.quiet_wait)
    t_fail, rep_f = timed_check(m, args.repeat, args.quiet_wait, candidate_eps=1e-6)
    n = len(rep_f.layers)
    failed = sum(1 for layer in rep_f.layers if not layer.passed)
    print(f"  passing check: {1000 * t_pass / n:6.1f} ms per norm layer; failing check ({failed}/{n} failed): "
          f"{1000 * t_fail / n:6.1f} ms per norm layer ({t_fail / t_pass:.1f}x)")
    print(f"  => a 405B-shaped model that fails every layer: ~{253 * t_fail / n:.0f}s of checking "
          f"(+ start-up), vs ~{253 * t_pass / n:.0f}s when it passes")
    # the aim of issue 13: the whole failing check within 2x the passing one, as a user runs it
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    out = Path(tempfile.mkdtemp(prefix="parity-bench-fail-"))
    base = parity_cmd() + ["check", str(model), "-q", "--json", str(out / "r.json")]
    runs = {"passing": [], "failing (--candidate-eps 1e-6)": []}
    for _ in range(args.repeat):  # interleaved
        for label, extra in (("passing", []), ("failing (--candidate-eps 1e-6)", ["--candidate-eps", "1e-6"])):
            wait_quiet(args.quiet_wait)
            runs[label].append(run_child(base + extra, check_rc=(0, 1))["wall"])
    walls = {k: median(v) for k, v in runs.items()}
    for label, ts in runs.items():
        print(f"  full 405B shape, {label:<32} wall {walls[label]:6.2f}s (runs {' '.join(f'{t:.1f}' for t in ts)})")
    ratio = walls["failing (--candidate-eps 1e-6)"] / walls["passing"]
    print(f"  => failing / passing = {ratio:.2f}x (aim: within 2x: {'met' if ratio <= 2 else 'NOT met'})")
    return t_pass / n, t_fail / n


def section_explain(args):
    model = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    print(f"\n== explain: the failing 405B shape (--candidate-eps 1e-6), with and without --explain, "
          f"median of {args.repeat} ==")
    out = Path(tempfile.mkdtemp(prefix="parity-bench-explain-"))
    base = parity_cmd() + ["check", str(model), "-q", "--candidate-eps", "1e-6", "--json", str(out / "r.json")]
    runs = {"failing": [], "failing --explain": []}
    for _ in range(args.repeat):  # interleaved
        for label, extra in (("failing", []), ("failing --explain", ["--explain"])):
            wait_quiet(args.quiet_wait)
            runs[label].append(run_child(base + extra, check_rc=(1,))["wall"])
    walls = {k: median(v) for k, v in runs.items()}
    for label, ts in runs.items():
        print(f"  full 405B shape, {label:<20} wall {walls[label]:6.2f}s (runs {' '.join(f'{t:.1f}' for t in ts)})")
    import json

    groups = json.loads((out / "r.json").read_text())["explain"]["groups"]
    ratio = walls["failing --explain"] / walls["failing"]
    print(f"  {len(groups)} ladder(s) for {sum(len(g['layers']) for g in groups)} failing layers")
    print(f"  => with / without --explain = {ratio:.2f}x (aim: within 1.5x: {'met' if ratio <= 1.5 else 'NOT met'})")
    return ratio


def section_profile(args):
    import cProfile
    import pstats

    from parity_cli import api

    m = ensure_model(DEFAULT_ROOT / "llama405b", 126, 16384)
    print("\n== profile: cProfile of one api.check on the 405B shape (top 25 by cumulative time) ==")
    api.check(str(m), candidate="torch", layers="model.norm")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    api.check(str(m), candidate="torch")
    prof.disable()
    print(f"  wall {time.perf_counter() - t0:.1f}s (under the profiler)")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are quoted")
    ap.add_argument("--iters", type=int, default=30, help="iterations per micro measurement")
    ap.add_argument("--dim", type=int, default=16384, help="dim of the micro benchmark")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile one api.check on the 405B shape (or --only profile)")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait before each run for the CPUs to be idle (another job inflates timings)")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.profile and "profile" not in wanted:
        wanted.append("profile")
    unknown = [s for s in wanted if s not in SECTIONS + ("profile",)]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")

    import torch

    args.threads_default = torch.get_num_threads()
    print_machine(DEFAULT_ROOT if DEFAULT_ROOT.exists() else None)
    DEFAULT_ROOT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name in SECTIONS + ("profile",):
        if name in wanted:
            globals()[f"section_{name}"](args)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s; " + busy_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
