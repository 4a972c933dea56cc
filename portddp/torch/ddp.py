"""DistributedDataParallel for torch.nn.Module, written in Python over c10d or MPI.

The design of PyTorch's C++ Reducer (torch/csrc/distributed/c10d/reducer.cpp),
made readable:

1. Construction: verify every rank has the same parameters (names, shapes,
   dtypes), copy rank 0's parameters and buffers everywhere, plan buckets
   (portddp.buckets) and allocate one flat buffer per bucket.
2. Forward: (rebuild the plan once, from rank 0's observed gradient order),
   broadcast buffers, run the module, open the iteration.
3. Backward: one hook per parameter fires once its `.grad` is accumulated. It
   packs the gradient (divided by the world size) into its bucket slot; when a
   bucket's last gradient arrives the bucket is ready, and every ready bucket
   at the front of the plan is launched -- an async all-reduce -- while
   autograd keeps computing the rest of the backward pass.
4. End of backward (a callback autograd runs once the graph is done): launch
   whatever is left, wait for every bucket in plan order, agree with the other
   ranks on which parameters got gradients, and write the mean back to `.grad`.

The per-iteration state is a handful of plain lists on `self` (pending counts,
ready flags, the next bucket to launch, futures), reset at each forward.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from portddp import launch
from portddp.autotune import CapTuner
from portddp.buckets import BucketPlan, ParamSpec, cap_bytes, plan_buckets, rebuild_plan
from portddp.protocol import check_same_config, check_same_specs, nonfinite_error, unused_parameters_error
from portddp.timeline import BucketEvents, IterationEvents
from portddp.torch.comm import TRANSPORTS, make_comm

__all__ = ["DistributedDataParallel", "GradBucket"]

_now = time.perf_counter_ns


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class GradBucket:
    """What a comm hook sees: one bucket's flat buffer and how to reduce it."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list, num_buckets: int, comm):
        self._index = index
        self._buffer = buffer
        self._params = params
        self._is_last = index == num_buckets - 1
        self._comm = comm
        self.world_size = comm.size

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum `tensor` in place over all ranks on this DDP's transport; returns at once."""
        return self._comm.allreduce(tensor)


