"""How a check spreads over the machine: how many workers, how many threads each.

Torch-free: the CLI refuses a bad --jobs before torch loads."""

from __future__ import annotations

import os

from parity_cli.errors import InputError


def resolve_jobs(jobs) -> int:
    """--jobs: a count, or "auto" (and 0): the CPUs this process may run on (its affinity mask,
    which a container or `taskset` narrows; os.cpu_count() would count the whole machine)."""
    if jobs in ("auto", 0, "0"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            return os.cpu_count() or 1
    try:
        n = int(jobs)
    except (TypeError, ValueError):
        raise InputError(f"--jobs must be a whole number >= 1 or 'auto', got {jobs!r}") from None
    if n < 1 or str(n) != str(jobs).strip():
        raise InputError(f"--jobs must be a whole number >= 1 or 'auto', got {jobs!r}")
    return n
