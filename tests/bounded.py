"""A server for run_bounded (tests/conftest.py): `parity ARGS` in a process of its own whose peak
RSS is measured, without paying a fresh interpreter's torch import (~4 s) on every call.

The server imports torch and parity's command line once, then for each request forks a child
that runs main(argv) as `python -m parity_cli` would (its own process group, stdin /dev/null,
stdout and stderr in files, the caller's environment and working directory, atexit handlers
run at its end) and answers with the child's exit code and its own peak RSS (wait4's
ru_maxrss: the resident pages it inherited from the server, torch's among them, count too, as
they do in a fresh `parity` that imports torch). A child that runs past its timeout is killed
with its process group and reported as such.

Protocol: one JSON object a line each way. Request: argv, env, cwd, timeout, out, err (paths).
Answer: code, maxrss_kb, timed_out."""

import json
import os
import signal
import sys
import time


def _child(req) -> None:
    import atexit

    os.setpgid(0, 0)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_TRUNC),
                            (2, req["err"], os.O_WRONLY | os.O_TRUNC)):
        new = os.open(path, flags)
        os.dup2(new, fd)
        os.close(new)
    sys.argv = ["parity", *req["argv"]]
    code = 0
    try:
        from parity_cli.cli import main

        main(None)  # as the console script: sys.argv, the hard exit on Ctrl-C
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # never back into the server's loop
        import traceback

        traceback.print_exc()
        code = 3
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _preload() -> None:
    """What a run imports, imported once here: torch, every module of parity_cli (each imports its
    heavy dependencies inside the functions that need them), the libraries they use, and the
    shipped family table."""
    import importlib
    import pkgutil

    import torch  # noqa: F401

    import parity_cli

    for mod in pkgutil.walk_packages(parity_cli.__path__, "parity_cli."):
        if not mod.name.endswith("__main__"):
            try:
                importlib.import_module(mod.name)
            except Exception:
                pass
    for name in ("numpy", "rich.console", "rich.text", "rich.table", "gguf", "safetensors", "yaml"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    try:  # the shipped family files, parsed once (a cached, read-only table; ~1 s for 450 files)
        from parity_cli.model.families import load_families

        load_families()
    except Exception:
        pass


def serve() -> None:
    _preload()

    answers = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            _child(req)
        try:
            os.setpgid(pid, pid)  # as the child does: a timeout kills its group even if it is that fast
        except OSError:
            pass
        deadline = time.monotonic() + req["timeout"]
        timed_out = False
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline and not timed_out:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss,
                                  "timed_out": timed_out}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
