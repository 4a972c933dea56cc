"""Multi-rank checks of portddp.torch, run by tests/test_torch_ddp.py:

    mpirun -n 2 python -m tests.workers.torch_equivalence

Each rank writes one JSON line per scenario (see `report`); the pytest side
asserts on them. Scenarios train the same model from the same weights on the
same per-rank data with native DDP and with portddp.torch, and report the
largest parameter difference.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import portddp
from portddp import watchdog
from portddp.launch import detect
from tests.workers import common
from portddp.data import global_batch, regression_batch
from portddp.torch import (DistributedDataParallel, allreduce_hook, bf16_compress_hook, fp16_compress_hook,
                           noop_hook)

CAP_MB = 0.004  # ~4 KB buckets: several buckets even for these small models
IN, OUT, BATCH, STEPS = 16, 4, 8, 5


class Net(nn.Module):
    """A small MLP, optionally with BatchNorm, a branch that is not always used, and its middle
    layer under reentrant activation checkpointing."""

    def __init__(self, batchnorm=False, branch=False, checkpointed=False):
        super().__init__()
        self.checkpointed = checkpointed
        self.fc1 = nn.Linear(IN, 32)
        self.bn = nn.BatchNorm1d(32) if batchnorm else None
        self.fc2 = nn.Linear(32, 32)
        self.branch = nn.Linear(32, 32) if branch else None
        self.never = nn.Linear(32, 32) if branch else None  # unused on every rank
        self.head = nn.Linear(32, OUT)

    def forward(self, x, use_branch=False):
        h = torch.relu(self.fc1(x))
        if self.bn is not None:
            h = self.bn(h)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.fc2(t)), h, use_reentrant=True)
        else:
            h = torch.relu(self.fc2(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def make(dtype=torch.float32, **kw):
    torch.manual_seed(1234)
    return Net(**kw).to(dtype)


def batch(step, rank, dtype):
    x, y = regression_batch(7, step, rank, BATCH, IN, OUT, dtype="float64")
    return torch.from_numpy(x).to(dtype), torch.from_numpy(y).to(dtype)


def train(wrapped, model, rank, *, micro=1, branch=False, dtype=torch.float32, steps=STEPS):
    """SGD with momentum; `micro` > 1 accumulates micro-1 local backward passes under no_sync."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step * micro + m, rank, dtype)
            use = branch and (rank + step) % 2 == 0  # used on some ranks only
            sync_ctx = wrapped.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with sync_ctx:
                nn.functional.mse_loss(wrapped(x, use_branch=use), y).backward()
        opt.step()
    return model


def max_diff(a: nn.Module, b: nn.Module) -> tuple[float, bool]:
    pa = [t.detach() for t in list(a.parameters()) + list(a.buffers())]
    pb = [t.detach() for t in list(b.parameters()) + list(b.buffers())]
    wide = lambda t: t.to(torch.complex128 if t.is_complex() else torch.float64)  # noqa: E731
    diff = max(((wide(x) - wide(y)).abs().max().item() for x, y in zip(pa, pb) if x.numel()), default=0.0)
    return diff, all(torch.equal(x, y) for x, y in zip(pa, pb))


def report(name, **fields):
    common.report(dist.get_rank(), name, **fields)


def vs_native(name, transport, rank, *, model_kw=None, ddp_kw=None, train_kw=None):
    model_kw, ddp_kw, train_kw = model_kw or {}, ddp_kw or {}, train_kw or {}
    native_model, ours_model = make(**model_kw), make(**model_kw)
    native = nn.parallel.DistributedDataParallel(native_model, bucket_cap_mb=CAP_MB, **ddp_kw)
    ours = DistributedDataParallel(ours_model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB,
                                   transport=transport, **ddp_kw)
    train(native, native_model, rank, **train_kw)
    train(ours, ours_model, rank, **train_kw)
    diff, equal = max_diff(native_model, ours_model)
    report(f"{name}/{transport}", max_diff=diff, bitwise=equal, buckets=len(ours.bucket_plan.buckets),
           rebuilt=ours.stats()["plan_rebuilt"])


