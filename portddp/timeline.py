"""Per-iteration events and the metrics every implementation reports.

All timestamps are host `time.perf_counter_ns()` values of one rank. The
definitions (README, "Metrics") live here once, so portddp.torch,
portddp.jax and the harness cannot drift apart:

* backward_compute_time  = backward end - forward end
* backward_comm_time     = last bucket done - first bucket launch
* backward_compute_comm_overlap_time = backward end - first bucket launch
  (these three are PyTorch DDP's own, as `_get_ddp_logging_data()` reports them)
* overlap_ratio = |union of bucket [launch, done] intervals within
  [forward end, backward end]| / |union of bucket intervals|
* exposed_comm_time = backward end -> every bucket done
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence

__all__ = ["BucketEvents", "IterationEvents", "union_length", "chrome_trace"]


@dataclasses.dataclass
class BucketEvents:
    """ready: its last gradient arrived; launch: its all-reduce was issued; done: reduced."""

    index: int
    nbytes: int
    ready_ns: int = 0
    launch_ns: int = 0
    done_ns: int = 0


@dataclasses.dataclass
class IterationEvents:
    """What one rank saw during one synchronised iteration."""

    rank: int
    forward_start_ns: int = 0
    forward_end_ns: int = 0
    backward_end_ns: int = 0  # the last gradient was produced
    finalize_end_ns: int = 0  # every gradient holds the mean: the step can run
    buckets: list[BucketEvents] = dataclasses.field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """The metrics of this iteration (the module's list), in seconds (ratio unitless)."""
        launched = [b for b in self.buckets if b.launch_ns and b.done_ns]
        out = {"backward_compute_time": (self.backward_end_ns - self.forward_end_ns) * 1e-9}
        if not launched:
            return out | {"backward_comm_time": 0.0, "backward_compute_comm_overlap_time": 0.0,
                          "overlap_ratio": 0.0, "exposed_comm_time": 0.0}
        first_launch = min(b.launch_ns for b in launched)
        last_done = max(b.done_ns for b in launched)
        intervals = [(b.launch_ns, b.done_ns) for b in launched]
        comm = union_length(intervals)
        hidden = union_length(intervals, clip=(self.forward_end_ns, self.backward_end_ns))
        return out | {
            "backward_comm_time": (last_done - first_launch) * 1e-9,
            "backward_compute_comm_overlap_time": max(0, self.backward_end_ns - first_launch) * 1e-9,
            "overlap_ratio": hidden / comm if comm else 0.0,
            "exposed_comm_time": max(0, last_done - self.backward_end_ns) * 1e-9,
        }

    def stats(self) -> dict:
        """What `ddp.stats()` returns on both frameworks: the metrics, the wall time from
        forward start to usable gradients, and the events themselves."""
        return self.metrics() | {
            "iteration_time": (self.finalize_end_ns - self.forward_start_ns) * 1e-9,
            "num_buckets": len(self.buckets),
            "events": self,
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "IterationEvents":
        return cls(**{**d, "buckets": [BucketEvents(**b) for b in d["buckets"]]})


def union_length(intervals: Iterable[tuple[int, int]], clip: tuple[int, int] | None = None) -> int:
    """Total length covered by the intervals (optionally clipped to `clip`)."""
    spans = sorted(intervals)
    if clip is not None:
        lo, hi = clip
        spans = [(max(a, lo), min(b, hi)) for a, b in spans]
        spans = [(a, b) for a, b in spans if b > a]
    total, cur_a, cur_b = 0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def chrome_trace(runs: Sequence[tuple[str, Sequence[IterationEvents]]]) -> str:
    """Chrome-trace JSON (opens in Perfetto): one process per run, a track per rank
    for compute and one for its communication."""
    events = []
    t0 = min((it.forward_start_ns for _, its in runs for it in its if it.forward_start_ns), default=0)

    def us(ns):
        return (ns - t0) / 1000.0

    for pid, (label, iterations) in enumerate(runs):
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
        for it in iterations:
            compute_tid, comm_tid = 2 * it.rank, 2 * it.rank + 1
            for tid, name in ((compute_tid, f"rank {it.rank} compute"), (comm_tid, f"rank {it.rank} comm")):
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
            if not it.forward_end_ns:  # a compiled step: only its span is visible from the host
                events.append({"ph": "X", "pid": pid, "tid": compute_tid, "name": "step (XLA-scheduled)",
                               "ts": us(it.forward_start_ns), "dur": (it.finalize_end_ns - it.forward_start_ns) / 1e3})
                continue
            if it.forward_start_ns:
                events.append({"ph": "X", "pid": pid, "tid": compute_tid, "name": "forward",
                               "ts": us(it.forward_start_ns), "dur": (it.forward_end_ns - it.forward_start_ns) / 1e3})
            events.append({"ph": "X", "pid": pid, "tid": compute_tid, "name": "backward",
                           "ts": us(it.forward_end_ns), "dur": (it.backward_end_ns - it.forward_end_ns) / 1e3})
            for b in it.buckets:
                if b.launch_ns and b.done_ns:
                    events.append({"ph": "X", "pid": pid, "tid": comm_tid, "name": f"bucket {b.index}",
                                   "ts": us(b.launch_ns), "dur": (b.done_ns - b.launch_ns) / 1e3,
                                   "args": {"bytes": b.nbytes, "ready_us": us(b.ready_ns)}})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
