"""The parent side of a supervised candidate: a child process (parity_cli.isolation.worker) that the
parent can always stop.

A candidate is untrusted code. Here it cannot change what the parent reads (it gets copies
through a pipe), cannot end the run (its exit is a finding), cannot hang it (a per-layer
deadline kills the child's whole process group) and cannot take the machine's memory (an RSS
watchdog kills it past a cap). After a kill the next layer gets a fresh child. The design
follows pytest-timeout / pytest-xdist: test code and the runner never share a process."""

from __future__ import annotations

import atexit
import json
import multiprocessing.util  # noqa: F401  (before atexit.register: kill_all runs before its exit joins)
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time

from parity_cli.errors import InputError
from parity_cli.isolation.runners import WIRE_DTYPES, CandidateJob, CandidateRun, Output

DEFAULT_TIMEOUT = 120.0  # seconds per layer: a CI run can never hang forever
LOAD_TIMEOUT = 60.0  # a fresh child imports torch and the candidate; never shorter than this
TICK = 0.05  # how often the watchdog looks at the child while waiting
OUTPUT_CAP = 64 << 20  # bytes of captured candidate stdout/stderr kept before it is truncated
MAX_HEADER = 64 << 10
TASK_MESSAGE_CAP = 16 << 20  # bytes of one message a supervisor.Task sends (a cell of `parity runtimes`: a few KiB)

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_live: set = set()
_live_lock = threading.Lock()


_ctx = None
_mp_lock = threading.Lock()


def _exit_code(proc, timeout: float):
    """The child's exit status, waiting up to `timeout`. A fork-server child's status is one
    message on a pipe: two threads polling the same child at once (multiprocessing's start()
    polls all children) can split it and read 255, so every poll here is serialised."""
    from multiprocessing.connection import wait

    _wake_fork_server()  # it reports the status: a stopped one never would
    wait([proc.sentinel], timeout)
    with _mp_lock:
        return proc.exitcode


# the worker first: it watches for parity's exit while torch imports (worker._fork_server_watch); then a
# --jobs worker's stages (parity_cli.check.parallel)
_PRELOAD = ["parity_cli.isolation.worker", "torch", "parity_cli.isolation.runners", "parity_cli.backends.implementations",
            "parity_cli.model.layers", "parity_cli.check.parallel", "parity_cli.api", "parity_cli.check.layer",
            "parity_cli.diagnose.fit"]
_preloaded: list[str] = []


def preload(*modules: str) -> bool:
    """Modules the fork server imports once, so that no supervised child imports them again: for a
    process that runs many checks (a test session: every child of `--candidate transformers`
    imported transformers' modeling stack, 3 s, by itself). Takes effect when the fork server
    starts: False where it already runs. A module that is not installed is skipped (the fork
    server ignores an ImportError in its preload). Only modules that start no thread when
    imported: every child is a fork of the server, and a fork beside a thread that holds a lock
    (onnxruntime's, OpenVINO's) can leave the child waiting on it for ever."""
    for module in modules:
        if module not in _PRELOAD + _preloaded:
            _preloaded.append(module)
    if _ctx is not None and _ctx.get_start_method() == "forkserver":
        _ctx.set_forkserver_preload(_PRELOAD + _preloaded)
    return _server_pid() is None


def _server_pid() -> int | None:
    """The running fork server's pid (multiprocessing keeps it on a private object), else None."""
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _context():
    """A fork server that has imported torch and the worker once: every child after the first
    is a fork of it. Falls back to spawn where there is no fork server (Windows)."""
    global _ctx
    if _ctx is None:
        import multiprocessing

        try:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD + _preloaded)
        except ValueError:
            ctx = multiprocessing.get_context("spawn")
        _ctx = ctx
    return _ctx


