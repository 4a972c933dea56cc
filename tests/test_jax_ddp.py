"""portddp.jax -- hooked, compiled and pmap -- against one process on the global
batch, each other, portddp.torch's plan, numpy, and its own events; bad input on
every rank. Worker: tests/workers/jax_equivalence.py (pmap runs in the n=1 world
over 4 forced host devices)."""

from __future__ import annotations

import pytest

from tests import mpi

STRATEGIES = ("hooked", "compiled", "pmap")


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"n{n}")
def results(request, tmp_path_factory):
    n = request.param
    return n, mpi.collect(n, "tests.workers.jax_equivalence", tmp_path_factory.mktemp(f"jax_n{n}"))


def _skip_pmap_beyond_one_process(results, strategy):
    if strategy == "pmap" and results[0] > 1:
        pytest.skip("pmap maps over one process's devices; it runs in the n=1 world")


def _skip_at_three(results):
    if results[0] == 3:
        pytest.skip("independent of an odd world size: checked at n=1 and n=2 (the n=3 worker runs the sums, "
                    "accumulation and hooks only)")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype,bound", [("float64", 1e-10), ("float32", 1e-5)])
def test_matches_one_process_on_the_global_batch(results, strategy, dtype, bound):
    _skip_pmap_beyond_one_process(results, strategy)
    _, rows = mpi.each_rank(results, f"global_batch/{strategy}/{dtype}/overlap=True")
    for row in rows:
        assert row["max_rel"] <= bound, row
        assert row["buckets"] >= 2, row
        if strategy == "hooked":
            # Buckets overlap backward, in plan order: from the recorded events.
            assert row["first_launch_before_backward_end"] and row["ordered"], row
        else:
            # What XLA made of one psum per bucket: at least one all-reduce survives.
            assert row["hlo"]["all_reduces"] >= 1, row


def test_hooked_without_overlap_launches_after_backward(results):
    _, rows = mpi.each_rank(results, "global_batch/hooked/float64/overlap=False")
    for row in rows:
        assert row["max_rel"] <= 1e-10 and row["ordered"], row
        assert not row["first_launch_before_backward_end"], row


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_four_accumulated_micro_batches_equal_one_batch(results, strategy):
    _skip_pmap_beyond_one_process(results, strategy)
    _, rows = mpi.each_rank(results, f"accumulate4/{strategy}")
    assert all(row["max_rel"] <= 1e-10 for row in rows), rows


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_auto_bucket_cap_picks_one_cap_on_every_rank(results, strategy):
    _skip_pmap_beyond_one_process(results, strategy)
    _skip_at_three(results)
    _, rows = mpi.each_rank(results, f"auto_cap/{strategy}")
    assert len({r["chosen"] for r in rows}) == 1, rows
    for row in rows:
        assert row["chosen"] in row["candidates"] and row["cap_in_use"] == row["chosen"], row
        assert row["plan_cap_mb"] == pytest.approx(row["chosen"], rel=1e-6), row
        assert row["max_rel"] <= 1e-10, row


def test_hooked_grad_fn_inside_the_callers_jit(results):
    """jax.jit(lambda p, b: update(p, grad_fn(p, b)[1])): the whole step one program, still bucketed and overlapped."""
    _skip_at_three(results)
    _, rows = mpi.each_rank(results, "inside_user_jit")
    for row in rows:
        assert row["max_rel"] <= 1e-10 and row["iterations"] == 5, row
        assert row["first_launch_before_backward_end"], row


def test_hooked_and_compiled_give_the_same_gradients(results):
    _skip_at_three(results)
    _, rows = mpi.each_rank(results, "hooked_vs_compiled")
    assert all(row["max_rel"] <= 1e-12 for row in rows), rows


def test_same_plan_as_portddp_torch(results):
    _skip_at_three(results)
    _, rows = mpi.each_rank(results, "same_plan_as_torch")
    for row in rows:
        assert row["equal"], row
        assert len(row["jax"]) >= 2, row


def test_flax_nnx_state(results):
    _skip_at_three(results)
    _, rows = mpi.each_rank(results, "nnx_state")
    for row in rows:
        assert row["max_rel"] <= 1e-10 and row["type"] == "State", row


