"""Soak: a long run per implementation, watching for leaks.

    mpirun -n 2 python -m experiments.soak                      # 2000 iterations each (~30 min on 2 cores)
    mpirun -n 2 python -m experiments.soak --iterations 300 --impls torch-mpi

For each implementation in turn: the benchmark MLP for `iterations` steps.
After `warmup` steps (JAX has compiled, the plan has been rebuilt, the
allocator has reached its working set) it records the resident memory, the
number of threads and of open file descriptors, then samples them every
`every` steps until the end. Resident memory of a healthy run still swings by
a few buffers (the allocators keep and return blocks), so growth is measured
on the high-water marks: the peak of the second half of the samples against
the peak of the first half. A leak raises the peaks step after step; a swing
does not. Passes when that growth is under `max_rss_growth` (5 %) and threads
and open files did not grow at all, on every rank. Not part of CI (it takes
half an hour); its numbers go in the README.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import portddp
from experiments.common import Memory, parse_config, write_result
from experiments.impls import IMPLEMENTATIONS, ModelConfig, check_implementations, make_trainer


@dataclasses.dataclass
class Config(ModelConfig):
    iterations: int = dataclasses.field(default=2000, metadata={"help": "steps per implementation"})
    warmup: int = dataclasses.field(default=100, metadata={"help": "steps before the baseline is taken"})
    every: int = dataclasses.field(default=100, metadata={"help": "sample every this many steps"})
    max_rss_growth: float = dataclasses.field(default=0.05, metadata={"help": "allowed RSS growth after warm-up"})
    impls: tuple[str, ...] = dataclasses.field(default=("native", "torch-c10d", "torch-mpi", "jax-hooked",
                                                        "jax-compiled"), metadata={"help": "implementations"})
    out: str = dataclasses.field(default="results/soak/soak.json", metadata={"help": "JSON result path"})


def sample(memory: Memory) -> dict:
    return {"rss_mb": memory.rss_mb(), "threads": threading.active_count(),
            "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
            "open_files": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None}


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
    half = max(1, len(samples) // 2)
    first_peak = max(s["rss_mb"] for s in samples[:half])
    second_peak = max(s["rss_mb"] for s in samples[half:]) if len(samples) > 1 else first_peak
    growth = (second_peak - first_peak) / first_peak
    result = {
        "impl": impl, "seconds": time.perf_counter() - t0, "samples": samples, "rss_growth": growth,
        "rss_last_vs_first": (last["rss_mb"] - base["rss_mb"]) / base["rss_mb"],
        "peak_rss_mb_after_warmup": max(s["rss_mb"] for s in samples),
        "thread_growth": last["os_threads"] - base["os_threads"],
        "open_file_growth": last["open_files"] - base["open_files"],
        "loss": trainer.loss,
    }
    result["ok"] = growth < cfg.max_rss_growth and result["thread_growth"] <= 0 and result["open_file_growth"] <= 0
    del trainer
    return result


def main(argv=None):
    cfg = parse_config(Config, argv, __doc__.split("\n\n")[0])
    check_implementations(cfg.impls, IMPLEMENTATIONS)
    if cfg.warmup >= cfg.iterations:
        raise SystemExit(f"--warmup {cfg.warmup} must be below --iterations {cfg.iterations}")
    world = portddp.init(jax_distributed="jax-compiled" in cfg.impls)
    say = print if world.rank == 0 else (lambda *a, **k: None)
    memory = Memory()
    say(f"soak: {cfg.iterations} iterations per implementation, {world.size} ranks, {cfg.depth} x "
        f"Linear({cfg.width}), batch {cfg.batch}/rank", flush=True)
    from portddp.transport import get_transport  # noqa: PLC0415

    results = []
    for impl in cfg.impls:
        mine = soak(impl, cfg, world, memory, say)
        everyone = get_transport().allgather_object(mine)
        row = {"impl": impl, "ranks": everyone, "ok": all(r["ok"] for r in everyone),
               "rss_growth": max(r["rss_growth"] for r in everyone),
               "rss_last_vs_first": max(r["rss_last_vs_first"] for r in everyone),
               "thread_growth": max(r["thread_growth"] for r in everyone),
               "open_file_growth": max(r["open_file_growth"] for r in everyone),
               "seconds": max(r["seconds"] for r in everyone)}
        results.append(row)
        say(f"{impl}: RSS peak growth after warm-up {row['rss_growth'] * 100:+.2f} % (worst rank; last sample vs "
            f"first {row['rss_last_vs_first'] * 100:+.2f} %), threads "
            f"{row['thread_growth']:+d}, open files {row['open_file_growth']:+d}, {row['seconds']:.0f} s -> "
            f"{'ok' if row['ok'] else 'FAILED'}", flush=True)
    if world.rank == 0:
        write_result(cfg.out, {"experiment": "soak", "config": dataclasses.asdict(cfg), "results": results})
        print(f"wrote {cfg.out}")
        print(" ".join(f"{r['impl']}_rss_growth={r['rss_growth']:.4f}" for r in results), flush=True)
    raise SystemExit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
