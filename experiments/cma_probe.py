"""Would reading the peer's gradients straight from its memory beat packing them? (issue 16)

    mpirun -bind-to user:0,1 -n 2 python -m experiments.cma_probe     # 2 ranks, 32 MB, ~10 s

portddp.jax hooked packs every gradient from XLA's buffer into shared memory (one copy), so that
the peer can read it; XLA's buffers are private. Linux's cross-memory attach
(`process_vm_readv`, what Open MPI's vader uses for large messages) lets a rank read another
process's private memory instead. Three ways of averaging one 32 MB float32 gradient between 2
ranks on one host, each ending with the mean in a private buffer, timed side by side in
interleaved rounds (medians of 15, rank 0, wall and CPU of the calling thread):

- pack: today's path -- pack (scaled) into shared memory, sum my half from both segments, copy
  both halves of the result out (portddp.shm's scheme);
- cma: no pack -- sum my half from my private buffer and the peer's (read with
  process_vm_readv, 256 KB at a time, into a buffer that stays in cache), result into shared
  memory, copy both halves out;
- cma-in-place: my half summed into my own private buffer, then the peer's half of the result
  read straight from its private buffer (no shared memory at all); restoring the gradient
  first costs one plain copy, timed alone as `copy` and to be subtracted.

All three give bitwise the same numbers (checked before timing). Synchronisation is MPI_Barrier,
the same in all three. Not used by portddp: inside a real step it is no faster
(experiments/cma_step_probe.py; README, "CPU per iteration").
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
from mpi4py import MPI

from harness.cma import BLOCK, read_remote
from harness.measure import rotated

N = 8 * 1024 * 1024  # 32 MB of float32
ROUNDS = 15


def shared_segments(comm, nbytes: int) -> list[np.ndarray]:
    """One /dev/shm file per rank, every rank mapping all of them (unlinked once mapped)."""
    path = f"/dev/shm/portddp-cma-probe-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        segs = []
        for p in comm.allgather(path):
            with open(p, "r+b") as f:
                segs.append(np.frombuffer(mmap.mmap(f.fileno(), nbytes), dtype=np.float32))
        comm.Barrier()
    finally:
        os.unlink(path)
        os.close(fd)
    return segs


def main() -> None:
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run on 2 ranks: mpirun -n 2 python -m experiments.cma_probe")
    rank, peer = comm.rank, 1 - comm.rank
    segs = shared_segments(comm, N * 4)
    grad = np.random.default_rng(rank).standard_normal(N).astype(np.float32)  # XLA's private gradient
    work = np.empty(N, np.float32)  # the in-place variant's private gradient
    out = np.empty(N, np.float32)  # XLA's private result buffer
    pids = comm.allgather(os.getpid())
    grad_at, work_at = comm.allgather(grad.ctypes.data), comm.allgather(work.ctypes.data)
    half = N // 2
    lo, hi = (0, half) if rank == 0 else (half, N)
    inv = np.float32(0.5)
    peer_block, my_block = np.empty(BLOCK, np.float32), np.empty(BLOCK, np.float32)

    def add_in_rank_order(mine, theirs, into):  # a0 + a1, as the shared-memory sum does
        np.add(*((mine, theirs) if rank == 0 else (theirs, mine)), out=into)

    def gather_out():
        out[:half], out[half:] = segs[0][:half], segs[1][half:]

    def pack():
        np.multiply(grad, inv, out=segs[rank])
        comm.Barrier()
        np.add(segs[0][lo:hi], segs[1][lo:hi], out=segs[rank][lo:hi])
        comm.Barrier()
        gather_out()
        comm.Barrier()

    def cma():
        comm.Barrier()
        for s in range(lo, hi, BLOCK):
            e = min(s + BLOCK, hi)
            theirs, mine = peer_block[:e - s], my_block[:e - s]
            read_remote(pids[peer], grad_at[peer] + s * 4, theirs)
            np.multiply(grad[s:e], inv, out=mine)
            np.multiply(theirs, inv, out=theirs)
            add_in_rank_order(mine, theirs, segs[rank][s:e])
        comm.Barrier()
        gather_out()
        comm.Barrier()

    def cma_in_place():
        work[:] = grad
        comm.Barrier()
        for s in range(lo, hi, BLOCK):
            e = min(s + BLOCK, hi)
            theirs, mine = peer_block[:e - s], work[s:e]
            read_remote(pids[peer], work_at[peer] + s * 4, theirs)
            np.multiply(mine, inv, out=mine)
            np.multiply(theirs, inv, out=theirs)
            add_in_rank_order(mine, theirs, mine)
        comm.Barrier()
        plo, phi = (half, N) if rank == 0 else (0, half)
        read_remote(pids[peer], work_at[peer] + plo * 4, work[plo:phi])
        comm.Barrier()

    def copy():
        work[:] = grad

    pack()
    reference = out.copy()
    cma()
    same = np.array_equal(out, reference)
    cma_in_place()
    same = same and np.array_equal(work, reference)
    variants = {"pack": pack, "cma": cma, "cma-in-place": cma_in_place, "copy": copy}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(ROUNDS):
        for name in rotated(order, r):
            comm.Barrier()
            t, c = time.perf_counter(), time.thread_time()
            variants[name]()
            times[name].append((time.perf_counter() - t, time.thread_time() - c))
    if rank == 0:
        ms = {name: (1e3 * np.median([w for w, _ in v]), 1e3 * np.median([c for _, c in v]))
              for name, v in times.items()}
        for name, (wall, cpu) in ms.items():
            print(f"{name:14s} {wall:7.2f} ms  (CPU {cpu:6.2f} ms)")
        in_place = ms["cma-in-place"][0] - ms["copy"][0]
        best = min(ms["cma"][0], in_place) / ms["pack"][0]
        verdict = ("on bare buffers, reading the peer's memory saves no time" if best > 0.9 else
                   "on bare buffers, reading the peer's memory saves time (inside a step: "
                   "python -m experiments.cma_step_probe)")
        print(f"bitwise equal: {same}; cma / pack = {ms['cma'][0] / ms['pack'][0]:.2f}, "
              f"cma-in-place (less the copy) / pack = {in_place / ms['pack'][0]:.2f}: {verdict}")


if __name__ == "__main__":
    main()
