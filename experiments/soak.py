"""Soak: a long run per implementation, watching for leaks.

    mpirun -n 2 python -m experiments.soak                      # 2000 iterations each (~30 min on 2 cores)
    mpirun -n 2 python -m experiments.soak --iterations 300 --impls torch-mpi

For each implementation in turn: the benchmark MLP for `iterations` steps.
After `warmup` steps (JAX has compiled, the plan has been rebuilt, the
allocator has reached its working set) it records the resident memory, the
number of threads and of open file descriptors, then samples them every
`every` steps until the end. Resident memory of a healthy run still swings by
several buffers (the allocators keep and return blocks: JAX's hooked strategy
swings by ~200 MB around a flat floor), so growth is the median of the second
half of the samples against the median of the first half: a leak moves the
whole distribution up, a swing does not. The last sample against the first and
the peaks are reported too. Passes when that growth is under `max_rss_growth`
(5 %) and threads and open files did not grow at all, on every rank. Not part
of CI (it takes half an hour); its numbers go in the README.

    python -m experiments.soak --summarize results/soak/soak.json   # the table again, from a run's samples
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import time

import portddp
from harness.adapter import IMPLEMENTATIONS, Workload, check_implementations, make_trainer
from harness.config import parse_config
from harness.measure import Memory
from harness.results import write_result


@dataclasses.dataclass
class Config(Workload):
    iterations: int = dataclasses.field(default=2000, metadata={"help": "steps per implementation"})
    warmup: int = dataclasses.field(default=100, metadata={"help": "steps before the baseline is taken"})
    every: int = dataclasses.field(default=100, metadata={"help": "sample every this many steps"})
    max_rss_growth: float = dataclasses.field(default=0.05, metadata={"help": "allowed RSS growth after warm-up"})
    impls: tuple[str, ...] = dataclasses.field(default=("native", "torch-c10d", "torch-mpi", "jax-hooked",
                                                        "jax-compiled"), metadata={"help": "implementations"})
    out: str = dataclasses.field(default="results/soak/soak.json", metadata={"help": "JSON result path"})


RUN = "mpirun -n 2 python -m experiments.soak"
SUMMARIZE = "python -m experiments.soak --summarize RESULT.json"


def sample(memory: Memory) -> dict:
    return {"rss_mb": memory.rss_mb(), "threads": threading.active_count(),
            "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
            "open_files": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None}


def growth(samples: list[dict]) -> dict:
    """RSS growth over the samples taken after warm-up: median of the second half against
    median of the first (the pass/fail number), the last sample against the first, the peaks."""
    rss = [s["rss_mb"] for s in samples]
    half = max(1, len(rss) // 2)
    first, second = statistics.median(rss[:half]), statistics.median(rss[half:] or rss)
    return {"rss_growth": (second - first) / first, "rss_last_vs_first": (rss[-1] - rss[0]) / rss[0],
            "rss_peak_growth": (max(rss[half:] or rss) - max(rss[:half])) / max(rss[:half])}


def soak(impl: str, cfg: Config, world, memory: Memory, say) -> dict:
    trainer = make_trainer(impl, cfg, world)
    samples, t0 = [], time.perf_counter()
    for i in range(1, cfg.iterations + 1):
        trainer.step()
        if i >= cfg.warmup and (i - cfg.warmup) % cfg.every == 0 or i == cfg.iterations:
            samples.append({"iteration": i, **sample(memory)})
            say(f"  {impl}: step {i}/{cfg.iterations}, RSS {samples[-1]['rss_mb']:.1f} MB, "
                f"{samples[-1]['os_threads']} threads, {samples[-1]['open_files']} open files", flush=True)
    base, last = samples[0], samples[-1]
    result = {
        "impl": impl, "seconds": time.perf_counter() - t0, "samples": samples, **growth(samples),
        "peak_rss_mb_after_warmup": max(s["rss_mb"] for s in samples),
        "thread_growth": last["os_threads"] - base["os_threads"],
        "open_file_growth": last["open_files"] - base["open_files"],
        "loss": trainer.loss,
    }
    result["ok"] = (result["rss_growth"] < cfg.max_rss_growth and result["thread_growth"] <= 0
                    and result["open_file_growth"] <= 0)
    del trainer
    return result


def summary_row(impl: str, everyone: list[dict]) -> dict:
    """One implementation over every rank: the worst rank's numbers, and whether all passed."""
    worst = {k: max(r[k] for r in everyone) for k in ("rss_growth", "rss_last_vs_first", "rss_peak_growth",
                                                      "thread_growth", "open_file_growth", "seconds")}
    return {"impl": impl, "ranks": everyone, "ok": all(r["ok"] for r in everyone), **worst}