def float64_vs_single_process(transport, rank, world):
    model = make(torch.float64)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, transport=transport)
    train(ddp, model, rank, dtype=torch.float64)
    ref = make(torch.float64)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = global_batch(regression_batch, world, 7, step, batch=BATCH, in_dim=IN, out_dim=OUT, dtype="float64")
        opt.zero_grad()
        nn.functional.mse_loss(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    rel = max(((a - b).abs().max() / max(1.0, b.abs().max().item())).item()
              for a, b in zip(model.parameters(), ref.parameters()))
    report(f"float64_global_batch/{transport}", max_rel=rel)


class Scaled(nn.Module):
    """A broadcast scale that becomes per-feature mid-training through `.data` (after wrapping)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.fc1, self.scale, self.head = nn.Linear(IN, 32), nn.Parameter(torch.ones(1)), nn.Linear(32, OUT)
        self.double()

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)) * self.scale)


def resized_parameter(transport, rank, world):
    """A parameter given a new shape through `.data` on every rank after wrapping (its gradient no longer
    fits its place in the bucket: it was packed over its neighbours', silently) trains as one process on
    the global batch does."""
    model, ref = Scaled(), Scaled()
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, transport=transport)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for m in (model, ref):
                    m.scale.data = torch.full((32,), 1.5, dtype=torch.float64)
        x, y = batch(step, rank, torch.float64)
        gx, gy = global_batch(regression_batch, world, 7, step, batch=BATCH, in_dim=IN, out_dim=OUT, dtype="float64")
        # (no output kept across steps: a graph alive at the resize keeps the old AccumulateGrad node, and
        # PyTorch then sums the new gradient down to the old shape, DDP or not)
        for opt, net, inputs, target in ((opts[0], ddp, x, y), (opts[1], ref, torch.from_numpy(gx), torch.from_numpy(gy))):
            opt.zero_grad()
            nn.functional.mse_loss(net(inputs), target).backward()
            opt.step()
    rel = max(((a - b).abs().max() / max(1.0, b.abs().max().item())).item()
              for a, b in zip(model.parameters(), ref.parameters()))
    report(f"resized/{transport}", max_rel=rel, shape=list(model.scale.shape))
    # A channels_last weight given more input channels: its bucket slot must follow the new shape (the
    # memory order agreed for the old one laid the new gradient over itself, silently).
    torch.manual_seed(1234)
    conv = nn.Conv2d(4, 8, 3).double().to(memory_format=torch.channels_last)
    ref = nn.Conv2d(4, 8, 3).double()
    ref.load_state_dict(conv.state_dict())
    ddp = DistributedDataParallel(conv, bucket_cap_mb=CAP_MB, transport=transport)
    worst = 0.0
    for step in range(3):
        if step == 1:
            new = torch.randn(8, 8, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            conv.weight.data, ref.weight.data = new.contiguous(memory_format=torch.channels_last), new.clone()
        g = torch.Generator().manual_seed(step)
        xs = [torch.randn(2, conv.weight.shape[1], 6, 6, dtype=torch.float64, generator=g) for _ in range(world)]
        for m in (conv, ref):
            m.zero_grad()
        ddp(xs[rank].contiguous(memory_format=torch.channels_last)).square().mean().backward()
        (sum(ref(x).square().mean() for x in xs) / world).backward()
        worst = max(worst, *((a.grad - b.grad).abs().max().item() for a, b in zip(conv.parameters(), ref.parameters())))
    report(f"resized_channels_last/{transport}", max_diff=worst)


def hooks_vs_numpy(transport, rank, world):
    """One backward with each compression hook against cast -> divide -> sum -> cast back in numpy."""
    x, y = batch(0, rank, torch.float32)
    local = make()
    nn.functional.mse_loss(local(x), y).backward()
    mine = [p.grad.numpy().copy() for p in local.parameters()]
    everyone = [[np.asarray(g) for g in grads] for grads in _allgather(mine)]
    for hook, np_dtype in ((fp16_compress_hook, np.float16), (bf16_compress_hook, ml_dtypes.bfloat16)):
        model = make()
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, transport=transport)
        ddp.register_comm_hook(None, hook)
        nn.functional.mse_loss(ddp(x), y).backward()
        worst = scale = 0.0
        for k, p in enumerate(model.parameters()):
            acc = None
            for r in range(world):  # the ring order does not matter for 2 addends; for 3 it may
                term = everyone[r][k].astype(np_dtype) / np_dtype(world)
                acc = term if acc is None else (acc + term).astype(np_dtype)
            worst = max(worst, float(np.abs(acc.astype(np.float32) - p.grad.numpy()).max()))
            scale = max(scale, float(np.abs(acc.astype(np.float32)).max()))
        report(f"hook_{hook.__name__}/{transport}", max_diff=worst, scale=scale)
    for hook in (allreduce_hook, noop_hook):
        model = make()
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, transport=transport)
        ddp.register_comm_hook(None, hook)
        nn.functional.mse_loss(ddp(x), y).backward()
        if hook is noop_hook:
            want = mine
        else:
            want = [sum(everyone[r][k] / np.float32(world) for r in range(world)) for k in range(len(mine))]
        worst = max(float(np.abs(w - p.grad.numpy()).max()) for w, p in zip(want, model.parameters()))
        report(f"hook_{hook.__name__}/{transport}", max_diff=worst)


def _allgather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def overlap_events(transport, rank):
    """From the recorded events: does the first launch precede the end of backward?"""
    for overlap in (True, False):
        model = make()
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB,
                                      transport=transport, overlap=overlap)
        train(ddp, model, rank, steps=3)
        ev = ddp.stats()["events"]
        launches = [b.launch_ns for b in ev.buckets]
        report(f"overlap_{overlap}/{transport}", first_launch_before_backward_end=min(launches) < ev.backward_end_ns,
               any_launch_before_backward_end=any(t < ev.backward_end_ns for t in launches),
               buckets=len(launches), overlap_ratio=ddp.stats()["overlap_ratio"],
               ordered=all(a.launch_ns <= b.launch_ns for a, b in zip(ev.buckets, ev.buckets[1:])))


def frozen_and_noncontiguous(transport, rank):
    """A frozen parameter is left out (and left alone); a non-contiguous one is reduced correctly.
    Both against native DDP, which treats them the same way."""
    def frozen(model):
        model.fc1.weight.requires_grad_(False)
        return model

    def noncontiguous(model):
        w = model.fc2.weight.detach()
        model.fc2.weight = nn.Parameter(w.t().contiguous().t())  # same values, transposed strides
        assert not model.fc2.weight.is_contiguous()
        return model

    for name, edit in (("frozen", frozen), ("noncontiguous", noncontiguous)):
        native_model, ours_model = edit(make()), edit(make())
        before = ours_model.fc1.weight.detach().clone()
        native = nn.parallel.DistributedDataParallel(native_model, bucket_cap_mb=CAP_MB)
        ours = DistributedDataParallel(ours_model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB,
                                       transport=transport)
        train(native, native_model, rank, steps=3)
        train(ours, ours_model, rank, steps=3)
        diff, equal = max_diff(native_model, ours_model)
        planned = [s.name for s in ours.bucket_plan.specs]
        report(f"{name}/{transport}", max_diff=diff, bitwise=equal, planned=planned,
               frozen_unchanged=bool(torch.equal(before, ours_model.fc1.weight)))


def auto_cap(transport, rank):
    """bucket_cap_mb="auto" trains exactly like native DDP while it tries caps; every rank picks the same."""
    from portddp.autotune import CapTuner  # noqa: PLC0415

    steps = CapTuner().iterations + 1
    native_model, ours_model = make(), make()
    native = nn.parallel.DistributedDataParallel(native_model, bucket_cap_mb=CAP_MB)
    ours = DistributedDataParallel(ours_model, bucket_cap_mb="auto", first_bucket_cap_mb=CAP_MB,
                                   transport=transport)
    train(native, native_model, rank, steps=steps)
    train(ours, ours_model, rank, steps=steps)
    diff, equal = max_diff(native_model, ours_model)
    summary = ours.stats()["autotune"]
    report(f"auto_cap/{transport}", max_diff=diff, bitwise=equal, chosen=summary["chosen_mb"],
           candidates=summary["candidates_mb"], cap_in_use=ours.bucket_cap_mb,
           plan_cap_mb=ours.bucket_plan.buckets[-1].cap_bytes / 2**20)


def collectives_per_step(transport, rank):
    """How many collectives one synchronised step issues (the stall inspector's count): on c10d
    without a comm hook the last bucket carries the used counts, so one per bucket; with a hook,
    or on MPI, one more."""
    counts = {}
    for hooked in (False, True):
        model = make()
        ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB, transport=transport)
        if hooked:
            ddp.register_comm_hook(None, allreduce_hook)
        train(ddp, model, rank, steps=2)  # (the plan is rebuilt after the first)
        before = watchdog._PROGRESS.seq
        train(ddp, model, rank, steps=1)
        counts["hooked" if hooked else "plain"] = watchdog._PROGRESS.seq - before
    report(f"collectives_per_step/{transport}", buckets=len(ddp.bucket_plan.buckets), **counts)


def main():
    w = portddp.init()
    transports = sys.argv[1:] or ["c10d", "mpi"]
    for transport in transports:
        vs_native("plain", transport, w.rank)
        vs_native("no_sync", transport, w.rank, train_kw={"micro": 3})
        vs_native("unused", transport, w.rank, model_kw={"branch": True},
                  ddp_kw={"find_unused_parameters": True}, train_kw={"branch": True})
        vs_native("batchnorm", transport, w.rank, model_kw={"batchnorm": True})
        vs_native("grad_as_bucket_view", transport, w.rank, ddp_kw={"gradient_as_bucket_view": True},
                  train_kw={"micro": 2})
        float64_vs_single_process(transport, w.rank, w.size)
        resized_parameter(transport, w.rank, w.size)
        hooks_vs_numpy(transport, w.rank, w.size)
        overlap_events(transport, w.rank)
        auto_cap(transport, w.rank)
        frozen_and_noncontiguous(transport, w.rank)
        collectives_per_step(transport, w.rank)


if __name__ == "__main__":
    main()
    if detect().launcher == "torchrun":
        # Everything is written and checked by now. Under torchrun, PyTorch's own teardown after the
        # script sometimes aborts ("terminate called without an active exception", ~1 run in 10, with
        # or without portddp): run the exit handlers (portddp's watchdog says goodbye, c10d is taken
        # down) and leave without the C++ teardown, so the test checks portddp and not that.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        os._exit(0)
