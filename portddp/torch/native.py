"""The parts of native DDP's interface that are about PyTorch, not about DDP's design.

portddp.torch.DistributedDataParallel takes native's arguments and is a
drop-in replacement, so it carries native's surface: its argument checks (with
native's words), the `Joinable` glue behind `ddp.join()` / `Join([ddp])`, the
output sink (native's _DDPSink), delayed all-reduce parameters and a few attributes
native scripts touch. They live here, mixed into the class, so that
portddp/torch/ddp.py and portddp/jax/ddp.py differ only where the frameworks
force them to.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook

from portddp import launch, watchdog
from portddp.buckets import cap_bytes, rebuild_plan

__all__ = ["NativeInterface", "registrations"]


class _Registrations:
    count = 0  # parameters, buffers and submodules (re)assigned in any module of this process


def _registered(*_args) -> None:
    _Registrations.count += 1


# Cheap change detection for DDP's per-forward check that the module's parameters are still
# the ones it wrapped: the module is walked again only after something was (re)registered.
torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


def registrations() -> int:
    return _Registrations.count


class _DDPSink(torch.autograd.Function):
    """Native's _DDPSink: with find_unused_parameters, and in static_graph's first iteration, the
    forward's outputs that have a grad_fn pass through here, cloned (as native's: a script may
    change one in place, or return one tensor under two names), and its backward -- a node of the
    outermost backward pass -- queues the end-of-backward callback there. (Reentrant backward passes,
    activation checkpointing with use_reentrant=True, run their gradient hooks inside a nested pass;
    the callback must not end the iteration with it. static_graph's later iterations queue it from
    the outputs' grad_fn pre-hook: backward_recorder.)"""

    @staticmethod
    def forward(ctx, ddp_ref, *tensors):
        ctx.ddp_ref = ddp_ref
        # An output the loss does not use gets no gradient (None, not zeros): the parameters that
        # only it depends on stay unused, .grad None, as in native (whose sink does the same).
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ddp = ctx.ddp_ref()
        if ddp is not None and ddp._expect_grads:
            ddp._queue_finalize()
        return (None, *grads)


class _CopyCannotTrain(torch.autograd.Function):
    """Identity whose backward refuses: the output of a copied (detached) wrapper's forward."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "backward through a copy of a portddp DistributedDataParallel (copy.deepcopy, pickle, torch.save/load): "
            "a copy does not synchronise gradients (its communication is not copied), so each rank would train "
            "alone. Train the original wrapper, or wrap the copy's module in a new DistributedDataParallel on every "
            "rank (DistributedDataParallel(copy.module)); evaluating the copy (an EMA, swa_utils.AveragedModel) is "
            "fine")


_PLAIN = (bool, int, float, str, type(None), torch.device, torch.dtype)


def _plain(value) -> bool:
    """A setting a copy can keep: plain values, and containers of them."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


class _JoinHook(JoinHook):
    """What a rank that ran out of inputs does inside `Join` while the others still train:
    issue the collectives of their forward and backward passes (zeros for the gradients),
    then, once everyone has joined, take the model of the last rank to join."""

    def __init__(self, ddp, divide_by_initial_world_size: bool):
        if ddp._tuner is not None and not ddp._tuner.done:
            raise RuntimeError("join() with bucket_cap_mb='auto' is refused while the caps are still being timed "
                               f"(the first {ddp._tuner.iterations} iterations): pass a fixed bucket_cap_mb")
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = ddp._find_common_rank(is_last_joiner)
        ddp._broadcast_state(src=src, buffers=ddp.forward_sync_buffers)
        ddp._step_count = 0  # the joined ranks stopped counting: every rank starts again from here
        ddp._forwards.clear()


def backward_recorder(ddp) -> Callable:
    """The grad_fn pre-hook `_mark_backward_source` registers: it records the autograd pass that
    starts from a synchronised forward's output (made once per wrapper; weakly, so that a graph
    does not keep the wrapper alive)."""
    ref = weakref.ref(ddp)

    def record(_grad_outputs):
        owner = ref()
        if owner is not None:
            owner._ddp_backward_task = torch._C._current_graph_task_id()
            if owner.static_graph and owner._expect_grads:  # (from the outermost pass, as _DDPSink's backward)
                owner._queue_finalize()

    return record


def step_marker(token: list, record: Callable | None) -> Callable:
    """A grad_fn pre-hook on a forward's output: token[0] = the autograd pass that first reached it
    (how forwards are told apart into steps: `DistributedDataParallel._step_slot`); then `record`
    (backward_recorder's, for a synchronised forward)."""
    def mark(grad_outputs):
        if token[0] is None:
            token[0] = torch._C._current_graph_task_id()
        if record is not None:
            record(grad_outputs)

    return mark


class NativeInterface:
    """Native DDP's interface around the design (mixed into portddp.torch.DistributedDataParallel)."""

    # -- copies: copy.deepcopy, pickle, torch.save(ddp)
    def __getstate__(self) -> dict:
        """What a copy keeps: the module (with its own copy of the parameters), nn.Module's state
        and the plain settings scripts read (.device_ids, .static_graph, ...) -- not the
        communication (process groups, MPI, bucket buffers, hooks), which cannot be copied. The
        copy is detached: its forward runs the module (an EMA or
        torch.optim.swa_utils.AveragedModel of the wrapper evaluates it, state_dict() keeps the
        `module.` keys), and a backward through it is refused (`_CopyCannotTrain`): native's copy
        builds a reducer of its own on the default group, portddp's would train each rank alone.
        Wrap `copy.module` in a new DistributedDataParallel on every rank to train it."""
        module_state = set(nn.Module().__dict__)
        state = {k: v for k, v in self.__dict__.items() if k in module_state or _plain(v)}
        state["_modules"] = {"module": self.module}
        state["_detached"] = True
        return state

    def _detached_forward(self, inputs, kwargs):
        output = self.module(*inputs, **kwargs)
        if not torch.is_grad_enabled():
            return output
        return torch.utils._pytree.tree_map(
            lambda t: _CopyCannotTrain.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t, output)

    def _native_arguments(self, module, device_ids, output_device, process_group, device_mesh, mixed_precision,
                          bucket_cap_mb_list, delay_all_reduce_named_params, param_to_hook_all_reduce,
                          check_reduction, broadcast_buffers=None, forward_sync_buffers=None):
        """Native DDP's checks of its own arguments, with native's words where they exist; returns
        the process group to use (device_mesh's, if one was given)."""
        if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
            raise ValueError("delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the "
                             "same time.")
        if process_group is not None and device_mesh is not None:
            raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
            process_group = device_mesh.get_group(mesh_dim=0)
        self.device_mesh = device_mesh
        if mixed_precision is not None:
            raise NotImplementedError(
                "mixed_precision is not supported by portddp.torch.DistributedDataParallel (native's own is a "
                "private prototype): pass mixed_precision=None and use torch.autocast for the forward, or "
                "register_comm_hook(None, fp16_compress_hook / bf16_compress_hook) to reduce in half precision")
        if bucket_cap_mb_list:
            raise NotImplementedError(
                f"bucket_cap_mb_list={bucket_cap_mb_list!r} is not supported by portddp: pass bucket_cap_mb=<cap> "
                "and first_bucket_cap_mb=<first bucket's cap> (keyword-only) instead")
        if check_reduction:
            warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
                          "Please avoid using it.", FutureWarning, stacklevel=3)
        if broadcast_buffers is not None:  # (2.13's words)
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is "
                "deprecated and its value is ignored when `forward_sync_buffers` is provided."
                if forward_sync_buffers is not None else
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
                "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init. If you rely on "
                "buffers NOT being synced at init (e.g. rank-local buffers), keep using `broadcast_buffers=False` "
                "until `init_sync_buffers` is available.", FutureWarning, stacklevel=3)
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._delayed = []  # (name, param): reduced together after backward
        delayed = list(delay_all_reduce_named_params or ())
        for name, param in delayed:
            self.parameters_to_ignore.add(name)
            if param.requires_grad:
                self._delayed.append((name, param))
        from portddp.torch.ddp import _sparse_gradient_expected  # noqa: PLC0415 -- (ddp.py mixes this class in)

        if sparse := [name for (name, _), expected in
                      zip(self._delayed, _sparse_gradient_expected(module, [p for _, p in self._delayed])) if expected]:
            raise ValueError(
                f"delay_all_reduce_named_params holds {sparse[0]!r}, the weight of an nn.Embedding/EmbeddingBag with "
                "sparse=True: the delayed parameters are all-reduced together as one dense buffer, which a sparse "
                "gradient cannot join (native fails there too, or trains the ranks apart). Leave it out of "
                "delay_all_reduce_named_params (its bucket is its own), or build the module with sparse=False")
        params = [p for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        if not any(p.requires_grad for p in params):
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter "
                               "that requires a gradient (and portddp needs at least one in the buckets).")
        for p in params:
            if isinstance(p, nn.parameter.UninitializedParameter):
                raise RuntimeError("Modules with uninitialized parameters can't be used with "
                                   "`DistributedDataParallel`. Run a dummy forward pass to correctly initialize "
                                   "the modules")
            if p.device.type == "meta":
                raise ValueError("the module has parameters on the meta device (no storage): materialise them "
                                 "first, e.g. module.to_empty(device='cpu') and initialise, then wrap")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError("device_ids can only be None or contain a single element.")
        types = {p.device.type for p in params}
        if len(types) != 1:
            raise ValueError("DistributedDataParallel's input module must be on the same type of devices, but "
                             f"input module parameters locate in {types}.")
        if types == {"cpu"} and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
            raise ValueError("SyncBatchNorm layers only work with GPU modules")  # (native's words and moment)
        multi_device = len({p.device for p in params}) > 1
        if not device_ids or types == {"cpu"} or multi_device:
            if device_ids or output_device:
                raise ValueError(
                    "DistributedDataParallel device_ids and output_device arguments only work with "
                    "single-device/multiple-device GPU modules or CPU modules, but got device_ids "
                    f"{device_ids}, output_device {output_device}, and module parameters "
                    f"{ {p.device for p in params} }. On CPU pass device_ids=None (or leave it out).")
            self.device_ids = None
            self.output_device = None
        else:
            index = [torch.device(d).index if not isinstance(d, int) else d for d in device_ids]
            self.device_ids = index
            out = output_device if output_device is not None else device_ids[0]
            self.output_device = torch.device(out).index if not isinstance(out, int) else out
        return process_group

    def _warn_if_alone(self, process_group=None) -> None:
        """A job of N ranks whose DDP sees a world of 1 trains N independent models (not said of a
        group of one the script made on purpose: `process_group=dist.new_group([2])`)."""
        launched = launch.detect().size
        if launched > 1 and self.world_size == 1 and process_group is None:
            warnings.warn(
                f"this job has {launched} ranks ({launch.detect().launcher}), but DistributedDataParallel's "
                f"{self.transport} group has 1: every rank will train its own model, nothing is averaged. "
                "Call portddp.init() (or init_process_group with the launcher's world) before wrapping",
                RuntimeWarning, stacklevel=3)

    @property
    def broadcast_buffers(self) -> bool:
        """Native's older name for forward_sync_buffers."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes (native's attribute)."""
        return cap_bytes(self.bucket_cap_mb, "bucket_cap_mb")

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs: `with ddp.join(): for batch in my_batches: ...` (native's API).

        A rank that runs out of batches keeps issuing the collectives of the
        others' iterations (zero gradients) until all have joined; then every
        rank takes the model of the last rank to join. Gradients are divided by
        the initial world size, or with divide_by_initial_world_size=False by
        the number of ranks still training. throw_on_early_termination=True
        makes every rank raise as soon as one runs out instead."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        if self.process_group is None:
            raise RuntimeError("join() notifies the ranks over c10d, and no c10d process group exists: call "
                               "portddp.init() (it creates one under mpirun too) before wrapping the model")
        return self.process_group

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """Native's private registration of its C++ hooks (older tutorials call it): the same
        arithmetic as PyTorch's Python hooks, divide then all-reduce (in float16 for FP16_COMPRESS),
        which is what is registered."""
        import torch.distributed as dist  # noqa: PLC0415
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:
            raise ValueError(f"_register_builtin_comm_hook takes a torch.distributed.BuiltinCommHookType "
                             f"(ALLREDUCE or FP16_COMPRESS), not {comm_hook_type!r}")
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])  # (native's: the reducer's group)

    def _register_fused_optim(self, optim, *args, optim_params=None, **kwargs) -> None:
        """Native's private "optimizer in backward": each bucket's parameters are stepped by `optim`'s
        functional form as soon as the bucket is reduced, inside the comm hook (the script then calls
        no optimizer.step()). PyTorch's own overlapped-optimizer wrapper does the registering, through
        this DDP's `register_comm_hook`, as for native."""
        from torch.distributed.algorithms._optimizer_overlap import _as_overlapped_optim  # noqa: PLC0415

        try:
            _as_overlapped_optim(optim, optim_params, *args, **kwargs).register_ddp(self)
        except NotImplementedError as e:  # (native's words)
            raise RuntimeError(f"{optim} does not support overlapped DDP. Please file an issue to PyTorch or the "
                               f"respective owner of {optim}.") from e

    def _set_static_graph(self) -> None:
        """Native's private switch for static_graph=True (some trainers call it after wrapping)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
        self.static_graph = True

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore) -> None:
        """Parameters and buffers (by name) DDP leaves alone; call before wrapping (native's API)."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    # -- join() and static_graph: what the forward and end of backward call
    def _through_sink(self, output):
        leaves, spec = torch.utils._pytree.tree_flatten(output)
        idx = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not idx:
            return output
        passed = _DDPSink.apply(weakref.ref(self), *[leaves[k] for k in idx])
        for k, t in zip(idx, passed):
            leaves[k] = t
        return torch.utils._pytree.tree_unflatten(leaves, spec)

    def _find_common_rank(self, candidate: bool) -> int:
        """The highest rank for which `candidate` holds (a collective; native's tie-break)."""
        votes = torch.zeros(self.world_size, dtype=torch.int32)
        votes[self.rank] = int(candidate)
        if self.world_size > 1:
            self._issue("join: vote for the source rank")
            with watchdog.waiting():
                votes = self._comm.allreduce(votes).wait()
        chosen = [r for r, v in enumerate(votes.tolist()) if v]
        if not chosen:
            raise RuntimeError("join(): no rank qualified as the source of the model (a portddp bug)")
        return chosen[-1]

    def _exchange_sync_flag(self, sync: bool):
        """join(): every rank says whether it synchronises this iteration (joined ranks: no); the sum
        is the number of ranks that contribute gradients."""
        flag = torch.tensor([int(sync)], dtype=torch.int32)
        if self.world_size > 1:
            self._issue("join: how many ranks synchronise")
        return self._comm.allreduce(flag) if self.world_size > 1 else _done(flag)

    # -- delay_all_reduce_named_params: reduced together after the buckets
    def _launch_delayed(self):
        """delay_all_reduce_named_params: one flat all-reduce of their (divided) gradients."""
        if not self._delayed:
            return None
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for _, p in self._delayed]).mul_(self._inv_world)
        self._issue("delayed parameters")
        return flat, self._comm.allreduce(flat)

    def _write_delayed(self, delayed) -> None:
        flat, fut = delayed
        fut.wait()
        offset = 0
        for _, p in self._delayed:
            reduced = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)

    # -- PyTorch modules, autograd and native's rules around the iteration
    def _apply(self, fn, recurse=True):
        """`.to()`, `.double()`, `.cuda()`, ... reach the module; the buckets follow at the next forward."""
        super()._apply(fn, recurse)
        if hasattr(self, "_plan"):
            # _apply replaces buffers (and parameters' data) without registering them again: look again.
            self._list_buffers_again()
            if [s for s in self._specs()] != list(self._plan.specs):
                self._replan()
        return self

    def _replan(self) -> None:
        """The parameters changed dtype, device or shape: the same plan (same order and caps) for the new
        ones; a resized parameter's slot in C order."""
        specs = self._specs()
        for i, (new, old) in enumerate(zip(specs, self._plan.specs)):
            if new.shape != old.shape:  # (the memory order agreed at construction was for the old shape)
                self._slot_strides[i] = None
        self.device = self._params[0].device
        self.device_type = self.device.type
        plan = self._initial_plan(specs)
        if self._observed_order is not None:
            plan = rebuild_plan(plan, self._observed_order, self.bucket_cap_mb, self.first_bucket_cap_mb)
        self._install_plan(plan)
        self._verify_pending = True  # every rank must have made the same change: checked at the next forward

    def _check_prior_reduction_finished(self) -> None:
        """A synchronised forward whose backward never started is dropped, as native DDP drops it
        (validation with autograd on, on every rank, is legal). If only some ranks skipped it, their
        step counts differ at the next reduction and every rank is told, naming each rank's step
        (portddp.protocol.check_same_step). A backward that started and never finished is native's
        error."""
        if not self._expect_grads:
            return
        self._expect_grads = False
        if not any(self._seen):
            return
        pending = [self._names[i] for i, seen in enumerate(self._seen) if not seen]
        if not pending:  # every gradient arrived, and the reduction never finished
            raise RuntimeError(
                f"Expected to have finished reduction in the prior iteration before starting a new one: rank "
                f"{self.rank}'s last backward produced every gradient, but its reduction did not finish -- an "
                "exception during that backward (in a comm hook, a gradient hook or autograd) that the script caught "
                "and went on after? The ranks' gradients then differ: a DDP cannot go on after a failed backward; let "
                "the exception end the job (or rebuild the model and the DDP on every rank)"
            )
        raise RuntimeError(
            f"Expected to have finished reduction in the prior iteration before starting a new one: rank "
            f"{self.rank}'s last backward ended before every parameter's gradient had arrived. Parameters still "
            f"waiting: {pending[:5]}{' ...' if len(pending) > 5 else ''}. Call backward() on every synchronised "
            "forward's output (once), run forwards you do not train on under torch.no_grad() or on ddp.module, "
            "or pass find_unused_parameters=True if some outputs are not used in the loss"
        )

    def _queue_finalize(self) -> None:
        if not self._finalize_queued:
            watchdog.step_started()  # this iteration's collectives begin
            # Runs once autograd has finished the graph of the pass it was queued from.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._finalize_queued = True

    @watchdog.noting_errors  # (what _finalize raises reaches the script through its backward())
    def _end_of_backward(self) -> None:
        """The callback `_queue_finalize` queued. A reentrant activation checkpoint
        (`checkpoint(..., use_reentrant=True)`) runs its part of the backward as a nested pass,
        and a gradient that arrives first inside one queues the callback there: it then runs
        when that nested pass ends, with the outer pass -- and the other layers' gradients --
        still to come (autograd is still evaluating the checkpoint's node). Then the iteration
        stays open and the next gradient queues the callback again, in the pass it arrives in;
        native's reducer, which queues its callback when the last bucket is ready, has no such
        case."""
        if torch._C._current_autograd_node() is not None and not all(self._seen):
            self._finalize_queued = False
            return
        if not any(self._seen) and not any(self._hook_counts):
            # No gradient of this DDP arrived in the pass that queued it: a pass through the outputs that
            # does not reach the parameters -- torch.autograd.grad(out.sum(), x, create_graph=True), a
            # gradient penalty's -- queued it from the output sink or pre-hook. The iteration stays open
            # for the backward that brings them (native's reducer, which queues its callback from a
            # parameter's hook, has no such case).
            self._finalize_queued = False
            return
        self._finalize()

    def _in_ddp_backward(self) -> bool:
        """Whether the running backward pass started from the output of a synchronised forward
        of this wrapper (whose grad_fn pre-hook recorded the pass: `_mark_backward_source`)."""
        return torch._C._current_graph_task_id() == self._ddp_backward_task

    def _mark_backward_source(self, output, synchronised: bool) -> None:
        """Note the forward that made `output` (a forward with autograd on) for the step count, and
        the autograd pass that reaches it (step_marker). A synchronised forward's pass also records
        itself (see _in_ddp_backward): a gradient that arrives outside an iteration in such a pass
        is a second backward through a synchronised forward's graph (an error), in any other pass
        one of a graph built without the wrapper (`ddp.module(x)`), which native ignores and leaves
        in .grad."""
        token = [None]
        self._forwards.append(token)
        hook = step_marker(token, self._record_backward if synchronised else None)
        for t in (output,) if isinstance(output, torch.Tensor) else torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(hook)

    def _first_order(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """backward(create_graph=True): native's behaviour -- the gradient's values are averaged,
        its graph (for higher-order gradients) stays local to each rank -- with native's warning."""
        if not self._warned_create_graph:
            warnings.warn(
                "backward(create_graph=True) through DistributedDataParallel: .grad holds the averaged "
                "gradient, but higher-order gradients taken through it are not synchronised across ranks "
                "(native DDP's behaviour; see https://github.com/pytorch/pytorch/issues/63929). Average them "
                "yourself (e.g. dist.all_reduce) if your method needs them", UserWarning, stacklevel=2)
            self._warned_create_graph = True
        return grad.detach()


def _done(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut
