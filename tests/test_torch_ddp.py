"""portddp.torch against native DDP, a single process, numpy, and its own events.

The worker (tests/workers/torch_equivalence.py) runs every scenario under
`mpirun -n K`; each rank writes one JSON line per scenario, asserted here."""

from __future__ import annotations

import pytest

from tests import mpi

TRANSPORTS = ("c10d", "mpi")
VS_NATIVE = ("plain", "no_sync", "unused", "batchnorm", "grad_as_bucket_view")


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"n{n}")
def results(request, tmp_path_factory):
    n = request.param
    return n, mpi.collect(n, "tests.workers.torch_equivalence", tmp_path_factory.mktemp(f"torch_n{n}"))


each_rank = mpi.each_rank


def as_native(n: int, transport: str, row: dict) -> bool:
    """Bitwise where the sums are native's: at n <= 2 (a sum of two is order-free) and on c10d at
    any n (the same buckets, so the same Gloo all-reduces, whose ring adds each chunk in its own
    rank order); on MPI at n = 3 its own order: 2e-5."""
    return row["bitwise"] if n <= 2 or transport == "c10d" else row["max_diff"] <= 2e-5


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scenario", VS_NATIVE)
def test_equals_native_ddp(results, scenario, transport):
    """5 SGD-momentum steps (as_native)."""
    n, rows = each_rank(results, f"{scenario}/{transport}")
    for row in rows:
        assert as_native(n, transport, row), row
        # re-planned from the observed order, except with find_unused_parameters (native never does then)
        assert row["rebuilt"] == (scenario != "unused"), row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_float64_matches_one_process_on_the_global_batch(results, transport):
    _, rows = each_rank(results, f"float64_global_batch/{transport}")
    for row in rows:
        assert row["max_rel"] <= 1e-10, row


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook"])
def test_compression_hooks_match_numpy(results, hook, transport):
    """cast -> divide -> sum -> cast back, computed with numpy from every rank's local gradient.
    Exact for two addends; with three the ring may add in another order: one ulp of the half type."""
    n, rows = each_rank(results, f"hook_{hook}/{transport}")
    eps = {"fp16_compress_hook": 2.0**-10, "bf16_compress_hook": 2.0**-7}[hook]
    for row in rows:
        assert row["max_diff"] <= (0.0 if n <= 2 else eps * row["scale"]), row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_allreduce_and_noop_hooks(results, transport):
    n, rows = each_rank(results, f"hook_allreduce_hook/{transport}")
    assert all(r["max_diff"] <= (0.0 if n <= 2 else 1e-7) for r in rows), rows
    _, rows = each_rank(results, f"hook_noop_hook/{transport}")
    assert all(r["max_diff"] == 0.0 for r in rows), rows  # local gradients, untouched


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_buckets_overlap_backward_only_when_asked(results, transport):
    n, on = each_rank(results, f"overlap_True/{transport}")
    _, off = each_rank(results, f"overlap_False/{transport}")
    for row in on:
        assert row["buckets"] >= 2 and row["ordered"], row
        assert row["first_launch_before_backward_end"], row
    for row in off:
        assert not row["any_launch_before_backward_end"] and row["ordered"], row
        assert row["overlap_ratio"] == 0.0, row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_auto_bucket_cap_picks_one_cap_on_every_rank_and_changes_no_number(results, transport):
    n, rows = each_rank(results, f"auto_cap/{transport}")
    assert len({r["chosen"] for r in rows}) == 1, rows
    for row in rows:
        assert row["chosen"] in row["candidates"] and row["cap_in_use"] == row["chosen"], row
        assert row["plan_cap_mb"] == pytest.approx(row["chosen"], rel=1e-6), row
        assert as_native(n, transport, row), row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frozen_parameters_are_left_out_and_alone(results, transport):
    n, rows = each_rank(results, f"frozen/{transport}")
    for row in rows:
        assert "fc1.weight" not in row["planned"] and "fc1.bias" in row["planned"], row
        assert row["frozen_unchanged"], row
        assert as_native(n, transport, row), row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_parameter_resized_through_data_after_wrapping_is_replanned(results, transport):
    """`p.data = <another shape>` on every rank after two steps (native: an error at the next backward;
    portddp packed the gradient over its neighbours', silently): the buckets follow, one process's numbers."""
    for row in each_rank(results, f"resized/{transport}")[1]:
        assert row["shape"] == [32] and row["max_rel"] <= 1e-12, row
    for row in each_rank(results, f"resized_channels_last/{transport}")[1]:  # (channels_last: 445 apart before)
        assert row["max_diff"] <= 1e-12, row


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_non_contiguous_parameter_is_reduced_like_native_ddp(results, transport):
    n, rows = each_rank(results, f"noncontiguous/{transport}")
    for row in rows:
        assert as_native(n, transport, row), row


