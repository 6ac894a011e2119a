"""Shared helpers for the benchmark scripts (standard library only; torch where noted).

- machine(): what the numbers were measured on (CPU model, cores, load, versions, readahead).
- run_child(): a subprocess with its own wall time, peak RSS, CPU time (os.wait4) and bytes
  read through read() syscalls (the delta of /proc/self/io: Linux adds a reaped child's I/O
  counters to its parent's).
- evict()/resident(): page-cache control via posix_fadvise(DONTNEED) and mincore(2). Sparse
  holes cost no disk I/O and mmap'd reads are invisible to rchar, so the honest measure of
  "how much of the checkpoint was read" is how many of its pages the kernel had to bring into
  the page cache for the run (readahead included): evict every shard, run, count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_ROOT = Path(os.environ.get("PARITY_BENCH_DIR", "/tmp/parity-bench"))
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- numbers -----------------------------------------------------------------------------

def median(xs):
    return statistics.median(xs)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def fit_line(xs, ys):
    """Least squares y = a + b x; returns a, b, R^2 and the largest |residual| / y."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys) or 1e-300
    worst = max(abs(y - (a + b * x)) / y for x, y in zip(xs, ys))
    return a, b, 1 - ss_res / ss_tot, worst


# --- the machine -------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def read_ahead_kb(path: Path) -> str:
    """The readahead window of the block device holding `path` (what mmap read-around uses)."""
    try:
        dev = os.stat(path).st_dev
        base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        for cand in (base / "queue/read_ahead_kb", base / "../queue/read_ahead_kb", Path("/sys/block/vda/queue/read_ahead_kb")):
            if cand.exists():
                return cand.read_text().strip()
    except OSError:
        pass
    return "n/a"


