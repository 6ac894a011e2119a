"""I/O: `parity inspect` and `parity check` on the sparse Llama-3.1-405B-shaped checkpoint,
against reading whole shards with safetensors.torch.load_file.

    python benchmarks/bench_io.py                      # 405B shape in /tmp/parity-bench/llama405b
    python benchmarks/bench_io.py --repeat 5 --shards 3

For every run all checkpoint files are evicted from the page cache first; afterwards the
script counts how many bytes of them the kernel brought into the page cache (mincore), which
covers read() and mmap alike, readahead included. It also reports rchar (bytes through read()
syscalls of the whole process: Python's own modules included; mmap'd reads are not counted)
and the child's wall time. The baseline loads a few whole shards with load_file (in this
process), and is extrapolated to all shards by declared size. Holes read as zeros without
touching the disk, so the baseline's *time* here is a lower bound of a real 812 GB read.

The last section is a what-if: `parity inspect` in-process, once as shipped (os.pread of each
norm tensor's own byte range) and once with Checkpoint.read monkeypatched back to the earlier
reader, safetensors' safe_open with its default mmap, to show how much page-cache traffic mmap
read-around costs (its size is the device's read_ahead_kb).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_ROOT,
    busy_note,
    checkpoint_files,
    ensure_model,
    evict,
    fmt_bytes,
    median,
    parity_cmd,
    print_machine,
    resident,
    resident_total,
    run_child,
    wait_quiet,
)


def measure_cli(name, cmd, files, repeat, quiet_wait):
    runs = []
    for _ in range(repeat):
        evict(files)
        wait_quiet(quiet_wait)
        r = run_child(cmd)
        r["pagecache"] = resident_total(files)
        runs.append(r)
    med = {k: median([r[k] for r in runs]) for k in ("wall", "rchar", "read_bytes", "pagecache", "maxrss_kb", "user", "sys")}
    walls = " ".join(f"{r['wall']:.2f}" for r in runs)
    print(f"  {name:<8} wall median {med['wall']:6.2f}s (runs: {walls}); page cache {fmt_bytes(med['pagecache'])}; "
          f"rchar {fmt_bytes(med['rchar'])}; disk read_bytes {fmt_bytes(med['read_bytes'])}; "
          f"cpu {med['user'] + med['sys']:.1f}s; peak RSS {med['maxrss_kb'] / 1024:.0f} MiB")
    return med


def load_eager(path):
    """Every byte of the shard in memory: load_file with the pread backend (safetensors >= 0.8;
    its default mmap backend is lazy), or the mmap'd tensors cloned on older versions."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), backend="pread")
    except TypeError:
        return {k: v.clone() for k, v in load_file(str(path)).items()}


