"""parity_cli.testing (issue 28): what one assert_norm_parity costs a kernel library's test suite,
against what its test does today (a reference and torch.testing.assert_close on randn) in the same run.

    python benchmarks/bench_testing_api.py                  # ~2 min on 2 cores
    python benchmarks/bench_testing_api.py --repeat 7 --only call,suite
    python benchmarks/bench_testing_api.py --device cuda    # where a GPU exists: the warm call there

Parts (--only NAME,...):
  call     in one interpreter (torch imported, as in any kernel test): the baseline (a reference
           module and assert_close on randn(4, 4096), bf16), one assert_norm_parity at hidden 4096 and
           bf16 warm (the probe set cached) and with a new probe set each call (another seed), a
           failing call (eps hard-coded 1e-5: diagnosis and the message), and grad=True
  cold     the first assert_norm_parity of a fresh interpreter, torch already imported: the library's
           own imports, the family file, the probes (one subprocess per repeat)
  suite    pytest -n 0 on a test file parametrised with norm_cases() (6 families x 3 dtypes, hidden
           4096) against the same file whose test runs the baseline instead, and one whose test is
           empty (pytest, torch and the kernels' import: the floor): what parity adds
  startup  `pytest --collect-only` of a project that does not use the plugin, with the plugin (it is
           installed: entry point pytest11) and with `-p no:parity`

Every measurement is repeated; medians are quoted, with the runs. Before each timed subprocess the
script waits up to --quiet-wait seconds for idle CPUs and says at the end whether any run started
on busy ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import busy_note, median, print_machine, wait_quiet  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "kernel_examples"
PARTS = ("call", "cold", "suite", "startup")


def _times(fn, repeat: int, quiet_wait: float = 0.0) -> list[float]:
    if quiet_wait:
        wait_quiet(quiet_wait)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _say(name: str, runs: list[float], base: float | None = None, unit: float = 1e3, suffix: str = "ms",
         against: str = "the baseline") -> float:
    m = median(runs)
    ratio = f"  ({m / base:.2f}x {against})" if base else ""
    print(f"  {name:<58} median {m * unit:8.1f} {suffix}{ratio}   runs: "
          + " ".join(f"{r * unit:.1f}" for r in runs))
    return m


def part_call(args) -> dict:
    import torch

    sys.path.insert(0, str(KERNELS.parent))
    from kernel_examples import fused_norms as k

    from parity_cli.testing import assert_norm_parity, check_norm

    torch.manual_seed(0)
    device = args.device
    dt = torch.bfloat16

    def baseline():  # what a kernel test does today: randn, the reference module, assert_close
        x = torch.randn(4, 4096, device=device).to(dt)
        w = torch.ones(4096, dtype=dt, device=device)
        ref = k.rms_norm_fwd(x, w, 1e-6)
        torch.testing.assert_close(k.fused_rms_norm(x, w, 1e-6), ref)
        if device != "cpu":
            torch.cuda.synchronize()

    kw = dict(family="llama", hidden_size=4096, eps=1e-6, dtype=dt, device=device)
    first = _times(lambda: assert_norm_parity(k.fused_rms_norm, **kw), 1)[0]  # imports, probes, family file
    seeds = iter(range(1, 10_000))
    print(f"call (hidden 4096, bf16, {device}; first call of this interpreter {first * 1e3:.0f} ms):")
    out = {"first": first}
    for _ in range(3):
        baseline()
    out["baseline"] = b = _say("baseline: randn(4, 4096), reference, assert_close", _times(baseline, args.iters, args.quiet_wait))
    out["warm"] = _say("assert_norm_parity, warm (probe set cached)",
                       _times(lambda: assert_norm_parity(k.fused_rms_norm, **kw), args.iters, args.quiet_wait), b)
    out["new_probes"] = _say("assert_norm_parity, a new probe set each call (seed)",
                             _times(lambda: assert_norm_parity(k.fused_rms_norm, seed=next(seeds), **kw), args.iters, args.quiet_wait), b)
    out["random_weight"] = _say("assert_norm_parity, weight='random'",
                                _times(lambda: assert_norm_parity(k.fused_rms_norm, weight="random", **kw),
                                       args.iters, args.quiet_wait), b)
    out["failing"] = _say("check_norm, failing (eps hard-coded 1e-5): diagnosis + message",
                          _times(lambda: check_norm(k.rms_norm_eps_1e5, **kw), args.iters, args.quiet_wait), b)
    out["grad"] = _say("assert_norm_parity, grad=True (hand-written backward)",
                       _times(lambda: assert_norm_parity(k.rms_norm_custom_backward, grad=True,
                                                         **{**kw, "dtype": torch.float32}), args.iters,
                              args.quiet_wait), b)
    return out


COLD = """
import sys, time
import torch
sys.path.insert(0, {kernels!r})
from kernel_examples import fused_norms as k
t0 = time.perf_counter()
from parity_cli.testing import assert_norm_parity
assert_norm_parity(k.fused_rms_norm, family="llama", hidden_size=4096, eps=1e-6, dtype=torch.bfloat16)
t1 = time.perf_counter()
assert_norm_parity(k.fused_rms_norm, family="llama", hidden_size=4096, eps=1e-6, dtype=torch.bfloat16)
print(t1 - t0, time.perf_counter() - t1)
"""


def part_cold(args) -> dict:
    code = COLD.format(kernels=str(KERNELS.parent))
    firsts, seconds = [], []
    for _ in range(args.repeat):
        wait_quiet(args.quiet_wait)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        a, b = (float(v) for v in run.stdout.split())
        firsts.append(a)
        seconds.append(b)
    print("cold (a fresh interpreter, torch imported before the clock starts):")
    second = _say("the second call of that interpreter", seconds)
    first = _say("the first call: import parity_cli.testing + one check", firsts, second, against="the second")
    return {"first": first, "second": second}


SUITE = '''
import sys
import pytest
import torch
sys.path.insert(0, {kernels!r})
from kernel_examples import fused_norms as k
from parity_cli.testing import norm_cases

DT = {{"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}}


@pytest.mark.parametrize("case", norm_cases())
def test_kernel(case, norm_parity):
    {body}
'''
BODY_PARITY = "norm_parity(k.FAMILY_KERNELS[case.family])"
BODY_BASELINE = textwrap.dedent("""\
    shape = (4, case.heads, case.hidden_size) if case.heads else (4, case.hidden_size)
        x = torch.randn(shape).to(DT[case.dtype])
        w = torch.ones(shape[1:], dtype=x.dtype)
        torch.testing.assert_close(k.FAMILY_KERNELS[case.family](x, w, case.eps), k.FAMILY_KERNELS[case.family](x, w, case.eps))""")


def _pytest(path: Path, *extra) -> float:
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *extra, str(path)],
                         capture_output=True, text=True, cwd=path.parent)
    took = time.perf_counter() - t0
    if run.returncode not in (0, 5):
        raise SystemExit(f"pytest failed:\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
    return took


def part_suite(args) -> dict:
    bodies = {"empty": "pass", "baseline": BODY_BASELINE, "parity": BODY_PARITY}
    runs: dict = {name: [] for name in bodies}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, body in bodies.items():
            (Path(tmp) / name).mkdir()
            paths[name] = Path(tmp) / name / "test_kernels.py"
            paths[name].write_text(SUITE.format(kernels=str(KERNELS.parent), body=body))
        for _ in range(args.repeat):  # interleaved: a slow spell of the machine hits each alike
            for name, path in paths.items():
                wait_quiet(args.quiet_wait)
                runs[name].append(_pytest(path))
    print("suite (pytest -n 0, 18 tests: 6 families x 3 dtypes, hidden 4096; cohere 32 heads x 128):")
    e = _say("the 18 tests, empty (pytest, torch, the kernels: the floor)", runs["empty"], unit=1, suffix="s")
    b = _say("baseline: the 18 tests, assert_close on randn", runs["baseline"], e, unit=1, suffix="s",
             against="the empty tests")
    p = _say("assert_norm_parity through the norm_parity fixture", runs["parity"], e, unit=1, suffix="s",
             against="the empty tests")
    print(f"  over the empty tests: assert_close adds {b - e:.2f} s, parity adds {p - e:.2f} s (medians)")
    return {"empty": e, "baseline": b, "parity": p, "added": p - e, "added_baseline": b - e}


def part_startup(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "test_plain.py"
        path.write_text("def test_plain():\n    assert 1 + 1 == 2\n")
        on, off = [], []
        for _ in range(args.repeat):
            wait_quiet(args.quiet_wait)
            off.append(_pytest(path, "-p", "no:parity", "--collect-only"))
            wait_quiet(args.quiet_wait)
            on.append(_pytest(path, "--collect-only"))
        probe = subprocess.run([sys.executable, "-c", "import sys, parity_cli.testing.plugin, parity_cli.testing; "
                                "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
        imports = []  # what pytest pays for the plugin: its import, after pytest's own (-X importtime, cumulative)
        for _ in range(args.repeat):
            run = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pytest; import parity_cli.testing.plugin"],
                                 capture_output=True, text=True, check=True)
            line = next(x for x in run.stderr.splitlines() if x.rstrip().endswith("| parity_cli.testing.plugin"))
            imports.append(int(line.split("|")[1]) / 1e6)
    print("startup (pytest --collect-only of a project that does not use the plugin):")
    b = _say("-p no:parity", off, unit=1e3)
    p = _say("the plugin loaded (entry point)", on, b, unit=1e3, against="-p no:parity")
    i = _say("import of parity_cli.testing.plugin alone (-X importtime)", imports, unit=1e3)
    print(f"  importing the plugin and parity_cli.testing imports torch: {probe.stdout.strip()}")
    return {"off": b, "on": p, "plugin_import": i, "torch_imported": probe.stdout.strip() == "True"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--repeat", type=int, default=5, help="subprocess runs per measurement (medians)")
    ap.add_argument("--iters", type=int, default=21, help="in-process calls per measurement (medians)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the `call` part runs the candidate")
    ap.add_argument("--quiet-wait", type=float, default=60.0, help="seconds to wait for idle CPUs before a run")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the medians here")
    args = ap.parse_args(argv)
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        ap.error(f"--only: unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    print_machine()
    results = {}
    for name in PARTS:
        if name in only:
            results[name] = globals()[f"part_{name}"](args)
    note = busy_note()
    if note:
        print(note)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