class DistributedDataParallel(nn.Module):
    """Data parallelism by gradient averaging with communication overlapped with backward.

    Args:
        module: the model; every rank must build the same one.
        bucket_cap_mb: bucket size cap in MB (math.inf: one bucket per dtype), or
            "auto": time a few caps during the first iterations and keep the
            fastest (portddp.autotune; the choice is in stats()["autotune"]).
        first_bucket_cap_mb: cap of the first bucket (the last layers' gradients),
            small so that communication starts early.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to
            every rank before each forward.
        find_unused_parameters: parameters that get no gradient on a rank are
            reduced as zeros there; without it such a parameter is an error.
        gradient_as_bucket_view: `.grad` becomes a view into the bucket buffer
            (no second copy of the gradients, no copy back after the reduction).
        transport: "c10d" (the default process group, Gloo/NCCL) or "mpi"
            (mpi4py on a comm thread; needs mpirun).
        overlap: False launches every bucket only after backward has finished:
            the no-overlap baseline of the overlap study.
        process_group: a c10d group other than the default one.
        check_finite: check every local gradient for NaN/Inf as it arrives; if any
            rank finds one, every rank raises naming the parameters and ranks, and
            .grad is left untouched (costs one pass over the gradients).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | str = 25.0,
        first_bucket_cap_mb: float = 1.0,
        broadcast_buffers: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        transport: str = "c10d",
        overlap: bool = True,
        process_group=None,
        check_finite: bool = False,
    ):
        super().__init__()
        # Validate everything local before talking to other ranks: every rank
        # sees the same arguments, so every rank raises the same error.
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}: choose one of {TRANSPORTS}")
        self._tuner = CapTuner() if isinstance(bucket_cap_mb, str) and bucket_cap_mb == "auto" else None
        if self._tuner is not None:
            bucket_cap_mb = self._tuner.first
        cap_bytes(bucket_cap_mb, "bucket_cap_mb")
        cap_bytes(first_bucket_cap_mb, "first_bucket_cap_mb")
        self.module = module
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.overlap = overlap
        self.transport = transport
        self.check_finite = check_finite
        self.require_backward_grad_sync = True  # no_sync() flips this

        # Frozen parameters (requires_grad=False) are not part of DDP at all.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        specs = [ParamSpec(n, tuple(p.shape), _dtype_name(p.dtype), p.device.type) for n, p in named]
        if not specs:
            raise ValueError("DistributedDataParallel needs a module with at least one parameter that requires grad")

        if process_group is None:  # (a custom group's members are the caller's business)
            check_same_config(launch.allgather_object({
                "bucket_cap_mb": "auto" if self._tuner else bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb,
                "transport": transport, "check_finite": bool(check_finite)}))
        self._comm = make_comm(transport, process_group)
        self.world_size = self._comm.size
        self.rank = self._comm.rank
        self._inv_world = 1.0 / self.world_size
        self._verify_same_model(specs)
        self._hook = None
        self._hook_state = None
        self._install_plan(plan_buckets(specs, bucket_cap_mb, first_bucket_cap_mb))
        # Ranks start identical: rank 0's parameters and buffers everywhere.
        if self.world_size > 1:
            self._broadcast_state()
        self._rebuilt = False
        self._rebuild_order: list[int] | None = None
        self._observed_order: list[int] | None = None  # rank 0's, once the plan was rebuilt
        self._sync = False
        self._expect_grads = False
        self._last_events: IterationEvents | None = None
        self._iterations = 0
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    # ------------------------------------------------------------------ setup
    def _verify_same_model(self, specs: list[ParamSpec]) -> None:
        """Compare every rank's parameter list with rank 0's; name the first difference."""
        everyone = self._comm.allgather_object([(s.name, s.shape, s.dtype) for s in specs])
        check_same_specs(everyone, "model mismatch across ranks", "parameter", "trainable parameters")

    def _broadcast_state(self) -> None:
        """Rank 0's parameters (bucket by bucket, after agreeing again) and buffers everywhere.

        The same exchange as portddp.jax's broadcast() (see portddp.protocol)."""
        self._verify_same_model(list(self._plan.specs))
        for bucket in self._plan.buckets:
            self._comm.broadcast_([self._params[i] for i in bucket.params], src=0)
        if self._module_buffers:
            self._comm.broadcast_(self._module_buffers, src=0)

    def _install_plan(self, plan: BucketPlan) -> None:
        """Allocate one flat buffer per bucket and a view of it per parameter."""
        self._plan = plan
        p0 = self._params[0]
        self._buffers = [
            torch.zeros(b.numel, dtype=getattr(torch, b.dtype), device=p0.device) for b in plan.buckets
        ]
        self._bucket_of = [0] * len(self._params)
        self._views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        for b, bucket in enumerate(plan.buckets):
            for i, off in zip(bucket.params, bucket.offsets):
                p = self._params[i]
                self._bucket_of[i] = b
                self._views[i] = self._buffers[b][off:off + p.numel()].view_as(p)
                if self.gradient_as_bucket_view and p.grad is not None:
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]
        self._bucket_sizes = [len(b.params) for b in plan.buckets]
        self._grad_buckets = [
            GradBucket(b, buf, [self._params[i] for i in plan.buckets[b].params], len(plan.buckets), self._comm)
            for b, buf in enumerate(self._buffers)
        ]

    @property
    def bucket_plan(self) -> BucketPlan:
        """The BucketPlan in use (after the rebuild, the rebuilt one)."""
        return self._plan

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future` (see portddp.torch.hooks).

        Call once, before the first backward. Gradients then reach the bucket
        undivided; the hook divides (portddp.torch.hooks does, before summing)."""
        if self._hook is not None:
            raise RuntimeError("a comm hook is already registered; register_comm_hook can be called only once")
        if self._iterations:
            raise RuntimeError("register_comm_hook must be called before the first backward pass")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket) -> Future; got {hook!r}")
        self._hook, self._hook_state = hook, state

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next synchronised backward reduces the sum.

            with ddp.no_sync():
                ddp(x1).sum().backward()   # local only
            ddp(x2).sum().backward()       # reduces grad(x1) + grad(x2)
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ---------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        start = _now()
        self._check_parameters_unchanged()
        if self._tuner is not None and not self._tuner.done and torch.is_grad_enabled() \
                and self.require_backward_grad_sync:
            self._autotune(start)
        if self._rebuild_order is not None:
            self._rebuild()
        if self.broadcast_buffers and self._module_buffers and self.world_size > 1:
            self._comm.broadcast_(self._module_buffers, src=0)
        # Like native DDP, whether the coming backward synchronises is decided
        # by the forward: a forward inside no_sync() gives a local backward.
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._sync = self.require_backward_grad_sync
            if self._sync:
                self._begin_iteration(start)
        out = self.module(*args, **kwargs)
        if grad_enabled and self._sync:
            self._events.forward_end_ns = _now()
        return out

    def _check_parameters_unchanged(self) -> None:
        """A model whose trainable parameters changed after wrapping would train them un-averaged."""
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) == len(self._params) and all(a is b for a, b in zip(now, self._params)):
            return
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        added = [n for n in names if n not in self._names]
        gone = [n for n in self._names if n not in names]
        raise RuntimeError(
            f"the module's trainable parameters changed after DistributedDataParallel wrapped it: "
            f"{len(self._params)} then, {len(now)} now (added: {added[:5] or 'none'}, gone or replaced: "
            f"{gone[:5] or 'none'}). Finish building the model (and setting requires_grad) before wrapping it, "
            "or wrap the new model in a new DistributedDataParallel"
        )

    def _begin_iteration(self, start_ns: int) -> None:
        n_buckets = len(self._buffers)
        self._pending = list(self._bucket_sizes)  # params still to arrive, per bucket
        self._next_launch = 0  # buckets launch strictly in plan order
        self._futures: list = [None] * n_buckets
        self._seen = bytearray(len(self._params))
        self._nonfinite = bytearray(len(self._params))
        self._ready_order: list[int] = []
        self._finalize_queued = False
        self._expect_grads = True
        self._events = IterationEvents(
            rank=self.rank,
            forward_start_ns=start_ns,
            buckets=[BucketEvents(b, buf.numel() * buf.element_size()) for b, buf in enumerate(self._buffers)],
        )

    # --------------------------------------------------------------- backward
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if self._sync:  # under no_sync the gradient simply accumulates in .grad
                self._mark_ready(i, param)

        return hook

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        now = _now()
        if not self._expect_grads:
            raise RuntimeError(
                f"gradient of {self._names[i]!r} arrived outside a DDP iteration: run one backward per "
                "forward of the DistributedDataParallel wrapper (a second backward needs another forward)"
            )
        if self._seen[i]:
            raise RuntimeError(
                f"parameter {self._names[i]!r} received its gradient twice in one backward pass; "
                "DistributedDataParallel supports one gradient per parameter per iteration"
            )
        if not self._finalize_queued:
            # Runs once autograd has finished the whole graph.
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            self._finalize_queued = True
        self._seen[i] = 1
        self._ready_order.append(i)
        self._events.backward_end_ns = now
        if self.check_finite and not bool(torch.isfinite(param.grad).all()):
            self._nonfinite[i] = 1
        self._pack(i, param)
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._events.buckets[b].ready_ns = now
            if self.overlap:
                self._launch_ready_buckets()

    def _pack(self, i: int, param: torch.Tensor) -> None:
        """Put param i's gradient in its bucket slot, divided unless a hook will divide."""
        grad, view = param.grad, self._views[i]
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self._names[i]!r} has a {grad.layout} gradient; portddp reduces dense gradients only "
                "(e.g. use nn.Embedding(sparse=False))"
            )
        if grad.data_ptr() == view.data_ptr():  # gradient_as_bucket_view: already in place
            if self._hook is None:
                view.mul_(self._inv_world)
            return
        if self._hook is None:
            # Divide while copying: one pass over the gradient instead of two.
            torch.mul(grad, self._inv_world, out=view)
        else:
            view.copy_(grad)
        if self.gradient_as_bucket_view:
            param.grad = view

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buffers) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        ev = self._events.buckets[b]
        ev.launch_ns = _now()
        if self._hook is None:
            fut = self._comm.allreduce(self._buffers[b])
        else:
            fut = self._hook(self._hook_state, self._grad_buckets[b])

        def record_done(_fut, ev=ev):
            ev.done_ns = _now()

        fut.add_done_callback(record_done)
        self._futures[b] = fut

    def _finalize_backward(self) -> None:
        """End of backward: launch the rest, wait in order, agree on unused params, write .grad."""
        self._expect_grads = False
        missing = [i for i, seen in enumerate(self._seen) if not seen]
        for i in missing:
            # No gradient here; other ranks may have one, and every rank must
            # still issue the same collectives: reduce zeros for it.
            self._views[i].zero_()
            self._pending[self._bucket_of[i]] -= 1
        self._launch_ready_buckets()
        # One more small collective after the buckets: how many ranks produced
        # each gradient. It is what lets every rank -- not only the one missing
        # a gradient -- fail together instead of hanging.
        # With check_finite the same collective also counts, per parameter, the ranks whose
        # gradient held a NaN or Inf (a second half of the vector).
        flags = bytes(self._seen) + (bytes(self._nonfinite) if self.check_finite else b"")
        used = None
        if self.world_size > 1:
            used = torch.frombuffer(bytearray(flags), dtype=torch.uint8).to(torch.int32)
            used_fut = self._comm.allreduce(used)
        for b, fut in enumerate(self._futures):
            result = fut.wait()
            if result.data_ptr() != self._buffers[b].data_ptr():
                self._buffers[b].copy_(result)
        totals = used_fut.wait().tolist() if used is not None else list(flags)
        counts, nonfinite = totals[:len(self._params)], totals[len(self._params):]
        self._events.finalize_end_ns = _now()
        self._last_events = self._events
        self._iterations += 1
        if not self._rebuilt and self._rebuild_order is None:
            self._rebuild_order = self._ready_order
        if not self.find_unused_parameters and min(counts) < self.world_size:
            self._raise_unused(counts)
        if any(nonfinite):
            self._raise_nonfinite()
        self._write_grads(counts)

    def _raise_unused(self, counts: list[int]) -> None:
        raise unused_parameters_error(self._names, counts, self.world_size, self.rank, self._seen)

    def _raise_nonfinite(self) -> None:
        mine = [self._names[i] for i, bad in enumerate(self._nonfinite) if bad]
        everyone = self._comm.allgather_object(mine) if self.world_size > 1 else [mine]
        raise nonfinite_error(everyone, self.rank)

    def _write_grads(self, counts: list[int]) -> None:
        for i, p in enumerate(self._params):
            view = self._views[i]
            if counts[i] == 0:
                continue  # unused on every rank: .grad is left as it was, as native DDP does
            if self.gradient_as_bucket_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _rebuild(self) -> None:
        """Re-plan once from the order gradients really arrived in (rank 0's, broadcast)."""
        order = torch.full((len(self._params),), -1, dtype=torch.int64)
        order[: len(self._rebuild_order)] = torch.tensor(self._rebuild_order, dtype=torch.int64)
        if self.world_size > 1:
            self._comm.broadcast_([order], src=0)
        self._observed_order = [i for i in order.tolist() if i >= 0]
        self._install_plan(rebuild_plan(self._plan, self._observed_order, self.bucket_cap_mb,
                                        self.first_bucket_cap_mb))
        self._rebuild_order = None
        self._rebuilt = True

    def _autotune(self, now: int) -> None:
        """bucket_cap_mb="auto": the cap this iteration uses; re-plan (observed order) when it changes."""
        cap = self._tuner.start_iteration(now)
        if cap is None:  # trials over: agree on the winner (a collective, on every rank)
            cap = self._tuner.decide(self._comm.allgather_object, self.rank)
        if cap != self.bucket_cap_mb:
            self.bucket_cap_mb = cap
            if self._observed_order is not None:  # else the pending rebuild plans with the new cap
                self._install_plan(rebuild_plan(self._plan, self._observed_order, cap, self.first_bucket_cap_mb))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """DESIGN.md metrics of the last synchronised iteration, plus its events."""
        if self._last_events is None:
            return {}
        extra = {"iterations": self._iterations, "plan_rebuilt": self._rebuilt, "bucket_cap_mb": self.bucket_cap_mb}
        if self._tuner is not None:
            extra["autotune"] = self._tuner.summary()
        return self._last_events.stats() | extra
