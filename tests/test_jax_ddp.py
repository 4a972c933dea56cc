"""portddp.jax (hooked strategy) against one process on the global batch, numpy,
and its own events; bad input on every rank. Worker: tests/workers/jax_equivalence.py."""

from __future__ import annotations

import pytest

from tests import mpi


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"n{n}")
def results(request, tmp_path_factory):
    n = request.param
    return n, mpi.collect(n, "tests.workers.jax_equivalence", tmp_path_factory.mktemp(f"jax_n{n}"))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype,bound", [("float64", 1e-10), ("float32", 1e-5)])
def test_matches_one_process_on_the_global_batch(results, dtype, bound, overlap):
    n, rows = mpi.each_rank(results, f"global_batch/{dtype}/overlap={overlap}/micro=1")
    for row in rows:
        assert row["max_rel"] <= bound, row
        assert row["ordered"], row
        assert row["buckets"] >= 2, row
        # Buckets overlap backward only when asked: from the recorded events.
        assert row["first_launch_before_backward_end"] is overlap, row


def test_accumulate_locally_then_reduce(results):
    _, rows = mpi.each_rank(results, "global_batch/float64/overlap=True/micro=3")
    assert all(row["max_rel"] <= 1e-10 for row in rows), rows


@pytest.mark.parametrize("hook,eps", [("fp16_compress_hook", 2.0**-10), ("bf16_compress_hook", 2.0**-7),
                                      ("allreduce_hook", 1e-6), ("noop_hook", 1e-6)])
def test_comm_hooks_match_numpy(results, hook, eps):
    """cast -> divide -> sum -> cast back in numpy, from every rank's local gradient. Bounded by one
    unit of the reduced type (XLA fuses the tapped program differently, ~1e-7 in float32)."""
    _, rows = mpi.each_rank(results, f"hook_{hook}")
    for row in rows:
        assert row["max_diff"] <= eps * row["scale"], row


BAD = [
    ("shape_mismatch", r"leaf #0 is \['dec'\]\['w'\] \(4, 2\) float32 on rank 0 but \['dec'\]\['w'\] \(4, 3\) float32"),
    ("dtype_mismatch", r"leaf #1 is \['enc'\]\['b'\] \(4,\) float32 on rank 0 but \['enc'\]\['b'\] \(4,\) bfloat16"),
    ("structure_mismatch", r"rank 0 has 3 leaves, rank \d has 4; the first one only rank \d has is \['extra'\]"),
    ("unknown_strategy", r"unknown strategy 'telepathy': choose one of"),
    ("bad_cap", r"bucket_cap_mb=-2 is not a valid bucket size"),
    ("bad_order", r"order must list every parameter name exactly once; .*missing: \[.*\['dec'\]\['w'\]"),
]


@pytest.mark.parametrize("case,pattern", BAD, ids=[c for c, _ in BAD])
def test_bad_input_fails_on_every_rank(case, pattern):
    proc = mpi.run(2, "tests.workers.jax_bad_input", case, timeout=120)
    mpi.errors_on_every_rank(proc, 2, pattern)