def load_lazy(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def measure_load_file(shards, repeat, loader, quiet_wait):
    """load_file of each sampled shard, in this process: seconds, page-cache bytes, tensor bytes."""
    from _common import proc_io

    per = []
    for _ in range(repeat):
        t_sum = pc_sum = mat_sum = rchar_sum = 0
        for shard in shards:
            evict([shard])
            wait_quiet(quiet_wait)
            io0 = proc_io()
            t0 = time.perf_counter()
            tensors = loader(shard)
            t_sum += time.perf_counter() - t0
            rchar_sum += proc_io().get("rchar", 0) - io0.get("rchar", 0)
            mat_sum += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
            pc_sum += resident(shard)
            evict([shard])
        per.append({"wall": t_sum, "pagecache": pc_sum, "materialised": mat_sum, "rchar": rchar_sum})
    return {k: median([p[k] for p in per]) for k in per[0]}, [p["wall"] for p in per]


def what_if_pread(model, files):
    """In-process api.inspect as shipped (pread of each tensor) vs the earlier safe_open mmap reader."""
    from parity_cli import api
    from parity_cli.sources import huggingface as checkpoint

    original = checkpoint.Checkpoint.read
    out = {}
    for label in ("pread (as shipped)", "safe_open mmap"):
        if label.startswith("safe_open"):
            def read(self, name):
                return self._read_safe_open(self.info(name))

            checkpoint.Checkpoint.read = read
        try:
            evict(files)
            t0 = time.perf_counter()
            api.inspect(model)
            out[label] = (time.perf_counter() - t0, resident_total(files))
        finally:
            checkpoint.Checkpoint.read = original
    for label, (t, pc) in out.items():
        print(f"  api.inspect, {label:<18} {t:5.2f}s in-process, page cache {fmt_bytes(pc)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_ROOT / "llama405b"), help="sparse checkpoint (generated if missing)")
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are quoted")
    ap.add_argument("--shards", type=int, default=3, help="whole shards loaded by the baseline")
    ap.add_argument("--skip-check", action="store_true", help="only `parity inspect` (the check takes ~15 s a run)")
    ap.add_argument("--skip-what-if", action="store_true")
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="seconds to wait before each run for the CPUs to be idle (another job inflates timings)")
    args = ap.parse_args(argv)

    model = ensure_model(args.model, args.layers, args.hidden)
    files = checkpoint_files(model)
    shards = [f for f in files if f.suffix == ".safetensors"]
    declared = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    print_machine(model)
    print(f"model: {model}: {len(shards)} shards, declared {fmt_bytes(declared)}, on disk {fmt_bytes(on_disk)}")

    out = Path(tempfile.mkdtemp(prefix="parity-bench-io-"))
    print(f"\nparity (median of {args.repeat}; page cache = bytes of the checkpoint files the run brought into memory)")
    insp = measure_cli("inspect", parity_cmd() + ["inspect", str(model), "--json", str(out / "inspect.json")],
                       files, args.repeat, args.quiet_wait)
    chk = None
    if not args.skip_check:
        chk = measure_cli("check", parity_cmd() + ["check", str(model), "--candidate", "torch", "-q", "--json",
                                                    str(out / "check.json")], files, args.repeat, args.quiet_wait)

    k = max(1, min(args.shards, len(shards)))
    sample = [shards[round(i * (len(shards) - 1) / max(1, k - 1))] for i in range(k)] if k > 1 else [shards[len(shards) // 2]]
    sample_declared = sum(s.stat().st_size for s in sample)
    factor = sum(s.stat().st_size for s in shards) / sample_declared
    print(f"\nbaseline: safetensors.torch.load_file of {k} whole shards ({', '.join(s.name[6:11] for s in sample)}; "
          f"{fmt_bytes(sample_declared)}), median of {args.repeat}, extrapolated x{factor:.1f} to {len(shards)} shards")
    lazy, _ = measure_load_file(sample[:1], 1, load_lazy, args.quiet_wait)
    print(f"  (load_file with its default mmap backend returns in {lazy['wall']:.3f}s and reads "
          f"{fmt_bytes(lazy['pagecache'])} of {fmt_bytes(sample[0].stat().st_size)}: tensors are mapped, read on first "
          "touch; the baseline therefore reads every byte eagerly, with backend='pread')")
    measure_load_file(sample[:1], 1, load_eager, args.quiet_wait)  # warm-up, not counted: the first
    # multi-GB load of a process runs ~2x slower than the next ones, which would flatter parity
    base, walls = measure_load_file(sample, args.repeat, load_eager, args.quiet_wait)
    full_t, full_pc, full_mat = base["wall"] * factor, base["pagecache"] * factor, base["materialised"] * factor
    print(f"  sampled  {base['wall']:6.2f}s (runs: {' '.join(f'{w:.2f}' for w in walls)}); page cache "
          f"{fmt_bytes(base['pagecache'])}; tensors materialised {fmt_bytes(base['materialised'])}; "
          f"rchar {fmt_bytes(base['rchar'])}")
    print(f"  all {len(shards)}  ~{full_t:6.1f}s; page cache ~{fmt_bytes(full_pc)}; tensors ~{fmt_bytes(full_mat)}")

    print("\nratios (baseline extrapolated / parity, same run)")
    rows = [("inspect", insp)] + ([("check", chk)] if chk else [])
    for name, m in rows:
        print(f"  {name:<8} bytes: {full_pc / max(m['pagecache'], 1):10.0f}x fewer page-cache bytes "
              f"({fmt_bytes(m['pagecache'])} vs {fmt_bytes(full_pc)}; {100 * m['pagecache'] / declared:.4f} % of "
              f"the declared size)   time: {full_t / m['wall']:6.1f}x faster than loading every shard")
    norm_bytes = 253 * args.hidden * 2 if args.layers == 126 else (2 * args.layers + 1) * args.hidden * 2
    print(f"  norm tensor data is {fmt_bytes(norm_bytes)}; inspect brought in "
          f"{insp['pagecache'] / norm_bytes:.0f}x that (headers and readahead around each norm tensor)")

    if not args.skip_what_if:
        print("\nwhat-if (monkeypatched, in-process): where the page-cache bytes come from")
        what_if_pread(str(model), files)
    evict(files)
    print("\n" + busy_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
