"""Where a PyTorch step's time goes, phase by phase: wall and main-thread CPU of each phase.

    mpirun -bind-to user:0,1 -n 2 python -m experiments.phase_probe                 # gpt, 12 rounds
    mpirun -bind-to user:0,1 -n 2 python -m experiments.phase_probe gelu-mlp 30 torch-local torch-c10d native

Builds the PyTorch implementations named (harness.adapter's names, or torch-mpi+view; default
torch-local, torch-mpi+view and native) on a benchmark model, warms them up, then runs ROUNDS
interleaved rounds of 3 steps each (each round starting with another one, no garbage collection
inside a turn, as the benchmark does) and times every step's phases on the main thread:
zero_grad, the batch, the forward (with the loss), the backward (with DDP's hooks, packs and the
wait for the last bucket) and the optimizer step. Prints each rank's medians, wall / CPU ms: a
phase whose wall exceeds its CPU waited (for a peer, or for a comm thread sharing the core).

With --lockstep every implementation is also timed with a barrier between the backward and the
optimizer step (rows `<name>+lockstep`, the barrier a phase of its own): a DDP backward ends on
every rank at once, a limit's ranks drift apart, and the optimizer step -- the same code in every
row, memory-bound -- is slower when the ranks run it at the same moment.

    mpirun -bind-to user:0,1 -n 2 python -m experiments.phase_probe gelu-mlp 30 torch-local torch-mpi+view native --lockstep

An implementation named twice is built twice (rows `native` and `native#2`): an A/A
check of how far two instances of one step read apart in one run.
"""

from __future__ import annotations

import statistics
import sys
import time

import portddp
from harness.adapter import make_trainer
from harness.measure import frozen_heap, no_collection, rotated
from harness.runner import MODELS, VIEW_OF, bench_workload
from portddp import malloc
from portddp.transport import get_transport

PHASES = ("zero_grad", "batch", "forward", "backward", "barrier", "optimizer")


def timed_step(trainer, barrier=None) -> dict[str, tuple[float, float]]:
    """One training step as TorchTrainer.step takes it, each phase's (wall, CPU) seconds; with
    `barrier` (a callable), called between the backward and the optimizer step."""
    import torch  # noqa: PLC0415

    out, t = {}, (time.perf_counter(), time.thread_time())

    def done(phase):
        nonlocal t
        now = (time.perf_counter(), time.thread_time())
        out[phase] = (now[0] - t[0], now[1] - t[1])
        t = now

    trainer.opt.zero_grad()
    done("zero_grad")
    x, y = (torch.from_numpy(a) for a in trainer.batch(0))
    done("batch")
    loss = trainer.work.torch_loss(trainer.wrapped(x), y)
    done("forward")
    loss.backward()
    done("backward")
    if barrier is not None:
        barrier()
    done("barrier")
    trainer.opt.step()
    done("optimizer")
    trainer.steps += 1
    return out


def main(argv: list[str]) -> None:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return
    lockstep = "--lockstep" in argv
    argv = [a for a in argv if a != "--lockstep"]
    model = argv[0] if argv else "gpt"
    rounds = int(argv[1]) if len(argv) > 1 else 12
    impls = argv[2:] or ["torch-local", "torch-mpi+view", "native"]
    if model not in MODELS or any(not (i.startswith("torch") or i == "native") for i in impls):
        raise SystemExit(f"usage: phase_probe [{'|'.join(MODELS)}] [rounds] [PyTorch implementations...] "
                         "[--lockstep]")
    malloc.keep_freed_memory()  # as the benchmark runs every row
    world = portddp.init()
    work = bench_workload(model)
    trainers = {}
    for k, i in enumerate(impls):  # (one named twice: two instances, "native" and "native#2" -- an A/A check)
        label = i if i not in trainers else f"{i}#{impls[:k + 1].count(i)}"
        trainers[label] = make_trainer(VIEW_OF.get(i, i), work, world, gradient_as_bucket_view=i in VIEW_OF)
    for trainer in trainers.values():
        for _ in range(4):
            timed_step(trainer)
    order = [(i, (t, None)) for i, t in trainers.items()]
    if lockstep:  # (the comm thread's barrier, as the benchmark's)
        barrier = get_transport().barrier if world.size > 1 else None
        order += [(f"{i}+lockstep", (t, barrier)) for i, t in trainers.items()]
    steps = {label: [] for label, _ in order}
    with frozen_heap():
        for r in range(rounds):
            for label, (trainer, sync) in rotated(order, r):
                with no_collection():
                    steps[label] += [timed_step(trainer, sync) for _ in range(3)]
    for label, taken in steps.items():
        total = statistics.median(sum(s[p][0] for p in PHASES) for s in taken) * 1e3
        parts = "  ".join(f"{p} {statistics.median(s[p][0] for s in taken) * 1e3:.1f} / "
                          f"{statistics.median(s[p][1] for s in taken) * 1e3:.1f}" for p in PHASES)
        print(f"rank {world.rank} {model} {label:24s} step {total:6.1f} ms   {parts}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
