"""portddp.torch misuse that native DDP leaves silent or hanging: every rank must stop within
seconds, naming the culprit and the fix (issue 17). Each case is one `mpirun -n 2` job of
tests/workers/torch_bad_input.py with a timeout, every rank's output and exit code checked."""

from __future__ import annotations

import re

import pytest

from tests import mpi

TRANSPORTS = ["c10d", "mpi"]


def named_by_rank_1_then_rank_0_stops(case: str, transport: str, pattern: str) -> None:
    """Rank 1, receiving rank 0's buffers, raises matching `pattern`; rank 0, in its next iteration,
    hears that rank 1 left: from its watchdog (exit 70), or at once when Gloo's connection to rank 1
    closes (the collective's error is raised naming rank 1)."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", case, transport, timeout=90)
    tail = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode != 0
    assert re.search(r"PORTDDP_ERROR rank=1 RuntimeError: " + pattern, proc.stdout), tail
    assert ("rank 0 exits now (code 70)" in proc.stderr or re.search(
        r"PORTDDP_ERROR rank=0 RuntimeError: rank 1 \(pid \d+ on .*\) left without an error", proc.stdout)), tail


def test_rank0_only_evaluation_through_the_wrapper_after_the_last_step_is_named():
    """`if rank == 0: ddp(val)` after the last step, on a model with buffers: rank 0's buffer broadcast has
    no partner (native c10d: 'Connection closed by peer' or a hang). Between steps it is legal, as native
    (tests/test_dropin.py, rank0_eval); with MPI a broadcast's root does not wait for its receivers."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", "rank0_only_eval", "c10d", timeout=90)
    tail = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode != 0 and "PORTDDP_NO_ERROR rank=1" in proc.stdout, tail
    assert re.search(r"PORTDDP_ERROR rank=0 RuntimeError: rank 1 \(pid \d+ on .*\) left without an error .* while "
                     r"this rank waits in collective #\d+ 'iteration 5: buffer broadcast'.*forwards through the "
                     r"wrapper: evaluate on one rank through ddp\.module", proc.stdout), tail


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_buffer_of_another_shape_registered_after_wrapping_is_named(transport):
    """A mask registered in the first forward, sized by each rank's batch, on a model with buffers (so
    they are broadcast before every forward): native overwrites rank 1's mask with rank 0's bytes of
    another shape, silently (c10d), or dies in MPI; portddp names it on the receiving rank."""
    named_by_rank_1_then_rank_0_stops(
        "buffer_shape_after_wrap", transport, r"(the buffers rank 0 broadcast differ in shape or dtype from this "
        r"rank's \(1\)|the broadcast of rank 0's buffers failed on rank 1 .* this rank's buffers are 4: .*mask "
        r"\(6, 6\) float32).*pass broadcast_buffers=False")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_comm_hook_registered_on_some_ranks_only_is_named_on_every_rank(transport):
    proc = mpi.run(2, "tests.workers.torch_bad_input", "some_ranks_hook", transport, timeout=90)
    mpi.errors_on_every_rank(proc, 2, r"comm hooks differ across ranks \(rank 0: fp16_compress_hook, rank 1: none; "
                                      r"this is rank \d\): every rank must call register_comm_hook")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_step_local_on_some_ranks_only_is_named_at_the_next_reduction(transport):
    """Rank 0 runs one step under no_sync() alone: from then on its step k+1 would be averaged with
    the others' step k. The per-iteration collective carries every rank's step count. (A rank that
    skips a whole step cannot be told from one with fewer batches: it is named when it ends, by the
    watchdog -- tests/test_dropin.py's one_batch_fewer.)"""
    proc = mpi.run(2, "tests.workers.torch_bad_input", "no_sync_on_some_ranks", transport, timeout=90)
    mpi.errors_on_every_rank(proc, 2, r"ranks reached this gradient reduction at different steps \(rank 0 at step 3, "
                                      r"rank 1 at step 2; this is rank \d;.*join\(\).*PORTDDP_CHECK_STEPS=0")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stalled_rank_is_named_by_every_rank_within_seconds(transport):
    """Rank 1 computes for 30 s before its backward; with PORTDDP_STALL_S=3 every rank reports who
    is where (rank 0 waiting in iteration 2's collectives, rank 1 computing) and exits."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", "stalled_rank", transport, timeout=60,
                   env={"PORTDDP_STALL_S": "3"})
    assert proc.returncode != 0
    out = proc.stderr
    assert "PORTDDP_STALL_S" in out and re.search(r"rank 1\b", out), out[-3000:]
    assert re.search(r"iteration 2: (bucket \d|used-count)", out), out[-3000:]


def test_backward_with_create_graph_averages_the_gradient_and_warns():
    proc = mpi.run(2, "tests.workers.torch_bad_input", "create_graph", "mpi", timeout=90)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    grads = re.findall(r"CREATE_GRAPH rank=(\d) requires_grad=(\w+) grad=(\S+) mean=(\S+)", proc.stdout)
    assert len(grads) == 2, proc.stdout
    for _, requires_grad, grad, mean in grads:
        assert requires_grad == "True" and grad == mean, grads
    assert "higher-order gradients taken through it are not synchronised" in proc.stderr


@pytest.mark.parametrize("case", ["join_twice", "partial_hook_everywhere", "double_after_wrap"])
def test_legal_patterns_pass_the_new_checks(case):
    """Two join() epochs with uneven inputs (the step counts start again after each), a comm hook
    wrapped in functools.partial (compared by name, not by address), BatchNorm buffers still synced
    after `.double()` replaced them."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", case, "mpi", timeout=90)
    assert proc.returncode == 0 and proc.stdout.count("PORTDDP_NO_ERROR") == 2, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case, pattern", [
    ("buffer_dtype", r"model mismatch across ranks \(the buffers rank 0 broadcasts\): buffer #1 is '1\.running_var' "
                     r"\(4,\) float32 on rank 0 but '1\.running_var' \(4,\) float64 on rank 1"),
    ("buffer_count", r"model mismatch across ranks \(the buffers rank 0 broadcasts\): rank 0 and rank 1 have different "
                     r"buffers: none only on rank 0, 'extra' only on rank 1\. Every rank must build the same model"),
])
def test_buffers_that_differ_across_ranks_are_named_at_construction(transport, case, pattern):
    """A buffer of another dtype on one rank: Gloo's broadcast reinterpreted its bytes (silently
    wrong running stats; native DDP dies in Gloo), MPI failed raw; one buffer more: a hang."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", case, transport, timeout=90)
    mpi.errors_on_every_rank(proc, 2, pattern)


def test_a_parameter_unfrozen_after_wrapping_is_named():
    proc = mpi.run(2, "tests.workers.torch_bad_input", "unfrozen_after_wrap", "mpi", timeout=90)
    mpi.errors_on_every_rank(proc, 2, r"trainable parameters changed after DistributedDataParallel wrapped it: 3 "
                                      r"then, 4 now \(added: \['0.weight'\]")



@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_backward_through_a_synchronising_and_a_no_sync_forward_is_refused(transport):
    """`o1 = ddp(x)`, then `with ddp.no_sync(): o2 = ddp(x2)`, then one backward of both: the last
    forward decides (native's rule), so o1's gradients stayed local -- every rank trained on its own,
    silently (native too). Refused on every rank."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", "sync_then_no_sync_one_backward", transport, timeout=90)
    mpi.errors_on_every_rank(proc, 2, r"got its gradient in a backward pass through the output of a synchronising "
                                      r"forward, but a forward inside no_sync\(\) ran after it.*Run each forward's "
                                      r"backward before the next forward")


