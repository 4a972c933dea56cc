"""The planner against PyTorch's own assignment, and the plan as a value."""

import math
import random

import pytest
import torch
import torch.distributed as dist

from portddp.buckets import BucketPlan, ParamSpec, assign_by_size, plan_as_registered, plan_buckets, rebuild_plan

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


def random_specs(rng: random.Random) -> list[ParamSpec]:
    n = rng.randint(1, 40)
    dtypes = rng.sample(list(DTYPES), rng.randint(1, 3))
    specs = []
    for i in range(n):
        shape = tuple(rng.choice([1, 3, 7, 64, 100, 256, 1000]) for _ in range(rng.randint(1, 3)))
        specs.append(ParamSpec(f"p{i}", shape, rng.choice(dtypes)))
    return specs


@pytest.mark.parametrize("seed", range(300))
def test_assignment_equals_pytorch(seed):
    rng = random.Random(seed)
    specs = random_specs(rng)
    limits = sorted(rng.sample([64, 400, 1000, 4096, 65536, 10**6, 10**7], rng.randint(1, 3)))
    tensors = [torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs]
    want_buckets, want_limits = dist._compute_bucket_assignment_by_size(tensors, limits)
    got_buckets, got_limits = assign_by_size(
        [s.nbytes for s in specs], [s.dtype for s in specs], limits
    )
    assert got_buckets == [list(b) for b in want_buckets]
    assert got_limits == list(want_limits)


@pytest.mark.parametrize("seed", range(100))
def test_sparse_gradients_get_buckets_of_their_own_as_in_pytorch(seed):
    """An nn.Embedding(sparse=True)'s weight: alone in its bucket (no limit), moving no group to its
    next limit -- native's assignment given expect_sparse_gradient; the flag survives a re-plan and
    JSON (where it is set: dense plans' JSON is as before)."""
    rng = random.Random(5000 + seed)
    specs = [ParamSpec(s.name, s.shape, s.dtype, sparse=rng.random() < 0.2) for s in random_specs(rng)]
    limits = sorted(rng.sample([64, 400, 1000, 4096, 65536], rng.randint(1, 2)))
    tensors = [torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs]
    want_buckets, want_limits = dist._compute_bucket_assignment_by_size(tensors, limits, [s.sparse for s in specs])
    got_buckets, got_limits = assign_by_size(
        [s.nbytes for s in specs], [s.dtype for s in specs], limits, [s.sparse for s in specs])
    assert got_buckets == [list(b) for b in want_buckets]
    assert got_limits == list(want_limits)
    plan = rebuild_plan(plan_buckets(specs, 0.01, 0.001), list(range(len(specs))), 0.01, 0.001)
    assert [b.sparse for b in plan.buckets] == [len(b.params) == 1 and specs[b.params[0]].sparse for b in plan.buckets]
    assert BucketPlan.from_json(plan.to_json()) == plan
    assert ('"sparse"' in plan.to_json()) == any(s.sparse for s in specs)


@pytest.mark.parametrize("seed", range(100))
def test_rebuild_is_pytorchs_assignment_given_the_observed_order(seed):
    """Native's reducer re-plans by passing the observed order as tensor indices, and then keeps its
    buckets in the order they closed (unsorted): a lone sparse tensor's bucket before the dense one
    still open when it arrived, a dtype's bucket before another dtype's that closed later (a review)."""
    rng = random.Random(7000 + seed)
    specs = [ParamSpec(s.name, s.shape, s.dtype, sparse=rng.random() < 0.2) for s in random_specs(rng)]
    cap_mb, first_mb = rng.choice([(0.01, 0.001), (0.25, 0.05), (1.0, 1.0)])
    order = list(range(len(specs)))
    rng.shuffle(order)
    rebuilt = rebuild_plan(plan_buckets(specs, cap_mb, first_mb), order, cap_mb, first_mb)
    limits = [int(first_mb * 2**20), int(cap_mb * 2**20)] if first_mb < cap_mb else [int(cap_mb * 2**20)]
    # (as the reducer calls it: the tensors in the observed order, the sparse flags by parameter index)
    want, _ = dist._compute_bucket_assignment_by_size(
        [torch.empty(specs[i].shape, dtype=DTYPES[specs[i].dtype]) for i in order], limits, [s.sparse for s in specs],
        order)
    got, want = rebuilt.assignment(), [list(b) for b in want]
    # Those that closed, in the order they closed; then those left open at the end, one per dtype,
    # which native emits in its hash map's order (compared as a set).
    closed = sum(b.sparse or b.nbytes >= b.cap_bytes for b in rebuilt.buckets)
    assert got[:closed] == want[:closed]
    assert sorted(got[closed:]) == sorted(want[closed:])


