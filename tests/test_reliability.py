"""Reliability: a rank killed mid-backward, under mpirun -n 3 (portddp.watchdog)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portddp.watchdog import EXIT_CODE, _alive
from tests import mpi

IMPLS = ("torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled")


def kill_mid_backward(impl: str, out: Path, launcher_cleanup: bool):
    """Start the job, SIGKILL the last rank where it parks inside backward; return
    (mpirun's exit status, its output, seconds from the kill to the job's end, every rank's pid)."""
    flags = [] if launcher_cleanup else ["-disable-auto-cleanup"]  # then only portddp can stop the others
    cmd = [mpi.mpirun_path(), *flags, "-n", "3", sys.executable, "-m", "tests.workers.rank_failure", impl, str(out)]
    proc = subprocess.Popen(cmd, cwd=mpi.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while not (out / "victim").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job never reached the victim's backward pass:\n{proc.communicate()[0][-3000:]}")
            time.sleep(0.05)
        time.sleep(0.2)
        victim = int((out / "victim").read_text())
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{impl}: the surviving ranks were still running 60 s after rank 2 was killed")
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pids = [int((out / f"pid.{r}").read_text()) for r in range(3)]
    return proc.returncode, output, elapsed, pids


def assert_no_orphans(pids):
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "orphaned rank processes"


@pytest.mark.parametrize("impl", IMPLS)
def test_survivors_name_the_lost_rank_and_exit(impl, tmp_path):
    """The launcher told not to clean up: the survivors must notice by themselves."""
    rc, output, elapsed, pids = kill_mid_backward(impl, tmp_path, launcher_cleanup=False)
    assert rc != 0, output
    assert elapsed < 60, output
    for r in (0, 1):
        line = f"portddp: rank 2 (pid {pids[2]} on "
        assert line in output and f"rank {r} exits now (code {EXIT_CODE})" in output, output[-3000:]
    assert_no_orphans(pids)


def test_mpirun_tears_the_job_down_too(tmp_path):
    """With mpirun's own cleanup (the default) the job also ends at once, naming the lost pid."""
    rc, output, elapsed, pids = kill_mid_backward("torch-c10d", tmp_path, launcher_cleanup=True)
    assert rc != 0 and elapsed < 60, output
    assert f"PID {pids[2]} " in output or f"rank 2 (pid {pids[2]}" in output, output[-3000:]
    assert_no_orphans(pids)
