"""Every implementation behind one small interface: build it, step it, read what it did.

    work = Workload(model="mlp", size="bench", batch=64)           # model, data, loss, optimizer
    trainer = make_trainer("jax-hooked", work, world, bucket_cap_mb=4.0, overlap=False)
    seconds = trainer.step()             # one optimizer step, blocking
    trainer.loss                         # its loss (this rank's)
    trainer.trace()                      # its gradients and the parameters after it (PyTorch layout, numpy)
    trainer.events(), trainer.stats()    # IterationEvents and DESIGN.md metrics (portddp only)

Implementations: "native" (torch.nn.parallel.DistributedDataParallel, Gloo),
"torch-c10d", "torch-mpi" (portddp.torch), "jax-hooked", "jax-compiled"
(portddp.jax), "torch-local" / "jax-local" (the same step with no
communication: the limits; with `global_batch=True`, the single-process
references of the equivalence checks, trained on the concatenation of every
rank's batch). The experiments time them; the comparisons check their numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time

import numpy as np

__all__ = ["IMPLEMENTATIONS", "HOOKS", "OPTIMIZERS", "Workload", "StepTrace", "UnfusedSGD", "make_trainer",
           "check_implementations"]

IMPLEMENTATIONS = ("native", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled", "torch-local", "jax-local")
HOOKS = ("none", "fp16", "bf16")
OPTIMIZERS = ("sgd", "adamw", "sgd-unfused")  # sgd-unfused: see UnfusedSGD


@dataclasses.dataclass
class Workload:
    """What every implementation trains: one twin model (portddp.models), its data, loss and optimizer.

    Data: the `bench` mlp (no input/output layer of its own) learns a synthetic
    regression (MSE); the `tiny` mlp and the cnn classify scikit-learn's digits,
    gpt predicts the next character (cross entropy)."""

    model: str = dataclasses.field(default="mlp", metadata={"help": "mlp, cnn or gpt (portddp.models)"})
    size: str = dataclasses.field(default="bench", metadata={"help": "tiny or bench (portddp.models sizes)"})
    width: int = dataclasses.field(default=0, metadata={"help": "mlp: features per Linear layer (0: the size's; "
                                                                "bench 1024)"})
    depth: int = dataclasses.field(default=0, metadata={"help": "mlp: number of Linear layers (0: the size's; "
                                                                "bench 8)"})
    activation: str = dataclasses.field(default="relu", metadata={"help": "mlp: relu or gelu between the layers"})
    batch: int = dataclasses.field(default=64, metadata={"help": "samples (gpt: sequences) per rank per step", "least": 1})
    seq: int = dataclasses.field(default=0, metadata={"help": "gpt: tokens per sequence (0: its block size)"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "float32 or float64"})
    optimizer: str = dataclasses.field(default="sgd", metadata={"help": "sgd (momentum 0.9), adamw (lr / 10) or "
                                                                        "sgd-unfused"})
    lr: float = dataclasses.field(default=0.01, metadata={"help": "learning rate", "least": 0})
    seed: int = dataclasses.field(default=0, metadata={"help": "model and data seed"})

    def validate(self, world_size: int = 1) -> None:
        """Refuse what no implementation can train, naming the value and the choices."""
        from portddp.models import MODELS, SIZES  # noqa: PLC0415
        from portddp.models.mlp import ACTIVATIONS  # noqa: PLC0415

        for value, valid, what in ((self.model, MODELS, "model"), (self.size, SIZES, "size"),
                                   (self.dtype, ("float32", "float64"), "dtype"),
                                   (self.optimizer, OPTIMIZERS, "optimizer"), (self.activation, ACTIVATIONS,
                                                                                "activation")):
            if value not in valid:
                raise SystemExit(f"unknown {what} {value!r}: choose one of {valid}")
        if self.model == "gpt" and not 0 <= self.seq <= self.block_size:
            raise SystemExit(f"--seq {self.seq}: the {self.size} gpt takes 1..{self.block_size} tokens")
        if self.batch < 1:
            raise SystemExit(f"--batch {self.batch}: at least one sample per rank")

    # -- the model -----------------------------------------------------------------------
    @property
    def args(self) -> dict:
        """Constructor overrides for portddp.models (on top of the size's own arguments)."""
        if self.model != "mlp":
            return {}
        over = {"width": self.width, "depth": self.depth}
        return {k: v for k, v in over.items() if v} | ({"activation": self.activation}
                                                      if self.activation != "relu" else {})

    @property
    def block_size(self) -> int:
        from portddp.models import GPTConfig  # noqa: PLC0415

        return (GPTConfig.tiny() if self.size == "tiny" else GPTConfig.bench()).block_size

    @property
    def regression(self) -> bool:
        return self.model == "mlp" and self.size == "bench"

    def torch_model(self):
        """The PyTorch model alone (no JAX import, no twin held in memory)."""
        from portddp.models import build_torch  # noqa: PLC0415

        return build_torch(self.model, self.size, self.dtype, self.seed, **self.args)

    def twin(self):
        from portddp.models import build_twin  # noqa: PLC0415

        return build_twin(self.model, self.size, self.dtype, self.seed, **self.args)

    def describe(self) -> str:
        if self.model == "mlp" and self.size == "bench":
            act = "" if self.activation == "relu" else f" + {self.activation.upper()}"
            return f"{self.depth or 8} x Linear({self.width or 1024}){act}, batch {self.batch}/rank"
        if self.model == "gpt":
            return f"gpt ({self.size}), batch {self.batch} x {self.seq or self.block_size} tokens/rank"
        return f"{self.model} ({self.size}), batch {self.batch}/rank"

    # -- the data ------------------------------------------------------------------------
    def batch_for(self, step: int, rank: int, world_size: int | None = None):
        """(x, y) as numpy: rank `rank`'s batch of `step`, or with `world_size` the global batch
        (every rank's, concatenated in rank order: what a single process trains on)."""
        from portddp.data import global_batch, model_batch, regression_batch  # noqa: PLC0415

        if world_size is not None:
            return global_batch(lambda rank: self.batch_for(step, rank), world_size)
        if self.regression:
            width = self.width or 1024
            return regression_batch(self.seed, step, rank, self.batch, width, width, dtype=self.dtype)
        return model_batch(self.model, self.seed, step, rank, self.batch, dtype=self.dtype,
                           block_size=self.seq or self.block_size)

    def torch_loss(self, out, y):
        import torch  # noqa: PLC0415

        from portddp.models import torch_loss  # noqa: PLC0415

        return torch.nn.functional.mse_loss(out, y) if self.regression else torch_loss(out, y)

    def jax_loss(self, out, y):
        import jax.numpy as jnp  # noqa: PLC0415

        from portddp.models import jax_loss  # noqa: PLC0415

        return jnp.mean((out - y) ** 2) if self.regression else jax_loss(out, y)

    @property
    def adamw_lr(self) -> float:
        return self.lr / 10  # Adam's steps are lr-sized whatever the gradient: keep them small


@dataclasses.dataclass
class StepTrace:
    """One step as numbers: the loss, the gradients the optimizer used and the parameters after
    it, as numpy arrays in PyTorch layout keyed by PyTorch parameter names."""

    loss: float
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]