@pytest.mark.parametrize("seed", range(100))
def test_plan_is_pytorch_assignment_of_reversed_params(seed):
    """Native DDP rebuilds its buckets from the gradient-ready order with limits
    [first_bucket_cap, bucket_cap]; our initial plan is that assignment over
    the reverse registration order."""
    rng = random.Random(1000 + seed)
    specs = random_specs(rng)
    cap_mb, first_mb = rng.choice([(0.01, 0.001), (0.25, 0.05), (1.0, 1.0), (25.0, 1.0)])
    plan = plan_buckets(specs, cap_mb, first_mb)
    rev = list(reversed(specs))
    tensors = [torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in rev]
    limits = [int(first_mb * 2**20), int(cap_mb * 2**20)] if first_mb < cap_mb else [int(cap_mb * 2**20)]
    want, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    n = len(specs)
    assert plan.assignment() == [[n - 1 - i for i in b] for b in want]


@pytest.mark.parametrize("seed", range(100))
def test_find_unused_plan_is_natives_assignment_in_registration_order_reversed(seed):
    """With find_unused_parameters=True (no static_graph) native DDP assigns its buckets over the
    registration order with limits [first_bucket_cap, bucket_cap] and hands the reducer the list
    reversed, never re-planning; plan_as_registered is that plan."""
    rng = random.Random(2000 + seed)
    specs = random_specs(rng)
    cap_mb, first_mb = rng.choice([(0.01, 0.001), (0.25, 0.05), (1.0, 1.0), (25.0, 1.0)])
    tensors = [torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in specs]
    limits = [int(first_mb * 2**20), int(cap_mb * 2**20)] if first_mb < cap_mb else [int(cap_mb * 2**20)]
    want, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    assert plan_as_registered(specs, cap_mb, first_mb).assignment() == [list(b) for b in reversed(want)]


def test_plan_layout_and_json_round_trip():
    specs = [ParamSpec("w1", (4, 3), "float32"), ParamSpec("b1", (4,), "float32"),
             ParamSpec("w2", (2, 4), "float64"), ParamSpec("b2", (2,), "float32")]
    plan = plan_buckets(specs, bucket_cap_mb=1.0)
    # reverse order, grouped by dtype: float32 bucket holds b2, b1, w1 back to back
    f32 = next(b for b in plan.buckets if b.dtype == "float32")
    assert f32.params == (3, 1, 0) and f32.offsets == (0, 2, 6) and f32.numel == 18
    assert BucketPlan.from_json(plan.to_json()) == plan
    where = plan.locate()
    assert all(b >= 0 for b, _ in where)


def test_first_bucket_cap_and_never_split():
    specs = [ParamSpec(f"p{i}", (1024,), "float32") for i in range(8)]  # 4 KiB each
    plan = plan_buckets(specs, bucket_cap_mb=12 * 1024 / 2**20, first_bucket_cap_mb=4 * 1024 / 2**20)
    assert [len(b.params) for b in plan.buckets] == [1, 3, 3, 1]
    big = [ParamSpec("small", (1,), "float32"), ParamSpec("huge", (10**6,), "float32")]
    plan = plan_buckets(big, bucket_cap_mb=0.001)
    assert sorted(len(b.params) for b in plan.buckets) == [1, 1]


def test_rebuild_follows_ready_order():
    specs = [ParamSpec(f"p{i}", (256,), "float32") for i in range(6)]  # 1 KiB each
    plan = plan_buckets(specs, bucket_cap_mb=2048 / 2**20, first_bucket_cap_mb=1024 / 2**20)
    rebuilt = rebuild_plan(plan, [0, 1, 2, 3, 4, 5], 2048 / 2**20, 1024 / 2**20)
    assert rebuilt.assignment() == [[0], [1, 2], [3, 4], [5]]
    partial = rebuild_plan(plan, [2, 0], 2048 / 2**20, 1024 / 2**20)
    assert partial.assignment()[0] == [2]  # unused ones follow, reverse registration order
    with pytest.raises(ValueError, match="permutation"):
        rebuild_plan(plan, [0, 0], 1.0, 1.0)


@pytest.mark.parametrize("bad", [-1e-9, -1.0, float("nan"), "25", None, True])
def test_bad_caps_are_refused_with_the_value(bad):
    with pytest.raises(ValueError, match=r"bucket_cap_mb=.*megabytes"):
        plan_buckets([ParamSpec("w", (3,), "float32")], bucket_cap_mb=bad)
    with pytest.raises(ValueError, match=r"first_bucket_cap_mb="):
        plan_buckets([ParamSpec("w", (3,), "float32")], first_bucket_cap_mb=bad)


def test_a_zero_cap_means_one_tensor_per_bucket_as_native():
    specs = [ParamSpec(f"p{i}", (1000,), "float32") for i in range(5)]
    plan = plan_buckets(specs, 0, 0)
    assert len(plan.buckets) == 5 and all(len(b.params) == 1 for b in plan.buckets)


def test_infinite_cap_means_one_bucket_per_dtype():
    specs = [ParamSpec(f"p{i}", (1000,), "float32") for i in range(5)]
    assert len(plan_buckets(specs, math.inf, math.inf).buckets) == 1