def ensure_fork_server() -> int | None:
    """The fork server's pid (None without one), started if it is not running. It starts with
    SIGINT blocked: it is in the terminal's process group, and a Ctrl-C while it imports torch
    (its first 2-3 s) printed a KeyboardInterrupt traceback after parity had exited. Once up it
    ignores SIGINT itself; its children unblock what they need (worker.serve)."""
    if _context().get_start_method() != "forkserver":
        return None
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: its own start unblocks SIGINT again
    mask = hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if mask else None
    try:
        forkserver.ensure_running()
    finally:
        if mask:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return _server_pid()


class deferred_interrupt:
    """Ctrl-C while torch imports is held until the import is done, then raised: torch's C
    init imports numpy and swallows any exception from it, KeyboardInterrupt included, so a
    Ctrl-C in a run's first seconds was lost (the run went on and passed, exit 0) or left a
    half-imported module behind (an internal error). Main thread only; elsewhere a no-op."""

    def __enter__(self):
        self.old, self.hit = None, False
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.old = signal.signal(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.hit:  # the Ctrl-C first, whatever the import raised: a caller that handled that
                raise KeyboardInterrupt from exc[1]  # error would otherwise run on, the Ctrl-C lost
        return False


_lifeline: tuple = ()  # (pid, read end, write end) of this process's lifeline pipe


def lifeline():
    """The read end of a pipe whose write end only this process holds (non-inheritable, never
    passed on): every supervised child watches it and ends itself and its forks at its EOF,
    which comes however this process dies (kill -9 included)."""
    global _lifeline
    if not _lifeline or _lifeline[0] != os.getpid():
        r, w = _context().Pipe(duplex=False)
        _lifeline = (os.getpid(), r, w)
    return _lifeline[1]


def _compact(job: CandidateJob) -> CandidateJob:
    """The job as it travels: a tensor pickles its whole storage, so a view of the probe set's
    batch (layer_check hands out one per stratum) would carry the batch once per stratum."""
    import dataclasses

    def own(t):
        if t is None or t.untyped_storage().nbytes() <= t.numel() * t.element_size():
            return t
        return t.clone()

    return dataclasses.replace(job, inputs=[own(x) for x in job.inputs],
                               upstream=None if job.upstream is None else [own(u) for u in job.upstream])


class _no_main:
    """multiprocessing would re-run the caller's script (`__main__`) in every child before
    serving it: a user script calling api.check without a __main__ guard would start a check
    inside the child. A spec named "__main__" tells it there is nothing to re-import."""

    def __enter__(self):
        import importlib.machinery

        self.main = sys.modules.get("__main__")
        self.spec = getattr(self.main, "__spec__", None)
        if self.main is not None:
            self.main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)

    def __exit__(self, *exc):
        if self.main is not None:
            self.main.__spec__ = self.spec
        return False


def _wake_fork_server() -> None:
    """The fork server is every child's parent, so a candidate can SIGSTOP it (os.getppid());
    the next start() would then wait for it forever. A SIGCONT first costs nothing."""
    try:
        pid = _server_pid()
        if pid:
            os.kill(pid, signal.SIGCONT)
    except (OSError, AttributeError):
        pass


def helpers() -> list[int]:
    """The pids of multiprocessing's own helpers (the fork server, the resource tracker): they end by
    themselves when parity exits, and the tracker's cleanup must run."""
    out = []
    try:
        from multiprocessing import resource_tracker

        for pid in (_server_pid(), getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)):
            if pid:
                out.append(pid)
    except ImportError:
        pass
    return out


def kill_all() -> None:
    """Every child this process started, and whatever they forked: no orphans on any exit."""
    with _live_lock:
        children = list(_live)
    for sup in children:
        sup.kill()


atexit.register(kill_all)


