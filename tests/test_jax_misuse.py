"""Misuses of portddp.jax that gave wrong results with exit 0 or raw errors (issue 17): each one
now fails on every rank naming the culprit and the fix, or gives correct results where legal.
Two jobs of 2 ranks: every in-process case in one (tests/workers/jax_misuse.py), and a comm hook
raising on one rank (which ends the job)."""

from __future__ import annotations

import glob
import re

import pytest

from tests import mpi

VMAP = r"cannot run under jax\.vmap: .* Call grad_fn once per step on this rank's whole batch"
TRACED = (r"strategy='compiled' runs its own program .* cannot be traced into your {} over this process's arrays: "
          r"call grad_fn outside any transformation .* or use strategy='hooked'")
STEPS = (r"RuntimeError: ranks reached this gradient reduction at different steps \(rank 0 at step {}, rank 1 at "
         r"step {}; this is rank \d;.*sync=False on some ranks only")
CASES = {
    "hooked_under_scan": r"OK max_rel=",
    "accumulate_inside_jit": r"OK steps=3$",
    "hooked_vmap": r"ValueError: portddp\.jax grad_fn \(strategy='hooked'\) " + VMAP,
    "hooked_vmap_of_jit": r"ValueError: portddp\.jax grad_fn \(strategy='hooked'\) " + VMAP,
    "compiled_vmap": "ValueError: " + TRACED.format(r"jax\.vmap"),
    "compiled_scan": "ValueError: " + TRACED.format(r"jax\.jit \(or lax\.scan, nnx\.jit: any trace\)"),
    "other_shapes_hooked": r"ValueError: leaf \['dec'\]\['w'\] is \(4, 3\) float32 here, but DistributedDataParallel "
                           r"was built for \(4, 2\) float32: .*build a new DistributedDataParallel",
    "other_shapes_compiled": r"ValueError: leaf \['dec'\]\['w'\] is \(4, 3\) float32 here, but .* \(4, 2\) float32",
    "other_dtype_hooked": r"ValueError: leaf \['dec'\]\['w'\] is \(4, 2\) bfloat16 here, but .* \(4, 2\) float32",
    "reduce_inside_jit": r"ValueError: ddp\.reduce\(\) cannot run inside jax\.jit .* Call it outside jit .* with "
                         r"sync=True \(the default\) whose loss_fn covers every micro-batch",
    "per_rank_init_hooked": r"ValueError: parameter values differ across ranks at the first synchronised step "
                            r"\(rank 1 vs rank 0; this is rank \d\): .* call params = ddp\.broadcast\(params\)",
    "per_rank_init_compiled": r"ValueError: parameter values differ across ranks at the first synchronised step",
    **{f"one_element_apart_{kind}": r"ValueError: parameter values differ across ranks at the first synchronised "
       r"step \(rank 1 vs rank 0" for kind in ("hooked", "compiled")},
    **{f"per_rank_init_reduce_{kind}": r"ValueError: parameter values differ across ranks at the first synchronised "
       r"step \(rank 1 vs rank 0; this is rank \d\): .* call params = ddp\.broadcast\(params\)"
       for kind in ("hooked", "compiled")},
    **{f"abstract_init_{kind}": r"ValueError: parameter values differ across ranks at the first synchronised step "
       r"\(rank 1 vs rank 0; this is rank \d\): .* call params = ddp\.broadcast\(params\)" for kind in ("hooked", "compiled")},
    "abstract_init_equal_hooked": r"OK loss=",
    **{f"buffer_shape_drifts{same}_compiled": r"ValueError: model buffers \(non-Param state, e\.g\. BatchStat\) differ "
       rf"across ranks: buffer #0 is \['last'\]\.value {a} float32 on rank 0 but \['last'\]\.value {b} float32 on rank 1"
       for same, a, b in (("", r"\(3, 2\)", r"\(4, 2\)"), ("_same_bytes", r"\(3, 4\)", r"\(4, 3\)"))},
    "grad_fn_built_every_step_compiled": r"OK grad_fns=1 programs=1 warned=0$",
    "grad_fn_new_every_step_hooked": r"OK grad_fns=1 programs=4 warned=2$",
    "per_rank_init_jitted": r"OK warned: the parameters' values differed across ranks when DistributedDataParallel "
                            r"was built \(rank 1 vs rank 0\) and broadcast\(\) was not called",
    "broadcast_then_step": r"OK loss=",
    "crossed_unused_leaves_compiled": r"OK max_rel=0\.0e\+00$",
    "wrt_on_one_rank": r"ValueError: DistributedDataParallel arguments differ across ranks: wrt is "
                       r"'flax\.nnx\.nn\.lora\.LoRAParam' on rank 0 but 'None \(nnx\.Param\)' on rank 1",
    **{f"numpy_float64_params_{kind}": r"OK max_rel=(0\.0e\+00|\d\.\de-(0[6-9]|[1-9]\d)) dtypes=\['float32'\]$"
       for kind in ("hooked", "compiled")},
    **{f"local_step_on_one_rank_{kind}": STEPS.format(*steps) for kind, steps in
       (("hooked", (3, 2)), ("compiled", (3, 2)), ("compiled_reduce", (3, 2)))},
    "step_here_reduce_there_compiled": STEPS.format(2, 1),
    "same_local_steps_compiled": r"OK steps=2 max_abs=",
    "steps_in_one_jit": r"OK max_rel=",
    "two_ddps_in_one_jit": r"OK max_rel=",
    "uneven_steps_in_one_jit": r"OK max_rel=",
    "rngs_as_third_argument": r"TypeError: grad_fn's third argument is sync \(True or False, a Python bool\), not "
                              r"Rngs: give several inputs as one batch pytree",
    "extra_positional_input": r"TypeError: grad_fn's third argument is sync \(True or False, a Python bool\), not "
                              r"ArrayImpl shaped \(3, 1\): give several inputs as one batch pytree -- "
                              r"grad_fn\(params, \(x, y\)\)",
    "held_gradients_lent": r"OK held=4 zero_copy=True$",
    "dropped_ddp_is_freed": r"OK freed=3 shm_back=True$",
    "program_outlives_its_ddp": r"RuntimeError: the portddp\.jax DistributedDataParallel this compiled program was "
                                r"traced with has been garbage-collected: keep it \(or its grad_fn\) alive",
    "buffers_differ_compiled": r"ValueError: model buffers \(non-Param state, e\.g\. BatchStat\) differ across ranks: "
                               r"buffer #0 is \['stat'\]\.value \(3,\) float32 on rank 0 but \['stat'\]\.value \(4,\)",
    **{f"buffers_on_one_rank_{kind}": r"ValueError: model buffers \(non-Param state, e\.g\. BatchStat\) differ across "
       r"ranks: rank 0 has 1 buffers, rank 1 has 0; the first one only rank 0 has is \['stat'\]\.value"
       for kind in ("hooked", "compiled")},
    "eager_here_jitted_there": r"OK same_plan=True max_rel_ok=True$",
    "eager_then_jitted_on_one_rank": r"OK same_plan=True max_rel_ok=True$",
    "jitted_local_steps_on_one_rank": r"OK same_plan=True max_rel_ok=True$",
    "differentiate_grad_fn": r"ValueError: portddp\.jax grad_fn \(strategy='hooked'\) cannot be differentiated "
                             r"\(a gradient of its gradients: MAML.*Put the inner derivative inside loss_fn",
    "differentiate_grad_fn_compiled": r"ValueError: portddp\.jax grad_fn \(strategy='compiled'\) cannot be "
                                      r"differentiated .*Put the inner derivative inside loss_fn",
    "pmap_under_mpirun": r"ValueError: strategy='pmap' maps over this process's devices only, but mpirun started 2 "
                         r"processes: each would .* train alone\. Use strategy='hooked' or 'compiled'",
    **{f"reduce_before_any_step_{kind}": STEPS.format(1, 0) + r".* Rank\(s\) 1 reduced before running any step "
       r"\(JAX: ddp\.reduce\(\) before any grad_fn call" for kind in ("hooked", "compiled")},
    "model_grew": r"ValueError: pytree differs from the one DistributedDataParallel was built with: 2 leaves it was "
                  r"not built with: \['l3'\]\['bias'\].*, \['l3'\]\['kernel'\].*\. The bucket plan .* build a new one",
    "other_containers": r"ValueError: pytree structure differs .* same paths .*: got PyTreeDef\(\(\*, \*\)\), expected "
                        r"PyTreeDef\(\[\*, \*\]\)\. The bucket plan",
    "reduce_after_a_failed_reduce": r"OK recovered$",
    "hook_not_a_handle": r"TypeError: comm hook .*not_a_handle returned ndarray for bucket 0; a hook must return a "
                         r"portddp\.transport\.Handle",
    "hook_one_element": r"RuntimeError: comm hook .*one_element's handle for bucket 0 resolved to a \(1,\) float32 "
                        r"array, but the bucket holds \d+ float32 gradients: return the whole reduced bucket",
    "hook_half_bucket": r"RuntimeError: comm hook .*half_bucket's handle for bucket 0 resolved to a \(\d+,\) float32 "
                        r"array, but the bucket holds \d+ float32 gradients",
    "hook_compiled": r"ValueError: register_comm_hook needs strategy='hooked': the 'compiled' strategy's buckets are "
                     r"psums inside one XLA program, which calls no Python hook",
}


