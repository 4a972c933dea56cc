"""The shared-memory all-reduce (portddp/shm.py) against MPI's own, under mpirun.

n=2: bitwise equal to MPI's Allreduce for float32/float64/float16/bfloat16, sizes from 1 element
to 300,001 (odd ones included), through the zero-copy path (a buffer from `empty`) and the copy
path; n=3 (oversubscribed): close, and every rank holds the same bits; the emulated cluster's
two hosts (root only): the hierarchical path."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from portddp import cluster
from tests import mpi


def _check(proc, n: int, impl: str, hosts: int = 1) -> None:
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out[-5000:]
    failed = re.findall(r"SHM_CASE rank=\d+ \S+ FAIL.*", proc.stdout)
    assert not failed, "\n".join(failed[:20])
    cases = re.findall(r"SHM_CASE rank=(\d+) (\S+) ok", proc.stdout)
    per_rank = {r: sum(1 for rank, _ in cases if rank == str(r)) for r in range(n)}
    assert len(set(per_rank.values())) == 1 and per_rank[0] >= 59, per_rank
    assert f"impl={impl} local={n // hosts} hosts={hosts}" in proc.stdout, out[:2000]
    # every case of the worker was checked: dtypes x sizes x paths, views, chunks, refusal, arena
    names = {name for _, name in cases}
    for name in ("bfloat16-1-zero-copy", "float16-300001-copy", "float64-7-zero-copy", "view-in-window",
                 "chunked-copy", "non-contiguous-refused", "deferred-gather-1", "deferred-gather-300001",
                 "deferred-small-between", "deferred-then-plain", "deferred-peer-scratch",
                 "deferred-discarded", *(("arena-one-round", "mixed-scratch-arena-plain",
                                          "mixed-scratch-arena-deferred") if impl == "shm" else ())):
        assert name in names, sorted(names)[:50]


@pytest.mark.parametrize("n, torch_loaded", [(2, False), (2, True), (3, False)])
def test_shm_allreduce_matches_mpi(n, torch_loaded):
    env = {"PORTDDP_MPI_ALLREDUCE": "shm", **({"SHM_TEST_TORCH": "1"} if torch_loaded else {})}
    proc = mpi.run(n, "tests.workers.shm_allreduce", timeout=240, env=env)
    _check(proc, n, "shm")
    if n == 3:
        assert "arena-free" in proc.stdout and "chunked-zero-copy" in proc.stdout


def test_mpi_allreduce_still_selectable():
    proc = mpi.run(2, "tests.workers.shm_allreduce", timeout=240, env={"PORTDDP_MPI_ALLREDUCE": "mpi"})
    _check(proc, 2, "mpi")


WHY = cluster.unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"no emulated cluster here: {WHY}")
def test_hierarchical_on_two_emulated_hosts():
    import subprocess  # noqa: PLC0415

    proc = subprocess.run([sys.executable, "-m", "portddp.cluster", "-n", "4", "--hosts", "2", "--link", "2gbit",
                           "--", sys.executable, "-m", "tests.workers.shm_allreduce"],
                          cwd=mpi.ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PORTDDP_MPI_ALLREDUCE": "shm", "PYTHONUNBUFFERED": "1"})
    _check(proc, 4, "shm", hosts=2)


def test_torch_mpi_comm_buffers_in_the_window():
    """MPIComm.empty: tensors (all four float dtypes) whose slices all-reduce in place, zero-copy."""
    import subprocess  # noqa: PLC0415

    code = """
import os, torch
from portddp.torch.comm import MPIComm
c = MPIComm()
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    t = c.empty(1000, dt); t.fill_(c.rank + 1)
    v = t[10:500]
    assert c.is_shared(v), dt
    c.allreduce(v).wait()
    assert (t[10:500] == 3).all() and (t[:10] == c.rank + 1).all() and (t[500:] == c.rank + 1).all(), dt
    x = torch.ones(7, dtype=dt)
    assert not c.is_shared(x)
    c.allreduce(x).wait()
    assert (x == 2).all(), dt
os.write(1, f"TORCH_SHM_OK {c.rank}\\n".encode())
"""
    proc = subprocess.run([mpi.mpirun_path(), "-n", "2", sys.executable, "-c", code], cwd=mpi.ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORTDDP_MPI_ALLREDUCE": "shm"})
    assert proc.stdout.count("TORCH_SHM_OK") == 2, proc.stdout + proc.stderr[-3000:]


def test_a_full_window_warns_once_and_still_reduces():
    """Buffers the shared window cannot hold come from ordinary memory (all-reduced through the
    scratch area, still right), and the first one says so, naming PORTDDP_SHM_ARENA_MB."""
    import subprocess  # noqa: PLC0415

    code = """
import os, warnings
import numpy as np
from portddp.transport import MPITransport
t = MPITransport()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = t.empty(400_000, np.float32)  # 1.6 MB: more than the 1 MB window
    b = t.empty(300_000, np.float32)
