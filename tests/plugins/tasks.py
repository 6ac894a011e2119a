"""Targets of supervisor.Task in tests: a task that dies, and one that hangs."""

import os
import threading


def die(send, code: int) -> None:
    send("started")
    os._exit(code)


def hang(send) -> None:
    send(os.getpid())
    threading.Event().wait()  # forever: the parent's deadline is what ends it


class _Planted:
    """Unpickling this touches a file: a parent that unpickles what a task sends would run it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def sends_a_pickle(send, path: str) -> None:
    """A task (a runtime's code, in the worst case) that writes a pickle onto its pipe itself."""
    import pickle

    conn = send.__closure__[0].cell_contents  # the pipe under send(): what a hostile runtime could reach
    conn.send_bytes(pickle.dumps(_Planted(path)))
    threading.Event().wait()


def sends_a_lie(send) -> None:
    """JSON, but not a cell of the runtime asked: another runtime's name, a key no cell has."""
    send({"runtime": "torch", "dtype": "float32", "verdict": "pass", "secret": 1})
    threading.Event().wait()


def imported(send, *names: str) -> None:
    """Which of `names` the child already holds when it starts: what its fork server preloaded."""
    import sys

    send({name: name in sys.modules for name in names})
