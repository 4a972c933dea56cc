"""Where one implementation's step spends its CPU: `perf record` of this process over timed steps.

    mpirun -bind-to user:0,1 -n 2 python -m experiments.step_profile jax-hooked mlp
    mpirun -bind-to user:0,1 -n 2 python -m experiments.step_profile torch-mpi+view gpt
    perf report -i results/perf-jax-hooked-mlp-0.data --no-children --sort dso,symbol

Builds `impl` (harness.adapter's names, or torch-mpi+view) on a benchmark model (mlp,
gelu-mlp, gpt at the benchmark's shapes), warms it up, then records every thread of each rank
with `perf record -F 1999` while it runs STEPS steps (default 40), and prints each rank's wall
time, main-thread CPU and process CPU per step. Comparing an implementation's profile with its
limit's (torch-local, jax-local) shows what the extra CPU is spent on, by library and symbol
(Python's own frames show as libpython). Without `perf` on PATH it only times the steps.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import portddp
from portddp import malloc
from harness.adapter import make_trainer
from harness.runner import MODELS, VIEW_OF, bench_workload


def main(impl: str = "jax-hooked", model: str = "mlp") -> None:
    if model not in MODELS:
        raise SystemExit(f"unknown model {model!r}: choose from {tuple(MODELS)}")
    malloc.keep_freed_memory()  # as the benchmark runs every row
    world = portddp.init(jax_distributed=impl == "jax-compiled")  # (the compiled strategy needs it)
    knobs = {"gradient_as_bucket_view": True} if impl in VIEW_OF else {}
    trainer = make_trainer(VIEW_OF.get(impl, impl), bench_workload(model), world, **knobs)
    for _ in range(8):
        trainer.step()
    steps = int(os.environ.get("STEPS", 40))
    out = Path(os.environ.get("OUT_DIR", "results"))
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"perf-{impl}-{model}-{world.rank}.data"
    perf = None
    if shutil.which("perf"):
        perf = subprocess.Popen(["perf", "record", "-q", "-F", "1999", "-p", str(os.getpid()), "-o", str(data)])
        time.sleep(1.0)  # (perf attaches to every thread before the first timed step)
    gc.collect()
    gc.disable()
    wall, main_cpu, cpu = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(steps):
        trainer.step()
    wall, main_cpu, cpu = (time.perf_counter() - wall, time.thread_time() - main_cpu, time.process_time() - cpu)
    gc.enable()
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
        if not (data.exists() and data.stat().st_size > 0):  # (perf refused: perf_event_paranoid, say)
            perf = None
    line = (f"rank {world.rank} {impl} {model}: {wall / steps * 1e3:.1f} ms per step, CPU {cpu / steps * 1e3:.1f} "
            f"ms (main thread {main_cpu / steps * 1e3:.1f})" + (f", profile in {data}" if perf else ""))
    print(line, flush=True)  # (one write with its newline: experiments/__init__.py)


if __name__ == "__main__":
    main(*sys.argv[1:3])
