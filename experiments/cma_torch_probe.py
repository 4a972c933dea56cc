"""The cross-memory-attach idea of experiments/cma_probe.py in a real portddp.torch step (issue 16).

    mpirun -bind-to user:0,1 -n 2 python -m experiments.cma_torch_probe [gpt|mlp|gelu-mlp]

portddp.torch's best row (MPI, `gradient_as_bucket_view`) copies every gradient, divided, into
its shared-memory bucket (the pack), then each rank sums its half of every bucket from both
ranks' buckets and writes the sum into both. Unlike XLA's buffers, a torch gradient stays put
after its backward, so a rank could instead sum its half of every gradient in place, in its own
private `.grad`, reading the peer's half with `process_vm_readv`, and then read the peer's half of
the result straight from the peer's `.grad`: no pack and no shared memory, about 40 % less
memory traffic for the averaging. A prototype, not portddp: after the backward, blocking (on one
core per rank, overlap inside a rank saves no CPU), it exchanges the gradients' addresses, sums
its half of each gradient (both halves divided first, as native DDP does), waits for the peer,
reads the other half, waits again. It runs beside the limit (no communication) and the view
row in interleaved rounds and prints each one's median ms per step and ratio to the limit,
twice, then whether its parameters are bitwise the view row's.
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np
from mpi4py import MPI

import portddp
from harness.adapter import make_trainer
from harness.cma import BLOCK, read_remote
from harness.measure import no_collection
from harness.runner import MODELS, bench_workload
from portddp.transport import get_transport


def timed(trainer, steps: int) -> list[float]:
    with no_collection():
        get_transport().barrier()
        return [trainer.step() for _ in range(steps)]


def average_in_place(params, comm) -> None:
    """Every parameter's .grad becomes the mean over the 2 ranks, bitwise as the view row's."""
    rank, peer = comm.rank, 1 - comm.rank
    pid = comm.allgather(os.getpid())[peer]
    grads = [p.grad.numpy().reshape(-1) for p in params]
    theirs_at = comm.allgather([g.ctypes.data for g in grads])[peer]  # (also: the peer's backward is done)
    half, block = np.float32(0.5), np.empty(BLOCK, np.float32)
    for g, at in zip(grads, theirs_at):
        lo, hi = (0, g.size // 2) if rank == 0 else (g.size // 2, g.size)
        for s in range(lo, hi, BLOCK):
            e = min(s + BLOCK, hi)
            mine, theirs = g[s:e], block[:e - s]
            read_remote(pid, at + s * g.itemsize, theirs)
            np.multiply(mine, half, out=mine)
            np.multiply(theirs, half, out=theirs)
            np.add(mine, theirs, out=mine)  # (a sum of two is commutative, bitwise)
    comm.Barrier()  # every half is summed
    for g, at in zip(grads, theirs_at):
        lo, hi = (g.size // 2, g.size) if rank == 0 else (0, g.size // 2)
        if hi > lo:
            read_remote(pid, at + lo * g.itemsize, g[lo:hi])
    comm.Barrier()  # no rank reads the other's gradients any more


def main(model: str = "gpt", rounds: int = 8, per_turn: int = 3) -> None:
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r}: choose from {tuple(MODELS)}")
    world = portddp.init()
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run on 2 ranks: mpirun -bind-to user:0,1 -n 2 python -m experiments.cma_torch_probe")
    say = print if world.rank == 0 else (lambda *a, **k: None)
    trainers = {"limit": make_trainer("torch-local", bench_workload(model), world),
                "view": make_trainer("torch-mpi", bench_workload(model), world, gradient_as_bucket_view=True),
                "in place": make_trainer("torch-local", bench_workload(model), world)}
    probe = trainers["in place"]
    params, step = list(probe.model.parameters()), probe.opt.step

    def averaged_step():
        average_in_place(params, comm)
        step()

    probe.opt.step = averaged_step
    for t in trainers.values():
        timed(t, 4)
    for repeat in (1, 2):
        times = {name: [] for name in trainers}
        for _ in range(rounds):
            for name, t in trainers.items():
                times[name] += timed(t, per_turn)
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        say(f"{model} #{repeat}  limit {med['limit']:.1f} ms  view {med['view']:.1f} ms "
            f"({med['view'] / med['limit']:.3f})  in place {med['in place']:.1f} ms "
            f"({med['in place'] / med['limit']:.3f})", flush=True)
    same = all(np.array_equal(a.detach().numpy(), b.detach().numpy())
               for a, b in zip(trainers["view"].model.parameters(), params))
    say(f"in place bitwise the view row's parameters: {same}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
