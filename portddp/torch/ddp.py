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
   whatever is left, wait for every bucket in plan order -- writing each one's
   mean back to `.grad` as it arrives, for the parameters this rank has a
   gradient of (the others, and all of them with check_finite, once the counts
   are in) --, and agree with the other ranks on which parameters got gradients.

The per-iteration state is a handful of plain lists on `self` (pending counts,
ready flags, the next bucket to launch, futures), reset at each forward.

The constructor takes native DDP's arguments in native's order (a script that
swaps only its import keeps working) and portddp's own knobs keyword-only; the
wrapper is an `nn.Module` like native's (`state_dict()` keys carry `module.`,
`.to()`/`.double()` re-plan the buckets) and a `Joinable`, so native's
`Join` context manager -- and `ddp.join()` -- train on uneven inputs. That
interface lives in portddp/torch/native.py, mixed in.

Mirrors portddp/jax/ddp.py: the same sections in the same order, the same
method names for the same roles. What PyTorch has that JAX has not:

* Per-parameter autograd hooks (`_make_hook`): a gradient is ready when
  autograd has accumulated it into `.grad`; a bucket is ready when its last
  parameter's is (JAX: one tap per bucket, which arrives whole).
* A forward to hook into (`forward` -> `_pre_forward`/`_post_forward`): the
  iteration opens there, and `no_sync()` is a flag it reads (JAX: grad_fn's
  `sync=`); the end of backward is a callback queued on autograd's engine.
* Gradients live in `.grad` (written back, or the bucket itself with
  gradient_as_bucket_view), parameters may go unused (find_unused_parameters,
  static_graph), and the module may change after wrapping (`.to()`, new
  parameters): checked at every forward.
* Uneven inputs through native's `Join` (a joined rank shadows the others'
  forward and backward); JAX has `ddp.uneven()`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from portddp import launch, watchdog
from portddp.buckets import BucketPlan, ParamSpec, plan_as_registered, plan_buckets, rebuild_plan
from portddp.common import DDPCommon, GradBucketCommon, hook_name as _hook_name, next_ddp_number
from portddp.config import DDPConfig
from portddp.lazy import after_import
from portddp.protocol import (BROADCAST_CHECK, REPLAN_CHECK, SHADOW, agreed_strides, buffer_layout, buffer_sync_header,
                              check_buffer_sync_header, check_same_buffers, check_same_config, check_same_frozen,
                              check_same_specs, check_same_step, hook_result_error, nonfinite_error,
                              unused_parameters_error)
from portddp.timeline import BucketEvents, IterationEvents
from portddp.torch.comm import TRANSPORTS, check_transport, make_comm
from portddp.torch.native import NativeInterface, _done, backward_recorder, registrations

__all__ = ["DistributedDataParallel", "GradBucket"]

_now = time.perf_counter_ns
_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}  # (a complex tensor's real view)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layout_of(buffers) -> int:
    return buffer_layout([(b.shape, _dtype_name(b.dtype)) for b in buffers])


class GradBucket(GradBucketCommon):
    """What a comm hook sees: one bucket's flat buffer and how to reduce it.

    The interface of `torch.distributed.GradBucket` (index, buffer, gradients,
    parameters, is_last, set_buffer), so PyTorch's own hooks (PowerSGD,
    fp16_compress_wrapper, ...) run unchanged, plus `allreduce()` on this DDP's
    transport for portddp's hooks."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list, offsets: list[int], num_buckets: int, comm):
        super().__init__(index, buffer, num_buckets, comm)
        self._params = params
        self._offsets = offsets

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor `buffer()` returns (e.g. by a compressed copy), as native's does."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of the bucket buffer per parameter, shaped like it -- of the buffer now, as
        native's: after set_buffer(a float16 copy), float16 views of the copy
        (fp16_compress_wrapper(powerSGD_hook) relies on it). A sparse gradient's bucket: none, as
        native's (a fused optimizer stepping bucket.gradients() leaves sparse tables alone there)."""
        if self._buffer.is_sparse:
            return []
        return [self._buffer[off:off + p.numel()].view(p.shape) for p, off in zip(self._params, self._offsets)]

    def parameters(self) -> list:
        return list(self._params)


_OWNERS: "weakref.WeakValueDictionary[int, DistributedDataParallel]" = weakref.WeakValueDictionary()
"""id(parameter) -> the live wrapper whose gradient hooks it carries."""


def _in_dist_autograd() -> bool:
    """Whether this thread is inside a torch.distributed.autograd context (RPC started; cheap otherwise)."""
    rpc = sys.modules.get("torch.distributed.rpc")
    if rpc is None or not rpc.is_available() or not rpc.api._is_current_rpc_agent_set():
        return False
    try:
        torch.distributed.autograd._current_context()
    except RuntimeError:  # "... doesn't have a valid autograd context"
        return False
    return True


