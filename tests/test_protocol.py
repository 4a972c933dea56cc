"""portddp/protocol.py alone: the cross-rank checks both frontends share, fed the lists an
allgather would return. What users rely on in each message: the culprit rank, the names and
values involved, and the fix. (tests/test_*_misuse.py and test_*_ddp.py check that real
mpirun jobs reach these errors on every rank.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

from portddp.protocol import (SHADOW, buffer_layout, buffer_sync_header, check_buffer_sync_header, check_rebuild_order,
                              check_same_buffers, check_same_config,
                              check_same_frozen, check_same_hook, check_same_specs, check_same_step, ddp_number,
                              nonfinite_error, step_slot, unused_parameters_error)

CONFIG = {"bucket_cap_mb": 25.0, "first_bucket_cap_mb": 1.0, "transport": "mpi", "check_finite": False}


# ---- check_same_config

def test_same_config_passes():
    check_same_config([CONFIG, dict(CONFIG), dict(CONFIG)])
    check_same_config([CONFIG])  # a world of one


def test_config_difference_names_key_both_values_and_rank():
    with pytest.raises(ValueError) as e:
        check_same_config([CONFIG, CONFIG, CONFIG | {"bucket_cap_mb": "auto"}])
    msg = str(e.value)
    assert "bucket_cap_mb is 25.0 on rank 0 but 'auto' on rank 2" in msg
    assert "every rank must pass the same bucket_cap_mb" in msg


def test_config_names_the_first_differing_rank():
    with pytest.raises(ValueError, match="'mpi' on rank 0 but 'c10d' on rank 1"):
        check_same_config([CONFIG, CONFIG | {"transport": "c10d"}, CONFIG | {"check_finite": True}])


def test_config_key_missing_on_another_rank():
    theirs = {k: v for k, v in CONFIG.items() if k != "check_finite"}
    with pytest.raises(ValueError, match="check_finite is False on rank 0 but None on rank 1"):
        check_same_config([CONFIG, theirs])


def test_config_key_only_another_rank_has_is_a_difference():
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        check_same_config([CONFIG, CONFIG | {"gradient_as_bucket_view": True}])


def test_framework_only_arguments_are_compared_among_the_ranks_of_that_framework():
    torch_args = {"torch": {"broadcast_buffers/forward_sync_buffers": True}}
    check_same_config([CONFIG | torch_args, CONFIG, CONFIG | torch_args])  # rank 1 is a JAX rank
    with pytest.raises(ValueError, match="broadcast_buffers/forward_sync_buffers is True on rank 0 but False on rank 2"):
        check_same_config([CONFIG | torch_args, CONFIG, CONFIG | {"torch": {"broadcast_buffers/forward_sync_buffers": False}}])
    jax_args = {"jax": {"broadcast_buffers": True}}
    check_same_config([CONFIG | torch_args, CONFIG | jax_args])  # a mixed job: nothing framework-only in common
    with pytest.raises(ValueError, match="broadcast_buffers is True on rank 0 but False on rank 1"):
        check_same_config([CONFIG | jax_args, CONFIG | {"jax": {"broadcast_buffers": False}}])


# ---- check_same_specs

SPECS = [("0.weight", (4, 3), "float32"), ("0.bias", (4,), "float32"), ("1.weight", (2, 4), "float32")]


def test_same_specs_pass():
    check_same_specs([SPECS, list(SPECS)], "model mismatch across ranks", "parameter", "trainable parameters")


def test_spec_difference_names_the_entry_both_specs_and_rank():
    theirs = [SPECS[0], ("0.bias", (5,), "float32"), SPECS[2]]
    with pytest.raises(ValueError) as e:
        check_same_specs([SPECS, SPECS, theirs], "model mismatch across ranks", "parameter", "trainable parameters")
    assert str(e.value) == ("model mismatch across ranks: parameter #1 is '0.bias' (4,) float32 on rank 0 but "
                            "'0.bias' (5,) float32 on rank 2; every rank must build the same model before wrapping it")


def test_spec_dtype_difference():
    theirs = [SPECS[0], SPECS[1], ("1.weight", (2, 4), "float64")]
    with pytest.raises(ValueError, match=r"#2 is '1\.weight' \(2, 4\) float32 on rank 0 but '1\.weight' \(2, 4\) "
                                         r"float64 on rank 1; every rank must build the same model before wrapping it "
                                         r"\(64 bits on one rank, 32 on the other: JAX's jax_enable_x64"):
        check_same_specs([SPECS, theirs], "model mismatch across ranks", "parameter", "parameters")
    theirs = [SPECS[0], SPECS[1], ("1.weight", (2, 4), "float16")]  # (no 64/32 pair: no hint)
    with pytest.raises(ValueError, match=r"float16 on rank 1; every rank must build the same model before wrapping "
                                         r"it$"):
        check_same_specs([SPECS, theirs], "model mismatch across ranks", "parameter", "parameters")


def test_an_exception_whose_str_fails_is_still_named_for_the_other_ranks():
    """(An audit: the other ranks reported such a rank as gone, as if killed -- the report itself raised.)"""
    from portddp.watchdog import _is_c10d_timeout, _summary  # noqa: PLC0415

    class Weird(Exception):
        def __str__(self):
            raise ValueError("no text")

    assert _summary(Weird, Weird()) == "Weird: <str() of the exception failed: ValueError>"
    assert not _is_c10d_timeout(Weird())


def test_jax_key_paths_are_shown_as_they_are():
    ours = [("['enc']['w']", (3,), "float32")]
    theirs = [("['dec']['w']", (3,), "float32")]
    with pytest.raises(ValueError, match=re.escape("leaves: ['enc']['w'] only on rank 0, ['dec']['w'] only on rank 1")):
        check_same_specs([ours, theirs], "parameter pytrees differ across ranks", "leaf", "leaves")


def test_an_extra_leaf_on_one_rank_is_named_not_paired_by_position():
    """(An audit: an extra Param on rank 1 read "leaf #0 is ['l']['bias'] on rank 0 but ['extra'] on rank 1".)"""
    ours = [("['l']['bias'].value", (2,), "float32"), ("['l']['kernel'].value", (4, 2), "float32")]
    theirs = [("['extra'].value", (2,), "float32"), *ours]
    for everyone, where in (([ours, theirs], "none only on rank 0, ['extra'].value only on rank 1"),
                            ([theirs, ours], "['extra'].value only on rank 0, none only on rank 1")):
        with pytest.raises(ValueError, match=re.escape("parameter pytrees differ across ranks: rank 0 and rank 1 have "
                                                       f"different leaves: {where}. Every rank must build the same")):
            check_same_specs(everyone, "parameter pytrees differ across ranks", "leaf", "leaves")


@pytest.mark.parametrize("short_rank", [0, 1])
def test_spec_count_difference_names_the_first_extra_entry(short_rank):
    everyone = [SPECS, SPECS[:2]] if short_rank == 1 else [SPECS[:2], SPECS]
    with pytest.raises(ValueError) as e:
        check_same_specs(everyone, "model buffers differ across ranks", "buffer", "buffers")
    n0, n1 = len(everyone[0]), len(everyone[1])
    assert str(e.value).startswith(f"model buffers differ across ranks: rank 0 has {n0} buffers, rank 1 has {n1}; "
                                   f"the first one only rank {1 - short_rank} has is '1.weight'.")
    assert "Every rank must build the same model before wrapping it" in str(e.value)


def test_a_differing_entry_is_reported_before_a_differing_count():
    theirs = [("other", (4, 3), "float32")]
    with pytest.raises(ValueError, match="'0.weight', '0.bias', '1.weight' only on rank 0, 'other' only on rank 1"):
        check_same_specs([SPECS, theirs], "model mismatch", "parameter", "parameters")


# ---- unused_parameters_error

def test_unused_parameters_error_names_parameters_ranks_and_the_fix():
    err = unused_parameters_error(names=["a", "b", "c"], counts=[2, 1, 0], world=2, rank=1, seen=[1, 0, 0])
    assert isinstance(err, RuntimeError)
    msg = str(err)
    assert "'b' (on 1 of 2 ranks), 'c' (on 2 of 2 ranks)" in msg
    assert "'a'" not in msg  # every rank produced it
    assert "on this rank (1): ['b', 'c']" in msg
    assert "find_unused_parameters=True" in msg and "requires_grad=False" in msg


def test_unused_parameters_error_on_a_rank_that_saw_them_all():
    msg = str(unused_parameters_error(["a", "b"], counts=[1, 2], world=2, rank=0, seen=[1, 1]))
    assert "'a' (on 1 of 2 ranks)" in msg
    assert "on this rank (0): none." in msg


def test_unused_parameters_error_shows_ten_and_counts_the_rest():
    names = [f"p{i}" for i in range(13)]
    msg = str(unused_parameters_error(names, counts=[0] * 13, world=4, rank=0, seen=[0] * 13))
    assert "'p9' (on 4 of 4 ranks) (+3 more)" in msg
    assert "'p10' (on" not in msg


def test_unused_parameters_error_shows_jax_key_paths_unquoted():
    msg = str(unused_parameters_error(["['dec']['b']"], counts=[0], world=2, rank=0, seen=[0]))
    assert "['dec']['b'] (on 2 of 2 ranks)" in msg


# ---- nonfinite_error

def test_nonfinite_error_names_each_rank_and_its_parameters():
    err = nonfinite_error([[], ["0.weight", "1.weight"], [], ["2.bias"]], rank=0)
    assert isinstance(err, FloatingPointError)
    msg = str(err)
    assert "-- rank 1: '0.weight', '1.weight'; rank 3: '2.bias' (this is rank 0)" in msg
    assert "rank 0:" not in msg and "rank 2:" not in msg  # ranks with finite gradients
    assert ".grad was left as it was" in msg
    assert "lower the learning rate, or skip the step" in msg


def test_nonfinite_error_shows_five_names_per_rank():
    msg = str(nonfinite_error([[f"p{i}" for i in range(7)]], rank=0))
    assert "rank 0: 'p0', 'p1', 'p2', 'p3', 'p4' ... (this is rank 0)" in msg
    assert "'p5'" not in msg


# ---- check_same_step

@pytest.fixture
def step_check_on(monkeypatch):
    monkeypatch.delenv("PORTDDP_CHECK_STEPS", raising=False)


def slots(*steps):
    """The values the ranks exchange: step_slot(step) for a training rank, SHADOW for None."""
    return [SHADOW if n is None else step_slot(n) for n in steps]


def test_same_steps_pass(step_check_on):
    check_same_step(slots(7, 7, 7), rank=0)
    check_same_step(slots(4), rank=0)
    check_same_step(slots(0, 0), rank=0)  # every rank reduces before any step (JAX: reduce() of own gradients)


def test_join_shadows_are_not_compared(step_check_on):
    check_same_step(slots(None, 5, 5), rank=1)
    check_same_step(slots(None, None), rank=0)
    check_same_step(slots(5, None), rank=0)


def test_different_steps_name_each_rank_and_the_fixes(step_check_on):
    with pytest.raises(RuntimeError) as e:
        check_same_step(slots(3, None, 2), rank=2)
    msg = str(e.value)
    assert "(rank 0 at step 3, rank 2 at step 2; this is rank 2;" in msg
    assert "rank 1" not in msg  # the joined rank
    assert "no_sync()" in msg and "join()" in msg and "ddp.uneven()" in msg
    assert "PORTDDP_CHECK_STEPS=0" in msg
    assert "before running any step" not in msg


def test_ranks_that_reduce_different_ddps_are_named_whatever_their_steps(monkeypatch):
    """A GAN whose discriminator's backward runs first on rank 0 and the generator's first on rank 1:
    each rank's slot carries its DDP's number (the order the process built it in), at the same step."""
    monkeypatch.setenv("PORTDDP_CHECK_STEPS", "0")  # (the DDP check stays on)
    check_same_step([step_slot(4, ddp_number(2)), step_slot(4, ddp_number(2))], rank=0)
    with pytest.raises(RuntimeError, match=r"the ranks reduced different DistributedDataParallels here \(rank 0 its "
                                           r"DistributedDataParallel #1, rank 1 its DistributedDataParallel #2, .*"
                                           r"this is rank 1\).*in the same order"):
        check_same_step([step_slot(4, ddp_number(1)), step_slot(4, ddp_number(2))], rank=1)
    check_same_step([step_slot(4, ddp_number(17)), SHADOW, step_slot(4, ddp_number(2))], rank=0)  # 17 -> #2
    check_same_step([step_slot(4, ddp_number(1)), step_slot(4, ddp_number(0))], rank=0)  # a subgroup's: not compared
    # exact as float32 (the c10d tail): the largest slot is below 2**24
    assert step_slot(2**20 - 2, ddp_number(15)) < 2**24
    assert step_slot(10**9, ddp_number(3)) == step_slot(10**9 % (2**20 - 1), ddp_number(3))


def test_every_ddp_number_survives_the_float32_tail_of_a_c10d_bucket():
    """The used counts and step slots ride in the tail of c10d's last float32 bucket: each of the 15
    DDP numbers comes back from it whole (a leftover modulo 2**23 there turned #8 into 'not compared'
    and #9-#15 into #1-#7, so crossed DDPs #8 and #9 went unnoticed)."""
    import torch  # noqa: PLC0415

    from portddp.torch.ddp import _put_counts  # noqa: PLC0415

    for built in range(1, 16):
        for step in (0, 7, 2**20 - 2, 10**7):
            tail = torch.zeros(3, dtype=torch.float32)
            _put_counts(tail, b"", 1, 1, step_slot(step, ddp_number(built)))
            assert int(tail[2]) == step_slot(step, ddp_number(built))
    with pytest.raises(RuntimeError, match=r"rank 0 its DistributedDataParallel #9, rank 1 its "
                                           r"DistributedDataParallel #8"):
        check_same_step([float(step_slot(3, ddp_number(9))), float(step_slot(3, ddp_number(8)))], rank=0)


def test_a_rank_that_never_stepped_is_compared_and_named(step_check_on):
    """Step 0 is a count like any other (a join() shadow has a slot of its own): a rank reducing
    before any step beside one that stepped is refused, naming it."""
    with pytest.raises(RuntimeError) as e:
        check_same_step(slots(2, 0, None), rank=0)
    msg = str(e.value)
    assert "(rank 0 at step 2, rank 1 at step 0; this is rank 0;" in msg
    assert "Rank(s) 1 reduced before running any step" in msg


def test_check_steps_zero_turns_the_check_off(monkeypatch):
    monkeypatch.setenv("PORTDDP_CHECK_STEPS", "0")
    check_same_step(slots(3, 2), rank=0)
    monkeypatch.setenv("PORTDDP_CHECK_STEPS", "1")
    with pytest.raises(RuntimeError, match="different steps"):
        check_same_step(slots(3, 2), rank=0)


# ---- check_same_frozen

def test_frozen_lists_compared_only_when_a_pytorch_rank_sends_them():
    """A JAX rank sends [specs, fingerprint]; a PyTorch rank about to broadcast its frozen
    parameters adds their list: compared as an empty list on the JAX rank (mixed jobs)."""
    check_same_frozen([[[], None], [[], "digest"]])  # nobody sent frozen parameters
    check_same_frozen([[[], None, []], [[], "digest"]])  # a PyTorch rank with none, a JAX rank
    check_same_frozen([[[], None, [("w", (2,), "float32")]], [[], None, [("w", (2,), "float32")]]])
    with pytest.raises(ValueError, match=r"rank 0 has 1 frozen \(requires_grad=False\) parameters, rank 1 has 0"):
        check_same_frozen([[[], None, [("w", (2,), "float32")]], [[], "digest"]])


# ---- check_same_hook

def test_same_hooks_pass():
    check_same_hook([("fp16_compress_hook", {}), ("fp16_compress_hook", {})], rank=0)
    check_same_hook([None, None], rank=1)


def test_different_hooks_name_every_rank_and_the_fix():
    with pytest.raises(RuntimeError) as e:
        check_same_hook([("fp16_compress_hook", {}), None, ("fp16_compress_hook", {})], rank=1)
    msg = str(e.value)
    assert "comm hooks differ across ranks (rank 0: fp16_compress_hook, rank 1: none, rank 2: fp16_compress_hook; " \
           "this is rank 1)" in msg
    assert "register_comm_hook with the same hook before the first backward" in msg


def test_a_powersgd_state_that_differs_across_ranks_is_named_setting_by_setting():
    """The same hook, other settings (or another random_seed): Gloo aborted on the shapes, MPI hung,
    or -- another seed alone -- the ranks summed other random projections, silently."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState  # noqa: PLC0415

    from portddp.common import hook_settings  # noqa: PLC0415
    from portddp.jax.hooks import PowerSGDState as JaxPowerSGDState  # noqa: PLC0415

    def entry(**kw):
        return "powerSGD_hook", hook_settings(PowerSGDState(process_group=None, **kw))

    check_same_hook([entry(matrix_approximation_rank=2), entry(matrix_approximation_rank=2)], rank=0)
    with pytest.raises(RuntimeError, match=r"comm hook powerSGD_hook's state differs across ranks: "
                                           r"matrix_approximation_rank is 1 on rank 0 but 2 on rank 1 \(this is rank 0\)"):
        check_same_hook([entry(matrix_approximation_rank=1), entry(matrix_approximation_rank=2)], rank=0)
    with pytest.raises(RuntimeError, match=r"rng \(random_seed, draws so far\) is \w+@624 on rank 0 but \w+@624 on "
                                           r"rank 2"):
        check_same_hook([entry(), entry(), entry(random_seed=7)], rank=1)
    # PyTorch's and portddp.jax's PowerSGD in one job compare the settings they share
    jax_side = "powerSGD_hook", hook_settings(JaxPowerSGDState(start_powerSGD_iter=1_000))
    check_same_hook([entry(start_powerSGD_iter=1_000), jax_side], rank=0)
    # other states are not compared (a rank may keep its own number there)
    check_same_hook([("my_hook", hook_settings({"rank": 0})), ("my_hook", hook_settings({"rank": 1}))], rank=0)


# ---- buffer sync header

def test_buffer_sync_header_is_four_ints():
    header = buffer_sync_header(np.int64(4), True, 9, np.int64(-7))
    assert header == [4, 1, 9, -7] and all(type(x) is int for x in header)
    assert buffer_sync_header(0, False, 0) == [0, 0, 0, 0]


def test_matching_headers_pass_whatever_their_container():
    check_buffer_sync_header([3, 1, 5, 0], [3, 1, 5, 0], src=0, rank=1)
    # what a Bcast delivers: an int64 array
    check_buffer_sync_header(np.array([3, 1, 5, 0], dtype=np.int64), buffer_sync_header(3, True, 5), src=0, rank=1)


def test_buffer_layout_is_a_stable_int64_digest_of_shapes_and_dtypes():
    layout = buffer_layout([((4, 4), "float32"), ((), "int64")])
    assert layout == buffer_layout([((4, 4), "float32"), ((), "int64")]) and -2**63 <= layout < 2**63
    assert layout != buffer_layout([((6, 6), "float32"), ((), "int64")])
    assert layout != buffer_layout([((4, 4), "float64"), ((), "int64")])
    assert layout != buffer_layout([((), "int64"), ((4, 4), "float32")])
    # the same in another process (a digest, not Python's per-process string hash)
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = "from portddp.protocol import buffer_layout; print(buffer_layout([((4, 4), 'float32'), ((), 'int64')]))"
    assert int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) == layout


def test_buffers_of_another_layout_are_named_with_the_fix():
    theirs = buffer_sync_header(3, True, 5, buffer_layout([((4, 4), "float32")]))
    mine = buffer_sync_header(3, True, 5, buffer_layout([((6, 6), "float32")]))
    with pytest.raises(RuntimeError, match=r"the buffers rank 0 broadcast differ in shape or dtype from this rank's "
                                           r"\(1\).*pass broadcast_buffers=False"):
        check_buffer_sync_header(np.array(theirs, dtype=np.int64), mine, src=0, rank=1)


def test_mismatched_header_describes_both_forwards_and_the_fix():
    theirs = np.array(buffer_sync_header(3, False, 7), dtype=np.int64)  # rank 0 evaluated alone
    mine = buffer_sync_header(3, True, 6)
    with pytest.raises(RuntimeError) as e:
        check_buffer_sync_header(theirs, mine, src=0, rank=1)
    msg = str(e.value)
    assert ("rank 0 broadcast its buffers in buffer sync #8, for a forward without gradient sync "
            "(no_grad/eval/no_sync) after 3 synchronised iterations, but this rank (1) is in buffer sync #7, for a "
            "forward that synchronises gradients after 3 synchronised iterations") in msg
    assert "np.int64" not in msg
    assert "ddp.module(...)" in msg and "`if rank == 0: ddp(val_batch)`" in msg


def test_rebuild_order_is_checked_as_received():
    """The plan rebuild's broadcast of rank 0's gradient order: what else arrives (another
    collective of rank 0's met it) is named, not handed to the planner."""
    assert check_rebuild_order([2, 0, 1, -1], 4, 1) == [2, 0, 1]
    for bad in ([4575657222473777152, 0, 1, 2], [0, 0, 1, 2], [0, 1, 2]):
        with pytest.raises(RuntimeError, match=r"rebuild on rank 1 received something other than rank 0's gradient "
                                               r"order .*rank-0-only evaluation.* ddp\.module"):
            check_rebuild_order(bad, 4, 1)


def test_buffers_are_compared_where_every_rank_sent_them():
    same = [["p"], None, None, [("bn.running_mean", (4,), "float32")]]
    check_same_buffers([same, same])
    check_same_buffers([same, [["p"], None, None]])  # a JAX rank of a mixed job sends none: not compared
    other = [["p"], None, None, [("bn.running_mean", (4,), "float64")]]
    with pytest.raises(ValueError, match=r"the buffers rank 0 broadcasts\): buffer #0 is 'bn\.running_mean' \(4,\) "
                                         r"float32 on rank 0 but 'bn\.running_mean' \(4,\) float64 on rank 1"):
        check_same_buffers([same, other])
