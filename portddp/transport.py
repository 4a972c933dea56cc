"""MPI transport: collectives on numpy buffers, run by a dedicated comm thread.

A launch (`allreduce`, `broadcast`, ...) only puts the job on a queue and
returns a `Handle`; the comm thread runs the collective (releasing the GIL
while it waits), so the thread that launched it -- the autograd engine in
PyTorch, an XLA callback in JAX -- is never blocked by communication. Within a
host `allreduce` runs on shared memory (portddp.shm; hierarchical across hosts;
`empty()` hands out buffers it reduces without copying); the MPI collectives
are nonblocking ones tested with sleeps in between, so a late peer costs a few
percent of a core, not all of it (PORTDDP_MPI_WAIT, README: Performance). The queue
is FIFO, which is what keeps every rank issuing collectives in the same order:
buckets are launched in plan order, so they are reduced in plan order.

Used by `portddp.torch` (`transport="mpi"`) and by `portddp.jax`. Buffers are
reduced in place, so callers pass views of their flat bucket buffers.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np

from portddp import env
from portddp.launch import allgather_pickled, test_then_sleep
from portddp.shm import arena_mb, half_add, is_half, scatter_into, scratch_mb

__all__ = ["Handle", "MPITransport", "get_transport"]

_half_ops: dict = {}


def _half_sum_op(np_dtype):
    """An MPI sum for 16-bit floats, which MPI has no standard type for.

    The buffers travel as uint16; each pairwise reduction is computed in
    float32 and rounded back, as Gloo and NCCL do for half types."""
    from mpi4py import MPI  # noqa: PLC0415

    key = np.dtype(np_dtype).name
    if key not in _half_ops:

        def add(inbuf, inoutbuf, datatype):
            b = np.frombuffer(inoutbuf, dtype=np_dtype)
            half_add(np.frombuffer(inbuf, dtype=np_dtype), b, b)

        _half_ops[key] = MPI.Op.Create(add, commute=True)
    return _half_ops[key]


_AGREED = {  # environment settings the ranks must share (their collectives depend on them), with defaults:
    # every rank of the job the first two (which collectives, blocking or not), the scratch size where
    # the shared-memory all-reduce runs (it chunks by it, across hosts too), the arena within a host
    # (each rank maps its peers' segments whole)
    "PORTDDP_MPI_ALLREDUCE": "shm", "PORTDDP_MPI_WAIT": "", "PORTDDP_SHM_SCRATCH_MB": "16",
    "PORTDDP_SHM_ARENA_MB": "4096"}
_SHM_ONLY = ("PORTDDP_SHM_SCRATCH_MB", "PORTDDP_SHM_ARENA_MB")


def _settings() -> dict:
    """This rank's values of _AGREED, each checked (the MB ones as numbers, so that 16 and 16.0 agree)."""
    return {"PORTDDP_MPI_ALLREDUCE": env.choice("PORTDDP_MPI_ALLREDUCE", "shm", ("shm", "mpi")),
            "PORTDDP_MPI_WAIT": env.choice("PORTDDP_MPI_WAIT", "", ("spin", "sleep")),
            "PORTDDP_SHM_SCRATCH_MB": scratch_mb(), "PORTDDP_SHM_ARENA_MB": arena_mb()}


def _check_settings(every: list[dict], rank: int, names, ranks=None) -> None:
    """Refuse, on every rank alike, settings `names` that differ between the ranks (`every` holds
    each rank's, in rank order; `ranks`: their ranks, if not 0..n-1), naming each rank's value."""
    ranks = list(range(len(every))) if ranks is None else ranks
    for name in names:
        values = [s.get(name) for s in every]
        if len(set(map(repr, values))) > 1:
            each = ", ".join(f"rank {r}: {v:g}" if isinstance(v, float) else f"rank {r}: {v!r}"
                             for r, v in zip(ranks, values))
            default = _AGREED[name] or "unset"
            raise ValueError(f"{name} differs between the ranks ({each}; this is rank {rank}): set it alike on "
                             f"every rank, or on none (default {default})")


