"""Predict a DDP iteration at another scale from one measured iteration (trace-driven, numpy only).

    from portddp.simulate import Trace, fit_link, simulate
    trace = Trace.from_row(row, world=2)                 # a row of an experiment's JSON (events + plan)
    link = fit_link(samples_from_trace(off_trace, rate_bps=1e9))
    p = simulate(trace, link, world=64, rate_bps=10e9, bucket_cap_mb=4)
    p.iteration_s, p.exposed_comm_s, p.overlap_ratio, p.buckets

The model, in the spirit of Daydream (one task per bucket, replayed on the
measured timeline) and Echo (compute slowed by overlapping communication):

* Compute comes from the trace: forward time, backward time, and when each
  bucket became ready. Re-planning with other caps needs per-parameter ready
  times: within a bucket, parameters are taken to finish in buffer order,
  spread over the time since the previous bucket by their bytes. The new plan
  comes from `portddp.buckets` (the rebuilt plan's order is the observed one).
* Communication: buckets are reduced one at a time, in plan order (one comm
  thread / one Gloo queue), each starting when it is ready and the previous
  one is done (`overlap=False`: all after backward). A ring all-reduce of B
  bytes over n ranks makes each host send s = 2(n-1)/n * B; it takes
  alpha + 2(n-1) * hop + max(s * 8 / rate, s * host_s_per_byte): the wire and the
  hosts' own per-byte work (copies, reduction, the TCP stack) run pipelined, the
  slower one sets the pace. alpha and host_s_per_byte are fitted (`fit_link`)
  from bucket durations measured without overlap, at a known link rate.
* Contention: on hosts whose cores also run communication, backward compute
  stretches by (1 + kappa * f), f the fraction of backward time communication
  runs beside it. kappa is measured: the same implementation's backward with
  overlap on vs off (`fit_contention`).
* The rest of the step (optimizer, data) is taken from the trace as measured.

Outputs use portddp.timeline's metric definitions. Knobs: world size, link
rate, bucket caps, overlap on/off, compression (bytes x 0.5 for fp16/bf16),
no_sync every k steps, compute scale (a faster device: < 1).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np

from portddp.buckets import BucketPlan, plan_buckets, rebuild_plan
from portddp.timeline import union_length

__all__ = ["Trace", "LinkModel", "Model", "Prediction", "fit_link", "fit_contention", "samples_from_trace", "simulate",
           "parse_rate", "why_not_replayable"]

def parse_rate(rate: str) -> float | None:
    """'10gbit' -> 1e10 bits/s; 'unlimited' or '0' -> None: the emulated cluster's reading of a link rate
    (portddp.cluster.parse_rate), so that a rate means the same to both."""
    from portddp.cluster import parse_rate as cluster_rate  # noqa: PLC0415

    return cluster_rate(rate)


def why_not_replayable(row: dict) -> str | None:
    """Why an experiment row cannot be replayed bucket by bucket (None: it can). Only portddp's own
    DDPs record per-bucket events (harness/adapter.py, events())."""
    ev = row.get("events")
    if isinstance(ev, dict) and ev.get("forward_end_ns") and ev.get("buckets"):
        return None
    impl = str(row.get("impl") or row.get("label"))
    if impl == "native":
        return ("torch's own DistributedDataParallel records no per-bucket events: it is timed from outside "
                "(its step time and the averages of its logging data only)")
    if impl.endswith("-local"):
        return "a single-process reference communicates nothing: it has no buckets"
    if impl == "jax-compiled":
        return "a compiled strategy schedules its all-reduces inside XLA: only the whole step is seen"
    return "its row records no per-bucket events"


@dataclasses.dataclass(frozen=True)
class Trace:
    """One steady-state iteration of one implementation, times in seconds from forward start."""

    forward_s: float
    backward_s: float  # forward end -> last gradient
    ready_s: tuple[float, ...]  # per bucket, from forward end
    bucket_bytes: tuple[int, ...]
    launch_s: tuple[float, ...]
    done_s: tuple[float, ...]
    finalize_s: float  # last of (backward end, last bucket done) -> gradients written
    other_s: float  # the rest of the measured step (optimizer, data)
    world: int
    plan: BucketPlan | None = None
    caps_mb: tuple[float, float] | None = None  # (bucket_cap_mb, first_bucket_cap_mb) of the plan

    @classmethod
    def from_row(cls, row: dict, world: int) -> "Trace":
        """From a row of an experiment JSON (harness/runner.py): events, plan, median step time."""
        why = why_not_replayable(row)
        if why:
            raise ValueError(f"{row.get('label')!r} cannot be replayed bucket by bucket: {why}")
        ev = row["events"]
        trace = cls.from_events(ev, row["median_s"], world, BucketPlan.from_dict(row["plan"]) if row.get("plan")
                                else None, _caps(row.get("knobs", {})))
        # The events are one iteration's; the row's medians over every timed iteration are steadier:
        # backward (ready times scaled alike) and the rest of the step come from them.
        m = row.get("metrics") or {}
        backward = m.get("backward_compute_time")
        if backward and trace.backward_s > 0:
            k = backward / trace.backward_s
            trace = dataclasses.replace(trace, backward_s=backward, ready_s=tuple(r * k for r in trace.ready_s))
        if m.get("iteration_time"):
            trace = dataclasses.replace(trace, other_s=max(0.0, row["median_s"] - m["iteration_time"]))
        return trace

    @classmethod
    def from_events(cls, ev: dict, step_s: float, world: int, plan: BucketPlan | None = None,
                    caps_mb: tuple[float, float] | None = None) -> "Trace":
        t0, fe = ev["forward_start_ns"], ev["forward_end_ns"]
        buckets = sorted(ev["buckets"], key=lambda b: b["index"])
        last = max([ev["backward_end_ns"]] + [b["done_ns"] for b in buckets])
        return cls(
            forward_s=(fe - t0) * 1e-9, backward_s=(ev["backward_end_ns"] - fe) * 1e-9,
            ready_s=tuple((b["ready_ns"] - fe) * 1e-9 for b in buckets),
            bucket_bytes=tuple(b["nbytes"] for b in buckets),
            launch_s=tuple((b["launch_ns"] - t0) * 1e-9 for b in buckets),
            done_s=tuple((b["done_ns"] - t0) * 1e-9 for b in buckets),
            finalize_s=max(0.0, (ev["finalize_end_ns"] - last) * 1e-9),
            other_s=max(0.0, step_s - (ev["finalize_end_ns"] - t0) * 1e-9), world=world, plan=plan,
            caps_mb=caps_mb)

    @property
    def step_s(self) -> float:
        return self.done_or_end() + self.finalize_s + self.other_s

    def done_or_end(self) -> float:
        return max([self.forward_s + self.backward_s, *self.done_s])

    def param_ready_s(self) -> list[float]:
        """Per parameter (plan spec index): when its gradient was ready, from forward end."""
        if self.plan is None:
            raise ValueError("this trace has no bucket plan: re-planning needs one (rows of portddp's DDPs have it)")
        ready = [0.0] * len(self.plan.specs)
        prev = 0.0
        for b, bucket in enumerate(self.plan.buckets):
            sizes = np.array([self.plan.specs[p].nbytes for p in bucket.params], dtype=float)
            ends = prev + (self.ready_s[b] - prev) * np.cumsum(sizes) / max(sizes.sum(), 1.0)
            for p, t in zip(bucket.params, ends):
                ready[p] = float(t)
            prev = max(prev, self.ready_s[b])
        return ready


def _caps(knobs: dict) -> tuple[float, float] | None:
    if "bucket_cap_mb" not in knobs or isinstance(knobs["bucket_cap_mb"], str):
        return None
    cap = float(knobs["bucket_cap_mb"])
    return cap, float(knobs.get("first_bucket_cap_mb", min(1.0, cap)))


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """All-reduce time: alpha + 2(n-1) * hop + max(wire, host), s = 2(n-1)/n * bytes sent per host.

    alpha: the fixed cost of one collective (launch, host bookkeeping); hop: the latency of one ring
    step. From samples at one world size the two cannot be told apart: hop is then 0 and alpha holds
    both (fine at that size; pass hop_s explicitly to extrapolate to many ranks)."""

    alpha_s: float
    host_s_per_byte: float
    rate_bps: float | None = None  # where it was fitted (informative)
    hop_s: float = 0.0
    # False: every sample sent about as many bytes, so alpha and host_s_per_byte could not be told apart
    # (any split of the time between them fits alike); host_s_per_byte was then taken as 0 (fit_link).
    separable: bool = True

    def allreduce_s(self, nbytes: float, world: int, rate_bps: float | None) -> float:
        if world <= 1:
            return 0.0
        sent = 2 * (world - 1) / world * nbytes
        wire = sent * 8 / rate_bps if rate_bps else 0.0
        return self.alpha_s + 2 * (world - 1) * self.hop_s + max(wire, sent * self.host_s_per_byte)


def samples_from_trace(trace: Trace, rate_bps: float | None) -> list[tuple[int, int, float | None, float]]:
    """(bytes, world, rate, seconds) per bucket of an iteration without overlap: each bucket's time from
    the later of its launch and the previous bucket's end (the transport runs them one at a time)."""
    out, prev_done = [], 0.0
    for nbytes, launch, done in zip(trace.bucket_bytes, trace.launch_s, trace.done_s):
        start = max(launch, prev_done)
        if done > start:
            out.append((nbytes, trace.world, rate_bps, done - start))
        prev_done = done
    return out


