"""The shared-memory all-reduce against MPI's own, under mpirun (tests/test_shm.py).

Every case is checked on every rank; one line per case: `SHM_CASE rank=<r> <name> <ok|FAIL ...>`.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
from mpi4py import MPI

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


if __name__ == "__main__":
    main()
