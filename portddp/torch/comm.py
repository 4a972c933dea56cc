"""The two transports behind portddp.torch, one interface.

`allreduce(tensor)` sums in place across ranks and returns a
`torch.futures.Future` whose value is the tensor; it never blocks the caller.
`broadcast_(tensors)` and `allgather_object(obj)` are blocking and used only
outside the backward pass (construction, buffer sync, plan rebuild).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from portddp.launch import allgather_named
from portddp.transport import get_transport

__all__ = ["C10dComm", "MPIComm", "make_comm", "TRANSPORTS"]

TRANSPORTS = ("c10d", "mpi")


def _coalesced(tensors):
    """Group tensors by dtype and device, so each group travels as one flat buffer."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups.values()


class _Comm:
    rank: int
    size: int

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket buffer."""
        return torch.zeros(numel, dtype=dtype, device=device)

    def broadcast_(self, tensors, src: int = 0) -> None:
        """Overwrite `tensors` with rank `src`'s values (coalesced per dtype). As native's broadcast,
        it does not bump their autograd version counters (`.data`, not `.detach()`): a BatchNorm's
        running stats synchronised before a second forward in one iteration do not invalidate the
        graph of the first (`z1, z2 = ddp(v1), ddp(v2); loss.backward()`)."""
        for group in _coalesced([t.data for t in tensors]):
            flat = torch.cat([t.reshape(-1) for t in group])
            self._broadcast_flat(flat, src)
            if self.rank == src:
                continue  # the values are this rank's already
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class C10dComm(_Comm):
    """c10d process group (Gloo on CPU, NCCL on GPU): its own async work queue."""

    name = "c10d"

    def __init__(self, process_group=None):
        if not dist.is_initialized():  # (native's words and type, then what portddp offers besides)
            raise ValueError(
                "Default process group has not been initialized, please make sure to call init_process_group. "
                "(transport='c10d' needs a c10d process group: torch.distributed.init_process_group(...), or "
                "portddp.init(), which makes it under mpirun; or use transport='mpi' under mpirun)"
            )
        self.group = process_group
        self._pg = None  # the ProcessGroup object itself, looked up at the first bucket
        self._opts = dist.AllreduceOptions()  # reduceOp SUM
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def allreduce_timed(self, tensor: torch.Tensor, event) -> torch.futures.Future:
        """DDP's bucket all-reduce: the process group's own call (the cheapest launch c10d has, no
        `.then`: the future's value is [tensor]); `event.done_ns` is stamped when it completes."""
        if self._pg is None:
            self._pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        fut = self._pg.allreduce([tensor], self._opts).get_future()
        fut.add_done_callback(lambda _fut: setattr(event, "done_ns", time.perf_counter_ns()))
        return fut

    def _broadcast_flat(self, flat, src):
        dist.broadcast(flat, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)

    def allgather_object(self, obj) -> list:
        def gather(named):
            out = [None] * self.size
            dist.all_gather_object(out, named, group=self.group)
            return out

        return allgather_named(gather, obj, self.rank)


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing `t`'s memory (bfloat16 via ml_dtypes). A bucket buffer carries its
    own, made once (MPIComm.empty): making one costs tens of microseconds with the caches a
    layer's backward leaves, at every launch."""
    own = t.__dict__.get("_portddp_numpy")
    if own is not None and own[0] == t.data_ptr():  # (a copy of the tensor would carry the attribute too)
        return own[1]
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError(f"transport='mpi' works on CPU tensors; got one on {t.device}: use transport='c10d'")
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # noqa: PLC0415 -- ships with jax

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class MPIComm(_Comm):
    """mpi4py collectives run on portddp's comm thread (portddp.transport)."""

    name = "mpi"

    def __init__(self):
        self.transport = get_transport()
        self.rank = self.transport.rank
        self.size = self.transport.size

    def empty(self, size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor for bucket buffers: inside this host's shared-memory window
        when the transport's shared-memory all-reduce is on, so `allreduce` of it (or of a
        contiguous slice of it) reads and writes it in place, with no copies; else torch.empty."""
        shape = (size,) if isinstance(size, int) else tuple(size)
        if dtype == torch.bfloat16:
            tensor = torch.from_numpy(self.transport.empty(shape, np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(self.transport.empty(shape, torch.empty(0, dtype=dtype).numpy().dtype))
        tensor._portddp_numpy = tensor.data_ptr(), _numpy_view(tensor)  # (see _numpy_view)
        return tensor

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket buffer, in the shared-memory window when there is one (see `empty`)."""
        if device.type != "cpu":
            return super().zeros(numel, dtype, device)
        return self.empty(numel, dtype).zero_()

    def is_shared(self, tensor: torch.Tensor) -> bool:
        """Whether `allreduce(tensor)` takes the zero-copy path."""
        return self.transport.is_shared(_numpy_view(tensor))

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        if tensor.is_sparse:
            return self._allreduce_sparse(tensor)
        return self.allreduce_timed(tensor, None)

    def _allreduce_sparse(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Gloo's sparse all-reduce on MPI, with Gloo's arithmetic: every rank's coalesced indices and
        values gathered, their sparse tensors added in rank order and coalesced, the sum written into
        `tensor` (in place, as Gloo does)."""
        fut = torch.futures.Future()
        mine = tensor.coalesce()
        values = mine._values().contiguous()
        dtype, shape = values.dtype, tuple(values.shape)

        def add(everyone):  # on the comm thread
            total = None
            for indices, raw, rows in everyone:
                # (indices checked against the shape: a rank's part that is not this bucket's raises here
                # instead of writing past the parameter when it is applied)
                part = torch.sparse_coo_tensor(torch.from_numpy(indices), torch.from_numpy(raw).view(dtype).reshape(
                    rows), tensor.shape, check_invariants=True)
                total = part if total is None else total + part
            tensor.copy_(total.coalesce())
            return tensor

        def resolve(handle):  # on the comm thread
            if handle._error is not None:
                fut.set_exception(handle._error)
            else:
                fut.set_result(handle.result)

        self.transport.allgather_object_async((mine._indices().numpy(), values.view(-1).view(torch.uint8).numpy(),
                                               shape), then=add, on_done=resolve)
        return fut

    def allreduce_timed(self, tensor: torch.Tensor, event) -> torch.futures.Future:
        """DDP's bucket all-reduce, `event.done_ns` (if an event is given) stamped when the comm
        thread has finished it."""
        fut = torch.futures.Future()

        def resolve(handle):  # on the comm thread
            if event is not None:
                event.done_ns = handle.done_ns
            if handle._error is not None:
                fut.set_exception(handle._error)
            else:
                fut.set_result(tensor)

        self.transport.allreduce(_numpy_view(tensor), on_done=resolve)
        return fut

    def _broadcast_flat(self, flat, src):
        self.transport.broadcast(_numpy_view(flat), root=src).wait()

    def allgather_object(self, obj) -> list:
        return allgather_named(self.transport.allgather_object, obj, self.rank)


def check_transport(transport: str, process_group=None) -> None:
    """What makes a transport impossible in this process, said before any rank talks to another
    (`process_group`: resolved from native's arguments -- None for the default group)."""
    if transport != "mpi":
        return
    from portddp.launch import detect, refuse_mpi_outside_ranks  # noqa: PLC0415

    refuse_mpi_outside_ranks("transport='mpi'", "use transport='c10d' here (unset PORTDDP_TRANSPORT)")
    launcher = detect().launcher
    if launcher == "torchrun":
        raise ValueError("transport='mpi' needs MPI ranks, and this job was started by torchrun: launch with "
                         "`mpirun -n K python ...`, or use transport='c10d'")
    if launcher == "none" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # (an audit: the DDP tutorial's mp.spawn script with PORTDDP_TRANSPORT=mpi trained one model per rank,
        # each its own MPI world of one, nothing averaged, exit 0)
        from portddp.launch import mpi_comm  # noqa: PLC0415 -- (the transport would start MPI anyway)

        if (mpi_size := mpi_comm().Get_size()) != dist.get_world_size():
            raise ValueError(f"transport='mpi' needs MPI ranks, and this process is rank {dist.get_rank()} of a c10d "
                             f"group of {dist.get_world_size()} made without mpirun (torch.multiprocessing.spawn, or "
                             f"init_process_group(rank=..., world_size=...)): MPI sees a world of {mpi_size} here, and "
                             "the ranks would not average together. Launch with `mpirun -n K python ...` (one process "
                             "per rank, no spawn), or use transport='c10d' (unset PORTDDP_TRANSPORT)")
    if process_group is not None:
        raise ValueError("process_group applies to transport='c10d' only; transport='mpi' uses COMM_WORLD"
                         + ("" if os.environ.get("PORTDDP_TRANSPORT") != "mpi" else
                            " (PORTDDP_TRANSPORT=mpi is set: unset it for a script that reduces over a subgroup)"))


def make_comm(transport: str, process_group=None) -> _Comm:
    check_transport(transport, process_group)
    if transport == "c10d":
        return C10dComm(process_group)
    if transport == "mpi":
        return MPIComm()
    raise ValueError(f"unknown transport {transport!r}: choose one of {TRANSPORTS}")
