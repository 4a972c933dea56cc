"""Every implementation behind one small interface, for the experiments.

    trainer = make_trainer("jax-hooked", model_cfg, world, bucket_cap_mb=4.0, overlap=False)
    seconds = trainer.step()             # one optimizer step, blocking
    trainer.events()                     # IterationEvents of that step (portddp only)

Implementations: "native" (torch.nn.parallel.DistributedDataParallel), "torch-c10d",
"torch-mpi" (portddp.torch), "jax-hooked", "jax-compiled" (portddp.jax),
"torch-local" / "jax-local" (the same step with no communication: the limits).
The model is the benchmark MLP (portddp.models.TorchMLP and its NNX twin) on
synthetic regression data (model="mlp"), or the ~25M-parameter `gpt` twin on
characters (model="gpt"); SGD with momentum.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

IMPLEMENTATIONS = ("native", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled", "torch-local", "jax-local")
HOOKS = ("none", "fp16", "bf16")


MODELS = ("mlp", "gpt")


@dataclasses.dataclass
class MLPConfig:
    width: int = dataclasses.field(default=1024, metadata={"help": "features per Linear layer"})
    depth: int = dataclasses.field(default=8, metadata={"help": "number of Linear layers"})
    batch: int = dataclasses.field(default=64, metadata={"help": "samples per rank per step"})
    lr: float = dataclasses.field(default=0.01, metadata={"help": "SGD learning rate (momentum 0.9)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "model and data seed"})


@dataclasses.dataclass
class ModelConfig(MLPConfig):
    model: str = dataclasses.field(default="mlp", metadata={"help": "mlp (width x depth Linear) or gpt (~25M)"})
    seq: int = dataclasses.field(default=64, metadata={"help": "gpt: tokens per sequence (<= 128)"})


class Workload:
    """One model's twins, its per-rank batches and its loss in both frameworks."""

    def __init__(self, cfg: ModelConfig):
        from portddp.models import GPTConfig  # noqa: PLC0415

        if cfg.model not in MODELS:
            raise SystemExit(f"unknown model {cfg.model!r}: choose one of {MODELS}")
        self.cfg = cfg
        self.args = {"width": cfg.width, "depth": cfg.depth} if cfg.model == "mlp" else {"cfg": GPTConfig.bench()}
        if cfg.model == "gpt" and not 1 <= cfg.seq <= GPTConfig.bench().block_size:
            raise SystemExit(f"--seq {cfg.seq}: the gpt bench model takes 1..{GPTConfig.bench().block_size} tokens")

    def torch_model(self):
        """The PyTorch model alone (no JAX import, no twin held in memory)."""
        import torch  # noqa: PLC0415

        from portddp.models import TorchGPT, TorchMLP  # noqa: PLC0415

        torch.manual_seed(self.cfg.seed)  # as build_twin does: the same initial values
        return (TorchMLP if self.cfg.model == "mlp" else TorchGPT)(**self.args)

    def twin(self):
        from portddp.models import build_twin  # noqa: PLC0415

        return build_twin(self.cfg.model, "bench", seed=self.cfg.seed, **self.args)

    def describe(self) -> str:
        cfg = self.cfg
        if cfg.model == "mlp":
            return f"{cfg.depth} x Linear({cfg.width}), batch {cfg.batch}/rank"
        return f"gpt ({self.args['cfg'].n_layer} layers x {self.args['cfg'].n_embd}, ~25M parameters), " \
               f"batch {cfg.batch} x {cfg.seq} tokens/rank"

    def batch(self, step: int, rank: int):
        from portddp.data import char_batch, regression_batch  # noqa: PLC0415

        cfg = self.cfg
        if cfg.model == "mlp":
            return regression_batch(cfg.seed, step, rank, cfg.batch, cfg.width, cfg.width)
        return char_batch(cfg.seed, step, rank, cfg.batch, cfg.seq)

    def torch_loss(self, out, y):
        import torch  # noqa: PLC0415

        from portddp.models import torch_loss  # noqa: PLC0415

        return torch.nn.functional.mse_loss(out, y) if self.cfg.model == "mlp" else torch_loss(out, y)

    def jax_loss(self, out, y):
        import jax.numpy as jnp  # noqa: PLC0415

        from portddp.models import jax_loss  # noqa: PLC0415

        return jnp.mean((out - y) ** 2) if self.cfg.model == "mlp" else jax_loss(out, y)


