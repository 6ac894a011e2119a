"""The supervised child process a candidate runs in: `serve`, forked by a fork server that
has torch imported already (a fresh child costs a fork, not a 1.5 s import).

It loads the candidate, then runs one CandidateJob per message from the parent and answers
with frames of a deliberately dumb format: a JSON header and raw little-endian bytes. The
parent never unpickles anything from here, so nothing the candidate does in this process
(even rewriting this module) can run code in the parent; the parent checks every header
before it reads a byte of payload."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import struct
import sys

from parity_cli.lifetime import die_with_parent
from parity_cli.text import quiet_third_party

_PID = os.getpid()
_CWD = os.getcwd()


def _fork_server_watch() -> None:
    """Imported first by the fork server (supervisor._context): while it imports torch (seconds
    on a busy machine) it is not yet watching its "alive" pipe, so parity killed then left it
    running until the import was done. A thread watches the pipe meanwhile and ends it at EOF;
    it stops once the fork server's own loop has the pipe."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "main"
                                     and frame.f_globals.get("__name__") == "multiprocessing.forkserver"):
        frame = frame.f_back
    fd = None if frame is None else frame.f_locals.get("alive_r")
    if not isinstance(fd, int):
        return  # not the fork server (or a multiprocessing that names it otherwise)
    import select
    import threading
    from multiprocessing import forkserver

    def watch():
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while getattr(forkserver._forkserver, "_forkserver_address", None) is None:
            if poller.poll(50):  # the only writer is parity: readable means EOF, parity is gone
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parity-fork-server-watch").start()


_fork_server_watch()


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _receive(fd: int):
    head = _read_exact(fd, 8)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack("<Q", head)[0])
    return None if body is None else pickle.loads(body)  # from the parent, which we trust


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(fd: int, header: dict, payload: list | None = None) -> None:
    payload = payload or []
    header["nbytes"] = sum(len(p) for p in payload)
    head = json.dumps(header).encode()
    _write_all(fd, struct.pack("<I", len(head)) + head)
    for p in payload:
        _write_all(fd, p)


def _raw(t) -> bytes:
    """A contiguous CPU tensor's bytes, without numpy (not a dependency)."""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def _tensor_header(t) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _guard() -> None:
    """After every call into candidate code: a process the candidate forked must not go on to
    speak on our pipe, and a chdir must not move later relative paths."""
    if os.getpid() != _PID:
        os._exit(0)
    if os.getcwd() != _CWD:
        os.chdir(_CWD)


def detach_from_fork_server() -> None:
    """Closes what every fork-server child inherits and must not keep: the write end of the fork
    server's "alive" pipe, whose EOF is how the fork server learns that parity has exited (a
    child holding it, stuck in a C call, kept the fork server, the resource tracker and itself
    alive after a kill -9 of parity; a candidate writing into it crashed the fork server), and
    the resource tracker's pipe (garbage written there is printed on parity's stderr)."""
    try:
        from multiprocessing import forkserver, resource_tracker
    except ImportError:
        return
    for owner, attr in ((forkserver._forkserver, "_forkserver_alive_fd"), (resource_tracker._resource_tracker, "_fd")):
        fd = getattr(owner, attr, None)
        if isinstance(fd, int):
            setattr(owner, attr, None)
            try:
                os.close(fd)
            except OSError:
                pass


def _lifeline(fd: int | None) -> None:
    """The read end of a pipe only the parity process writes to: its EOF (parity has exited,
    however it died) ends this process and whatever the candidate forked (its process group),
    without waiting for the fork server. A candidate stuck in a call that holds the GIL is
    still ended by die_with_parent."""
    if fd is None:
        return
    import threading

    def watch():
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        from parity_cli.isolation.tree import kill_tree

        kill_tree(os.getpid(), include_root=False)  # what the candidate started, in its own session too
        try:
            if os.getpgid(0) == os.getpid():  # our own group (setsid), never the fork server's
                os.killpg(0, signal.SIGKILL)
        except OSError:
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parity-lifeline").start()


