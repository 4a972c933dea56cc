"""portddp.torch beside native PyTorch DDP: same model, same data, same buckets.

    mpirun -n 2 python -m experiments.torch_ddp
    mpirun -n 2 python -m experiments.torch_ddp --width 256 --rounds 2   # quick look

Trains the benchmark MLP (8 x Linear(1024, 1024), batch 64 per rank) with
native DDP, portddp.torch over c10d, portddp.torch over MPI, and a local step
with no communication at all (the limit), interleaved round by round so that
the machine's noise hits all of them alike. Prints per-iteration medians, the
DESIGN.md metrics of each, the largest parameter difference to native DDP, and
a last line of ratios; writes the numbers as JSON.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.distributed as dist
from torch import nn

import portddp
from experiments.common import METRICS, environment, median, parse_config, print_results, ratios, write_result
from experiments.impls import MLPConfig
from portddp.data import regression_batch
from portddp.models import TorchMLP
from portddp.torch import DistributedDataParallel

IMPLEMENTATIONS = ("native", "portddp-c10d", "portddp-mpi", "local")


@dataclasses.dataclass
class Config(MLPConfig):  # the benchmark MLP's width, depth, batch, lr and seed, plus:
    warmup: int = dataclasses.field(default=5, metadata={"help": "untimed steps per implementation"})
    rounds: int = dataclasses.field(default=5, metadata={"help": "interleaved rounds"})
    steps_per_round: int = dataclasses.field(default=6, metadata={"help": "timed steps per implementation per round"})
    bucket_cap_mb: float = dataclasses.field(default=25.0, metadata={"help": "bucket cap (MB), all implementations"})
    first_bucket_cap_mb: float = dataclasses.field(default=1.0, metadata={"help": "first bucket cap (MB)"})
    impls: tuple[str, ...] = dataclasses.field(default=IMPLEMENTATIONS, metadata={"help": "what to run"})
    out: str = dataclasses.field(default="results/torch_ddp.json", metadata={"help": "JSON result path"})


class Runner:
    """One implementation: its own model copy, optimizer and timings."""

    def __init__(self, impl: str, cfg: Config):
        torch.manual_seed(cfg.seed)
        self.impl = impl
        self.model = TorchMLP(cfg.width, cfg.depth)
        if impl == "native":
            # Native DDP applies first_bucket_cap_mb only with its default cap.
            default = (cfg.bucket_cap_mb, cfg.first_bucket_cap_mb) == (25.0, 1.0)
            self.wrapped = nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=None if default else cfg.bucket_cap_mb)
        elif impl.startswith("portddp-"):
            self.wrapped = DistributedDataParallel(
                self.model, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_cap_mb=cfg.first_bucket_cap_mb,
                transport=impl.removeprefix("portddp-"))
        elif impl == "local":
            self.wrapped = self.model  # same step, no communication: the limit
        else:
            raise ValueError(f"unknown implementation {impl!r}: choose from {IMPLEMENTATIONS}")
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        self.times: list[float] = []
        self.metrics: list[dict] = []
        self.steps = 0
        self.loss = math.nan

    def step(self, cfg: Config, rank: int, timed: bool) -> None:
        x, y = (torch.from_numpy(a) for a in regression_batch(cfg.seed, self.steps, rank, cfg.batch,
                                                               cfg.width, cfg.width))
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss = nn.functional.mse_loss(self.wrapped(x), y)
        loss.backward()
        self.opt.step()
        elapsed = time.perf_counter() - t0
        self.steps += 1
        self.loss = loss.item()
        if timed:
            self.times.append(elapsed)
            if isinstance(self.wrapped, DistributedDataParallel):
                self.metrics.append({k: self.wrapped.stats()[k] for k in METRICS})

    def summary(self) -> dict:
        out = {"median_s": median(self.times), "steps": self.steps, "loss": self.loss,
               "metrics": {k: median([m[k] for m in self.metrics]) for k in METRICS} if self.metrics else {}}
        if self.impl == "native":
            data = self.wrapped._get_ddp_logging_data()
            # Native DDP's own view of the same three quantities (ns, averaged over its samples).
            out["metrics"] = {k: data.get(f"avg_{k}", 0) * 1e-9 for k in METRICS[:3]}
        return out


def main(argv=None) -> dict:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    world = portddp.init()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"portddp.torch demo: {world.size} ranks ({world.launcher}), {cfg.depth} x Linear({cfg.width}, {cfg.width}), "
        f"batch {cfg.batch}/rank, bucket cap {cfg.bucket_cap_mb} MB, {torch.get_num_threads()} thread(s)/rank")
    runners = [Runner(impl, cfg) for impl in cfg.impls]
    for r in runners:
        for _ in range(cfg.warmup):
            r.step(cfg, world.rank, timed=False)
    for rnd in range(cfg.rounds):
        # Interleaved: each round gives every implementation the same slice of machine time.
        for r in runners:
            for _ in range(cfg.steps_per_round):
                r.step(cfg, world.rank, timed=True)
        say(f"  round {rnd + 1}/{cfg.rounds}: " + "  ".join(
            f"{r.impl} {median(r.times) * 1e3:.1f} ms" for r in runners), flush=True)

    results = {r.impl: r.summary() for r in runners}
    by_impl = {r.impl: r for r in runners}
    if "native" in by_impl:
        ref = list(by_impl["native"].model.parameters())
        for r in runners:
            if r.impl != "local":
                results[r.impl]["max_param_diff_vs_native"] = max(
                    (a - b).abs().max().item() for a, b in zip(r.model.parameters(), ref))
    # Every rank checks the others hold the same parameters (they should: same mean gradients).
    for r in runners:
        if r.impl != "local":
            flat = torch.cat([p.detach().reshape(-1) for p in r.model.parameters()])
            spread = flat.clone()
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
            results[r.impl]["ranks_identical"] = bool(torch.equal(spread, flat))

    headline = ratios(results, "native", "vs_native") | ratios(results, "local", "vs_limit")
    if world.rank == 0:
        print_results(results, "per-iteration medians (rank 0); times in ms",
                      {"max |Δparam| vs native": "max_param_diff_vs_native", "ranks identical": "ranks_identical"})
        print("native DDP's metrics are its own (_get_ddp_logging_data averages); the others are portddp's events.")
        path = write_result(cfg.out, {"config": dataclasses.asdict(cfg), "world": dataclasses.asdict(world),
                                      "environment": environment(), "results": results, "ratios": headline})
        print(f"wrote {path}")
        print(" ".join(f"{k}={v:.3f}" for k, v in headline.items()))
    return results


if __name__ == "__main__":
    main()
