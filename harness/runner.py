"""Run a list of variants (implementation + knobs), interleaved, and write one JSON.

    payload = runner.run("overlap", cfg, variants)    # variants(cfg, world) -> [Variant, ...]

Each experiment (experiments/*.py) only lists its variants; this module
measures them the same way: build and warm up each variant, then rounds in
which every variant of a group runs a few steps in turn (each round starting
with another one), so the machine's noise hits them alike. Groups run one after
another (one group's models in memory at a time). Per variant: the median step
time (each step's on its slowest rank), DESIGN.md's metrics, CPU seconds per
step by thread group (harness.measure), peak memory, gradient memory, the
bucket plan, the last iteration's events, and on the emulated cluster the bytes
on the wire.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import portddp
from harness.adapter import IMPLEMENTATIONS, Workload, check_implementations, make_trainer
from harness.measure import GROUPS, CpuMeter, Memory, frozen_heap, no_collection, rotated
from harness.results import environment, median, out_dir_problem, write_result
from portddp import cluster, malloc
from portddp.launch import detect
from portddp.timeline import IterationEvents, chrome_trace
from portddp.transport import get_transport

__all__ = ["ExperimentConfig", "Variant", "run"]


@dataclasses.dataclass
class ExperimentConfig(Workload):
    seq: int = dataclasses.field(default=64, metadata={"help": "gpt: tokens per sequence (0: its block size)"})
    warmup: int = dataclasses.field(default=3, metadata={"help": "untimed steps per variant (JAX compiles here)"})
    rounds: int = dataclasses.field(default=3, metadata={"help": "interleaved rounds"})
    warmup_rounds: int = dataclasses.field(
        default=0, metadata={"help": "untimed interleaved rounds first: the process's memory settles into the "
                                     "layout the interleaving gives (its first rounds fault pages back in)"})
    steps_per_round: int = dataclasses.field(default=4, metadata={"help": "timed steps per variant per round"})
    impls: tuple[str, ...] = dataclasses.field(default=IMPLEMENTATIONS[:5], metadata={"help": "implementations"})
    out_dir: str = dataclasses.field(default="results", metadata={"help": "where the JSON goes"})
    ranks: int = dataclasses.field(default=0, metadata={"help": "ranks this run must have (0: any)"})

    def implementations(self) -> set[str]:
        """Every implementation the experiment's variants will build (what portddp.init must start)."""
        return set(self.impls)

    def validate_schedule(self) -> None:
        """Refuse a measurement schedule that measures nothing, naming the value and the fix.

        Called by run() on every rank (each parsed the same arguments) before portddp.init or any
        model: `--rounds 0` would otherwise write a result of NaN medians over an earlier good
        one, and `--steps-per-round 0` fail at the first per-step division."""
        for flag, value, least, what in (
                ("--rounds", self.rounds, 1, "measures nothing (the timed steps come from the interleaved rounds)"),
                ("--steps-per-round", self.steps_per_round, 1, "measures nothing (each round times that many "
                                                               "steps per variant)"),
                ("--warmup", self.warmup, 0, "is not a number of untimed steps per variant (0: none)"),
                ("--warmup-rounds", self.warmup_rounds, 0, "is not a number of untimed rounds (0: none)"),
                ("--ranks", self.ranks, 0, "is not a number of ranks the run must have (0: any)")):
            if value < least:
                raise SystemExit(f"{flag} {value} {what}: pass {flag} {least} or more")
        problem = out_dir_problem(self.out_dir, "--out-dir")
        if problem:
            raise SystemExit(problem)
        caps = [("--bucket-cap-mb", getattr(self, "bucket_cap_mb", None)),
                *(("--caps", c) for c in getattr(self, "caps", ()))]
        for flag, cap in caps:  # (what DistributedDataParallel would refuse on every rank, with a traceback)
            if isinstance(cap, (int, float)) and not cap > 0:
                raise SystemExit(f"{flag} {cap:g} is not a bucket size: pass megabytes > 0, e.g. {flag} 4 (inf: one "
                                 "bucket per dtype)")