def machine(path: Path | None = None) -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "loadavg": loadavg(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import safetensors

        info["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    try:
        from parity_cli import __version__

        info["parity_cli"] = __version__
    except ImportError:
        pass
    info["PYTHONDONTWRITEBYTECODE"] = os.environ.get("PYTHONDONTWRITEBYTECODE", "")
    info["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "")
    if path is not None:
        info["read_ahead_kb"] = read_ahead_kb(path)
    return info


def cpu_busy(interval: float = 0.5) -> float:
    """Share of all CPUs busy over `interval` seconds (from /proc/stat), 0..1."""
    def sample():
        parts = open("/proc/stat").readline().split()[1:]
        vals = [int(v) for v in parts]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return idle, sum(vals[:8])
    try:
        i0, t0 = sample()
        time.sleep(interval)
        i1, t1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


BUSY_LOG: list[float] = []


def wait_quiet(max_wait: float, threshold: float = 0.2) -> float:
    """Waits (up to max_wait seconds) until the CPUs are mostly idle, so that a run does not
    share them with another job; returns the busy share seen last (logged in BUSY_LOG)."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        time.sleep(2.0)
        busy = cpu_busy()
    BUSY_LOG.append(busy)
    return busy


class busy_neighbour:
    """One busy-loop process pinned to one CPU (the last this process may use) for the length
    of a `with` block: the CI runner whose other job keeps a core busy."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.proc = None

    def __enter__(self):
        if self.enabled:
            cpu = max(os.sched_getaffinity(0))
            self.proc = subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"],
                                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
            time.sleep(0.3)  # running before the measured command starts
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        return False


def busy_note() -> str:
    if not BUSY_LOG:
        return ""
    noisy = sum(1 for b in BUSY_LOG if b > 0.2)
    return (f"CPU busy before runs: median {100 * median(BUSY_LOG):.0f} %, max {100 * max(BUSY_LOG):.0f} %"
            + (f"; {noisy} of {len(BUSY_LOG)} runs started while another job used the CPUs (timings inflated)"
               if noisy else "; every run started on idle CPUs"))


def print_machine(path: Path | None = None) -> dict:
    info = machine(path)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    busy = cpu_busy(1.0)
    if busy > 0.2:
        print(f"WARNING: the CPUs are {100 * busy:.0f} % busy before the run: another job is running, and "
              "timings will be inflated (each run below waits up to --quiet-wait seconds for idle CPUs).")
    return info


# --- subprocesses --------------------------------------------------------------------------

def proc_io() -> dict:
    out = {}
    try:
        for line in open("/proc/self/io"):
            key, value = line.split(":")
            out[key.strip()] = int(value)
    except OSError:
        pass
    return out


def parity_cmd() -> list[str]:
    """The installed console script, resolved past any pyenv shim (the shim is a bash script
    that re-execs pyenv; bench_startup measures it separately)."""
    exe = Path(sys.executable).parent / "parity"
    return [str(exe)] if exe.exists() else ["parity"]


# A small launcher between this process and the measured command: a child spawned straight
# from a process that has imported torch inherits that process's RSS high-water mark at
# fork/exec (Linux carries it into ru_maxrss), so every peak RSS would read ~200 MiB. The
# launcher (python -S, ~10 MiB) spawns the command, waits for it with wait4 (the command's own
# rusage) and reports wall time, rusage and its /proc/self/io delta (the reaped command's I/O).
_LAUNCHER = r"""
import json, os, sys, time
def io():
    d = {}
    try:
        for line in open('/proc/self/io'):
            k, v = line.split(':'); d[k.strip()] = int(v)
    except OSError:
        pass
    return d
cmd, env, err = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
actions = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
           (os.POSIX_SPAWN_OPEN, 2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)]
io0 = io(); t0 = time.perf_counter()
pid = os.posix_spawnp(cmd[0], cmd, env, file_actions=actions)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0; io1 = io()
print(json.dumps({"wall": wall, "rc": os.waitstatus_to_exitcode(status), "maxrss_kb": ru.ru_maxrss,
                  "user": ru.ru_utime, "sys": ru.ru_stime, "minflt": ru.ru_minflt, "majflt": ru.ru_majflt,
                  "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
                  "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0)}))
"""


def spawn(cmd, env: dict | None = None):
    """Starts cmd under the launcher; collect() waits for it. Several may run at once."""
    import json
    import tempfile

    full_env = dict(os.environ)
    full_env.update({k: v for k, v in (env or {}).items() if v is not None})
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
    fd, err = tempfile.mkstemp(prefix="parity-bench-stderr-")
    os.close(fd)
    p = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, json.dumps([str(c) for c in cmd]),
                          json.dumps(full_env), err], stdout=subprocess.PIPE, text=True)
    p.bench_cmd, p.bench_err = cmd, err
    return p


def collect(p, check_rc=(0,)) -> dict:
    import json

    out, _ = p.communicate()
    try:
        stderr = Path(p.bench_err).read_text(errors="replace")
    finally:
        os.unlink(p.bench_err)
    if p.returncode != 0 or not out.strip():
        raise SystemExit(f"launcher failed for {' '.join(map(str, p.bench_cmd))}: {stderr[-2000:]}")
    r = json.loads(out)
    if check_rc is not None and r["rc"] not in check_rc:
        raise SystemExit(f"{' '.join(map(str, p.bench_cmd))}: exit {r['rc']}\n{stderr[-2000:]}")
    return r


def run_child(cmd, env: dict | None = None, check_rc=(0,)) -> dict:
    """Runs cmd to completion: wall seconds (spawn to exit), exit code, peak RSS (KiB),
    user/sys CPU seconds, and rchar/read_bytes read by it."""
    return collect(spawn(cmd, env), check_rc)


# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json): 30 layers, 61 norms
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=2048,
                    tie_word_embeddings=True)


def smollm2_shaped(directory: Path, dtype: str = "float32") -> Path:
    """A Llama of SmolLM2-135M's shape (random weights, seed 0, stored at `dtype`) with a word-level
    tokenizer (w0 .. w39): what the capture and export benchmarks run. Needs torch and transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from parity_cli.sources.synthetic import write_word_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    return write_word_tokenizer(directory)


def token_bench_args():
    """(--repeat, --tokens arguments, the prompt of that many words w0 .. w39) of a capture benchmark."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    return a, " ".join(f"w{i % 40}" for i in range(a.tokens))


