"""A/B of reading this rank's own slice of each bucket straight from the gradients (no pack).

    mpirun -bind-to user:0,1 -n 2 python -m experiments.unpacked_probe gelu-mlp [rounds]
    MEM=packed mpirun -bind-to user:0,1 -n 2 python -m experiments.unpacked_probe mlp   (or MEM=unpacked)

Builds torch-local and two torch-mpi + gradient_as_bucket_view wrappers, one with the unpacked
slices, one packing everything (own_ranges switched off), and times them interleaved, each turn
starting with a barrier; with MEM=<variant> it builds that one alone and reports its peak memory over 8 steps.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import portddp
from harness.adapter import make_trainer
from harness.measure import Memory
from harness.runner import bench_workload
from portddp.transport import get_transport


def build(name, model, world):
    if name == "local":
        return make_trainer("torch-local", bench_workload(model), world)
    t = make_trainer("torch-mpi", bench_workload(model), world, gradient_as_bucket_view=True)
    if name == "packed":
        t.wrapped._comm.own_ranges = lambda tensor: None
        t.wrapped._install_plan(t.wrapped._plan)
    return t


def main(model: str = "gelu-mlp", rounds: int = 6) -> None:
    world = portddp.init()
    if os.environ.get("MEM"):
        mem = Memory()
        mem.start()
        t = build(os.environ["MEM"], model, world)
        for _ in range(8):
            t.step()
        print(f"rank {world.rank} {model} {os.environ['MEM']}: peak {mem.peak_mb():.0f} MB, unpacked params "
              f"{t.wrapped.stats()['unpacked_params']}", flush=True)
        return
    trainers = {name: build(name, model, world) for name in ("local", "packed", "unpacked")}
    for t in trainers.values():
        for _ in range(4):
            t.step()
    times = {k: [] for k in trainers}
    order = list(trainers.items())
    for r in range(rounds):
        for k, t in order[r % 3:] + order[:r % 3]:
            gc.collect()
            gc.disable()
            get_transport().barrier()
            for _ in range(3):
                times[k].append(t.step())
            gc.enable()
    if world.rank == 0:
        m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(model, " ".join(f"{k} {v:.1f} ms" for k, v in m.items()),
              f"unpacked/packed {m['unpacked'] / m['packed']:.3f}", flush=True)


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["gelu-mlp"]), *(int(a) for a in sys.argv[2:3]))
