import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity_cli.synthetic import write_checkpoint

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

    return subprocess.run([sys.executable, "-m", "parity_cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=None if env is None else {**os.environ, **env})


def load_json(path):
    return json.loads(Path(path).read_text())
