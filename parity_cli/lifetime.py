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
