"""Same model, same weights, same per-rank batches: is it the same training?

    mpirun -n 2 python -m comparisons.equivalence --model gpt --steps 10 --dtype float64 --optimizer adamw
    mpirun -n 3 python -m comparisons.equivalence --model cnn --dtype float32

Trains one twin model (portddp.models) for K optimizer steps with every
implementation and compares, per step, the loss, the reduced gradients and the
parameters (JAX values converted to PyTorch layout) against a reference:

    torch-ref        one PyTorch process on the global batch (the reference)
    native-ddp       torch.nn.parallel.DistributedDataParallel (Gloo)
    torch-c10d       portddp.torch over c10d        torch-mpi   portddp.torch over MPI
    jax-hooked       portddp.jax, hooked            jax-compiled portddp.jax, compiled
    jax-ref          one JAX process on the global batch

For `cnn` the reference is native DDP: BatchNorm normalises with each rank's
own batch statistics, by design, so no single process computes the same thing.
Deviation = max over tensors of max|a - b| / max(1, max|b|), worst over steps
and ranks. Each implementation is also compared with its own framework's
single-process reference (jax-* with jax-ref), which separates what DDP does
from what two frameworks' kernels do. Prints a table, writes JSON and a `step
loss` file per implementation, and exits 1 if a deviation exceeds its bound.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import portddp
from harness.adapter import Workload, make_trainer
from harness.compare import BOUNDS, SAME_FRAMEWORK_BOUND, worst_deviation
from harness.results import out_dir_problem
from harness.config import parse_config
from harness.results import environment, write_result
from portddp.launch import detect

IMPLS = ("torch-ref", "native-ddp", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled", "jax-ref")
ADAPTER = {"torch-ref": "torch-local", "native-ddp": "native", "jax-ref": "jax-local"}
"""This harness's names -> harness.adapter's implementations (the -ref ones train on the global batch)."""


@dataclasses.dataclass
class Config:
    model: str = dataclasses.field(default="mlp", metadata={"help": "mlp, cnn or gpt"})
    size: str = dataclasses.field(default="tiny", metadata={"help": "tiny or bench"})
    steps: int = dataclasses.field(default=5, metadata={"help": "optimizer steps", "least": 1})
    dtype: str = dataclasses.field(default="float64", metadata={"help": "float64 or float32"})
    optimizer: str = dataclasses.field(default="sgd", metadata={"help": "sgd (momentum 0.9) or adamw"})
    global_batch: int = dataclasses.field(default=12, metadata={"help": "samples per step over all ranks", "least": 1})
    lr: float = dataclasses.field(default=0.05, metadata={"help": "learning rate (adamw: lr / 10)", "least": 0})
    bucket_cap_mb: float = dataclasses.field(default=0.01, metadata={"help": "bucket cap: several buckets", "above": 0})
    seed: int = dataclasses.field(default=0, metadata={"help": "weights and data seed"})
    impls: tuple[str, ...] = dataclasses.field(default=IMPLS, metadata={"help": "implementations to run"})
    out: str = dataclasses.field(default="results/equivalence", metadata={"help": "output directory"})


def workload(cfg: Config, world_size: int) -> Workload:
    """The model, data and optimizer every implementation trains (validated; the batch is per rank)."""
    work = Workload(model=cfg.model, size=cfg.size, batch=max(1, cfg.global_batch // world_size), dtype=cfg.dtype,
                    optimizer=cfg.optimizer, lr=cfg.lr, seed=cfg.seed)
    work.validate(world_size)
    return work


def make_runner(name: str, work: Workload, world, cfg: Config):
    """One implementation, by this harness's name, with several buckets; JAX in the PyTorch twin's layout."""
    return make_trainer(ADAPTER.get(name, name), work, world, global_batch=name.endswith("-ref"),
                        bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=cfg.bucket_cap_mb / 4,
                        torch_layout=name.startswith("jax"))


def validate(cfg: Config, world_size: int) -> None:
    unknown = [i for i in cfg.impls if i not in IMPLS]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}: choose from {IMPLS}")
    if cfg.global_batch % world_size:
        raise SystemExit(f"--global-batch {cfg.global_batch} is not divisible by the world size {world_size}: "
                         f"pass a multiple of {world_size}")
    problem = out_dir_problem(cfg.out, "--out")
    if problem:
        raise SystemExit(problem)


def reference_of(cfg: Config) -> str:
    return "native-ddp" if cfg.model == "cnn" else "torch-ref"


def main(argv=None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    validate(cfg, detect().size)
    work = workload(cfg, detect().size)
    world = portddp.init(jax_distributed=any(i.startswith("jax") for i in cfg.impls))

    import jax  # noqa: PLC0415 -- after init(): XLA threads and jax.distributed come first

    jax.config.update("jax_enable_x64", cfg.dtype == "float64")
    import numpy as np  # noqa: PLC0415

    from portddp.transport import get_transport  # noqa: PLC0415

    transport = get_transport()
    ref_name = reference_of(cfg)
    impls = [i for i in cfg.impls if not (cfg.model == "cnn" and i.endswith("-ref"))]
    if len(impls) < len(cfg.impls):
        say = print if world.rank == 0 else (lambda *a, **k: None)
        say("cnn: single-process references skipped -- BatchNorm uses each rank's own batch statistics")
    # References first: each implementation is compared with them as it finishes.
    order = sorted(impls, key=lambda i: (i != ref_name, not i.endswith("-ref")))
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"equivalence: {cfg.model} ({cfg.size}), {cfg.dtype}, {cfg.optimizer}, {cfg.steps} steps, "
        f"{world.size} rank{'s' if world.size != 1 else ''}, global batch {cfg.global_batch}; reference: {ref_name}")

    reference = None
    own_refs: dict = {}  # framework -> trace of its single-process reference, when it runs
    results = {}
    for name in order:
        runner = make_runner(name, work, world, cfg)
        trace = []
        for _ in range(cfg.steps):
            runner.step()
            trace.append(runner.trace())
        # Every implementation's loss as the global-batch loss: the mean over ranks of the local ones.
        gathered = transport.allgather_object([t.loss for t in trace])
        losses = gathered[0] if runner.global_batch else [float(np.mean([g[k] for g in gathered]))
                                                         for k in range(cfg.steps)]
        if name == ref_name:
            reference = (losses, trace)
        framework = name.split("-")[0] if name != "native-ddp" else "torch"
        if name.endswith("-ref"):
            own_refs[framework] = (losses, trace)
        dev = worst_deviation(losses, trace, reference)
        # The verdict must be the same on every rank: take the worst rank's numbers.
        dev = {k: max(v) for k, v in zip(dev, zip(*transport.allgather_object(list(dev.values()))))}
        own = own_refs.get(framework)
        own_dev = None
        if own is not None and cfg.model != "cnn":
            own_dev = worst_deviation(losses, trace, own)
            own_dev = max(max(v) for v in zip(*transport.allgather_object(list(own_dev.values()))))
        ok = max(dev.values()) <= BOUNDS[cfg.dtype] and (own_dev is None or own_dev <= SAME_FRAMEWORK_BOUND[cfg.dtype])
        results[name] = {"deviation": dev, "same_framework_deviation": own_dev, "losses": losses, "ok": ok}
        say(f"  {name:<13} worst deviation {max(dev.values()):.3g}"
            + (f" (from its own framework's reference {own_dev:.3g})" if own_dev is not None else ""), flush=True)

    ok = all(r["ok"] for r in results.values())
    if world.rank == 0:
        out = Path(cfg.out) / f"{cfg.model}-{cfg.dtype}-{cfg.optimizer}-n{world.size}"
        print_table(results, ref_name, BOUNDS[cfg.dtype], SAME_FRAMEWORK_BOUND[cfg.dtype])
        write_result(out / "result.json", {"config": dataclasses.asdict(cfg), "world": dataclasses.asdict(world),
                                           "environment": environment(), "reference": ref_name,
                                           "bound": BOUNDS[cfg.dtype],
                                           "same_framework_bound": SAME_FRAMEWORK_BOUND[cfg.dtype], "ok": ok,
                                           "results": results})
        for name, r in results.items():
            (out / f"{name}.loss.txt").write_text("".join(f"{k} {x!r}\n" for k, x in enumerate(r["losses"])))
        print(f"wrote {out}/")
        print("EQUIVALENT" if ok else "NOT EQUIVALENT: a deviation exceeds its bound")
    return 0 if ok else 1


def print_table(results: dict, ref_name: str, bound: float, same_bound: float) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=f"worst relative deviation from {ref_name} over all steps and ranks (bound {bound:g}). "
                        f"Last column: from the own framework's reference (bound {same_bound:g})")
    for col in ("implementation", "loss", "reduced grads", "params", "vs own framework", "ok"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        d, own = r["deviation"], r["same_framework_deviation"]
        table.add_row(name, f"{d['loss']:.2e}", f"{d['grads']:.2e}", f"{d['params']:.2e}",
                      "-" if own is None else f"{own:.2e}", "yes" if r["ok"] else "NO")
    Console(width=120).print(table)


if __name__ == "__main__":
    sys.exit(main())