class DistributedDataParallel(DDPCommon, NativeInterface, nn.Module, Joinable):
    """Data parallelism by gradient averaging with communication overlapped with backward.

    Takes native `torch.nn.parallel.DistributedDataParallel`'s arguments, in its
    positional order; README "Switching from torch DDP" lists what each does here.

    Args (native's):
        module: the model; every rank must build the same one.
        device_ids, output_device: None for a CPU module (native's rule); for a
            single-device GPU module `[i]` (inputs are moved there).
        dim: kept for compatibility (single-device modules never scatter).
        broadcast_buffers: False neither syncs buffers at construction nor before
            forwards (native's meaning; see forward_sync_buffers).
        init_sync: False skips the broadcast of rank 0's parameters and buffers at
            construction (the ranks must then start equal by themselves).
        process_group: a c10d group other than the default one (transport="c10d").
        bucket_cap_mb: bucket size cap in MiB (None: 25 with a 1 MiB first bucket;
            given: every bucket, the first included, unless first_bucket_cap_mb is),
            math.inf for one bucket, or "auto": time a few caps during the first
            iterations and keep the fastest (portddp.autotune; stats()["autotune"]).
        find_unused_parameters: parameters that get no gradient on a rank are
            reduced as zeros there; without it such a parameter is an error.
        check_reduction: deprecated and ignored, as in native.
        gradient_as_bucket_view: `.grad` becomes a view into the bucket buffer
            (no second copy of the gradients, no copy back after the reduction).
        static_graph: the graph is the same every iteration: parameters that get no
            gradient are allowed (left untouched), and reentrant backward passes
            (activation checkpointing with use_reentrant=True) are supported.
        delay_all_reduce_named_params, param_to_hook_all_reduce: these (name,
            param) pairs leave the buckets and are all-reduced (averaged) together
            at the end of backward. Both or neither, as native requires.
        mixed_precision: refused (use a comm hook or torch.autocast).
        device_mesh: a 1-D DeviceMesh whose group replaces process_group.
        skip_all_reduce_unused_params: accepted; portddp still reduces zeros for
            unused parameters, which gives the same numbers.
        bucket_cap_mb_list: refused (use bucket_cap_mb and first_bucket_cap_mb).
        batched_grad_copy: accepted (a copying strategy of native's C++ reducer).
        forward_sync_buffers: sync buffers before forwards (default: broadcast_buffers,
            i.e. True); unlike broadcast_buffers=False, False still syncs them once
            at construction.

    Args (portddp's, keyword-only):
        first_bucket_cap_mb: cap of the first bucket (the last layers' gradients),
            small so that communication starts early.
        transport: "c10d" (the process group, Gloo/NCCL) or "mpi" (mpi4py on a
            comm thread; needs mpirun). Not given: $PORTDDP_TRANSPORT, else "c10d" --
            so a script that only swapped the import can run on either.
        overlap: False launches every bucket only after backward has finished:
            the no-overlap baseline of the overlap study.
        check_finite: check every local gradient for NaN/Inf as it arrives; if any
            rank finds one, every rank raises naming the parameters and ranks, and
            .grad is left untouched (costs one pass over the gradients).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params=None,
        param_to_hook_all_reduce=None,
        mixed_precision=None,
        device_mesh=None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list=None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | None = None,
        transport: str | None = None,
        overlap: bool = True,
        check_finite: bool = False,
    ):
        super().__init__()
        Joinable.__init__(self)
        if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            # (Native trains a DDP nested in a DDP, reducing every gradient twice; here the inner one's forward
            # refused, as a wrapper whose parameters a newer one took over, with advice that did not apply.)
            raise ValueError(
                f"DistributedDataParallel(module) got a {type(module).__module__}.{type(module).__name__}, a DDP "
                "wrapper itself: wrap its module instead -- DistributedDataParallel(ddp.module, ...) -- one DDP per "
                "model (a DDP inside another would reduce every gradient twice)")
        if transport is None:  # (a script that only swapped the import picks the MPI transport by the environment)
            transport = os.environ.get("PORTDDP_TRANSPORT") or "c10d"
            if transport not in TRANSPORTS:
                raise ValueError(f"PORTDDP_TRANSPORT={transport!r} is not a transport: set it to one of "
                                 f"{', '.join(TRANSPORTS)}, or unset it (c10d)")
        # Validate everything local before talking to other ranks: every rank
        # sees the same arguments, so every rank raises the same error.
        config = DDPConfig.resolve(bucket_cap_mb, first_bucket_cap_mb, transport=transport, transports=TRANSPORTS,
                                   overlap=overlap, check_finite=check_finite)
        check_transport(transport)  # (process_group: once native's arguments have resolved it, in make_comm)
        process_group = self._native_arguments(
            module, device_ids, output_device, process_group, device_mesh, mixed_precision, bucket_cap_mb_list,
            delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction, broadcast_buffers,
            forward_sync_buffers)
        self.config = config
        self._iterations = 0  # synchronised iterations finished
        self._step_count = 0  # steps so far (no_sync ones included): see _step_slot
        self._forwards: list[list] = []  # since the last count: per forward with autograd on, its backward pass
        self._tuner = config.tuner()
        self.module = module
        self.dim = dim
        self.bucket_cap_mb = config.bucket_cap_mb
        self.first_bucket_cap_mb = config.first_bucket_cap_mb
        if forward_sync_buffers is None:
            forward_sync_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
            init_sync_buffers = forward_sync_buffers
        else:
            init_sync_buffers = True
        self.forward_sync_buffers = forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = bool(static_graph)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = None
        self.overlap = config.overlap
        self.transport = config.transport
        self.check_finite = config.check_finite
        self.require_backward_grad_sync = True  # no_sync() flips this
        self.require_forward_param_sync = True  # native's: buffers sync before a forward that follows a synced one
        self.broadcast_bucket_size = 250 * 1024 * 1024

        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        self._module_buffers = [b for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
        self._buffer_layout = _layout_of(self._module_buffers)  # (in every buffer broadcast's header)
        self._frozen = [p for _, p in self._frozen_named()]  # watched: unfrozen later, they would train alone
        self._registrations = registrations()  # parameters, buffers, modules (re)assigned so far
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._expect_sparse = _sparse_gradient_expected(module, self._params)
        self.device = self._params[0].device
        self.device_type = self.device.type
        specs = self._specs()

        if process_group is not None and dist.is_initialized() and \
                process_group is dist.distributed_c10d._get_default_group():
            process_group = None  # dist.group.WORLD passed explicitly: the world-wide DDP it is
        if process_group is None:  # (a custom group's members are the caller's business)
            launch.ensure_watchdog()  # (unless portddp.init() started it, or was told not to)
            # What changes the collectives each rank issues (a difference would hang, or mix them up).
            mine = config.exchanged() | {"torch": {
                "broadcast_buffers/forward_sync_buffers": bool(forward_sync_buffers), "init_sync": bool(init_sync),
                "find_unused_parameters": bool(find_unused_parameters), "static_graph": self.static_graph}}
            check_same_config(launch.allgather_object(mine, name="DDP construction: config check"))
        self._comm = make_comm(transport, process_group)
        if process_group is not None:
            watchdog.subgroups_in_use()  # a rank leaving may be done with its group only
        # What native exposes (scripts pass it to their own collectives); with transport="mpi", the
        # default c10d group if there is one.
        self.process_group = process_group if process_group is not None else (
            dist.distributed_c10d._get_default_group() if dist.is_initialized() else None)
        self.world_size = self._comm.size
        self.rank = self._comm.rank
        self._set_divisor(self.world_size)
        self._divide_by_initial_world_size = True
        self._warn_if_alone(process_group)
        # Buffers are compared too wherever they travel (before forwards, or at construction): a
        # rank with one buffer more, or of another dtype, would pair its broadcasts wrongly -- Gloo
        # then reinterprets the bytes (silently), MPI fails raw.
        self._check_buffers = bool(forward_sync_buffers or (init_sync and init_sync_buffers))
        # Each bucket slot's layout, fixed here for the DDP's life: memory order where every rank
        # holds the parameter alike in another dense order than C's (as native's reducer), else C order.
        self._slot_strides = agreed_strides(self._verify_same_model(specs), len(self._params))
        self._hook = None
        self._next_hook = None  # (hook, state) registered during an iteration: installed at the next one
        self._hook_state = None
        self._install_plan(self._initial_plan(specs))
        # Ranks start identical: rank 0's parameters and buffers everywhere.
        if self.world_size > 1 and init_sync:
            self._broadcast_state(src=0, buffers=init_sync_buffers)
        self._rebuilt = False
        self._rebuild_order: list[int] | None = None
        self._observed_order: list[int] | None = None  # rank 0's, once the plan was rebuilt
        self._sync = False
        self._expect_grads = False
        self._finalize_queued = False
        self._static_hooks: list[int] | None = None  # static_graph: gradient hooks per param, learnt once
        self._ddp_backward_task = None  # the autograd pass the last synchronised forward's output started
        self._record_backward = backward_recorder(self)  # (the pre-hook that records it)
        self._sync_flag = None  # join(): how many ranks sync this iteration (a pending collective)
        self._last_events: IterationEvents | None = None
        self._warned_create_graph = False
        self._buffer_syncs = 0  # buffer broadcasts so far (their header carries it)
        self._hooks_agreed = False  # the first synchronised iteration compares comm hooks across ranks
        # find_unused_parameters, as native's local used map: the parameters that got a gradient in a
        # no_sync() backward since the last synchronised one count as used by this rank in the next,
        # which reduces whatever .grad they hold; and what the last reduction found used anywhere, which
        # a joined rank contributes to the others' (native's _match_unused_params_allreduce).
        self._used_unsynced = bytearray(len(self._params))
        self._used_last = bytes(len(self._params))
        self._superseded = False  # a newer DistributedDataParallel took over these parameters
        self._take_over_parameters()
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                              for i, p in enumerate(self._params)]
        self._hook_ids = [handle.id for handle in self._hook_handles]
        # (in its step slots: which of the process's DDPs on this group reduces)
        self._ddp_number = next_ddp_number(None if process_group is None else _members(process_group))

    def __setattr__(self, name: str, value) -> None:
        # The per-iteration bookkeeping (flags, counters, bucket events) is set a few dozen times a
        # step; nn.Module's __setattr__ first checks every value against parameters, buffers and
        # submodules (~2 us each). Private plain values go straight to the instance.
        if name[0] == "_" and not isinstance(value, (torch.Tensor, nn.Module)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def _take_over_parameters(self) -> None:
        """Wrapping parameters another live DistributedDataParallel wraps (the module wrapped
        again, the old wrapper not yet freed): the newer one owns them. The older one's hooks are
        removed -- else a backward through the new wrapper would fire them too -- and using it
        raises. (A wrapper that was freed left nothing behind: its hooks hold it weakly.) The
        owners are kept in a module-level weak map, not on the parameters, which must stay
        picklable (torch.save(module))."""
        older: dict[int, tuple] = {}  # id(owner) -> (owner, the ids of its parameters)
        for p in self._params:
            owner = _OWNERS.get(id(p))
            if owner is not None and owner is not self:
                ids = older[id(owner)][1] if id(owner) in older else {id(q) for q in owner._params}
                if id(p) in ids:  # (else an id reused by another tensor: not the owner's)
                    older[id(owner)] = owner, ids
            _OWNERS[id(p)] = self
        for owner, _ in older.values():
            for handle in owner._hook_handles:
                handle.remove()
            owner._superseded = True

    # ---- construction
    def _specs(self) -> list[ParamSpec]:
        return [ParamSpec(n, tuple(p.shape), _dtype_name(p.dtype), p.device.type, sparse)
                for n, p, sparse in zip(self._names, self._params, self._expect_sparse)]

    def _verify_same_model(self, specs: list[ParamSpec], frozen: bool = False, what: str = "model check") -> list:
        """Compare every rank's parameter list (and, with `frozen`, its frozen parameters') with
        rank 0's; name the first difference. Returns what every rank sent (its fifth item: the
        parameters' memory-order strides, for agreed_strides). `what` names the collective (a JAX
        rank of a mixed job issues its counterpart under the same name)."""
        self._issue(what)
        mine = _named_specs(self._frozen_named()) if frozen else None
        buffers = _named_specs((n, b) for n, b in self.module.named_buffers()
                               if n not in self.parameters_to_ignore) if self._check_buffers else None
        with watchdog.waiting():
            # (with no values' fingerprint: this DDP broadcasts rank 0's values at construction)
            everyone = self._comm.allgather_object([[(s.name, s.shape, s.dtype) + (("sparse",) if s.sparse else ())
                                                     for s in specs], None, mine, buffers,
                                                    [_dense_strides(p) for p in self._params]])
        check_same_specs([e[0] for e in everyone], "model mismatch across ranks", "parameter", "trainable parameters",
                         frozen=[e[2] if len(e) > 2 else None for e in everyone])  # (a JAX rank sends two items)
        check_same_frozen(everyone)
        check_same_buffers(everyone)
        return everyone

    def _frozen_named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.module.named_parameters()
                if not p.requires_grad and n not in self.parameters_to_ignore]

    def _broadcast_state(self, src: int = 0, buffers: bool = True) -> None:
        """Rank `src`'s parameters (bucket by bucket, after agreeing again), frozen ones included
        (as native's _sync_module_states: they are never reduced, but must start equal), and
        buffers everywhere.

        The same exchange as portddp.jax's broadcast() (see portddp.protocol)."""
        self._verify_same_model(list(self._plan.specs), frozen=True, what=BROADCAST_CHECK)
        self._issue(f"broadcast of rank {src}'s parameters")
        with torch.no_grad(), watchdog.waiting():
            for bucket in self._plan.buckets:
                self._comm.broadcast_([self._params[i] for i in bucket.params], src=src)
            if self._delayed:
                self._comm.broadcast_([p for _, p in self._delayed], src=src)
            if frozen := [p for _, p in self._frozen_named()]:
                self._comm.broadcast_(frozen, src=src)
            if buffers and self._module_buffers:
                self._comm.broadcast_(self._module_buffers, src=src)

    # ---- plan
    def _install_plan(self, plan: BucketPlan) -> None:
        """Allocate one flat buffer per bucket and a view of it per parameter."""
        self._plan = plan
        # (transport="mpi" on one host: inside the shared-memory window, reduced where they lie; a sparse
        # gradient's bucket has none: the gradient itself is reduced, as native's reducer does)
        self._bucket_buffers = [self._comm.zeros(0 if b.sparse else b.numel, getattr(torch, b.dtype), self.device)
                                for b in plan.buckets]
        self._sparse_buckets = {b for b, bucket in enumerate(plan.buckets) if bucket.sparse}
        self._sparse_grads: dict[int, torch.Tensor] = {}  # this iteration's, per sparse bucket, until reduced
        self._sparse_results: dict[int, torch.Tensor] = {}  # ... then reduced
        # On c10d between two ranks the last bucket also carries the iteration's used counts (see
        # _finalize): its buffer is the head of one with a tail for them, all-reduced together when
        # no comm hook is registered -- one Gloo collective fewer per step, whose round trip native
        # DDP does not pay either. (Counts and step slots are small integers: exact in float32.)
        # Not at n >= 3: a longer buffer moves the boundaries of the chunks Gloo's ring adds in
        # different rank orders, and the gradients would no longer be native's to the bit.
        self._tail = None
        if self.transport == "c10d" and self.world_size == 2 and plan.buckets and (
                plan.buckets[-1].dtype in ("float32", "float64")) and not plan.buckets[-1].sparse:
            last = plan.buckets[-1]
            self._last_full = self._comm.zeros(last.numel + 2 * len(self._params) + self.world_size,
                                               getattr(torch, last.dtype), self.device)
            self._bucket_buffers[-1] = self._last_full[:last.numel]
            self._tail = self._last_full[last.numel:]
        self._bucket_of = [0] * len(self._params)
        self._views: list[torch.Tensor] = [None] * len(self._params)  # type: ignore[list-item]
        for b, bucket in enumerate(plan.buckets):
            for i, off in zip(bucket.params, bucket.offsets):
                p = self._params[i]
                self._bucket_of[i] = b
                if bucket.sparse:  # (no slot: a stand-in of p's shape, dtype and device over one element)
                    self._views[i] = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
                    continue
                # In p's memory order where every rank agreed (channels_last, say: as native's reducer,
                # so a comm hook reading bucket.gradients() -- C-order views of the slot, as native's --
                # sees native's arrangement, and with gradient_as_bucket_view .grad has p's strides),
                # else C order: the same element in the same slot on every rank, JAX ranks included.
                slot, strides = self._bucket_buffers[b][off:off + p.numel()], self._slot_strides[i]
                self._views[i] = slot.view(p.shape) if strides is None else slot.as_strided(p.shape, strides)
                if self.gradient_as_bucket_view and p.grad is not None:
                    if p.grad.shape != p.shape:  # (p resized through .data: its old gradient means nothing now)
                        p.grad = None
                        continue
                    self._views[i].copy_(p.grad)
                    p.grad = self._views[i]
        self._bucket_sizes = [len(b.params) for b in plan.buckets]

    def _grad_bucket(self, b: int, buffer: torch.Tensor) -> GradBucket:
        bucket = self._plan.buckets[b]
        return GradBucket(b, buffer, [self._params[i] for i in bucket.params], list(bucket.offsets),
                          len(self._plan.buckets), self._comm)

    @property
    def bucket_plan(self) -> BucketPlan:
        """The BucketPlan in use (after the rebuild, the rebuilt one)."""
        return self._plan

    # ---- public API
    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future` (see portddp.torch.hooks).

        Call once, usually before the first backward; as with native DDP, a hook registered
        after some iterations (compression switched on after a warm-up) reduces from the next
        synchronised iteration on -- every rank must register it at the same step (the hooks are
        compared across ranks before that iteration's first bucket). Gradients then reach the
        bucket undivided; the hook divides (portddp.torch.hooks does, before summing).
        PyTorch's own hooks (torch.distributed.algorithms.ddp_comm_hooks) work too."""
        if self._hook is not None or self._next_hook is not None:
            raise RuntimeError("a comm hook is already registered; register_comm_hook can be called only once")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket) -> Future; got {hook!r}")
        if self._iterations and self._join_config.enable:
            raise RuntimeError("register_comm_hook inside `with ddp.join():` after training started is refused: a "
                               "rank that has already joined cannot register it at the same step, and the ranks' "
                               "reductions would no longer pair. Register it before the join() loop")
        if self._expect_grads:  # between a forward and its backward: this iteration's packs divide already
            self._next_hook = (hook, state)
        else:
            self._hook, self._hook_state = hook, state
        self._hooks_agreed = False  # compared across ranks before the next bucket

    def _agree_on_next_hook(self) -> None:
        """Before an iteration's first bucket: a hook registered after the previous one's forward takes
        over now, and the hooks are compared across ranks (once after each registration)."""
        if self._next_hook is not None:
            (self._hook, self._hook_state), self._next_hook = self._next_hook, None
        self._agree_on_hook()

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

    def forward(self, *inputs, **kwargs):
        if self.__dict__.get("_detached"):  # a copy (see __getstate__)
            return self._detached_forward(inputs, kwargs)
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        return self._post_forward(self.module(*inputs, **kwargs))

    # ---- one iteration: begin (the forward), trigger (a hook per parameter), pack, launch

    @watchdog.noting_errors  # (a rank whose script caught it and went on: named by the stall inspector)
    def _pre_forward(self, *inputs, **kwargs):
        """Everything before the module runs (kept out of torch.compile's graph: it talks to other ranks)."""
        start = _now()
        if self._superseded:
            raise RuntimeError(
                "this DistributedDataParallel's parameters were wrapped again by a newer DistributedDataParallel, "
                "which now owns them (their gradient hooks are the newer one's): use the newer wrapper, or call "
                "this one's module directly (ddp.module(...)) for a forward without DDP")
        self._check_parameters_unchanged()
        if torch.is_grad_enabled():
            self._keep_hooks_last()
        if torch.is_grad_enabled() and _in_dist_autograd():
            raise NotImplementedError(
                "this forward runs inside a torch.distributed.autograd context (RPC training, "
                "dist_autograd.backward): its gradients go to that context, never to .grad, so portddp's hooks "
                "would never see them and every rank would step on its own local gradient. portddp.torch "
                "reduces .grad only: use torch.nn.parallel.DistributedDataParallel for distributed autograd")
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if grad_sync:
            self._check_prior_reduction_finished()
        # Inside `with ddp.join()` only: "I still have inputs" (c10d). Before the rebuild, as native's: a
        # joined rank's Join loop meets this first, then shadows the rebuild (_shadow_iteration).
        Join.notify_join_context(self)
        if grad_sync and self._tuner is not None and not self._tuner.done:
            self._autotune(start)
        # The re-plan at the first forward with autograd on after the first synchronised iteration -- a
        # no_sync() one too, as native's (a joined rank shadows it there: join() with accumulation hung)
        if self._rebuild_order is not None and torch.is_grad_enabled():
            self._rebuild()
        if self._will_sync_buffers():
            self._sync_buffers(grad_sync)
        if self._join_config.enable:
            self._sync_flag = self._exchange_sync_flag(grad_sync)
        # Like native DDP, whether the coming backward synchronises is decided
        # by the forward: a forward inside no_sync() gives a local backward.
        if torch.is_grad_enabled():
            self._sync = grad_sync
            if grad_sync:
                self._begin_iteration(start)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
            inputs, kwargs = torch.utils._pytree.tree_map(move, (inputs, kwargs))
        return inputs, kwargs

    def _post_forward(self, output):
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        # Native's rule: buffers are synced before a forward only if the one before it synchronised.
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            self._events.forward_end_ns = _now()
        if torch.is_grad_enabled():
            # Native's _DDPSink, where native passes the outputs through it -- find_unused_parameters
            # (no_sync forwards too), static_graph's first iteration: outputs with a grad_fn are cloned
            # there, which a script that changes one in place, or returns one tensor twice, can tell.
            if self.find_unused_parameters and not self.static_graph or self.static_graph and self._static_hooks is None:
                output = self._through_sink(output)
            self._mark_backward_source(output, grad_sync)
        return output

    def _step_slot(self) -> int:
        """The step count compared across ranks at every reduction (protocol.check_same_step). A step
        is a backward pass and the forwards with autograd on whose outputs it reached (several
        forwards into one loss -- micro-batches concatenated, a rank-conditional extra term -- are one
        step, as native takes them), or a forward that no backward reached (a backward skipped on one
        rank, an evaluation forward with autograd on): each its own step."""
        if self._forwards:
            passes = {t[0] for t in self._forwards}
            self._step_count += len(passes - {None}) + sum(t[0] is None for t in self._forwards)
            self._forwards.clear()
        return super()._step_slot()

    def _check_parameters_unchanged(self) -> None:
        """A model whose trainable parameters changed after wrapping would train them un-averaged.
        Walking the module costs per parameter; it is done only when some module in the process
        (re)registered a parameter, buffer or submodule since the last look."""
        if getattr(self, "_verify_pending", False):  # .to()/.double() since the last forward: same on every rank?
            self._verify_same_model(list(self._plan.specs), what=REPLAN_CHECK)
            self._verify_pending = False
        # A parameter frozen after wrapping (requires_grad_(False)) stays in the plan, as native's
        # reducer keeps it: forwards without a backward (a DINO teacher frozen after wrapping, run
        # under no_grad) are fine; in a backward it gets no gradient -- reduced as unused with
        # find_unused_parameters, else the unused-parameter error on every rank, as native's.
        for p, v in zip(self._params, self._views):
            if p.dtype != v.dtype or p.device != v.device or p.shape != v.shape:
                break
        else:
            if self._registrations == registrations() and not any(p.requires_grad for p in self._frozen):
                return
        self._registrations = registrations()
        self._list_buffers_again()
        planned = {id(p) for p in self._params}
        now = [p for n, p in self.module.named_parameters()
               if (p.requires_grad or id(p) in planned) and n not in self.parameters_to_ignore]
        # (The same Parameter objects under other names or in another order are the same model: the
        # plan holds the objects, as native's reducer does -- torch.nn.utils.prune moves `weight` to
        # `weight_orig`, registered last.)
        if len(now) == len(self._params) and (all(a is b for a, b in zip(now, self._params))
                                              or {id(p) for p in now} == {id(p) for p in self._params}):
            if any(p.dtype != v.dtype or p.device != v.device or p.shape != v.shape
                   for p, v in zip(self._params, self._views)):
                # A dtype/device change that bypassed Module._apply, or a new shape (p.data = ...: an
                # embedding grown for new tokens): its gradient no longer fits its place in the bucket.
                self._replan()
                self._check_parameters_unchanged()
            return
        named = dict(self.module.named_parameters())
        names = [n for n, p in named.items()
                 if (p.requires_grad or id(p) in planned) and n not in self.parameters_to_ignore]
        added = [n for n in names if n not in self._names]
        gone = [n for n in self._names if n not in names]
        wrapped = dict(zip(self._names, self._params))
        replaced = [n for n in names if n in wrapped and named[n] is not wrapped[n]]
        raise RuntimeError(
            f"the module's trainable parameters changed after DistributedDataParallel wrapped it: "
            f"{len(self._params)} then, {len(now)} now (added: {added[:5] or 'none'}, gone: {gone[:5] or 'none'}, "
            f"replaced by new Parameter objects: {replaced[:5] or 'none'}). Finish building the model (and setting "
            "requires_grad) before wrapping it, or wrap the new model in a new DistributedDataParallel"
            + ("; load_state_dict(..., assign=True) and `module.name = nn.Parameter(...)` replace the objects whose "
               "gradients DDP reduces: load into them (assign=False, or `with torch.no_grad(): p.copy_(...)`), or "
               "wrap after loading" if replaced else "")
        )

    def _list_buffers_again(self) -> None:
        """The buffers broadcast before each forward, after the module (re)registered some: as native,
        whose list is taken again at each broadcast -- and only while it holds any, so a module with
        no buffers when wrapped never broadcasts (a mask or statistic it registers later stays each
        rank's own, as with native DDP)."""
        if self._module_buffers:
            self._module_buffers = [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]
            self._buffer_layout = _layout_of(self._module_buffers)

    def _will_sync_buffers(self) -> bool:
        return self.require_forward_param_sync and self.forward_sync_buffers and bool(self._module_buffers)

    def _sync_buffers(self, synchronises: bool, joined: bool = False) -> None:
        """Rank 0's buffers everywhere (in join(): those of the highest rank still training), with a
        header saying which forward they were sent for (does it synchronise gradients?), checked
        by the receivers (not by a joined rank's shadow, which takes whatever the others send)."""
        src = self._find_common_rank(not joined) if self._join_config.enable else 0
        mine = buffer_sync_header(self._iterations, synchronises, self._buffer_syncs, self._buffer_layout)
        self._buffer_syncs += 1
        if self.world_size > 1:
            header = torch.tensor(mine, dtype=torch.int64)
            self._issue("buffer broadcast")
            with torch.no_grad(), watchdog.waiting():
                try:
                    # (the header first: intact even where a receiver's int64 buffers are of another size)
                    self._comm.broadcast_([header, *self._module_buffers], src=src)
                except Exception as e:  # (MPI: a receiver's buffers of another size truncate the message)
                    if self.rank == src:
                        raise
                    mine_ = ", ".join(f"{n} {tuple(b.shape)} {_dtype_name(b.dtype)}" for n, b in
                                      list(self.module.named_buffers())[:4])
                    first = str(e).splitlines()[0] if str(e) else repr(e)
                    raise RuntimeError(
                        f"the broadcast of rank {src}'s buffers failed on rank {self.rank} ({type(e).__name__}: "
                        f"{first}); this rank's buffers are {len(self._module_buffers)}: {mine_}"
                        f"{' ...' if len(self._module_buffers) > 4 else ''}. Every rank must hold the same buffers "
                        "(shapes, dtypes, order): a buffer registered or replaced after wrapping with another shape "
                        "on some ranks differs; make it the same everywhere, keep per-rank state out of the "
                        "module's buffers, or pass broadcast_buffers=False") from e
            if not joined and self.rank != src:
                check_buffer_sync_header(header.tolist(), mine, src, self.rank, any_forward=True)

    def _begin_iteration(self, start_ns: int) -> None:
        n_buckets = len(self._bucket_buffers)
        self._pending = list(self._bucket_sizes)  # params still to arrive, per bucket
        self._next_launch = 0  # buckets launch strictly in plan order
        self._futures: list = [None] * n_buckets
        self._flags: bytes | None = None  # this rank's used (and non-finite) flags, once known
        self._seen = bytearray(len(self._params))
        self._nonfinite = bytearray(len(self._params))
        self._ready_order: list[int] = []
        self._hook_counts = [0] * len(self._params)  # static_graph: gradient hooks fired so far
        self._hook_order: list[int] = []  # static_graph's first iteration: params in hook order
        self._finalize_queued = False
        self._expect_grads = True
        if not self._hooks_agreed:
            self._agree_on_next_hook()
        self._contributors = self.world_size
        if self._sync_flag is not None and not self._divide_by_initial_world_size:
            # join(divide_by_initial_world_size=False): the mean over the ranks still training.
            with watchdog.waiting():
                self._contributors = int(self._sync_flag.wait()[0])
        if self._contributors != self._divisor:
            self._set_divisor(self._contributors)
        self._events = IterationEvents(
            rank=self.rank,
            forward_start_ns=start_ns,
            buckets=[BucketEvents(b, buf.numel() * buf.element_size()) for b, buf in enumerate(self._bucket_buffers)],
        )

    def _set_divisor(self, n: int) -> None:
        """Gradients are divided by `n` (the world size; in join(divide_by_initial_world_size=False),
        the ranks still training). The packs multiply float32/float64 gradients by a 0-dim tensor of
        their dtype holding 1/n: bitwise the product with the Python float (which the kernel casts to
        the same dtype), without wrapping that float into a tensor at every pack (~2 us a parameter).
        Half dtypes keep the float: their kernel multiplies in float32 by the float itself."""
        self._divisor = n
        self._inv_world = 1.0 / n
        self._scale_of = {dtype: torch.tensor(self._inv_world, dtype=dtype) for dtype in (torch.float32, torch.float64)}

    def _initial_plan(self, specs: list[ParamSpec]) -> BucketPlan:
        """The plan before any re-plan. With find_unused_parameters and no static_graph, where
        native never re-plans: its capped buckets, filled in registration order. Otherwise the order
        the gradients will come in is not known yet, and on c10d the plan is native's: one bucket
        per dtype (a sparse gradient alone) in registration order, until the re-plan from the
        observed order (_observes_order). The same buckets as native's are the same Gloo
        all-reduces: at n >= 3, where Gloo's ring adds each chunk of a bucket in its own rank order,
        the same sums to the bit (and a comm hook sees native's buckets). Over MPI, whose sums
        at n >= 3 are its own anyway, the planner's buckets in reverse registration order from the
        first iteration, as portddp.jax's, which may share the job's collectives."""
        if self.find_unused_parameters and not self.static_graph:
            return plan_as_registered(specs, self.bucket_cap_mb, self.first_bucket_cap_mb)
        if self._native_schedule:
            return plan_as_registered(specs, math.inf, math.inf)
        return plan_buckets(specs, self.bucket_cap_mb, self.first_bucket_cap_mb)

    @property
    def _native_schedule(self) -> bool:
        """Whether the buckets follow native's schedule iteration by iteration (_initial_plan,
        _observes_order): on c10d, where the sums are Gloo's as native's."""
        return self.transport == "c10d"

    def _keep_hooks_last(self) -> None:
        """Native's reducer takes a gradient after every post-accumulate-grad hook of its parameter,
        whenever that hook was registered (its own hook sits on the AccumulateGrad node, which runs
        them first): a gradient clipped in place, or an optimizer stepped in backward, by a hook the
        script adds after wrapping must be what is reduced. Ours is one of those hooks, which run in
        registration order: each forward moves it back behind any added since (a length check per
        parameter when nothing was added)."""
        for p, hook_id in zip(self._params, self._hook_ids):
            hooks = p._post_accumulate_grad_hooks
            if hooks is not None and len(hooks) > 1 and next(reversed(hooks)) != hook_id and hook_id in hooks:
                hooks[hook_id] = hooks.pop(hook_id)  # (autograd walks the dict's own order: not move_to_end)

    def _make_hook(self, i: int):
        # Weakly: the parameters keep their hooks for as long as they live, and must not keep a
        # wrapper the script dropped (native's reducer removes its hooks when it is freed).
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            ddp = ref()
            if ddp is None:
                return
            try:  # (a try costs nothing until it raises: no wrapper frame per parameter and backward)
                if ddp._sync and (ddp._expect_grads or ddp._in_ddp_backward()):
                    # An undefined gradient (e.g. from an output the loss ignores): native's rule -- not
                    # used, with find_unused_parameters or static_graph (its .grad stays None); else a
                    # zero gradient, reduced with the others'.
                    if param.grad is not None or not (ddp.find_unused_parameters or ddp.static_graph):
                        ddp._mark_ready(i, param)  # (outside an iteration: a second backward, refused there)
                elif ddp._expect_grads and ddp._in_ddp_backward():
                    raise RuntimeError(_MIXED_BACKWARD.format(name=ddp._names[i]))
                elif ddp.find_unused_parameters and param.grad is not None:  # under no_sync (or through
                    ddp._used_unsynced[i] = 1  # ddp.module) it accumulates in .grad: used since the last reduction
            except BaseException as e:  # (raised through the script's backward(), which may catch it and go on)
                watchdog.note_raised(e)
                raise

        return hook

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        now = _now()
        if not self._expect_grads:
            raise RuntimeError(
                f"gradient of {self._names[i]!r} arrived outside a DDP iteration: run one backward per "
                "forward of the DistributedDataParallel wrapper (a second backward needs another forward). For two "
                "losses of one forward, backpropagate their sum once: (loss1 + loss2).backward() gives the same "
                "gradients as loss1.backward(retain_graph=True); loss2.backward(), all of them averaged (native "
                "DDP averages only the first backward's and leaves the second's on each rank as it is)"
            )
        if self.static_graph and self._static_gradient_incomplete(i):
            return
        if self._seen[i]:
            raise RuntimeError(
                f"parameter {self._names[i]!r} received its gradient twice in one backward pass (a layer "
                "used twice under reentrant activation checkpointing, say); DistributedDataParallel supports "
                "one gradient per parameter per iteration unless static_graph=True, which learns how many "
                "arrive in its first iteration"
            )
        if not self._finalize_queued:
            self._queue_finalize()
        self._ready(i, param, now)

    def _static_gradient_incomplete(self, i: int) -> bool:
        """static_graph: count param i's gradient hooks (a layer reused under reentrant
        checkpointing fires them once per nested backward, each time after accumulating into
        .grad). In the first iteration, as native's, nothing is reduced during the backward:
        the counts are learnt and `_finalize` marks every parameter ready at the end. From then
        on, a parameter is ready at its last hook."""
        self._hook_counts[i] += 1
        if self._static_hooks is None:
            self._hook_order.append(i)  # (the last hook decides the order the plan is rebuilt in)
            if not self._finalize_queued:
                self._queue_finalize()
            return True
        if self._hook_counts[i] > self._static_hooks[i]:
            raise self._static_graph_changed(i)
        return self._hook_counts[i] < self._static_hooks[i]

    def _static_graph_changed(self, i: int) -> RuntimeError:
        return RuntimeError(
            f"parameter {self._names[i]!r} received {self._hook_counts[i]} gradient(s) in this backward pass "
            f"{'so far ' if self._hook_counts[i] > self._static_hooks[i] else ''}but {self._static_hooks[i]} in "
            "the first one, which static_graph=True learned: the graph changed (a layer reused a different number "
            "of times: a depth that varies, LayerDrop), so its gradient would be reduced incomplete or not at all. "
            "static_graph needs the same graph in every iteration (native DDP fails here too, at the next "
            "forward). For a layer reused under activation checkpointing, checkpoint it with use_reentrant=False "
            "(one gradient per parameter per backward) and build DistributedDataParallel without static_graph")

    def _ready(self, i: int, param: torch.Tensor, now: int) -> None:
        """Param i's gradient is complete: pack it, launch what the plan order allows."""
        self._seen[i] = 1
        if not self._rebuilt:
            self._ready_order.append(i)
        self._events.backward_end_ns = now
        if self.check_finite and param.grad is not None and not bool(torch.isfinite(
                param.grad._values() if param.grad.is_sparse else param.grad).all()):
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
        if self._sparse_buckets and self._bucket_of[i] in self._sparse_buckets:
            self._pack_sparse(i, grad)
            return
        if grad is None:  # an undefined gradient, counted as zeros (see _make_hook)
            view.zero_()
            return
        if grad.requires_grad:  # backward(create_graph=True)
            grad = self._first_order(i, grad)
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter {self._names[i]!r} has a {grad.layout} gradient, but it is not the weight of an "
                "nn.Embedding or nn.EmbeddingBag with sparse=True, whose gradients DistributedDataParallel "
                "expects sparse and reduces alone (native's rule too: its reducer fails on this one). Make it such "
                "a module's weight, or give it a dense gradient"
            )
        if self.gradient_as_bucket_view and grad.data_ptr() == view.data_ptr():  # already in place
            if self._hook is None:
                view.div_(self._divisor)  # (native's reducer divides here, where it multiplies on a copy)
            return
        if self._hook is None:
            # Divide while copying: one pass over the gradient instead of two.
            torch.mul(grad, self._scale_of.get(grad.dtype, self._inv_world), out=view)
        else:
            view.copy_(grad)
        if self.gradient_as_bucket_view and not param.grad.requires_grad:
            param.grad = view

    def _pack_sparse(self, i: int, grad: torch.Tensor | None) -> None:
        """Param i's sparse gradient is its bucket: divided (unless a hook will divide) and reduced
        itself, the reduced sum becoming .grad -- as native's reducer does, but on a copy (see below).
        No gradient here (unused on this rank): an empty one, so the collectives still pair."""
        if grad is None:
            grad = _empty_sparse(self._params[i])
        elif not grad.is_sparse:
            raise RuntimeError(
                f"parameter {self._names[i]!r}, the weight of an nn.Embedding/EmbeddingBag built with sparse=True, got "
                f"a {grad.layout} gradient; DistributedDataParallel planned it as sparse when it was built (native's "
                "reducer fails here too). Keep the module's `sparse` as it was when wrapped, or wrap it again")
        elif self._hook is None:
            # Divided out of place: two tables summed in the forward (`tok(x) + pos(p)`) get gradients whose
            # values share memory, which native divides in place twice (half the mean, silently); and with
            # check_finite .grad is to be left as it was if some rank finds a NaN.
            grad = grad / self._divisor
        else:
            grad = grad.clone()  # (hooks divide in place too: PyTorch's allreduce_hook)
        self._sparse_grads[self._bucket_of[i]] = grad

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self._bucket_buffers) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        ev = self._events.buckets[b]
        ev.launch_ns = _now()
        buffer = self._sparse_grads[b] if self._sparse_buckets and b in self._sparse_buckets else self._bucket_buffers[b]
        if b == len(self._bucket_buffers) - 1 and self._carries_used():
            # (every gradient is in, or counted missing, by the time the last bucket goes out)
            _put_counts(self._tail, self._local_flags(), 2 * len(self._params), self.rank, self._step_slot())
            buffer = self._last_full
        self._futures[b] = self._reduce_bucket(b, buffer, ev)

    def _observes_order(self) -> bool:
        """Whether the iteration just finished is the one whose gradient order the plan is rebuilt
        from: the first synchronised iteration, never with find_unused_parameters alone; with
        static_graph on c10d the second, as native's (its first learns the graph and reduces
        everything at its end; native's reducer records the order in the second and keeps its one
        bucket until then)."""
        if self.static_graph:
            return self._iterations >= (2 if self._native_schedule else 1)
        return not self.find_unused_parameters and self._iterations >= 1

    def _carries_used(self) -> bool:
        """Whether the last bucket's all-reduce carries the used counts (c10d, no comm hook)."""
        return self._tail is not None and self._hook is None

    def _reduce_bucket(self, b: int, buffer: torch.Tensor, event=None) -> torch.futures.Future:
        """Launch bucket b's reduction (the comm hook's, or a plain all-reduce); `event.done_ns` is
        stamped when it completes."""
        self._issue(f"bucket {b}")
        if self._hook is None and not buffer.is_sparse:
            return self._comm.allreduce_timed(buffer, event) if event is not None else self._comm.allreduce(buffer)
        if self._hook is None:  # (a sparse gradient: Gloo's sparse all-reduce, or its equal on MPI)
            fut = self._comm.allreduce(buffer)
            if event is not None:
                fut.add_done_callback(lambda _fut: setattr(event, "done_ns", _now()))
            return fut
        # A new GradBucket each time, as native hands out: hooks may set_buffer() on it. On c10d its
        # buffer() is a tensor of its own over the bucket's memory: a hook that pads it with resize_()
        # (as batched_powerSGD_hook does) grows that tensor, not the bucket the gradients are packed into.
        # (MPI's buckets are numpy's memory, shared or not, which cannot grow at all.)
        if buffer.is_sparse and _is_powersgd(self._hook):
            raise RuntimeError(
                f"comm hook {_hook_name(self._hook)} got bucket {b}, the sparse gradient of "
                f"{self._names[self._plan.buckets[b].params[0]]!r} (an nn.Embedding/EmbeddingBag with sparse=True): "
                "PowerSGD compresses dense buckets and hands a sparse one back unreduced -- native DDP's ranks then "
                "train their tables apart, silently. Build the module with sparse=False, or use a hook that "
                "all-reduces a sparse bucket (PyTorch's allreduce_hook)")
        if buffer.is_complex() and not buffer.is_sparse:  # native's hooks see its real view: (re, im) pairs
            buffer = torch.view_as_real(buffer).view(-1)
        elif self.transport == "c10d" and not buffer.is_sparse:
            buffer = buffer.view(-1)
        try:
            fut = self._hook(self._hook_state, self._grad_bucket(b, buffer))
        except (RuntimeError, NotImplementedError) as e:
            if buffer.is_sparse:
                name = self._names[self._plan.buckets[b].params[0]]
                raise RuntimeError(
                    f"comm hook {_hook_name(self._hook)} failed on bucket {b}, the sparse gradient of {name!r} (an "
                    f"nn.Embedding/EmbeddingBag with sparse=True): {type(e).__name__}: {str(e).splitlines()[0]}. "
                    "Compression hooks (PowerSGD, fp16/bf16) work on dense buckets; native DDP hands this one back "
                    "unreduced and the ranks' tables drift apart. Use a hook that all-reduces a sparse bucket "
                    "(PyTorch's allreduce_hook), skip it in yours (bucket.buffer().is_sparse), or build the module "
                    "with sparse=False") from e
            if not isinstance(e, RuntimeError) or self.transport != "mpi" or "not resizable" not in str(e):
                raise
            raise RuntimeError(
                f"comm hook {_hook_name(self._hook)} resized bucket {b}'s buffer() (resize_(), as torch's "
                "batched_powerSGD_hook pads it): transport='mpi' keeps its buckets in numpy's memory (the "
                "shared-memory window on one host), which cannot grow. Pad a copy in the hook "
                "(torch.nn.functional.pad(bucket.buffer(), ...)), or use transport='c10d'") from e
        if not isinstance(fut, torch._C.Future):  # (c10d's get_future() is the C++ base class)
            raise TypeError(
                f"comm hook {_hook_name(self._hook)} returned {type(fut).__name__} for bucket {b}; a hook must "
                "return a torch.futures.Future whose value is the reduced flat bucket (e.g. "
                "dist.all_reduce(t, async_op=True).get_future(), or bucket.allreduce(t))")
        if event is not None:
            fut.add_done_callback(lambda _fut: setattr(event, "done_ns", _now()))
        return fut

    def _check_hook_result(self, b: int, result) -> torch.Tensor:
        """Native's contract: the future's value is one tensor shaped like the bucket."""
        tensor = _tensor_of(result)
        if b in self._sparse_buckets:
            p = self._params[self._plan.buckets[b].params[0]]
            if not (isinstance(tensor, torch.Tensor) and tensor.is_sparse and tensor.shape == p.shape):
                got = (f"a {tuple(tensor.shape)} {tensor.layout} tensor" if isinstance(tensor, torch.Tensor)
                       else type(result).__name__)
                raise RuntimeError(
                    f"comm hook {_hook_name(self._hook)}'s future for bucket {b} resolved to {got}, but the bucket "
                    f"holds the sparse gradient of {tuple(p.shape)} {self._names[self._plan.buckets[b].params[0]]!r}: "
                    "return the reduced sparse tensor (bucket.buffer() after its all-reduce)")
            return tensor
        expected = self._bucket_buffers[b]
        if (expected.is_complex() and isinstance(tensor, torch.Tensor) and tensor.numel() == 2 * expected.numel()
                and tensor.dtype == _REAL_OF.get(expected.dtype)):
            # c10d's all_reduce of a complex tensor resolves to its real view (n, 2); native takes it.
            tensor = torch.view_as_complex(tensor.reshape(-1, 2).contiguous())
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != expected.numel() or not (
                tensor.dtype.is_floating_point or tensor.is_complex()):
            got = (f"a {tuple(tensor.shape)} {_dtype_name(tensor.dtype)} tensor" if isinstance(tensor, torch.Tensor)
                   else type(result).__name__)
            raise hook_result_error(_hook_name(self._hook), b, got, expected.numel(), _dtype_name(expected.dtype),
                                    "future")
        return tensor

    # ---- finalize
    def _finalize(self) -> None:
        """End of backward: launch the rest, wait in order, agree on unused params, write .grad."""
        self._expect_grads = False
        if self.static_graph and self._static_hooks is None:  # first iteration: every gradient is complete now
            self._static_hooks = list(self._hook_counts)
            last = {i: k for k, i in enumerate(self._hook_order)}
            now = _now()
            for i in sorted(last, key=last.get):
                self._ready(i, self._params[i], now)
        missing = [i for i, seen in enumerate(self._seen) if not seen]
        if self.static_graph and self._static_hooks is not None:
            for i in missing:  # (some gradients, fewer than learned: never marked ready)
                if self._hook_counts[i]:
                    raise self._static_graph_changed(i)
        flags = self._local_flags()
        for i in missing:
            # No gradient in this backward; other ranks may have one, and every rank must still issue
            # the same collectives. Reduce what .grad holds (with find_unused_parameters, as native
            # does: a no_sync() backward's accumulated gradient is averaged now), else zeros.
            p = self._params[i]
            if self.find_unused_parameters and p.grad is not None:
                self._pack(i, p)
            elif self._sparse_buckets and self._bucket_of[i] in self._sparse_buckets:
                self._pack_sparse(i, None)
            else:
                self._views[i].zero_()
            self._pending[self._bucket_of[i]] -= 1
        self._launch_ready_buckets()
        # The collectives below are queued behind the buckets (their latency hidden) on the MPI
        # transport, whose comm thread runs one at a time. Not with a comm hook, which may issue
        # more collectives from its futures' callbacks (PowerSGD does): they must all be out
        # first, or ranks would issue them in different orders. And not on c10d: Gloo runs a
        # small all-reduce issued now beside the last bucket's, which cost 3-7 % of a step on
        # the MLPs against issuing it after the buckets (A/B, docs/performance-log.md).
        early = self._hook is None and self.transport != "c10d"
        delayed = self._launch_delayed() if early else None
        # One more small collective after the buckets: how many ranks produced
        # each gradient. It is what lets every rank -- not only the one missing
        # a gradient -- fail together instead of hanging.
        # With check_finite the same collective also counts, per parameter, the ranks whose
        # gradient held a NaN or Inf (a second half of the vector). On c10d the last bucket
        # carries them instead (_launch).
        carried = self._carries_used()
        used_fut = self._exchange_used(flags) if early else None
        # As native's reducer does, a bucket's mean goes back to .grad as soon as it is reduced,
        # while the later buckets are still on the wire -- for the parameters this rank has a
        # gradient of (used at least here; the rest wait for the counts). Not with check_finite,
        # which leaves .grad untouched if any rank finds a NaN.
        early_write = not self.check_finite
        with watchdog.waiting():
            for b, fut in enumerate(self._futures):
                # (not kept past the iteration: a script that destroys the process group after its last
                # step would leave c10d's futures to the interpreter's teardown, which now and then
                # aborted the rank -- "terminate called without an active exception", 1 run in ~15)
                self._futures[b] = None
                result = self._check_hook_result(b, fut.wait()) if self._hook is not None else _tensor_of(fut.wait())
                if self._sparse_buckets and b in self._sparse_buckets:
                    self._finish_sparse(b, result)
                # (not for an empty bucket: its data_ptr() is 0, and on c10d its result is the
                # buffer with the used counts' tail)
                elif result.data_ptr() != self._bucket_buffers[b].data_ptr() and self._bucket_buffers[b].numel():
                    self._bucket_buffers[b].copy_(result)
                if early_write:
                    self._write_grads([i for i in self._plan.buckets[b].params if self._seen[i]])
            if not early:
                delayed = self._launch_delayed()
                used_fut = None if carried else self._exchange_used(flags)
            if delayed is not None:
                self._write_delayed(delayed)
            totals = self._tail.long().tolist() if carried else used_fut.wait().tolist()
        n = len(self._params)
        counts, nonfinite, steps = totals[:n], totals[n:-self.world_size], totals[-self.world_size:]
        if self.find_unused_parameters:  # (what a join() shadow contributes later)
            self._used_last = bytes(1 if c else 0 for c in counts)
        self._events.finalize_end_ns = _now()
        self._last_events = self._events
        self._iterations += 1
        watchdog.step_finished()
        if self._sync_flag is not None:
            self._contributors = int(self._sync_flag.wait()[0])
            self._sync_flag = None
        # Re-plan once from the observed order -- as native's reducer, not with find_unused_parameters
        # (unless static_graph): its buckets stay native's (plan_as_registered), as a comm hook sees them.
        if not self._rebuilt and self._rebuild_order is None and self._observes_order():
            self._rebuild_order = self._ready_order
        check_same_step(steps, self.rank)
        if not (self.find_unused_parameters or self.static_graph) and min(counts) < self._contributors:
            self._raise_unused(counts)
        if any(nonfinite):
            self._sparse_results.clear()
            self._raise_nonfinite()
        self._write_grads([i for i, c in enumerate(counts) if c and not (early_write and self._seen[i])])
        self._sparse_results.clear()  # (.grad holds them: not kept past zero_grad)

    def _finish_sparse(self, b: int, result: torch.Tensor) -> None:
        """A sparse bucket's reduced sum, into the copy that was reduced (native copies it into the
        gradient itself the same way); _write_grads makes it .grad."""
        grad = self._sparse_grads.pop(b)
        if result is not grad:
            grad.copy_(result)
        self._sparse_results[b] = grad

    def _local_flags(self) -> bytes:
        """This iteration's flags, computed once: the parameters used by this rank since the
        last synchronised backward (native's local used map), then, with check_finite, those
        whose gradient held a NaN or Inf."""
        if self._flags is None:
            used = bytes(self._seen)
            if self.find_unused_parameters and any(self._used_unsynced):
                used = bytes(max(a, b) for a, b in zip(self._seen, self._used_unsynced))
                self._used_unsynced = bytearray(len(self._params))
            self._flags = used + (bytes(self._nonfinite) if self.check_finite else b"")
        return self._flags

    def _exchange_used(self, flags: bytes, shadow: bool = False):
        """How many ranks produced each gradient (and found it non-finite), and each rank's step
        slot in its own place (protocol.step_slot; a join() shadow's SHADOW is not compared): one
        small all-reduce that lets every rank fail together."""
        used = torch.empty(len(flags) + self.world_size, dtype=torch.int32)
        _put_counts(used, flags, len(flags), self.rank, SHADOW if shadow else self._step_slot())
        if self.world_size == 1:
            return _done(used)
        self._issue("used-count")
        return self._comm.allreduce(used)

    def _raise_unused(self, counts: list[int]) -> None:
        raise unused_parameters_error(self._names, counts, self._contributors, self.rank, self._seen)

    def _raise_nonfinite(self) -> None:
        mine = [self._names[i] for i, bad in enumerate(self._nonfinite) if bad]
        self._issue("non-finite gradients' names")
        with watchdog.waiting():
            everyone = self._comm.allgather_object(mine) if self.world_size > 1 else [mine]
        raise nonfinite_error(everyone, self.rank)

    def _write_grads(self, indices: list[int]) -> None:
        """The mean back into the `.grad` of parameters `indices`: one fused copy for the common
        case (`.grad` exists and is not the bucket view), a per-parameter path for the others. (A
        parameter unused on every rank is never passed: its .grad is left as it was, as native
        DDP does.)"""
        grads, views = [], []
        params, bucket_views, as_view = self._params, self._views, self.gradient_as_bucket_view
        for i in indices:
            p, view = params[i], bucket_views[i]
            grad = p.grad
            if self._sparse_buckets and self._bucket_of[i] in self._sparse_buckets:
                p.grad = self._sparse_results[self._bucket_of[i]]
                continue
            if grad is None:
                p.grad = view if as_view else view.clone()
            elif grad.requires_grad:  # create_graph=True: keep its local graph
                with torch.no_grad():
                    grad.copy_(view)
            elif as_view:
                if grad.data_ptr() != view.data_ptr():
                    p.grad = view
            else:
                grads.append(grad)
                views.append(view)
        if grads:
            torch._foreach_copy_(grads, views)

    # ---- join/uneven
    def _shadow_iteration(self) -> None:
        """join(): this rank has no inputs left; issue the collectives of the others' forward
        and backward (in the same order as _pre_forward and _finalize do)."""
        # The others re-plan at the forward after their first synchronised iteration: so does a rank that
        # joined before it had one (no batch at all), taking rank 0's order (as native's joined rank, which
        # pushes every parameter as observed; with rank 0 joined so, that is the parameters' order).
        if self._rebuild_order is not None or not self._rebuilt and self._observes_order():
            self._rebuild()
        if self._will_sync_buffers():
            self._sync_buffers(True, joined=True)
        with watchdog.waiting():
            contributors = int(self._exchange_sync_flag(False).wait()[0])
        self.require_forward_param_sync = contributors > 0
        if contributors == 0:
            return  # the others run a local (no_sync) or no_grad forward
        if not self._hooks_agreed:
            self._agree_on_next_hook()
        zeros = [_empty_sparse(self._params[self._plan.buckets[b].params[0]]) if b in self._sparse_buckets
                 else torch.zeros_like(buf) for b, buf in enumerate(self._bucket_buffers)]
        # With find_unused_parameters, native's joined rank contributes the used map of its last
        # reduction (kept up to date by every shadow one): what was used then counts as used now,
        # so the others write zeros (their mean) into those .grad rather than leaving them alone.
        used = self._used_last if self.find_unused_parameters else bytes(len(self._params))
        carried = self._carries_used()
        if carried:  # the training ranks' last bucket carries the used counts: so does ours
            zeros[-1] = torch.zeros_like(self._last_full)
            tail = zeros[-1][self._bucket_buffers[-1].numel():]
            _put_counts(tail, used, 2 * len(self._params), self.rank, SHADOW)
        futures = [self._reduce_bucket(b, z) for b, z in enumerate(zeros)]
        if self._hook is not None:  # the order of _finalize
            futures = [fut.wait() for fut in futures] and []
        if self._delayed:
            self._issue("delayed parameters")  # (as the training ranks' _launch_delayed: the same count)
            futures.append(self._comm.allreduce(torch.zeros(sum(p.numel() for _, p in self._delayed),
                                                            dtype=self._delayed[0][1].dtype)))
        self._iterations += 1
        used_fut = None if carried else self._exchange_used(
            used + (bytes(len(self._params)) if self.check_finite else b""), shadow=True)
        with watchdog.waiting():
            for fut in futures:
                fut.wait()
            totals = tail.long().tolist() if carried else used_fut.wait().tolist()
        if self.find_unused_parameters:
            self._used_last = bytes(1 if c else 0 for c in totals[:len(self._params)])

    # ---- rebuild/autotune
    def _broadcast_from_first(self, order) -> None:
        """Rank 0's values of the int64 numpy array `order`, in place (_rebuild)."""
        self._comm.broadcast_([torch.from_numpy(order)], src=0)

    def _autotune(self, now: int) -> None:
        """bucket_cap_mb="auto": the cap this iteration uses; re-plan (observed order) when it changes."""
        cap = self._tuned_cap(now)
        if cap != self.bucket_cap_mb:
            self.bucket_cap_mb = cap
            if self._observed_order is not None:  # else the pending rebuild plans with the new cap
                self._install_plan(rebuild_plan(self._plan, self._observed_order, cap, self.first_bucket_cap_mb))
            elif self.find_unused_parameters and not self.static_graph:  # (no rebuild to plan it)
                self._install_plan(self._initial_plan(list(self._plan.specs)))

    # ---- stats
    def stats(self) -> dict:
        """The metrics (portddp.timeline) of the last synchronised iteration, plus its events."""
        if self._last_events is None:
            return {}
        extra = {"iterations": self._iterations, "plan_rebuilt": self._rebuilt, "bucket_cap_mb": self.bucket_cap_mb}
        if self._tuner is not None:
            extra["autotune"] = self._tuner.summary()
        return self._last_events.stats() | extra


def _outside_compiled_graphs(dynamo) -> None:
    """What runs before and after the module talks to other ranks: torch.compile must not trace it
    (`torch._dynamo.disable`, as native DDP's own). Applied when TorchDynamo is loaded -- by
    torch.compile, or by PyTorch itself at the first optimizer step -- not at import, which would
    load it (1.2 s) in a process that never needs it."""
    for name in ("_pre_forward", "_post_forward"):
        setattr(DistributedDataParallel, name, dynamo.disable(DistributedDataParallel.__dict__[name]))


after_import("torch._dynamo", _outside_compiled_graphs)

_MIXED_BACKWARD = (
    "parameter {name!r} got its gradient in a backward pass through the output of a synchronising forward, "
    "but a forward inside no_sync() ran after it: as native's, the last forward decides whether the backward "
    "synchronises, so the synchronising forward's gradients would stay local on every rank, silently (native "
    "DDP's ranks drift apart here). Run each forward's backward before the next forward, or both forwards inside "
    "no_sync() (accumulating) or both outside it")


def _members(group) -> tuple[int, ...]:
    """A c10d process group's members' global ranks."""
    return tuple(dist.get_process_group_ranks(group))


def _dense_strides(t: torch.Tensor) -> tuple | None:
    """t's strides where its elements fill their memory densely in another order than C's
    (channels_last, a transposed weight); None for C order or a layout with gaps."""
    if t.is_contiguous() or t.numel() == 0:
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))  # outermost first (size-1 dims: any place)
    return tuple(t.stride()) if t.permute(order).is_contiguous() else None


def _named_specs(named) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of each (name, tensor): what the model check compares across ranks."""
    return [(n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in named]


def _put_counts(out: torch.Tensor, flags: bytes, slots_at: int, rank: int, slot: int) -> None:
    """This rank's part of the used counts: `out` = [flags][zeros up to slots_at][one step slot
    per rank], this rank's slot in its own place. The same layout travels alone (_exchange_used,
    int32) or as the tail of c10d's last bucket (floats: a step slot is below 2**24, exact in
    float32)."""
    out.zero_()
    if flags:
        out[:len(flags)] = torch.frombuffer(bytearray(flags), dtype=torch.uint8)
    out[slots_at + rank] = slot


def _sparse_gradient_expected(module: nn.Module, params: list) -> list[bool]:
    """Native's rule: a parameter's gradient is expected sparse when the first module holding it
    (in named_modules order) is an nn.Embedding or nn.EmbeddingBag built with sparse=True."""
    first: dict[int, nn.Module] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            first.setdefault(id(p), m)
    return [isinstance(m := first.get(id(p)), (nn.Embedding, nn.EmbeddingBag)) and bool(m.sparse) for p in params]


def _is_powersgd(hook) -> bool:
    """PyTorch's PowerSGD hooks (which return a sparse bucket unreduced)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook  # noqa: PLC0415

    return hook in (powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook)


def _empty_sparse(param: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of `param` with no entries, laid out as an embedding's (rows sparse, the rest dense)."""
    return torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.long, device=param.device),
                                   torch.empty((0, *param.shape[1:]), dtype=param.dtype, device=param.device),
                                   param.shape, check_invariants=False)


def _tensor_of(value) -> torch.Tensor:
    """A comm hook's result: native accepts a tensor or a list holding one (c10d futures give lists)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return value
