"""portddp.jax in the everyday idioms of Flax NNX and optax: an nnx.Module with BatchNorm and
Dropout trained by nnx.Optimizer through ddp.nnx_value_and_grad (eagerly and inside nnx.jit),
leaves the loss does not use, has_aux, and the errors for what the design cannot take.
Worker: tests/workers/jax_dropin.py (n=2 for hooked and compiled; n=1 over 2 forced host
devices for pmap; the bad inputs in one n=2 job)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests import mpi


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return 2, mpi.collect(2, "tests.workers.jax_dropin", tmp_path_factory.mktemp("dropin_n2"))


@pytest.fixture(scope="module")
def pmap_world(tmp_path_factory):
    return 1, mpi.collect(1, "tests.workers.jax_dropin", tmp_path_factory.mktemp("dropin_pmap"), "pmap")


@pytest.mark.parametrize("scenario", ["hooked", "compiled", "hooked/nnx.jit", "hooked/broadcast_buffers=False"])
def test_nnx_batchnorm_dropout_adamw_matches_the_per_shard_reference(two_ranks, scenario):
    """float64, 4 adamw steps: Params equal to the reference's; each rank's BatchStat equal to what the
    reference computes for that rank's shard (starting from rank 0's with broadcast_buffers, its own
    without); each rank's loss its own shard's; grads an nnx.State."""
    _, rows = mpi.each_rank(two_ranks, f"nnx_train/{scenario}")
    for row in rows:
        assert row["params_rel"] <= 1e-10 and row["stats_rel"] <= 1e-10 and row["loss_rel"] <= 1e-10, row
        assert row["grads_type"] == "State" and row["buckets"] >= 2, row
        assert row["rng_count"] > 0, row  # the forward's RNG draws came back to the model


def test_dropout_masks_are_applied_and_differ_per_rank(two_ranks):
    """Each rank draws from its own stream (nnx.Rngs(dropout=1000 + rank)), as torch's per-process generators."""
    _, rows = mpi.each_rank(two_ranks, "nnx_train/hooked")
    masks = [row["mask"] for row in rows]
    assert all(0 < sum(m) < len(m) for m in masks), masks
    assert masks[0] != masks[1]


@pytest.mark.parametrize("strategy", ["hooked", "compiled"])
def test_nnx_without_per_rank_state_matches_the_global_batch(two_ranks, strategy):
    _, rows = mpi.each_rank(two_ranks, f"nnx_global_batch/{strategy}")
    assert all(row["max_rel"] <= 1e-10 and row["remat_max_rel"] <= 1e-10 for row in rows), rows


def _unused_rows(two_ranks, pmap_world, strategy):
    return mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"unused/{strategy}")[1]


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_leaves_the_loss_does_not_use_get_zeros(two_ranks, pmap_world, strategy):
    """Plan [d] [c, b] [a]: the first bucket never fires, b sits beside c, and (hooked) c reaches the loss
    on rank 0 only -- its gradient is then rank 0's / world. Three calls: before and after the rebuild."""
    for row in _unused_rows(two_ranks, pmap_world, strategy):
        assert row["buckets"] == [["['d']"], ["['c']", "['b']"], ["['a']"]], row
        assert row["max_rel"] <= 1e-10, row
        assert row["zero"] == row["want_zero"], row
        assert row["zero"][1] and row["zero"][3] and not row["zero"][0], row
        if strategy == "hooked":
            assert not row["zero"][2], row  # used on rank 0 only: a nonzero mean


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_has_aux(two_ranks, pmap_world, strategy):
    """((loss, aux), grads) as jax.value_and_grad(has_aux=True) gives, for pytrees and NNX models."""
    _, rows = mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"has_aux/{strategy}")
    for row in rows:
        assert row["aux_equal"] and row["local_aux_equal"] and row["loss_equal"], row
        assert row["grads_rel"] == 0.0 and row.get("loss_is_mine", True), row
        assert row["nnx_aux"] == [8, 3] and row["nnx_grads_type"] == "State", row



