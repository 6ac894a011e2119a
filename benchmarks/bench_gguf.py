"""GGUF metadata cost (issue 14): a Gemma-3-like GGUF with a 262,144-entry tokenizer against the
same norms as an HF directory, `parity inspect` as a subprocess, and the parse alone with
gguf-py's GGUFReader against parity's bounded reader. Medians of --repeat runs."""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make(root: Path, vocab: int) -> tuple[Path, Path]:
    import gguf
    import numpy as np

    from parity_cli.sources.synthetic import write_checkpoint

    hf = write_checkpoint(root / "hf", "gemma3", layers=2, eps=1e-6)
    path = root / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, path


def wall(cmd) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=262144)
    args = ap.parse_args(argv)
    import gguf

    from parity_cli.sources.gguf_reader import read_gguf

    root = Path(tempfile.mkdtemp(prefix="parity-bench-gguf-"))
    hf, path = make(root, args.vocab)
    print(f"{path}: {path.stat().st_size} bytes, vocabulary {args.vocab}")
    parse_theirs = statistics.median(wall([sys.executable, "-c", f"import gguf; gguf.GGUFReader({str(path)!r}, 'r')"])
                                     for _ in range(args.repeat))
    t = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        read_gguf(path)
        t.append(time.perf_counter() - t0)
    parse_ours = statistics.median(t)
    cmd = [sys.executable, "-m", "parity_cli", "inspect"]
    g = statistics.median(wall(cmd + [str(path)]) for _ in range(args.repeat))
    h = statistics.median(wall(cmd + [str(hf)]) for _ in range(args.repeat))
    print(f"  parse, gguf-py GGUFReader (incl. interpreter start): {parse_theirs:6.2f}s")
    print(f"  parse, parity's bounded reader:                      {parse_ours:6.2f}s")
    print(f"  parity inspect GGUF {g:5.2f}s vs the HF copy {h:5.2f}s: {g / h:.2f}x (aim: within 1.5x)")
    del gguf
    return 0


if __name__ == "__main__":
    sys.exit(main())
