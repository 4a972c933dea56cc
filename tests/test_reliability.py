"""Reliability: a rank SIGKILLed in the middle of a backward pass, in a job of 3; a bug on one
rank; determinism and checkpoint/resume in two separate jobs.

Two ways to launch the failures: `mpirun -n 3` (which also kills the survivors
itself, racing portddp's watchdog), and three bare processes with torchrun-style
environment variables, where nothing but portddp.watchdog can stop them."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portddp.launch import _free_port
from portddp import watchdog
from portddp.watchdog import EXIT_CODE, pid_alive
from tests import mpi

IMPLS = ("torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled")
WORKER = [sys.executable, "-m", "tests.workers.rank_failure"]


def _start(impl: str, out: Path, launcher: str, mode: str = "kill", *extra: str) -> list[subprocess.Popen]:
    common = {"cwd": mpi.ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
              "start_new_session": True}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if launcher == "mpirun":
        return [subprocess.Popen([mpi.mpirun_path(), "-n", "3", *WORKER, impl, str(out), mode, *extra], env=env,
                                 **common)]
    port = str(_free_port())
    return [subprocess.Popen([*WORKER, impl, str(out), mode, *extra], **common, env={
        **env, "RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(3)]


def kill_mid_backward(impl: str, out: Path, launcher: str, mode: str = "kill", *extra: str):
    """SIGKILL the last rank where it parks inside backward (mode "kill"; with "raise" it raises
    there by itself). Returns (exit statuses and outputs of the processes the test started,
    seconds from the kill until they all ended, every rank's pid)."""
    procs = _start(impl, out, launcher, mode, *extra)
    try:
        deadline = time.monotonic() + 180
        while not (out / "victim").exists():
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                outputs = "\n".join(p.communicate(timeout=5)[0][-2000:] for p in procs if p.poll() is not None)
                pytest.fail(f"the job never reached the victim's backward pass:\n{outputs}")
            time.sleep(0.05)
        time.sleep(0.2)
        victim = int((out / "victim").read_text())
        if mode == "kill":
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
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "orphaned rank processes"


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


def test_an_exception_on_one_rank_stops_the_others_naming_it(tmp_path):
    """A bug on rank 2 only: it dies of its own traceback, and the others -- which would wait for it
    in the next collective -- exit at once saying so, instead of hanging until a timeout."""
    results, elapsed, pids = kill_mid_backward("torch-c10d", tmp_path, "bare", mode="raise")
    assert elapsed < 60
    assert results[2][0] == 1 and "RuntimeError: a bug on the last rank only" in results[2][1]
    for rank in (0, 1):
        rc, output = results[rank]
        assert rc == EXIT_CODE, output[-3000:]
        assert f"portddp: rank 2 (pid {pids[2]} on " in output, output[-3000:]
        assert "failed with RuntimeError: a bug on the last rank only" in output, output[-3000:]
        assert "-- the fix: read to the end" in output, output[-3000:]  # the whole line, not its first 300 chars
    assert_no_orphans(pids)


@pytest.mark.parametrize("impl", IMPLS)
def test_under_mpirun_the_job_ends_at_once_naming_the_lost_rank(impl, tmp_path):
    """Under `mpirun -n 3`, for every implementation. MPICH's mpirun SIGKILLs the survivors itself
    the moment it sees a rank die by a signal, and stops forwarding their output: the watchdog
    (which hears the closed socket within microseconds) usually gets its line out first, and the
    banner names the dead pid otherwise. Either way: fast, non-zero, no orphan, and no MPICH
    segment left in /dev/shm (portddp.init unlinks its name once every rank has attached: the
    survivors are SIGKILLed too, before any code of theirs could)."""
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    [(rc, output)], elapsed, pids = kill_mid_backward(impl, tmp_path, "mpirun")
    assert rc != 0 and elapsed < 60, output[-3000:]
    assert f"portddp: rank 2 (pid {pids[2]} on " in output or "BAD TERMINATION" in output, output[-3000:]
    assert_no_orphans(pids)
    assert not set(glob.glob("/dev/shm/mpich_shm_*")) - before, "the killed job left MPICH's segment behind"


@pytest.mark.parametrize("impl,launcher", [("torch-c10d", "bare"), ("torch-mpi", "mpirun")])
def test_ctrl_c_on_a_rank_blocked_in_a_collective_stops_it_at_once(impl, launcher, tmp_path):
    """(A SIGINT to a rank waiting for a slow peer was raised only when the collective ended: 53 s
    later, or never for a hung peer.) Rank 2 parks inside its backward pass; ranks 0 and 1 wait for
    it in the bucket all-reduces; Ctrl-C to rank 0 ends it within seconds, exit 130, naming the
    collective, and the others hear of it."""
    procs = _start(impl, tmp_path, launcher, "park")
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "victim").exists():
            assert not any(p.poll() is not None for p in procs) and time.monotonic() < deadline, "never parked"
            time.sleep(0.05)
        time.sleep(1.5)  # (ranks 0 and 1 are inside the collective by now)
        os.kill(int((tmp_path / "pid.0").read_text()), signal.SIGINT)
        sent = time.monotonic()
        outputs = []
        for p in procs:
            try:
                outputs.append((p.communicate(timeout=30)[0], p.returncode))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{impl}: still running 30 s after Ctrl-C on rank 0")
        assert time.monotonic() - sent < 20
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = "\n".join(o for o, _ in outputs)
    assert re.search(r"portddp: rank 0 \(pid \d+ on .*\) received SIGINT \(Ctrl-C\) while waiting in 'iteration \d+",
                     text), text[-3000:]
    if launcher == "bare":
        assert outputs[0][1] == 130 and outputs[1][1] == EXIT_CODE and outputs[2][1] == EXIT_CODE, text[-3000:]
    else:  # (mpirun stops the rest itself once one rank has ended)
        assert outputs[0][1] != 0
    assert_no_orphans([int((tmp_path / f"pid.{r}").read_text()) for r in range(3)])


