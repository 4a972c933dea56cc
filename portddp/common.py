"""What the two DistributedDataParallel classes do in exactly the same way, in one place.

portddp/torch/ddp.py and portddp/jax/ddp.py mirror each other method by method;
where a method would be the same text in both -- it touches only the bucket
plan, the cap and the rank's bookkeeping, never a tensor or an array -- it
lives here, and both classes inherit it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

import numpy as np

from portddp import watchdog
from portddp.buckets import BucketPlan, rebuild_plan
from portddp.protocol import check_rebuild_order, check_same_hook, ddp_number, step_slot

__all__ = ["DDPCommon", "GradBucketCommon", "hook_name", "hook_settings", "next_ddp_number"]

_BUILT = itertools.count(1)  # the world-wide DistributedDataParallels this process built, both frameworks
_BUILT_ON: dict[tuple[int, ...], itertools.count] = {}  # those on each process group (by its global ranks)


def next_ddp_number(group: tuple[int, ...] | None = None) -> int:
    """The number (protocol.ddp_number) of the DDP built now, in its step slots: ranks that reduce
    different DDPs at one collective are named (see protocol.check_same_step). World-wide DDPs are
    counted together; those on a process group (`group`: its members' global ranks) per group, so
    that its members, which build its DDPs in one order, number them alike."""
    counter = _BUILT if group is None else _BUILT_ON.setdefault(group, itertools.count(1))
    return ddp_number(next(counter))


def hook_name(hook) -> str:
    """A comm hook's name, the same in every process (no memory addresses): a function's qualified
    name, a functools.partial's function's, a callable object's class's."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None)
    return name if isinstance(name, str) else type(hook).__qualname__


_POWERSGD_SETTINGS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                      "use_error_feedback", "warm_start", "orthogonalization_epsilon", "batch_tensors_with_same_shape")


def hook_settings(state) -> dict[str, str]:
    """What of a comm hook's state every rank must share ({} if nothing known): PowerSGD's settings
    (PyTorch's PowerSGDState and portddp.jax's) and where its random generator stands -- ranks that
    differ there compress with other matrices of other shapes (a Gloo abort, a hang, or silently
    wrong sums). Other states may legitimately differ across ranks (a rank's own number)."""
    if not hasattr(state, "matrix_approximation_rank"):
        return {}
    settings = {k: repr(getattr(state, k)) for k in _POWERSGD_SETTINGS if hasattr(state, k)}
    rng = getattr(state, "rng", None)
    if isinstance(rng, np.random.RandomState):
        _, key, pos, *_ = rng.get_state()
        settings["rng (random_seed, draws so far)"] = f"{hashlib.sha256(key.tobytes()).hexdigest()[:8]}@{pos}"
    return settings


class GradBucketCommon:
    """What a comm hook sees of one bucket in either framework: its index, its flat buffer, whether
    it is the iteration's last, the world size, and `allreduce` on the DDP's transport. Each
    framework's GradBucket adds the views of the buffer per parameter and the parameters."""

    def __init__(self, index: int, buffer, num_buckets: int, comm):
        self._index = index
        self._buffer = buffer
        self._is_last = index == num_buckets - 1
        self._comm = comm
        self.world_size = comm.size

    def index(self) -> int:
        return self._index

    def buffer(self):
        return self._buffer

    def is_last(self) -> bool:
        return self._is_last

    def allreduce(self, buffer):
        """Sum `buffer` in place over all ranks on this DDP's transport; returns at once (a future
        in PyTorch, a Handle in JAX)."""
        return self._comm.allreduce(buffer)


class DDPCommon:
    """Shared by portddp.torch's and portddp.jax's DistributedDataParallel."""

    def _step_slot(self) -> int:
        """This rank's entry in the step exchange of a reduction: its step count and this DDP's
        number (protocol.step_slot)."""
        return step_slot(self._step_count, self._ddp_number)

    def _rebuild(self) -> None:
        """Re-plan once from the order gradients really arrived in (rank 0's, broadcast): portddp.torch
        at the forward after its first synchronised iteration, portddp.jax at the call after it."""
        order = np.full(len(self._plan.specs), -1, np.int64)
        if self._rebuild_order is not None:
            order[: len(self._rebuild_order)] = self._rebuild_order
        else:  # (a joined rank that never trained: rank 0's counts only if it is rank 0)
            order[:] = np.arange(len(order))
        if self.world_size > 1:
            self._issue("plan rebuild (rank 0's gradient order)")
            with watchdog.waiting():
                self._broadcast_from_first(order)
        self._observed_order = check_rebuild_order(order.tolist(), len(order), self.rank)
        self._install_plan(rebuild_plan(self._plan, self._observed_order, self.bucket_cap_mb,
                                        self.first_bucket_cap_mb))
        self._rebuild_order = None
        self._rebuilt = True

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
        self._rebuilt = True

    def _issue(self, what: str) -> None:
        """Name the collective this rank issues next, for the stall inspector (portddp.watchdog)."""
        left = self.__dict__.get("_left_uneven")  # (portddp.jax: a ddp.uneven() loop this rank left early)
        note = f" (this rank left a ddp.uneven() loop early, after its step {left}: a break?)" if left else ""
        watchdog.collective(f"iteration {self._iterations + 1}: {what}{note}")

    def _tuned_cap(self, now: int) -> float:
        """bucket_cap_mb="auto": the cap the tuner gives this synchronised iteration; once its trials
        are over, the winner every rank agrees on (a collective, on every rank)."""
        cap = self._tuner.start_iteration(now)
        if cap is None:
            self._issue("bucket_cap_mb='auto' decision")
            with watchdog.waiting():
                cap = self._tuner.decide(self._comm.allgather_object, self.rank)
        return cap

    def _agree_on_hook(self) -> None:
        """Once, before the first bucket is reduced: the same comm hook (or none) on every rank."""
        mine = None if self._hook is None else (hook_name(self._hook), hook_settings(self._hook_state))
        if self.world_size > 1:
            self._issue("comm hook check")
            with watchdog.waiting():
                check_same_hook(self._comm.allgather_object(mine), self.rank)
        self._hooks_agreed = True
