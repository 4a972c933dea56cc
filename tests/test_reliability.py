"""Reliability: a rank SIGKILLed in the middle of a backward pass, in a job of 3.

Two ways to launch: `mpirun -n 3` (whose own cleanup races portddp's watchdog to
stop the survivors), and three bare processes with torchrun-style environment
variables, where nothing but portddp.watchdog can stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portddp.launch import _free_port
from portddp.watchdog import EXIT_CODE, _alive
from tests import mpi

IMPLS = ("torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled")
WORKER = [sys.executable, "-m", "tests.workers.rank_failure"]


def _start(impl: str, out: Path, launcher: str) -> list[subprocess.Popen]:
    common = {"cwd": mpi.ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
              "start_new_session": True}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if launcher == "mpirun":
        return [subprocess.Popen([mpi.mpirun_path(), "-n", "3", *WORKER, impl, str(out)], env=env, **common)]
    port = str(_free_port())
    return [subprocess.Popen([*WORKER, impl, str(out)], **common, env={
        **env, "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(3)]


def kill_mid_backward(impl: str, out: Path, launcher: str):
    """SIGKILL the last rank where it parks inside backward. Returns (exit statuses and outputs of
    the processes the test started, seconds from the kill until they all ended, every rank's pid)."""
    procs = _start(impl, out, launcher)
    try:
        deadline = time.monotonic() + 180
        while not (out / "victim").exists():
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                outputs = "\n".join(p.communicate(timeout=5)[0][-2000:] for p in procs if p.poll() is not None)
                pytest.fail(f"the job never reached the victim's backward pass:\n{outputs}")
            time.sleep(0.05)
        time.sleep(0.2)
        victim = int((out / "victim").read_text())
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        results = []
        for p in procs:
            try:
                output, _ = p.communicate(timeout=max(1.0, 60 - (time.monotonic() - killed)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{impl}: the surviving ranks were still running 60 s after rank 2 was killed")
            results.append((p.returncode, output))
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    pids = [int((out / f"pid.{r}").read_text()) for r in range(3)]
    return results, elapsed, pids


def assert_no_orphans(pids):
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "orphaned rank processes"


def test_watchdog_alone_stops_every_survivor_naming_the_lost_rank(tmp_path):
    """No launcher to clean up: each survivor exits by itself, code 70, saying rank 2 is gone.
    (Bare processes have no MPI world, so this runs the c10d transport; the watchdog is the same
    for every implementation.)"""
    results, elapsed, pids = kill_mid_backward("torch-c10d", tmp_path, "bare")
    assert elapsed < 60
    for rank in (0, 1):
        rc, output = results[rank]
        assert rc == EXIT_CODE, output[-3000:]
        assert f"portddp: rank 2 (pid {pids[2]} on " in output, output[-3000:]
        assert f"rank {rank} exits now (code {EXIT_CODE})" in output, output[-3000:]
    assert_no_orphans(pids)


@pytest.mark.parametrize("impl", IMPLS)
def test_under_mpirun_the_job_ends_at_once_naming_the_lost_rank(impl, tmp_path):
    """mpirun (MPICH's Hydra) SIGKILLs the survivors itself as soon as a rank dies by a signal and
    prints its BAD TERMINATION banner (whose pid is the first death it saw, not always the victim's);
    portddp's watchdog often gets there first and names the rank. Either way: fast, non-zero, no orphan."""
    [(rc, output)], elapsed, pids = kill_mid_backward(impl, tmp_path, "mpirun")
    assert rc != 0 and elapsed < 60, output[-3000:]
    assert f"portddp: rank 2 (pid {pids[2]} on " in output or "BAD TERMINATION" in output, output[-3000:]
    assert_no_orphans(pids)
