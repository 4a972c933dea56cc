"""What a step costs beside its time: CPU per thread group, and peak resident memory (Linux /proc).

    cpu = CpuMeter()
    cpu.start(); ...steps...; cpu.stop(steps=3)      # any number of turns
    cpu.per_step()    # {"total": s, "main": s, "comm": s, "xla": s, "other": s, "threads": {name: s}}

Per step, and the median over turns (each turn's CPU divided by its steps), as the times
beside it are medians over steps: one turn that a stray page-fault storm or a scheduler
hiccup made slow moves a mean, not a median.

Why CPU: on a machine whose cores all compute, a comm thread that spins while
it waits for a peer steals its core from the backward pass it should overlap.
Wall time hides that; CPU seconds per step, split by thread, show it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import threading
import time
from collections.abc import Iterator, Sequence

__all__ = ["CpuMeter", "GROUPS", "thread_group", "thread_cpu", "Memory", "rotated", "no_collection"]

GROUPS = ("main", "comm", "xla", "other")
"""main: the Python thread that runs the step (PyTorch's forward and backward, the hooks; JAX's
dispatch and host callbacks). comm: portddp's MPI comm thread and Gloo's threads (native DDP
and portddp's c10d transport all-reduce there). xla: XLA's named compute pools (tf_XLA*).
other: every other thread -- the watchdog, gRPC, and XLA's unnamed pools, which also run
jitted code (the JAX rows' compute is split between `xla` and `other`)."""

_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 1e7


def rotated(items: Sequence, r: int) -> list:
    """Round r's order of interleaved variants: each round starts with another one, so that none
    always runs right after the same one."""
    k = r % len(items)
    return [*items[k:], *items[:k]]


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """As timeit does: collect first, then no collector pause inside the timed steps."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect once, then leave every object alive now out of the collections until the block ends
    (`gc.freeze`): the collections `no_collection` and `Memory.start` make inside it walk only what
    was made since. A full one walks what torch, JAX and the trainers made -- 0.1-0.25 s each here,
    a third of a small experiment's run. (Not nested: leaving the block unfreezes everything.)"""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def thread_group(py_name: str | None, os_name: str, is_main: bool) -> str:
    """The group of one thread, from its Python name (threads Python started) or its OS name."""
    if is_main:
        return "main"
    if py_name == "portddp-mpi-comm" or "gloo" in os_name:
        return "comm"
    if os_name.startswith(("tf_XLA", "XLA")):
        return "xla"
    return "other"


def thread_cpu() -> dict[int, tuple[str, str, float]]:
    """{tid: (group, name, CPU seconds so far)} for every thread of this process.

    Read from /proc/self/task/<tid>/schedstat (nanoseconds on the CPU, read from any
    thread: no need to run code inside the comm thread), or utime + stime from
    /proc/self/task/<tid>/stat (clock ticks) where schedstat is missing. Empty
    elsewhere than Linux. The kernel brings a running thread's schedstat up to date only
    at its scheduler's events (a tick, a switch): the calling thread -- the main thread,
    running as it reads -- would lag by up to a tick (4 ms), as much as a tiny step takes
    (a turn read 0 s); its own count comes from time.thread_time(), the same counter
    brought up to date."""
    base = "/proc/self/task"
    if not os.path.isdir(base):
        return {}
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    main, me = threading.main_thread().native_id, threading.get_native_id()
    out = {}
    for entry in os.listdir(base):
        tid = int(entry)
        try:
            with open(f"{base}/{entry}/comm") as f:
                os_name = f.read().strip()
            try:
                if tid == me:
                    seconds = time.thread_time()
                else:
                    with open(f"{base}/{entry}/schedstat") as f:
                        seconds = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                with open(f"{base}/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                seconds = (int(fields[11]) + int(fields[12])) * _TICK_NS / 1e9  # utime, stime
        except OSError:
            continue  # the thread ended while we read
        name = python_names.get(tid, os_name)
        out[tid] = (thread_group(python_names.get(tid), os_name, tid == main), name, seconds)
    return out


class CpuMeter:
    """CPU seconds spent by this process's threads between start() and stop(), per turn,
    grouped (GROUPS) and by thread name.

    A thread that ends inside a turn loses that turn's CPU (threads live for the
    whole run here: comm thread, Gloo, XLA pools); one born inside a turn counts
    from zero."""

    def __init__(self):
        self._before: dict[int, tuple[str, str, float]] | None = None
        self.turns: list[dict] = []  # per turn and per step: {"total", *GROUPS, "wall", "threads"}

    def start(self) -> None:
        self._before = thread_cpu()
        self._t0 = time.perf_counter()

    def stop(self, steps: int) -> None:
        wall = time.perf_counter() - self._t0
        groups, threads = dict.fromkeys(GROUPS, 0.0), {}
        for tid, (group, name, seconds) in thread_cpu().items():
            spent = seconds - (self._before or {}).get(tid, (group, name, 0.0))[2]
            groups[group] += spent / steps
            threads[name] = threads.get(name, 0.0) + spent / steps
        self.turns.append({"total": sum(groups.values()), **groups, "wall": wall / steps, "threads": threads})
        self._before = None

    def per_step(self) -> dict:
        """CPU seconds per step, the median over turns: "total", each group, and "threads" by
        name (summed over threads of the same name); "wall" is the wall time per step, the
        median over the same turns. (Within a turn the groups sum to the total; their medians
        need not.) Zeros before any turn."""
        if not self.turns:
            return {"total": 0.0, **dict.fromkeys(GROUPS, 0.0), "wall": 0.0, "threads": {}}
        out = {k: statistics.median(t[k] for t in self.turns) for k in ("total", *GROUPS, "wall")}
        names = {name for t in self.turns for name in t["threads"]}
        busy = {name: statistics.median(t["threads"].get(name, 0.0) for t in self.turns) for name in names}
        return out | {"threads": {k: v for k, v in sorted(busy.items(), key=lambda kv: -kv[1]) if v > 0}}


class Memory:
    """Resident memory of this process (Linux /proc), for "how much did this add at its peak".

        mem = Memory()
        mem.start()              # settle, then reset the kernel's high-water mark
        ... build and run something ...
        mem.peak_mb()            # peak RSS since start() minus RSS at start(), in MB

    The peak is the kernel's high-water mark (VmHWM), reset by writing 5 to
    /proc/self/clear_refs: exact, not sampled. But the allocator is left as it
    is (changing its thresholds would change the timings too), so memory freed
    earlier and kept by malloc can be reused unseen: read it as approximate.
    Elsewhere than Linux every reading is None."""

    def __init__(self):
        self.ok = os.path.exists("/proc/self/clear_refs")
        self._base = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def rss_mb(self) -> float | None:
        return self._status("VmRSS:") / 2**20 if self.ok else None

    def start(self) -> None:
        if self.ok:
            import gc  # noqa: PLC0415

            gc.collect()
            # Wait (up to 2 s) for the resident size to settle: XLA frees its buffers asynchronously.
            last, t0 = -1, time.monotonic()
            while (now := self._status("VmRSS:")) != last and time.monotonic() - t0 < 2:
                last = now
                time.sleep(0.05)
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.ok = False
                return
            self._base = self._status("VmRSS:")

    def peak_mb(self) -> float | None:
        return (self._status("VmHWM:") - self._base) / 2**20 if self.ok else None
