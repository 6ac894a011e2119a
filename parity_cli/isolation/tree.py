"""Every process a candidate starts dies with the child that runs it (issue 48). The child is a
child subreaper (lifetime.adopt_orphans) (it leads the tree it starts: what the candidate double-forks, or starts in a new
session where a kill of the child's group cannot reach it, stays its descendant), and a kill takes
the whole tree, frozen first with SIGSTOP so that nothing forks past the kill. Linux /proc; a kill
of the group alone elsewhere."""

from __future__ import annotations

import os
import signal

MAX_TREE = 4096  # processes looked at, at most: a fork bomb is frozen as far as this goes


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from each of its threads' children lists (/proc)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(c) for c in fh.read().split()]
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    out: list[int] = []
    todo, seen = [pid], {pid}
    while todo and len(seen) < MAX_TREE:
        for kid in children(todo.pop()):
            if kid not in seen:
                seen.add(kid)
                out.append(kid)
                todo.append(kid)
    return out


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def kill_tree(pid: int, include_root: bool = True) -> None:
    """SIGKILL `pid` (unless `include_root` is False) and every descendant, each frozen first (SIGSTOP)
    and the tree read again until it stops growing."""
    if include_root:
        _signal(pid, signal.SIGSTOP)
    frozen: list[int] = []
    for _ in range(16):
        new = [p for p in descendants(pid) if p not in frozen]
        if not new:
            break
        for p in new:
            _signal(p, signal.SIGSTOP)
        frozen += new
    for p in ([pid] if include_root else []) + frozen:
        _signal(p, signal.SIGKILL)
