"""All-reduce within a host on MPI-3 shared memory, hierarchical across hosts.

The ranks of one host (MPI's `COMM_TYPE_SHARED` split, refined by hostname) map each other's
shared-memory segment: one /dev/shm file per rank, mapped by all, unlinked at once. (Not
`MPI_Win_allocate_shared`: under MPICH's OFI netmod, the emulated cluster's, a window still alive
at MPI_Finalize aborts the job -- "fabricclose failed: Device or resource busy" -- and freeing it is
collective, so a rank leaving on an error would hang in the free while its peers wait for it.)
Each rank's segment holds a small header (a sequence counter and a descriptor of the data
it offers), a scratch area and an arena that `empty()` allocates buffers from. One all-reduce
goes in rounds -- one for a buffer every rank holds in its arena; a scratch-full at a time when
some rank's data must be copied into scratch, or across hosts --, each round:

1. every rank publishes where its data is (an offset into its own segment: a buffer from the
   arena is used where it lies -- zero copy --, any other buffer is first copied into scratch)
   and bumps its counter;
2. once every peer's counter has moved, local rank r sums slice r (1/L of the elements) straight
   from every peer's memory, in local-rank order, and writes the sum into slice r of its own data
   and of every peer's (across hosts it first all-reduces the slice with the ranks of the same
   local rank on the other hosts, over MPI). It sums a cache-sized chunk at a time, so the copies
   to the peers read what is still in cache: per rank, each element of its slice is read once per
   rank and written once per rank -- the least any all-reduce that leaves the sum in every rank's
   own memory can do;
3. counters again: every rank's data holds the whole sum, and no rank reads a peer's memory
   any more, so each may reuse its buffer at once (a rank that copied into scratch copies the
   sum out of it).

`allreduce(buf, defer_gather=True)` (a buffer from the arena) asks the peers not to write the
sum into this rank's buffer: it then holds only its own slice until `gather(buf, dests)` copies
every slice, straight from its owner's segment, into `dests` -- portddp.jax writes the reduced
gradients into XLA's result buffers that way, one copy fewer. (When some rank's data lies in its
scratch, not its arena, every rank receives the whole sum: that rank's next all-reduce
overwrites its scratch.) Until the gather we read the owners' buffers: the caller must not let
any peer reuse its buffer in between (portddp.jax gathers before the iteration's used-count
all-reduce, which every rank finishes before it writes a bucket again).

Nothing spins: a rank whose peer is not there yet sleeps in the kernel (a futex on the peer's
counter, woken by the peer's store; a sleeping poll where futexes are unavailable).

Summation order: at L = 2 the result is a0 + a1, bitwise what MPI's all-reduce gives (a sum of
two is commutative, also for the half types, which are summed as MPI's op in portddp.transport
does: float32, rounded once). At L > 2 each element is ((a0 + a1) + a2) + ..., in local-rank
order, the same on every rank and every run; MPI's own order at L > 2 depends on its algorithm.
Across hosts: the host sums (in local-rank order), then MPI's sum of those over the hosts.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import platform
import socket
import sys
import threading
import time
import weakref

import numpy as np

from portddp import env

__all__ = ["ShmAllreduce", "half_add", "is_half", "loaded_torch", "node_comm", "scatter_into", "torch_half",
           "torch_serially", "TORCH_SERIAL"]

_ALIGN = 64  # bytes: slices and allocations start on a cache line
_HEADER = 4096  # per-rank header: counter (int32, the futex word) + descriptor
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "int16", "uint16",
           "uint32", "uint64", "complex64", "complex128")

_CODES: dict = {}


def _code(dtype: np.dtype) -> int:
    """The index of `dtype` in _DTYPES, -1 if absent (cached: numpy computes `dtype.name` in Python)."""
    code = _CODES.get(dtype)
    if code is None:
        code = _CODES[dtype] = _DTYPES.index(dtype.name) if dtype.name in _DTYPES else -1
    return code


_HALF_CODES = (_DTYPES.index("float16"), _DTYPES.index("bfloat16"))


def is_half(dtype: np.dtype) -> bool:
    """float16 or bfloat16 (cached per dtype, as `_code`)."""
    return _code(dtype) in _HALF_CODES


# -- waiting without spinning ---------------------------------------------------------------------
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_futex = None
if _SYS_FUTEX is not None and env.flag("PORTDDP_SHM_FUTEX", True):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL while it sleeps
        _futex = _libc.syscall
        _futex.restype = ctypes.c_long
        _futex.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_int]
    except (OSError, AttributeError):
        _futex = None
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word lives in memory other processes map
_WAIT_SLICE = _Timespec(0, 20_000_000)  # re-check every 20 ms even without a wake-up


def node_comm(comm):
    """The ranks of `comm` that share this host's memory: MPI's shared-memory split, further split
    by hostname (the emulated cluster's hosts are network namespaces of one machine; MPI may see
    them as one node, but the point of the emulation is that hosts do not share memory)."""
    from mpi4py import MPI  # noqa: PLC0415

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    names = shared.allgather(socket.gethostname())
    if len(set(names)) == 1:
        return shared
    color = sorted(set(names)).index(socket.gethostname())
    node = shared.Split(color, key=comm.rank)
    shared.Free()
    return node


class ShmAllreduce:
    """Shared-memory all-reduce among the ranks of `comm` on this host; hierarchical when `comm`
    spans several hosts (all with the same number of ranks). Collective to construct. Its
    `allreduce` must be called by every rank of `comm` in the same order (portddp's comm thread
    does), `empty` by anyone, at any time."""

    def __init__(self, comm, node=None, scratch_bytes: int | None = None, arena_bytes: int | None = None,
                 wait=None, half_op=None):
        from mpi4py import MPI  # noqa: PLC0415

        self._MPI = MPI
        self.comm = comm
        self.node = node if node is not None else node_comm(comm)
        self.local_rank, self.local_size = self.node.rank, self.node.size
        sizes = comm.allgather(self.local_size)
        self.hosts = comm.size // self.local_size
        if len(set(sizes)) != 1:
            raise ValueError(f"hosts have different numbers of ranks ({sorted(set(sizes))}): the hierarchical "
                             "all-reduce needs the same number on every host")
        # the ranks with my local rank on the other hosts (MPI all-reduces each host's slice among them)
        self.cross = comm.Split(self.local_rank, key=comm.rank) if self.hosts > 1 else None
        self._wait_request = wait or (lambda req: req.Wait())
        self._half_op = half_op
        mb = 1 << 20
        self.scratch_bytes = _round(int(scratch_bytes or scratch_mb() * mb))
        self.arena_bytes = _round(int((arena_mb() if arena_bytes is None else arena_bytes / mb) * mb))
        # every rank must chunk alike (across hosts too), and map its host peers' segments whole
        scratch = comm.allgather(self.scratch_bytes)
        arenas = self.node.allgather(self.arena_bytes)
        if len(set(scratch)) != 1 or len(set(arenas)) != 1:
            raise ValueError(f"the shared-memory sizes differ between the ranks (scratch, every rank: "
                             f"{[s / mb for s in scratch]} MB; arena, this host's ranks: {[a / mb for a in arenas]} MB): "
                             "set PORTDDP_SHM_SCRATCH_MB and PORTDDP_SHM_ARENA_MB alike on every rank, or on none")
        seg = _HEADER + self.scratch_bytes + self.arena_bytes
        self._fd, self._segs = _map_segments(self.node, seg, _HEADER + self.scratch_bytes)
        self._seg_addr = self._segs[self.local_rank].ctypes.data
        self._counters = [s[:4].view(np.int32) for s in self._segs]
        # offset, elements in all, dtype code, elements offered, defer, first element of the round
        self._desc = [s[8:64].view(np.int64) for s in self._segs]
        self._counter_addr = [s.ctypes.data for s in self._segs]
        self._seq = 0
        self.node.Barrier()
        # arena: first fit over free blocks [start, end) (offsets into my segment)
        self._arena_lo = _HEADER + self.scratch_bytes
        self._free = [(self._arena_lo, self._arena_lo + self.arena_bytes)] if self.arena_bytes else []
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], list] = {}  # deferred gathers: (address, bytes) -> chunks
        self.cpu_waiting = 0.0  # seconds of CPU this rank's waits used (for the benchmark)
        self.wall_waiting = 0.0

    # -- buffers ---------------------------------------------------------------------------------
    def empty(self, shape, dtype) -> np.ndarray | None:
        """An uninitialised array in this rank's part of the shared window (its space returns to
        the arena when the array and every view of it are gone), or None when the arena is full."""
        dtype = np.dtype(dtype)
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
        size = _round(nbytes)
        with self._lock:
            for i, (lo, hi) in enumerate(self._free):
                if hi - lo >= size:
                    self._free[i] = (lo + size, hi)
                    if lo + size == hi:
                        del self._free[i]
                    break
            else:
                return None
        try:  # back the block now: a full /dev/shm then means ordinary memory, not a SIGBUS later
            os.posix_fallocate(self._fd, lo, size)
        except OSError:
            self._release(lo, size)
            return None
        # The root array owns the block: numpy makes every view's base this array (not the
        # window), so the block is released only when the last view is gone.
        root = np.frombuffer(memoryview(self._segs[self.local_rank])[lo:lo + nbytes], dtype=np.uint8)
        weakref.finalize(root, self._release, lo, size)
        return root[: nbytes - nbytes % dtype.itemsize].view(dtype).reshape(shape)

    def _release(self, lo: int, size: int) -> None:
        with self._lock:
            blocks = sorted([*self._free, (lo, lo + size)])
            merged = [blocks[0]]
            for a, b in blocks[1:]:
                if a == merged[-1][1]:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            self._free = merged

    def offset_of(self, buf: np.ndarray) -> int | None:
        """Where `buf` lies in my segment (None if it does not)."""
        addr = buf.ctypes.data
        off = addr - self._seg_addr
        if self._arena_lo <= off and off + buf.nbytes <= self._arena_lo + self.arena_bytes:
            return off
        return None

    # -- synchronisation -------------------------------------------------------------------------
    def _signal(self) -> None:
        self._seq = (self._seq + 1) & 0x7FFFFFFF  # an int32 futex word: wraps, compared modulo 2**31
        _fence()  # my data and descriptor before my counter
        self._counters[self.local_rank][0] = self._seq
        if _futex is not None:
            _futex(_SYS_FUTEX, self._counter_addr[self.local_rank], _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def _wait_peers(self) -> None:
        """Until every local peer's counter reached mine (kernel sleep, no spinning)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        target = self._seq
        for j in range(self.local_size):
            if j == self.local_rank:
                continue
            counter = self._counters[j]
            pause = 20e-6
            while True:
                seen = int(counter[0])
                if (seen - target) & 0x7FFFFFFF < 0x40000000:  # seen >= target, modulo 2**31
                    break
                if _futex is not None:
                    _futex(_SYS_FUTEX, self._counter_addr[j], _FUTEX_WAIT, seen, ctypes.byref(_WAIT_SLICE),
                           None, 0)
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, 500e-6)
        _fence()  # their stores before my loads
        self.cpu_waiting += time.thread_time() - c0
        self.wall_waiting += time.perf_counter() - t0

    # -- the all-reduce --------------------------------------------------------------------------
    def allreduce(self, buf: np.ndarray, defer_gather: bool = False) -> np.ndarray:
        """Sum `buf` (C-contiguous) over every rank of `comm`, in place; blocking. With
        `defer_gather` and `buf` in the arena, `buf` holds only this rank's slice of the sum
        afterwards: `gather(buf, dests)` must follow (see the module's account). A buffer whose
        deferred gather never ran (its iteration failed) is simply reduced again: the gather is
        forgotten."""
        if not buf.flags.c_contiguous:
            raise ValueError("shared-memory all-reduce buffers must be C-contiguous")
        flat = buf.reshape(-1)
        code = _code(flat.dtype)
        if code < 0:
            raise TypeError(f"no shared-memory sum for dtype {flat.dtype}")
        key = (flat.ctypes.data, flat.nbytes)
        self._pending.pop(key, None)  # a gather that never ran (its iteration failed): this sum replaces it
        home = self.offset_of(flat)
        defer = defer_gather and home is not None
        # Rounds: each rank offers what it can show its peers at once -- all that is left from the
        # arena, a scratch-full otherwise -- and a round sums the least offer: one round for a
        # bucket every rank holds in its arena. (Across hosts every round also all-reduces over
        # MPI, which the other hosts must issue alike: there, always a scratch-full.)
        chunk = max(self.scratch_bytes // flat.dtype.itemsize, 1)
        whole = home is not None and self.cross is None
        chunks, start = [], 0
        while True:
            left = flat.size - start
            done, views, bounds = self._one(flat, start, left if whole else min(left, chunk), home, code, defer)
            chunks.append((start, views, bounds))  # views None: the whole sum is in buf already
            start += done
            if start >= flat.size:
                break
        if defer:
            self._pending[key] = chunks
        return buf

    def gather(self, buf: np.ndarray, dests: list[tuple[int, np.ndarray]]) -> None:
        """Copy the sum `allreduce(buf, ...)` computed into `dests`: (offset into buf's elements,
        flat array) pairs (they need not cover buf). After a deferred all-reduce, every slice comes
        straight from the segment of the rank that reduced it; otherwise from `buf`. Local: no
        counters move. Any thread, once the all-reduce has returned."""
        flat = buf.reshape(-1)
        chunks = self._pending.pop((flat.ctypes.data, flat.nbytes), None)
        if chunks is None:
            scatter_into(dests, 0, flat)
            return
        for start, views, bounds in chunks:
            if views is None:
                scatter_into(dests, start, flat[start:start + bounds[-1]])
                continue
            for j in range(len(bounds) - 1):
                a, b = bounds[j], bounds[j + 1]
                if b > a:
                    scatter_into(dests, start + a, views[j][a:b])

    def _one(self, flat: np.ndarray, start: int, offer: int, home: int | None, code: int,
             defer: bool) -> tuple[int, list | None, list[int]]:
        """One round: sum elements [start, start + n) of every rank's `flat`, n the least of the
        ranks' offers; returns n, the views of every rank's data (None once this rank's buffer
        holds the whole sum) and the slices' bounds."""
        me, n = self.local_rank, self.local_size
        dtype, item = flat.dtype, flat.dtype.itemsize
        if home is None:  # a copy in my scratch
            offset = _HEADER
            self._view(me, offset, dtype, offer)[...] = flat[start:start + offer]
        else:
            offset = home + start * item
        self._desc[me][:6] = (offset, flat.size, code, offer, int(defer), start)
        self._signal()
        self._wait_peers()
        descs = [self._desc[j][:6].tolist() for j in range(n)]
        for j, (_, total, their_code, _, _, their_start) in enumerate(descs):
            if total != flat.size or their_code != code or their_start != start:
                raise RuntimeError(f"local rank {j} all-reduces {total} x {_DTYPES[their_code]} while local rank {me} "
                                   f"all-reduces {flat.size} x {dtype.name}: the ranks issue different collectives")
        count = min(d[3] for d in descs)
        views = [self._view(j, d[0], dtype, count) for j, d in enumerate(descs)]
        # A rank whose data lies in its scratch overwrites it in its next round: then every rank
        # receives the whole sum now, whatever it asked.
        any_scratch = min(d[0] for d in descs) < self._arena_lo
        peers = [j for j in range(n) if j != me and (not descs[j][4] or any_scratch)]  # those that receive the sum
        bounds = _bounds(count, n, item)
        lo, hi = bounds[me], bounds[me + 1]
        if hi > lo:
            parts = [v[lo:hi] for v in views]
            if self.cross is None:
                _reduce_into([parts[me]] + [parts[j] for j in peers], parts, me)
            else:  # my slice of the host's sum, then summed over the hosts, then shared within the host
                _reduce_into([parts[me]], parts, me)
                self._cross_allreduce(parts[me])
                for j in peers:
                    parts[j][...] = parts[me]
        self._signal()
        self._wait_peers()
        if home is None:
            flat[start:start + count] = views[me]
        whole = not defer or any_scratch  # my buffer holds the whole sum
        return count, (None if whole else views), bounds

    def _cross_allreduce(self, mine: np.ndarray) -> None:
        MPI = self._MPI
        if is_half(mine.dtype):
            spec, op = [mine.view(np.uint16), MPI.UINT16_T], self._half_op(mine.dtype)
        else:
            spec, op = mine, MPI.SUM
        self._wait_request(self.cross.Iallreduce(MPI.IN_PLACE, spec, op=op))

    def discard(self, buf: np.ndarray) -> None:
        """Forget a deferred gather that will not run (its iteration failed): `buf` may be reduced
        again. Its sum is then lost."""
        flat = buf.reshape(-1)
        self._pending.pop((flat.ctypes.data, flat.nbytes), None)

    def _view(self, j: int, offset: int, dtype: np.dtype, count: int) -> np.ndarray:
        return self._segs[j][offset:offset + count * dtype.itemsize].view(dtype)


def _map_segments(node, seg: int, backed: int):
    """One file of `seg` bytes per local rank in /dev/shm, every rank mapping all of them; the files
    are unlinked once mapped, so the memory goes when the processes do (also after kill -9, but for
    one that lands between a file's creation and the barrier after every peer mapped it).
    The first `backed` bytes of mine are allocated now (the rest as `empty` hands it out)."""
    import tempfile  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    from portddp import watchdog  # noqa: PLC0415

    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(where, f"portddp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    with watchdog.shared_file(path):  # (removed also if the watchdog ends this rank in the middle)
        try:
            return fd, _share(node, fd, path, seg, backed)
        finally:
            os.unlink(path)


def _share(node, fd: int, path: str, seg: int, backed: int) -> list[np.ndarray]:
    """_map_segments' collective part: size my file, learn the peers', map them all (mine unlinked
    by the caller once every rank has)."""
    import mmap  # noqa: PLC0415

    error = ""
    try:
        os.ftruncate(fd, seg)
        os.posix_fallocate(fd, 0, backed)
    except OSError as e:
        error = f"{path}: {e}"
    errors = [x for x in node.allgather(error) if x]
    paths = node.allgather(path)
    if errors:
        raise OSError(f"no shared memory for the all-reduce: {errors[0]} (each rank's segment: a scratch area of "
                      "PORTDDP_SHM_SCRATCH_MB, and the arena's address space, PORTDDP_SHM_ARENA_MB: make room in "
                      "/dev/shm or lower them; PORTDDP_MPI_ALLREDUCE=mpi uses MPI's own all-reduce)")
    segs = []
    for j, p in enumerate(paths):
        if j == node.rank:
            mm = mmap.mmap(fd, seg, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            with open(p, "r+b") as f:
                mm = mmap.mmap(f.fileno(), seg, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        segs.append(np.frombuffer(mm, dtype=np.uint8))
    node.Barrier()  # everyone has mapped everyone's file
    return segs


_fence_lock = threading.Lock()


def scratch_mb() -> float:
    """PORTDDP_SHM_SCRATCH_MB (16): each rank's scratch area, through which a buffer outside the
    arena is summed a scratch-full at a time (across hosts: every bucket)."""
    return env.number("PORTDDP_SHM_SCRATCH_MB", 16, unit="MB", least=1 / 16)


def arena_mb() -> float:
    """PORTDDP_SHM_ARENA_MB (4096): the address space of each rank's arena, where its buckets live."""
    return env.number("PORTDDP_SHM_ARENA_MB", 4096, unit="MB", zero_means="no arena: every buffer through the scratch")


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release imply one), so the data a counter
    announces is visible before the counter, also on weakly ordered CPUs."""
    with _fence_lock:
        pass


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _bounds(count: int, n: int, itemsize: int) -> list[int]:
    """Slice boundaries for n ranks, each on a cache line where the size allows."""
    step = max(_ALIGN // itemsize, 1)
    units = (count + step - 1) // step
    return [min(units * j // n * step, count) for j in range(n)] + [count]


_CHUNK_BYTES = 1 << 20  # summed a chunk at a time: the copies to the peers read it from cache


def _reduce_into(dests: list[np.ndarray], parts: list[np.ndarray], me: int) -> None:
    """Every array of `dests` = ((parts[0] + parts[1]) + parts[2]) + ..., a cache-sized chunk at a
    time. dests[0] is parts[me]'s memory: the sum is made there (read before it is written) and
    copied from cache into the others. Silently for Inf and NaN, as torch's and MPI's sums (a
    GradScaler's overflowing step is expected, and it checks the result itself)."""
    with np.errstate(invalid="ignore", over="ignore"):
        _sum_into(dests, parts, me)


def _sum_into(dests: list[np.ndarray], parts: list[np.ndarray], me: int) -> None:
    add = half_add if is_half(parts[0].dtype) else np.add
    if len(parts) == 2 and me == 1:  # a sum of two is commutative (bitwise): start from my own part
        parts = parts[::-1]
    first = me == 0 or len(parts) == 2  # dests[0] is parts[0]: accumulate in place
    count = parts[0].size
    step = min(max(_CHUNK_BYTES // parts[0].itemsize, 1), count)
    acc = None if first else np.empty(step, parts[0].dtype)
    for a in range(0, count, step):
        b = min(a + step, count)
        out = dests[0][a:b]
        s = out if first else acc[:b - a]
        add(parts[0][a:b], parts[1][a:b], s)
        for p in parts[2:]:
            add(s, p[a:b], s)
        if s is not out:
            out[...] = s
        for d in dests[1:]:
            d[a:b] = out


def scatter_into(dests: list[tuple[int, np.ndarray]], start: int, src: np.ndarray) -> None:
    """Copy `src`, elements [start, start + src.size) of a flat buffer, into the parts of it that
    `dests` ((offset, flat array) pairs, sorted by offset, not overlapping) hold."""
    end = start + src.size
    first = max(bisect.bisect_right(dests, start, key=lambda d: d[0]) - 1, 0)
    for off, dest in dests[first:]:
        if off >= end:
            break
        lo, hi = max(start, off), min(end, off + dest.size)
        if hi > lo:
            dest[lo - off:hi - off] = src[lo - start:hi - start]


TORCH_SERIAL = 32767
"""Elements per torch call on a thread of portddp's own: below torch's grain size (32768) an op runs on
the calling thread alone. A larger one starts an OpenMP team of that thread's own (as many threads as
cores, not the rank's share), which would compete with the rank's compute for its cores."""


def loaded_torch():
    """torch if this process has imported it whole, else None: a module still being imported (by
    another thread: portddp.jax's hooks import it on first use) is in sys.modules already, and an op
    on it crashed the process (a review, 2026-12-07)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", True):
        return None
    return torch


def torch_half(torch, a: np.ndarray):
    """A flat torch view of the float16 or bfloat16 numpy array `a` (numpy has no bfloat16: through its bits)."""
    kind = torch.float16 if a.dtype == np.float16 else torch.bfloat16
    return torch.from_numpy(a.reshape(-1).view(np.int16)).view(kind)


def torch_serially(n: int) -> list[slice]:
    """Slices of range(n), TORCH_SERIAL elements each: torch ops over them start no OpenMP team."""
    return [slice(i, i + TORCH_SERIAL) for i in range(0, n, TORCH_SERIAL)]


def half_add(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a + b for 16-bit floats (of one dtype; `out` is an input or overlaps neither), computed
    in float32 and rounded back, as Gloo and NCCL sum half types (the shared-memory sum and
    portddp.transport's MPI op alike). numpy converts float16 one element at a time (4M elements: 35
    ms here, against ~1 ms in torch's vectorised loop, TORCH_SERIAL elements a call; bfloat16 through
    ml_dtypes 8 ms): in a process that has loaded torch (a portddp.torch rank, a JAX rank with a half
    hook) torch sums them, with the same float32 sum and rounding -- equal bit for bit but for the
    payload of a NaN. Otherwise numpy; a JAX rank loads no torch for it."""
    torch = loaded_torch()
    if torch is not None and all(x.flags.c_contiguous and x.flags.writeable and x.dtype.isnative
                                 for x in (a, b, out)):  # (torch.from_numpy's terms)
        x, y, z = (torch_half(torch, v) for v in (a, b, out))
        for part in torch_serially(z.numel()):
            torch.add(x[part], y[part], out=z[part])
    else:
        np.copyto(out, (a.astype(np.float32) + b.astype(np.float32)).astype(out.dtype))
