"""portddp.jax's strategies side by side on the torch demo's model and data.

    mpirun -n 2 python -m experiments.jax_ddp
    mpirun -n 2 python -m experiments.jax_ddp --width 256 --rounds 2   # quick look

Trains the benchmark MLP (8 x Linear(1024, 1024), batch 64 per rank, the same
initial weights as experiments.torch_ddp) with the hooked strategy (custom_vjp
taps + MPI comm thread), the compiled strategy (shard_map, XLA schedules the
psums) and the same jitted step with no communication (the limit), interleaved
round by round. Prints per-iteration medians, the DESIGN.md metrics (hooked),
what XLA made of the psums (compiled), the largest difference to one process
training on the global batch, and a last line of ratios; writes JSON.
"""

from __future__ import annotations

import dataclasses
import math
import time

import portddp
from experiments.common import METRICS, environment, median, parse_config, print_results, ratios, write_result
from experiments.impls import MLPConfig

IMPLEMENTATIONS = ("hooked", "compiled", "local")


@dataclasses.dataclass
class Config(MLPConfig):  # the benchmark MLP's width, depth, batch, lr and seed, plus:
    warmup: int = dataclasses.field(default=5, metadata={"help": "untimed steps per implementation (compiles)"})
    rounds: int = dataclasses.field(default=5, metadata={"help": "interleaved rounds"})
    steps_per_round: int = dataclasses.field(default=6, metadata={"help": "timed steps per implementation per round"})
    bucket_cap_mb: float = dataclasses.field(default=25.0, metadata={"help": "bucket cap (MB)"})
    first_bucket_cap_mb: float = dataclasses.field(default=1.0, metadata={"help": "first bucket cap (MB)"})
    impls: tuple[str, ...] = dataclasses.field(default=IMPLEMENTATIONS, metadata={"help": "what to run"})
    reference: bool = dataclasses.field(default=True, metadata={"help": "train the global-batch reference on rank 0"})
    out: str = dataclasses.field(default="results/jax_ddp.json", metadata={"help": "JSON result path"})


def main(argv=None) -> dict:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    unknown = [i for i in cfg.impls if i not in IMPLEMENTATIONS]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}: choose from {IMPLEMENTATIONS}")
    world = portddp.init(torch_distributed=False, jax_distributed="compiled" in cfg.impls)

    import jax  # noqa: PLC0415 -- after init(): XLA threads and jax.distributed are set up first
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from portddp.data import global_batch, regression_batch  # noqa: PLC0415
    from portddp.jax import DistributedDataParallel  # noqa: PLC0415
    from portddp.models import build_twin, jax_order  # noqa: PLC0415
    from portddp.transport import get_transport  # noqa: PLC0415

    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"portddp.jax demo: {world.size} ranks ({world.launcher}), {cfg.depth} x Linear({cfg.width}, {cfg.width}), "
        f"batch {cfg.batch}/rank, bucket cap {cfg.bucket_cap_mb} MB, jax {jax.__version__}")
    # The torch demo's model: the same seed gives the same initial weights.
    twin = build_twin("mlp", "bench", seed=cfg.seed, width=cfg.width, depth=cfg.depth)
    graphdef, init_params = nnx.split(twin.nnx_model, nnx.Param)
    order = jax_order(twin.torch_model, init_params)

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    opt = optax.sgd(cfg.lr, momentum=0.9)
    update = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2))(*opt.update(g, s, p)))

    class Runner:
        def __init__(self, impl: str):
            self.impl, self.params, self.times, self.metrics, self.steps = impl, init_params, [], [], 0
            self.opt_state = opt.init(init_params)
            if impl == "local":
                self.ddp, self.grad_fn = None, jax.jit(jax.value_and_grad(loss_fn))
            else:
                self.ddp = DistributedDataParallel(init_params, cfg.bucket_cap_mb, cfg.first_bucket_cap_mb,
                                                   strategy=impl, order=order)
                self.params = self.ddp.broadcast(init_params)
                self.grad_fn = self.ddp.value_and_grad(loss_fn)
            self.loss = math.nan

        def step(self, timed: bool):
            batch = regression_batch(cfg.seed, self.steps, world.rank, cfg.batch, cfg.width, cfg.width)
            t0 = time.perf_counter()
            loss, grads = self.grad_fn(self.params, batch)
            self.params, self.opt_state = update(self.params, self.opt_state, grads)
            jax.block_until_ready(self.params)
            elapsed = time.perf_counter() - t0
            self.steps += 1
            self.loss = float(loss)
            if timed:
                self.times.append(elapsed)
                if self.impl == "hooked":
                    stats = self.ddp.stats()
                    self.metrics.append({k: stats[k] for k in METRICS})

        def summary(self) -> dict:
            out = {"median_s": median(self.times), "steps": self.steps, "loss": self.loss,
                   "metrics": {k: median([m[k] for m in self.metrics]) for k in METRICS} if self.metrics else {}}
            if self.impl == "compiled":
                hlo = self.ddp.stats()["hlo"]
                out["hlo"] = hlo
                out["xla_all_reduces"] = f"{hlo['all_reduces']} for {len(self.ddp.bucket_plan.buckets)} buckets"
            return out

    runners = [Runner(impl) for impl in cfg.impls]
    for r in runners:
        for _ in range(cfg.warmup):
            r.step(timed=False)
    for rnd in range(cfg.rounds):
        for r in runners:
            for _ in range(cfg.steps_per_round):
                r.step(timed=True)
        say(f"  round {rnd + 1}/{cfg.rounds}: " + "  ".join(
            f"{r.impl} {median(r.times) * 1e3:.1f} ms" for r in runners), flush=True)
    results = {r.impl: r.summary() for r in runners}

    if cfg.reference:
        # One process, the concatenated global batch, the same number of steps.
        ref = None
        if world.rank == 0:
            say("  training the single-process global-batch reference ...", flush=True)
            grad = jax.jit(jax.grad(loss_fn))
            ref, state = init_params, opt.init(init_params)
            for step in range(runners[0].steps):
                gb = global_batch(regression_batch, world.size, cfg.seed, step, batch=cfg.batch, in_dim=cfg.width,
                                  out_dim=cfg.width)
                ref, state = update(ref, state, grad(ref, gb))
            ref = [np.asarray(v) for v in jax.tree.leaves(ref)]
        ref = get_transport().bcast_object(ref)
        for r in runners:
            if r.impl != "local":
                results[r.impl]["max_rel_diff_vs_global_batch"] = max(
                    float(np.abs(np.asarray(a) - b).max() / max(1.0, np.abs(b).max()))
                    for a, b in zip(jax.tree.leaves(r.params), ref))

    headline = ratios(results, "local", "vs_limit")
    if "hooked" in results and results["hooked"]["metrics"]:
        headline["hooked_overlap"] = results["hooked"]["metrics"]["overlap_ratio"]
    if world.rank == 0:
        print_results(results, "per-iteration medians (rank 0); times in ms",
                      {"max rel Δ vs global batch": "max_rel_diff_vs_global_batch",
                       "XLA all-reduces": "xla_all_reduces"})
        path = write_result(cfg.out, {"config": dataclasses.asdict(cfg), "world": dataclasses.asdict(world),
                                      "environment": environment() | {"jax": jax.__version__},
                                      "results": results, "ratios": headline})
        print(f"wrote {path}")
        print(" ".join(f"{k}={v:.3f}" for k, v in headline.items()))
    return results


if __name__ == "__main__":
    main()