@dataclasses.dataclass
class Variant:
    label: str  # unique within the experiment
    impl: str
    knobs: dict
    group: str  # variants of a group are interleaved with each other
    params: dict  # what the report groups and plots by, e.g. {"bucket_cap_mb": 4.0}
    model: dict = dataclasses.field(default_factory=dict)  # Workload fields to change, e.g. {"model": "gpt"}
    warmup: int | None = None  # untimed steps, if not the config's (e.g. bucket_cap_mb="auto" tunes during them)
    rounds: int | None = None  # interleaved rounds of its group, if not the config's (a group takes its members' most)


def run(name: str, cfg: ExperimentConfig, make_variants: Callable[[ExperimentConfig, object], Sequence[Variant]]
        ) -> dict:
    """The experiment `name`: its variants measured as the module docstring says, the result JSON
    written (and returned). Ctrl-C: one line per rank and exit 130, no traceback."""
    try:
        return _run(name, cfg, make_variants)
    except KeyboardInterrupt:
        print(f"{name}: rank {detect().rank} interrupted (SIGINT: Ctrl-C, or its launcher stopping the job): no result written", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _run(name: str, cfg: ExperimentConfig, make_variants: Callable[[ExperimentConfig, object], Sequence[Variant]]
         ) -> dict:
    cfg.validate_schedule()
    check_implementations(sorted(cfg.implementations()))
    launched = detect().size
    if cfg.ranks and cfg.ranks != launched:
        raise SystemExit(f"experiment {name!r} was asked for {cfg.ranks} ranks but launched with {launched}: "
                         f"run `mpirun -n {cfg.ranks} python -m experiments.{name}`")
    # Before any variant exists: every row runs with the same allocator settings (portddp.jax's
    # hooked strategy sets them for itself when it is built, process-wide).
    malloc.keep_freed_memory()
    world = portddp.init(jax_distributed="jax-compiled" in cfg.implementations())
    say = print if world.rank == 0 else (lambda *a, **k: None)
    variants = list(make_variants(cfg, world))
    for v in variants:
        _workload(cfg, v).validate(world.size)
    groups: dict[str, list[Variant]] = {}
    for v in variants:
        groups.setdefault(v.group, []).append(v)
    say(f"{name}: {len(variants)} variants in {len(groups)} group(s), {world.size} rank{'s' if world.size != 1 else ''}", flush=True)
    memory = Memory()
    rows, traces = [], []
    for g, (group, members) in enumerate(groups.items(), start=1):
        say(f"  [{g}/{len(groups)}] {group}: {_workload(cfg, members[0]).describe()}; building "
            f"and warming up {len(members)} variant(s)", flush=True)
        trainers, peak_mb = {}, {}
        beat = _heartbeat(say)
        with frozen_heap():
            for v in members:
                # Built and warmed up one at a time, so that each one's peak resident memory is its own.
                memory.start()
                trainers[v.label] = t = make_trainer(v.impl, _workload(cfg, v), world, **v.knobs)
                beat(f"{v.label} built")
                warmup = cfg.warmup if v.warmup is None else v.warmup
                for k in range(warmup):
                    t.step()
                    beat(f"{v.label}: warm-up step {k + 1}/{warmup}")
                peak_mb[v.label] = memory.peak_mb()
        times = {label: [] for label in trainers}
        stats = {label: [] for label in trainers}
        cpu = {label: CpuMeter() for label in trainers}
        wire = {label: [] for label in trainers}  # on the emulated cluster: bytes this host sent per step
        order = list(trainers.items())
        with frozen_heap():  # (the trainers too: the collection before each turn walks what the steps made)
            for _ in range(cfg.warmup_rounds):
                for _label, t in order:
                    for _ in range(cfg.steps_per_round):
                        t.step()
            n_rounds = max(v.rounds or cfg.rounds for v in members)
            for r in range(n_rounds):
                beat(f"round {r + 1}/{n_rounds}")
                for label, t in rotated(order, r):
                    with no_collection():
                        # (every turn starts together: else a communicating variant's first step would
                        # include its peers' lateness -- their collection, a local variant's drift)
                        before = _settled_interface_bytes()
                        cpu[label].start()
                        for _ in range(cfg.steps_per_round):
                            times[label].append(t.step())
                            stats[label].append(t.stats())
                        cpu[label].stop(cfg.steps_per_round)
                        after = _settled_interface_bytes()
                    if before is not None:
                        wire[label].append((after["tx_bytes"] - before["tx_bytes"]) / cfg.steps_per_round)
        # A step of a synchronous job takes as long as its slowest rank's: so does each step's time
        # here, for every variant alike (a local variant's rank that is slower by itself is the
        # bound a communicating one meets; rank 0's time alone would hide it from the limit).
        slowest = {label: _slowest_per_step(ts) for label, ts in times.items()}
        for v in members:
            t = trainers[v.label]
            events = _median_events(times[v.label], stats[v.label]) or t.events()
            rows.append({
                "label": v.label, "impl": v.impl, "group": group, "params": v.params, "knobs": v.knobs,
                "model": _workload(cfg, v).model, "peak_mb": peak_mb[v.label], "grad_mb": t.grad_mb(),
                "median_s": median(slowest[v.label]), "times_s": slowest[v.label],
                "rank0_median_s": median(times[v.label]), "loss": t.loss,
                "metrics": _median_metrics(stats[v.label]),
                "cpu": _gather_cpu(cpu[v.label]),
                "hlo": stats[v.label][-1].get("hlo") if stats[v.label] else None,
                "auto": t.autotune(),
                "wire_bytes_per_step": _hosts_mean(wire[v.label], world), "param_bytes": t.param_bytes(),
                "plan": t.plan(),
                "events": events.to_dict() if events is not None else None,
            })
        traces += _gather_events(members, trainers)
        say(f"  [{g}/{len(groups)}] {group}: " + "  ".join(
            f"{v.label} {median(slowest[v.label]) * 1e3:.1f} ms" for v in members), flush=True)
        del trainers
    where = cluster.cluster_info()
    if where is None:
        command = " ".join([f"mpirun{_binding()} -n {world.size} python -m experiments.{name}", *sys.argv[1:]])
        stem = f"{name}-n{world.size}"
    else:
        command = " ".join([f"portddp run {name} -n {world.size} --hosts {where['hosts']} --link {where['link']} --",
                            *sys.argv[1:]])
        stem = f"{name}-n{world.size}-h{where['hosts']}-{where['link']}"
    payload = {"experiment": name, "portddp_version": portddp.__version__, "command": command,
               "config": dataclasses.asdict(cfg), "cluster": where,
               "cluster_unavailable": os.environ.get("PORTDDP_CLUSTER_UNAVAILABLE"),
               # (--link matched: the calibration run that chose the rate, harness/calibrate.py)
               "calibration": json.loads(os.environ["PORTDDP_CALIBRATION"]) if where and os.environ.get(
                   "PORTDDP_CALIBRATION") else None,
               "world": dataclasses.asdict(world), "environment": environment(), "rows": rows}
    payload["path"] = f"{cfg.out_dir}/{stem}.json"
    if world.rank == 0:
        path = write_result(payload["path"], payload)
        trace = Path(cfg.out_dir) / f"{stem}.trace.json"
        trace.write_text(chrome_trace(traces))
        print(f"wrote {path} and {trace} (open in https://ui.perfetto.dev)")
    return payload


def _binding() -> str:
    """The binding arguments `portddp run` gave mpirun (' -bind-to user:...'), else ''."""
    bound = os.environ.get("PORTDDP_MPIRUN_BIND", "")
    return f" {bound}" if bound else ""


# The benchmark's models (experiments.bench, and the probes beside it): name -> Workload fields.
MODELS = {
    "mlp": {"model": "mlp"},  # the config's --width, --depth, --batch: 8 x Linear(1024), 64 by default
    "gelu-mlp": {"model": "mlp", "width": 1280, "depth": 6, "activation": "gelu", "batch": 48},
    "gpt": {"model": "gpt"},  # batch: --gpt-batch
}
GPT_BATCH = 4  # the gpt's sequences per rank per step
VIEW_OF = {"torch-mpi+view": "torch-mpi"}  # a variant named alone: the implementation it builds, with the view


def bench_model_fields(model: str, gpt_batch: int = GPT_BATCH) -> dict:
    """The Workload fields the benchmark's `model` changes from an experiment's config."""
    return MODELS[model] | ({"batch": gpt_batch} if model == "gpt" else {})


def bench_workload(model: str) -> Workload:
    """The Workload the benchmark trains `model` with by default."""
    return workload_of(ExperimentConfig(), bench_model_fields(model))


def _workload(cfg: ExperimentConfig, v: Variant) -> Workload:
    return workload_of(cfg, v.model)


def workload_of(cfg, model: dict) -> Workload:
    """The Workload an experiment's config describes, with `model`'s fields changed."""
    fields = {f.name for f in dataclasses.fields(Workload)}
    return Workload(**{k: getattr(cfg, k) for k in fields} | model)


def _gather_cpu(meter: CpuMeter) -> dict:
    """CPU seconds per step: every rank's (by group and by thread name), and their mean by group."""
    everyone = get_transport().allgather_object(meter.per_step())
    mean = {k: statistics.fmean(r[k] for r in everyone) for k in ("total", *GROUPS, "wall")}
    return {**mean, "per_rank": everyone}


def _slowest_per_step(mine: list[float]) -> list[float]:
    """Each step's time on the slowest rank (every rank's k-th timed step started after the same
    barrier and as many steps)."""
    return [max(step) for step in zip(*get_transport().allgather_object(mine))]


def _settled_interface_bytes() -> dict | None:
    """Once every rank got here (a barrier), this host's interface counters; None outside the
    emulated cluster.

    A rank's step can end while the tail of what it sent last is still queued in its socket or in
    the link's tbf queue (its peer needed those bytes, not this rank); the interface counts them
    only when they leave. The barrier's message from a peer arrives only after that peer received
    everything of this round, so after it the counters hold all of a round's bytes and none of the
    next's (plus the barrier's few bytes)."""
    get_transport().barrier()
    return None if cluster.cluster_info() is None else cluster.interface_bytes()


def _hosts_mean(samples: list[float], world) -> float | None:
    """Bytes a host sent per step, averaged over the hosts (each host's first rank reads its
    interface; the others report nothing); None outside the emulated cluster."""
    mine = median(samples) if samples and world.local_rank == 0 else None
    everyone = [x for x in get_transport().allgather_object(mine) if x is not None]
    return sum(everyone) / len(everyone) if everyone else None


def _gather_events(members, trainers) -> list:
    """(label, every rank's last IterationEvents) for each variant that records events."""
    mine = {v.label: e.to_dict() for v in members if (e := trainers[v.label].events()) is not None}
    everyone = get_transport().allgather_object(mine)
    return [(label, [IterationEvents.from_dict(ranks[label]) for ranks in everyone]) for label in mine]


def _heartbeat(say, every_s: float = 20.0):
    """`beat(what)` prints `what` with the group's time so far, at most every `every_s` seconds: long
    groups only (a gpt group under load spent minutes building and warming up without a line)."""
    started = told = time.perf_counter()

    def beat(what: str) -> None:
        nonlocal told
        now = time.perf_counter()
        if now - told >= every_s:
            say(f"      {what} ({now - started:.0f} s so far)", flush=True)
            told = now

    return beat


def _median_events(times: list[float], samples: list[dict]):
    """The events of this rank's median timed iteration (what a row records for portddp.simulate, whose
    link fit reads one iteration's bucket durations: a typical one, not the last, which may be an
    outlier -- a bucket that waited 600 ms in a noisy run); None where the steps recorded none."""
    if not times or len(samples) != len(times):
        return None
    middle = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    events = samples[middle].get("events")
    return events if hasattr(events, "to_dict") else None


def _median_metrics(samples: list[dict]) -> dict:
    keys = {k for s in samples for k, v in s.items() if isinstance(v, float)}
    return {k: statistics.median(s[k] for s in samples if k in s) for k in sorted(keys)}
