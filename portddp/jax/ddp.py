"""DistributedDataParallel for JAX parameter pytrees: the DDP design, functionally.

Mirrors portddp/torch/ddp.py: the same sections in the same order, the same
method names for the same roles. What JAX forces to differ:

* No per-parameter autograd hooks. Each bucket's parameters pass through a
  `jax.custom_vjp` identity (a "tap", `_make_tap`) on their way into the loss.
  Its backward rule receives the bucket's gradients the moment XLA has produced
  them and hands them to the host (portddp/jax/taps.py: XLA lends its buffers to a
  `jax.experimental.buffer_callback`; io_callback on older JAX): the callback
  packs them (divided by the world size) into the bucket's flat buffer and
  launches the all-reduce on the MPI transport's comm thread while XLA goes on
  with the backward pass. A bucket arrives whole: "ready" needs no counting.
* Gradients are values, not `.grad` fields: grad_fn returns them, in the input
  pytree's structure, after waiting for every bucket (`_fill`: written into XLA's
  result buffers; `_write_grads` for eager `reduce()`). The
  pytree <-> bucket layout lives in portddp/jax/layout.py.
* Every parameter gets a gradient (zeros if the loss does not use it, as
  `jax.grad` gives), so there is no `find_unused_parameters`. JAX never runs the
  backward rule of a tap whose outputs the loss ignores; such buckets are found
  when the step is traced and launched as zeros in plan order, so every rank
  issues the same all-reduces. `sync=False` plays the role of `no_sync()`.
* No `gradient_as_bucket_view` (gradients are fresh arrays). Buffers exist only
  for Flax NNX models (`nnx_value_and_grad`, portddp/jax/flax_nnx.py); with
  `broadcast_buffers=True` rank 0's replace each rank's before every
  synchronised forward. RNG state stays per rank, as torch's generators do.
* No check that the model changed after wrapping: the pytree comes with every
  call, and another structure, shape or dtype is refused where it is flattened.
* `check_finite` needs strategy="hooked": only there do gradients pass the host.
* Only strategy="hooked" can be traced into the caller's own `jax.jit` (or
  `lax.scan`): its collectives are host callbacks. Not into `jax.vmap`, which
  would run them once per batch element; "compiled" and "pmap" are programs
  over devices of their own (portddp/jax/compiled.py) and refuse any trace.
* Uneven inputs: no `join()` context manager (no forward to hook a shadow
  into): `for batch in ddp.uneven(batches)` yields `ddp.JOINED` to the ranks
  that ran out, whose grad_fn issues the step's collectives with zero
  gradients (`_shadow_iteration`) and returns the same mean as the others'.
* portddp.watchdog hears of every synchronised iteration from the host
  callbacks that open and finish it (hooked) or around the XLA program.

strategy="compiled" and "pmap" leave the scheduling to XLA: one psum per bucket
inside the compiled step, over all processes (shard_map) or over this
process's devices (pmap); `self._comm` is then the MPI comm (construction
checks, agreements) or, for pmap, a LocalComm (portddp/jax/comm.py).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import sys
import threading
import time
import types
import warnings
import weakref
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from portddp import launch, malloc, watchdog
from portddp.buckets import BucketPlan, ParamSpec, plan_buckets, rebuild_plan
from portddp.common import DDPCommon, GradBucketCommon, hook_name as _hook_name, next_ddp_number
from portddp.config import DDPConfig
from portddp.jax import closure, compiled, flax_nnx, taps
from portddp.jax.comm import TRANSPORTS, check_strategy, make_comm
from portddp.jax.layout import Canonical, Layout, copy_scaled
from portddp.protocol import (BROADCAST_CHECK, buffer_layout, buffer_sync_header, check_buffer_sync_header,
                              check_same_config, check_same_frozen, check_same_step, check_same_specs,
                              hook_result_error, nonfinite_error, unused_parameters_error)
from portddp.timeline import BucketEvents, IterationEvents
from portddp.transport import Handle

__all__ = ["Canonical", "DistributedDataParallel", "GradBucket", "JOINED", "Joined", "STRATEGIES"]

STRATEGIES = ("hooked", "compiled", "pmap")
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


class GradBucket(GradBucketCommon):
    """What a comm hook sees: one bucket's flat numpy buffer and how to reduce it (the interface
    of portddp.torch's GradBucket, on numpy)."""

    def __init__(self, index: int, buffer: np.ndarray, names: list[str], grads: list, num_buckets: int, comm):
        super().__init__(index, buffer, num_buckets, comm)
        self._names = names
        self._grads = grads

    def gradients(self) -> list[np.ndarray]:
        """One view of the bucket buffer per parameter, shaped like it (canonical layout)."""
        return list(self._grads)

    def parameters(self) -> list[str]:
        return list(self._names)


_GRAD_FNS_KEPT = 16  # grad_fns remembered per DDP, the least recently asked for forgotten first (_grad_fn_for)


class _Token:
    """What a plan's traced programs are kept by: one per grad_fn (its step holds it), so that a
    grad_fn's programs go with it -- a script that builds a new loss function at every step (a
    lambda capturing that step's teacher) gets a new program each time, and each holds what its
    loss captured; kept by the loss function, they held every step's (an audit)."""

    __slots__ = ("__weakref__",)


_REDUCE = _Token()  # (ddp.reduce()'s program: one per plan, kept with it)


class _PlanState(NamedTuple):
    """What belongs to one bucket plan: bucket_cap_mb="auto" switches between a few plans, and
    each keeps its buffers, taps and traced programs (traced once per plan)."""

    plan: BucketPlan
    buffers: list  # one flat numpy buffer per bucket (hooked: what the collectives reduce)
    taps: list  # one custom_vjp identity per bucket (_make_tap)
    steps: weakref.WeakKeyDictionary  # per grad_fn (its _Token): its jitted (hooked) or compiled program
    lent: list  # eager hooked steps: sets of bucket buffers, some still lent to the caller (_lend)


@contextlib.contextmanager
def _xla_rendezvous_named(strategy: str, iterations: int):
    """XLA's own words when its collectives cannot start -- every rank meets in the key-value store
    before a program's first all-reduce, and gives up after 30 s: "Gloo context initialization failed:
    DEADLINE_EXCEEDED: GetKeyValue() timed out with key: cpu:gloo/...", naming no rank and no cause
    (an audit: the other rank had raised portddp's own error and caught it) -- said in portddp's."""
    try:
        yield
    except Exception as e:
        text = str(e)
        if "GetKeyValue() timed out" not in text and "Gloo context initialization failed" not in text:
            raise
        raise RuntimeError(
            f"portddp.jax (strategy={strategy!r}, after {iterations} iteration(s)): the other ranks did not reach "
            "this step's collectives within XLA's wait for them (30 s): a rank is behind (loading, compiling, "
            "checkpointing), raised an error (see its output), or skipped this step (grad_fn called on some "
            f"ranks only). Every rank must call grad_fn at every step. XLA said: {text.splitlines()[0][:300]}") from e