@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_variables_holding_python_numbers_are_carried_through_the_step(two_ranks, pmap_world, strategy):
    """nnx.Variable(0) / nnx.Variable(0.5) updated by the forward (a step counter): three steps update
    them three times on every rank, each rank's own (compiled and pmap raised AttributeError on a leaf
    without a dtype; later steps broadcast rank 0's value as if it were a buffer)."""
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"python_numbers/{strategy}")[1]:
        assert row["calls"] == 10 * row["me"] + 3 and row["decay"] == 0.5 ** 4 and row["max_rel"] <= 1e-12, row


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_a_script_training_inside_its_own_mesh_gets_the_global_batchs_gradients(two_ranks, pmap_world, strategy):
    """jax.set_mesh around the loop (Flax's nnx.with_partitioning needs one): the compiled and pmap strategies
    raised JAX's 'context mesh ... should match the mesh passed to shard_map'; a step and ddp.reduce."""
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"user_mesh/{strategy}")[1]:
        assert row["step"] <= 1e-12 and row["reduce"] <= 1e-12, row


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_plain_attributes_the_forward_changes_are_kept_as_nnx_value_and_grad_keeps_them(two_ranks, pmap_world,
                                                                                        strategy):
    """A plain Python call counter and a flag switched at the third step (static in NNX): after four steps
    both are where nnx.value_and_grad leaves them, and every step's gradient is the global batch's (they
    were silently dropped: the counter stayed 0, the warm-up branch ran for ever). The model also holds a
    dict of lists, which no hash takes: its GraphDef is jit's static argument all the same."""
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"plain_attributes/{strategy}")[1]:
        assert [row["calls"], row["mode"]] == row["reference"] == [4, "full"] and row["max_rel"] <= 1e-12, row
        assert row["rows"][0] == row["rows"][1], row  # the batch rows the last forward saw, step by step


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_a_value_sown_by_an_evaluation_is_popped_by_the_next_step_as_under_nnx(two_ranks, pmap_world, strategy):
    """Flax's VAE example: an evaluation forward between steps sows a value, the next step's loss_fn pops
    it with its own -- that step's loss holds both, as under nnx.value_and_grad, and the model holds neither
    after it (compiled and pmap refused the step; hooked kept the stale value in the model for ever)."""
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"sown/{strategy}")[1]:
        assert all(abs(got - want) <= 1e-12 * abs(want) for got, want in row["losses"]), row
        assert row["max_rel"] <= 1e-12 and row["left"] == [0, 0, 0, 0], row


@pytest.mark.parametrize("strategy", ["compiled", "pmap"])
def test_a_change_of_the_trained_state_on_one_shard_is_refused_everywhere(two_ranks, pmap_world, strategy):
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"changed_on_one_shard/{strategy}")[1]:
        assert row["outcome"].startswith("loss_fn changed the value of trained state ['l1']['kernel'].value"), row


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_wrt_trains_a_subset_and_freezes_the_rest(two_ranks, pmap_world, strategy):
    """DistributedDataParallel(model, wrt=F) beside nnx.Optimizer(model, tx, wrt=F) -- F = nnx.LoRAParam, or a
    path filter taking the LoRA and a head held as plain arrays: the global batch's training with
    nnx.DiffState(0, F); gradients only for what F selects; the frozen base is rank 0's on every rank."""
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"wrt/{strategy}")[1]:
        lora = ["['lora']['lora_a']", "['lora']['lora_b']"]
        assert row["lora"]["grads"] == lora and row["path"]["grads"] == sorted(["['head']", "['head_b']", *lora]), row
        for case in ("lora", "path"):
            assert row[case]["max_rel"] <= 1e-12 and row[case]["base_is_rank0s"], row