def _check_contiguous(buf: np.ndarray) -> None:
    if not buf.flags.c_contiguous:
        raise ValueError("MPI transport buffers must be C-contiguous (a view of a flat bucket)")


class Handle:
    """A launched collective, the JAX side's `torch.futures.Future`: `wait()` blocks until it is
    done and re-raises its error; `then(fn)` chains work on the result, as a future's does."""

    __slots__ = ("_done", "_latch", "_error", "launch_ns", "start_ns", "done_ns", "result", "_on_done", "_lock",
                 "_next")

    def __init__(self, on_done: Callable[["Handle"], None] | None = None):
        # Done: a flag, and a lock held until then that waiters pass through (lighter to make
        # than a threading.Event, which is Python code: a handle is made at every launch).
        self._done = False
        self._latch = threading.Lock()
        self._latch.acquire()
        self._error: BaseException | None = None
        self._on_done = on_done
        self._lock = threading.Lock()
        self._next: list[Callable[[], None]] = []
        self.launch_ns = time.perf_counter_ns()  # queued
        self.start_ns = 0  # the comm thread picked it up
        self.done_ns = 0
        self.result = None

    @classmethod
    def completed(cls, result=None) -> "Handle":
        """A handle that is done already (a hook that communicates nothing)."""
        handle = cls()
        handle.result, handle.done_ns = result, handle.launch_ns
        handle._finish()
        return handle

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None):
        if not self._done:
            if not self._latch.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                raise TimeoutError(f"MPI collective not finished after {timeout} s")
            self._latch.release()  # (for any other waiter)
        if self._error is not None:
            raise self._error
        return self.result

    def then(self, fn: Callable[["Handle"], object]) -> "Handle":
        """A handle for `fn(self)`, run once this one is done (on the comm thread, or here if it is
        done already); its result is what `fn` returns, its error what `fn` or this handle raised."""
        child = Handle()
        child.launch_ns = self.launch_ns

        def run():
            child.start_ns = self.start_ns
            try:
                if self._error is not None:
                    raise self._error
                child.result = fn(self)
            except BaseException as e:
                child._error = e
            child.done_ns = time.perf_counter_ns()
            child._finish()

        with self._lock:
            if not self._done:
                self._next.append(run)
                return child
        run()
        return child

    def _finish(self) -> None:
        """Run `on_done` (before the event: a waiter must see what it writes), mark done, then
        whatever `then()` chained."""
        if self._on_done is not None:
            try:
                self._on_done(self)
            except BaseException as e:
                self._error = self._error or e
        with self._lock:
            self._done = True
            chained, self._next = self._next, []
        self._latch.release()
        for run in chained:
            run()


