"""How a check uses the machine: one torch thread per process unless asked, --jobs N|auto over
whole worker processes for the built-ins, a refused value before torch loads, and a worker
that dies being an error, never a hang."""

import os
import textwrap

import pytest
import torch
from conftest import run_parity

from parity_cli import api
from parity_cli.check.parallel import resolve_jobs
from parity_cli.errors import InputError


def test_jobs_auto_counts_the_cpus_this_process_may_use():
    assert resolve_jobs("auto") == len(os.sched_getaffinity(0))
    assert resolve_jobs(0) == resolve_jobs("0") == resolve_jobs("auto")
    assert resolve_jobs("3") == resolve_jobs(3) == 3


@pytest.mark.parametrize("bad", ["-1", "x", "1.5", "", "02x", True])
def test_a_bad_jobs_value_is_refused(bad):
    with pytest.raises(InputError, match="--jobs"):
        resolve_jobs(bad)


@pytest.mark.parametrize("args,needle", [(("--jobs", "many"), "--jobs must be"), (("--threads", "0"), "--threads")])
def test_bad_jobs_and_threads_are_exit_2_before_any_layer(ckpt, tmp_path, args, needle):
    out = tmp_path / "r.json"
    r = run_parity("check", ckpt("llama", layers=1), *args, "--json", out)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_one_thread_by_default_recorded_and_restored(ckpt):
    """The run sets torch's intra-op pool for its duration and puts it back after."""
    path = ckpt("llama", layers=1)
    before = torch.get_num_threads()
    one = api.check(path, candidate="torch")
    two = api.check(path, candidate="torch", threads=2)
    assert torch.get_num_threads() == before
    assert (one.header["environment"]["threads"], two.header["environment"]["threads"]) == (1, 2)
    assert one.header["candidate"]["threads"] == 1
    assert one.header["environment"]["cpus"] == len(os.sched_getaffinity(0))
    with pytest.raises(InputError, match="--threads"):
        api.check(path, candidate="torch", threads=0)


def test_jobs_auto_records_its_workers(ckpt):
    report = api.check(ckpt("llama", layers=2), candidate="torch", jobs="auto")
    workers = min(len(os.sched_getaffinity(0)), 5)  # 2 layers x 2 norms + the final norm
    assert report.passed
    assert report.header["environment"]["jobs"] == report.header["candidate"]["workers"] == workers


def test_a_reference_fault_in_a_worker_is_exit_2(ckpt, tmp_path):
    """Under --isolation none a plugin reference runs in the workers: its fault is still the
    user's input (InputError)."""
    bad = tmp_path / "ref.py"
    bad.write_text(textwrap.dedent("""
        def norm(x, weight, eps):
            raise ValueError("no reference today")
    """))
    with pytest.raises(InputError, match="no reference today"):  # the CLI's exit 2, one line
        api.check(ckpt("llama", layers=2), candidate="torch", reference=f"{bad}:norm", jobs=2, isolation="none")


def test_a_worker_that_dies_is_an_error_not_a_hang(ckpt, tmp_path):
    """A worker process killed mid-run (here by a reference that --isolation none runs in it, and
    that exits the process) ends the run with a one-line error: ProcessPoolExecutor notices, a
    multiprocessing.Pool would wait forever."""
    bad = tmp_path / "ref.py"
    bad.write_text(textwrap.dedent("""
        import os

        def norm(x, weight, eps):
            os._exit(3)
    """))
    with pytest.raises(InputError, match="worker process died"):  # the CLI's exit 2, one line
        api.check(ckpt("llama", layers=2), candidate="torch", reference=f"{bad}:norm", jobs=2, isolation="none")


def test_workers_resolve_relative_paths_from_the_callers_directory(ckpt, tmp_path, monkeypatch):
    """A worker starts in the directory of the check that started it (multiprocessing prepares
    it so), not where the fork server once started."""
    path = ckpt("llama", layers=2)
    assert api.check(path, candidate="torch", jobs=2).passed  # the fork server starts here
    (tmp_path / "ref.py").write_text(textwrap.dedent("""
        import torch

        def norm(x, weight, eps):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    """))
    monkeypatch.chdir(tmp_path)
    report = api.check(os.path.relpath(path, tmp_path), candidate="torch", reference="ref.py:norm", jobs=2,
                       isolation="none")  # the reference then runs in the workers
    assert report.passed and report.header["candidate"]["workers"] == 2
