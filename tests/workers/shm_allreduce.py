"""The shared-memory all-reduce against MPI's own, under mpirun (tests/test_shm.py).

Every case is checked on every rank; one line per case: `SHM_CASE rank=<r> <name> <ok|FAIL ...>`.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
from mpi4py import MPI

if os.environ.get("SHM_TEST_TORCH"):  # a portddp.torch rank: float16 sums go through torch (shm.half_add)
    import torch  # noqa: F401

from portddp.transport import MPITransport, _half_sum_op

SIZES = (1, 2, 7, 17, 1000, 4097, 300_001)
DTYPES = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)


def emit(rank, name, ok, detail=""):
    os.write(1, f"SHM_CASE rank={rank} {name} {'ok' if ok else 'FAIL ' + detail}\n".encode())


def reference(comm, data):
    """MPI's own all-reduce of `data` (blocking, on a separate communicator)."""
    out = data.copy()
    if out.dtype.name in ("float16", "bfloat16"):
        comm.Allreduce(MPI.IN_PLACE, [out.view(np.uint16), MPI.UINT16_T], op=_half_sum_op(out.dtype))
    else:
        comm.Allreduce(MPI.IN_PLACE, out, op=MPI.SUM)
    return out


def main():
    t = MPITransport()
    ref_comm = MPI.COMM_WORLD.Dup()
    rank, n = t.rank, t.size
    exact = t.local_size <= 2 and not t.multi_host  # MPI's order is a0 + a1 only at n = 2
    emit(rank, f"impl={t.allreduce_impl} local={t.local_size} hosts={t.size // t.local_size}", True)
    rng = np.random.default_rng(1234 + rank)
    for dtype in DTYPES:
        for size in SIZES:
            data = rng.standard_normal(size).astype(np.float32).astype(dtype)
            want = reference(ref_comm, data)
            for path in ("copy", "zero-copy"):
                buf = t.empty(size, dtype) if path == "zero-copy" else np.empty(size, dtype)
                buf[...] = data
                if path == "zero-copy" and t.allreduce_impl == "shm" and not t.is_shared(buf):
                    emit(rank, f"{np.dtype(dtype).name}-{size}-{path}", False, "empty() not in the window")
                    continue
                t.allreduce(buf).wait(timeout=120)
                name = f"{np.dtype(dtype).name}-{size}-{path}"
                if exact:
                    ok = buf.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
                    emit(rank, name, ok, f"max diff {np.max(np.abs(buf.astype(np.float64) - want)):.3g}")
                else:
                    tol = 1e-2 if np.dtype(dtype).itemsize == 2 else 1e-5
                    err = np.max(np.abs(buf.astype(np.float64) - want.astype(np.float64))) if size else 0.0
                    emit(rank, name, err <= tol * max(1.0, np.max(np.abs(want.astype(np.float64)))), f"err {err}")
                # every rank holds the same bits
                agreed = ref_comm.allgather(buf.view(np.uint8).tobytes())
                if len(set(agreed)) != 1:
                    emit(rank, name + "-agree", False, "ranks differ")
    # a view inside a shared buffer (a bucket of a larger flat buffer), odd offset
    flat = t.empty(10_001, np.float32)
    flat[...] = rank + 1
    t.allreduce(flat[3:9_000]).wait(timeout=120)
    total = n * (n + 1) / 2
    emit(rank, "view-in-window", bool(np.all(flat[3:9_000] == total) and np.all(flat[:3] == rank + 1)
                                      and np.all(flat[9_000:] == rank + 1)))
    # larger than the scratch area: chunked (both paths)
    big = np.full((t._shm.scratch_bytes // 4 + 123) if t._shm else 1000, rank + 1, np.float32)
    t.allreduce(big).wait(timeout=120)
    emit(rank, "chunked-copy", bool(np.all(big == total)))
    if t._shm:
        bigw = t.empty(big.size, np.float32)
        bigw[...] = rank + 1
        t.allreduce(bigw).wait(timeout=120)
        emit(rank, "chunked-zero-copy", bool(np.all(bigw == total)))
        # rounds: a buffer every rank holds in its arena goes in one (two counter moves), whatever
        # its size (on one host; across hosts a scratch-full at a time); one rank's in ordinary
        # memory (rank 0's) makes every rank go a scratch-full at a time, deferred or not, with
        # the same sums
        seq = t._shm._seq
        t.allreduce(bigw).wait(timeout=120)
        moves = 2 if t._shm.hosts == 1 else 4
        emit(rank, "arena-one-round", t._shm._seq - seq == moves and bool(np.all(bigw == n * total)),
             str(t._shm._seq - seq))
        for defer in (False, True):
            mixed = np.full(big.size, rank + 1, np.float32) if rank == 0 else t.empty(big.size, np.float32)
            mixed[...] = rank + 1
            seq = t._shm._seq
            t.allreduce(mixed, defer_gather=defer).wait(timeout=120)
            out = np.empty_like(mixed)
            t.gather(mixed, [(0, out)])
            emit(rank, f"mixed-scratch-arena-{'deferred' if defer else 'plain'}",
                 t._shm._seq - seq == 4 and bool(np.all(out == total)), f"{t._shm._seq - seq} {out[:2]} {out[-2:]}")
    deferred_gathers(t, ref_comm, rank, n, exact)
    # non-contiguous buffers are refused when launched, on every rank
    try:
        t.allreduce(np.zeros(10, np.float32)[::2])
        emit(rank, "non-contiguous-refused", False, "accepted")
    except ValueError as e:
        emit(rank, "non-contiguous-refused", "C-contiguous" in str(e), str(e))
    # the arena returns freed space
    if t._shm:
        free_before = sum(b - a for a, b in t._shm._free)
        x = t.empty((1000, 10), np.float64)
        view = x[5:]
        del x
        mid = sum(b - a for a, b in t._shm._free)
        del view
        after = sum(b - a for a, b in t._shm._free)
        emit(rank, "arena-free", mid < free_before and after == free_before, f"{free_before} {mid} {after}")
    # the int32 sequence counters wrap around
    if t._shm:
        t.barrier()
        t._shm._seq = 0x7FFFFFFE
        t._shm._counters[t._shm.local_rank][0] = t._shm._seq
        t.barrier()
        ok = True
        for k in range(3):
            w = t.empty(33, np.float64)
            w[...] = rank + k
            t.allreduce(w).wait(timeout=60)
            ok &= bool(np.all(w == total - n + n * k))
        emit(rank, "counter-wraps", ok and t._shm._seq < 100, str(t._shm._seq))
    t.barrier()
    sys.stdout.flush()


def deferred_gathers(t, ref_comm, rank, n, exact):
    """allreduce(buf, defer_gather=True) + gather(buf, dests): the same bits as the plain all-reduce,
    into destinations that split the buffer at odd offsets (and leave parts out); several buffers
    deferred before any is gathered, a collective in between, and ranks that do not defer (rank 1)
    in the same collectives -- the protocol is the same either way."""
    rng = np.random.default_rng(99 + rank)
    sizes = (1, 1000, 300_001, (t._shm.scratch_bytes // 4 + 777) if t._shm else 5000)  # the last one chunked
    bufs, datas, wants = [], [], []
    for size in sizes:
        data = rng.standard_normal(size).astype(np.float32)
        buf = t.empty(size, np.float32)
        buf[...] = data
        bufs.append(buf), datas.append(data), wants.append(reference(ref_comm, data))
    handles = [t.allreduce(buf, defer_gather=rank != 1) for buf in bufs]
    for h in handles:
        h.wait(timeout=120)
    small = np.full(5, rank + 1.0)  # an ordinary all-reduce between the deferred ones and their gathers
    t.allreduce(small).wait(timeout=120)
    for size, buf, want in zip(sizes, bufs, wants):
        cuts = sorted({0, *(int(c) for c in np.linspace(0, size, 5)[1:-1] + 3), size})
        cuts = [c for c in cuts if c <= size]
        dests = [(a, np.full(b - a, np.nan, np.float32)) for a, b in zip(cuts, cuts[1:]) if b > a]
        skipped = dests.pop(1) if len(dests) > 2 else None  # a part nobody asks for stays untouched
        t.gather(buf, dests)
        got = np.concatenate([d for _, d in dests])
        expect = np.concatenate([want[a:a + d.size] for a, d in dests])
        name = f"deferred-gather-{size}"
        if exact:
            emit(rank, name, got.tobytes() == expect.tobytes(), f"max diff {np.nanmax(np.abs(got - expect)):.3g}")
        else:
            emit(rank, name, bool(np.allclose(got, expect, rtol=1e-5, atol=1e-5)), f"{np.nanmax(np.abs(got - expect))}")
        if skipped is not None and not np.isnan(skipped[1]).all():
            emit(rank, name + "-untouched", False, "a part not asked for was written")
        if len(set(ref_comm.allgather(got.tobytes()))) != 1:
            emit(rank, name + "-agree", False, "ranks differ")
    emit(rank, "deferred-small-between", bool(np.all(small == n * (n + 1) / 2)))
    # a deferred buffer reduced again before its gather (an iteration that failed before gathering):
    # the new sum replaces the forgotten gather
    buf = t.empty(64, np.float32)
    buf[...] = 1
    t.allreduce(buf, defer_gather=True).wait(timeout=60)
    buf[...] = 2
    t.allreduce(buf).wait(timeout=60)
    t.barrier()
    if rank != 0:  # were the forgotten gather still pending, rank 0 would read these
        buf[...] = -1
    t.barrier()
    out = np.empty(64, np.float32)
    t.gather(buf, [(0, out)])  # from this rank's own buffer: the plain all-reduce's result, or the -1s
    emit(rank, "deferred-then-plain", bool(np.all(out == (2 * n if rank == 0 else -1))), str(out[:3]))
    # data in a peer's scratch (rank 0 passes ordinary memory) is gathered at once, before that
    # peer's next all-reduce overwrites its scratch; discard() forgets a gather that will not run
    buf = np.full(1000, 1, np.float32) if rank == 0 else t.empty(1000, np.float32)
    buf[...] = rank + 1
    t.allreduce(buf, defer_gather=True).wait(timeout=60)
    other = np.full(1000, 5, np.float32) if rank == 0 else t.empty(1000, np.float32)
    other[...] = 100
    t.allreduce(other, defer_gather=True).wait(timeout=60)  # rank 0's scratch now holds sums of 100s
    out = np.empty(1000, np.float32)
    t.gather(buf, [(0, out)])
    emit(rank, "deferred-peer-scratch", bool(np.all(out == n * (n + 1) / 2)), str(out[:3]))
    t.discard(other)
    if t._shm is not None and t._shm._pending:
        emit(rank, "deferred-discarded", False, f"still pending: {len(t._shm._pending)}")
    other[...] = 1
    t.allreduce(other).wait(timeout=60)
    emit(rank, "deferred-discarded", bool(np.all(other == n)), str(other[:3]))


if __name__ == "__main__":
    main()
