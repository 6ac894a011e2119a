import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity_cli.sources.synthetic import write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins" / "norms.py"


def plugin(name: str) -> str:
    return f"{PLUGINS}:{name}"


@pytest.fixture
def ckpt(tmp_path):
    """Factory: a synthetic HF checkpoint directory with the family's real tensor names."""
    counter = iter(range(1000))

    def make(model_type="llama", **kwargs):
        return write_checkpoint(tmp_path / f"ckpt{next(counter)}", model_type, **kwargs)

    return make


def run_parity(*args, cwd=None, env=None):
    """The installed console entry as a user runs it (a real process: exit code, stderr)."""
    import os

    # a fixed width unless the test sets one: a CI runner's COLUMNS must not rewrap what tests read
    return subprocess.run([sys.executable, "-m", "parity_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "COLUMNS": "160", **(env or {})})


def load_json(path):
    return json.loads(Path(path).read_text())


BOUNDED = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
RSS_LIMIT_KB = 700 * 1024  # torch itself is ~230 MB: a few hundred MB more would mean something was allocated


def run_bounded(*args, timeout=60):
    """`parity ARGS` as a user runs it, for hostile inputs: asserts the peak RSS stayed under
    RSS_LIMIT_KB and returns (result, seconds)."""
    import time

    start = time.monotonic()
    import os

    r = subprocess.run([sys.executable, "-c", BOUNDED, sys.executable, "-m", "parity_cli", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       env={**os.environ, "COLUMNS": "160"})
    *lines, rss = r.stderr.rstrip("\n").split("\n")
    r.stderr = "\n".join(lines) + ("\n" if lines else "")
    assert int(rss) < RSS_LIMIT_KB, (args, f"peak RSS {int(rss) // 1024} MiB")
    return r, time.monotonic() - start
