import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# pytest rewrites the asserts of every module of a distribution that registers a plugin (parity's
# pytest11 entry point), parity_cli's 29,000 lines among them: on a fresh clone each worker parsed
# and rewrote them all (about 2 s) for asserts that are parity's own, not the tests'. Only the tests
# are rewritten. (The hook's set is pytest's private state: where it is missing, nothing changes.)
for _hook in sys.meta_path:
    getattr(_hook, "_must_rewrite", set()).discard("parity_cli")

from parity_cli.sources.synthetic import write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# Issue 49: where PYTHONDONTWRITEBYTECODE is set (the development machine sets it), every worker and
# each of the suite's `python -m parity_cli` children and fork servers compiled the package and the
# tests from source again: about a second a process, a minute or two a run. The suite writes the
# bytecode (into __pycache__, which git ignores), for itself and the processes it starts. The
# installed libraries keep theirs from the install either way.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
PLUGINS = Path(__file__).resolve().parent / "plugins" / "norms.py"


def plugin(name: str) -> str:
    return f"{PLUGINS}:{name}"


# Issue 49: two tiers, every test in exactly one. The default run (the README's test command) leaves
# out what is marked `slow`: a runtime's export, lowering or compile per case beyond the one case of
# each runtime and exporter that stays in it, the model zoo's drawn sample beyond the most deployed
# types, the docs' examples that export. `--tier slow` runs those alone (CI runs it after the
# default), `--tier all` both.
SLOW = pytest.mark.slow


def slow_unless(keep: bool):
    """The marks of a parametrized case: none for the case kept in the default run, else `slow`."""
    return () if keep else (SLOW,)


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("default", "slow", "all"), default="default",
                     help="default: every test not marked slow (the README's command); slow: only those "
                          "(CI runs them after the default); all: both")


def pytest_collection_modifyitems(config, items):
    tier = config.getoption("--tier")
    if tier == "all":
        return
    kept, dropped = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        (kept if slow == (tier == "slow") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_configure(config):
    """Under pytest-xdist each worker gets one torch thread: the workers already fill the CPUs,
    and a second intra-op thread per worker spins against the other (see BENCHMARKS.md).

    The session's fork server (one a worker) imports what dozens of supervised children here
    would each import again: transformers' modeling stack (3 s a child of `--candidate
    transformers`), onnx (0.8 s a child of every ONNX check, most of it ml_dtypes). What a child
    computes is the same; a `run_parity(process=True)` run has parity's own fork server, which
    preloads none of them (tests/test_isolation.py checks preload itself). Not onnxruntime nor
    OpenVINO: each starts a thread when imported, and a child forked beside a foreign thread can
    wait for ever on a lock that thread held (with them preloaded, two children hung while loading
    in a day's runs, one in a whole-suite run)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    from parity_cli.isolation import supervisor

    supervisor.preload("transformers.modeling_utils", "transformers.models.llama.modeling_llama", "onnx")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Started now, its preload (5-9 s on a loaded box) overlaps the collection instead of
        # stalling the worker's first supervised test.
        supervisor.ensure_fork_server()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(_exit_without_teardown)


def _exit_without_teardown():
    """A worker that has sent its results ends without the interpreter's teardown: freeing what
    torch, transformers, OpenVINO and ONNX Runtime hold took 3-4 s of CPU a worker, which the
    controller waits for before it reports. The exit handlers still run (multiprocessing's, which
    stops the fork server's children and removes its socket directory; pytest's temporary dirs)."""
    atexit.unregister(_exit_without_teardown)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(autouse=True)
def _restore_sys_path():
    """A FILE.py candidate resolved in this process puts its directory on sys.path for good (so
    that it can import its neighbours): a tmp_path's kernels.py must not shadow the `kernels`
    package that transformers looks for in a later test. A directory inside an installed package
    stays: onnxruntime.transformers (imported by ONNX Runtime GenAI's builder, by ORT's quantization)
    appends its own directory when first imported, and its later submodule imports need it there."""
    import sysconfig

    saved = list(sys.path)
    yield
    installed = tuple(str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("purelib", "platlib"))
    kept = [p for p in sys.path if p not in saved and str(Path(p).resolve()).startswith(installed)]
    sys.path[:] = saved + kept


# a ResNet-50 (53 BatchNorm2d, 4 stages) an eighth as wide as the shrunk one: the batch-norm tests
# export it and run it whole four times over; at full width each file was 94 MB
NARROW_RESNET = {"hidden_sizes": [32, 64, 128, 256], "embedding_size": 16}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Factory: the tiny random-weight checkpoint of a transformers model type, written once per
    session by the type's own classes (model.derive.write_tiny_checkpoint; needs transformers)."""
    made = {}

    def get(model_type):
        if model_type not in made:
            from parity_cli.model.derive import write_tiny_checkpoint

            path = tmp_path_factory.mktemp(model_type)
            write_tiny_checkpoint(model_type, path, config=NARROW_RESNET if model_type == "resnet" else None)
            made[model_type] = path
        return made[model_type]

    return get


@pytest.fixture
def ckpt(tmp_path):
    """Factory: a synthetic HF checkpoint directory with the family's real tensor names."""
    counter = iter(range(1000))

    def make(model_type="llama", **kwargs):
        return write_checkpoint(tmp_path / f"ckpt{next(counter)}", model_type, **kwargs)

    return make


# `python -m parity_cli` as a terminal starts it: SIGINT and SIGQUIT at their defaults. A shell that
# runs the suite as a background job without job control (`cmd &` in a script, nohup) starts it with
# them ignored, every child inherits that, and the Ctrl-C tests would signal a process that rightly
# ignores it (found running them beside a load: all four failed so).
PARITY = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
          "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
          "-m", "parity_cli"]