def _stall_job(case: str, out: Path) -> subprocess.Popen:
    """`mpirun -n 2 python -m tests.workers.stall <case> <out>`, returned once both ranks wrote their pid."""
    proc = subprocess.Popen([mpi.mpirun_path(), "-n", "2", sys.executable, "-m", "tests.workers.stall", case,
                             str(out)], cwd=mpi.ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((out / f"pid.{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(proc.communicate()[0][-3000:])
        time.sleep(0.1)
    return proc


def test_a_ctrl_c_the_script_catches_lets_it_save_through_a_collective(tmp_path):
    """(A review of the above: the watchdog read the signal after the main thread had already caught
    it and entered the save's collective, and ended the rank there.) Delivered as KeyboardInterrupt
    while computing and caught: the script's collective save completes on both ranks."""
    proc = _stall_job("caught", tmp_path)
    try:
        time.sleep(1)
        os.kill(int((tmp_path / "pid.0").read_text()), signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    assert "rank 0 interrupted; saving" in output and output.count("saved [0, 1]") == 2, output[-3000:]


@pytest.mark.parametrize("impl", ("torch-c10d", "torch-mpi"))
def test_without_portddp_init_a_rank_that_raises_still_stops_the_others_naming_it(impl, tmp_path):
    """A drop-in script never calls portddp.init() (torchrun-style: its own init_process_group; or
    transport="mpi" and nothing): the DDP's construction starts the watchdog. Before, transport="mpi"
    left the others waiting in MPI's shared memory for ever, and the raising rank in MPI_Finalize."""
    [(rc, output)], elapsed, pids = kill_mid_backward(impl, tmp_path, "mpirun", "raise", "noinit")
    assert rc != 0 and elapsed < 60, output[-3000:]
    assert "RuntimeError: a bug on the last rank only" in output, output[-3000:]
    for rank in (0, 1):
        assert re.search(rf"portddp: rank 2 \(pid {pids[2]} on .*\) failed with RuntimeError: a bug on the last rank "
                         rf"only.*; rank {rank} exits now \(code {EXIT_CODE}\)", output), output[-3000:]
    assert_no_orphans(pids)


# ------------------------------------------------------- determinism, checkpoint/resume
RESUME_IMPLS = ("torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled", "jax-nnx-hooked", "jax-nnx-compiled")


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory):
    """Two separate `mpirun -n 2` jobs (tests/workers/resume.py): rows of both, by (scenario, rank). The
    first saves after 5 of its 10 steps, the second trains 10 without saving and resumes from step 5."""
    out = tmp_path_factory.mktemp("resume")
    rows = {}
    for phase in ("first", "second"):
        rows |= mpi.collect(2, "tests.workers.resume", out, phase, str(out))
    return rows


@pytest.mark.parametrize("dtype", ("float32", "float64"))
@pytest.mark.parametrize("impl", ("native", *RESUME_IMPLS))
def test_two_identical_runs_give_bitwise_identical_parameters(two_jobs, impl, dtype):
    for rank in (0, 1):
        assert two_jobs[f"first/full/{impl}/{dtype}", rank]["digest"] == \
            two_jobs[f"second/full/{impl}/{dtype}", rank]["digest"]


@pytest.mark.parametrize("dtype", ("float32", "float64"))
@pytest.mark.parametrize("impl", RESUME_IMPLS)
def test_five_steps_save_resume_five_equals_ten_bitwise(two_jobs, impl, dtype):
    for rank in (0, 1):
        resumed = two_jobs[f"resumed/{impl}/{dtype}", rank]
        assert resumed["start"] == 5
        assert resumed["digest"] == two_jobs[f"second/full/{impl}/{dtype}", rank]["digest"]  # (saved nothing)


def test_an_optimizer_of_another_class_is_refused_naming_both(two_jobs):
    for rank in (0, 1):
        message = two_jobs["other_optimizer", rank]["message"]
        assert re.search(r"torch-c10d-float32\.ckpt holds the state of a torch\.optim\.adamw\.AdamW optimizer, but "
                         r"load\(\) got a torch\.optim\.sgd\.SGD, whose hyperparameters dampening, momentum, nesterov "
                         r"it lacks: pass an optimizer of the class that was saved",
                         message or ""), message
        assert two_jobs["other_optimizer", rank]["subclass"] is None  # a subclass of the saved AdamW loads


@pytest.mark.parametrize("kind,pattern", [
    ("truncated", r"is truncated: its header promises \d+ bytes of payload, the file holds \d+"),
    ("corrupt", r"is corrupt: the SHA-256 of its payload does not match its header"),
])
def test_a_torn_checkpoint_is_refused_on_every_rank_naming_the_intact_previous_one(two_jobs, kind, pattern):
    for rank in (0, 1):
        row = two_jobs[f"torn/{kind}", rank]
        assert row["message"] and re.search(pattern, row["message"]), row
        assert f"the previous checkpoint {row['prev']} is intact" in row["message"], row


def test_a_missing_checkpoint_falls_back_to_the_intact_previous_one_on_every_rank(two_jobs):
    for rank in (0, 1):
        row = two_jobs["torn/missing", rank]
        assert row["message"] is None and row["used"] == row["prev"] and row["step"] == 5, row


def test_a_save_killed_between_its_renames_resumes_from_the_newest_intact_file(two_jobs):
    """<p> moved to <p>.prev (step 5), the finished temporary file (step 7) not renamed: load(<p>) takes
    the temporary file on every rank."""
    for rank in (0, 1):
        row = two_jobs["interrupted", rank]
        assert Path(row["used"]).name == ".interrupted.ckpt.tmp-999999" and row["step"] == 7, row


def test_files_of_other_contents_at_the_same_path_and_step_are_refused_on_every_rank(two_jobs):
    """Node-local disks: each rank finds its own file at the same path and step (an audit: each resumed
    from its own, the replicas apart, silently)."""
    for rank in (0, 1):
        message = two_jobs["node_local", rank]["message"]
        assert re.search(r"the ranks read different checkpoints at local\.ckpt \(step 5\): the SHA-256 of its "
                         r"payload is [0-9a-f]{12} on rank 0, [0-9a-f]{12} on rank 1 -- each rank found its own file "
                         r"\(a node-local disk\?\).*rank 0's file copied to every node", message or ""), message


@pytest.mark.parametrize("impl", ("torch-mpi", "jax-hooked"))
def test_load_right_after_a_rank_0_save_waits_for_its_file(two_jobs, impl):
    """`if rank == 0: save(...)` then `load(...)` on every rank, rank 0 slow to write: rank 1 used to
    read first and fail (no checkpoint at ..., or rank 0's temporary file)."""
    for rank in (0, 1):
        row = two_jobs[f"at_once/{impl}", rank]
        assert row["step"] == 2 and row["used"], row


@pytest.mark.parametrize("impl", ("torch-mpi", "jax-hooked"))
def test_rank0_only_save_writes_without_a_hang_and_restores_rng_on_rank_0_only(two_jobs, impl):
    """`if rank == 0: checkpoint.save(...)` (native DDP's idiom): written while the others train on."""
    for rank in (0, 1):
        row = two_jobs[f"rank0/{impl}", rank]
        assert row["step"] == 2 and row["rng_restored"] == (rank == 0), row


def test_a_failed_save_raises_on_every_rank_and_leaves_no_temporary_file(two_jobs):
    """Rank 0's disk full (a file-size limit): CheckpointError everywhere; the directory stays empty."""
    for rank in (0, 1):
        row = two_jobs["failed_save", rank]
        assert row["message"] and "could not write checkpoint" in row["message"], row
        assert row["left"] == [], row


# ------------------------------------------------ stall inspector, collective names, SIGTERM
def _rank_lines(output: str, n: int, pattern: str, code: int = EXIT_CODE) -> None:
    """Every rank printed a line matching `pattern` that ends in its own 'rank r exits now (code ...)'."""
    for r in range(n):
        assert re.search(pattern + rf".*; rank {r} exits now \(code {code}\)", output), f"rank {r}:\n{output[-4000:]}"


@pytest.mark.parametrize("case", ["late", "desync", "mismatch", "compiled"])
def test_stalls_and_mismatched_collectives_stop_every_rank_naming_who_is_where(case, tmp_path):
    """PORTDDP_STALL_S=2. late: rank 1 sleeps 10 s before a collective the others wait in -- all stop
    within ~5 s, every rank printing the same table with rank 1 behind. desync: rank 0 waits in
    'iteration 3 bucket 0', rank 1 in 'checkpoint save'. mismatch: the ranks meet in one allgather under
    different names -- an error on every rank at once, no stall needed. compiled: portddp.jax's compiled
    step (one XLA program that computes and communicates) on rank 0 while rank 1 sleeps before its own
    (until 2026-12-05 no rank was ever reported: the job waited as long as rank 1 did, forever if it hung)."""
    n = 3 if case == "late" else 2
    start = time.monotonic()
    proc = mpi.run(n, "tests.workers.stall", case, str(tmp_path), timeout=60, env={"PORTDDP_STALL_S": "2"})
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    if case == "mismatch":  # raised on every rank at once: each catches its own error
        assert proc.returncode == 0, output[-4000:]
        for r in range(n):
            assert re.match(r"the ranks met in different collectives -- rank 0: 'checkpoint save'; rank 1: 'checkpoint "
                            rf"load' \(this is rank {r}\)\. Every rank must make",
                            (tmp_path / f"error.{r}").read_text()), output[-4000:]
        return
    assert proc.returncode == EXIT_CODE, output[-4000:]
    assert "finished" not in proc.stdout, output[-4000:]
    if case == "late":
        assert elapsed < 30, elapsed  # ~2 s of stall + start-up; rank 1 alone would sleep 10 s
        _rank_lines(output, n, r"stall: ranks 0, 2 waited up to \d+\.\d s \(over PORTDDP_STALL_S=2\).*rank 1 is behind: "
                               r"rank 1's last collective is #2 'iteration 1 config'.*ranks 0, 2 are in #3 "
                               r"'iteration 2 unused-count'")
        assert len(re.findall(r"\n  1 +pid \d+ on .* 2 +#2 .iteration 1 config. +computing for \d+\.\d s <- behind", output)) == n, \
            output[-4000:]
    elif case == "compiled":
        assert elapsed < 60, elapsed  # ~2 s of stall + jax.distributed's start-up
        _rank_lines(output, n, r"stall: rank 0 waited \d+\.\d s \(over PORTDDP_STALL_S=2\).*rank 1 is behind: "
                               r"rank 1's last collective is #\d+ 'iteration 2: compiled step'.*rank 0 is in #\d+ "
                               r"'iteration 3: compiled step'")
    elif case == "desync":
        _rank_lines(output, n, r"stall: .*the ranks issued different collectives: collective #3 is 'iteration 3 "
                               r"bucket 0' on rank 0 but 'checkpoint save' on rank 1")
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(n)]
    assert_no_orphans(pids)


def _state(rank, seq, waiting, computes=False, name="iteration 3: compiled step"):
    return {"rank": rank, "seq": seq, "names": {str(seq): name}, "waiting": waiting, "waiting_for": name,
            "computes": computes, "idle": None if waiting is not None else 9.0, "iterations": 2,
            "in_iteration": True}


def test_the_stall_headline_names_every_waiting_rank_also_one_just_under_the_limit():
    """(A flake: the ranks leave the collective before the stalled one a moment apart, and one that
    began waiting 10 ms after the first was left out of the headline its own table listed.)"""
    states = {0: _state(0, 3, 2.01, name="iteration 2: unused-count"), 1: _state(1, 2, None, name="config"),
              2: _state(2, 3, 1.99, name="iteration 2: unused-count")}
    head = watchdog.stall_report(states, 2.0).splitlines()[0]
    assert head.startswith("stall: ranks 0, 2 waited up to 2.0 s (over PORTDDP_STALL_S=2)") and "rank 1 is behind" in head


def test_a_long_compiled_step_on_every_rank_is_not_a_stall_but_a_rank_behind_it_is():
    """portddp.jax's compiled step computes inside the wait: every rank in the same one for longer
    than PORTDDP_STALL_S is a long step; a rank that has not entered it is behind; a plain collective
    every rank waits in that long is still reported."""
    long_step = {0: _state(0, 9, 30.0, computes=True), 1: _state(1, 9, 29.0, computes=True)}
    assert watchdog.stall_report(long_step, 5.0) is None
    behind = {0: _state(0, 9, 30.0, computes=True), 1: _state(1, 8, None, name="iteration 2: compiled step")}
    assert "rank 1 is behind" in watchdog.stall_report(behind, 5.0)
    plain = {r: _state(r, 9, 30.0, name="iteration 3: bucket 0") for r in (0, 1)}
    assert "the collective itself does not complete" in watchdog.stall_report(plain, 5.0)
    # a step on one rank, a reduce() on the other (each a compiled program): other programs, reported
    other = {0: _state(0, 9, 30.0, computes=True),
             1: _state(1, 9, 30.0, computes=True, name="iteration 3: compiled reduce")}
    assert "the ranks issued different collectives" in watchdog.stall_report(other, 5.0)



def test_a_rank_behind_is_named_with_the_portddp_error_it_caught_since_its_last_collective():
    """(An audit: a rank whose script caught portddp's own error and went elsewhere was said to be
    "computing".) Only an error since its last collective is named: an older one was not why."""
    waiting = _state(0, 9, 30.0, name="iteration 3: bucket 0")
    since = {**_state(1, 8, None, name="iteration 3: plan check"), "raised": [8.5, "TypeError: loss_fn must ..."]}
    assert ("has been computing for 9.0 s since (its last portddp call raised TypeError: loss_fn must ... 8 s ago, "
            "and the script went on)") in watchdog.stall_report({0: waiting, 1: since}, 5.0)
    before = {**since, "raised": [40.0, "TypeError: an old one"]}
    assert "an old one" not in watchdog.stall_report({0: waiting, 1: before}, 5.0)

@pytest.mark.parametrize("target", ["rank", "mpirun"])
def test_sigterm_stops_a_jax_distributed_job_within_seconds(target, tmp_path):
    """jax.distributed's preemption notifier used to swallow SIGTERM (a job ran 189 s past it): now a
    SIGTERM to one rank, or to mpirun (which forwards it), ends every rank within seconds, naming it."""
    proc = _stall_job("sigterm", tmp_path)
    try:
        time.sleep(2)  # inside the loop of collectives, past jax.distributed's start
        os.kill(int((tmp_path / "pid.1").read_text()) if target == "rank" else proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the job still ran 30 s after SIGTERM")
        assert time.monotonic() - sent < 15
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0 and "finished" not in output, output[-3000:]
    if target == "rank":  # mpirun itself stops forwarding once it sees a rank end: its line, or the banner
        assert re.search(r"portddp: rank 1 \(pid \d+ on .*\) received SIGTERM; rank 1 exits now \(code 143\)",
                         output), output[-3000:]
    assert_no_orphans([int((tmp_path / f"pid.{r}").read_text()) for r in range(2)])


def test_the_others_hear_the_inner_error_of_a_failing_jax_host_callback():
    """What a rank dying of an uncaught exception tells the others: XLA wraps an error raised in a host
    callback (a user's pure_callback) as 'INTERNAL: CpuCallback error ... Traceback'; the line sent is
    the inner exception's."""
    import jax
    import jax.numpy as jnp

    from portddp.watchdog import _summary

    def bad(x):
        raise ValueError("boom inside the callback")

    with pytest.raises(Exception) as e:
        jax.jit(lambda x: jax.pure_callback(bad, jax.ShapeDtypeStruct((2,), jnp.float32), x))(jnp.ones(2)).block_until_ready()
    assert _summary(e.type, e.value).startswith("ValueError: boom inside the callback (raised in a JAX host callback; ")
    assert _summary(KeyError, KeyError("plain")) == "KeyError: 'plain'"


def test_a_child_forked_from_a_rank_does_not_speak_for_it():
    """Background checkpoint writers forked from rank 1 raise (step 2) and exit (step 5) mid-training:
    the job trains on to the end (it stopped within a second, naming rank 1 as failed or gone); the
    ranks agree."""
    proc = mpi.run(2, "tests.workers.forked_child", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "portddp: rank" not in out and "disk full while saving (in the child)" in out, out[-3000:]
    assert "rank 1: raise child's exit status 1" in out and "rank 1: exit child's exit status 3" in out, out[-3000:]
    sums = re.findall(r"rank \d: trained 12 steps, parameters (-?\d+\.\d+(?:e[-+]?\d+)?)", out)  # (lines interleave)
    assert len(sums) == 2 and sums[0] == sums[1], out[-3000:]


@pytest.mark.parametrize("names,hint", [
    (("iteration 2: plan rebuild (rank 0's gradient order)",
      "iteration 2: model check after a re-plan (a parameter's dtype, device or shape changed)"),
     r"a rank in 'model check after a re-plan' re-planned its buckets because its parameters changed dtype, device "
     r"or shape after wrapping \(\.double\(\), \.to\(\), p\.data = \.\.\.\) where the others did not"),
    (("iteration 3: bucket 0", "iteration 3: buffer broadcast"),
     r"it ran a forward without its backward \(an exception caught, a `continue` after the forward\) where they did "
     r"not\. Skip a step on every rank or on none"),
])
def test_a_desync_of_a_known_shape_says_what_usually_causes_it(names, hint):
    """(An audit: `.double()` on one rank, or a forward whose backward one rank skipped on a model with buffers,
    hang native DDP; portddp's stall table named the two collectives but not what leads there.) A rank alone
    in the broadcast's model check is not told about re-plans."""
    states = {r: _state(r, 8, 6.0, name=name) for r, name in enumerate(names)}
    assert re.search(hint, watchdog.stall_report(states, 5.0).splitlines()[0])
    alone = {0: _state(0, 8, 6.0, name="iteration 1: broadcast of rank 0's model: model check"),
             1: _state(1, 8, 6.0, name="iteration 1: bucket 0")}
    assert "re-plan" not in watchdog.stall_report(alone, 5.0)


def test_a_segment_some_process_holds_open_or_maps_is_in_use_and_one_nobody_uses_is_not():
    """What the suite (tests/conftest.py) and `portddp cluster` may remove: only a segment no process of
    this host uses. A name removed while a job's ranks meet in MPI_Init (the first opens it, the others
    after) made the late rank create a segment of its own, and the job hung there for good: the suite
    removed every new segment after each test, also those of a job running beside it."""
    path = f"/dev/shm/mpich_shm_portddptest{os.getpid()}_0"
    with open(path, "wb") as f:
        f.truncate(4096)
    holders = {
        "open": f"f = open({path!r}, 'rb'); print('ready', flush=True); input()",
        "mapped": f"import mmap; f = open({path!r}, 'r+b'); m = mmap.mmap(f.fileno(), 4096); f.close(); "
                  "print('ready', flush=True); input()",
    }
    try:
        assert path not in watchdog.mpich_segments_in_use()  # (this process closed it, mapping nothing)
        for how, code in holders.items():
            with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True) as holder:
                try:
                    assert holder.stdout.readline().strip() == "ready", how
                    assert path in watchdog.mpich_segments_in_use(), how
                finally:
                    holder.stdin.close()
                    holder.wait(timeout=30)
            assert path not in watchdog.mpich_segments_in_use(), how
    finally:
        os.unlink(path)
