"""Who portddp.jax talks to, one interface: the twin of portddp/torch/comm.py.

`allreduce(buf)` sums a numpy buffer in place across ranks and returns a
`portddp.transport.Handle` at once (the JAX side's future). `broadcast_(arrays)`
and `allgather_object(obj)` block and are used outside the backward pass
(construction, buffer sync, plan rebuild, agreements).

`gather(buf, dests)` copies a finished sum where it is wanted (XLA's result buffers); after
`allreduce(buf, defer_gather=True)` on the shared-memory path, straight from the memory of the
rank that reduced each slice (portddp/shm.py). The torch twin has no such pair: a PyTorch
gradient is read where the all-reduce leaves it (the bucket, or `.grad` as a view of it), while
a JAX gradient has to end in a buffer XLA owns.

strategy="hooked" and "compiled" run one rank per MPI process (MPIComm: the
hooked gradients travel here; the compiled ones inside XLA, so there the comm
only carries the construction checks and agreements). strategy="pmap" runs
every rank as a device of this one process (LocalComm): nothing to exchange.
"""

from __future__ import annotations

import numpy as np

from portddp import launch
from portddp.shm import scatter_into
from portddp.transport import Handle, get_transport

__all__ = ["LocalComm", "MPIComm", "TRANSPORTS", "make_comm"]

TRANSPORTS = ("mpi",)


class MPIComm:
    """mpi4py collectives run on portddp's comm thread (portddp.transport)."""

    name = "mpi"

    def __init__(self):
        self.transport = get_transport()
        self.rank = self.transport.rank
        self.size = self.transport.size
        launched = launch.world()
        if launched.size != self.size:
            raise RuntimeError(
                f"portddp.jax talks over MPI, whose world here has {self.size} rank(s), but the launcher "
                f"({launched.launcher}) started {launched.size}: launch with `mpirun -n {launched.size} python "
                "...` (or use strategy='pmap' within one process)")

    def zeros(self, numel: int, dtype) -> np.ndarray:
        """A zeroed bucket buffer, inside the transport's shared-memory window when it has one (then
        the all-reduce reads and writes it where it lies, no copies)."""
        buf = self.transport.empty((numel,), dtype)
        buf.fill(0)
        return buf

    def allreduce(self, buf: np.ndarray, defer_gather: bool = False) -> Handle:
        return self.transport.allreduce(buf, defer_gather=defer_gather)

    @property
    def defers_gather(self) -> bool:
        return self.transport.defers_gather

    def gather(self, buf: np.ndarray, dests: list[tuple[int, np.ndarray]]) -> None:
        """The sum of a finished allreduce(buf, defer_gather=True) into `dests` (portddp.transport)."""
        self.transport.gather(buf, dests)

    def discard(self, buf: np.ndarray) -> None:
        self.transport.discard(buf)

    def broadcast_(self, arrays: list[np.ndarray], src: int = 0) -> None:
        """Overwrite `arrays` (C-contiguous numpy) with rank `src`'s values in one Bcast: typed for
        one array of a builtin numeric dtype (a bucket, as portddp.torch sends it), else as bytes."""
        if self.size == 1 or not arrays:
            return
        if len(arrays) == 1 and (arrays[0].dtype.kind in "fiu" or arrays[0].dtype.name == "bfloat16"):
            self.transport.broadcast(arrays[0], root=src).wait()
            return
        flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
        self.transport.broadcast(flat, root=src).wait()
        offset = 0
        for a in arrays:
            a.reshape(-1).view(np.uint8)[...] = flat[offset:offset + a.nbytes]
            offset += a.nbytes

    def allgather_object(self, obj) -> list:
        return launch.allgather_named(self.transport.allgather_object, obj, self.rank)


class LocalComm:
    """strategy='pmap': the ranks are this process's devices, which share its host values -- rank
    0's already, and the same on every rank; XLA (jax.pmap) reduces the gradients."""

    name = "local"
    rank = 0

    def __init__(self, size: int):
        self.size = size

    def zeros(self, numel: int, dtype) -> np.ndarray:
        return np.zeros(numel, dtype)

    def allreduce(self, buf: np.ndarray, defer_gather: bool = False) -> Handle:
        """Every rank holds this process's `buf`: their sum is size x it."""
        np.multiply(buf, self.size, out=buf, casting="unsafe")
        return Handle.completed(buf)

    defers_gather = False

    def gather(self, buf: np.ndarray, dests: list[tuple[int, np.ndarray]]) -> None:
        scatter_into(dests, 0, buf.reshape(-1))

    def discard(self, buf: np.ndarray) -> None:
        pass

    def broadcast_(self, arrays: list[np.ndarray], src: int = 0) -> None:
        pass  # one process: its values are rank 0's

    def allgather_object(self, obj) -> list:
        return [obj]  # one process speaks for all its ranks


def check_strategy(strategy: str) -> None:
    """What makes a strategy impossible in this process, said before any rank talks to another
    (portddp.torch's check_transport)."""
    if strategy != "pmap":
        from portddp.launch import refuse_mpi_outside_ranks  # noqa: PLC0415

        refuse_mpi_outside_ranks(f"strategy={strategy!r} (its collectives go over MPI)",
                                 "build the DistributedDataParallel in the rank itself")


def make_comm(strategy: str, pmap_devices: int | None = None):
    if strategy == "pmap":
        from portddp.jax.compiled import pmap_world  # noqa: PLC0415

        return LocalComm(pmap_world(pmap_devices))
    return MPIComm()