# --------------------------------------------------------------- bad input
BAD = [
    ("shape_mismatch", TRANSPORTS, r"model mismatch across ranks: parameter #2 is '1\.weight' \(8, 8\) float32 on rank 0 but '1\.weight' \(9, 8\)"),
    ("count_mismatch", TRANSPORTS, r"wrap different trainable parameters: none only on rank 0, '2\.weight', '2\.bias' only on rank 1 -- the other rank built its model without them, or set requires_grad=False on them"),
    ("unused_some_ranks", TRANSPORTS, r"no gradient .*'branch\.weight' \(on 1 of \d ranks\).*find_unused_parameters=True"),
    ("unused_all_ranks", TRANSPORTS, r"no gradient .*'branch\.weight' \(on (\d) of \1 ranks\).*find_unused_parameters=True"),
    ("bad_cap=-0.5", ("c10d",), r"bucket_cap_mb=-0\.5 is not a valid bucket size: pass a number of megabytes >= 0"),
    ("bad_cap=-1", ("mpi",), r"bucket_cap_mb=-1\.0 is not a valid bucket size"),
    ("bad_first_cap=big", ("c10d",), r"first_bucket_cap_mb='big' is not a valid bucket size"),
    ("unknown_transport", ("c10d",), r"unknown transport 'carrier-pigeon': choose one of \('c10d', 'mpi'\)"),
    ("dtype_mismatch", ("mpi",), r"model mismatch across ranks: parameter #0 is '0\.weight' \(8, 8\) float32 on rank 0 but '0\.weight' \(8, 8\) float64"),
    ("cap_differs", TRANSPORTS, r"DistributedDataParallel arguments differ across ranks: bucket_cap_mb is 25\.0 on rank 0 but 5\.0 on rank 1; every rank must pass the same bucket_cap_mb"),
    ("frozen_on_one_rank", ("mpi",), r"model mismatch across ranks: rank 0 and rank 1 wrap different trainable parameters: '1\.weight', '1\.bias' only on rank 0, none only on rank 1; a parameter set to requires_grad=False on some ranks only"),
    ("last_frozen_on_one_rank", ("c10d",), r"wrap different trainable parameters: '2\.weight', '2\.bias' only on rank 0, none only on rank 1 -- the other rank built its model without them, or set requires_grad=False on them \(which leaves them out of its plan\)"),
    ("buffers_flag_differs", TRANSPORTS, r"broadcast_buffers/forward_sync_buffers is True on rank 0 but False on rank 1"),
    ("transport_differs", ("c10d",), r"transport is 'c10d' on rank 0 but 'mpi' on rank 1"),
    ("sparse_gradient_outside_embedding", TRANSPORTS, r"parameter 'weight' has a torch\.sparse_coo gradient, but it is not the weight of an nn\.Embedding or nn\.EmbeddingBag with sparse=True"),
    ("sparse_delayed", ("mpi",), r"delay_all_reduce_named_params holds '0\.weight', the weight of an nn\.Embedding/EmbeddingBag with sparse=True"),
    ("sparse_on_one_rank", ("c10d",), r"model mismatch across ranks: parameter #0 is 'weight' \(10, 4\) float32 on rank 0 but 'weight' \(10, 4\) float32 with a sparse gradient \(nn\.Embedding\(sparse=True\)\) on rank 1"),
    ("backward_twice", ("c10d",), r"gradient of '(weight|bias)' arrived outside a DDP iteration: run one backward per forward"),
    ("modified_after_wrap", ("mpi",), r"the module's trainable parameters changed after DistributedDataParallel wrapped it: 2 then, 4 now \(added: \['1\.weight', '1\.bias'\]"),
    ("double_on_one_rank", TRANSPORTS, r"the ranks met in different collectives -- .*model check after a re-plan.*\(this is "
                                       r"rank \d\)\. Every rank must make the same calls in the same order; a rank in "
                                       r"'model check after a re-plan' re-planned its buckets because its parameters "
                                       r"changed dtype, device or shape after wrapping \(\.double\(\), \.to\(\)"),
    ("replaced_after_wrap", ("c10d",), r"trainable parameters changed after DistributedDataParallel wrapped it: 2 then, 2 now \(added: none, gone: none, replaced by new Parameter objects: \['0\.weight', '0\.bias'\]\).*load into them \(assign=False"),
    ("crossed_ddps", TRANSPORTS, r"the ranks reduced different DistributedDataParallels here \(rank 0 its DistributedDataParallel #\d+, rank 1 its DistributedDataParallel #\d+, .*in the same order"),
    ("crossed_ddps_world_group", ("c10d",), r"the ranks reduced different DistributedDataParallels here \(rank 0 its DistributedDataParallel #\d+, rank 1 its DistributedDataParallel #\d+"),
    # (on a group of its own -- a data-parallel group, here of every rank -- numbered per group: was not compared)
    ("crossed_ddps_subgroup", ("c10d",), r"the ranks reduced different DistributedDataParallels here \(rank 0 its DistributedDataParallel #[12], rank 1 its DistributedDataParallel #[12]"),
    ("late_hook_in_join", TRANSPORTS, r"register_comm_hook inside `with ddp\.join\(\):` after training started is refused: a rank that has already joined cannot register it at the same step"),
    ("nonfinite", TRANSPORTS, r"non-finite gradients \(NaN or Inf\) found by check_finite -- rank 1: '0\.weight', '1\.weight' \(this is rank \d\)"),
    ("world_size", ("c10d",), r"portddp\.init\(world_size=\d\) but the launcher \(mpirun\) started \d process\(es\): launch with `mpirun -n"),
    ("process_group_mismatch", ("c10d",), r"a c10d process group already exists with rank 0 of 1, but the launcher \(mpirun\) says rank \d of \d"),
]


