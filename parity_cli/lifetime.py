"""A child process's life bound to its parent's: below every stage, so that a supervised candidate
(isolation.worker), a --jobs worker (check.parallel) and llama.cpp's capture child (backends.llama_graph)
all die with parity, however it dies (kill -9 included)."""

from __future__ import annotations

import os
import signal


def die_with_parent(parent: int | None) -> None:
    """Linux: the kernel kills this process when its parent dies, even in the middle of a C call
    (PR_SET_PDEATHSIG). A parent gone before the prctl took effect is seen in getppid(): then this
    one goes now."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent and os.getppid() != parent:
        os._exit(1)


GENERIC = "a fatal signal in parity's own process, outside any implementation it ran"
_CRASH = {"line": b""}
_KEPT: list = []  # the installed callbacks and the handlers they replaced: alive as long as the process
FATAL = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL")


def _set(words: str) -> None:
    _CRASH["line"] = f"parity: error: {words}".encode("utf-8", "replace")[:2000] + b"\n"


class crash_scope:
    """While an implementation runs in this process, a crash names it (the words after 'parity: error: ');
    outside, the line blames nobody (the generic one)."""

    def __init__(self, words: str):
        self.words = words

    def __enter__(self):
        self.before = _CRASH["line"]
        _set(self.words)

    def __exit__(self, *exc):
        _CRASH["line"] = self.before
        return False


def say_on_crash() -> None:
    """Where code runs in parity's own process (--isolation none, a built-in), a fatal signal it
    raises (SIGSEGV, SIGBUS, SIGFPE, SIGILL) prints one line on stderr first (crash_scope's, naming
    what ran, else GENERIC); the process then dies of that signal as before (the handler it replaced,
    faulthandler's or the default, runs next). A crash there killed parity with exit 139 and nothing
    on stderr (issue 48). Linux and macOS."""
    import ctypes

    if not _CRASH["line"]:
        _set(GENERIC)
    if _KEPT:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    previous: dict = {}

    def on_signal(signum):
        os.write(2, _CRASH["line"])
        libc.signal(signum, previous.get(signum))  # what was there before; on return the fault repeats into it
        os.kill(os.getpid(), signum)  # a signal sent, not a fault, repeats nothing: sent again, it ends the process

    callback = handler_type(on_signal)
    for name in FATAL:
        signum = getattr(signal, name, None)
        if signum is not None:
            previous[signum] = libc.signal(signum, ctypes.cast(callback, ctypes.c_void_p))
    _KEPT.extend([callback, libc, previous])


def adopt_orphans() -> None:
    """This process adopts what its descendants leave behind (PR_SET_CHILD_SUBREAPER) instead of init:
    a supervised child keeps in its tree what its candidate starts in a new session or double-forks;
    parity's command line, what is left when such a child died by itself (cli._end_leftovers ends it).
    Linux; elsewhere nothing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)
    except (OSError, AttributeError):
        pass