SEPARABLE_SPREAD = 1.5
"""Samples at one link rate whose bytes sent per host span less than this factor cannot tell a fixed
cost per all-reduce (alpha) from a per-byte one (host_s_per_byte): fit_link then fits alpha alone."""


def _fixed_costs(design: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Coefficients (>= 0) of the time beyond the wire: with one world size (one column, alpha: every
    trace the CLI reads) its median -- robust to one all-reduce that also waited for a late peer (the
    first bucket of an iteration without overlap absorbs the ranks' skew: 287 ms beside 29-41 ms in one
    busy run, which made the mean, least squares' alpha, 31 ms where the buckets' own was ~1.4) --;
    across several world sizes (alpha and the ring step's hop), least squares."""
    if design.shape[1] == 1:  # (the lower median: of two buckets, one late, the other one's -- not their mean)
        return np.array([max(0.0, float(np.sort(rest)[(len(rest) - 1) // 2]))])
    return np.clip(np.linalg.lstsq(design, rest, rcond=None)[0], 0.0, None)


def fit_link(samples: Sequence[tuple[int, int, float | None, float]]) -> LinkModel:
    """alpha and host_s_per_byte over measured all-reduces (bytes, world, rate, seconds): for each
    candidate h, alpha (and hop) by `_fixed_costs`; the h whose fit leaves the least absolute error.

    With one size of all-reduce (an iteration whose buckets are all alike, as a model of equal
    layers gives), t = alpha + max(wire, sent * h) fits every split of the time beyond the wire
    between alpha and h equally well; which one a fit would return is decided by rounding,
    and the two extrapolate differently (a host-bound h ignores a faster link). The split is then
    taken as all alpha (h = 0: the hosts keep up with the wire) and the model says so (`separable`)."""
    if not samples:
        raise ValueError("fit_link needs at least one measured all-reduce")
    b = np.array([s[0] for s in samples], float)
    n = np.array([s[1] for s in samples], float)
    rate = np.array([s[2] or np.inf for s in samples], float)
    t = np.array([s[3] for s in samples], float)
    sent = 2 * (n - 1) / n * b
    wire = sent * 8 / rate
    hops = 2 * (n - 1)
    best = (math.inf, (0.0, 0.0), 0.0)

    several_sizes = len(set(n.tolist())) > 1
    design = np.stack([np.ones_like(hops), hops], axis=1) if several_sizes else np.ones((len(t), 1))

    def consider(grid):
        nonlocal best
        # t = alpha + hops * hop + max(wire, sent * h): for each h, (alpha, hop) >= 0 (_fixed_costs).
        for h in grid:
            rest = t - np.maximum(wire, sent * h)
            coef = _fixed_costs(design, rest)
            err = float(np.sum(np.abs(rest - design @ coef)))
            if err < best[0]:
                best = (err, (float(coef[0]), float(coef[1]) if several_sizes else 0.0), float(h))

    # Apart: bytes that differ enough, or links of several rates (the wire binds at one, the hosts at another);
    # and at least as many distinct points as unknowns (alpha, h, and hop with several world sizes).
    points = {(float(x), float(y), float(z)) for x, y, z in zip(b, n, rate)}
    separable = len(points) >= design.shape[1] + 1 and bool(
        sent.max() > SEPARABLE_SPREAD * sent.min() or len(set(rate.tolist())) > 1)
    consider([0.0])
    if separable:  # coarse, then around the best
        consider(np.logspace(-12, -6, 241))
        if best[2] > 0:
            consider(np.linspace(best[2] / 1.07, best[2] * 1.07, 281))
    rates = {s[2] for s in samples}
    return LinkModel(best[1][0], best[2], rates.pop() if len(rates) == 1 else None, best[1][1], separable)


def fit_contention(on: Trace, off: Trace) -> float:
    """kappa: backward with overlap = backward alone x (1 + kappa x the fraction of it beside communication)."""
    frac = _busy_fraction(on.forward_s, on.backward_s, on.launch_s, on.done_s)
    if frac <= 0.02 or off.backward_s <= 0:
        return 0.0
    return max(0.0, (on.backward_s / off.backward_s - 1) / frac)


def fit_comm_contention(on: Trace, link: LinkModel, rate_bps: float | None) -> float:
    """kappa_comm: while backward compute runs beside it, an all-reduce progresses (1 + kappa_comm) x
    slower than alone; after backward ends, at its own pace (_beside_compute). The median over the
    buckets of an overlapped iteration that started before backward ended, each solved for the part
    of its measured duration that lay beside compute."""
    end = on.forward_s + on.backward_s
    ratios = []
    for s, start in zip(samples_from_trace(on, rate_bps), _starts(on)):
        alone, took = link.allreduce_s(s[0], on.world, rate_bps), s[3]
        if start >= end or not alone > 0:
            continue
        beside = end - start
        if start + took <= end:  # all of it beside compute
            ratios.append(took / alone - 1)
        elif alone - (took - beside) > 0:  # beside for `beside` s, then alone for the rest
            ratios.append(beside / (alone - (took - beside)) - 1)
    ratios = [r for r in ratios if math.isfinite(r)]
    return max(0.0, float(np.median(ratios))) if ratios else 0.0


def _beside_compute(start: float, alone: float, end: float, kappa_comm: float) -> float:
    """How long an all-reduce taking `alone` seconds by itself takes when it starts at `start` and
    backward compute runs beside it until `end`: (1 + kappa_comm) x slower while it does, at its own
    pace after (only the part beside compute is stretched)."""
    if start >= end or kappa_comm <= 0:
        return alone
    beside = end - start
    if alone * (1 + kappa_comm) <= beside:
        return alone * (1 + kappa_comm)
    return beside + (alone - beside / (1 + kappa_comm))


def _starts(trace: Trace) -> list[float]:
    out, prev = [], 0.0
    for launch, done in zip(trace.launch_s, trace.done_s):
        out.append(max(launch, prev))
        prev = done
    return out


@dataclasses.dataclass(frozen=True)
class Model:
    """What is fitted at one measured point: the link, and both contention terms."""

    link: LinkModel
    kappa: float = 0.0  # compute slowed by communication beside it
    kappa_comm: float = 0.0  # communication slowed by compute beside it

    @classmethod
    def fit(cls, on: Trace, off: Trace, rate_bps: float | None) -> "Model":
        """From one implementation's iteration with overlap (on) and without (off), at a known link rate."""
        link = fit_link(samples_from_trace(off, rate_bps))
        return cls(link, fit_contention(on, off), fit_comm_contention(on, link, rate_bps))


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _busy_fraction(forward_s: float, backward_s: float, starts, ends) -> float:
    if backward_s <= 0:
        return 0.0
    hidden = union_length(list(zip(starts, ends)), clip=(forward_s, forward_s + backward_s))
    return hidden / backward_s


@dataclasses.dataclass
class Prediction:
    iteration_s: float  # forward start -> gradients written (the DDP part of a step)
    step_s: float  # + the rest of the measured step (optimizer, data), averaged over no_sync periods
    backward_s: float
    exposed_comm_s: float
    overlap_ratio: float
    buckets: list[dict]  # per bucket: bytes, ready, start, end (seconds from forward start)

    def summary(self) -> str:
        """The step (one whole training iteration, what the experiments time), then its DDP part."""
        return (f"step {self.step_s * 1e3:.1f} ms (forward start to reduced gradients {self.iteration_s * 1e3:.1f} ms: "
                f"backward {self.backward_s * 1e3:.1f} ms, exposed communication {self.exposed_comm_s * 1e3:.1f} ms, "
                f"overlap ratio {self.overlap_ratio:.2f}, {_count(len(self.buckets), 'bucket')}; the rest of the "
                f"step -- optimizer, data -- {(self.step_s - self.iteration_s) * 1e3:.1f} ms)")


def simulate(trace: Trace, model: "Model | LinkModel", *, world: int | None = None, rate_bps: float | None = None,
             bucket_cap_mb: float | None = None, first_bucket_cap_mb: float | None = None, overlap: bool = True,
             compression: float = 1.0, no_sync_every: int = 1, compute_scale: float = 1.0) -> Prediction:
    """One iteration at the given point, from a trace measured at another.

    compression: bytes on the wire x this (0.5 for fp16/bf16 hooks). compute_scale: compute time x
    this (0.5: a device twice as fast). A bare LinkModel means no contention terms."""
    if isinstance(model, LinkModel):
        model = Model(model)
    link, kappa = model.link, model.kappa
    world = world or trace.world
    if no_sync_every < 1 or compute_scale <= 0 or not 0 < compression <= 1:
        raise ValueError(f"no_sync_every={no_sync_every} (>= 1), compute_scale={compute_scale} (> 0), "
                         f"compression={compression} (0 < c <= 1)")
    ready, nbytes = _buckets(trace, bucket_cap_mb, first_bucket_cap_mb)
    forward = trace.forward_s * compute_scale
    base_backward = trace.backward_s * compute_scale
    ready = [r * compute_scale for r in ready]
    durations = [link.allreduce_s(b * compression, world, rate_bps) for b in nbytes]
    stretch = 1.0
    for _ in range(8):  # contention: backward stretched by the communication running beside it
        r = [x * stretch for x in ready]
        backward = base_backward * stretch
        starts, ends, prev = [], [], 0.0
        for ready_b, d in zip(r, durations):
            start = max(forward + (ready_b if overlap else backward), prev)
            d = _beside_compute(start, d, forward + backward, model.kappa_comm)
            starts.append(start)
            ends.append(start + d)
            prev = start + d
        new = 1.0 + kappa * _busy_fraction(forward, backward, starts, ends)
        if abs(new - stretch) < 1e-6:
            break
        stretch = new
    end = max([forward + backward, *ends]) + trace.finalize_s
    comm = union_length(list(zip(starts, ends)))
    hidden = union_length(list(zip(starts, ends)), clip=(forward, forward + backward))
    synced_step = end + trace.other_s * compute_scale
    local_step = (trace.forward_s + trace.backward_s + trace.other_s) * compute_scale
    return Prediction(
        iteration_s=end, step_s=((no_sync_every - 1) * local_step + synced_step) / no_sync_every,
        backward_s=backward, exposed_comm_s=max(0.0, max(ends, default=0.0) - (forward + backward)),
        overlap_ratio=hidden / comm if comm > 0 else 0.0,
        buckets=[{"bytes": int(b), "ready_s": forward + x, "start_s": s, "end_s": e}
                 for b, x, s, e in zip(nbytes, r, starts, ends)])


def _buckets(trace: Trace, cap_mb: float | None, first_mb: float | None) -> tuple[list[float], list[int]]:
    """(ready time from forward end, bytes) per bucket: the trace's own, or re-planned with new caps."""
    if cap_mb is None and first_mb is None:
        return list(trace.ready_s), list(trace.bucket_bytes)
    if trace.plan is None:
        raise ValueError("re-planning with other bucket caps needs the trace's bucket plan")
    cap = cap_mb if cap_mb is not None else (trace.caps_mb or (25.0, 1.0))[0]
    first = first_mb if first_mb is not None else min(1.0, cap)
    param_ready = trace.param_ready_s()
    order = [p for bucket in trace.plan.buckets for p in bucket.params]  # the observed order
    plan = rebuild_plan(plan_buckets(trace.plan.specs, cap, first), order, cap, first)
    ready = [max(param_ready[p] for p in b.params) for b in plan.buckets]
    return ready, [b.nbytes for b in plan.buckets]


_RESULT_FIX = ("pass the result JSON of the overlap experiment on the emulated cluster: `portddp run overlap -n 2 "
               "--hosts 2 --link matched -- --batch 1024` writes results/overlap-n2-h2-<rate>mbit.json")


def _refuse(what: str, fix: str) -> NoReturn:
    """End the command with one line: what is wrong (naming the value) and what to do instead."""
    raise SystemExit(f"portddp simulate: {what} -- {fix}")


def _result_fix(near: Path) -> str:
    """_RESULT_FIX, naming the overlap results that lie in `near` (a directory) if there are any."""
    found = sorted(str(p) for p in near.glob("overlap-*.json") if not p.name.endswith(".trace.json"))
    return _RESULT_FIX + (f" (here: {', '.join(found[:3])})" if near.is_dir() and found else "")


def _read_result(path: str) -> dict:
    """The experiment result at `path`, refusing what is not one (the runner's JSON: world, rows)."""
    import json  # noqa: PLC0415

    p = Path(path)
    if not p.exists():
        _refuse(f"{path} does not exist", _result_fix(p.parent))
    if p.is_dir():
        _refuse(f"{path} is a directory, not a result file", _result_fix(p))
    try:
        payload = json.loads(p.read_text())
    except OSError as e:
        _refuse(f"cannot read {path} ({e.strerror})", _result_fix(p.parent))
    except ValueError as e:  # not UTF-8, or not JSON
        _refuse(f"{path} is not JSON ({e})" if isinstance(e, json.JSONDecodeError) else f"{path} is not JSON text",
                _result_fix(p.parent))
    if not (isinstance(payload, dict) and isinstance(payload.get("rows"), list)
            and isinstance(payload.get("world"), dict) and "size" in payload["world"]):
        # The runner writes a Chrome trace beside each result, under a name easily taken for it.
        fix = (f"pass the result written beside it, {path[:-len('.trace.json')]}.json"
               if path.endswith(".trace.json") else _result_fix(p.parent))
        _refuse(f"{path} is not an overlap-experiment result (it has no 'world' and 'rows' of measured iterations)",
                fix)
    return payload


_OFF = " (no overlap)"  # the label suffix of an implementation's row measured without overlap


def _rate_text(bps: float | None) -> str:
    """A link rate as people write it: 'unlimited', '600 Mbit/s', '10 Gbit/s'."""
    if not bps:
        return "unlimited"
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def _link_rate(text: str) -> float | None:
    """--link as `portddp cluster --link` reads it (a unit required; 0 or unlimited: no limit)."""
    try:
        return parse_rate(text)
    except ValueError as e:
        _refuse(f"--link {text.strip()} is not a link rate ({e})",
                "write it with its unit, e.g. 10gbit or 500mbit; unlimited (or 0) for no limit")


def _check_options(ns) -> None:
    """Refuse option values simulate() would refuse, naming the option: its ValueError lists every
    constraint at once. NaN fails every comparison, so each test is written to refuse it too."""
    if ns.world is not None and ns.world < 1:
        _refuse(f"--world {ns.world} is not a number of ranks", "pass --world 1 or more, or leave it out for the "
                "trace's own world size")
    for flag, cap in (("--bucket-cap", ns.bucket_cap), ("--first-bucket-cap", ns.first_bucket_cap)):
        if cap is not None and not cap > 0:
            _refuse(f"{flag} {cap:g} is not a bucket size", f"pass megabytes > 0, e.g. {flag} 4 (inf: no cap; as "
                    "in DDP the first bucket is capped apart, at min(1, --bucket-cap) MB unless --first-bucket-cap "
                    "says otherwise: both inf for one bucket), or leave it out for the trace's own buckets")
    if not 0 < ns.compression <= 1:
        _refuse(f"--compression {ns.compression:g} is not a fraction of the bytes sent", "pass 0 < c <= 1: 0.5 for "
                "fp16/bf16 hooks, 1 (the default) for none")
    if ns.no_sync_every < 1:
        _refuse(f"--no-sync-every {ns.no_sync_every} is not a number of steps", "pass k >= 1 to synchronize every "
                "k-th step (1, the default: every step)")
    if not 0 < ns.compute_scale < math.inf:
        _refuse(f"--compute-scale {ns.compute_scale:g} is not a factor on compute time", "pass a number > 0, e.g. "
                "0.5 for a device twice as fast (1, the default: the measured one)")
    if ns.hop_latency_us is not None and not 0 <= ns.hop_latency_us < math.inf:
        _refuse(f"--hop-latency-us {ns.hop_latency_us:g} is not a latency", "pass microseconds >= 0, e.g. 10, or "
                "leave it out to fit it")


ALPHA_NOTE_S = 5e-3
"""A fitted alpha above this (and above half a measured all-reduce) is noted as the machine's, not the link's."""


def _note_fit(result: str, link: LinkModel, samples) -> None:
    """What the fit could not know, on stderr: all-reduces quicker than the trace's link allows (their bytes
    did not all cross it at its rate: a token bucket's burst, or traffic that stayed on the host), and a
    fixed cost that could not be told from a per-byte one."""
    wire = [(t, 2 * (n - 1) / n * b * 8 / r) for b, n, r, t in samples if r]
    if wire and (ratio := float(np.median([t / w for t, w in wire]))) < 0.9:
        print(f"portddp simulate: note: {result}'s all-reduces took {ratio:.2f} x the time their bytes need on its "
              f"{_rate_text(link.rate_bps)} link (median over {_count(len(wire), 'bucket')}): they did not all "
              "cross it at that rate (a bucket smaller than the link's burst, or traffic that stayed on the host), "
              "so the link model under-counts the wire; measure with larger buckets or a faster link",
              file=sys.stderr)
    took = float(np.median([t for *_, t in samples])) if samples else 0.0
    if link.rate_bps is not None and link.alpha_s > ALPHA_NOTE_S and link.alpha_s > 0.5 * took:  # (a link crossed)
        print(f"portddp simulate: note: the fitted fixed cost per all-reduce, alpha {_duration_text(link.alpha_s)}, "
              f"is {link.alpha_s / took * 100:.0f} % of {result}'s median all-reduce ({_duration_text(took)}) and far "
              "above a LAN's (tens of microseconds to ~2 ms): time its all-reduces spent beyond the wire -- a busy "
              "machine's, most often -- which no faster --link and no --compute-scale shortens, so predictions at "
              "faster links are upper bounds. Measure on a quiet machine (more rounds: -- --rounds 8)",
              file=sys.stderr)
    if not link.separable:
        sizes = sorted({b for b, *_ in samples})
        print(f"portddp simulate: note: every all-reduce of {result} moved about the same bytes "
              f"({sizes[0] / 1e6:.2f}" + (f"-{sizes[-1] / 1e6:.2f}" if len(sizes) > 1 else "") + " MB), which cannot "
              "tell a fixed cost per all-reduce from a per-byte cost of the hosts: the time beyond the wire is taken "
              "as fixed (alpha; host 0 ns/byte), which a faster --link then shortens only by the wire's share. To fit "
              "both, measure a model whose buckets differ in size (e.g. `portddp run overlap ... -- --model gpt`)",
              file=sys.stderr)


def main(argv=None) -> int:
    """`portddp simulate RESULT.json --world 64 --link 10gbit --bucket-cap 4`.

    Bad input ends with one line on stderr, `portddp simulate: <what is wrong> -- <the fix>`, and exit
    status 1: the library's ValueErrors say what a value must be, not which option gave it."""
    import argparse  # noqa: PLC0415
    import shlex  # noqa: PLC0415
    import time  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="portddp simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("result", help="an overlap experiment's JSON (e.g. results/overlap-n2-h2-1gbit.json, written by `portddp run overlap -n 2 "
                        "--hosts 2 --link 1gbit`)")
    parser.add_argument("--impl", default="torch-c10d", help="which implementation's row to replay: torch-c10d, "
                        "torch-mpi or jax-hooked (rows with per-bucket events; native and jax-compiled have none); "
                        "its '(no overlap)' row, when the result has one, is read for the fit")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: the trace's)")
    parser.add_argument("--link", default=None, help="link rate, e.g. 10gbit (default: the trace's)")
    parser.add_argument("--bucket-cap", type=float, default=None, help="bucket cap in MB (re-planned; inf: no cap)")
    parser.add_argument("--first-bucket-cap", type=float, default=None,
                        help="first bucket's cap in MB (re-planned; default: min(1, bucket cap), as DDP's; "
                        "with --bucket-cap inf, inf for one bucket)")
    parser.add_argument("--no-overlap", action="store_true", help="reduce every bucket after backward")
    parser.add_argument("--compression", type=float, default=1.0, help="0.5 for fp16/bf16 hooks")
    parser.add_argument("--no-sync-every", type=int, default=1,
                        help="synchronize every k-th step, accumulating locally in between (default: 1)")
    parser.add_argument("--compute-scale", type=float, default=1.0, help="compute time x this (faster device: < 1)")
    parser.add_argument("--hop-latency-us", type=float, default=None, help="latency of one ring step (default: "
                        "fitted; 0 when the trace has one world size -- set it to extrapolate to many ranks)")
    ns = parser.parse_args(argv)
    _check_options(ns)
    link_rate = _link_rate(ns.link) if ns.link else None
    payload = _read_result(ns.result)
    # A cluster of one host is loopback too: its ranks met in shared memory, no byte crossed the link.
    crossed = bool(payload.get("cluster")) and payload["cluster"].get("hosts", 2) > 1
    trace_rate = payload["cluster"].get("rate_bps") if crossed else None
    if not all(isinstance(r, dict) and isinstance(r.get("label"), str) for r in payload["rows"]):
        _refuse(f"{ns.result} holds rows that are not the overlap experiment's (each a dict with a 'label')",
                _result_fix(Path(ns.result).parent))
    rows = {r["label"]: r for r in payload["rows"]}
    # (an implementation's "(no overlap)" row is its fit's other half, not a row to replay by itself)
    replayable = [label for label, r in rows.items() if why_not_replayable(r) is None and not label.endswith(_OFF)]
    fix = (f"pass --impl one of: {', '.join(shlex.quote(label) for label in replayable)}" if replayable else
           f"{ns.result} has no row that can be; " + _RESULT_FIX)
    if ns.impl not in rows:
        _refuse(f"{ns.result} has no row {ns.impl!r} (it has {', '.join(map(repr, rows))})", fix)
    if why := why_not_replayable(rows[ns.impl]):
        _refuse(f"--impl {ns.impl} cannot be replayed bucket by bucket: {why}", fix)
    if ns.impl.endswith(_OFF):
        _refuse(f"--impl {ns.impl!r} is the no-overlap half of {ns.impl[:-len(_OFF)]!r}'s measurement, which the fit "
                f"reads by itself", f"pass --impl {shlex.quote(ns.impl[:-len(_OFF)])}, and --no-overlap to predict "
                "without overlap")
    world = payload["world"]["size"]
    if world < 2 and (ns.world or 1) > 1:  # (its all-reduces send nothing: no bandwidth to fit)
        _refuse(f"{ns.result} was measured with {world} rank, whose all-reduces send no bytes: it says nothing "
                f"about the link, so it cannot predict --world {ns.world}", "pass the result of a run with 2 ranks "
                "or more (e.g. portddp run overlap -n 2 --hosts 2 --link 1gbit)")
    t0 = time.perf_counter()
    try:  # (a result edited by hand, or written by something else, gets one line, not a traceback)
        on = Trace.from_row(rows[ns.impl], world)
        off_row = rows.get(ns.impl + _OFF)
        off = Trace.from_row(off_row, world) if off_row and why_not_replayable(off_row) is None else on
        measured = float(rows[ns.impl]["median_s"])
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        _refuse(f"{ns.result}'s row {ns.impl!r} (or its {_OFF.strip()} row) is not as the overlap experiment writes it "
                f"({type(e).__name__}: {e})",
                "pass a result as the experiment wrote it, or rerun the experiment")
    if off.plan is None and (ns.bucket_cap is not None or ns.first_bucket_cap is not None):
        flag = "--bucket-cap" if ns.bucket_cap is not None else "--first-bucket-cap"
        _refuse(f"{flag} {ns.bucket_cap if ns.bucket_cap is not None else ns.first_bucket_cap:g} needs the "
                f"bucket plan to re-plan, and {ns.result}'s row {ns.impl!r} records none", "leave out --bucket-cap "
                "and --first-bucket-cap, or rerun the experiment (this version's runs record their plan)")
    try:
        model = Model.fit(on, off, trace_rate) if off is not on else Model(fit_link(samples_from_trace(on, trace_rate)))
    except ValueError as e:  # fit_link: no all-reduce took any time (a world of one)
        _refuse(f"{ns.result}'s row {ns.impl!r} ({world} ranks) has no all-reduce to fit the link to ({e})",
                "pass the result of a run with 2 ranks or more")
    if ns.hop_latency_us is not None:
        model = dataclasses.replace(model, link=dataclasses.replace(model.link, hop_s=ns.hop_latency_us * 1e-6))
    link = model.link
    rate = link_rate if ns.link else trace_rate
    world_to = ns.world if ns.world is not None else world
    # Replayed: the iteration without overlap (compute undisturbed by communication), when there is one.
    p = simulate(off, model, world=world_to, rate_bps=rate, bucket_cap_mb=ns.bucket_cap,
                 first_bucket_cap_mb=ns.first_bucket_cap, overlap=not ns.no_overlap, compression=ns.compression,
                 no_sync_every=ns.no_sync_every, compute_scale=ns.compute_scale)
    took = time.perf_counter() - t0
    # The measured point itself, replayed: how far the model is from its own trace (a noisy trace --
    # a shared machine, few rounds -- shows here, before any extrapolation is trusted).
    own = simulate(off, model, world=world, rate_bps=trace_rate).step_s
    if measured > 0 and abs(own / measured - 1) > 0.10:  # (--no-overlap too: the same two numbers)
        print(f"portddp simulate: warning: replayed at its own point ({_count(world, 'rank')}, link "
              f"{_rate_text(trace_rate) if crossed else 'loopback'}) the model gives a step of {own * 1e3:.1f} ms, "
              f"{(own / measured - 1) * 100:+.0f} % from the {measured * 1e3:.1f} ms measured: the trace's rows "
              "disagree (its row without overlap, which is replayed, took longer or shorter outside the backward "
              "pass than the row with overlap -- noise on a busy machine, or too few rounds). Read the prediction "
              "with that error in mind, or measure again on a quiet machine with more rounds (-- --rounds 8)",
              file=sys.stderr)
    if not crossed:
        where = ("on one emulated host, whose ranks all-reduced in its shared memory" if payload.get("cluster") else
                 "on this machine's loopback, not on an emulated cluster")
        print(f"portddp simulate: note: {ns.result} ran {where}: its ranks shared cores and memory and no link "
              "shaped their traffic, so the fitted link and contention describe this machine; for predictions "
              "across links, measure on an emulated cluster of 2 hosts or more (`portddp run overlap -n 2 --hosts 2 "
              "--link matched -- --batch 1024`, root)", file=sys.stderr)
    _note_fit(ns.result, model.link, samples_from_trace(off, trace_rate))
    if world_to > world and ns.hop_latency_us is None and link.hop_s == 0:
        print(f"portddp simulate: note: {ns.result} was measured at {_count(world, 'rank')} only, which cannot tell "
              "the latency of one ring step from the fixed cost of an all-reduce: it is taken as 0, so the "
              f"prediction at {_count(world_to, 'rank')} grows only with the wire's share 2(n-1)/n, not with the "
              "ring's 2(n-1) steps of latency (which dominate small buckets at many ranks). Pass --hop-latency-us "
              "(e.g. 10, a switched LAN's) to include it", file=sys.stderr)
    print(f"trace: {ns.impl} from {ns.result} ({_count(world, 'rank')}, link "
          f"{_rate_text(trace_rate) if crossed else 'loopback'}): measured step "
          f"{measured * 1e3:.1f} ms, replayed {own * 1e3:.1f} ms ({(own / measured - 1) * 100:+.1f} %)")
    print(f"link model: alpha {_duration_text(link.alpha_s)} per all-reduce, {_duration_text(link.hop_s)} per ring "
          f"step, host {link.host_s_per_byte * 1e9:.3f} ns/byte "
          + (f"(host-bound at {8 / link.host_s_per_byte / 1e9:.2f} Gbit/s)" if link.host_s_per_byte else
             "(wire-bound)" if crossed else "(loopback: no wire, all of it fixed cost)")
          + f"; contention: compute x(1 + {model.kappa:.2f} f), communication beside compute x{1 + model.kappa_comm:.2f}")
    where_to = _rate_text(rate) if rate or crossed or ns.link else "loopback, as measured"
    print(f"prediction at {_count(world_to, 'rank')}, link {where_to}: {p.summary()}; x{p.step_s / own:.2f} the "
          f"step replayed at the trace's own point ({own * 1e3:.1f} ms; fitted and replayed in {took * 1e3:.0f} ms)")
    return 0


def _duration_text(seconds: float) -> str:
    """A fitted time in the unit that reads best: '850.0 us', '30.82 ms'."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    raise SystemExit(main())