def parse_memory(value) -> int | None:
    """--candidate-memory: '8G', '512M', '1.5GiB', a byte count, 'none'; None: half of RAM."""
    if value is None or value == "auto":
        return _total_memory() // 2 if _total_memory() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise InputError(f"--candidate-memory must be > 0, got {value}")
        return int(value)
    import re

    text = str(value).strip().lower()
    if text in ("none", "off", "0"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?b)?", text)
    if m is None:
        raise InputError(f"--candidate-memory: '{value}' is not a size (e.g. 8G, 512M, none)")
    size = float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)]
    if not size > 0 or size == float("inf"):
        raise InputError(f"--candidate-memory must be > 0, got {value}")
    return int(size)


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def _rss(pid: int) -> int:
    """Resident bytes of the child and the processes it forked (Linux /proc; 0 elsewhere)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo, seen = 0, [pid], set()
    while todo and len(seen) < 256:  # the child and everything it forked, from any of its threads
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (OSError, ValueError, IndexError):
            pass
    return total


class _Stop(Exception):
    """The child has to go: the message says why, for the layer's error."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _kill_group(proc) -> None:
    """The child and whatever it started: its tree (a candidate's process in a new session included:
    isolation.tree), then its group (worker._child_life's setsid)."""
    from parity_cli.isolation.tree import kill_tree

    try:
        alive = proc.exitcode is None  # reaped already: its pid may be another process's now
    except (OSError, ValueError, AttributeError):
        alive = False
    if alive:
        kill_tree(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()  # in case it had not reached setsid yet
    except (OSError, ValueError):
        pass


class Supervisor:
    """One supervised child for one candidate spec; `run(job)` is one layer."""

    isolated = True

    def __init__(self, spec: str, args: dict | None, timeout: float | None = DEFAULT_TIMEOUT,
                 memory: int | None = None, threads: int | None = None):
        self.spec, self.args = spec, dict(args or {})
        self.timeout, self.memory, self.threads = timeout, memory, threads
        self.proc = None
        self.info: dict | None = None
        self.printed = 0  # bytes the candidate wrote to stdout/stderr, over every child
        self.first_line = ""
        self.stopped = False  # Ctrl-C / SIGTERM: no fresh child after this
        self._out_fd = None
        self._out_base = 0
        self._conns = ()
        self._job, self._failed, self._deadline = None, None, None

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Supervisor:
        """Forks the child (from the fork server) and asks it to load the candidate; `loaded()`
        waits for the answer, so the parent can read the checkpoint meanwhile."""
        import tempfile

        if self.stopped:
            raise InputError("stopped")
        ctx = _context()
        self._new_output()
        fd, out_path = tempfile.mkstemp(prefix="parity-candidate-", suffix=".log")
        os.close(fd)
        try:
            self._out_fd = os.open(out_path, os.O_RDWR | os.O_APPEND)
            p2c_r, p2c_w = ctx.Pipe(duplex=False)
            c2p_r, c2p_w = ctx.Pipe(duplex=False)
            for conn in (p2c_w, c2p_w):
                try:
                    import fcntl

                    fcntl.fcntl(conn.fileno(), 1031, 1 << 20)  # F_SETPIPE_SZ: fewer wake-ups per megabyte
                except (ImportError, OSError):
                    pass
            from parity_cli.isolation.worker import serve

            try:
                with _mp_lock, _no_main():  # start() polls every other child: see _exit_code
                    _wake_fork_server()
                    server = ensure_fork_server()
                    proc = ctx.Process(target=serve, args=(p2c_r, c2p_w, out_path, server or os.getpid(), lifeline()),
                                       name="parity-candidate")
                    proc.start()
            except BaseException:
                for conn in (p2c_r, p2c_w, c2p_r, c2p_w):
                    conn.close()
                raise
            finally:
                p2c_r.close()
                c2p_w.close()
        finally:
            # the child opens the file by name before it runs any candidate code (or has failed
            # to start): from here on only open descriptors refer to it, nothing is left behind
            self._unlink_after_open = out_path
        self.proc = proc
        self._conns = (p2c_w, c2p_r)
        self.wfd, self.rfd = p2c_w.fileno(), c2p_r.fileno()
        os.set_blocking(self.wfd, False)
        with _live_lock:
            _live.add(self)
        self._started = time.monotonic()
        try:
            self._send(("load", self.spec, self.args, list(sys.path), self.threads, os.getcwd(), dict(os.environ)),
                       time.monotonic() + max(self.timeout or 0, LOAD_TIMEOUT))
        except _Stop as why:  # e.g. a memory cap below what the bare child already holds
            self.kill()
            raise InputError(f"implementation '{self.spec}': its process {why} while loading it") from None
        return self

    def loaded(self) -> dict:
        """The candidate's name/source as the child loaded it; InputError if it cannot load."""
        if self.info is not None:
            return self.info
        if self.proc is None:
            self.start()
        deadline = self._started + max(self.timeout or 0, LOAD_TIMEOUT)
        try:
            head, _ = self._frame(deadline, 0)
        except _Stop as why:
            self.kill()
            raise InputError(f"implementation '{self.spec}': its process {why} while loading it"
                             f"{self._last_line()}") from None
        finally:
            self._forget_path()
        if head.get("type") == "load_error":
            self.kill()
            raise InputError(str(head.get("error"))[:500])
        if head.get("type") != "loaded":
            self.kill()
            raise InputError(f"implementation '{self.spec}': its process answered {str(head.get('type'))[:40]!r} "
                             "while loading")
        self.info = {k: str(head.get(k, ""))[:300] for k in ("name", "source", "description")}
        return self.info

    def stop(self) -> None:
        """Ctrl-C / SIGTERM, from another thread: kills the child's group but leaves the pipes to
        the thread that reads them (it sees EOF and finishes its layer); no fresh child after."""
        self.stopped = True
        proc = self.proc
        if proc is not None and proc.pid:
            _kill_group(proc)

    def kill(self) -> None:
        self._forget_path()
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.pid:
            _kill_group(proc)
            _exit_code(proc, 10)
        for conn in self._conns:
            conn.close()
        self._conns = ()
        with _live_lock:
            _live.discard(self)

    def close(self) -> None:
        self.kill()
        self._forget_path()
        self._new_output()

    # --- one layer ------------------------------------------------------------------------------

    def run(self, job: CandidateJob) -> CandidateRun:
        """The candidate's outputs for one layer. Whatever the child does, this returns."""
        self.submit(job)
        return self.collect()

    def submit(self, job: CandidateJob) -> None:
        """Hands the layer to the child and returns at once: the parent computes the reference
        while the child computes the candidate. `collect()` gathers the answer."""
        self._job, self._failed = job, None
        if self.proc is None:  # the previous layer killed it, or it died: a fresh child
            if self.stopped:
                self._failed = "stopped"
                return
            self.info = None
            try:
                self.start()
                self.loaded()
            except Exception as exc:  # a load error, or a fork server the candidate broke
                self.kill()
                self._failed = f"a fresh candidate process could not be started: {str(exc)[:300]}"
                return
        self._deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            self._send(_compact(job), self._deadline)
        except _Stop as why:
            self.kill()
            self._failed = f"candidate process {why}{self._last_line()}"

    def collect(self) -> CandidateRun:
        job, run = self._job, CandidateRun()
        if self._failed:
            return CandidateRun(error=self._failed)
        try:
            self._answer(job, run)
        except _Stop as why:
            self.kill()
            run.error = f"candidate process {why}{self._last_line()}"
            return run
        except Exception:  # a header no check anticipated: still the candidate's fault, never ours
            self.kill()
            run.error = ("candidate process sent something unreadable: the candidate corrupted its result channel "
                         "(protocol violation)")
            return run
        if job.device.startswith("cuda") and (run.error or any(o.error for o in run.outputs)
                                              or any(g[2] for g in run.grads)):
            self.kill()  # a device-side assert or an OOM can poison the CUDA context: the next layer gets a fresh one
        return run

    def _answer(self, job: CandidateJob, run: CandidateRun) -> None:
        """Exactly the frames the job calls for, in order: one `built`, an `out` per input, a
        `grad` per input under --grad, `done`. Anything else ends the child."""
        n = len(job.inputs)
        grads = n if job.upstream is not None else 0
        w_numel = job.weight.numel()
        head, _ = self._frame(self._deadline, 0)
        if head.get("type") != "built":
            raise _Stop(f"sent {str(head.get('type'))[:40]!r} before building (protocol violation)")
        run.error = _error(head.get("error"), allow_none=True)
        run.setup = bool(run.error) and head.get("setup") is True
        if run.error:
            head, _ = self._frame(self._deadline, 0)
            if head.get("type") != "done":
                raise _Stop("sent results after a failed build (protocol violation)")
            return
        for k in range(n):
            numel = job.inputs[k].numel()
            head, payload = self._frame(self._deadline, 8 * (4 * numel + 1024))
            if head.get("type") != "out" or head.get("k") != k:
                raise _Stop("sent results out of order (protocol violation)")
            run.outputs.append(self._output(head, payload))
        for k in range(grads):
            numel = job.inputs[k].numel()
            head, payload = self._frame(self._deadline, 8 * (numel + w_numel))
            if head.get("type") != "grad" or head.get("k") != k:
                raise _Stop("sent gradients out of order (protocol violation)")
            run.grads.append(self._grads(head, payload))
        head, _ = self._frame(self._deadline, 0)
        if head.get("type") != "done":
            raise _Stop("sent more than the job asked for (protocol violation)")

    def _output(self, head: dict, payload: bytes) -> Output:
        returned = head.get("returned")
        returned = returned if isinstance(returned, str) and len(returned) < 40 else None
        err = _error(head.get("error"), allow_none=True)
        if err:
            return Output(error=err, dtype=returned)
        return Output(_tensor(head, payload), None, returned)

    def _grads(self, head: dict, payload: bytes) -> tuple:
        err = _error(head.get("error"), allow_none=True)
        if err:
            return None, None, err
        dx_head, dw_head = head.get("dx"), head.get("dw")
        if not isinstance(dx_head, dict) or not (dw_head is None or isinstance(dw_head, dict)):
            raise _Stop("sent a gradient without a readable dx/dweight header (protocol violation)")
        split = _nbytes(dx_head)
        dx = _tensor(dx_head, payload[:split])
        dw = None if dw_head is None else _tensor(dw_head, payload[split:])
        if dw is None and len(payload) != split:
            raise _Stop("sent a gradient whose size disagrees with its header (protocol violation)")
        return dx, dw, None

    # --- frames -------------------------------------------------------------------------------

    def _send(self, message, deadline: float | None) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(struct.pack("<Q", len(data)) + data)
        while view:
            self._wait(deadline, write=True)
            try:
                view = view[os.write(self.wfd, view):]
            except BlockingIOError:
                continue
            except OSError:
                raise _Stop(self._gone()) from None

    def _frame(self, deadline: float | None, limit: int) -> tuple[dict, bytes]:
        """One header and its payload, every declared size checked before anything is read;
        `limit` is the most payload this frame may carry."""
        (size,) = struct.unpack("<I", self._read(4, deadline))
        if size > MAX_HEADER:
            raise _Stop(f"sent a {size}-byte header: the candidate corrupted its result channel "
                        "(protocol violation)")
        try:
            head = json.loads(self._read(size, deadline))
        except (ValueError, RecursionError):  # UnicodeDecodeError too: bytes that are no JSON text
            raise _Stop("sent a header that is not JSON text: the candidate corrupted its result channel "
                        "(protocol violation)") from None
        if not isinstance(head, dict):
            raise _Stop("sent a header that is not a JSON object: the candidate corrupted its result channel "
                        "(protocol violation)")
        nbytes = head.get("nbytes", 0)
        if type(nbytes) is not int or not 0 <= nbytes <= limit:
            raise _Stop(f"declared a {str(nbytes)[:30]}-byte payload (at most {limit}; protocol violation)")
        return head, self._read(nbytes, deadline) if nbytes else b""

    def _read(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self._wait(deadline)
            try:
                chunk = os.read(self.rfd, min(n - len(buf), 1 << 22))
            except OSError:
                chunk = b""
            if not chunk:
                raise _Stop(self._gone())
            buf += chunk
        return bytes(buf)

    def _wait(self, deadline: float | None, write: bool = False) -> None:
        """Blocks until the pipe is ready or the child has exited (a process it forked may hold
        the pipe open), watching the clock and the child's memory."""
        if self.proc is None:
            raise _Stop("died")
        poller = select.poll()
        poller.register(self.wfd if write else self.rfd, select.POLLOUT if write else select.POLLIN)
        poller.register(self.proc.sentinel, select.POLLIN)
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise _Stop(f"timed out after {self.timeout:g}s and was killed")
            wait = TICK if deadline is None else min(TICK, deadline - now)
            ready = {fd for fd, _ in poller.poll(max(0, int(wait * 1000)) or 1)}
            self._watch()
            if (self.wfd if write else self.rfd) in ready:
                return
            if self.proc.sentinel in ready:
                if write or not self._readable_now():
                    raise _Stop(self._gone())
                return

    def _readable_now(self) -> bool:
        """The child has exited: what it wrote before that is still worth reading."""
        return bool(select.select([self.rfd], [], [], 0)[0])

    def _watch(self) -> None:
        if self.memory is not None and self.proc is not None:
            rss = _rss(self.proc.pid)
            if rss > self.memory:
                raise _Stop(f"exceeded the memory cap of {_gib(self.memory)} (resident {_gib(rss)}) and was killed")
        if self._out_fd is not None and os.fstat(self._out_fd).st_size > OUTPUT_CAP:
            self._note_output()
            os.ftruncate(self._out_fd, 0)
            self._out_base = 0

    def _gone(self) -> str:
        if self.proc is None:
            return "died"
        code = _exit_code(self.proc, 5)
        if code is None:
            return "closed its pipe"
        return f"died ({_describe_exit(code)})"

    # --- what the candidate printed -----------------------------------------------------------

    def _forget_path(self) -> None:
        path, self._unlink_after_open = getattr(self, "_unlink_after_open", None), None
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass

    def _new_output(self) -> None:
        """Each child writes its own capture file; the old one is counted, then closed."""
        if self._out_fd is not None:
            self._note_output()
            os.close(self._out_fd)
            self._out_fd, self._out_base = None, 0

    def _note_output(self) -> None:
        size = os.fstat(self._out_fd).st_size
        if size > self._out_base:
            if not self.first_line:
                head = os.pread(self._out_fd, 4096, self._out_base).decode("utf-8", "replace")
                self.first_line = next((line.strip() for line in head.splitlines() if line.strip()), "")[:200]
            self.printed += size - self._out_base
            self._out_base = size

    def _last_line(self) -> str:
        """The child's last line of output (a traceback's last line, a fatal error): why it died."""
        if self._out_fd is None:
            return ""
        size = os.fstat(self._out_fd).st_size
        tail = os.pread(self._out_fd, 4096, max(self._out_base, size - 4096)).decode("utf-8", "replace")
        self._note_output()
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        return f"; its last output: {lines[-1][:200]}" if lines else ""


class Task:
    """A child from the fork server that runs one function of parity's own, `target(send, *args)`
    ("module:function"), and sends its results back as it goes (`receive`): a runtime's cells of
    `parity runtimes` in one warm process. Gone with parity (lifeline, process group, kill_all), its
    death a value the caller reads (`receive` returns None at EOF, `why` says how it ended)."""

    def __init__(self, target: str, *args):
        from parity_cli.isolation.worker import serve_task

        ctx = _context()
        self.conn, child = ctx.Pipe(duplex=False)
        try:
            with _mp_lock, _no_main():
                _wake_fork_server()
                server = ensure_fork_server()
                self.proc = ctx.Process(target=serve_task, name="parity-task", args=(
                    child, server or os.getpid(), lifeline(), target, args, list(sys.path), os.getcwd(),
                    dict(os.environ)))
                self.proc.start()
        finally:
            child.close()
        with _live_lock:
            _live.add(self)

    def receive(self, timeout: float | None):
        """The next value the task sent; None where it ended (or sent nothing for `timeout` s: then
        it is killed)."""
        from multiprocessing.connection import wait

        if not wait([self.conn], timeout):
            self.kill()
            self.timed_out = True
            return None
        try:  # JSON, bounded: a task never hands the parent anything to unpickle, nor a body to exhaust it
            raw = self.conn.recv_bytes(TASK_MESSAGE_CAP)
        except (EOFError, OSError):
            return None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            self.kill()
            self.garbled = True
            return None

    def why(self) -> str:
        if getattr(self, "timed_out", False):
            return "sent nothing before its deadline and was stopped"
        if getattr(self, "garbled", False):
            return "sent a message that is not what it was asked for and was stopped"
        return _describe_exit(_exit_code(self.proc, 10) if self.proc is not None else None)

    def kill(self) -> None:
        if self.proc is not None and self.proc.pid:
            _kill_group(self.proc)
        with _live_lock:
            _live.discard(self)

    def close(self) -> None:
        self.kill()
        if self.proc is not None:
            _exit_code(self.proc, 10)
        self.conn.close()


def _error(value, allow_none: bool) -> str | None:
    """An error field from the child: None, or a non-empty one-line message."""
    if value is None and allow_none:
        return None
    text = str(value).strip().splitlines()[0][:500] if str(value).strip() else ""
    return text or "the candidate failed without a message"


def _text(value) -> str | None:
    return None if value is None else str(value)[:500]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _nbytes(head: dict) -> int:
    dtype, shape = head.get("dtype"), head.get("shape")
    if dtype not in WIRE_DTYPES or not isinstance(shape, list) or len(shape) > 8 or \
            not all(type(s) is int and 0 <= s < 2**40 for s in shape):
        raise _Stop(f"declared a tensor of dtype {str(dtype)[:20]!r} and shape {str(shape)[:60]} (protocol violation)")
    return _numel(shape) * _ITEMSIZE[dtype]


def _tensor(head: dict, payload: bytes):
    """float64 CPU tensor from a checked header and exactly its bytes."""
    import torch

    if _nbytes(head) != len(payload):
        raise _Stop("sent a tensor whose size disagrees with its header (protocol violation)")
    if not payload:
        return torch.empty(head["shape"], dtype=torch.float64)
    flat = torch.frombuffer(bytearray(payload), dtype=getattr(torch, head["dtype"]))
    return flat.reshape(head["shape"]).to(torch.float64)


ISOLATION = ("auto", "process", "none")


def open_runners(spec: str, args: dict, device: str, isolation: str = "auto",
                 timeout: float | None = DEFAULT_TIMEOUT, memory: int | None = None, count: int = 1,
                 threads: int = 1):
    """(Implementation, [runner] * count) for the candidate. `auto`: the built-ins that are our
    own pure code (oracle, torch, hf) run here on the CPU; everything else, and anything on a
    GPU (the child owns the CUDA context), runs supervised. `process`: everything supervised.
    `none`: everything here, for debugging a plugin (then --timeout cannot stop it)."""
    from parity_cli.backends import implementations as impls
    from parity_cli.isolation.runners import InProcessRunner

    if isolation not in ISOLATION:
        raise InputError(f"--isolation: '{isolation}' is not one of {', '.join(ISOLATION)}")
    if not supervised(spec, device, isolation):
        impl = impls.resolve(spec, args)
        return impl, [InProcessRunner(impl, timeout) for _ in range(count)]
    impls.precheck(spec, args)
    _import_parent_stages()
    # The parent computes the reference while the children compute the candidate: intra-op
    # pools that add up to more threads than cores spin against each other (measured on 2
    # cores: 1.7x the in-parent time with the default 2 threads per child, 1.2x with 1), so
    # each child gets --threads (default 1), as the parent does.
    sups = [Supervisor(spec, args, timeout, memory, threads=threads) for _ in range(count)]
    try:
        for sup in sups:
            sup.start()  # all load at once; the first answer decides whether the spec is good
        info = sups[0].loaded()
        for sup in sups[1:]:
            sup.loaded()
    except BaseException:
        for sup in sups:
            sup.close()
        raise
    return impls.Implementation(info["name"], info["source"], None, info["description"]), sups


def reference_supervised(spec: str, isolation: str) -> bool:
    """A plugin --reference (anything but a built-in name) is untrusted code like a candidate:
    supervised unless --isolation none. The float64 oracle and the built-ins run here."""
    from parity_cli.backends.implementations import BUILTINS

    if isolation not in ISOLATION:
        raise InputError(f"--isolation: '{isolation}' is not one of {', '.join(ISOLATION)}")
    return spec not in BUILTINS and isolation != "none"


def open_reference(spec: str, device: str, timeout: float | None, memory: int | None, count: int = 1,
                   threads: int = 1):
    """(Implementation, RunnerPool) for a plugin reference: `count` supervised children, one per
    layer thread, each as a candidate's (timeout, memory cap, a fresh child after a kill)."""
    impl, sups = open_runners(spec, {}, device, "process", timeout, memory, count, threads)
    return impl, RunnerPool(sups)


class RunnerPool:
    """Several supervised children for one side, shared by the layer threads (--jobs N): each
    run takes a free one, so no two threads ever speak on one child's pipe at once."""

    isolated = True

    def __init__(self, runners):
        import queue

        self.runners = list(runners)
        self._free: queue.Queue = queue.Queue()
        for runner in self.runners:
            self._free.put(runner)

    def run(self, job: CandidateJob) -> CandidateRun:
        runner = self._free.get()
        try:
            return runner.run(job)
        finally:
            self._free.put(runner)

    def stop(self) -> None:
        for runner in self.runners:
            runner.stop()

    def close(self) -> None:
        close_runners(self.runners)


def supervised(spec: str, device: str, isolation: str) -> bool:
    from parity_cli.isolation.runners import IN_PROCESS_BUILTINS

    return isolation == "process" or (isolation == "auto" and not (spec in IN_PROCESS_BUILTINS and device == "cpu"))


def warm() -> None:
    """Starts the fork server now (it does not wait for it): its torch import then overlaps the
    parent's own, instead of following it."""
    try:
        ensure_fork_server()
    except Exception:  # only an optimisation: the first child starts it anyway
        pass


def _import_parent_stages() -> None:
    """Everything the parent will import later, imported before any candidate code runs: a
    plugin that rewrites an installed module file then cannot get its code into the parent."""
    import importlib

    for name in PARENT_STAGES:
        importlib.import_module(name)


# by name: these stages sit above this one and import it (the layers contract), so the parent's
# own modules are loaded here without an import statement that would run upwards
PARENT_STAGES = ("parity_cli.comparison", "parity_cli.diagnose.causes", "parity_cli.diagnose.fit",
                 "parity_cli.check.gradients", "parity_cli.check.layer", "parity_cli.check.results",
                 "parity_cli.report.formats", "parity_cli.report.gate", "parity_cli.report.grouping",
                 "parity_cli.report.terminal", "parity_cli.explain", "parity_cli.pipeline")


def close_runners(runners) -> None:
    for runner in runners:
        runner.close()


def printed_note(runners) -> str | None:
    """A run-level warning when the candidate wrote to stdout/stderr (captured, not shown)."""
    total, first = 0, ""
    for runner in runners:
        if isinstance(runner, Supervisor):
            if runner._out_fd is not None:
                runner._note_output()
            total += runner.printed
            first = first or runner.first_line
    if not total:
        return None
    return f"the candidate wrote {total} byte(s) to stdout/stderr (captured, not shown); first line: {first!r}"


def timeout_of(opts) -> float | None:
    """Seconds per layer: the default when unset, none at all only when asked for (inf)."""
    if opts.timeout is None:
        return DEFAULT_TIMEOUT
    return None if opts.timeout == float("inf") else float(opts.timeout)
