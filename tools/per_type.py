"""One function over many model types, in child processes: what tools/derive_families.py and
benchmarks/zoo_sweep.py both run.

Types go to a child a chunk at a time (torch and transformers import once a chunk). Each type has
an alarm; a type over its time ends its child, since an alarm that fires inside transformers'
first import of a model module leaves that module half-imported for whatever the child would run
next. The rest of the chunk then goes to a fresh child, and a child that dies loses only the type
it was on."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

CHILD = r"""
import importlib.util, json, signal, sys, warnings
warnings.filterwarnings("ignore")
spec = importlib.util.spec_from_file_location("per_type_target", sys.argv[1])
target = importlib.util.module_from_spec(spec)
spec.loader.exec_module(target)
one = getattr(target, sys.argv[2])

def alarm(signum, frame):
    raise TimeoutError("over the time limit")

signal.signal(signal.SIGALRM, alarm)
for model_type in sys.argv[4:]:
    signal.alarm(int(sys.argv[3]))
    try:
        result = one(model_type)
    except BaseException as exc:
        result = {"model_type": model_type, "outcome": "timeout" if isinstance(exc, TimeoutError) else "error",
                  "error": (type(exc).__name__ + ": " + " ".join(str(exc).split()))[:300]}
    signal.alarm(0)
    print("@@" + json.dumps(result), flush=True)
    if result.get("outcome") == "timeout":
        break
"""


def _chunk(script: str, function: str, types: list[str], timeout: float) -> list[dict]:
    done: list[dict] = []
    left = list(types)
    while left:
        run = subprocess.run([sys.executable, "-c", CHILD, script, function, str(max(1, int(timeout))), *left],
                             capture_output=True, text=True)
        got = [json.loads(line[2:]) for line in run.stdout.splitlines() if line.startswith("@@")]
        done += got
        left = left[len(got):]
        if left and (not got or got[-1].get("outcome") != "timeout"):  # it died on left[0]
            err = (run.stderr.strip().splitlines() or ["?"])[-1][:300]
            done.append({"model_type": left.pop(0), "outcome": "error", "error": f"the worker died: {err}"})
    return done


def run(script: str, function: str, types: list[str], timeout: float, jobs: int, chunk: int = 40):
    """Each type's result (`function(model_type)` in `script`, a dict), chunk by chunk, in order."""
    size = max(1, min(chunk, len(types) // max(1, jobs)))
    chunks = [types[k:k + size] for k in range(0, len(types), size)]
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for results in pool.map(lambda c: _chunk(script, function, c, timeout), chunks):
            yield from results
