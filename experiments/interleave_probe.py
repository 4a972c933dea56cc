"""Is a DDP step slower next to its limit than on its own? (issue 16)

    mpirun -bind-to user:0,1 -n 2 python -m experiments.interleave_probe [gpt|mlp|gelu-mlp]

The benchmark times every variant in interleaved rounds (a few steps of each in turn), so that
the machine's drift hits them alike. This probe times the step without communication
(torch-local, the limit) and portddp.torch over MPI with gradient_as_bucket_view (the best
torch row) both ways in one job, twice: in blocks (all of one's steps, then all of the other's)
and interleaved (3 steps each in turn), and prints each way's medians and their ratio. Every
block and turn starts with a barrier, as the benchmark's turns do (without one, a DDP turn right
after the limit's began with the ranks' drift over the limit's steps).
"""

from __future__ import annotations

import statistics
import sys

import portddp
from harness.adapter import make_trainer
from harness.measure import no_collection
from harness.runner import MODELS, bench_workload
from portddp.transport import get_transport

VARIANTS = (("limit", "torch-local", {}), ("ddp", "torch-mpi", {"gradient_as_bucket_view": True}))


def timed(trainer, steps: int) -> list[float]:
    with no_collection():
        get_transport().barrier()
        return [trainer.step() for _ in range(steps)]


def main(model: str = "gpt", rounds: int = 8, per_turn: int = 3) -> None:
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r}: choose from {tuple(MODELS)}")
    world = portddp.init()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    trainers = {name: make_trainer(impl, bench_workload(model), world, **knobs)
                for name, impl, knobs in VARIANTS}
    for t in trainers.values():
        timed(t, 6)
    for repeat in (1, 2):
        blocks = {name: timed(t, rounds * per_turn) for name, t in trainers.items()}
        mixed = {name: [] for name in trainers}
        for _ in range(rounds):
            for name, t in trainers.items():
                mixed[name] += timed(t, per_turn)
        for way, times in (("in blocks", blocks), ("interleaved", mixed)):
            med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            say(f"{model} #{repeat} {way:11s}  limit {med['limit']:7.1f} ms  ddp {med['ddp']:7.1f} ms  "
                f"ratio {med['ddp'] / med['limit']:.3f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
