"""DistributedDataParallel for JAX parameter pytrees: the DDP design, functionally.

Mirrors portddp/torch/ddp.py. What JAX forces to differ:

* There are no per-parameter autograd hooks. Instead each bucket's parameters
  pass through a `jax.custom_vjp` identity (a "tap") on their way into the
  loss. Its backward rule receives the bucket's gradients the moment XLA has
  produced them and hands them to the host with `io_callback`: the callback
  packs them (divided by the world size) into the bucket's flat buffer and
  launches the all-reduce on the MPI transport's comm thread, while XLA goes on
  with the rest of the backward pass. A bucket arrives whole, so "ready" needs
  no per-parameter counting.
* Gradients are values, not `.grad` fields: `value_and_grad` returns them after
  waiting for every bucket, in the input pytree structure.
* Every parameter gets a gradient, zeros if the loss does not use it (as
  `jax.grad` gives), so there is no `find_unused_parameters`. JAX never runs
  the backward rule of a tap whose outputs the loss ignores; such buckets are
  found when the step is traced, packed as zeros when the iteration opens and
  launched in plan order like any other, so every rank issues the same
  all-reduces even when a leaf is used on some ranks only.
  `sync=False` plays the role of `no_sync()`.
* No `gradient_as_bucket_view` (gradients are fresh arrays, there is no
  `.grad` to alias). Buffers exist only for Flax NNX models
  (`nnx_value_and_grad`, portddp/jax/flax_nnx.py): every non-Param state that
  is not RNG state (BatchNorm's BatchStat, plain arrays); with
  `broadcast_buffers=True` rank 0's are broadcast before each synchronised
  forward, as portddp.torch does. RNG state stays per rank, as torch's
  generators do.
* No check that the model changed after wrapping (portddp.torch's forward has
  one): the pytree comes with every call, and a different structure, shape
  or dtype is refused where it is flattened.
* `check_finite` needs strategy="hooked": only there do gradients pass
  through the host before they are reduced.
* Only strategy="hooked" can be traced into the caller's own `jax.jit`
  (its collectives are host callbacks); "compiled" and "pmap" are compiled
  programs over several devices of their own and say so if called under jit.
* Uneven inputs: no `join()` context manager (there is no forward to hook a
  shadow into). `for batch in ddp.uneven(batches)` agrees before each step on
  which ranks still have a batch and yields `ddp.JOINED` to those that ran
  out; their grad_fn issues the step's collectives with zero gradients and
  returns the same mean, so every rank applies the same update and nothing
  needs broadcasting at the end (see `uneven`).
* portddp.watchdog hears of every synchronised iteration (`step_started`,
  `step_finished`): hooked, from the host callbacks that open and finish it
  (so inside the caller's jit too) and in `reduce`; compiled and pmap, around
  the XLA program; each `uneven()` agreement counts as one. A rank whose loop
  ends early therefore stops the others, naming it, instead of hanging them.

strategy="hooked" is the above. strategy="compiled" and strategy="pmap" leave
the scheduling to XLA: one psum per bucket inside the compiled step
(portddp/jax/compiled.py), over all processes (shard_map) or over this
process's devices (pmap).
"""

from __future__ import annotations

import math
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

import numpy as np
from jax.experimental import io_callback

from portddp import launch, watchdog
from portddp.autotune import CapTuner
from portddp.buckets import BucketPlan, ParamSpec, cap_bytes, plan_buckets, rebuild_plan
from portddp.jax import compiled, flax_nnx
from portddp.protocol import check_same_config, check_same_specs, nonfinite_error, unused_parameters_error
from portddp.timeline import BucketEvents, IterationEvents
from portddp.transport import get_transport

__all__ = ["Canonical", "DistributedDataParallel", "GradBucket", "JOINED", "Joined", "STRATEGIES"]

STRATEGIES = ("hooked", "compiled", "pmap")
TRANSPORTS = ("mpi",)
_now = time.perf_counter_ns


class Joined:
    """What `DistributedDataParallel.uneven` yields in place of a batch once this rank has run
    out while others still train. Hand it to grad_fn as the batch: the rank then shadows the
    others' synchronised step (zero gradients, the same collectives) and gets their mean back.
    A pytree with no leaves, so it also passes through the caller's jax.jit (hooked strategy)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "portddp.jax.JOINED"

    def __reduce__(self):
        return (Joined, ())


JOINED = Joined()
jax.tree_util.register_pytree_node(Joined, lambda _j: ((), None), lambda _aux, _children: JOINED)


class GradBucket:
    """What a comm hook sees: one bucket's flat numpy buffer and how to reduce it."""

    def __init__(self, index: int, buffer: np.ndarray, names: list[str], num_buckets: int, transport,
                 world_size: int, layout: list[tuple[int, tuple[int, ...]]] = ()):
        self._index = index
        self._buffer = buffer
        self._names = names
        self._layout = list(layout)  # (offset, shape) per parameter, in buffer order
        self._is_last = index == num_buckets - 1
        self._transport = transport
        self.world_size = world_size

    def index(self) -> int:
        return self._index

    def buffer(self) -> np.ndarray:
        return self._buffer

    def parameters(self) -> list[str]:
        return list(self._names)

    def gradients(self) -> list[np.ndarray]:
        """One view of the buffer per parameter, shaped like it (the canonical layout), as PyTorch's
        GradBucket.gradients() gives."""
        return [self._buffer[off:off + math.prod(shape)].reshape(shape) for off, shape in self._layout]

    def is_last(self) -> bool:
        return self._is_last

    def allreduce(self, array: np.ndarray, on_done=None):
        """Sum `array` in place over all ranks on the comm thread; returns a Handle at once."""
        return self._transport.allreduce(array, on_done=on_done)


