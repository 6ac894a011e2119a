"""Targets of supervisor.Task in tests: a task that dies, and one that hangs."""

import os
import threading


def die(send, code: int) -> None:
    send("started")
    os._exit(code)


def hang(send) -> None:
    send(os.getpid())
    threading.Event().wait()  # forever: the parent's deadline is what ends it
