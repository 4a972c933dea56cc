"""portddp.transport: Handle semantics, and a rank that waits for a late peer does not spin."""

from __future__ import annotations

import re
import threading

import pytest

from portddp.transport import Handle
from tests import mpi


def test_completed_handle_and_then_chain():
    h = Handle.completed(5)
    assert h.done() and h.wait() == 5
    child = h.then(lambda x: x.result + 1)
    assert child.done() and child.wait() == 6


def test_then_runs_when_done_and_errors_propagate():
    h = Handle()
    child = h.then(lambda x: x.result * 2)
    assert not child.done()
    h.result = 21
    threading.Thread(target=h._finish).start()
    assert child.wait(timeout=5) == 42
    bad = Handle()
    bad._error = RuntimeError("boom")
    bad._finish()
    with pytest.raises(RuntimeError, match="boom"):
        bad.then(lambda x: 1).wait(timeout=5)
    with pytest.raises(TimeoutError):
        Handle().wait(timeout=0.01)


def test_every_waiter_is_released_and_waits_again_freely():
    h = Handle()
    got = []
    waiters = [threading.Thread(target=lambda: got.append(h.wait(timeout=5))) for _ in range(3)]
    for w in waiters:
        w.start()
    h.result = "sum"
    h._finish()
    for w in waiters:
        w.join(timeout=5)
    assert got == ["sum"] * 3 and h.done()
    assert h.wait() == "sum" and h.wait(timeout=0) == "sum"  # (done: no lock taken)


@pytest.mark.parametrize("impl", ["shm", "mpi"])
def test_waiting_for_a_late_peer_does_not_spin(impl):
    """Rank 1 arrives 1 s late: rank 0's CPU over the wait stays under 10 % of it (a blocking MPICH
    collective burns most of a core, README: Performance). The shared-memory all-reduce (the
    default) sleeps in a futex; MPI's own, with PORTDDP_MPI_WAIT=sleep, tests and sleeps."""
    env = {"PORTDDP_MPI_ALLREDUCE": impl, **({"PORTDDP_MPI_WAIT": "sleep"} if impl == "mpi" else {})}
    proc = mpi.run(2, "tests.workers.transport_wait", "1.0", timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"WAIT impl=(\w+) op=(\w+) wall=([\d.]+) cpu=([\d.]+)", proc.stdout)
    assert len(rows) == 3, proc.stdout + proc.stderr[-2000:]
    for got_impl, op, wall, cpu in rows:
        assert got_impl == impl
        assert float(wall) >= 0.9, (op, wall)
        assert float(cpu) <= 0.10 * float(wall), f"{op}: {cpu} s of CPU over a {wall} s wait"


@pytest.mark.parametrize("setting,message", [
    ("PORTDDP_MPI_ALLREDUCE=mpi", "PORTDDP_MPI_ALLREDUCE differs between the ranks (rank 0: 'shm', rank 1: 'mpi'"),
    ("PORTDDP_SHM_ARENA_MB=0.001", "PORTDDP_SHM_ARENA_MB differs between the ranks (rank 0: 4096, rank 1: 0.001"),
    ("PORTDDP_SHM_SCRATCH_MB=8", "PORTDDP_SHM_SCRATCH_MB differs between the ranks (rank 0: 16, rank 1: 8"),
    ("PORTDDP_WATCHDOG=0", "the watchdog is on for some ranks only: set PORTDDP_WATCHDOG"),
    ("PORTDDP_MPI_WAIT=spin", "PORTDDP_MPI_WAIT differs between the ranks (rank 0: '', rank 1: 'spin'"),
])
def test_a_setting_that_differs_between_ranks_is_named_on_every_rank(setting, message):
    """(Were: `unhashable type: 'list'` -- one rank's shared-memory set-up paired with the other's
    named allgather --, `mmap length is greater than file size` with the segment file left in
    /dev/shm, `PORTDDP_SHM_SCRATCH_MB differs between ranks` with no values, and a fix nobody can
    apply for a watchdog off on one rank.)"""
    import glob  # noqa: PLC0415

    before = set(glob.glob("/dev/shm/portddp-*"))
    proc = mpi.run(2, "tests.workers.env_mismatch", f"1:{setting}", timeout=120, env={"PORTDDP_STALL_S": "20"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "stepped" not in proc.stdout, out[-3000:]
    assert message in out, out[-3000:]
    assert not set(glob.glob("/dev/shm/portddp-*")) - before, "a shared-memory segment file was left behind"


def test_an_object_allgather_waiting_for_a_late_peer_does_not_spin():
    """(mpi4py's blocking allgather polled a core while a peer was late: 6.1 CPU s of an 8 s wait, in
    the transport's and the launcher channel's object allgathers -- the per-step checks, checkpoint
    saves, construction.) Both now wait in nonblocking allgathers with sleeps; the objects arrive
    whole, in rank order."""
    code = """
import resource, time
import portddp
from portddp import launch
from portddp.transport import get_transport
w = portddp.init()
t = get_transport()
for name, gather in (("transport", t.allgather_object), ("launch", lambda o: launch.allgather_object(o, name="p"))):
    gather(0)
    if w.rank == 1:
        time.sleep(3)
    before = resource.getrusage(resource.RUSAGE_SELF)
    got = gather({"rank": w.rank, "payload": list(range(1000 * w.rank))})
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert got == [{"rank": r, "payload": list(range(1000 * r))} for r in range(w.size)], got
    print(f"WAITED {name} rank={w.rank} cpu={cpu:.3f}", flush=True)
"""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    proc = subprocess.run([mpi.mpirun_path(), "-n", "2", sys.executable, "-c", code], cwd=mpi.ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    waited = re.findall(r"WAITED (\w+) rank=0 cpu=([\d.]+)", proc.stdout)
    assert {name for name, _ in waited} == {"transport", "launch"}, proc.stdout
    for name, cpu in waited:  # rank 0 waited ~3 s; spinning would burn ~2-3 s of it
        assert float(cpu) < 0.6, (name, cpu)


def test_shared_memory_sizes_need_not_agree_where_no_shared_memory_is_used():
    """(The check of 2026-12-06 first refused an arena size set on one rank of a job on MPI's own
    all-reduce, where no segment is mapped.)"""
    proc = mpi.run(2, "tests.workers.env_mismatch", "1:PORTDDP_SHM_ARENA_MB=1024", timeout=120,
                   env={"PORTDDP_MPI_ALLREDUCE": "mpi"})
    assert proc.returncode == 0 and proc.stdout.count("stepped") == 2, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("setting", ["PORTDDP_SHM_SCRATCH_MB=16", "PORTDDP_SHM_ARENA_MB=4096.0"])
def test_a_size_set_to_its_default_on_one_rank_agrees_with_the_unset_others(setting):
    """(The environment's checked readers of 2026-12-06 first gave the default as 16 where unset and 16.0
    where set, which the agreement check took for different values.)"""
    proc = mpi.run(2, "tests.workers.env_mismatch", f"1:{setting}", timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("stepped") == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