def run_parity(*args, cwd=None, env=None, process=False):
    """`parity ARGS` with the result interface of subprocess.run (.returncode, .stdout, .stderr).

    By default main(argv) runs in this process (click's CliRunner: stdout and stderr captured
    apart, `env` set and `cwd` entered for the call, both restored after it): a fresh interpreter
    would cost a torch import (~4 s here) and the fork server's. `process=True` runs the real
    `python -m parity_cli` instead; a caller passes it, with its reason, where the process itself
    is what the test is about (PYTHONPATH, an interpreter exit, signals, a terminal)."""
    argv = [str(a) for a in args]
    # a fixed width unless the test sets one: a CI runner's COLUMNS must not rewrap what tests read
    env = {"COLUMNS": "160", **(env or {})}
    if process:
        return subprocess.run([sys.executable, "-m", "parity_cli", *argv], capture_output=True, text=True,
                              cwd=cwd, env={**os.environ, **env})
    return _run_in_process(argv, cwd, env)


def _run_in_process(argv, cwd, env):
    """main(argv) here, with what a run may change in its process put back afterwards: the
    working directory, os.environ, sys.path (a FILE.py plugin's directory is added to it), the
    plugin modules it loaded, the signal handlers main installs (SIGTERM), torch's thread count
    and the warnings filters."""
    import signal
    import warnings

    import torch
    from click.testing import CliRunner

    from parity_cli.cli import main

    saved = (os.getcwd(), dict(os.environ), list(sys.path), set(sys.modules), torch.get_num_threads(),
             list(warnings.filters), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)})
    code = 0
    try:
        with CliRunner().isolation(env=env) as (out, err, _):
            if cwd is not None:
                os.chdir(cwd)
            try:
                main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    finally:
        old_cwd, old_env, old_path, old_modules, threads, filters, handlers = saved
        os.chdir(old_cwd)
        if dict(os.environ) != old_env:
            os.environ.clear()
            os.environ.update(old_env)
        sys.path[:] = old_path
        for name in set(sys.modules) - old_modules:
            if _is_plugin_module(sys.modules.get(name)):
                del sys.modules[name]
        torch.set_num_threads(threads)
        warnings.filters[:] = filters
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(["parity", *argv], code, stdout, stderr)