BAD = [
    ("tuple_loss_without_has_aux", r"TypeError: loss_fn must return a scalar; 'returns_pair' returned a tuple of 2 "
                                   r"values: to return \(loss, aux\) pass has_aux=True"),
    ("nnx_tuple_loss_without_has_aux", r"returned a tuple of 2 values: to return \(loss, aux\) pass has_aux=True "
                                       r"\(ddp\.nnx_value_and_grad\(loss_fn, has_aux=True\)"),
    ("has_aux_without_pair", r"has_aux=True: loss_fn must return a pair \(loss, aux\); '<lambda>' returned one array"),
    ("compiled_inside_jit", r"strategy='compiled' runs its own program over every rank's device, which cannot be "
                            r"traced into your jax\.jit .* or use strategy='hooked'"),
    ("rngs_captured_outside", r"loss_fn changed Flax NNX state that is not part of the model \(Flax: Cannot mutate "
                              r"RngCount .*\): .* Keep it in the model"),
    ("rngs_in_batch", r"loss_fn changed Flax NNX state that is not part of the model \(Flax: Cannot mutate "
                      r"RngCount .*\): .* passed in the batch, cannot be updated there .* Keep it in the model"),
    ("rngs_in_batch_nnx_jit", r"loss_fn changed Flax NNX state that is not part of the model \(its RngCount was "
                              r"updated\): .* the same dropout masks at every step\). Keep it in the model"),
    ("key_in_params", r"leaf \['seed'\]\.value is a JAX PRNG key, which is not a parameter"),
    ("module_to_pytree_grad_fn", r"grad_fn got a Flax Net module: use ddp\.nnx_value_and_grad\(loss_fn\)"),
    ("key_in_batch_compiled", r"batch leaf \[1\] is a JAX PRNG key: strategy='compiled' splits batch and state "
                              r"leaves"),
    ("scalar_in_batch_compiled", r"strategy='compiled' splits every batch leaf along its first axis over the "
                                 r"processes, but batch leaf \[1\] is a scalar \(float32\): give it a leading batch axis"),
    ("buffers_differ", r"model buffers differ across ranks: buffer #0 is \['bn'\]\['mean'\]\.value \(16,\) float32 on "
                       r"rank 0 but \['bn'\]\['mean'\]\.value \(17,\)"),
    ("param_changed_in_forward", r"RuntimeError: loss_fn changed the value of trained state \['l1'\]\['kernel'\]"
                                 r"\.value in the forward .* the replicas would drift apart: portddp refuses it .* "
                                 r"Make the change outside loss_fn, the same on every rank"),
    ("param_changed_in_forward_in_jit", r"CpuCallback error .* RuntimeError: loss_fn changed the value of trained state "
                                        r"\['l1'\]\['kernel'\]\.value in the forward"),
    ("param_changed_in_forward_compiled", r"RuntimeError: loss_fn changed the value of trained state "
                                          r"\['l1'\]\['kernel'\]\.value in the forward"),
    ("broadcast_buffers_differ", r"broadcast_buffers is True on rank 0 but False on rank 1"),
    ("no_param_in_module", r"ValueError: Plain holds no nnx\.Param \(its floating-point arrays: \['w'\]\), so "
                           r"DistributedDataParallel has no gradient to reduce\..* or pass DistributedDataParallel"
                           r"\(model, wrt=\.\.\.\) the filter your nnx\.Optimizer's wrt= uses"),
    ("frozen_params_differ", r"ValueError: parameter values differ across ranks at the first synchronised step "
                             r"\(rank 1 vs rank 0; .*with wrt=, ddp\.broadcast\(model\) gives the Params it leaves "
                             r"out -- frozen, compared here too -- rank 0's values as well"),
]


@pytest.fixture(scope="module")
def bad_job():
    proc = mpi.run(2, "tests.workers.jax_dropin", "bad", "all", timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("case,pattern", BAD, ids=[c for c, _ in BAD])
def test_bad_input_fails_on_every_rank(bad_job, case, pattern):
    mine = "\n".join(line[len(case) + 3:] for line in bad_job.stdout.splitlines() if line.startswith(f"[{case}] "))
    mpi.errors_on_every_rank(SimpleNamespace(stdout=mine, stderr=bad_job.stderr), 2, pattern)


def test_bad_cases_are_all_listed():
    from pathlib import Path  # noqa: PLC0415

    worker = (Path(__file__).parent / "workers" / "jax_dropin.py").read_text()
    listed = re.search(r"BAD_CASES = \((.*?)\)\n", worker, re.S).group(1)
    assert sorted(re.findall(r'"(\w+)"', listed)) == sorted(c for c, _ in BAD)


@pytest.mark.parametrize("strategy,pattern", [
    ("hooked", r"OK$"),
    ("compiled", r"ValueError: strategy='compiled' splits every batch leaf along its first axis over the processes, "
                 r"but batch leaf \[2\] is a scalar \(float64\): give it a leading batch axis"),
    ("pmap", r"ValueError: strategy='pmap' splits every batch leaf along its first axis over the 2 devices, but a "
             r"batch leaf is a scalar \(float64\): give it a leading batch axis"),
])
def test_a_scalar_batch_leaf_is_named_where_the_batch_is_split(two_ranks, pmap_world, strategy, pattern):
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"scalar_batch/{strategy}")[1]:
        assert re.match(pattern, row["outcome"]), row["outcome"]


@pytest.mark.parametrize("strategy", ["hooked", "compiled", "pmap"])
def test_values_loss_fn_reads_from_outside_its_arguments_are_read_at_every_step(two_ranks, pmap_world, strategy):
    """A global pytree (a GAN's generator), a closure cell (a temperature) and an NNX teacher updated in
    place, each changed after every step: the gradients are jax.value_and_grad's on the global batch at
    every step (the first version compiled loss_fn once with the values of its first call: 0.49 and 0.64
    apart at steps 2 and 3, silently; two changes: what the retrace read is watched in turn), and each
    grad_fn warns once that it compiles again."""
    for row in mpi.each_rank(pmap_world if strategy == "pmap" else two_ranks, f"captured/{strategy}")[1]:
        assert max(row["gaps"]) <= 1e-12 and len(row["gaps"]) == 3, row
        assert row["warnings"] == 2 and row["names"] == ["'GENERATOR'", "'teacher'"], row