def interleaved_commands(rows: dict, repeat: int, check_rc=(0,)) -> dict:
    """`parity ARGS` for each {label: ARGS}, in fresh processes, interleaved over `repeat` rounds (a
    slow spell hits every label): {label: [wall seconds]}. A run that exits outside `check_rc` stops
    the benchmark."""
    times: dict = {label: [] for label in rows}
    for _ in range(repeat):
        for label, args in rows.items():
            times[label].append(run_child(parity_cmd() + [str(a) for a in args], check_rc=check_rc)["wall"])
    return times


def print_against(times: dict, base: str, width: int = 42) -> None:
    """Each label's median and runs, and its ratio to `base`'s median (measured in the same run)."""
    ref = statistics.median(times[base])
    for label, values in times.items():
        med = statistics.median(values)
        print(f"  {label:{width}s} {med:6.2f} s ({', '.join(f'{v:.2f}' for v in values)})  {med / ref:.2f}x {base}")


# --- page cache ------------------------------------------------------------------------------

_libc = None


def interleaved_checks(model: Path, configs: dict, repeat: int, quiet_wait: float) -> tuple[dict, dict]:
    """`parity check MODEL -q --json R *extra` for each {label: extra}, interleaved over `repeat`
    rounds (a slow spell on the machine hits every label), each started on idle CPUs:
    ({label: [run_child results]}, {label: the last run's report as a dict})."""
    import json
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="parity-bench-checks-"))
    runs: dict = {}
    reports: dict = {}
    for _ in range(repeat):
        for label, extra in configs.items():
            wait_quiet(quiet_wait)
            report = out / "r.json"
            runs.setdefault(label, []).append(
                run_child(parity_cmd() + ["check", str(model), "-q", "--json", str(report), *extra], check_rc=(0, 1)))
            reports[label] = json.loads(report.read_text())
    return runs, reports


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = lib
    return _libc


_RESIDENT_BIT = bytes((b & 1) for b in range(256))


def resident(path) -> int:
    """Bytes of `path` currently in the page cache (mincore on a fresh read-only mapping,
    which maps pages without faulting them in)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    lib = _lib()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = ctypes.create_string_buffer(pages)
            if lib.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return vec.raw[:pages].translate(_RESIDENT_BIT).count(1) * PAGE
        finally:
            lib.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def evict(paths) -> None:
    """Drop the files' clean pages from the page cache (needs no privileges)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_total(paths) -> int:
    return sum(resident(p) for p in paths)


def checkpoint_files(directory) -> list[Path]:
    return sorted(p for p in Path(directory).iterdir() if p.is_file())


# --- models ----------------------------------------------------------------------------------

def ensure_model(directory, layers: int, hidden: int) -> Path:
    """A sparse Llama checkpoint of that shape at `directory`: generated if missing, regenerated
    if this script made it with another shape; a checkpoint it did not make is used as it is."""
    import json

    sys.path.insert(0, str(HERE))
    from make_sparse_405b import MARKER, make

    directory = Path(directory)
    cfg = directory / "config.json"
    if cfg.is_file():
        if not (directory / MARKER).is_file():
            print(f"  using {directory} as it is (not generated by make_sparse_405b.py)")
            return directory
        try:
            c = json.loads(cfg.read_text())
            if c.get("num_hidden_layers") == layers and c.get("hidden_size") == hidden and \
                    (directory / "model.safetensors.index.json").is_file():
                return directory
        except (OSError, ValueError):
            pass
    t = time.perf_counter()
    info = make(directory, layers=layers, hidden=hidden, force=True)
    print(f"  generated {directory}: {layers} layers, hidden {hidden}, {info['shards']} shards, declared "
          f"{fmt_bytes(info['declared_bytes'])}, on disk {fmt_bytes(info['on_disk_bytes'])} "
          f"({time.perf_counter() - t:.1f}s)")
    return directory