def check_implementations(names, allowed=IMPLEMENTATIONS) -> None:
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"unknown implementation(s) {unknown}: choose from {allowed}")


def make_trainer(impl: str, work: Workload, world, **knobs):
    """Build `impl` on `work` for this rank. Knobs: bucket_cap_mb, first_bucket_cap_mb, overlap,
    hook ("none", "fp16", "bf16"), no_sync_every, gradient_as_bucket_view, global_batch (the
    -local implementations only: train on the global batch), torch_layout (JAX: the PyTorch
    twin's names and flat layout, as a job shared with PyTorch ranks needs)."""
    check_implementations([impl])
    return (JaxTrainer if impl.startswith("jax") else TorchTrainer)(impl, work, world, **knobs)


class UnfusedSGD:
    """SGD with momentum computed the way optax.sgd computes it, one rounding per operation:
    trace = g + m * trace; p = p + (-lr * trace). torch.optim.SGD fuses `p + a * b` into one
    rounding, so after a step a PyTorch rank and a JAX rank would differ in the last bit;
    with this they stay bitwise equal (comparisons/mixed.py)."""

    def __init__(self, params, lr: float, momentum: float):
        import torch  # noqa: PLC0415

        self.params, self.lr, self.momentum = params, lr, momentum
        self.traces = [torch.zeros_like(p) for p in params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        import torch  # noqa: PLC0415

        with torch.no_grad():
            for p, t in zip(self.params, self.traces):
                t.mul_(self.momentum).add_(p.grad)
                p.add_(t * -self.lr)


class _Trainer:
    """What both frameworks' trainers share: the workload, the knobs, the step counter."""

    def __init__(self, impl: str, work: Workload, world, *, bucket_cap_mb=25.0, first_bucket_cap_mb=1.0,
                 overlap=True, hook="none", no_sync_every=1, gradient_as_bucket_view=False, global_batch=False,
                 torch_layout=False):
        if hook not in HOOKS:
            raise SystemExit(f"unknown hook {hook!r}: choose one of {HOOKS}")
        if global_batch and not impl.endswith("-local"):
            raise ValueError(f"global_batch=True is for the single-process references (*-local), not {impl}")
        self.impl, self.work, self.world = impl, work, world
        self.no_sync_every, self.global_batch = no_sync_every, global_batch
        self.steps, self.loss = 0, math.nan

    def batch(self, micro: int):
        """Micro-batch `micro` of the current step (each has its own data)."""
        index = self.steps * self.no_sync_every + micro
        return self.work.batch_for(index, self.world.rank, self.world.size if self.global_batch else None)


class TorchTrainer(_Trainer):
    def __init__(self, impl: str, work: Workload, world, **knobs):
        import torch  # noqa: PLC0415
        from torch import nn  # noqa: PLC0415

        from portddp.torch import DistributedDataParallel, bf16_compress_hook, fp16_compress_hook  # noqa: PLC0415

        super().__init__(impl, work, world, **knobs)
        cap, first = knobs.get("bucket_cap_mb", 25.0), knobs.get("first_bucket_cap_mb", 1.0)
        view = knobs.get("gradient_as_bucket_view", False)
        self.model = work.torch_model()
        if impl == "native":
            if not knobs.get("overlap", True):
                raise ValueError("native DDP has no overlap switch")
            default = (cap, first) == (25.0, 1.0)  # None: native's own defaults (25 MB, first bucket 1 MB)
            self.wrapped = nn.parallel.DistributedDataParallel(
                self.model, bucket_cap_mb=None if default else min(cap, 2.0**40), gradient_as_bucket_view=view)
        elif impl == "torch-local":
            self.wrapped = self.model
        else:
            self.wrapped = DistributedDataParallel(self.model, bucket_cap_mb=cap, first_bucket_cap_mb=first,
                                                   transport=impl.removeprefix("torch-"),
                                                   overlap=knobs.get("overlap", True), gradient_as_bucket_view=view)
        hook = knobs.get("hook", "none")
        if hook != "none" and impl == "torch-local":
            raise SystemExit(f"torch-local has no communication to compress: drop it from --impls for hook {hook!r}")
        if hook != "none":
            if impl == "native":  # PyTorch's own hooks of the same arithmetic (native checks their annotations)
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

                if hook == "bf16":  # (native refuses it without NCCL: a TypeError on every rank)
                    raise SystemExit("native DDP's bf16_compress_hook needs NCCL (CUDA): on CPU, compare bf16 with "
                                     "the portddp implementations only")

                fp16_compress_hook, bf16_compress_hook = default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook
            self.wrapped.register_comm_hook(None, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[hook])
        params = list(self.model.parameters())
        if work.optimizer == "sgd":
            self.opt = torch.optim.SGD(params, lr=work.lr, momentum=0.9)
        elif work.optimizer == "sgd-unfused":
            self.opt = UnfusedSGD(params, lr=work.lr, momentum=0.9)
        else:
            self.opt = torch.optim.AdamW(params, lr=work.adamw_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        self._torch = torch

    def step(self) -> float:
        torch = self._torch
        t0 = time.perf_counter()
        self.opt.zero_grad()
        for m in range(self.no_sync_every):
            x, y = (torch.from_numpy(a) for a in self.batch(m))
            last = m == self.no_sync_every - 1
            local = not last and hasattr(self.wrapped, "no_sync")
            with self.wrapped.no_sync() if local else contextlib.nullcontext():
                loss = self.work.torch_loss(self.wrapped(x), y)
                loss.backward()
        self.opt.step()
        self.steps += 1
        self.loss = loss.item()
        return time.perf_counter() - t0

    def trace(self) -> StepTrace:
        """The last step's gradients and the parameters after it (call right after step())."""
        named = list(self.model.named_parameters())
        return StepTrace(self.loss, {n: p.grad.detach().numpy().copy() for n, p in named},
                         {n: p.detach().numpy().copy() for n, p in named})

    def events(self):
        stats = getattr(self.wrapped, "stats", None)
        return stats().get("events") if stats else None

    def stats(self) -> dict:
        if self.impl == "native":
            data = self.wrapped._get_ddp_logging_data()
            keys = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
            return {k: data.get(f"avg_{k}", 0) * 1e-9 for k in keys}
        stats = getattr(self.wrapped, "stats", None)
        if not stats:
            return {}
        # (and this iteration's events: the runner keeps those of the median iteration for the simulator)
        return {k: v for k, v in stats().items() if isinstance(v, float) or k == "events"}

    def autotune(self) -> dict | None:
        """bucket_cap_mb="auto": what it tried and chose (portddp only)."""
        stats = getattr(self.wrapped, "stats", None)
        return stats().get("autotune") if stats else None

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


class JaxTrainer(_Trainer):
    def __init__(self, impl: str, work: Workload, world, **knobs):
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
        import optax  # noqa: PLC0415
        from flax import nnx  # noqa: PLC0415

        from portddp.jax import DistributedDataParallel, bf16_compress_hook, fp16_compress_hook  # noqa: PLC0415
        from portddp.models import jax_canonical, jax_order, rules_for  # noqa: PLC0415

        super().__init__(impl, work, world, **knobs)
        if knobs.get("gradient_as_bucket_view"):
            raise ValueError("gradient_as_bucket_view is a portddp.torch knob: JAX gradients are fresh arrays")
        twin = work.twin()
        self.rules = [r for r in rules_for(twin.torch_model) if r.is_param]  # for trace(): PyTorch names, layout
        graphdef, params, rest = nnx.split(twin.nnx_model, nnx.Param, ...)

        def loss_fn(p, batch):
            x, y = batch
            # Fresh copies of the non-trainable state (BatchNorm statistics) inside the trace: BatchNorm
            # updates them in training mode, and Flax refuses to mutate variables of an outer trace.
            return work.jax_loss(nnx.merge(graphdef, p, jax.tree.map(lambda v: v, rest))(x), y)

        if impl == "jax-local":
            self.ddp = None
            local = jax.jit(jax.value_and_grad(loss_fn))
            self.grad_fn = lambda p, b, sync=True: local(p, b)
        else:
            # torch_layout: the PyTorch twin's names and flat layout, so that a JAX rank can share a job
            # with PyTorch ranks (comparisons/mixed.py); otherwise PyTorch's order (the same plan) in the
            # JAX layout (no transposes).
            layout = ({"canonical": jax_canonical(twin.torch_model, params)} if knobs.get("torch_layout")
                      else {"order": jax_order(twin.torch_model, params)})
            self.ddp = DistributedDataParallel(params, knobs.get("bucket_cap_mb", 25.0),
                                               knobs.get("first_bucket_cap_mb", 1.0),
                                               strategy=impl.removeprefix("jax-"), overlap=knobs.get("overlap", True),
                                               **layout)
            hook = knobs.get("hook", "none")
            if hook != "none":
                self.ddp.register_comm_hook(None, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[hook])
            params = self.ddp.broadcast(params)
            self.grad_fn = self.ddp.value_and_grad(loss_fn)
        del twin
        if work.optimizer in ("sgd", "sgd-unfused"):
            opt = optax.sgd(work.lr, momentum=0.9)
        else:
            opt = optax.adamw(work.adamw_lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
        self.params, self.opt_state = params, opt.init(params)

        def update(p, s, g):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        # sgd-unfused runs op by op: jitted, XLA contracts `p + -lr * t` into one fused multiply-add.
        self.update = update if work.optimizer == "sgd-unfused" else jax.jit(update)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        self._jax, self._nnx = jax, nnx

    def step(self) -> float:
        t0 = time.perf_counter()
        acc = None
        for m in range(self.no_sync_every):
            batch = self.batch(m)
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

    def trace(self) -> StepTrace:
        return StepTrace(self.loss, self._to_torch(self._grads), self._to_torch(self.params))

    def _to_torch(self, state) -> dict[str, np.ndarray]:
        flat = {path: v for path, v in self._nnx.to_flat_state(state)}
        out = {}
        for r in self.rules:
            v = flat[r.nnx_path]
            out[r.torch_name] = np.array(r.to_torch(np.asarray(v.get_value() if hasattr(v, "get_value") else v)))
        return out

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
        out = {k: v for k, v in self.ddp.stats().items() if isinstance(v, (float, int, dict)) or k == "events"}
        if self.ddp.strategy == "compiled":  # (its one span, so that a row keeps its median step's, not the last)
            out["events"] = self.events()
        return out

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
