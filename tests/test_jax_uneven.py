"""Uneven inputs in portddp.jax: `for batch in ddp.uneven(batches)` (torch's `with ddp.join():`),
and what the watchdog does for a JAX rank whose loop ends one batch early without it.
Worker: tests/workers/jax_uneven.py (every uneven scenario in one n=2 job; the early exits at n=3)."""

from __future__ import annotations

import re

import pytest

from tests import mpi

SCENARIOS = ["hooked", "hooked/jit", "hooked/divide_by_initial_world_size=False",
             "hooked/allreduce_hook+check_finite", "compiled"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return 2, mpi.collect(2, "tests.workers.jax_uneven", tmp_path_factory.mktemp("uneven_n2"))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_uneven_inputs_match_one_process_and_every_rank_ends_alike(two_ranks, scenario):
    """Rank r has 2 + r batches; float64, SGD with momentum. Each step's mean gradient is the sum over
    the ranks that still have a batch divided by the world size (by how many have one with
    divide_by_initial_world_size=False), as a single process computes it; every rank runs 3 steps,
    rank 0 the last one joined (loss None), and every rank ends with identical parameters."""
    _, (r0, r1) = mpi.each_rank(two_ranks, scenario)
    for row in (r0, r1):
        assert row["max_abs_diff"] <= 1e-10 and row["steps"] == 3, row
    assert r0["joined"] == 1 and r0["losses"][2] is None and None not in r0["losses"][:2], r0
    assert r1["joined"] == 0 and None not in r1["losses"], r1
    assert r0["params"] == r1["params"]
    assert r0["buckets"] >= 2, r0


def test_the_two_divisors_differ(two_ranks):
    _, (plain, _) = mpi.each_rank(two_ranks, "hooked")
    _, (effective, _) = mpi.each_rank(two_ranks, "hooked/divide_by_initial_world_size=False")
    assert max(abs(a - b) for a, b in zip(plain["params"], effective["params"])) > 1e-4


@pytest.mark.parametrize("scenario", ["hooked", "hooked/nnx.jit", "hooked/nnx.jit on the last rank", "compiled"])
def test_nnx_model_buffers_follow_torchs_join(two_ranks, scenario):
    """An NNX model with BatchNorm, rank 0 holding 3 batches and rank 1 two: each step starts from the
    BatchStat of the highest rank that has a batch (rank 1, then rank 0 once rank 1 has joined), which
    the joined rank takes too; at the loop's end every rank holds the last joiner's (rank 0's) -- as
    torch's join() leaves a module's buffers. Params identical and as one process computes them.
    Inside nnx.jit the loop's end cannot reach the model (grad_fn sees a copy): each rank keeps what
    its last step left -- also where the other ranks step eagerly, which every rank then warns of. (The first version took rank 0's buffers at every step and a joined rank kept
    its own.)"""
    _, (r0, r1) = mpi.each_rank(two_ranks, f"nnx_batchnorm/{scenario}")
    for row in (r0, r1):
        assert row["max_abs_diff"] <= 1e-10 and row["steps"] == 3, row
        assert max(row["step_gaps"]) <= 1e-12, row
        if "nnx.jit" in scenario:
            assert row["last_step_gap"] <= 1e-12, row
        else:
            assert row["final_gap"] <= 1e-12, row
        # eager on one rank, inside jit on another: none takes the last joiner's buffers, each says so
        assert row["unsynced"] == (1 if scenario.endswith("last rank") else 0), row
    assert r0["joined"] == 0 and r1["joined"] == 1, (r0, r1)
    if scenario.endswith("last rank"):  # (the same gradients; the update rounds differently jitted and eager)
        assert max(abs(a - b) for a, b in zip(r0["params"], r1["params"])) <= 1e-15
    else:
        assert r0["params"] == r1["params"]


def test_throw_on_early_termination_raises_on_every_rank(two_ranks):
    _, rows = mpi.each_rank(two_ranks, "throw")
    for row in rows:
        assert row["steps"] == 2 and re.search(r"rank\(s\) \[0\] ran out of batches", row["message"] or ""), row


@pytest.mark.parametrize("strategy", ["hooked", "compiled"])
def test_a_rank_that_stops_one_batch_early_stops_every_rank_naming_it(strategy):
    """Without uneven(): rank 2 of 3 runs 2 synchronised steps, the others 3. The watchdog counts
    JAX's iterations too (hooked: host callbacks; compiled: around the XLA program), so the
    survivors exit (code 70) naming rank 2 instead of waiting in the third step's collectives."""
    proc = mpi.run(3, "tests.workers.jax_uneven", "early", strategy, timeout=60)
    assert proc.returncode != 0
    assert "rank 2 finished its loop" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    for r in (0, 1):
        assert re.search(rf"rank 2 \(pid \d+ on .*\) left without an error .* after 2 synchronised iteration\(s\), "
                         rf"while this rank is in iteration 3.*; rank {r} exits now \(code 70\)",
                         proc.stderr), proc.stderr[-3000:]


def test_a_break_out_of_uneven_on_one_rank_is_named_by_the_stall_inspector():
    """A break on rank 0 alone, then the next epoch's loop: the ranks meet in different collectives, which only
    the stall inspector can name (a closed generator cannot tell the others); its table says this rank left the
    loop early (was: only the collectives' usual names)."""
    proc = mpi.run(2, "tests.workers.jax_uneven", "break", "hooked", timeout=90, env={"PORTDDP_STALL_S": "6"})
    assert proc.returncode != 0
    assert "this rank left a ddp.uneven() loop early, after its step 2: a break?" in proc.stdout + proc.stderr, \
        proc.stdout[-2000:] + proc.stderr[-3000:]