def check_implementations(names, allowed=IMPLEMENTATIONS) -> None:
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}: choose from {allowed}")


class TorchTrainer:
    def __init__(self, impl: str, cfg: ModelConfig, world, bucket_cap_mb=25.0, first_bucket_cap_mb=1.0,
                 overlap=True, hook="none", no_sync_every=1, gradient_as_bucket_view=False):
        import torch  # noqa: PLC0415
        from torch import nn  # noqa: PLC0415

        from portddp.torch import DistributedDataParallel, bf16_compress_hook, fp16_compress_hook  # noqa: PLC0415

        self.impl, self.cfg, self.world, self.no_sync_every = impl, cfg, world, no_sync_every
        self.work = Workload(cfg)
        self.model = self.work.torch_model()
        if impl == "native":
            if not overlap:
                raise ValueError("native DDP has no overlap switch")
            default = (bucket_cap_mb, first_bucket_cap_mb) == (25.0, 1.0)
            self.wrapped = nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=None if default else min(bucket_cap_mb, 2.0**40),
                gradient_as_bucket_view=gradient_as_bucket_view)
        elif impl == "torch-local":
            self.wrapped = self.model
        else:
            self.wrapped = DistributedDataParallel(self.model, bucket_cap_mb=bucket_cap_mb,
                                                   first_bucket_cap_mb=first_bucket_cap_mb,
                                                   transport=impl.removeprefix("torch-"), overlap=overlap,
                                                   gradient_as_bucket_view=gradient_as_bucket_view)
        if hook != "none":
            self.wrapped.register_comm_hook(None, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[hook])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        self.steps, self.loss = 0, math.nan
        self._torch = torch

    def step(self) -> float:
        torch = self._torch
        t0 = time.perf_counter()
        self.opt.zero_grad()
        for m in range(self.no_sync_every):
            x, y = (torch.from_numpy(a) for a in self.work.batch(self.steps * 64 + m, self.world.rank))
            last = m == self.no_sync_every - 1
            local = not last and hasattr(self.wrapped, "no_sync")
            ctx = self.wrapped.no_sync() if local else contextlib.nullcontext()
            with ctx:
                loss = self.work.torch_loss(self.wrapped(x), y)
                loss.backward()
        self.opt.step()
        self.steps += 1
        self.loss = loss.item()
        return time.perf_counter() - t0

    def events(self):
        stats = getattr(self.wrapped, "stats", None)
        return stats().get("events") if stats else None

    def param_bytes(self) -> int:
        """Bytes of the trainable parameters: what one all-reduce per step carries."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def plan(self) -> dict | None:
        """The bucket plan in use (its JSON form), for portddp.simulate to re-plan from."""
        plan = getattr(self.wrapped, "bucket_plan", None)
        return plan.to_dict() if plan is not None else None

    def grad_mb(self) -> float | None:
        """Memory holding gradients after a step: every distinct storage behind a .grad, plus
        portddp's bucket buffers (with gradient_as_bucket_view they are the same storage).
        None for native DDP, whose bucket buffers live inside its C++ reducer."""
        if self.impl == "native":
            return None
        tensors = [p.grad for p in self.model.parameters() if p.grad is not None]
        tensors += getattr(self.wrapped, "_bucket_buffers", [])
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values()) / 2**20

    def autotune(self) -> dict | None:
        """bucket_cap_mb="auto": what it tried and chose (portddp only)."""
        stats = getattr(self.wrapped, "stats", None)
        return stats().get("autotune") if stats else None

    def stats(self) -> dict:
        if self.impl == "native":
            data = self.wrapped._get_ddp_logging_data()
            keys = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
            return {k: data.get(f"avg_{k}", 0) * 1e-9 for k in keys}
        stats = getattr(self.wrapped, "stats", None)
        return {k: v for k, v in stats().items() if isinstance(v, float)} if stats else {}


class JaxTrainer:
    def __init__(self, impl: str, cfg: ModelConfig, world, bucket_cap_mb=25.0, first_bucket_cap_mb=1.0,
                 overlap=True, hook="none", no_sync_every=1, gradient_as_bucket_view=False):
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        import optax  # noqa: PLC0415
        from flax import nnx  # noqa: PLC0415

        from portddp.jax import DistributedDataParallel, bf16_compress_hook, fp16_compress_hook  # noqa: PLC0415
        from portddp.models import jax_order  # noqa: PLC0415

        if gradient_as_bucket_view:
            raise ValueError("gradient_as_bucket_view is a portddp.torch knob: JAX gradients are fresh arrays")
        self.impl, self.cfg, self.world, self.no_sync_every = impl, cfg, world, no_sync_every
        self.work = work = Workload(cfg)
        twin = work.twin()
        graphdef, params = nnx.split(twin.nnx_model, nnx.Param)

        def loss_fn(p, batch):
            x, y = batch
            return work.jax_loss(nnx.merge(graphdef, p)(x), y)

        if impl == "jax-local":
            self.ddp = None
            local = jax.jit(jax.value_and_grad(loss_fn))
            self.grad_fn = lambda p, b, sync=True: local(p, b)
        else:
            self.ddp = DistributedDataParallel(params, bucket_cap_mb, first_bucket_cap_mb,
                                               strategy=impl.removeprefix("jax-"), overlap=overlap,
                                               # PyTorch's order (same plan); the JAX layout, so no transposes
                                               order=jax_order(twin.torch_model, params))
            if hook != "none":
                self.ddp.register_comm_hook(None, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[hook])
            params = self.ddp.broadcast(params)
            self.grad_fn = self.ddp.value_and_grad(loss_fn)
        opt = optax.sgd(cfg.lr, momentum=0.9)
        self.params, self.opt_state = params, opt.init(params)

        def update(p, s, g):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        self.update = jax.jit(update)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        self.steps, self.loss = 0, math.nan
        self._jax = jax

    def step(self) -> float:
        t0 = time.perf_counter()
        acc = None
        for m in range(self.no_sync_every):
            batch = self.work.batch(self.steps * 64 + m, self.world.rank)
            last = m == self.no_sync_every - 1
            if self.no_sync_every == 1:
                loss, grads = self.grad_fn(self.params, batch)
            else:
                loss, g = self.grad_fn(self.params, batch, sync=False)
                acc = g if acc is None else self.add(acc, g)
                grads = self.ddp.reduce(acc) if last and self.ddp is not None else acc
        self.params, self.opt_state = self.update(self.params, self.opt_state, grads)
        self._jax.block_until_ready(self.params)
        self._grads = grads
        self.steps += 1
        self.loss = float(loss)
        t1 = time.perf_counter()
        self._span = (int(t0 * 1e9), int(t1 * 1e9))  # perf_counter_ns's clock, as the events use
        return t1 - t0

    def events(self):
        from portddp.timeline import IterationEvents  # noqa: PLC0415

        if self.ddp is None:
            return None
        if self.ddp.strategy == "compiled":
            # XLA schedules compute and all-reduces inside one program: the step is the one span we see.
            return IterationEvents(rank=self.world.rank, forward_start_ns=self._span[0], finalize_end_ns=self._span[1])
        return self.ddp.stats().get("events")

    def stats(self) -> dict:
        if self.ddp is None:
            return {}
        return {k: v for k, v in self.ddp.stats().items() if isinstance(v, (float, int, dict)) and k != "events"}

    def autotune(self) -> dict | None:
        return self.ddp.stats().get("autotune") if self.ddp is not None else None

    def param_bytes(self) -> int:
        """Bytes of the trainable parameters: what one all-reduce per step carries."""
        return sum(x.nbytes for x in self._jax.tree.leaves(self.params))

    def plan(self) -> dict | None:
        """The bucket plan in use (its JSON form), for portddp.simulate to re-plan from."""
        return self.ddp.bucket_plan.to_dict() if self.ddp is not None else None

    def grad_mb(self) -> float | None:
        """The gradient pytree of the last step plus, for hooked, the host bucket buffers."""
        leaves = self._jax.tree.leaves(self._grads)
        host = self.ddp._buffers if self.ddp is not None and self.ddp.strategy == "hooked" else []
        return (sum(x.nbytes for x in leaves) + sum(b.nbytes for b in host)) / 2**20


def make_trainer(impl: str, cfg: ModelConfig, world, **knobs):
    check_implementations([impl])
    return (JaxTrainer if impl.startswith("jax") else TorchTrainer)(impl, cfg, world, **knobs)