@pytest.fixture(scope="module")
def outcomes():
    proc = mpi.run(2, "tests.workers.jax_misuse", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(name, int(rank)): outcome for name, rank, outcome in re.findall(r"CASE (\S+) rank=(\d) (.*)", proc.stdout)}


@pytest.mark.parametrize("case", list(CASES))
def test_misuse_is_named_on_every_rank(outcomes, case):
    for rank in range(2):
        assert re.search(CASES[case], outcomes.get((case, rank), "(missing)")), (rank, outcomes.get((case, rank)))


def test_a_raising_comm_hook_is_named_on_its_rank_and_stops_the_others():
    """Rank 1's hook raises ValueError: rank 1 raises portddp's error naming the hook, the bucket and
    the original error (not XLA's "CpuCallback error"); rank 0's watchdog stops it, naming rank 1;
    the job ends (rank 1 used to hang in MPI_Finalize now and then) leaving no /dev/shm file."""
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    proc = mpi.run(2, "tests.workers.jax_misuse", "hook_raises", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    # neither rank reached MPI_Finalize: portddp removed MPICH's shared-memory file on the way out
    assert not set(glob.glob("/dev/shm/mpich_shm_*")) - before
    assert re.search(r"RuntimeError: comm hook .*flaky_hook raised ValueError for bucket \d+ on rank 1: boom in the "
                     r"hook", out), out[-3000:]
    assert re.search(r"portddp: rank 1 .* failed with RuntimeError: comm hook .*flaky_hook raised ValueError", out), \
        out[-3000:]
    assert "CpuCallback error" not in out, out[-3000:]


def test_synchronised_steps_in_two_traces_are_refused_not_mixed():
    """One synchronised grad_fn inside lax.scan and one after it, in one jit (or an inner jit called
    twice): nothing can order the two, and the second iteration used to open over the first --
    silently wrong gradients. The rank that sees the overlap raises naming it and the fix; the
    others stop (the same error, or the watchdog naming that rank)."""
    proc = mpi.run(2, "tests.workers.jax_misuse", "overlap", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert re.search(r"RuntimeError: a synchronised grad_fn step of portddp\.jax \(strategy='hooked'\) began on rank "
                     r"\d while this DistributedDataParallel's step \(iteration \d+\) was still reducing its "
                     r"gradients\. .*call every synchronised grad_fn of a program in the same trace", out), out[-3000:]


def test_a_jitted_step_that_failed_on_one_rank_and_was_caught_stops_both_not_shifts_them():
    """Rank 1's jitted step fails in the user's own data check (a callback on the batch) and the
    script goes on: no step's gradient is ever averaged with another step's (it was, silently, from
    then on: the check ran before the iteration opened, so the failed step went uncounted); every
    rank raises the step mismatch."""
    proc = mpi.run(2, "tests.workers.jax_misuse", "caught_failure", timeout=120)
    out = proc.stdout + proc.stderr
    got = re.findall(r"CASE caught_step_failure_(\d) rank=(\d) (.*)", proc.stdout)
    assert got, out[-3000:]
    for _, _, outcome in got:
        if outcome.startswith("OK"):
            grad, expected = re.fullmatch(r"OK grad=(\S+) expected=(\S+)", outcome).groups()
            assert grad == expected, (got, out[-3000:])
    for rank in "01":
        assert any(r == rank and "ranks reached this gradient reduction at different steps" in o
                   for _, r, o in got), (rank, got, out[-3000:])


def test_hooked_grad_fn_under_shard_map_or_pmap_over_several_devices_is_refused_on_every_rank():
    proc = mpi.run(2, "tests.workers.jax_misuse", "mapped", timeout=120,
                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = dict(((name, int(rank)), outcome) for name, rank, outcome in re.findall(r"CASE (\S+) rank=(\d) (.*)",
                                                                                   proc.stdout))
    for name, axes in (("shard_map", r"\{'d': 2\}"), ("pmap", r"\{'_internal_pmap_axis_name': 2\}")):
        for rank in range(2):
            assert re.search(r"ValueError: portddp\.jax grad_fn \(strategy='hooked'\) cannot run under jax\.pmap or "
                             rf"jax\.shard_map over several of this process's devices \(mapped axes here: {axes}\).*"
                             r"Run one rank per device", got.get((name, rank), "(missing)")), (name, rank, got)
    for rank in range(2):  # eagerly, on a batch laid over both devices: named, not XLA's RET_CHECK
        assert re.search(r"ValueError: batch leaf \(the batch\) is split over 2 devices of this process: "
                         r"strategy='hooked' runs one rank per device.*use strategy='compiled'",
                         got.get(("split_batch", rank), "(missing)")), got


def test_a_compiled_step_whose_peer_never_comes_is_named_in_portddps_words(tmp_path):
    """Rank 1 skips the first compiled step (its loss check raised, the script caught it and went on
    to a collective of its own): rank 0's program waits for it in XLA's key-value store and XLA gives
    up after 30 s naming neither a rank nor a cause ("Gloo context initialization failed:
    DEADLINE_EXCEEDED: GetKeyValue() timed out ..."; an audit); said in portddp's words, and the job
    stops (the watchdog tells rank 1)."""
    script = tmp_path / "skip.py"
    script.write_text(
        "import jax, jax.numpy as jnp, portddp\n"
        "from portddp.jax import DistributedDataParallel as DDP\n"
        "w = portddp.init(jax_distributed=True)\n"
        "params = {'w': jnp.ones((3,))}\n"
        "ddp = DDP(params, strategy='compiled')\n"
        "grad_fn = ddp.value_and_grad(lambda p, x: jnp.sum(p['w'] * x) if w.rank == 0 else p['w'] * x)\n"
        "try:\n"
        "    grad_fn(params, jnp.ones((4, 3)))\n"
        "except TypeError as e:\n"
        "    print('CAUGHT', w.rank, flush=True)\n"
        "    from portddp.launch import mpi_comm\n"
        "    mpi_comm().Barrier()\n")
    proc = mpi.run_script(2, script, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CAUGHT 1" in proc.stdout, out[-3000:]
    assert re.search(r"RuntimeError: portddp\.jax \(strategy='compiled', after 0 iteration\(s\)\): the other ranks did "
                     r"not reach this step's collectives within XLA's wait for them \(30 s\).*XLA said: ", out), out[-3000:]


def test_a_rank_that_caught_portddps_error_and_went_on_is_named_with_it_by_the_stall_inspector(tmp_path):
    """Rank 1's loss check raised, its script caught it and went elsewhere: the stall inspector named
    rank 1 as "computing" (an audit); it now also says what its last portddp call raised."""
    script = tmp_path / "caught.py"
    script.write_text(
        "import time, jax.numpy as jnp, portddp\n"
        "from portddp.jax import DistributedDataParallel as DDP\n"
        "w = portddp.init()\n"
        "params = {'w': jnp.ones((3,))}\n"
        "grad_fn = DDP(params).value_and_grad(lambda p, x: jnp.sum(p['w'] * x) if w.rank == 0 else p['w'] * x)\n"
        "try:\n"
        "    grad_fn(params, jnp.ones((4, 3)))\n"
        "except TypeError:\n"
        "    print('CAUGHT', w.rank, flush=True)\n"
        "    time.sleep(60)\n")
    proc = mpi.run_script(2, script, timeout=120, env={"PORTDDP_STALL_S": "5"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CAUGHT 1" in proc.stdout, out[-3000:]
    assert re.search(r"rank 1 is behind: rank 1's last collective is #\d+ '[^']*' and it has been computing for "
                     r"[\d.]+ s since \(its last portddp call raised TypeError: loss_fn must return a scalar; .* "
                     r"\d+ s ago, and the script went on\)", out), out[-3000:]