class MPITransport:
    """Collectives over a private duplicate of COMM_WORLD, run by one comm thread."""

    def __init__(self, comm=None):
        from portddp.launch import mpi_comm  # noqa: PLC0415 -- initialises MPI with portddp's settings

        world = mpi_comm()
        from mpi4py import MPI  # noqa: PLC0415

        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "MPI was initialised without thread support, but the MPI transport runs its "
                "collectives on a comm thread: do not set mpi4py.rc.threads = False"
            )
        self._MPI = MPI
        # A private communicator: our collectives can never pair with a user's.
        self.comm = (comm or world).Dup()
        self.rank = self.comm.rank
        self.size = self.comm.size
        # The ranks on this host (MPI's shared-memory split, refined by hostname: portddp.shm).
        from portddp.shm import ShmAllreduce, node_comm  # noqa: PLC0415

        self.node = node_comm(self.comm)
        self.local_rank, self.local_size = self.node.rank, self.node.size
        self.multi_host = self.local_size < self.size
        self._max_pause = env.number("PORTDDP_MPI_POLL_US", 1000, unit="microseconds") * 1e-6
        # The all-reduce (PORTDDP_MPI_ALLREDUCE=shm|mpi): within a host on a shared-memory window
        # (portddp.shm; hierarchical across hosts), or MPI's own.
        settings = _settings()  # (a bad value is refused here, before any collective)
        self.allreduce_impl = settings["PORTDDP_MPI_ALLREDUCE"]
        self._shm = None
        self._warned_full = False
        facts = self.comm.allgather((self.local_size, settings))
        # (before the shared-memory set-up's own collectives, which differing settings would mismatch)
        _check_settings([f[1] for f in facts], self.rank, [n for n in _AGREED if n not in _SHM_ONLY])
        sizes = {f[0] for f in facts}
        if self.allreduce_impl == "shm" and self.local_size > 1 and len(sizes) == 1:
            _check_settings([f[1] for f in facts], self.rank, ["PORTDDP_SHM_SCRATCH_MB"])
            mine = self.node.allgather((self.rank, settings))
            _check_settings([m[1] for m in mine], self.rank, ["PORTDDP_SHM_ARENA_MB"], [m[0] for m in mine])
            self._shm = ShmAllreduce(self.comm, self.node, wait=self._complete, half_op=_half_sum_op)
        else:
            self.allreduce_impl = "mpi"
        # How to wait for MPI (PORTDDP_MPI_WAIT=spin|sleep). MPICH's blocking collectives poll a full
        # core while a peer is late (~0.85-1.0 CPU s per s); a nonblocking one tested with sleeps in
        # between costs ~0.04, but it progresses only when tested: on one host MPI's 32 MB all-reduce
        # takes 2.4x as long that way, so MPI's own all-reduce on one host (PORTDDP_MPI_ALLREDUCE=mpi)
        # keeps the blocking call. Across hosts the nonblocking ring (MPIR_CVAR_IALLREDUCE_INTRA_
        # ALGORITHM, set by portddp.launch) is also the faster one. README, Performance.
        default_wait = "spin" if self._shm is None and not self.multi_host else "sleep"
        self._spin = (settings["PORTDDP_MPI_WAIT"] or default_wait) == "spin"
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="portddp-mpi-comm", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- the comm thread ------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, handle = item
            handle.start_ns = time.perf_counter_ns()
            try:
                handle.result = job()
            except BaseException as e:  # handed to whoever waits
                handle._error = e
            handle.done_ns = time.perf_counter_ns()
            handle._finish()
            # (Drop the job now: kept until the next one arrives, its closure's tensors would be freed on
            # this thread at an arbitrary later moment, in the middle of the next job's work.)
            del item, job, handle

    def _submit(self, job, on_done=None) -> Handle:
        if self._thread is None:
            raise RuntimeError("this MPITransport is closed")
        handle = Handle(on_done)
        self._queue.put((job, handle))
        return handle

    # -- collectives ------------------------------------------------------------
    def _typed(self, buf: np.ndarray):
        _check_contiguous(buf)
        if is_half(buf.dtype):
            return [buf.view(np.uint16), self._MPI.UINT16_T], _half_sum_op(buf.dtype)
        return buf, self._MPI.SUM

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised buffer for `allreduce`: inside this host's shared-memory window when the
        shared-memory all-reduce is on (then `allreduce` reads and writes it where it lies: no
        copies), else ordinary memory. Any thread, not collective; freed with its last view."""
        if self._shm is not None:
            buf = self._shm.empty(shape, dtype)
            if buf is not None:
                return buf
            if not self._warned_full:  # once per process: the job still trains, with copies
                self._warned_full = True
                warnings.warn(
                    f"portddp: the shared-memory window has no room for a {np.dtype(dtype).name} buffer of shape "
                    f"{tuple(int(d) for d in np.atleast_1d(shape))} (PORTDDP_SHM_ARENA_MB={self._shm.arena_bytes >> 20} MB per rank, "
                    f"or /dev/shm is full): its all-reduces copy it through the scratch area instead of reducing it "
                    "where it lies. Set PORTDDP_SHM_ARENA_MB higher, alike on every rank (address space: pages are "
                    "used only as buffers are handed out), or free the DistributedDataParallel objects you no "
                    "longer use", RuntimeWarning, stacklevel=2)
        return np.empty(shape, dtype)

    def is_shared(self, buf: np.ndarray) -> bool:
        """Whether `allreduce(buf)` takes the zero-copy path (buf lies in the shared window)."""
        return self._shm is not None and self._shm.offset_of(buf) is not None

    def allreduce(self, buf: np.ndarray, on_done=None, defer_gather: bool = False) -> Handle:
        """Sum `buf` over all ranks, in place. Returns at once.

        `defer_gather`: the caller will copy the sum out with `gather(buf, dests)` (and reads it
        nowhere else): on the shared-memory path `buf` then holds only this rank's slice, and the
        other slices go from their owners' memory straight into `dests` -- one copy fewer. The
        caller issues no further collective that would let a peer reuse its buffer before that
        (portddp/shm.py)."""
        shm = self._shm
        if shm is not None:  # (the shared-memory sum needs no MPI datatype)
            _check_contiguous(buf)
            return self._submit(lambda: shm.allreduce(buf, defer_gather=defer_gather), on_done)
        spec, op = self._typed(buf)
        MPI = self._MPI

        def job():
            if self._spin:
                self.comm.Allreduce(MPI.IN_PLACE, spec, op=op)
            else:
                self._wait(self.comm.Iallreduce(MPI.IN_PLACE, spec, op=op))
            return buf

        return self._submit(job, on_done)

    @property
    def defers_gather(self) -> bool:
        """Whether `allreduce(..., defer_gather=True)` saves anything: only the shared-memory path
        defers (elsewhere `gather` is a copy out of the reduced buffer)."""
        return self._shm is not None

    def discard(self, buf: np.ndarray) -> None:
        """Forget the deferred gather of `buf` (its iteration failed before gathering)."""
        if self._shm is not None:
            self._shm.discard(buf)

    def gather(self, buf: np.ndarray, dests: list[tuple[int, np.ndarray]]) -> None:
        """Copy the sum of a finished `allreduce(buf, ...)` into `dests`, (offset into buf's
        elements, flat array) pairs sorted by offset. On the calling thread; no communication."""
        if self._shm is not None:
            self._shm.gather(buf, dests)
        else:
            scatter_into(dests, 0, buf.reshape(-1))

    def _complete(self, request) -> None:
        """Wait for a nonblocking request the configured way (PORTDDP_MPI_WAIT)."""
        if self._spin:
            request.Wait()
        else:
            self._wait(request)

    def _wait(self, request) -> None:
        """Wait for a nonblocking collective without spinning: test it (which also drives MPI's
        progress), and sleep between tests, 20 us at first, doubling up to PORTDDP_MPI_POLL_US.
        A blocking MPICH collective polls a full core while it waits; on cores that also compute
        (or with more ranks than cores) that is taken from the backward pass it should overlap."""
        test_then_sleep(request, self._max_pause)

    def broadcast(self, buf: np.ndarray, root: int = 0, on_done=None) -> Handle:
        """Overwrite `buf` with rank `root`'s values, in place. Returns at once."""
        spec, _ = self._typed(buf)

        def job():
            if self._spin:
                self.comm.Bcast(spec, root=root)
            else:
                self._wait(self.comm.Ibcast(spec, root=root))
            return buf

        return self._submit(job, on_done)

    def allgather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order (blocking; small objects only), waited for the configured
        way (PORTDDP_MPI_WAIT; launch.allgather_pickled: not mpi4py's blocking allgather, which polls
        a core while a peer is late)."""
        return self.allgather_object_async(obj).wait()

    def allgather_object_async(self, obj, then: Callable[[list], object] | None = None, on_done=None) -> Handle:
        """`allgather_object` in the queue's order, returning at once: the Handle's result is the list,
        or what `then(list)` returns (run on the comm thread)."""
        def job():
            everyone = self.comm.allgather(obj) if self._spin else allgather_pickled(self.comm, obj, self._wait)
            return everyone if then is None else then(everyone)

        return self._submit(job, on_done)

    def barrier(self) -> None:
        self._submit(lambda: self.comm.Barrier() if self._spin else self._wait(self.comm.Ibarrier())).wait()

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout=5)


_DEFAULT: MPITransport | None = None


def get_transport() -> MPITransport:
    """The process-wide MPI transport (one comm thread shared by every DDP wrapper)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MPITransport()
    return _DEFAULT
