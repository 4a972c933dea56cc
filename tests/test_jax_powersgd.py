"""portddp.jax's PowerSGD (powerSGD_hook, PowerSGDState) against PyTorch's own, under mpirun -n 2.

tests/workers/jax_powersgd.py runs both frameworks in one job: the two hooks alone on the same
gradients (hook/...), and SGD training with native DDP + PyTorch's hook against portddp.jax
(hooked) + ours (train/...)."""

from __future__ import annotations

import numpy as np
import pytest

from portddp.jax import PowerSGDState, powerSGD_hook
from tests import mpi

HOOK_SCENARIOS = ["rank1", "rank1_compress_biases", "rank2", "rank2_no_warm_start",
                  "rank1_no_error_feedback_no_warm_start", "rank4_qr", "epsilon", "buckets_with_1d_only",
                  "zero_size_leaves"]
TRAIN_SCENARIOS = ["rank1", "rank2", "rank1_jax_two_buckets", "rank2_jax_two_buckets"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return mpi.collect(2, "tests.workers.jax_powersgd", tmp_path_factory.mktemp("powersgd_n2"))


@pytest.mark.parametrize("scenario", HOOK_SCENARIOS)
def test_hook_matches_pytorchs_on_the_same_gradients(two_ranks, scenario):
    _, rows = mpi.each_rank((2, two_ranks), f"hook/{scenario}")
    for row in rows:
        # float32 rounding only (BLAS and norm sums differ), through 4-6 compressed iterations
        assert row["max_rel"] < 1e-5, row
        assert row["per_iter"][0] == 0.0, row  # before start_powerSGD_iter: the same plain mean, bitwise
        assert row["iter_torch"] == row["iter_jax"] == row["iters"], row
        assert row["compressed_rate_torch"] == pytest.approx(row["compressed_rate_jax"]), row


@pytest.mark.parametrize("scenario", ["rank1_float64", "rank2_float64"])
def test_hook_matches_pytorchs_to_float64_rounding(two_ranks, scenario):
    _, rows = mpi.each_rank((2, two_ranks), f"hook/{scenario}")
    assert all(row["max_rel"] < 1e-12 for row in rows), rows


@pytest.mark.parametrize("scenario", TRAIN_SCENARIOS)
def test_training_matches_native_ddp_with_pytorchs_hook(two_ranks, scenario):
    _, rows = mpi.each_rank((2, two_ranks), f"train/{scenario}")
    _, plain = mpi.each_rank((2, two_ranks), "train/plain_allreduce")
    for row, base in zip(rows, plain):
        assert row["max_rel"] < 1e-5, row
        # PowerSGD did change the training (by far more than the frameworks differ by)
        assert row["vs_plain"] > 1e-4 > 100 * base["max_rel"], (row, base)
        assert row["iter_torch"] == row["iter_jax"] == row["steps"], row
        names = lambda buckets: [n for _, ps in buckets for n in ps]  # noqa: E731
        assert names(row["buckets_torch"]) == names(row["buckets_jax"]), row
    if "two_buckets" in scenario:
        assert [b[1] for b in rows[0]["buckets_jax"]][-1] == ["inp.shift", "inp.scale"]  # 1-D only
        assert rows[0]["errors"] == [0, 1]


def test_state_checks_its_arguments():
    with pytest.raises(ValueError, match="start_powerSGD_iter must be > 1"):
        PowerSGDState(start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="process_group=None"):
        PowerSGDState(process_group=object())
    PowerSGDState(start_powerSGD_iter=1, use_error_feedback=False, warm_start=False)


def test_hook_needs_the_parameter_shapes():
    class Bare:  # a GradBucket without gradients(), and no ddp= in the state
        def index(self):
            return 0

        def buffer(self):
            return np.ones(8, np.float32)

        def is_last(self):
            return True

        world_size = 1

    with pytest.raises(TypeError, match="ddp=ddp"):
        powerSGD_hook(_started(), Bare())


def _started():
    state = PowerSGDState(start_powerSGD_iter=2)
    state.iter = 2
    return state
