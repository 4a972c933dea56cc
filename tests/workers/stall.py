"""The stall inspector and the collective checks (tests/test_reliability.py).

    mpirun -n N python -m tests.workers.stall <case>

late      rank 1 sleeps 10 s before a collective the others already wait in
desync    rank 0 waits in "iteration 3 bucket 0" (on a duplicate communicator, as the MPI transport
          does) while rank 1 waits in "checkpoint save": both wait forever, in different collectives
mismatch  the ranks meet in one MPI allgather under different names (no stall: the objects would
          be wrong)
sigterm   JAX-distributed ranks that loop in collectives until SIGTERMed (the test sends it)
compiled  portddp.jax strategy="compiled": rank 1 sleeps 10 s before its third step while the
          others are already inside theirs (one XLA program, computing and then waiting)
caught    rank 0 computes until Ctrl-C (the test sends it), catches KeyboardInterrupt and saves
          through a collective that rank 1 joins 4 s later: both must finish

The collectives are driven through portddp.launch.allgather_object (instrumented) and
portddp.watchdog.collective/waiting directly.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import portddp
from portddp import launch, watchdog

CASE = sys.argv[1]
WORLD = portddp.init(torch_distributed=False, jax_distributed=CASE in ("sigterm", "compiled"))
if len(sys.argv) > 2:
    Path(sys.argv[2], f"pid.{WORLD.rank}").write_text(str(os.getpid()))


def main() -> None:
    if CASE == "compiled":
        compiled_steps()
        return
    launch.allgather_object(WORLD.rank, name="iteration 1 config")
    if CASE == "late":
        if WORLD.rank == 1:
            time.sleep(10)
        launch.allgather_object(WORLD.rank, name="iteration 2 unused-count")
    elif CASE == "desync":
        dup = launch.mpi_comm().Dup()
        if WORLD.rank == 0:
            watchdog.collective("iteration 3 bucket 0")
            import numpy as np  # noqa: PLC0415

            with watchdog.waiting("iteration 3 bucket 0"):
                dup.Allreduce(np.ones(4), np.empty(4))
        else:
            launch.allgather_object(WORLD.rank, name="checkpoint save")
    elif CASE == "mismatch":
        try:
            launch.allgather_object(WORLD.rank, name="checkpoint save" if WORLD.rank == 0 else "checkpoint load")
        except RuntimeError as e:
            Path(sys.argv[2], f"error.{WORLD.rank}").write_text(str(e))  # mpirun may interleave printed lines
            return
    elif CASE == "caught":
        started = time.monotonic()
        try:
            while WORLD.rank == 0 and time.monotonic() - started < 60:
                sum(range(1000))  # Python code: the KeyboardInterrupt is delivered here
        except KeyboardInterrupt:
            print("rank 0 interrupted; saving", flush=True)
        if WORLD.rank == 1:
            time.sleep(4)
        saved = launch.allgather_object(WORLD.rank, name="save")
        print(f"rank {WORLD.rank} saved {saved}", flush=True)
    elif CASE == "sigterm":
        import jax.numpy as jnp  # noqa: PLC0415

        print(f"rank {WORLD.rank} ready", flush=True)
        for i in range(10_000):
            launch.allgather_object(float(jnp.sum(jnp.ones(4))), name=f"iteration {i}")
            time.sleep(0.05)
    print(f"rank {WORLD.rank} finished", flush=True)


def compiled_steps() -> None:
    import jax.numpy as jnp  # noqa: PLC0415

    from portddp.jax import DistributedDataParallel  # noqa: PLC0415

    params = {"w": jnp.ones((8, 4))}
    ddp = DistributedDataParallel(params, strategy="compiled")
    params = ddp.broadcast(params)
    grad_fn = ddp.value_and_grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2))
    for step in range(3):
        if WORLD.rank == 1 and step == 2:
            time.sleep(10)
        grad_fn(params, jnp.ones((4, 8)))


main()