class DistributedDataParallel:
    """Data-parallel gradients for a parameter pytree (or a Flax NNX state).

    Args:
        params: the pytree whose structure, shapes and dtypes define the plan.
        bucket_cap_mb, first_bucket_cap_mb: as in portddp.torch, "auto" included
            (it times synchronised grad_fn calls, so it needs grad_fn called eagerly,
            not inside your own jax.jit).
        strategy: "hooked" (custom_vjp taps + MPI comm thread), "compiled"
            (shard_map over all processes, one psum per bucket; needs
            portddp.init(jax_distributed=True) under mpirun) or "pmap" (this
            process's devices are the ranks; no MPI).
        transport: "mpi" (hooked: the gradients; compiled: construction checks only).
        overlap: False launches every bucket after backward (the baseline).
        order: parameter names (jax.tree_util.keystr of each leaf path) in
            registration order; default: the pytree's leaf order. Give the twin
            PyTorch model's order to get its identical plan.
        canonical: instead of `order`, a list of Canonical(leaf, name, perm) in
            registration order: the PyTorch twin's names and layout, for jobs
            that mix frameworks.
        pmap_devices: strategy="pmap" only: how many local devices (default all).
        broadcast_buffers: Flax NNX models only (nnx_value_and_grad): rank 0's buffers (every
            non-Param, non-RNG state, e.g. BatchStat) replace each rank's before every synchronised
            forward, as in PyTorch DDP. A plain pytree has no buffers.
        check_finite: (hooked) check every local gradient for NaN/Inf as XLA hands it over; if
            any rank finds one, every rank raises naming the parameters and ranks.
    """

    JOINED = JOINED
    """What `uneven()` yields once this rank is out of batches; pass it to grad_fn as the batch."""

    def __init__(self, params, bucket_cap_mb: float | str = 25.0, first_bucket_cap_mb: float = 1.0,
                 strategy: str = "hooked", transport: str = "mpi", overlap: bool = True, order=None,
                 canonical=None, pmap_devices: int | None = None, check_finite: bool = False,
                 broadcast_buffers: bool = True):
        params = flax_nnx.params_of(params)  # an nnx.Module: its nnx.Param state
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}: choose one of {STRATEGIES}")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}: portddp.jax supports {TRANSPORTS}")
        if check_finite and strategy != "hooked":
            raise ValueError(f"check_finite=True needs strategy='hooked' (the gradients pass through the host "
                             f"there); with strategy={strategy!r} XLA never hands them over")
        self.check_finite = check_finite
        if order is not None and canonical is not None:
            raise ValueError("pass order= or canonical= (which implies the order), not both")
        self._tuner = CapTuner() if isinstance(bucket_cap_mb, str) and bucket_cap_mb == "auto" else None
        if self._tuner is not None:
            bucket_cap_mb = self._tuner.first
        cap_bytes(bucket_cap_mb, "bucket_cap_mb")
        cap_bytes(first_bucket_cap_mb, "first_bucket_cap_mb")
        self.strategy, self.transport, self.overlap = strategy, transport, overlap
        self.broadcast_buffers = bool(broadcast_buffers)
        self.bucket_cap_mb, self.first_bucket_cap_mb = bucket_cap_mb, first_bucket_cap_mb

        paths, self._treedef = jax.tree_util.tree_flatten_with_path(params)
        leaf_names = [jax.tree_util.keystr(p) for p, _ in paths]
        leaves = [leaf for _, leaf in paths]
        if not leaves:
            raise ValueError("DistributedDataParallel needs a pytree with at least one array leaf")
        keys = [n for n, x in zip(leaf_names, leaves) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
        if keys:
            raise ValueError(
                f"leaf {keys[0]} is a JAX PRNG key, which is not a parameter: keep random state out of the "
                "parameters (for Flax NNX: in nnx.Rngs, whose RngState nnx_value_and_grad carries per rank; "
                "pass nnx.state(model, nnx.Param) or the model itself)")
        not_float = [(n, np.dtype(x.dtype).name) for n, x in zip(leaf_names, leaves)
                     if not jnp.issubdtype(x.dtype, jnp.floating)]
        if not_float:
            raise ValueError(
                f"leaf {not_float[0][0]} has dtype {not_float[0][1]}, which has no gradient: pass only the "
                "trainable floating-point parameters (for Flax NNX: nnx.state(model, nnx.Param)) and keep "
                f"integer state elsewhere ({len(not_float)} such leaves)"
            )
        self._leaf_shapes = [tuple(np.shape(x)) for x in leaves]
        self._leaf_dtypes = [np.dtype(x.dtype).name for x in leaves]
        self._leaf_names = leaf_names
        # Everything below works on parameter k = the k-th in registration order, in
        # the canonical layout; _leaf_of[k] and _perm[k] lead back to the pytree.
        canonical = canonical if canonical is not None else [
            Canonical(leaf_names[i], leaf_names[i], None) for i in self._registration_order(order)]
        self._leaf_of = self._leaf_indices([c.leaf for c in canonical])
        self._perm = [c.perm for c in canonical]
        self._names = [c.name for c in canonical]
        specs = self._specs_of(params)

        if strategy == "pmap":
            # This process's devices are the ranks: no other process, no MPI.
            self._transport = None
            self.world_size, self.rank = compiled.pmap_world(pmap_devices), 0
        else:
            check_same_config(launch.allgather_object({
                "bucket_cap_mb": "auto" if self._tuner else bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb,
                "transport": "mpi" if strategy == "hooked" else f"xla (strategy={strategy!r})", "check_finite": bool(check_finite)}))
            self._transport = get_transport()
            self.world_size, self.rank = self._transport.size, self._transport.rank
            launched = launch.world()
            if launched.size != self.world_size:
                raise RuntimeError(
                    f"portddp.jax talks over MPI, whose world here has {self.world_size} rank(s), but the "
                    f"launcher ({launched.launcher}) started {launched.size}: launch with `mpirun -n "
                    f"{launched.size} python ...` (or use strategy='pmap' within one process)")
            self._verify_same_params(specs)
            if strategy == "compiled":
                compiled.process_devices(self.world_size)  # fails early without jax.distributed
        self._inv_world = 1.0 / self.world_size
        self._hook = None
        self._hook_state = None
        self._lock = threading.Lock()
        self._tracing_fired: set | None = None  # while a hooked step is traced: the taps whose backward ran
        self._install_plan(plan_buckets(specs, bucket_cap_mb, first_bucket_cap_mb))
        self._rebuilt = strategy != "hooked"  # XLA schedules the other strategies: nothing to rebuild
        self._rebuild_order: list[int] | None = None
        self._observed_order: list[int] | None = None
        self._last_events: IterationEvents | None = None
        self._iterations = 0
        self._iteration_time = 0.0
        self._uneven: _Uneven | None = None  # inside ddp.uneven(): this step's agreement

    # ------------------------------------------------------------------ setup
    def _registration_order(self, order) -> list[int]:
        if order is None:
            return list(range(len(self._leaf_names)))
        return self._leaf_indices(order, what="order")

    def _leaf_indices(self, names, what: str = "canonical") -> list[int]:
        index = {n: i for i, n in enumerate(self._leaf_names)}
        unknown = [n for n in names if n not in index]
        if unknown or len(names) != len(index) or len(set(names)) != len(names):
            missing = sorted(set(index) - set(names))
            raise ValueError(
                f"{what} must list every parameter name exactly once; unknown: {unknown[:5]}, missing: "
                f"{missing[:5]} (names are jax.tree_util.keystr of the leaf paths, e.g. {self._leaf_names[0]!r})"
            )
        return [index[n] for n in names]

    def _specs_of(self, tree) -> list[ParamSpec]:
        """The (name, shape, dtype) of each parameter of `tree` in registration order and canonical
        layout -- or, for a tree of another structure, of each leaf (and the check will say where)."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != self._treedef:
            return [ParamSpec(jax.tree_util.keystr(p), tuple(np.shape(x)), np.dtype(x.dtype).name) for p, x in paths]
        return [ParamSpec(self._names[k], _permuted(tuple(np.shape(paths[i][1])), self._perm[k]),
                          np.dtype(paths[i][1].dtype).name) for k, i in enumerate(self._leaf_of)]

    def _verify_same_params(self, specs: list[ParamSpec]) -> None:
        """Compare every rank's parameters with rank 0's; name the first differing key path."""
        everyone = self._transport.allgather_object([(s.name, s.shape, s.dtype) for s in specs])
        check_same_specs(everyone, "parameter pytrees differ across ranks", "leaf", "leaves")

    _PER_PLAN = ("_plan", "_buffers", "_grad_buckets", "_taps", "_reduce_step", "_steps", "_hlo")

    def _install_plan(self, plan: BucketPlan) -> None:
        """Buffers, taps and compiled steps for `plan`; a plan seen before gets its own back
        (bucket_cap_mb="auto" switches between a few, and each is traced only once)."""
        if getattr(self, "_plan", None) is not None:
            self._plan_cache[self._plan.to_json()] = {a: getattr(self, a) for a in self._PER_PLAN}
        else:
            self._plan_cache: dict = {}
        cached = self._plan_cache.get(plan.to_json())
        if cached is not None:
            for a, value in cached.items():
                setattr(self, a, value)
            return
        self._plan = plan
        self._buffers = [np.zeros(b.numel, dtype=jnp.dtype(b.dtype)) for b in plan.buckets]
        self._grad_buckets = [
            GradBucket(b, buf, [self._names[k] for k in plan.buckets[b].params], len(plan.buckets), self._transport,
                       self.world_size, [(off, plan.specs[k].shape) for k, off in
                                         zip(plan.buckets[b].params, plan.buckets[b].offsets)])
            for b, buf in enumerate(self._buffers)
        ]
        self._taps = [self._make_tap(b) for b in range(len(plan.buckets))]
        self._reduce_step = None
        self._steps: dict = {}  # jitted steps per step function (held: an id could be reused), with this plan
        self._hlo: dict = {}  # compiled: what XLA made of this plan (filled at the first step)

    @property
    def bucket_plan(self) -> BucketPlan:
        return self._plan

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Handle` (see portddp.jax.hooks).
        Gradients then reach the bucket undivided; the hook divides."""
        if self._hook is not None:
            raise RuntimeError("a comm hook is already registered; register_comm_hook can be called only once")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket) -> Handle; got {hook!r}")
        self._hook, self._hook_state = hook, state

    # ------------------------------------------------------------- broadcast
    def broadcast(self, params):
        """Rank 0's values of `params` on every rank, after checking every rank passes the same
        structure, shapes and dtypes (the same exchange as portddp.torch's, portddp.protocol).

        Given a Flax nnx.Module, it updates the module in place -- rank 0's Params and buffers
        (BatchStat and other non-RNG state; RNG state stays per rank) -- and returns it."""
        if flax_nnx.is_module(params):
            return flax_nnx.broadcast(self, params)
        if self._transport is not None:
            # Agree first: a rank whose tree differs must not leave the others waiting in Bcast.
            self._verify_same_params(self._specs_of(params))
        leaves = self._leaves_of(params)
        if self.strategy == "pmap":
            return params  # one process: its values are rank 0's
        for b in range(len(self._plan.buckets)):
            self._pack(b, leaves, divide=False)
            if self.world_size > 1:
                self._transport.broadcast(self._buffers[b], root=0).wait()
        return self._unpack()

    def _broadcast_leaves(self, leaves: list) -> list:
        """Rank 0's values of a list of numpy-convertible arrays (any dtypes), in one Bcast of bytes."""
        arrays = [np.ascontiguousarray(np.asarray(x)) for x in leaves]
        if self.world_size == 1 or self._transport is None or not arrays:
            return arrays
        flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
        self._transport.broadcast(flat, root=0).wait()
        out, off = [], 0
        for a in arrays:
            out.append(flat[off:off + a.nbytes].view(a.dtype).reshape(a.shape).copy())
            off += a.nbytes
        return out

    def _leaves_of(self, tree) -> dict[int, object]:
        """{parameter index k: its leaf}, after checking the tree is the one we were built with."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self._treedef:
            raise ValueError(f"pytree structure differs from the one DistributedDataParallel was built with:"
                             f" got {treedef}, expected {self._treedef}")
        for name, shape, dtype, leaf in zip(self._leaf_names, self._leaf_shapes, self._leaf_dtypes, leaves):
            if tuple(np.shape(leaf)) != shape or np.dtype(leaf.dtype).name != dtype:
                raise ValueError(f"leaf {name} is {np.shape(leaf)} {np.dtype(leaf.dtype).name}; "
                                 f"expected {shape} {dtype}")
        return {k: leaves[i] for k, i in enumerate(self._leaf_of)}

    def _pack(self, b: int, leaves: dict, divide: bool) -> None:
        """Copy bucket b's parameters (canonical layout) into its flat buffer, divided if asked."""
        buf, bucket = self._buffers[b], self._plan.buckets[b]
        for k, off in zip(bucket.params, bucket.offsets):
            src = np.asarray(leaves[k])
            if self._perm[k] is not None:
                src = src.transpose(self._perm[k])
            dst = buf[off:off + src.size].reshape(src.shape)
            if divide:
                np.multiply(src, self._inv_world, out=dst, casting="unsafe")
            else:
                dst[...] = src

    def _unpack(self):
        """A new pytree of jax arrays holding the buffers' contents, in the pytree's own layout."""
        return jax.tree_util.tree_unflatten(self._treedef, self._unpack_host(jnp.array))

    def _unpack_host(self, array=np.array) -> list:
        """Copies of the buffers' contents (`array(view, copy=True)`), one per pytree leaf, in the
        pytree's own layout."""
        out = [None] * len(self._leaf_names)
        for buf, bucket in zip(self._buffers, self._plan.buckets):
            for k, off in zip(bucket.params, bucket.offsets):
                spec = self._plan.specs[k]
                value = buf[off:off + spec.numel].reshape(spec.shape)
                if self._perm[k] is not None:
                    value = value.transpose(np.argsort(self._perm[k]))
                # Copy: the buffer is reused by the next iteration.
                out[self._leaf_of[k]] = array(value, copy=True)
        return out

    # --------------------------------------------------------------- backward
    def _make_tap(self, b: int):
        """Identity on bucket b's parameters whose backward launches bucket b."""
        return _host_tap(lambda token, *grads: self._bucket_ready(b, grads), on_trace=lambda: self._tap_traced(b))

    def _tap_traced(self, b: int) -> None:
        """At trace time: tap b's backward rule is part of the program (JAX skips the rule of a tap
        whose outputs the loss never uses, so a bucket not recorded here would never fire)."""
        if self._tracing_fired is not None:
            self._tracing_fired.add(b)

    def _loss_tap(self):
        """Identity on the loss whose backward records the end of forward. The loss itself is
        handed to the callback, so that it cannot be scheduled before the forward is done."""
        return _host_tap(self._forward_done, keep_primal=True)

    def _start(self, dead: list):
        """Identity on a scalar whose forward opens the iteration on the host (`_begin_iteration`).
        Its output is the token every tap takes, so no tap's callback can run before it; the
        taps' callbacks return the cotangents of that token, which flow back into `start`'s
        input -- a value that exists only once every bucket has been launched. `dead` lists the
        buckets whose taps never fire (filled in once the step has been traced)."""

        @jax.custom_vjp
        def start(x):
            return io_callback(lambda _x: self._begin_callback(dead), jax.ShapeDtypeStruct((), jnp.float32), x,
                               ordered=False)

        def fwd(x):
            return start(x), None

        def bwd(_, ct):
            return (ct,)

        start.defvjp(fwd, bwd)
        return start

    def _begin_callback(self, dead):
        self._begin_iteration(dead)
        return np.float32(0)

    def _buffers_callback(self, *leaves):
        """Host side of broadcast_buffers in a hooked step: rank 0's buffers, then a zero the
        iteration's start waits on (so the Bcast precedes every bucket's all-reduce on every rank)."""
        return [*self._broadcast_leaves(leaves), np.float32(0)]

    def _forward_done(self, *_):
        self._events.forward_end_ns = _now()
        return np.float32(0)

    def _bucket_ready(self, b: int, grads) -> np.int32:
        """Host side of bucket b's tap: pack, mark ready, launch what the plan order allows."""
        now = _now()
        bucket = self._plan.buckets[b]
        if self.check_finite:
            for k, g in zip(bucket.params, grads):
                self._nonfinite[k] = not np.isfinite(g).all()
        self._pack(b, dict(zip(bucket.params, grads)), divide=self._hook is None)
        with self._lock:  # XLA may run independent callbacks on different threads
            self._ready_order.extend(bucket.params)
            self._events.buckets[b].ready_ns = now
            self._events.backward_end_ns = max(self._events.backward_end_ns, now)
            self._ready[b] = True
            if self.overlap:
                self._launch_ready_buckets()
        return np.float32(0)

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buffers) and self._ready[self._next_launch]:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        ev = self._events.buckets[b]
        ev.launch_ns = _now()
        if self.world_size == 1 and self._hook is None:
            self._handles[b] = None
            ev.done_ns = ev.launch_ns
            return
        if self._hook is None:
            self._handles[b] = self._transport.allreduce(self._buffers[b])
        else:
            self._handles[b] = self._hook(self._hook_state, self._grad_buckets[b])

    def _begin_iteration(self, dead=()) -> None:
        """Open an iteration. The `dead` buckets (no tap fires: the loss uses none of their
        leaves) are zeros and ready at once; they launch in plan order like the others.
        The watchdog learns that a synchronised iteration is under way (a peer that already left
        before reaching it stops this rank, naming it, instead of leaving it waiting)."""
        watchdog.step_started()
        n = len(self._buffers)
        self._ready = [False] * n
        self._next_launch = 0
        self._handles: list = [None] * n
        self._ready_order: list[int] = []
        self._nonfinite = np.zeros(len(self._names), np.int32)
        self._events = IterationEvents(
            rank=self.rank, forward_start_ns=_now(),
            buckets=[BucketEvents(b, buf.nbytes) for b, buf in enumerate(self._buffers)])
        if dead:
            with self._lock:
                self._zero_ready(dead)
                if self.overlap:
                    self._launch_ready_buckets()

    def _zero_ready(self, buckets) -> None:
        now = _now()
        for b in buckets:
            self._buffers[b].fill(0)
            self._events.buckets[b].ready_ns = now
            self._ready[b] = True

    def _finalize(self):
        """After the computation: launch the rest, wait in plan order, return the mean gradients."""
        with self._lock:
            # Only a safety net: buckets whose taps cannot fire were found at trace time (`dead`).
            self._zero_ready([b for b, r in enumerate(self._ready) if not r])
            self._launch_ready_buckets()
        # After the buckets, as portddp.torch does: how many ranks produced each gradient. A JAX
        # rank always has all of them; a PyTorch rank in the same job may not (portddp.protocol).
        # (check_finite: a second half counting, per parameter, the ranks with NaN/Inf in it)
        n = len(self._names)
        used = np.concatenate([np.ones(n, np.int32), self._nonfinite if self.check_finite else np.zeros(0, np.int32)])
        used_handle = self._transport.allreduce(used) if self.world_size > 1 else None
        for b, handle in enumerate(self._handles):
            if handle is not None:
                handle.wait()
                self._events.buckets[b].done_ns = handle.done_ns
        if used_handle is not None:
            used_handle.wait()
        watchdog.step_finished()  # every collective of the iteration is done (errors below are every rank's)
        self._events.finalize_end_ns = _now()
        self._last_events = self._events
        self._iterations += 1
        if not self._rebuilt and self._rebuild_order is None:
            self._rebuild_order = self._ready_order
        if used[:n].min() < self.world_size:
            raise unused_parameters_error(self._names, used[:n].tolist(), self.world_size, self.rank,
                                          [1] * len(self._names))
        if used[n:].any():
            mine = [self._names[k] for k in np.flatnonzero(self._nonfinite)]
            raise nonfinite_error(self._transport.allgather_object(mine) if self.world_size > 1 else [mine],
                                  self.rank)

    def _maybe_rebuild(self) -> None:
        """Once, at the call after the first synchronised one: re-plan from rank 0's observed order
        (broadcast), as portddp.torch does at its next forward."""
        if self._rebuild_order is None:
            return
        order = np.full(len(self._names), -1, np.int64)
        order[: len(self._rebuild_order)] = self._rebuild_order
        if self.world_size > 1:
            self._transport.broadcast(order, root=0).wait()
        self._observed_order = [int(i) for i in order if i >= 0]
        self._install_plan(rebuild_plan(self._plan, self._observed_order, self.bucket_cap_mb,
                                        self.first_bucket_cap_mb))
        self._rebuild_order = None
        self._rebuilt = True

    def _autotune(self) -> None:
        """bucket_cap_mb="auto": the cap this call uses; re-plan when it changes (which re-traces)."""
        if self._tuner is None or self._tuner.done:
            return
        cap = self._tuner.start_iteration(_now())
        if cap is None:  # trials over: agree on the winner (a collective, on every rank)
            gather = self._transport.allgather_object if self._transport is not None else (lambda x: [x])
            cap = self._tuner.decide(gather, self.rank)
        if cap != self.bucket_cap_mb:
            self.bucket_cap_mb = cap
            order = self._observed_order
            # Hooked: the observed order (or the pending rebuild uses the new cap); others: the initial order.
            if self._rebuild_order is None:
                self._install_plan(rebuild_plan(self._plan, order, cap, self.first_bucket_cap_mb) if order is not None
                                   else plan_buckets(self._plan.specs, cap, self.first_bucket_cap_mb))

    def value_and_grad(self, loss_fn, has_aux: bool = False):
        """`grad_fn(params, batch, sync=True) -> (loss, grads)`: grads are the mean over
        ranks (sync=True) or this rank's own (sync=False, to accumulate and `reduce` later).

        `loss` is this rank's own loss (pmap: the mean over devices). For pmap,
        `batch` is the process's whole batch, split evenly over the devices.
        With `has_aux=True`, `loss_fn` returns `(loss, aux)` and grad_fn
        `((loss, aux), grads)`, as with `jax.value_and_grad` (aux: this rank's;
        pmap: the first device's). For a Flax nnx.Module, see `nnx_value_and_grad`."""
        checked = _checked_loss(loss_fn, has_aux)

        def pure(_static, params, state, batch):
            loss, aux = checked(params, batch)
            return loss, (aux, state)

        step = self._grad_step(pure)

        def grad_fn(params, batch, sync: bool = True):
            if flax_nnx.is_module(params):
                raise TypeError(f"grad_fn got a Flax {type(params).__name__} module: use "
                                "ddp.nnx_value_and_grad(loss_fn), whose grad_fn takes (model, batch)")
            loss, aux, _, grads = step(None, params, None, batch, sync)
            return ((loss, aux) if has_aux else loss), grads

        return grad_fn

    def nnx_value_and_grad(self, loss_fn, has_aux: bool = False):
        """`grad_fn(model, batch, sync=True) -> (loss, grads)` for a Flax nnx.Module: the
        counterpart of `nnx.value_and_grad(loss_fn)` with `loss_fn(model, batch)`.

        grads is an nnx.State of the model's nnx.Param (the mean over ranks), ready for
        `optimizer.update(model, grads)`; the state the forward changed (BatchStat, RNG counts)
        is written back into `model`. See portddp/jax/flax_nnx.py for buffers and RNG."""
        return flax_nnx.value_and_grad(self, loss_fn, has_aux)

    def _grad_step(self, fn):
        """`step(static, params, state, batch, sync) -> (loss, aux, new_state, grads)` for
        `fn(static, params, state, batch) -> (loss, (aux, new_state))`, the one form every
        front end (value_and_grad, nnx_value_and_grad) reduces to. `static` is hashable and
        fixed per trace (an NNX GraphDef); `state` is per rank and not differentiated, and
        `state[0]` holds the buffers broadcast_buffers replaces with rank 0's (None: no state)."""
        local = jax.jit(jax.value_and_grad(fn, argnums=1, has_aux=True), static_argnums=0)

        def local_step(static, params, state, batch):
            (loss, (aux, new_state)), grads = local(static, params, state, batch)
            return loss, aux, new_state, grads

        if self.strategy != "hooked":
            def synced(static, params, state, batch, scale=None):
                self._autotune()
                step = self._steps.get(fn)
                if step is None:  # first call, or the plan changed ("auto"): compile with this plan
                    step = self._steps[fn] = self._timed(compiled.make_step(self, fn))
                return step(static, params, state, batch, scale)

            def uneven_step(static, params, state, batch):
                """Inside ddp.uneven() while some rank has joined: every rank runs the same program,
                which zeroes the gradients of the joined ranks (scale 0) before the psums; a joined
                rank feeds it zeros shaped like the others' batch (the forward's result is dropped)."""
                joined = isinstance(batch, Joined)
                if joined:
                    batch = self._uneven.zeros_batch()
                loss, aux, new_state, grads = synced(static, params, state, batch, 0.0 if joined else 1.0)
                return (None, None, state, grads) if joined else (loss, aux, new_state, grads)

            def xla_step(static, params, state, batch, sync=True):
                if sync and _traced(params):
                    raise ValueError(
                        f"strategy={self.strategy!r} runs its own program over every rank's device, which "
                        "cannot be traced into your jax.jit (or nnx.jit) over this process's arrays: call "
                        "grad_fn outside jit (it is compiled already; jit the optimizer update on its own), "
                        "or use strategy='hooked', which can be")
                if isinstance(batch, Joined):
                    self._leaves_of(params)
                    if self._uneven is None or self._uneven.count == self.world_size:
                        raise ValueError(_JOINED_OUTSIDE)
                    if not sync:
                        return None, None, state, _zeros_like(params)
                if not sync:
                    return _flax_errors(local_step, static, params, state, batch)
                if self._uneven is not None and self._uneven.count < self.world_size:
                    return _flax_errors(uneven_step, static, params, state, batch)
                return _flax_errors(synced, static, params, state, batch)

            return xla_step
        program = self._hooked_step(fn)

        def hooked_step(static, params, state, batch, sync: bool = True):
            joined = isinstance(batch, Joined)
            if _traced(params):
                # Inside the caller's jit: the program is traced once, with today's plan, so the
                # plan must not change under it -- no rebuild in this mode.
                if self._tuner is not None:
                    raise ValueError("bucket_cap_mb='auto' re-plans between grad_fn calls, which cannot happen "
                                     "inside your own jax.jit: pass a number of MB, or call grad_fn outside jit")
                self._rebuilt, self._rebuild_order = True, None
                if joined:
                    return self._joined_traced(params, state, sync)
                return _flax_errors(program if sync else local_step, static, params, state, batch)
            if sync:
                self._autotune()
            self._maybe_rebuild()
            if joined:  # the same collectives as the branch below, with zeros for this rank's gradients
                self._leaves_of(params)
                if not sync:
                    return None, None, state, _zeros_like(params)
                if self._bcasts_buffers(state):
                    self._broadcast_leaves(jax.tree.leaves(state[0]))  # rank 0's; this rank runs no forward
                return None, None, state, self._reduce_host(None)
            if not sync:
                return _flax_errors(local_step, static, params, state, batch)
            step = self._steps.get(program)
            if step is None:  # first call, or the plan was rebuilt: trace again with the new taps
                # A new function object each time: jax.jit caches traces per function.
                step = self._steps[program] = jax.jit(lambda *args: program(*args), static_argnums=0)
            self._callback_error = None
            try:
                loss, aux, new_state, grads = _flax_errors(step, static, params, state, batch)
                return loss, aux, new_state, jax.block_until_ready(grads)
            except Exception:
                error, self._callback_error = self._callback_error, None
                if error is None:
                    raise
                raise error from None  # portddp's own message, not XLA's wrapper around it

        return hooked_step

    def _joined_traced(self, params, state, sync: bool):
        """A joined rank's grad_fn inside the caller's jit (hooked): one host callback issues what
        the program's callbacks issue on the other ranks -- rank 0's buffers (Bcast, if the
        program broadcasts them), every bucket (zeros) and the used counts -- and hands back the mean."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if treedef != self._treedef:
            raise ValueError(f"pytree structure differs from the one DistributedDataParallel was built with:"
                             f" got {treedef}, expected {self._treedef}")
        if not sync:
            return None, None, state, _zeros_like(params)
        buffers = jax.tree.leaves(state[0]) if self._bcasts_buffers(state) else []
        reduced = io_callback(self._joined_callback,
                              [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves], *buffers, ordered=False)
        return None, None, state, jax.tree_util.tree_unflatten(self._treedef, reduced)

    def _joined_callback(self, *buffers):
        try:
            if buffers:
                self._broadcast_leaves(buffers)
            return self._reduce_host(None, host=True)
        except Exception as e:
            self._callback_error = e
            raise

    def _bcasts_buffers(self, state) -> bool:
        """Whether a hooked step with this `state` broadcasts rank 0's buffers before the iteration."""
        return (state is not None and self.broadcast_buffers and self.world_size > 1
                and bool(jax.tree.leaves(state[0])))

    def _timed(self, step):
        def run(*args):
            t0 = _now()
            watchdog.step_started()  # one XLA program holds the iteration's collectives
            out = step(*args)
            jax.block_until_ready(out[-1])
            watchdog.step_finished()
            self._iteration_time = (_now() - t0) * 1e-9
            self._iterations += 1
            return out

        return run

    def psum_buckets(self, leaves: list, axis_name: str) -> list:
        """Inside a compiled step: each bucket flattened, divided by the world size,
        summed with one psum, and split back. Takes and returns the pytree's leaf list
        (only JAX processes take part, so the pytree's own layout will do)."""
        out = list(leaves)
        for bucket in self._plan.buckets:
            flat = jnp.concatenate([leaves[self._leaf_of[k]].reshape(-1) for k in bucket.params])
            # Divide before the sum, as the hooked strategy and PyTorch do.
            flat = jax.lax.psum(flat * jnp.asarray(self._inv_world, flat.dtype), axis_name)
            for k, off in zip(bucket.params, bucket.offsets):
                i = self._leaf_of[k]
                out[i] = flat[off:off + self._plan.specs[k].numel].reshape(self._leaf_shapes[i])
        return out

    def _hooked_step(self, fn):
        """The synchronised step as one traceable program: host callbacks open the iteration,
        launch each bucket as XLA produces its gradients, and finally wait for the reductions and
        hand the reduced buckets back into the program. It can therefore be wrapped in the
        caller's own jax.jit (with the optimizer update, say); called eagerly, it is jitted here."""
        loss_tap = self._loss_tap()

        def program(static, params, state, batch):
            if jax.tree_util.tree_structure(params) != self._treedef:
                raise ValueError(f"pytree structure differs from the one DistributedDataParallel was built with:"
                                 f" got {jax.tree_util.tree_structure(params)}, expected {self._treedef}")
            dead: list[int] = []  # read by the start callback at run time, filled below at trace time
            start = self._start(dead)
            bcast = self._bcasts_buffers(state)

            def tapped(params, start_value, state):
                # Read at trace time: the plan's taps. A rebuilt plan needs a new trace (grad_fn).
                if bcast:  # rank 0's buffers, Bcast before the iteration starts (the token waits for it)
                    leaves, tree = jax.tree.flatten(state[0])
                    *leaves, after = io_callback(self._buffers_callback, [
                        *(jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves),
                        jax.ShapeDtypeStruct((), jnp.float32)], *leaves, ordered=False)
                    state = (jax.tree.unflatten(tree, leaves), *state[1:])
                    start_value = start_value + after
                token = start(start_value)
                leaves = list(jax.tree_util.tree_leaves(params))
                for b, bucket in enumerate(self._plan.buckets):
                    tapped_leaves = self._taps[b]([leaves[self._leaf_of[k]] for k in bucket.params], token)
                    for k, leaf in zip(bucket.params, tapped_leaves):
                        leaves[self._leaf_of[k]] = leaf
                loss, aux = fn(static, jax.tree_util.tree_unflatten(self._treedef, leaves), state, batch)
                return loss_tap(loss, token), aux

            self._tracing_fired = fired = set()
            try:
                (loss, (aux, new_state)), (_, launched) = jax.value_and_grad(tapped, argnums=(0, 1), has_aux=True)(
                    params, jnp.float32(0), state)
            finally:
                self._tracing_fired = None
            dead.extend(b for b in range(len(self._plan.buckets)) if b not in fired)
            # `launched` depends on every live tap's callback: this one runs after the last launch.
            # One array per parameter (canonical layout, plan order): XLA copies the callback's
            # results into its own buffers, so the host hands out views of the bucket buffers.
            specs = [self._plan.specs[k] for b in self._plan.buckets for k in b.params]
            reduced = io_callback(self._finish_callback,
                                  [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in specs],
                                  launched, ordered=False)
            return loss, aux, new_state, self._to_tree(reduced)

        return program

    def _finish_callback(self, _launched):
        """Host side of the end of the step: wait for every bucket; hand back each parameter's
        reduced gradient as a view of its bucket (XLA copies it out before the next step)."""
        try:
            self._finalize()
        except Exception as e:  # XLA wraps it in its own error; grad_fn raises this one instead
            self._callback_error = e
            raise
        return [buf[off:off + self._plan.specs[k].numel].reshape(self._plan.specs[k].shape)
                for buf, bucket in zip(self._buffers, self._plan.buckets)
                for k, off in zip(bucket.params, bucket.offsets)]

    def _to_tree(self, reduced):
        """Inside the program: per-parameter arrays in plan order -> the pytree, in its own layout."""
        out = [None] * len(self._leaf_names)
        ks = [k for bucket in self._plan.buckets for k in bucket.params]
        for k, value in zip(ks, reduced):
            if self._perm[k] is not None:
                value = value.transpose(tuple(np.argsort(self._perm[k])))
            out[self._leaf_of[k]] = value
        return jax.tree_util.tree_unflatten(self._treedef, out)

    def reduce(self, grads):
        """The mean over ranks of (accumulated) local gradients, bucket by bucket in plan order."""
        self._maybe_rebuild()
        leaves = self._leaves_of(grads)
        if self.strategy != "hooked":
            if self._reduce_step is None:
                self._reduce_step = compiled.make_reduce(self)
            watchdog.step_started()
            out = jax.block_until_ready(self._reduce_step(grads))
            watchdog.step_finished()
            return out
        return self._reduce_host(leaves)

    def uneven(self, batches, divide_by_initial_world_size: bool = True, throw_on_early_termination: bool = False):
        """Train on uneven inputs -- portddp.jax's counterpart of torch DDP's `with ddp.join():`.

            for batch in ddp.uneven(my_batches):      # this rank's batches, then JOINED
                loss, grads = grad_fn(params, batch)  # loss is None for JOINED
                params = update(params, grads)

        Before each step every rank says whether it still has a batch (one int32[world]
        all-reduce over the transport). While some rank does, every rank runs the step: a
        rank with a batch gets it as usual; a rank that has run out gets `ddp.JOINED`, which
        grad_fn takes as the batch and answers by shadowing the others' synchronised step --
        the very same collectives (hooked: rank 0's buffers if the program broadcasts them,
        one all-reduce per bucket in plan order, the used counts; compiled: the same XLA
        program, whose psums get zeros from the joined ranks) with zero gradients and no
        forward -- returning (None, the mean gradients) ((None, None) for loss and aux with
        has_aux); its model state (buffers, RNG) is left as it is. Once no rank has a batch,
        the loop ends on every rank at the same step.

        The mean is the sum of the ranks that had a batch divided by the initial world size
        (as torch's default), or with divide_by_initial_world_size=False by the number of
        ranks that had one (hooked, without a comm hook). Parameters stay identical: every
        rank -- joined or not -- gets the same mean gradients every step and applies them with
        the same update, so optimizer state stays in step too (torch instead broadcasts the
        last joiner's model at the end; nothing needs broadcasting here). The loop body must
        therefore run the same DDP calls (grad_fn with sync=True/False, reduce) at the same
        step on every rank, whatever the item is; give JOINED to grad_fn untouched (test
        `batch is ddp.JOINED` before using the batch for anything else). With sync=False a
        joined rank's grad_fn returns zeros, so accumulation then `reduce` works as usual.

        throw_on_early_termination=True: instead, every rank raises as soon as one runs out.
        Hooked grad_fn may be inside your own jax.jit (JOINED is a pytree with no leaves: it
        gets its own trace). bucket_cap_mb="auto" is refused until the caps are chosen.
        Each agreement counts as one synchronised iteration for portddp.watchdog."""
        if self._tuner is not None and not self._tuner.done:
            raise RuntimeError(f"uneven() with bucket_cap_mb='auto' is refused while the caps are still being timed "
                               f"(the first {self._tuner.iterations} synchronised steps): pass a fixed bucket_cap_mb")
        if not divide_by_initial_world_size and (self.strategy != "hooked" or self._hook is not None):
            raise ValueError("uneven(divide_by_initial_world_size=False) needs strategy='hooked' without a comm hook "
                             "(it changes the divisor per step on the host): use the default (divide by the initial "
                             "world size) or strategy='hooked'")
        return self._uneven_steps(iter(batches), divide_by_initial_world_size, throw_on_early_termination)

    def _uneven_steps(self, batches, divide: bool, throw: bool):
        alone = self._transport is None or self.world_size == 1  # pmap, or a world of one: nothing to agree on
        step = _Uneven()
        try:
            while True:
                batch = _END if step.out else next(batches, _END)
                step.out = batch is _END
                if alone:
                    if step.out:
                        return
                    yield batch
                    continue
                flags = np.zeros(self.world_size, np.int32)
                flags[self.rank] = not step.out
                watchdog.step_started()  # a collective every rank must reach, like an iteration
                self._transport.allreduce(flags).wait()
                watchdog.step_finished()
                step.count = int(flags.sum())
                if step.count == 0:
                    return
                if step.count < self.world_size and throw:
                    out = [r for r in range(self.world_size) if not flags[r]]
                    raise RuntimeError(f"uneven(throw_on_early_termination=True): rank(s) {out} ran out of batches "
                                       f"while {step.count} of {self.world_size} ranks still have one")
                step.template = None
                if step.count < self.world_size and self.strategy == "compiled":
                    # The joined ranks feed the program zeros shaped like a batch of a rank that has one.
                    step.template = next(t for t in self._transport.allgather_object(
                        None if step.out else _batch_spec(batch)) if t is not None)
                self._inv_world = 1.0 / (self.world_size if divide else step.count)
                self._uneven = step
                yield JOINED if step.out else batch
                self._uneven = None
        finally:
            self._uneven = None
            self._inv_world = 1.0 / self.world_size

    def _reduce_host(self, leaves: dict | None, host: bool = False):
        """One synchronised iteration on the host: every bucket packed from `leaves` (None: zeros,
        a joined rank's share) and launched in plan order, then the used counts. The same
        collectives as a hooked grad_fn step, which is what lets a joined rank shadow one.
        Returns the pytree (jax arrays), or with `host` its leaves as numpy copies (for a callback)."""
        self._begin_iteration()
        for b in range(len(self._buffers)):
            if leaves is None:
                self._buffers[b].fill(0)
            else:
                self._pack(b, leaves, divide=self._hook is None)
            with self._lock:
                self._ready[b] = True
                self._launch_ready_buckets()
        self._finalize()
        return self._unpack_host() if host else self._unpack()

    def plan_state(self) -> dict:
        """The bucket plan in use and the cap it was made with, as plain JSON (what a checkpoint keeps
        so a resumed run buckets exactly as the saved one did, without re-learning the order)."""
        return {"bucket_plan": self._plan.to_json(), "bucket_cap_mb": self.bucket_cap_mb}

    def load_plan_state(self, state: dict) -> None:
        """Use a plan from `plan_state()` from now on, as if this run had rebuilt (and autotuned) it
        itself. The plan must be for the same parameters."""
        plan = BucketPlan.from_json(state["bucket_plan"])
        if plan.specs != self._plan.specs:
            raise ValueError("load_plan_state: the saved bucket plan is for other parameters than this model's")
        self.bucket_cap_mb = state["bucket_cap_mb"]
        if self._tuner is not None:
            self._tuner.chosen = self.bucket_cap_mb  # tuned already, in the run that saved it
        self._install_plan(plan)
        self._rebuild_order = None
        self._observed_order = [k for b in plan.buckets for k in b.params]
        if self.strategy == "hooked":
            self._rebuilt = True

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """DESIGN.md metrics of the last synchronised iteration, plus its events."""
        extra = {"iterations": self._iterations, "bucket_cap_mb": self.bucket_cap_mb}
        if self._tuner is not None:
            extra["autotune"] = self._tuner.summary()
        if self.strategy != "hooked":
            return {"iteration_time": self._iteration_time, "hlo": self._hlo} | extra
        if self._last_events is None:
            return {}
        return self._last_events.stats() | extra | {"plan_rebuilt": self._rebuilt}