a[...] = t.rank + 1
t.allreduce(a).wait(timeout=60)
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert not t.is_shared(a) and not t.is_shared(b) and (a == 3).all(), said
assert len(said) == 1 and "PORTDDP_SHM_ARENA_MB=1 MB" in said[0] and "(400000,)" in said[0], said
os.write(1, f"FULL_OK {t.rank}\\n".encode())
"""
    proc = subprocess.run([mpi.mpirun_path(), "-n", "2", sys.executable, "-c", code], cwd=mpi.ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORTDDP_MPI_ALLREDUCE": "shm", "PORTDDP_SHM_ARENA_MB": "1"})
    assert proc.stdout.count("FULL_OK") == 2, proc.stdout + proc.stderr[-3000:]


def test_a_segment_file_still_being_opened_goes_with_a_rank_the_watchdog_ends(tmp_path):
    """(A rank ended by the watchdog while its peers were still opening its segment -- in the set-up's
    barrier -- never reached its own unlink: the file stayed in /dev/shm.) The exit paths call
    unlink_mpi_shared_memory first; it removes the files registered with shared_file too."""
    from portddp import watchdog  # noqa: PLC0415

    path = tmp_path / "portddp-segment"
    path.write_bytes(b"x")
    with watchdog.shared_file(str(path)):
        watchdog.unlink_mpi_shared_memory()
        assert not path.exists()
    assert str(path) not in watchdog._SHARED_FILES


def test_the_sum_takes_inf_and_nan_silently_as_torch_and_mpi_do():
    """A GradScaler's overflowing step sums Inf with -Inf (a NaN: GradScaler checks the result and skips
    the step): numpy warned "invalid value encountered in add" on the MPI transport only (an audit)."""
    import warnings  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from portddp import shm  # noqa: PLC0415

    for me in (0, 1):
        parts = [np.array([np.inf, 1.0, 3e38], np.float32), np.array([-np.inf, np.nan, 3e38], np.float32)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            shm._reduce_into([parts[me]], parts, me)
        got = parts[me]
        assert np.isnan(got[0]) and np.isnan(got[1]) and np.isinf(got[2]), got


def test_half_sums_are_the_same_through_torch_and_numpy(monkeypatch):
    """shm.half_add sums float16 and bfloat16 with torch where torch is loaded (numpy converts float16
    element by element: 60 x slower), numpy elsewhere (a JAX rank): the same values, every pair of
    16-bit patterns' worth of them -- subnormals, the largest values, infinities, NaNs (whose payload
    may differ) -- so that a mixed torch + JAX job sums alike on every rank."""
    import ml_dtypes  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: F401, PLC0415 -- loaded: half_add's torch path

    from portddp.shm import half_add  # noqa: PLC0415

    rng = np.random.default_rng(7)
    every = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)
    a = np.concatenate([every, rng.integers(0, 2 ** 16, 2_000_000, dtype=np.uint32).astype(np.uint16)])
    b = np.concatenate([rng.permutation(every), rng.integers(0, 2 ** 16, a.size - every.size,
                                                             dtype=np.uint32).astype(np.uint16)])
    for dtype in (np.float16, ml_dtypes.bfloat16):
        x, y = a.view(dtype), b.view(dtype)
        through_torch, through_numpy = np.empty_like(x), np.empty_like(x)
        with np.errstate(all="ignore"), monkeypatch.context() as m:
            half_add(x, y, through_torch)
            m.delitem(sys.modules, "torch")
            half_add(x, y, through_numpy)
        nan = np.isnan(through_numpy.astype(np.float32))
        assert np.array_equal(nan, np.isnan(through_torch.astype(np.float32))), dtype
        assert np.array_equal(through_torch.view(np.uint16)[~nan], through_numpy.view(np.uint16)[~nan]), dtype


def test_half_sums_beside_an_import_of_torch_and_on_a_thread_of_their_own():
    """A thread summing halves while another imports torch (portddp.jax's hooks import it on first use,
    with earlier buckets' sums under way on the comm thread): numpy's way until torch is whole -- an op
    on torch half-imported crashed the process, 6 runs in 6 (a review). And torch's way on such a thread
    starts no OpenMP team of its own (as many threads as cores, beside the rank's compute): TORCH_SERIAL
    elements a call."""
    code = """
import os, sys, threading, time
import numpy as np
from portddp.shm import half_add
x = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float16)
want = (x.astype(np.float32) * 2).astype(np.float16)
out, wrong, stop = np.empty_like(x), [], []
def sums():
    while not stop:
        half_add(x, x, out)
        if not np.array_equal(out.view(np.uint16), want.view(np.uint16)):
            wrong.append(1)
summing = threading.Thread(target=sums)
summing.start()
time.sleep(0.05)
import torch
torch.set_num_threads(2)
time.sleep(0.2)
stop.append(1)
summing.join()
before, grew = set(os.listdir("/proc/self/task")), []
def more():
    for _ in range(20):
        half_add(x, x, out)
    grew.append(len(set(os.listdir("/proc/self/task")) - before) - 1)
t = threading.Thread(target=more)
t.start()
t.join()
print("WRONG", len(wrong), "GREW", grew[0], flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=mpi.ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "WRONG 0 GREW 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