def describe(row: dict) -> str:
    return (f"{row['impl']}: RSS growth after warm-up {row['rss_growth'] * 100:+.2f} % (worst rank; medians of the "
            f"halves; last vs first {row['rss_last_vs_first'] * 100:+.2f} %, peaks {row['rss_peak_growth'] * 100:+.2f}"
            f" %), threads {row['thread_growth']:+d}, open files {row['open_file_growth']:+d}, {row['seconds']:.0f} s"
            f" -> {'ok' if row['ok'] else 'FAILED'}")


def summarize(path: str, max_rss_growth: float) -> int:
    """Re-read a soak JSON and print its table with this module's measures."""
    import json  # noqa: PLC0415

    try:
        payload = json.loads(open(path).read())
    except FileNotFoundError:
        raise SystemExit(f"no soak result at {path}: run the soak first ({RUN}, which writes "
                         f"{Config.out}), or pass the path of a run's JSON") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read a soak result ({e}): pass the JSON a soak run wrote") from None
    if not isinstance(payload, dict) or payload.get("experiment") != "soak" or "results" not in payload:
        raise SystemExit(f"{path}: not a soak result (no per-implementation results): pass the JSON a soak run "
                         f"wrote, e.g. {Config.out}")
    ok = True
    for r in payload["results"]:
        for rank in r["ranks"]:
            rank.update(growth(rank["samples"]))
            rank["ok"] = rank["rss_growth"] < max_rss_growth and rank["thread_growth"] <= 0 and \
                rank["open_file_growth"] <= 0
        row = summary_row(r["impl"], r["ranks"])
        ok &= row["ok"]
        print(describe(row))
    return 0 if ok else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        if len(argv) != 2:
            raise SystemExit(f"usage: {SUMMARIZE} (a soak run's JSON, e.g. {Config.out})")
        raise SystemExit(summarize(argv[1], Config.max_rss_growth))
    cfg = parse_config(Config, argv, __doc__.split("\n\n")[0],
                       epilog=f"{SUMMARIZE}: print a finished run's table again from its samples (e.g. "
                              f"{Config.out}); nothing is run.")
    check_implementations(cfg.impls, IMPLEMENTATIONS)
    cfg.validate()
    if cfg.warmup >= cfg.iterations:
        raise SystemExit(f"--warmup {cfg.warmup} must be below --iterations {cfg.iterations}")
    if cfg.every < 1:
        raise SystemExit(f"--every {cfg.every} is not a number of steps: pass --every 1 or more")
    world = portddp.init(jax_distributed="jax-compiled" in cfg.impls)
    say = print if world.rank == 0 else (lambda *a, **k: None)
    memory = Memory()
    say(f"soak: {cfg.iterations} iterations per implementation, {world.size} ranks, {cfg.describe()}", flush=True)
    from portddp.transport import get_transport  # noqa: PLC0415

    results = []
    for impl in cfg.impls:
        mine = soak(impl, cfg, world, memory, say)
        everyone = get_transport().allgather_object(mine)
        row = summary_row(impl, everyone)
        results.append(row)
        say(describe(row), flush=True)
    if world.rank == 0:
        write_result(cfg.out, {"experiment": "soak", "config": dataclasses.asdict(cfg), "results": results})
        print(f"wrote {cfg.out}")
        print(" ".join(f"{r['impl']}_rss_growth={r['rss_growth']:.4f}" for r in results), flush=True)
    raise SystemExit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