class Canonical(NamedTuple):
    """How one pytree leaf appears in the bucket plan: under `name`, transposed by `perm`.

    With these, a JAX rank uses the exact names, shapes and flat layout of a
    PyTorch twin (portddp.models.jax_canonical builds them), which is what lets
    one job mix the two frameworks (comparisons/mixed.py)."""

    leaf: str  # jax.tree_util.keystr of the leaf's path
    name: str  # the name every rank agrees on, e.g. the PyTorch parameter name
    perm: tuple[int, ...] | None  # canonical array = leaf.transpose(perm); None: as is


def _host_tap(on_backward, keep_primal: bool = False, on_trace=None):
    """`tap(x, token) -> x`, whose backward rule calls `on_backward` on the host (io_callback)
    with (the primal value if `keep_primal`,) the token and the cotangents of x, as soon as XLA
    has computed them. It passes the cotangents on unchanged, and the callback's float32 result
    becomes the token's cotangent: whatever depends on that has to wait for the callback.

    `on_trace()` runs when the backward rule is traced. JAX traces it only if some output of the
    tap reaches the loss (unused outputs within it get zero cotangents, instantiated)."""

    @jax.custom_vjp
    def tap(x, token):
        return x

    def fwd(x, token):
        return x, (x if keep_primal else None, token)

    def bwd(residual, g):
        if on_trace is not None:
            on_trace()
        done = io_callback(on_backward, jax.ShapeDtypeStruct((), jnp.float32), *jax.tree.leaves((residual, g)),
                           ordered=False)
        return g, done

    tap.defvjp(fwd, bwd)
    return tap