_LIBRARY = (str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve()), str(ROOT / "parity_cli"))


def _is_plugin_module(module) -> bool:
    """A module a run loaded from outside the installed libraries and the package: a FILE.py
    candidate and the neighbours it imports (tests/plugins, a test's tmp_path)."""
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return getattr(module, "__name__", "").startswith("parity_plugin_")
    return not str(Path(file).resolve()).startswith(_LIBRARY)


def load_json(path):
    return json.loads(Path(path).read_text())


def check_with_report(tmp_path, *args):
    """`parity check ARGS --json tmp_path/r.json`: (the result, the report as a dict or None)."""
    report = Path(tmp_path) / "r.json"
    r = run_parity("check", *args, "--json", report)
    return r, (load_json(report) if report.exists() else None)


def capture_inside(runtime: str, model, tmp_path, prompt: str) -> Path:
    """`parity capture MODEL --runtime RUNTIME --prompt PROMPT`, which must succeed: the file written."""
    cap = Path(tmp_path) / f"{runtime}-cap.safetensors"
    r = run_parity("capture", model, "--runtime", runtime, "--prompt", prompt, "-o", cap)
    assert r.returncode == 0, r.stderr
    return cap


def finding_codes(data) -> list[set]:
    """Each layer's diagnosis and finding codes."""
    return [{d["code"] for d in layer["diagnoses"]} | {f["code"] for f in layer.get("findings", [])}
            for layer in data["layers"]]


def all_pass(data) -> bool:
    """Every layer of a report passes (exit 0 alone would also hold for a report of none)."""
    return bool(data["layers"]) and all(layer["status"] == "pass" for layer in data["layers"])


RSS_LIMIT_KB = 700 * 1024  # torch itself is ~230 MB: a few hundred MB more would mean something was allocated
_BOUNDED = []  # this worker's tests/bounded.py server, started at the first run_bounded


def _bounded_server():
    if not _BOUNDED or _BOUNDED[0].poll() is not None:
        import atexit

        server = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "bounded.py")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        atexit.register(server.kill)
        _BOUNDED[:] = [server]
    return _BOUNDED[0]


def run_bounded(*args, timeout=60):
    """`parity ARGS` as a user runs it, for hostile inputs, in a process of its own (forked by
    tests/bounded.py, torch imported there once): asserts the peak RSS stayed under
    RSS_LIMIT_KB and returns the result. A run past `timeout` raises TimeoutExpired: a guard against a
    hang, never a measure (no test compares a duration; work is bounded by memory, bytes and counts)."""
    import tempfile

    argv = [str(a) for a in args]
    server = _bounded_server()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        out.touch()
        err.touch()
        server.stdin.write(json.dumps({"argv": argv, "env": {**os.environ, "COLUMNS": "160"}, "cwd": os.getcwd(),
                                       "timeout": timeout, "out": str(out), "err": str(err)}) + "\n")
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
        r = subprocess.CompletedProcess(["parity", *argv], answer["code"], out.read_text(), err.read_text())
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired(r.args, timeout, r.stdout, r.stderr)
    assert answer["maxrss_kb"] < RSS_LIMIT_KB, (args, f"peak RSS {answer['maxrss_kb'] // 1024} MiB")
    return r


def failing(report) -> dict:
    """{layer name: (status, the codes of its findings and diagnoses)} of every layer that did not pass:
    a planted fault is asserted as a fail with its cause, never as any layer that merely did not pass."""
    return {layer.name: (layer.status, {f["code"] for f in layer.findings} | {d.code for d in layer.diagnoses})
            for layer in report.layers if not layer.passed}