class DistributedDataParallel(DDPCommon):
    """Data-parallel gradients for a parameter pytree (or a Flax NNX state).

    Args:
        params: the pytree whose structure, shapes and dtypes define the plan (or an nnx.Module:
            its nnx.Param state).
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
        wrt: Flax NNX models only: an nnx filter for the state to differentiate and reduce
            (default nnx.Param), the one your nnx.Optimizer's wrt= uses -- nnx.LoRAParam to
            train adapters only, a path predicate for plain array attributes. Params it leaves
            out are frozen, as PyTorch parameters with requires_grad=False: ddp.broadcast(model)
            gives them rank 0's values once; no gradient is computed or reduced for them.
    """

    JOINED = JOINED
    """What `uneven()` yields once this rank is out of batches; pass it to grad_fn as the batch."""

    def __init__(self, params, bucket_cap_mb: float | str = 25.0, first_bucket_cap_mb: float = 1.0,
                 strategy: str = "hooked", transport: str = "mpi", overlap: bool = True, order=None,
                 canonical=None, pmap_devices: int | None = None, check_finite: bool = False,
                 broadcast_buffers: bool = True, wrt=None):
        model, params = params, flax_nnx.params_of(params, wrt)  # an nnx.Module: its nnx.Param (or wrt=) state
        self._nnx_wrt = wrt
        # Validate everything local before talking to other ranks: every rank sees the same
        # arguments, so every rank raises the same error.
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}: choose one of {STRATEGIES}")
        config = DDPConfig.resolve(bucket_cap_mb, first_bucket_cap_mb, transport=transport, transports=TRANSPORTS,
                                   overlap=overlap, check_finite=check_finite)
        if check_finite and strategy != "hooked":
            raise ValueError(f"check_finite=True needs strategy='hooked' (the gradients pass through the host "
                             f"there); with strategy={strategy!r} XLA never hands them over")
        check_strategy(strategy)
        self.config = config
        self._tuner = config.tuner()
        self.strategy = strategy
        self.bucket_cap_mb = config.bucket_cap_mb
        self.first_bucket_cap_mb = config.first_bucket_cap_mb
        self.broadcast_buffers = bool(broadcast_buffers)
        self.overlap = config.overlap
        self.transport = config.transport
        self.check_finite = config.check_finite
        self._iterations = 0  # synchronised iterations finished
        self._left_uneven = None  # the agreements of a ddp.uneven() loop this rank left early, until all meet again
        self._step_count = 0  # grad_fn calls (sync=False ones included), compared across ranks at every reduction
        self._local_params = None  # the parameters of the last eager sync=False step, while values may differ
        self._buffers_agreed = False  # buffer specs agreed across ranks (first synchronised call): _agree_on_start
        self._buffers_travel = False  # ... and compared again at every synchronised step (compiled, with buffers)
        self._step_counted = False  # this eager call counted already (else its traced program counts it)
        self._layout = Layout(params, order, canonical)
        self._mixed = False  # a job shared with PyTorch ranks (set below from the config exchange)
        self._plan_agreed = False  # _agree_on_start ran (at the first synchronised call, or reduce())
        self._traced_seen = False  # some grad_fn call of this rank was traced (sync=False ones included)
        specs = self._specs(params)

        if strategy != "pmap":  # (pmap: one process, nobody to compare with)
            launch.ensure_watchdog()  # (unless portddp.init() started it, or was told not to)
            mine = config.exchanged(transport="mpi" if strategy == "hooked" else f"xla (strategy={strategy!r})")
            # (as portddp.torch's: what changes the collectives each rank issues)
            mine["jax"] = {"broadcast_buffers": bool(broadcast_buffers)}
            if flax_nnx.is_module(model):  # which of its state it trains (named when it differs)
                mine["jax"]["wrt"] = flax_nnx.filter_name(wrt)
            everyone = launch.allgather_object(mine, name="DDP construction: config check")
            check_same_config(everyone)
            # A job shared with PyTorch ranks (their entries carry no "jax" part): see _agree_on_start
            self._mixed = any("jax" not in e for e in everyone)
        self._comm = make_comm(strategy, pmap_devices)
        if strategy == "pmap" and (launched := launch.detect()).size > 1:
            raise ValueError(
                f"strategy='pmap' maps over this process's devices only, but {launched.launcher} started "
                f"{launched.size} processes: each would average its own devices' gradients and train alone. Use "
                "strategy='hooked' or 'compiled' (they span processes), or run pmap in one process "
                "(python train.py, not under mpirun/torchrun)")
        self.world_size = self._comm.size
        self.rank = self._comm.rank
        self._inv_world = 1.0 / self.world_size
        self._values_differ: list[int] = []  # ranks whose parameter values differ from rank 0's (construction)
        self._values_unknown = False  # ... or whose values were abstract there (jax.eval_shape): compared later
        # (with wrt=, the frozen Params too: ddp.broadcast(model) gives them rank 0's values, as the trained ones)
        self._verify_same_model(specs, _fingerprint([*self._layout.leaves_of(params).values(),
                                                     *flax_nnx.frozen_of(model, wrt)]))
        if strategy == "compiled":
            compiled.process_devices(self.world_size)  # fails early without jax.distributed
        if strategy == "hooked":
            malloc.keep_freed_memory()
        self._hook = None
        self._defer_gather = False  # this iteration's all-reduces leave their gathers to _fill
        self._stale_used = None  # the used-count handle of an iteration that failed before its gathers
        self._hook_state = None
        self._lock = threading.Lock()  # XLA may run independent host callbacks on different threads
        self._callback_errors: list = _CallbackErrors(self)  # what the last eager step's host callbacks raised
        self._tracing_fired: set | None = None  # while a hooked step is traced: the taps whose backward ran
        self._plans: dict[str, _PlanState] = {}
        self._grad_fns: collections.OrderedDict = collections.OrderedDict()  # (see _grad_fn_for)
        self._grad_fn_codes: collections.Counter = collections.Counter()
        self._lent = False  # an eager hooked step has lent bucket buffers to the caller (_lend)
        self._install_plan(plan_buckets(specs, self.bucket_cap_mb, self.first_bucket_cap_mb))
        self._rebuilt = strategy != "hooked"  # XLA schedules the other strategies: nothing to rebuild
        self._rebuild_order: list[int] | None = None
        self._observed_order: list[int] | None = None  # rank 0's, once the plan was rebuilt
        self._uneven: _Uneven | None = None  # inside ddp.uneven(): this step's agreement
        self._last_events: IterationEvents | None = None
        self._iterations = 0
        self._buffer_syncs = 0  # buffer broadcasts so far (their header carries it)
        self._hooks_agreed = False  # the first synchronised iteration compares comm hooks across ranks
        self._iteration_time = 0.0  # compiled, pmap: seconds of the last step
        self._hlo: dict = {}  # compiled, pmap: what XLA made of the last step
        # (in its step slots: which of the process's DDPs reduces, as portddp.torch's)
        self._ddp_number = next_ddp_number() if strategy != "pmap" else 0

    # ---- construction
    def _specs(self, tree) -> list[ParamSpec]:
        return self._layout.specs(tree)

    def _verify_same_model(self, specs: list[ParamSpec], fingerprint: str | None = None,
                           what: str = "model check") -> None:
        """Compare every rank's parameters with rank 0's; name the first differing key path. With a
        `fingerprint` of the values (construction), remember which ranks' values differ from rank 0's:
        unless broadcast() makes them equal, the first synchronised step checks again (see
        `_check_same_values`) -- native DDP broadcasts at construction, a JAX DDP cannot (it owns no
        parameters), and replicas that start apart never meet."""
        self._issue(what)
        with watchdog.waiting():
            everyone = self._comm.allgather_object([[(s.name, s.shape, s.dtype) for s in specs], fingerprint])
        check_same_specs([e[0] for e in everyone], "parameter pytrees differ across ranks", "leaf", "leaves")
        check_same_frozen(everyone)  # (a PyTorch rank's frozen parameters, in a mixed job: a JAX rank has none)
        prints = [e[1] for e in everyone]  # (None from a PyTorch rank, or for abstract parameters)
        self._values_unknown = False
        if None not in prints:
            self._values_differ = [r for r, f in enumerate(prints) if f != prints[0]]
        elif what == "model check" and all(len(e) == 2 for e in everyone):
            # Built from abstract shapes (jax.eval_shape) on some rank: the values are compared at the first
            # synchronised step instead, unless broadcast() makes them equal first. (Not in a job with PyTorch
            # ranks, which issue no such collective.)
            self._values_differ = [r for r, f in enumerate(prints) if f is None]
            self._values_unknown = True

    def _check_same_values(self, params, traced: bool, frozen=()) -> None:
        """The first synchronised step, if the parameters differed across ranks at construction and
        broadcast() was not called: compare them again (eager; a collective every rank issues, the
        flag being the same everywhere) and refuse to average gradients of different models. Under
        the caller's jax.jit there are no values to compare: a warning instead. `frozen`: the leaves
        of the Params an NNX model's wrt= leaves out, compared with the trained ones (a replica
        whose frozen base differs trains apart as surely)."""
        differ, self._values_differ = self._values_differ, []
        if not differ or self.world_size == 1 or traced and self._values_unknown:
            return  # (under the caller's jit, values unknown at construction stay unknown: nothing to warn of)
        fix = ("every rank must start from the same parameters: call params = ddp.broadcast(params) once after "
               "building DistributedDataParallel (native DDP does this at construction), or initialise them from "
               "the same seed on every rank")
        if frozen:
            fix += (" (with wrt=, ddp.broadcast(model) gives the Params it leaves out -- frozen, compared here too -- "
                    "rank 0's values as well)")
        if traced:
            warnings.warn(f"the parameters' values differed across ranks when DistributedDataParallel was built (rank "
                          f"{', '.join(map(str, differ))} vs rank 0) and broadcast() was not called since; unless "
                          f"they were made equal since, the replicas train apart: {fix}", RuntimeWarning, stacklevel=3)
            return
        # (None: no values to compare here -- a reduce() of gradients no grad_fn call computed)
        mine = _fingerprint([*self._layout.leaves_of(params).values(), *frozen]) if params is not None else None
        self._issue("parameter values check")
        with watchdog.waiting():
            prints = self._comm.allgather_object(mine)
        ref = next((r for r, f in enumerate(prints) if f is not None), None)
        apart = [r for r, f in enumerate(prints) if f is not None and f != prints[ref]]
        if apart:
            raise ValueError(f"parameter values differ across ranks at the first synchronised step (rank "
                             f"{', '.join(map(str, apart))} vs rank {ref}; this is rank {self.rank}): averaging "
                             f"gradients of different models trains every replica apart. {fix}")

    def _broadcast_state(self, params):
        """Rank 0's values of `params` everywhere, bucket by bucket, after agreeing again: the same
        exchange as portddp.torch's _broadcast_state (see portddp.protocol)."""
        # Agree first: a rank whose tree differs must not leave the others waiting in Bcast.
        self._verify_same_model(self._specs(params), what=BROADCAST_CHECK)
        self._values_differ = []
        leaves = self._layout.leaves_of(params)
        self._issue("broadcast of rank 0's parameters")
        self._buffers = self._free_buffers()
        with watchdog.waiting():
            for b, bucket in enumerate(self._plan.buckets):
                self._pack(b, [leaves[k] for k in bucket.params], divide=False)
                self._comm.broadcast_([self._buffers[b]], src=0)
        return self._write_grads()  # (the buffers hold rank 0's parameters)

    # ---- plan
    def _install_plan(self, plan: BucketPlan) -> None:
        """Buffers, taps and traced steps for `plan`; a plan seen before gets its own back."""
        key = plan.to_json()
        if key not in self._plans:
            buffers = self._new_buffers(plan)
            self._plans[key] = _PlanState(plan, buffers, [self._make_tap(b) for b in range(len(plan.buckets))],
                                          weakref.WeakKeyDictionary(),
                                          [buffers])
        self._plan, self._buffers, self._taps, self._steps, self._buffer_sets = self._plans[key]

    def _grad_bucket(self, b: int, buffer: np.ndarray) -> GradBucket:
        bucket, specs = self._plan.buckets[b], self._plan.specs
        grads = [buffer[off:off + specs[k].numel].reshape(specs[k].shape)
                 for k, off in zip(bucket.params, bucket.offsets)]
        return GradBucket(b, buffer, [self._layout.names[k] for k in bucket.params], grads, len(self._plan.buckets),
                          self._comm)

    @property
    def bucket_plan(self) -> BucketPlan:
        """The BucketPlan in use (after the rebuild, the rebuilt one)."""
        return self._plan

    # ---- public API
    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Handle` (see portddp.jax.hooks).

        Call once, before the first synchronised step. Gradients then reach the bucket
        undivided; the hook divides. Once the handle is done, bucket.buffer() holds the result.
        (portddp.torch also takes a hook registered later, as native DDP does; here the steps
        already traced -- into your own jit, or compiled -- have fixed whether a hook reduces and
        whether the buckets are lent, so a later hook is refused rather than half applied.)"""
        if self.strategy != "hooked":
            # (was: stored and never called -- plain psums, fp16 or PowerSGD silently not applied)
            raise ValueError(f"register_comm_hook needs strategy='hooked': the {self.strategy!r} strategy's buckets "
                             "are psums inside one XLA program, which calls no Python hook. Build the "
                             "DistributedDataParallel with strategy='hooked' to reduce through a comm hook")
        if self._hook is not None:
            raise RuntimeError("a comm hook is already registered; register_comm_hook can be called only once")
        if self._iterations:
            raise RuntimeError(
                f"register_comm_hook after {self._iterations} synchronised step(s): portddp.jax takes a comm hook "
                "only before the first one (the steps already traced fixed whether a hook reduces): register it "
                "right after constructing the DistributedDataParallel, before training -- or, to switch hooks "
                "mid-run, build a new DistributedDataParallel (and a new step function) from then on")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket) -> Handle; got {hook!r}")
        self._hook, self._hook_state = hook, state
        self._hooks_agreed = False  # compared across ranks before the next bucket

    def value_and_grad(self, loss_fn, has_aux: bool = False):
        """`grad_fn(params, batch, sync=True) -> (loss, grads)`: grads are the mean over
        ranks (sync=True) or this rank's own (sync=False, to accumulate and `reduce` later).

        `loss` is this rank's own loss (pmap: the mean over devices). For pmap,
        `batch` is the process's whole batch, split evenly over the devices.
        With `has_aux=True`, `loss_fn` returns `(loss, aux)` and grad_fn
        `((loss, aux), grads)`, as with `jax.value_and_grad` (aux: this rank's;
        pmap: the first device's). For a Flax nnx.Module, see `nnx_value_and_grad`."""
        return self._grad_fn_for("value_and_grad", loss_fn, has_aux, lambda: self._value_and_grad(loss_fn, has_aux))

    def _value_and_grad(self, loss_fn, has_aux: bool):
        checked = taps.checked_loss(loss_fn, has_aux)

        def pure(_static, params, state, batch):
            loss, aux = checked(params, batch)
            return loss, (aux, state)

        step = self._grad_step(pure, loss_fn)

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
        return self._grad_fn_for("nnx_value_and_grad", loss_fn, has_aux,
                                 lambda: flax_nnx.value_and_grad(self, loss_fn, has_aux))

    def _grad_fn_for(self, kind: str, loss_fn, has_aux: bool, make):
        """One grad_fn per loss_fn (and has_aux): asked for again with the same loss_fn -- at every step,
        as Flax's tutorials build nnx.value_and_grad inside their train_step, which under
        strategy='compiled' or 'pmap' runs eagerly -- it is the same grad_fn, with its traced programs
        (a new one traced and compiled again at every step: 300-400 ms a step against 7, an audit found).
        A new function object at every step (a lambda capturing that step's values) gets a new grad_fn,
        as jax.jit gets a new trace; said once it happens often. The grad_fns remembered here are the
        _GRAD_FNS_KEPT most recently asked for; a grad_fn's programs live as long as it does (_Token)."""
        # (a bound method is a new object at every attribute access: `ddp.value_and_grad(self.loss)` in a step)
        parts = (loss_fn.__self__, loss_fn.__func__) if isinstance(loss_fn, types.MethodType) else (loss_fn,)
        key = (kind, *map(id, parts), bool(has_aux))
        held = self._grad_fns.get(key)
        if held is not None and all(a is b for a, b in zip(held[0], parts)):
            self._grad_fns.move_to_end(key)
            return held[1]
        grad_fn = make()
        self._grad_fns[key] = (parts, grad_fn)
        while len(self._grad_fns) > _GRAD_FNS_KEPT:
            self._grad_fns.popitem(last=False)
        made = loss_fn
        while isinstance(made, functools.partial):  # (a partial made per step: the code of what it wraps)
            made = made.func
        code = getattr(made, "__code__", None) or getattr(getattr(type(made), "__call__", None), "__code__", None)
        if code is not None:
            self._grad_fn_codes[code] += 1
            if self._grad_fn_codes[code] == 2 * _GRAD_FNS_KEPT:  # (more than a script keeps alive on purpose)
                warnings.warn(
                    f"portddp: ddp.{kind}() got a new loss function made by the same code {2 * _GRAD_FNS_KEPT} times "
                    f"({closure.describe(loss_fn)}): each new function object gets a new grad_fn, traced and "
                    f"compiled again at its first call, as jax.jit does for a new function (the {_GRAD_FNS_KEPT} "
                    "most recent are kept with their programs). Build grad_fn once, outside the step, and pass what changes "
                    "as arguments (in the batch, or as state of an NNX model)", RuntimeWarning, stacklevel=3)
        return grad_fn

    def reduce(self, grads):
        """The mean over ranks of (accumulated) local gradients, bucket by bucket in plan order.
        Eager only: it runs one synchronised iteration on the host (inside jax.jit, make one
        synchronised grad_fn call whose loss_fn covers every micro-batch instead)."""
        if taps.traced(grads):
            if self.strategy == "hooked":
                raise ValueError(
                    f"ddp.reduce() cannot run inside {taps.transformation(grads)}: it reduces the arrays it is "
                    "given on the host, once, and a trace has only placeholders. Call it outside jit on the "
                    "gradients your jitted sync=False steps returned, or, inside jit, make one grad_fn call with "
                    "sync=True (the default) whose loss_fn covers every micro-batch (a Python loop or lax.scan "
                    "over them inside loss_fn, averaging their losses): its gradient is the accumulated one, "
                    "reduced once (a sync=True call on the last micro-batch alone would reduce only that one's)")
            raise ValueError(
                f"ddp.reduce() cannot run inside {taps.transformation(grads)}: strategy={self.strategy!r} "
                "reduces in its own program over every rank's device, which cannot be traced into yours. Call "
                "it outside jit on the gradients your jitted sync=False steps returned (it is compiled already)")
        if self._values_differ:  # the first synchronised step: the parameters the sync=False steps saw
            self._check_same_values(self._local_params, traced=False)
        self._local_params = None
        if not self._plan_agreed:  # (before a re-plan: whether any rank's steps were traced)
            self._agree_on_start(None, step=False)
        if self._rebuild_order is not None:
            self._rebuild()
        leaves = self._layout.leaves_of(grads)
        if self.strategy != "hooked":
            if _REDUCE not in self._steps:
                self._steps[_REDUCE] = compiled.make_reduce(self.strategy, self._plan, self._layout, self.world_size)
            watchdog.step_started()
            self._issue("compiled reduce")
            with watchdog.waiting(computes=True):
                out, counts = self._steps[_REDUCE](grads, self._step_slot())
                jax.block_until_ready(out)
            watchdog.step_finished()
            if counts is not None:
                check_same_step(counts, self.rank)
            return out
        # One synchronised iteration on the host: the same collectives as a hooked grad_fn step.
        self._step_counted = True  # (not a step: the accumulated ones were counted)
        try:
            self._begin_iteration()
            for b, bucket in enumerate(self._plan.buckets):
                self._mark_ready(b, [leaves[k] for k in bucket.params])
            self._finalize()
        finally:
            _OPEN.release(self)  # (also when it failed before _finalize, which releases it itself)
        return self._write_grads()

    def uneven(self, batches, divide_by_initial_world_size: bool = True, throw_on_early_termination: bool = False):
        """Train on uneven inputs -- portddp.jax's counterpart of torch DDP's `with ddp.join():`.

            for batch in ddp.uneven(my_batches):      # this rank's batches, then JOINED
                loss, grads = grad_fn(params, batch)  # loss is None for JOINED
                params = update(params, grads)

        Before each step every rank says whether it still has a batch (one int32[world]
        all-reduce). While some rank does, every rank runs the step; a rank that has run out
        gets `ddp.JOINED`, and its grad_fn shadows the others' synchronised step -- the same
        collectives with zero gradients and no forward (`_shadow_iteration`; compiled: the same
        XLA program, fed zeros) -- and returns (None, the mean gradients). Once no rank has a
        batch, the loop ends on every rank at the same step.

        The mean is the sum over the ranks that had a batch divided by the initial world size
        (torch's default), or with divide_by_initial_world_size=False by how many had one
        (hooked, without a comm hook). Every rank gets the same mean every step, so parameters
        and optimizer state stay identical. Buffers (an NNX model's BatchStat, broadcast_buffers)
        follow torch's join(): each step starts from those of the highest rank that has a batch,
        which a joined rank takes too (its other state stays), and at the end every rank takes
        the last joiner's into each model its grad_fn stepped eagerly in the loop (torch
        broadcasts the last joiner's whole model). The loop body must make the same DDP calls
        at the same step on every rank; give JOINED to grad_fn untouched (sync=False: zeros, so
        accumulating and `reduce` work as usual). throw_on_early_termination=True: every rank
        raises as soon as one runs out. Hooked grad_fn may be inside your own jax.jit (JOINED is
        a pytree without leaves: it gets its own trace); bucket_cap_mb="auto" is refused until
        the caps are chosen. Each agreement counts as one iteration for portddp.watchdog."""
        if self._tuner is not None and not self._tuner.done:
            raise RuntimeError(f"uneven() with bucket_cap_mb='auto' is refused while the caps are still being timed "
                               f"(the first {self._tuner.iterations} synchronised steps): pass a fixed bucket_cap_mb")
        if self._mixed:
            raise ValueError("ddp.uneven() in a job shared with PyTorch ranks is not supported: their join() issues "
                             "other collectives than uneven()'s agreement, and the ranks would pair them wrongly. "
                             "Give every rank the same number of batches (a DistributedSampler with drop_last=True)")
        if not divide_by_initial_world_size and (self.strategy != "hooked" or self._hook is not None):
            raise ValueError("uneven(divide_by_initial_world_size=False) needs strategy='hooked' without a comm hook "
                             "(it changes the divisor per step on the host): use the default (divide by the initial "
                             "world size) or strategy='hooked'")
        batches = iter(batches)
        alone = self.strategy == "pmap" or self.world_size == 1  # one process: nothing to agree on

        def steps():
            step, agreed = _Uneven(), 0
            try:
                while True:
                    batch = _END if step.out else next(batches, _END)
                    step.out = batch is _END
                    if alone:
                        if step.out:
                            return
                        yield batch
                        continue
                    # Who still has a batch, and how many NNX models each rank's grad_fn stepped
                    # eagerly in this loop (their buffers are synchronised at its end).
                    flags = np.zeros(2 * self.world_size, np.int32)
                    flags[self.rank] = not step.out
                    flags[self.world_size + self.rank] = len(step.alive_models())
                    watchdog.step_started()  # a collective every rank must reach, like an iteration
                    self._issue("uneven: who still has a batch")
                    with watchdog.waiting():
                        self._comm.allreduce(flags).wait()
                    watchdog.step_finished()
                    agreed += 1
                    self._left_uneven = None  # (every rank met here: any earlier loop left early is behind us)
                    flags, models = flags[:self.world_size], flags[self.world_size:].tolist()
                    step.count = int(flags.sum())
                    if step.count == 0:
                        self._sync_final_buffers(step, models)
                        return
                    step.src = int(np.flatnonzero(flags)[-1])
                    if step.count < self.world_size and throw_on_early_termination:
                        out = [r for r in range(self.world_size) if not flags[r]]
                        raise RuntimeError(f"uneven(throw_on_early_termination=True): rank(s) {out} ran out of "
                                           f"batches while {step.count} of {self.world_size} ranks still have one")
                    step.template = None
                    if step.count < self.world_size and self.strategy == "compiled":
                        # The joined ranks feed the program zeros shaped like a batch of a rank that has one.
                        step.template = next(t for t in self._comm.allgather_object(
                            None if step.out else _batch_spec(batch)) if t is not None)
                    self._inv_world = 1.0 / (self.world_size if divide_by_initial_world_size else step.count)
                    self._uneven = step
                    try:
                        yield JOINED if step.out else batch
                    except GeneratorExit:  # left early (a break): said in this rank's next collectives' names, which
                        self._left_uneven = agreed  # the stall inspector prints (the others may still be in the loop)
                        raise
                    self._uneven = None
            finally:
                self._uneven = None
                self._inv_world = 1.0 / self.world_size

        return steps()

    def broadcast(self, params):
        """Rank 0's values of `params` on every rank, after checking every rank passes the same
        structure, shapes and dtypes (the same exchange as portddp.torch's, portddp.protocol).

        Given a Flax nnx.Module, it updates the module in place -- rank 0's Params and buffers
        (BatchStat and other non-RNG state; RNG state stays per rank) -- and returns it."""
        if flax_nnx.is_module(params):
            return flax_nnx.broadcast(self, params)
        return self._broadcast_state(params)

    def psum_buckets(self, leaves: list, axis_name: str) -> list:
        """Inside a compiled step of your own: each bucket flattened, divided by the world size,
        summed with one psum over `axis_name`, and split back (the pytree's leaf list in and out)."""
        return compiled.psum_buckets(self._plan, self._layout, leaves, axis_name, self._inv_world)

    # ---- one iteration: begin (the traced step), trigger (a tap per bucket), pack, launch
    def _grad_step(self, fn, source=None):
        """`step(static, params, state, batch, sync) -> (loss, aux, new_state, grads)` for
        `fn(static, params, state, batch) -> (loss, (aux, new_state))`, the one form every
        front end (value_and_grad, nnx_value_and_grad) reduces to: JAX's counterpart of forward.
        `static` is hashable and fixed per trace (an NNX GraphDef); `state` is per rank and not
        differentiated, and `state[0]` holds the buffers broadcast_buffers replaces with rank 0's (in
        uneven(): the highest rank's with a batch; None: no state). `source`: the user's loss_fn,
        whose captured values (closure, globals) are watched: when one the trace read is
        replaced, the step is traced again (`closure.Captured`)."""
        def jit_local():
            return jax.jit(jax.value_and_grad(fn, argnums=1, has_aux=True), static_argnums=0)

        local = [jit_local()]
        token = _Token()  # (this step's programs are kept by it: _Token)
        me = weakref.proxy(self)  # (for host callbacks: see _make_tap; the step itself holds the DDP)
        captured = closure.Captured(source) if source is not None else None

        def local_step(static, params, state, batch):
            (loss, (aux, new_state)), grads = local[0](static, params, state, batch)
            return loss, aux, new_state, grads

        program = self._trace_iteration(fn) if self.strategy == "hooked" else None

        def trace_again(name: str) -> None:
            """A value loss_fn captured was replaced: forget every trace of this step (each plan's)."""
            local[0] = jit_local()
            for plan in self._plans.values():
                plan.steps.pop(token, None)
            n = captured.retraces
            if n in (1, 10, 100) or n % 1000 == 0:  # (said again as it goes on: each time is a compile)
                if self.strategy == "hooked":
                    fix = "in the batch (grad_fn(params, (batch, value))) or as state of an NNX model"
                else:  # (their batch is split over the ranks or devices)
                    fix = ("as state of an NNX model (an nnx.Variable), or in the batch with a copy for every row "
                           "(jnp.broadcast_to(value, (rows, *value.shape))): strategy=" + repr(self.strategy) +
                           " splits the batch over the " + ("ranks" if self.strategy == "compiled" else "devices"))
                warnings.warn(
                    f"portddp: loss_fn {closure.describe(source)} reads {name!r} from outside its arguments (its "
                    f"closure or a global), and it changed since portddp compiled the step ({n} time(s) so far). "
                    "portddp compiles loss_fn once, as jax.jit does, with the values it read then; it compiles it "
                    "again at every such change, so that it computes with the new values. To compile once, pass "
                    f"what changes as an argument: {fix}", RuntimeWarning, stacklevel=5)

        def xla_step(static, params, state, batch, scale):
            """compiled, pmap: one XLA program holds the iteration's collectives."""
            step = self._steps.get(token)
            if step is None:  # first call, or the plan changed ("auto"): compile with this plan
                step = self._steps[token] = compiled.make_step(self.strategy, self._plan, self._layout, fn,
                                                            self.world_size, self.broadcast_buffers)
            t0 = _now()
            watchdog.step_started()
            self._issue(f"{self.strategy} step")  # (the stall inspector's name for the program's collectives)
            with watchdog.waiting(computes=True), _xla_rendezvous_named(self.strategy, self._iterations):
                *out, counts = step.run(static, params, state, batch, scale, self._step_slot())
                jax.block_until_ready(out[-1])
            watchdog.step_finished()
            self._hlo, self._iteration_time = step.hlo, (_now() - t0) * 1e-9
            self._iterations += 1
            self._left_uneven = None
            if counts is not None:  # every rank holds the same counts: every rank raises alike
                check_same_step(counts, self.rank)
            return out

        def step(static, params, state, batch, sync: bool = True):
            sync = _as_sync(sync)
            if not isinstance(sync, bool):
                raise TypeError(
                    f"grad_fn's third argument is sync (True or False, a Python bool), not {sync}: give several "
                    "inputs as one batch pytree -- grad_fn(params, (x, y)) with loss_fn(params, batch) unpacking "
                    "x, y = batch -- and decide sync in Python, outside jit")
            self._check_parameters_unchanged(params)
            traced = taps.traced((params, state, batch))
            self._traced_seen |= bool(traced)
            if captured is not None and not traced and (name := captured.changed()) is not None:
                trace_again(name)  # (inside the caller's jit, its own trace holds what loss_fn read)
            if sync and self._values_differ:
                frozen = flax_nnx.frozen_of(state[1], self._nnx_wrt) if isinstance(state, tuple) else []
                self._check_same_values(params, taps.traced(params), frozen)
            self._step_count += not traced  # (traced: counted when the program runs, by _begin_iteration)
            if traced and not sync:  # an accumulation step inside the caller's jit: counted when it runs
                taps.host_call(taps.reporting(lambda: me._count_step(), self._callback_errors),
                               jax.ShapeDtypeStruct((), jnp.float32))
            joined = isinstance(batch, Joined)
            if joined and (self._uneven is None or self._uneven.count == self.world_size):
                raise ValueError(_JOINED_OUTSIDE)
            if traced and sync and self.strategy != "hooked" and \
                    taps.transformation((params, state, batch)) == taps.DERIVATIVE:
                raise ValueError(  # (an audit: it was refused with jit's words)
                    f"portddp.jax grad_fn (strategy={self.strategy!r}) cannot be differentiated (a gradient of its "
                    "gradients: MAML, a gradient penalty, jax.hessian): it runs its own program over every rank's "
                    "device, outside your derivative. Put the inner derivative inside loss_fn with plain jax.grad "
                    "(MAML's inner step, the penalty's gradient), so that grad_fn differentiates and averages only "
                    "the outer loss")
            if traced and sync and self.strategy != "hooked":
                raise ValueError(
                    f"strategy={self.strategy!r} runs its own program over every rank's device, which cannot be "
                    f"traced into your {taps.transformation((params, state, batch))} over this process's arrays: call "
                    "grad_fn outside any transformation (it is compiled already; jit the optimizer update on its "
                    "own), or use strategy='hooked', which can be traced into jit and scan")
            if traced and sync and taps.transformation((params, state, batch)) == "jax.vmap":
                raise ValueError(taps.UNDER_VMAP)  # (vmap of a jit: taps.host_call refuses it when batched)
            if traced and sync and self.strategy == "hooked" and (axes := taps.mapped_over_devices()):
                raise ValueError(taps.UNDER_MAP.format(axes=axes))
            if sync and not self._buffers_agreed:
                self._agree_on_start(state, step=True)
            elif sync and self._buffers_travel:
                self._check_buffer_layout(state)
            if traced and self.strategy == "hooked":
                # Inside the caller's trace: the program is traced once, with today's plan, so the
                # plan must not change under it -- no rebuild after this. (A rebuild pending from an
                # eager step before -- as on every rank, _agree_on_start -- is made now, before the
                # program is traced, as a rank calling eagerly makes it at this call.)
                if self._tuner is not None:
                    raise ValueError("bucket_cap_mb='auto' re-plans between grad_fn calls, which cannot happen "
                                     "inside your own jax.jit: pass a number of MB, or call grad_fn outside jit")
                if self._rebuild_order is not None:
                    self._rebuild()
                self._rebuilt, self._rebuild_order = True, None
            elif not traced:
                if sync and self._tuner is not None and not self._tuner.done:
                    self._autotune(_now())
                if self._rebuild_order is not None:
                    self._rebuild()
            if joined and (self.strategy == "hooked" or not sync):
                self._step_counted = not traced
                return self._shadow_iteration(params, state, sync)
            if not sync:
                if self._values_differ and not traced:  # compared at the reduce() that follows
                    self._local_params = params
                return flax_nnx.named_errors(local_step, static, params, state, batch)
            if self.strategy != "hooked":
                # Inside ddp.uneven(): every rank runs the program that zeroes the gradients of the
                # joined ranks (scale 0), which feed zeros shaped like a batch, and takes the buffers
                # of the highest rank with a batch (a joined rank keeps them: its new state).
                uneven = self._uneven is not None
                if joined:
                    out = xla_step(static, params, state, self._uneven.zeros_batch(), 0.0)
                    return None, None, out[2], out[-1]
                return flax_nnx.named_errors(xla_step, static, params, state, batch, 1.0 if uneven else None)
            if traced:
                return flax_nnx.named_errors(functools.partial(program, tie=True), static, params, state, batch)
            lends = self._hook is None and self._comm.defers_gather  # (the shared-memory path: see _lend)
            runs = self._steps.setdefault(token, {})
            run = runs.get(lends)
            if run is None:  # first call, or the plan was rebuilt: trace again with the new taps
                # A new function object each time: jax.jit caches traces per function.
                run = runs[lends] = jax.jit(lambda *args: program(*args, lend=lends), static_argnums=0)
            self._callback_errors.clear()
            self._step_counted = True
            try:
                loss, aux, new_state, grads = flax_nnx.named_errors(run, static, params, state, batch)
                grads = jax.block_until_ready(grads)
                return loss, aux, new_state, self._lend() if lends else grads
            except Exception as e:
                if not self._callback_errors:
                    if "Side-effect HLO must have sharding" in str(e):
                        raise _split_over_devices(params, batch) or e from None
                    raise
                raise self._callback_errors[0] from None  # portddp's own message, not XLA's wrapper

        def ended_on_error(static, params, state, batch, *sync):
            try:
                out = step(static, params, state, batch, *sync)
            except BaseException as e:  # (a call that failed ended whatever iteration it opened: eager, or
                _OPEN.release(self)  # run op by op under the caller's jax.grad before it was refused)
                watchdog.note_raised(e)
                raise
            if captured is not None and not captured.learnt and not isinstance(batch, Joined) and not taps.traced(
                    (params, state, batch)):  # the step just traced loss_fn: what did it read?
                # (the constants' look is one more trace of the forward: only where a JAX array is read)
                captured.learn(_constants_of(fn, static, params, state, batch) if captured.reads_arrays() else None)
            return out

        return ended_on_error

    def _trace_iteration(self, fn):
        """The hooked synchronised step as one traceable program, in the order a gradient travels:
        a host callback opens the iteration (`_begin_iteration`, after rank 0's buffers arrive,
        `_sync_buffers`); each bucket's parameters pass a tap (`_make_tap`) whose backward hands
        the bucket's gradients to the host (`_mark_ready`: pack, launch) as soon as XLA has them;
        a last callback waits for every reduction and writes the reduced gradients into the
        program's result buffers (`_finalize(outs)`, `_fill`). It can therefore be wrapped in the
        caller's own jax.jit (with the optimizer update, say); called eagerly, it is jitted here,
        and with `lend` its last callback only finalizes: the step lends the buckets (`_lend`)."""
        errors = self._callback_errors
        me = weakref.proxy(self)  # (the host callbacks: see _make_tap)

        def forward_done(*_):
            me._events.forward_end_ns = _now()
            return np.float32(0)

        # Identity on the loss whose backward records the end of forward. The loss itself is
        # handed to the callback, so that it cannot be scheduled before the forward is done.
        loss_tap = taps.host_tap(taps.reporting(forward_done, errors), keep_primal=True)

        def finish(outs, _launched):
            # The reduced gradients go straight into XLA's result buffers (`outs`); the last one
            # is the scalar the next iteration traced into the same program starts from.
            outs[-1][...] = 0
            me._finalize(outs[:-1])

        def finish_lent(_launched):  # eager, lent: the sums stay in the buckets (_lend)
            me._finalize()
            return np.float32(0)

        def program(static, params, state, batch, lend: bool = False, tie: bool = False):
            dead: list[int] = []  # buckets whose taps never fire: read at run time, filled at trace time
            start = taps.start_token(taps.reporting(
                lambda: me._begin_iteration(dead, fills=not lend, lend=lend), errors))
            bcast = self._will_sync_buffers(state)

            def tapped(params, start_value, state):
                if bcast:  # rank 0's buffers, Bcast before the iteration starts (the token waits for it)
                    # ... and after the previous step traced into this program (start_value): its
                    # collectives and this Bcast go out in one order on every rank.
                    leaves, tree = jax.tree.flatten(state[0])
                    *leaves, after = taps.host_call(
                        taps.reporting(lambda *xs: [*me._sync_buffers(xs[:-1]), np.float32(0)], errors),
                        [*(jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves),
                         jax.ShapeDtypeStruct((), jnp.float32)], *leaves, jax.lax.stop_gradient(start_value))
                    state = (jax.tree.unflatten(tree, leaves), *state[1:])
                    start_value = start_value + after
                token = start(start_value)
                inputs = batch
                if tie:  # (inside the caller's jit: the step is counted when it opens)
                    state, inputs = taps.after(token, (state, batch))
                # Read at trace time: the plan's taps. A rebuilt plan needs a new trace (grad_fn).
                leaves = list(jax.tree_util.tree_leaves(params))
                for b, bucket in enumerate(self._plan.buckets):
                    ks = [self._layout.leaf_of[k] for k in bucket.params]
                    for i, leaf in zip(ks, self._taps[b]([leaves[i] for i in ks], token)):
                        leaves[i] = leaf
                loss, aux = fn(static, jax.tree_util.tree_unflatten(self._layout.treedef, leaves), state, inputs)
                return loss_tap(loss, token), aux

            self._tracing_fired = fired = set()
            try:
                (loss, (aux, new_state)), (_, launched) = jax.value_and_grad(tapped, argnums=(0, 1), has_aux=True)(
                    params, self._after_previous_iteration(), state)
            finally:
                self._tracing_fired = None
            dead.extend(b for b in range(len(self._plan.buckets)) if b not in fired)
            # `launched` depends on every live tap's callback: this one runs after the last launch.
            if lend:  # (grads: the scalar to wait for; the step hands the buckets back itself)
                _TRACED.done = None
                return loss, aux, new_state, taps.host_call(
                    taps.reporting(finish_lent, errors), jax.ShapeDtypeStruct((), jnp.float32), launched)
            *reduced, _TRACED.done = taps.host_call(
                taps.reporting(finish, errors), [*_reduced_shapes(self._plan), jax.ShapeDtypeStruct((), jnp.float32)],
                launched, fills=True)
            return loss, aux, new_state, self._layout.to_tree(self._plan, reduced)

        return program

    def _after_previous_iteration(self):
        """The value a traced iteration starts from: 0, or -- when the previous synchronised step
        was traced into the same program (two grad_fn calls in one jax.jit: steps unrolled, SAM's
        two gradients; a GAN's two DistributedDataParallels, which share one transport) -- the
        scalar that step's last callback returns. Host callbacks run in data order only, so without
        it the second step's could open its iteration while the first one's gradients are still
        being reduced, mixing the two. (Steps in different traces -- one inside jax.lax.scan or an
        inner jax.jit, one outside -- cannot be chained: _begin_iteration refuses the overlap.)"""
        done, _TRACED.done = _TRACED.done, None
        if done is not None and taps.in_current_trace(done):
            return done
        return jnp.float32(0)

    def _check_parameters_unchanged(self, params) -> None:
        """The plan is sized for the pytree DDP was built for: another structure, shape or dtype is
        refused naming the leaf (the pytree comes with every call, unlike a module's parameters)."""
        self._layout.check(params)

    def _will_sync_buffers(self, state) -> bool:
        """Whether a hooked step with this `state` broadcasts rank 0's buffers before the iteration."""
        return (state is not None and self.broadcast_buffers and self.world_size > 1
                and bool(jax.tree.leaves(state[0])))

    def _agree_on_start(self, state, step: bool) -> None:
        """Once, at the first synchronised grad_fn call (eager, or while the caller's jit traces
        it) -- or at a ddp.reduce() before any -- ahead of the call's collectives: one allgather
        that every rank takes part in, whether or not it holds buffers (a rank without any would
        skip the buffer broadcast its peers issue, and the next collectives would pair wrongly).

        * The buffers rank 0 broadcasts (broadcast_buffers) must have the same paths, shapes and
          dtypes everywhere: XLA's broadcast of mismatched ones aborts the process, and MPI's
          pairs a rank's Bcast with another's all-reduce. (From a grad_fn call, `step`; reduce()
          has no state: they are compared at the first synchronised call after it.)
        * hooked: whether any of the rank's calls so far was traced. A rank inside the caller's
          jit never re-plans (its program is traced once); a rank calling eagerly would re-plan
          at its next call, alone, and its buckets would then sum other parameters than its
          peers' at equal sizes. If any rank was traced, none re-plans.

        Not in a job shared with PyTorch ranks, whose side has no such exchange: there the Bcast
        names a mismatch when it fails (_sync_buffers)."""
        self._plan_agreed = True
        self._buffers_agreed |= step
        if self.world_size == 1 or self.strategy == "pmap" or self._mixed:
            return
        specs = None  # (reduce(): not known)
        if step:
            buffers = state[0] if state is not None and self.broadcast_buffers else None
            specs = [(jax.tree_util.keystr(path), tuple(jnp.shape(x)), str(jnp.result_type(x)))
                     for path, x in jax.tree_util.tree_flatten_with_path(buffers)[0]]
        self._issue("buffer and plan check")
        with watchdog.waiting():
            everyone = self._comm.allgather_object((specs, self._traced_seen))
        if all(e[0] is not None for e in everyone):
            check_same_specs([e[0] for e in everyone], "model buffers (non-Param state, e.g. BatchStat) differ "
                             "across ranks", "buffer", "buffers")
            # (agreed, so the same on every rank: whether the compiled strategy compares them at every step)
            self._buffers_travel = self.strategy == "compiled" and bool(everyone[0][0])
        if any(e[1] for e in everyone):
            self._rebuilt, self._rebuild_order = True, None

    def _check_buffer_layout(self, state) -> None:
        """strategy='compiled', after the first step: the buffers rank 0's replace travel inside the
        program, in an all_gather sized by each rank's own shapes. Shapes that drifted apart since the
        first step (a buffer sized by each rank's last batch) aborted the process in XLA's Gloo, or, at
        equal byte counts, took rank 0's bytes in another shape, silently (an audit). Compared at every
        synchronised step of a model with buffers -- a digest per rank, one small all-reduce (tens of
        microseconds on shared memory) --, and named on every rank as at the first step."""
        buffers = state[0] if state is not None else None
        mine = buffer_layout([(tuple(jnp.shape(x)), str(jnp.result_type(x))) for x in jax.tree.leaves(buffers)])
        digests = np.zeros(self.world_size, np.int64)  # (each rank's in its own slot: the sum is all of them)
        digests[self.rank] = mine
        self._issue("buffer layout check")
        with watchdog.waiting():
            self._comm.allreduce(digests).wait()
        if len(set(digests.tolist())) > 1:  # (every rank sees it: every rank names the difference)
            self._agree_on_start(state, step=True)

    def _sync_buffers(self, leaves, synchronises: bool = True, src: int | None = None) -> list[np.ndarray]:
        """Rank `src`'s values of these buffers (numpy copies, any dtypes), in one Bcast with a
        header saying which step they were sent for, checked by the receivers (portddp.protocol).
        By default rank 0's; inside ddp.uneven() those of the highest rank with a batch this step,
        as torch's join() (rank 0 may have joined: its statistics no longer move)."""
        if src is None:
            src = self._uneven.src if self._uneven is not None else 0
        arrays = [np.array(x) for x in leaves]
        # (the buffers' layout too, as portddp.torch's header: a receiver whose buffers differ names it)
        mine = buffer_sync_header(self._iterations, synchronises, self._buffer_syncs,
                                  buffer_layout([(a.shape, a.dtype.name) for a in arrays]))
        self._buffer_syncs += 1
        if self.world_size > 1:
            header = np.array(mine, np.int64)
            self._issue("buffer broadcast")
            with watchdog.waiting():
                try:
                    self._comm.broadcast_([*arrays, header], src=src)
                except Exception as e:  # (a size mismatch is MPI's truncation error on a receiver)
                    shapes = ", ".join(f"{a.shape} {a.dtype}" for a in arrays)
                    first = str(e).splitlines()[0] if str(e) else repr(e)
                    raise RuntimeError(
                        f"broadcast of rank {src}'s buffers (non-Param state, e.g. BatchStat) failed on rank {self.rank} "
                        f"({type(e).__name__}: {first}); this rank's buffers are {len(arrays)} array(s): {shapes} -- "
                        f"not as many bytes as rank {src}'s. Every rank must hold the same buffers (shapes, dtypes, "
                        "order) at every step: a buffer the step writes with a shape of its own on some ranks (sized "
                        "by each rank's batch, whose last one may be smaller) differs -- make it the same on every "
                        "rank, keep per-rank state out of the model's buffers, or pass broadcast_buffers=False; a "
                        "model built differently on some ranks: build the same one, and call ddp.broadcast(model) "
                        "once after building DistributedDataParallel") from e
            if self.rank != src:
                check_buffer_sync_header(header.tolist(), mine, src, self.rank)
        return arrays

    def _sync_final_buffers(self, step: _Uneven, counts: list[int]) -> None:
        """The end of ddp.uneven(), as the end of torch's join(): every rank takes the last joiner's
        buffers (`step.src`: the highest rank with a batch in the last step) into each Flax NNX
        model its grad_fn stepped eagerly in the loop (`counts`: how many, per rank). Params need
        nothing: every rank applied the same mean gradients. A model stepped only inside the
        caller's jit is not held here (its step sees a copy): broadcast it yourself if needed."""
        if not self.broadcast_buffers:
            return
        if len(set(counts)) > 1:  # (every rank knows the counts: every rank skips alike)
            warnings.warn(
                f"portddp: ddp.uneven() ended with grad_fn having stepped {counts} Flax NNX model(s) eagerly on "
                f"ranks {list(range(self.world_size))} (the others inside jit, whose models the loop cannot reach), "
                f"so no rank takes the last joiner's (rank {step.src}'s) buffers: each keeps what its last step "
                "left. Call ddp.broadcast(model) after the loop for rank 0's everywhere", RuntimeWarning, stacklevel=3)
            return
        for model in step.alive_models():
            flax_nnx.take_buffers(self, model, step.src)

    def _count_step(self) -> np.float32:
        """(Host callback.) A grad_fn(sync=False) traced into the caller's program ran: the step
        counts compared at the next reduction include it, as an eager call's do."""
        self._step_count += 1
        return np.float32(0)

    def _begin_iteration(self, dead=(), fills: bool = False, lend: bool = False) -> np.float32:
        """Open an iteration. The `dead` buckets (no tap fires: the loss uses none of their
        leaves) are zeros and ready at once; they launch in plan order like the others.
        `fills`: the iteration ends with `_finalize(outs)`, which copies the reduced buckets into
        `outs` -- then, without a comm hook, each bucket's all-reduce defers its gather to that
        copy (portddp.transport: the other ranks' slices come straight from shared memory).
        `lend`: the reduced buckets are handed to the caller as they lie (`_lend`). Every
        iteration packs into a set of buffers no array lent earlier still uses.
        The watchdog learns that a synchronised iteration is under way (a peer that already left
        before reaching it stops this rank, naming it, instead of leaving it waiting)."""
        _OPEN.claim(self)
        self._buffers = self._free_buffers()  # (what an earlier eager step lent may be in use still)
        if self._stale_used is not None:  # a failed iteration's used counts (see _finalize)
            stale, self._stale_used = self._stale_used, None
            with watchdog.waiting(), contextlib.suppress(Exception):
                stale.wait()
        watchdog.step_started()
        if self._step_counted:  # an eager grad_fn call counted it (or reduce(), which is no step)
            self._step_counted = False
        else:
            self._step_count += 1
        if not self._hooks_agreed:
            self._agree_on_hook()
        n = len(self._buffers)
        # (where the transport cannot defer, the used counts had better travel behind the buckets)
        self._defer_gather = fills and self._hook is None and self._comm.defers_gather
        self._ready = [False] * n
        self._next_launch = 0  # buckets launch strictly in plan order
        self._handles: list = [None] * n
        self._ready_order: list[int] = []
        self._nonfinite = np.zeros(len(self._layout.names), np.int32)
        self._events = IterationEvents(
            rank=self.rank, forward_start_ns=_now(),
            buckets=[BucketEvents(b, buf.nbytes) for b, buf in enumerate(self._buffers)])
        for b in dead:
            self._mark_ready(b, None)
        return np.float32(0)

    def _make_tap(self, b: int):
        """Identity on bucket b's parameters whose backward hands their gradients to `_mark_ready`.
        When traced it records that it fires: JAX skips the rule of a tap whose outputs the loss
        never uses, and such a bucket, not recorded, is launched as zeros (`dead`).

        Host callbacks hold the DDP weakly (here and in every traced program): JAX keeps its
        compiled programs, and their callbacks, in caches that outlive the DDP, and a callback
        holding it would keep it -- and its buckets, shared memory -- alive after the caller
        dropped it (a sweep building one DDP after another filled the shared window)."""
        me = weakref.proxy(self)

        def traced() -> None:
            if me._tracing_fired is not None:
                me._tracing_fired.add(b)

        return taps.host_tap(taps.reporting(lambda token, *grads: me._mark_ready(b, grads), self._callback_errors),
                         on_trace=traced)

    def _mark_ready(self, b: int, grads) -> np.float32:
        """Bucket b's gradients have arrived (host side of its tap; None: zeros -- a dead bucket, or
        a joined rank's): pack them, mark the bucket ready, launch what the plan order allows."""
        now = _now()
        bucket = self._plan.buckets[b]
        if grads is not None and self.check_finite:
            for k, g in zip(bucket.params, grads):
                self._nonfinite[k] = not np.isfinite(g).all()
        self._pack(b, grads, divide=self._hook is None)
        with self._lock:
            if grads is not None:
                self._ready_order.extend(bucket.params)
                self._events.backward_end_ns = max(self._events.backward_end_ns, now)
            self._events.buckets[b].ready_ns = now
            self._ready[b] = True
            if self.overlap:
                self._launch_ready_buckets()
        return np.float32(0)

    def _pack(self, b: int, grads, divide: bool) -> None:
        """Copy bucket b's arrays (pytree layout, bucket order; None: zeros) into its flat buffer in
        the canonical layout, divided by the world size unless a hook will divide."""
        buf, bucket = self._buffers[b], self._plan.buckets[b]
        if grads is None:
            buf.fill(0)
            return
        for k, off, g in zip(bucket.params, bucket.offsets, grads):
            src = self._layout.canonical(k, g)
            dst = buf[off:off + src.size].reshape(src.shape)
            # Divide while copying: one pass over the gradient instead of two.
            copy_scaled(dst, src, self._inv_world if divide else None)

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._buffers) and self._ready[self._next_launch]:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        self._events.buckets[b].launch_ns = _now()
        self._handles[b] = self._reduce_bucket(b, self._buffers[b])

    def _reduce_bucket(self, b: int, buffer: np.ndarray) -> Handle:
        self._issue(f"bucket {b}")
        if self._hook is None:
            return self._comm.allreduce(buffer, defer_gather=self._defer_gather)
        try:
            handle = self._hook(self._hook_state, self._grad_bucket(b, buffer))
        except Exception as e:
            raise RuntimeError(f"comm hook {_hook_name(self._hook)} raised {type(e).__name__} for bucket {b} "
                               f"on rank {self.rank}: {e}") from e
        if not isinstance(handle, Handle):
            raise TypeError(
                f"comm hook {_hook_name(self._hook)} returned {type(handle).__name__} for bucket {b}; a hook must "
                "return a portddp.transport.Handle that is done once bucket.buffer() holds the reduced bucket "
                "(e.g. bucket.allreduce(buffer), or Handle.completed(buffer))")
        return handle

    def _check_hook_result(self, b: int, handle: Handle) -> None:
        """Wait for a hook's handle; its result must be the reduced bucket: its buffer (reduced in
        place) or an array of its size, copied in (as native's future value is)."""
        name, expected = _hook_name(self._hook), self._buffers[b]
        try:
            result = handle.wait()
        except Exception as e:
            raise RuntimeError(f"comm hook {name}'s handle for bucket {b} raised {type(e).__name__} on rank "
                               f"{self.rank}: {e}") from e
        if result is expected:
            return
        if not isinstance(result, np.ndarray) or result.size != expected.size or not (
                jnp.issubdtype(result.dtype, jnp.floating)):
            got = (f"a {result.shape} {result.dtype} array" if isinstance(result, np.ndarray)
                   else type(result).__name__)
            raise hook_result_error(name, b, got, expected.size, str(expected.dtype), "handle")
        if not np.shares_memory(result, expected):
            expected[...] = result.reshape(-1)

    # ---- finalize
    def _finalize(self, outs: list[np.ndarray] | None = None) -> None:
        """After the computation: launch the rest, wait in plan order, copying each reduced bucket
        into `outs` as it arrives (one array per parameter, plan order; None: the caller reads
        self._buffers), agree on the used counts."""
        try:
            self._reduce_and_check(outs)
        finally:
            _OPEN.release(self)

    def _reduce_and_check(self, outs: list[np.ndarray] | None) -> None:
        """(_finalize, while this iteration holds _OPEN.)"""
        for b in [b for b, ready in enumerate(self._ready) if not ready]:
            self._mark_ready(b, None)  # only a safety net: taps that cannot fire were found at trace time
        with self._lock:
            self._launch_ready_buckets()
        # After the buckets, as portddp.torch does: how many ranks produced each gradient. A JAX
        # rank always has all of them; a PyTorch rank in the same job may not (portddp.protocol).
        # With check_finite a second half counts, per parameter, the ranks with NaN/Inf in it.
        n = len(self._layout.names)
        flags = np.concatenate([np.ones(n, np.int32), self._nonfinite if self.check_finite else np.zeros(0, np.int32)])
        # A deferred gather reads the other ranks' buckets: the used counts, whose all-reduce lets
        # every rank go on to reuse its buckets, wait for it; otherwise they travel behind the buckets.
        used = None if self._defer_gather else self._exchange_used(flags)
        issued = used is not None
        try:
            with watchdog.waiting():
                start = 0
                for b, handle in enumerate(self._handles):
                    if self._hook is not None:
                        self._check_hook_result(b, handle)
                    else:
                        handle.wait()
                    self._events.buckets[b].done_ns = handle.done_ns
                    if outs is not None:  # now, while the later buckets are still being reduced
                        count = len(self._plan.buckets[b].params)
                        self._fill(b, outs[start:start + count])
                        start += count
                if used is None:
                    issued = True
                    used = self._exchange_used(flags)
                totals = used.wait()
        except BaseException:
            if not issued:  # failed before the used counts (some buckets may be gathered already, later ones
                # still in flight): forget the pending gathers, and still issue what peers wait for
                for buf in self._buffers:
                    self._comm.discard(buf)
                # (waited for before this rank writes a bucket again: peers may still be gathering from it)
                with contextlib.suppress(Exception):  # (the first error is the one to report)
                    self._stale_used = self._exchange_used(flags)
            raise
        watchdog.step_finished()  # every collective of the iteration is done (errors below are every rank's)
        self._events.finalize_end_ns = _now()
        self._last_events = self._events
        self._iterations += 1
        self._left_uneven = None  # (every rank met in this iteration: a loop left early is behind us)
        if not self._rebuilt and self._rebuild_order is None:
            self._rebuild_order = self._ready_order
        check_same_step(totals[-self.world_size:].tolist(), self.rank)
        if totals[:n].min() < self.world_size:
            self._raise_unused(totals[:n].tolist())
        if totals[n:-self.world_size].any():
            self._raise_nonfinite()

    def _exchange_used(self, flags: np.ndarray) -> Handle:
        """How many ranks produced each gradient (and found it non-finite), and each rank's step
        slot in its own place (protocol.step_slot): one small all-reduce that lets every rank fail
        together."""
        used = np.zeros(len(flags) + self.world_size, np.int32)
        used[:len(flags)] = flags
        used[len(flags) + self.rank] = self._step_slot()
        if self.world_size == 1:
            return Handle.completed(used)
        self._issue("used-count")
        return self._comm.allreduce(used)

    def _raise_unused(self, counts: list[int]) -> None:
        raise unused_parameters_error(self._layout.names, counts, self.world_size, self.rank, [1] * len(counts))

    def _raise_nonfinite(self) -> None:
        mine = [self._layout.names[k] for k in np.flatnonzero(self._nonfinite)]
        self._issue("non-finite gradients' names")
        with watchdog.waiting():
            everyone = self._comm.allgather_object(mine)
        raise nonfinite_error(everyone, self.rank, "grad_fn returned no gradients for this step")

    def _fill(self, b: int, outs: list[np.ndarray]) -> None:
        """Reduced bucket b into `outs` (one array per parameter of it, in plan order: XLA's result
        buffers), through the comm's gather (straight from shared memory after a deferred one)."""
        dests = []
        for off, out in zip(self._plan.buckets[b].offsets, outs, strict=True):
            if not out.flags.c_contiguous:  # (reshape would copy, and the copy be filled instead)
                raise RuntimeError(f"XLA handed a result buffer that is not row-major ({out.shape}, strides "
                                   f"{out.strides}): portddp.jax cannot write the reduced gradients into it")
            dests.append((off, out.reshape(-1)))
        self._comm.gather(self._buffers[b], sorted(dests, key=lambda d: d[0]))

    def _free_buffers(self) -> list:
        """A set of bucket buffers that no array `_lend` handed out still uses: one whose memory
        nothing but the set holds (JAX keeps the memory's owner alive while an array over it
        lives: also a numpy view the caller took of it, or a copy JAX made for a jit that donated
        it frees it). Few sets in a loop: the last step's gradients are still held while the next
        step runs, so two alternate. The buffers in use while nothing was ever lent."""
        if not self._lent:
            return self._buffers
        sets = self._buffer_sets  # (this plan's)
        free = [bufs for bufs in sets if all(_owner_refs(buf) <= _FREE_REFS for buf in bufs)]
        if free:  # (at most two spare sets kept: the memory of a burst of held steps goes back)
            sets[:] = [bufs for bufs in sets if not any(bufs is extra for extra in free[3:])]
            return free[0]
        bufs = self._new_buffers(self._plan)
        sets.append(bufs)
        return bufs

    def _new_buffers(self, plan: BucketPlan) -> list:
        """One zeroed flat buffer per bucket (one host, MPI: inside the transport's shared-memory
        window, reduced where they lie), each a view of the object owning its memory (_owner_refs)."""
        bufs = [self._comm.zeros(b.numel, jnp.dtype(b.dtype)) for b in plan.buckets]
        return [buf if buf.base is not None else buf[...] for buf in bufs]

    def _lend(self):
        """The reduced buckets as the caller's gradients, without a copy: each parameter's slice of
        its bucket becomes a JAX array over that memory (jax.device_put of an aligned, contiguous
        numpy array on CPU aliases it; anything else is copied). The next iterations pack into
        other buffers until every such array is gone (_free_buffers) -- the memory traffic of
        copying every reduced gradient into XLA's result buffers, saved."""
        self._lent = True
        return self._layout.to_tree(self._plan, jax.device_put(self._bucket_views()))  # (one batched call)

    def _bucket_views(self) -> list[np.ndarray]:
        """Each parameter's slice of its bucket, shaped (plan order, canonical layout)."""
        specs = self._plan.specs
        return [buf[off:off + specs[k].numel].reshape(specs[k].shape) for buf, bucket in
                zip(self._buffers, self._plan.buckets) for k, off in zip(bucket.params, bucket.offsets)]

    def _write_grads(self):
        """The reduced buckets back into the pytree: a new one of jax arrays in its own layout."""
        # Copy: the buffers are reused by the next iteration (_lend is the step's way without one).
        return self._layout.to_tree(self._plan, [jnp.array(v, copy=True) for v in self._bucket_views()])

    # ---- join/uneven
    def _shadow_iteration(self, params, state, sync: bool):
        """ddp.uneven(): this rank has no batch; issue the collectives of the others' synchronised
        step (the order of _trace_iteration: rank 0's buffers if their program broadcasts them,
        every bucket -- zeros -- and the used counts) and return their mean, without a forward.
        Eagerly, or inside the caller's jit as one host callback."""
        if not sync:
            return None, None, state, _zeros_like(params)
        buffers, tree = jax.tree.flatten(state[0]) if self._will_sync_buffers(state) else ([], None)

        me = weakref.proxy(self)  # (a host callback: see _make_tap)

        def shadow(outs, received, *buffers):
            # The buffers the highest training rank sends: this rank takes them, as torch's joined rank.
            for out, value in zip(received, me._sync_buffers(buffers) if buffers else []):
                out[...] = value
            me._begin_iteration(fills=True)
            for b in range(len(me._buffers)):
                me._mark_ready(b, None)
            me._finalize(outs)

        shapes = _reduced_shapes(self._plan)
        kept = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in buffers]
        if taps.traced(params):
            # Chained like a step (_after_previous_iteration): two shadows in one program -- two
            # grad_fn calls in one jit -- run in the order the other ranks' steps do, one at a time.
            def traced_shadow(outs, _previous, *buffers):
                outs[len(shapes)][...] = 0
                shadow(outs[:len(shapes)], outs[len(shapes) + 1:], *buffers)

            outs = taps.host_call(
                taps.reporting(traced_shadow, self._callback_errors),
                [*shapes, jax.ShapeDtypeStruct((), jnp.float32), *kept], self._after_previous_iteration(), *buffers,
                fills=True)
            reduced, _TRACED.done, received = outs[:len(shapes)], outs[len(shapes)], outs[len(shapes) + 1:]
        else:
            reduced = [np.empty(s.shape, s.dtype) for s in shapes]
            received = [np.empty(k.shape, k.dtype) for k in kept]
            shadow(reduced, received, *buffers)
            reduced, received = [jnp.asarray(r) for r in reduced], [jnp.asarray(r) for r in received]
        if tree is not None:
            state = (jax.tree.unflatten(tree, received), *state[1:])
        return None, None, state, self._layout.to_tree(self._plan, reduced)

    # ---- rebuild/autotune
    def _broadcast_from_first(self, order: np.ndarray) -> None:
        """Rank 0's values of `order`, in place (_rebuild)."""
        self._comm.broadcast_([order], src=0)

    def _autotune(self, now: int) -> None:
        """bucket_cap_mb="auto": the cap this call uses; re-plan when it changes (which re-traces)."""
        cap = self._tuned_cap(now)
        if cap != self.bucket_cap_mb:
            self.bucket_cap_mb = cap
            order = self._observed_order
            # Hooked: the observed order (or the pending rebuild uses the new cap); others: the initial order.
            if self._rebuild_order is None:
                self._install_plan(rebuild_plan(self._plan, order, cap, self.first_bucket_cap_mb) if order is not None
                                   else plan_buckets(self._plan.specs, cap, self.first_bucket_cap_mb))

    # ---- stats
    def stats(self) -> dict:
        """The metrics (portddp.timeline) of the last synchronised iteration, plus its events."""
        extra = {"iterations": self._iterations, "bucket_cap_mb": self.bucket_cap_mb}
        if self._tuner is not None:
            extra["autotune"] = self._tuner.summary()
        if self.strategy != "hooked":
            return {"iteration_time": self._iteration_time, "hlo": self._hlo} | extra
        if self._last_events is None:
            return {}
        return self._last_events.stats() | extra | {"plan_rebuilt": self._rebuilt}


def _as_sync(sync) -> bool | str:
    """grad_fn's `sync` as a bool (a Python or numpy bool, 0/1, a concrete 0-d array), else what it
    is, in words for the error (a batch's second input passed positionally, a traced value)."""
    if isinstance(sync, bool | np.bool_):
        return bool(sync)
    if isinstance(sync, jax.core.Tracer):
        return f"a traced {sync.dtype} value (sync must be known in Python when grad_fn is called)"
    # (only an array's shape: an nnx.Rngs answers any attribute with a stream -- the MNIST tutorial's
    # grad_fn(model, batch, rngs) failed here with "'RngStream' object is not iterable", an audit found)
    shape = sync.shape if isinstance(sync, jax.Array | np.ndarray | np.generic) else None
    if shape == () and np.dtype(sync.dtype).kind in "bi" or type(sync) is int:
        return bool(sync)
    return f"{type(sync).__name__}" + (f" shaped {tuple(shape)}" if shape is not None else "")


_FREE_REFS = 2  # references to a free bucket's memory owner: the bucket array's base, getrefcount's argument


def _owner_refs(buf: np.ndarray) -> int:
    """References to the object owning `buf`'s memory (the arena block of portddp.shm.empty)."""
    return sys.getrefcount(buf.base)


def _reduced_shapes(plan: BucketPlan) -> list:
    """What the host hands back into a traced program: one array per parameter, in plan order."""
    return [jax.ShapeDtypeStruct(plan.specs[k].shape, jnp.dtype(plan.specs[k].dtype))
            for bucket in plan.buckets for k in bucket.params]


class _Traced:
    """The end of the last synchronised hooked step traced in this process, by any DDP: the next
    one traced into the same program starts from it (_after_previous_iteration)."""

    done = None


_TRACED = _Traced()


class _OpenIteration:
    """The hooked iteration under way in this process, if any. Every DDP of the process reduces on
    one transport, whose collectives pair across ranks in the order they are issued: two
    iterations under way at once -- of one DDP or of two -- issue theirs in an order XLA's
    scheduling decides, which need not be another rank's, and sums would mix one iteration's
    buckets with the other's (silently, at equal sizes). Refused instead, on the rank that sees it.
    (portddp.torch has no counterpart: autograd runs its hooks in an order every rank shares, and
    two DDPs reduced in other orders on different ranks are named by the step slots' DDP number.)"""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: tuple | None = None  # (weak reference to the DDP, its iteration number)

    def claim(self, ddp) -> None:
        with self._lock:
            if self._owner is not None and self._owner[0]() is not None:  # (a collected DDP's is over)
                other, it = self._owner
                who = "this DistributedDataParallel" if other() is ddp else "another DistributedDataParallel"
                raise RuntimeError(
                    f"a synchronised grad_fn step of portddp.jax (strategy='hooked') began on rank {ddp.rank} while "
                    f"{who}'s step (iteration {it}) was still reducing its gradients. Either that step failed "
                    "midway on this rank (an error raised inside it -- in loss_fn or a callback of yours -- and "
                    "caught: this rank is now a step behind the others, whose collectives it would pair with the "
                    "wrong buckets; let the error end the job, or build the DistributedDataParallel anew on every "
                    "rank), or two synchronised steps were traced into one program that cannot order them -- one "
                    "inside jax.lax.scan or an inner jax.jit and one outside it, an inner jit called twice, or "
                    "grad_fn under jax.pmap/shard_map: call every synchronised grad_fn of a program in the same "
                    "trace (no inner jit around it; all inside the scan or all outside), or take the earlier "
                    "gradients with sync=False and reduce them with ddp.reduce()")
            self._owner = (weakref.ref(ddp), ddp._iterations + 1)

    def release(self, ddp) -> None:
        with self._lock:
            if self._owner is not None and self._owner[0]() in (ddp, None):
                self._owner = None


_OPEN = _OpenIteration()


class _CallbackErrors(list):
    """What a DDP's host callbacks raised (grad_fn raises the first, in portddp's words). A callback
    that raised ended its iteration: the next may begin."""

    def __init__(self, ddp):
        super().__init__()
        self._ddp = weakref.ref(ddp)

    def append(self, error) -> None:
        super().append(error)
        _OPEN.release(self._ddp())


_JOINED_OUTSIDE = ("grad_fn got JOINED as the batch outside a step of ddp.uneven() in which some rank has joined: "
                   "pass only what `for batch in ddp.uneven(batches)` yields")
_END = object()


def _fingerprint(leaves) -> str | None:
    """A digest of the parameters' values -- every value: a CRC-32 of each leaf's bytes (~0.25 ms per
    MB, no copy; a sample of values missed ranks that differ in a few elements, a review found),
    the leaves' CRCs and sizes hashed together; None if some leaf is not a concrete array in host
    memory (a trace, abstract shapes, an accelerator's memory: not compared)."""
    digest = hashlib.blake2b(digest_size=16)
    for leaf in leaves:
        if taps.traced(leaf) or not hasattr(leaf, "__array__"):
            return None
        if isinstance(leaf, jax.Array) and any(d.platform != "cpu" for d in leaf.devices()):
            return None
        flat = np.ascontiguousarray(np.asarray(leaf)).reshape(-1)
        digest.update(zlib.crc32(flat.view(np.uint8).data).to_bytes(4, "little") + flat.nbytes.to_bytes(8, "little"))
    return digest.hexdigest()


def _constants_of(fn, static, params, state, batch) -> list | None:
    """The constants of `fn`'s trace -- the arrays it read from outside its arguments -- or None
    where it cannot be traced on its own here (then every array it names is watched)."""
    try:
        # (a new function each time: make_jaxpr would hand back its cached trace of `fn`, old constants)
        return jax.make_jaxpr(lambda *args: fn(*args), static_argnums=0)(static, params, state, batch).consts
    except Exception:  # noqa: BLE001 -- (e.g. a collective over an axis only the compiled program has)
        return None


def _zeros_like(tree):
    return jax.tree.map(jnp.zeros_like, tree)


class _Uneven:
    """One step of ddp.uneven(), as every rank agreed on it."""

    def __init__(self):
        self.out = False  # this rank has run out of batches
        self.count = 0  # how many ranks have a batch this step
        self.src = 0  # the highest rank with a batch this step: whose buffers every rank starts from
        self.template = None  # strategy="compiled", some rank joined: (treedef, [(shape, dtype)]) of a batch
        self.models: list[weakref.ref] = []  # the NNX models grad_fn stepped eagerly in this loop

    def remember(self, model) -> None:
        if all(ref() is not model for ref in self.models):
            self.models.append(weakref.ref(model))

    def alive_models(self) -> list:
        return [m for m in (ref() for ref in self.models) if m is not None]

    def zeros_batch(self):
        treedef, specs = self.template
        return jax.tree_util.tree_unflatten(treedef, [np.zeros(shape, dtype) for shape, dtype in specs])


def _batch_spec(batch):
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return treedef, [(tuple(np.shape(x)), np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)) for x in leaves]


def _split_over_devices(params, batch) -> ValueError | None:
    """The hooked step's error for an array laid over several of this process's devices (XLA's own:
    "Side-effect HLO must have sharding", of its host callbacks), naming the leaf; None if none is."""
    for what, tree in (("parameter", params), ("batch leaf", batch)):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
                return ValueError(
                    f"{what} {jax.tree_util.keystr(path) or '(the batch)'} is split over {len(x.sharding.device_set)} "
                    "devices of this process: strategy='hooked' runs one rank per device, its host callbacks on "
                    "one. Put it on one device (jax.device_put(x, jax.local_devices()[0])), or use "
                    "strategy='compiled', which takes arrays laid over the processes' devices")
    return None