@pytest.mark.parametrize("change", ["fewer", "more"])
def test_a_static_graph_whose_layer_reuse_changes_is_refused_on_every_rank(change):
    """static_graph=True learns in the first iteration how many gradients each parameter gets (a
    layer reused under reentrant checkpointing: one per use). Used fewer times later, the layer's
    gradient was never reduced -- each rank kept its own, silently (native raises); used more
    times, the error said to set static_graph=True, which was set."""
    proc = mpi.run(2, "tests.workers.torch_bad_input", f"static_graph_depth_{change}", "mpi", timeout=90)
    counts = "1 gradient\\(s\\) in this backward pass but 2" if change == "fewer" else \
        "2 gradient\\(s\\) in this backward pass so far but 1"
    mpi.errors_on_every_rank(proc, 2, rf"parameter 'shared\.(weight|bias)' received {counts} in the first one, which "
                                      r"static_graph=True learned: the graph changed .*use_reentrant=False")


def test_distributed_autograd_is_refused_on_every_rank():
    """RPC training (dist_autograd.backward) puts gradients in its context, never in .grad: native's
    reducer reduces them there; portddp's hooks would never fire (no error, each rank stepped alone)."""
    import socket  # noqa: PLC0415

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    proc = mpi.run(None, "tests.workers.dist_autograd", *ports, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mpi.errors_on_every_rank(proc, 2, r"NotImplementedError: this forward runs inside a torch\.distributed\.autograd "
                                      r"context .* use torch\.nn\.parallel\.DistributedDataParallel for distributed "
                                      r"autograd")


_PREAMBLE = ("import time, torch, portddp\n"
             "from portddp.torch import DistributedDataParallel as DDP\n"
             "w = portddp.init()\n"
             "ddp = DDP(torch.nn.Linear(3, 1), transport='mpi')\n")
CAUGHT = {
    # rank 1 changed its model after wrapping: its forward raises
    "forward": ("if w.rank == 1:\n"
                "    ddp.module.extra = torch.nn.Parameter(torch.ones(2))\n"
                "try:\n"
                "    ddp(torch.ones(4, 3)).sum().backward()\n"
                "except RuntimeError:\n"
                "    print('CAUGHT', w.rank, flush=True)\n"
                "    time.sleep(60)\n", r"RuntimeError: .*"),
    # rank 1 runs a second backward through the first one's graph: portddp's gradient hook raises in it,
    # while rank 0 goes on to the next iteration's all-reduce
    "backward": ("loss = ddp(torch.ones(4, 3)).sum()\n"
                 "loss.backward(retain_graph=True)\n"
                 "if w.rank == 1:\n"
                 "    try:\n"
                 "        loss.backward()\n"
                 "    except RuntimeError:\n"
                 "        print('CAUGHT', w.rank, flush=True)\n"
                 "        time.sleep(60)\n"
                 "ddp(torch.ones(4, 3)).sum().backward()\n",
                 r"RuntimeError: gradient of '(weight|bias)' arrived outside a DDP iteration.*"),
}


@pytest.mark.parametrize("where", CAUGHT)
def test_a_rank_that_caught_portddps_error_is_named_with_it_by_the_stall_inspector(where, tmp_path):
    """As portddp.jax's grad_fn (tests/test_jax_misuse.py): rank 1's forward, or a gradient hook in its
    backward, raised; its script caught that and went elsewhere; the stall table says what it raised."""
    body, raised = CAUGHT[where]
    script = tmp_path / "caught.py"
    script.write_text(_PREAMBLE + body)
    proc = mpi.run_script(2, script, timeout=120, env={"PORTDDP_STALL_S": "5"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CAUGHT 1" in proc.stdout, out[-3000:]
    assert re.search(r"rank 1 is behind: .*has been computing for [\d.]+ s since \(its last portddp call raised "
                     + raised + r" \d+ s ago, and the script went on\)", out), out[-3000:]

