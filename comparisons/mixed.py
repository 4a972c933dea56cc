"""One DDP job, two frameworks: even ranks train with PyTorch, odd ranks with JAX.

    mpirun -n 2 python -m comparisons.mixed                  # rank 0 PyTorch, rank 1 JAX
    mpirun -n 3 python -m comparisons.mixed --model gpt

portddp.torch (transport="mpi", no c10d group at all) and portddp.jax
(strategy="hooked", with the PyTorch twin's names and layout) speak the same
protocol (portddp.protocol): the same specs check, the same per-bucket
broadcast, the same bucket plan and flat layout, the same rebuild and the same
all-reduces in the same order. So every all-reduce sums PyTorch gradients with
JAX gradients. Checked each step: every rank's parameters against every other
rank's (lockstep: bitwise equal, since both frameworks apply the momentum
update with the same roundings, harness.adapter.UnfusedSGD) and against one PyTorch
process on the global batch (within the harness's bound for the dtype). Exits
1 if either check fails.
"""

from __future__ import annotations

import dataclasses
import sys

import portddp
from harness.adapter import Workload, make_trainer
from harness.compare import BOUNDS, deviation
from harness.config import parse_config
from portddp.launch import detect


@dataclasses.dataclass
class Config:
    model: str = dataclasses.field(default="mlp", metadata={"help": "mlp or gpt (models without buffers)"})
    size: str = dataclasses.field(default="tiny", metadata={"help": "tiny or bench"})
    steps: int = dataclasses.field(default=5, metadata={"help": "optimizer steps", "least": 1})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "float32 or float64"})
    global_batch: int = dataclasses.field(default=12, metadata={"help": "samples per step over all ranks", "least": 1})
    lr: float = dataclasses.field(default=0.05, metadata={"help": "SGD learning rate (momentum 0.9)", "least": 0})
    bucket_cap_mb: float = dataclasses.field(default=0.01, metadata={"help": "bucket cap: several buckets", "above": 0})
    seed: int = dataclasses.field(default=0, metadata={"help": "weights and data seed"})


def main(argv=None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    if cfg.model == "cnn":
        raise SystemExit("--model cnn has BatchNorm buffers, which only PyTorch ranks would broadcast: "
                         "the mixed job takes mlp or gpt")
    world = detect()
    if world.size < 2:
        raise SystemExit(f"the mixed job needs 2 or more ranks (even ranks PyTorch, odd ranks JAX); this one has "
                         f"{world.size}: run `portddp mixed -n 2` (or mpirun -n 2 python -m comparisons.mixed)")
    if cfg.global_batch % world.size:
        raise SystemExit(f"--global-batch {cfg.global_batch} is not divisible by the world size {world.size}: "
                         f"pass a multiple of {world.size}")
    # Both frameworks round the momentum update identically (UnfusedSGD): the ranks can stay bitwise equal.
    work = Workload(model=cfg.model, size=cfg.size, batch=cfg.global_batch // world.size, dtype=cfg.dtype,
                    optimizer="sgd-unfused", lr=cfg.lr, seed=cfg.seed)
    work.validate(world.size)
    world = portddp.init(torch_distributed=False)  # MPI only: the PyTorch ranks need no c10d group
    framework = "torch" if world.rank % 2 == 0 else "jax"

    import jax  # noqa: PLC0415

    jax.config.update("jax_enable_x64", cfg.dtype == "float64")
    import numpy as np  # noqa: PLC0415

    from portddp.transport import get_transport  # noqa: PLC0415

    transport = get_transport()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"mixed job: {world.size} ranks -- " + ", ".join(
        f"rank {r} {'PyTorch' if r % 2 == 0 else 'JAX'}" for r in range(world.size)) +
        f"; {cfg.model} ({cfg.size}), {cfg.dtype}, {cfg.steps} SGD steps", flush=True)
    knobs = {"bucket_cap_mb": cfg.bucket_cap_mb, "first_bucket_cap_mb": cfg.bucket_cap_mb / 4}
    # One process on the global batch (no communication), then this rank's DDP; JAX in PyTorch's layout.
    reference = make_trainer("torch-local", work, world, global_batch=True)
    runner = (make_trainer("torch-mpi", work, world, **knobs) if framework == "torch" else
              make_trainer("jax-hooked", work, world, torch_layout=True, **knobs))
    spread = ref_dev = 0.0
    bitwise = True
    for k in range(cfg.steps):
        reference.step()
        runner.step()
        want, got = reference.trace(), runner.trace()
        everyone = transport.allgather_object(got.params)  # every rank's parameters, PyTorch layout
        spread = max(spread, max(deviation(theirs, everyone[0]) for theirs in everyone))
        bitwise &= all(np.array_equal(theirs[n], everyone[0][n]) for theirs in everyone for n in everyone[0])
        ref_dev = max(ref_dev, deviation(got.params, want.params), deviation(got.grads, want.grads))
        say(f"  step {k}: loss (rank 0) {got.loss:.6f}  ranks' spread {spread:.2e}  vs reference {ref_dev:.2e}",
            flush=True)
    rows = transport.allgather_object((world.rank, framework, ref_dev, runner.plan()))
    bound = BOUNDS[cfg.dtype]
    same_plan = all(r[3] == rows[0][3] for r in rows)
    # Lockstep means equal: every rank applies the same reduced gradients with the same rounding.
    ok = bitwise and all(r[2] <= bound for r in rows) and same_plan
    if world.rank == 0:
        for r, fw, dev, _ in rows:
            print(f"rank {r} ({fw:>5}): worst deviation from the single-process reference {dev:.2e} "
                  f"(bound {bound:g})")
        print(f"same bucket plan on every rank: {same_plan}; parameters across ranks: "
              f"{'bitwise equal' if bitwise else f'differ, max relative spread {spread:.2e} (they must be equal)'}")
        print("MIXED JOB OK" if ok else "MIXED JOB FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
