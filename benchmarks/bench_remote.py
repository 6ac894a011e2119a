"""Time and bytes to a verdict for a checkpoint read where it lives: Llama 3.1 405B's layout (191
shards, 812 GB declared, sparse here: make_sparse_405b's writer) served by a local server that
speaks the Hub's file API (tests/hub_server.py, reached through HF_ENDPOINT), against the check
of the same directory on local disk, measured in the same run:

  local   parity check DIR
  cold    parity check hf://meta-llama/Llama-3.1-405B, parity's cache empty
  warm    parity check hf://meta-llama/Llama-3.1-405B@<commit>, the cache kept (reads nothing)

    python benchmarks/bench_remote.py [--repeat 3] [--layers 126]

Each command runs in a fresh interpreter (its cost includes the imports); medians of --repeat
runs. The server is on the loopback: the figures are parity's own cost (requests, parsing,
the check), not a network's; over a real link add one round trip per request (reported)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(args: list, env: dict) -> float:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "parity_cli", *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, **env}, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"parity {' '.join(map(str, args))} failed: {r.stderr.strip()[-400:]}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--layers", type=int, default=126, help="decoder layers (126: the 405B)")
    a = p.parse_args()
    from parity_cli.sources.remote import human
    from parity_cli.sources.synthetic import write_sparse_llama
    from tests.hub_server import HubServer

    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        root = Path(tmp)
        info = write_sparse_llama(root / "405b", layers=a.layers)
        sha = hub.add_repo("meta-llama/Llama-3.1-405B", root / "405b")
        cache = root / "cache"
        env = {"HF_ENDPOINT": hub.url, "PARITY_CACHE": str(cache), "HF_HOME": str(root / "hf"), "HF_TOKEN": ""}
        print(f"checkpoint: {info['shards']} shards, {human(info['declared_bytes'])} declared, "
              f"{info['norm_layers']} norm layers; medians of {a.repeat}")
        rows = {}
        for name, target, clear in (("local", root / "405b", False),
                                    ("cold", "hf://meta-llama/Llama-3.1-405B", True),
                                    ("warm", f"hf://meta-llama/Llama-3.1-405B@{sha}", False)):
            times, fetched, requests = [], [], []
            for _ in range(a.repeat):
                if clear:
                    shutil.rmtree(cache, ignore_errors=True)
                hub.reset_counts()
                times.append(timed(["check", target, "-q", "--json", root / "r.json"], env))
                fetched.append(hub.body_bytes)
                requests.append(len(hub.requests))
            rows[name] = (statistics.median(times), statistics.median(fetched), statistics.median(requests), times)
        base = rows["local"][0]
        for name, (t, nbytes, requests, times) in rows.items():
            share = f"{100 * nbytes / info['declared_bytes']:.4f} %" if name != "local" else "-"
            runs = ", ".join(f"{x:.2f}" for x in times)
            print(f"{name:6s} {t:6.2f} s ({runs})  x{t / base:4.2f} of local  fetched {human(nbytes):>8s} ({share})  "
                  f"{int(requests)} requests")


if __name__ == "__main__":
    main()
