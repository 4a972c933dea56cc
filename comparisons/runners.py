"""One runner per implementation for the equivalence harness: build, then step.

Each `step(k)` trains one optimizer step on its batch (this rank's, or the
global batch for the single-process references) and returns the loss, the
gradients the optimizer used and the parameters after the step, as numpy
arrays in PyTorch layout keyed by PyTorch parameter names.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from portddp.data import global_batch, model_batch
from portddp.models import build_twin, jax_canonical, jax_loss, rules_for, torch_loss

__all__ = ["StepTrace", "make_runner"]


@dataclasses.dataclass
class StepTrace:
    loss: float
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]


def _adamw_lr(cfg) -> float:
    return cfg.lr / 10  # Adam's steps are lr-sized whatever the gradient: keep them small


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


class _Runner:
    """What every runner shares: its twin (fresh, from the seed) and its batches."""

    def __init__(self, name: str, cfg, world, reference: str):
        self.name, self.cfg, self.world = name, cfg, world
        self.twin = build_twin(cfg.model, cfg.size, cfg.dtype, cfg.seed)
        self.block = self.twin.args["cfg"].block_size if cfg.model == "gpt" else 16
        self.global_loss = name == reference  # the single-process references train on the global batch

    def batch(self, step: int):
        cfg, world = self.cfg, self.world
        per_rank = cfg.global_batch // world.size
        if self.global_loss:
            return global_batch(model_batch, world.size, cfg.model, cfg.seed, step, batch=per_rank,
                                dtype=cfg.dtype, block_size=self.block)
        return model_batch(cfg.model, cfg.seed, step, world.rank, per_rank, dtype=cfg.dtype, block_size=self.block)


class TorchRunner(_Runner):
    def __init__(self, name: str, cfg, world):
        import torch  # noqa: PLC0415
        from torch import nn  # noqa: PLC0415

        from portddp.torch import DistributedDataParallel  # noqa: PLC0415

        super().__init__(name, cfg, world, reference="torch-ref")
        self.model = self.twin.torch_model
        if name == "torch-ref":
            self.wrapped = self.model
        elif name == "native-ddp":
            self.wrapped = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=cfg.bucket_cap_mb)
        else:
            self.wrapped = DistributedDataParallel(self.model, bucket_cap_mb=cfg.bucket_cap_mb,
                                                   first_bucket_cap_mb=cfg.bucket_cap_mb / 4,
                                                   transport=name.removeprefix("torch-"))
        if cfg.optimizer == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=0.9)
        elif cfg.optimizer == "sgd-unfused":
            self.opt = UnfusedSGD(list(self.model.parameters()), lr=cfg.lr, momentum=0.9)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=_adamw_lr(cfg), betas=(0.9, 0.999), eps=1e-8,
                                         weight_decay=0.01)
        self._torch = torch

    def plan_signature(self):
        """The bucket plan as plain data, for checking every rank uses the same one."""
        plan = getattr(self.wrapped, "bucket_plan", None)
        return None if plan is None else plan.to_json()

    def step(self, k: int) -> StepTrace:
        torch = self._torch
        x, y = (torch.from_numpy(a) for a in self.batch(k))
        self.opt.zero_grad()
        loss = torch_loss(self.wrapped(x), y)
        loss.backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in self.model.named_parameters()}
        self.opt.step()
        params = {n: p.detach().numpy().copy() for n, p in self.model.named_parameters()}
        return StepTrace(loss.item(), grads, params)


class JaxRunner(_Runner):
    def __init__(self, name: str, cfg, world):
        import jax  # noqa: PLC0415
        import optax  # noqa: PLC0415
        from flax import nnx  # noqa: PLC0415

        from portddp.jax import DistributedDataParallel  # noqa: PLC0415

        super().__init__(name, cfg, world, reference="jax-ref")
        twin = self.twin
        self.rules = [r for r in rules_for(twin.torch_model) if r.is_param]
        graphdef, params, rest = nnx.split(twin.nnx_model, nnx.Param, ...)

        def loss_fn(p, batch):
            x, y = batch
            # Fresh copies of the non-trainable state (BatchNorm statistics) inside the trace: BatchNorm
            # updates them in training mode, and Flax refuses to mutate variables of an outer trace.
            model = nnx.merge(graphdef, p, jax.tree.map(lambda v: v, rest))
            return jax_loss(model(x), y)

        if self.global_loss:
            self.grad_fn = jax.jit(jax.value_and_grad(loss_fn))
        else:
            # The PyTorch twin's names and layout: the same plan and flat buckets, so that a JAX
            # rank can even share a job with PyTorch ranks (comparisons/mixed.py).
            ddp = DistributedDataParallel(params, bucket_cap_mb=cfg.bucket_cap_mb,
                                          first_bucket_cap_mb=cfg.bucket_cap_mb / 4,
                                          strategy=name.removeprefix("jax-"),
                                          canonical=jax_canonical(twin.torch_model, params))
            params = ddp.broadcast(params)
            self.grad_fn = ddp.value_and_grad(loss_fn)
        if cfg.optimizer in ("sgd", "sgd-unfused"):
            opt = optax.sgd(cfg.lr, momentum=0.9)
        else:
            opt = optax.adamw(_adamw_lr(cfg), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
        self.params, self.state = params, opt.init(params)

        def update(p, s, g):
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s

        # sgd-unfused runs op by op: jitted, XLA contracts `p + -lr * t` into one fused multiply-add.
        self.update = update if cfg.optimizer == "sgd-unfused" else jax.jit(update)
        self._nnx = nnx
        self.ddp = None if self.global_loss else ddp

    def plan_signature(self):
        return None if self.ddp is None else self.ddp.bucket_plan.to_json()

    def to_torch(self, state) -> dict[str, np.ndarray]:
        flat = {path: v for path, v in self._nnx.to_flat_state(state)}
        out = {}
        for r in self.rules:
            v = flat[r.nnx_path]
            out[r.torch_name] = np.array(r.to_torch(np.asarray(v.get_value() if hasattr(v, "get_value") else v)))
        return out

    def step(self, k: int) -> StepTrace:
        batch = self.batch(k)
        loss, grads = self.grad_fn(self.params, batch)
        self.params, self.state = self.update(self.params, self.state, grads)
        return StepTrace(float(loss), self.to_torch(grads), self.to_torch(self.params))


def make_runner(name: str, cfg, world):
    return (JaxRunner if name.startswith("jax") else TorchRunner)(name, cfg, world)