@pytest.mark.parametrize("hook,eps", [("fp16_compress_hook", 2.0**-10), ("bf16_compress_hook", 2.0**-7),
                                      ("allreduce_hook", 1e-6), ("noop_hook", 1e-6)])
def test_comm_hooks_match_numpy(results, hook, eps):
    """cast -> divide -> sum -> cast back in numpy, from every rank's local gradient. Bounded by one
    unit of the reduced type (the tapped program may fuse differently, ~1e-7 in float32; observed 0)."""
    _, rows = mpi.each_rank(results, f"hook_{hook}")
    for row in rows:
        assert row["max_diff"] <= eps * row["scale"], row


BAD = [
    ("shape_mismatch", r"leaf #0 is \['dec'\]\['w'\] \(4, 2\) float32 on rank 0 but \['dec'\]\['w'\] \(4, 3\) float32"),
    ("dtype_mismatch", r"leaf #1 is \['enc'\]\['b'\] \(4,\) float32 on rank 0 but \['enc'\]\['b'\] \(4,\) bfloat16"),
    ("structure_mismatch", r"rank 0 has 3 leaves, rank \d has 4; the first one only rank \d has is \['extra'\]"),
    ("broadcast_mismatch", r"leaf #0 is \['dec'\]\['w'\] \(4, 2\) float32 on rank 0 but \['dec'\]\['w'\] \(5, 2\)"),
    ("unknown_strategy", r"unknown strategy 'telepathy': choose one of \('hooked', 'compiled', 'pmap'\)"),
    ("unknown_transport", r"unknown transport 'c10d': choose one of \('mpi',\)"),
    ("bad_cap", r"bucket_cap_mb=-2 is not a valid bucket size"),
    ("bad_order", r"order must list every parameter name exactly once; .*missing: \[.*\['dec'\]\['w'\]"),
    ("pmap_too_many_devices", r"strategy='pmap' asked for 4 devices but this process has 1: set "
                              r"XLA_FLAGS=--xla_force_host_platform_device_count=4"),
    ("integer_leaf", r"leaf \['enc'\]\['step'\] has dtype int32, which has no gradient"),
    ("python_float_leaf", r"leaf \['enc'\]\['scale'\] is a Python float, not an array: make it one"),
    ("complex_leaf", r"leaf \['enc'\]\['phase'\] is complex \(complex64\): portddp\.jax reduces real"),
    ("float8_leaf", r"leaf \['enc'\]\['scale'\] has dtype float8_e4m3fn, which portddp\.jax does not reduce \(it "
                    r"reduces float16, bfloat16, float32, float64\): keep the parameter in one of those"),
    ("loss_not_scalar", r"loss_fn must return a scalar; '<lambda>' returned shape \(3, 4\)"),
    ("cap_differs", r"DistributedDataParallel arguments differ across ranks: bucket_cap_mb is 25\.0 on rank 0 but "
                    r"5\.0 on rank 1; every rank must pass the same bucket_cap_mb"),
    ("strategy_differs", r"transport is 'mpi' on rank 0 but \"xla \(strategy='compiled'\)\" on rank 1"),
    ("nonfinite", r"non-finite gradients \(NaN or Inf\) found by check_finite -- rank 1: .*\['enc'\]\['w'\].*grad_fn "
                  r"returned no gradients for this step"),
    ("check_finite_compiled", r"check_finite=True needs strategy='hooked'"),
    ("compiled_without_jax_distributed", r"strategy='compiled' sees 1 JAX process\(es\) but the job has 2 ranks: "
                                         r"call portddp\.init\(jax_distributed=True\)"),
]


@pytest.fixture(scope="module")
def bad_input():
    """Every case in one job (tests/workers/common.run_cases)."""
    return mpi.run_cases(2, "tests.workers.jax_bad_input", [c for c, _ in BAD])


@pytest.mark.parametrize("case,pattern", BAD, ids=[c for c, _ in BAD])
def test_bad_input_fails_on_every_rank(bad_input, case, pattern):
    mpi.case_errors_on_every_rank(bad_input, case, 2, pattern)