def _child_life(parent: int | None, lifeline) -> None:
    """A supervised child's life: its own session (the terminal's Ctrl-C is the parent's; a kill of
    the group also stops what it forks), gone with parity (the fork server's pid, the lifeline's
    EOF), SIGTERM's default, and no core file."""
    try:
        os.setsid()
    except OSError:
        pass
    from parity_cli.lifetime import adopt_orphans

    adopt_orphans()  # what the candidate double-forks or starts in a new session stays in this tree
    die_with_parent(parent)
    detach_from_fork_server()
    _lifeline(None if lifeline is None else lifeline.fileno())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # the fork server started with SIGINT blocked (supervisor)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    quiet_third_party()
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a segfaulting candidate leaves no core file
    except (ImportError, ValueError, OSError):
        pass


def serve(rconn, wconn, out_path: str, parent: int | None = None, lifeline=None) -> None:
    """The child's life: its own session (the terminal's Ctrl-C is the parent's; a kill of the
    group also stops what the candidate forks), output captured, then load and run jobs.
    `parent` is the fork server's pid; `lifeline` a pipe whose EOF says parity is gone."""
    global _PID, _CWD
    _PID = os.getpid()
    _child_life(parent, lifeline)
    out = os.open(out_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    rfd, wfd = rconn.fileno(), wconn.fileno()
    hello = _receive(rfd)
    if hello is None:
        return
    _, spec, args, path, threads, cwd, environ = hello
    os.chdir(cwd)  # the parent's, now: a fork server keeps the one it started in
    _CWD = os.getcwd()
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:0] = [p for p in path if p not in sys.path]
    from parity_cli.isolation import runners

    try:
        import torch

        if threads:
            torch.set_num_threads(threads)
        from parity_cli.backends.implementations import resolve

        impl = resolve(spec, args)
    except BaseException as exc:  # an import that raises, or exits, is the user's input at fault
        from parity_cli.errors import InputError

        _send(wfd, {"type": "load_error", "error": str(exc) if isinstance(exc, InputError)
                    else runners.failure(f"implementation '{spec}' raised while loading: ", exc)})
        return
    finally:
        _guard()
    _send(wfd, {"type": "loaded", "name": impl.name, "source": impl.source, "description": impl.description})
    while True:
        job = _receive(rfd)
        if job is None:
            return
        # the job's inputs arrived through the pipe: this process's own, used once each (unless
        # --grad runs them again, after whatever the forward call did to them)
        for event in runners.execute(impl, job, _guard, in_child=True, copy_inputs=job.upstream is not None):
            if event[0] == "built":
                _send(wfd, {"type": "built", "error": event[1], "setup": event[2]})
            elif event[0] == "out":
                _, k, y, dtype, err = event
                if y is None:
                    _send(wfd, {"type": "out", "k": k, "error": err, "returned": dtype})
                else:
                    _send(wfd, {"type": "out", "k": k, "error": None, "returned": dtype, **_tensor_header(y)},
                          [_raw(y)])
            else:
                _, k, dx, dw, err = event
                if err:
                    _send(wfd, {"type": "grad", "k": k, "error": err})
                else:
                    parts = [_raw(dx)] + ([] if dw is None else [_raw(dw)])
                    _send(wfd, {"type": "grad", "k": k, "error": None, "dx": _tensor_header(dx),
                                "dw": None if dw is None else _tensor_header(dw)}, parts)
        _send(wfd, {"type": "done"})



def serve_task(conn, parent: int | None, lifeline, target: str, args: tuple, path: list, cwd: str,
               environ: dict) -> None:
    """A task's child (supervisor.Task): the same life as a candidate's (its own session, gone with
    parity, Ctrl-C the parent's, no core file, its native output to /dev/null), then
    `target(send, *args)` with `send(value)` sending a JSON value to the parent. `target` is
    "module:function", imported here."""
    import importlib

    _child_life(parent, lifeline)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:0] = [p for p in path if p not in sys.path]
    module, _, name = target.partition(":")
    # values go back as JSON, never pickle: the task runs third-party runtime code, and what it sends is
    # read by the parent (supervisor.Task.receive), which must not execute anything it is handed
    getattr(importlib.import_module(module), name)(lambda value: conn.send_bytes(json.dumps(value).encode()), *args)
    conn.close()