ALONE = ("world_size", "process_group_mismatch")  # portddp.init() itself fails: one job each


@pytest.fixture(scope="module")
def bad_input_jobs():
    """Every 2-rank case of one transport in one job (tests/workers/common.run_cases), run on first
    use; a job that failed fails its other cases at once instead of running again."""
    done: dict = {}

    def job(transport: str) -> dict:
        if transport not in done:
            try:
                done[transport] = mpi.run_cases(2, "tests.workers.torch_bad_input",
                                                [c for c, ts, _ in BAD if transport in ts and c not in ALONE],
                                                transport)
            except BaseException as e:  # (pytest.fail raises a BaseException)
                done[transport] = e
        if isinstance(done[transport], BaseException):
            raise done[transport]
        return done[transport]

    return job


@pytest.mark.parametrize(
    "case,transport,pattern,n",
    [(c, t, p, 2) for c, ts, p in BAD for t in ts]
    + [("unused_some_ranks", "mpi", r"no gradient .*'branch\.weight' \(on 2 of 3 ranks\)", 3)],
)
def test_bad_input_fails_on_every_rank(bad_input_jobs, case, transport, pattern, n):
    if n == 2 and case not in ALONE:
        mpi.case_errors_on_every_rank(bad_input_jobs(transport), case, n, pattern)
        return
    proc = mpi.run(n, "tests.workers.torch_bad_input", case, transport, timeout=120)
    mpi.errors_on_every_rank(proc, n, pattern)


def test_under_torchrun_with_c10d(tmp_path):
    """The same worker under torchrun instead of mpirun (c10d only: torchrun starts no MPI ranks)."""
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    torchrun = shutil.which("torchrun", path=str(mpi._BIN))
    proc = subprocess.run([torchrun, "--nproc-per-node=2", "-m", "tests.workers.torch_equivalence", "c10d"],
                          # (TMPDIR: torchrun leaves its log directory behind, here not in /tmp)
                          cwd=mpi.ROOT, env={**os.environ, "PORTDDP_RESULTS": str(tmp_path), "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rows in mpi.rows(proc, tmp_path, 2):
        plain = next(row for row in rows if row["scenario"] == "plain/c10d")
        assert plain["bitwise"], plain


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_collectives_per_step(results, transport):
    """On c10d between two ranks without a comm hook the used counts ride on the last bucket's
    all-reduce (one Gloo round trip fewer per step); with a hook, on MPI, at n >= 3 (where a longer
    bucket would move the chunks of Gloo's ring, and the sums would no longer be native's), or
    alone, they have a collective of their own."""
    n, rows = each_rank(results, f"collectives_per_step/{transport}")
    for row in rows:
        if n == 1:
            assert row["plain"] == row["hooked"] == row["buckets"], row
        elif transport == "c10d" and n == 2:
            assert (row["plain"], row["hooked"]) == (row["buckets"], row["buckets"] + 1), row
        else:
            assert row["plain"] == row["hooked"] == row["buckets"] + 1, row


@pytest.mark.parametrize("world", [2, 3, 7, 1000])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_packs_scale_tensor_multiplies_bitwise_like_the_python_float(world, dtype):
    """_set_divisor's 0-dim tensors replace the Python float 1/world in every pack (faster): the
    product must keep every bit -- huge, tiny, subnormal, inf, NaN and signed zeros included."""
    import torch  # noqa: PLC0415

    from portddp.torch.ddp import DistributedDataParallel  # noqa: PLC0415

    dt = getattr(torch, dtype)
    fi = torch.finfo(dt)
    gen = torch.Generator().manual_seed(world)
    grad = torch.cat([torch.randn(20000, dtype=dt, generator=gen)
                      * torch.pow(torch.tensor(10.0, dtype=dt), torch.randint(-45, 38, (20000,), generator=gen).to(dt)),
                      torch.tensor([fi.tiny, fi.tiny / 3, fi.max, -fi.max, float("inf"), float("nan"), 0.0, -0.0],
                                   dtype=dt)])
    state = type("State", (), {})()
    DistributedDataParallel._set_divisor(state, world)
    packed = torch.empty_like(grad)
    torch.mul(grad, state._scale_of[dt], out=packed)
    bits = torch.int32 if dt == torch.float32 else torch.int64
    assert torch.equal(packed.view(bits), torch.mul(grad, 1.0 / world).view(bits))
    in_place = grad.clone().mul_(state._scale_of[dt])
    assert torch.equal(in_place.view(bits), packed.view(bits))