def _permuted(shape: tuple[int, ...], perm) -> tuple[int, ...]:
    return shape if perm is None else tuple(shape[p] for p in perm)


def _traced(tree) -> bool:
    """Whether `tree` holds tracers: grad_fn is being traced into the caller's jit."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _flax_errors(step, *args):
    """Run `step`; Flax's error for state mutated across a trace boundary becomes portddp's, with the fix."""
    try:
        return step(*args)
    except Exception as e:
        if type(e).__name__ != "TraceContextError":
            raise
        raise RuntimeError(
            f"loss_fn changed Flax NNX state that was not passed to grad_fn (Flax: {str(e).split(' (')[0]}): "
            "portddp traces loss_fn into its own compiled step, so an nnx.Rngs (or any nnx.Variable) captured "
            "from outside cannot be updated there. Keep it in the model -- e.g. nnx.Dropout(rate, rngs=rngs) "
            "holds its own stream -- and use ddp.nnx_value_and_grad(loss_fn)(model, batch), which carries the "
            "model's RNG state and buffers through the step") from None


def _checked_loss(loss_fn, has_aux: bool):
    """loss_fn as `(x, batch) -> (loss, aux)` (aux None without has_aux), checked at trace time to
    return a floating-point scalar loss (the same error on every rank, before any collective)."""
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def checked(x, batch):
        out = loss_fn(x, batch)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                got = f"a {type(out).__name__} of {len(out)} values" if isinstance(out, tuple | list) else \
                    f"one array of shape {jnp.shape(out)}" if hasattr(out, "shape") else f"a {type(out).__name__}"
                raise TypeError(f"has_aux=True: loss_fn must return a pair (loss, aux); {name!r} returned {got}")
            loss, aux = out
        elif isinstance(out, tuple | list):
            raise TypeError(
                f"loss_fn must return a scalar; {name!r} returned a {type(out).__name__} of {len(out)} values: to "
                "return (loss, aux) pass has_aux=True (ddp.value_and_grad(loss_fn, has_aux=True); grad_fn then "
                "returns ((loss, aux), grads)), or return only the loss")
        else:
            loss, aux = out, None
        if jnp.shape(loss) != ():
            raise TypeError(f"loss_fn must return a scalar; {name!r} returned shape {jnp.shape(loss)}: reduce it "
                            "(e.g. .mean()) inside loss_fn")
        if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise TypeError(f"loss_fn must return a floating-point scalar; {name!r} returned "
                            f"{jnp.result_type(loss)}: gradients need a real-valued loss")
        return loss, aux

    return checked


_JOINED_OUTSIDE = ("grad_fn got JOINED as the batch outside a step of ddp.uneven() in which some rank has joined: "
                   "pass only what `for batch in ddp.uneven(batches)` yields")
_END = object()


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


class _Uneven:
    """One step of ddp.uneven(), as every rank agreed on it."""

    def __init__(self):
        self.out = False  # this rank has run out of batches
        self.count = 0  # how many ranks have a batch this step
        self.template = None  # strategy="compiled", some rank joined: (treedef, [(shape, dtype)]) of a batch

    def zeros_batch(self):
        treedef, specs = self.template
        return jax.tree_util.tree_unflatten(treedef, [np.zeros(shape, dtype) for shape, dtype in specs])


def _batch_spec(batch):
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, [(tuple(np.shape(x)), np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)) for x in leaves]
