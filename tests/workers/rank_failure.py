"""A job that loses a rank in the middle of a backward pass (tests/test_reliability.py).

    mpirun -n 3 python -m tests.workers.rank_failure <impl> <dir> [kill|raise] [noinit]

Every rank writes its pid to <dir>/pid.<rank> and trains. On the last rank, at
step 3, the backward pass stops in a hook after writing <dir>/victim: the test
SIGKILLs that pid there ("kill"), or the hook raises ("raise": a bug on one
rank only). What the surviving ranks do next is under test. With "noinit"
(PyTorch only) the script never calls portddp.init(): torchrun-style, its own
init_process_group for c10d, nothing at all for transport="mpi".
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import portddp

IMPL, OUT = sys.argv[1], Path(sys.argv[2])
MODE = sys.argv[3] if len(sys.argv) > 3 else "kill"
if "noinit" in sys.argv[4:]:
    WORLD = portddp.launch.detect()
    if IMPL == "torch-c10d":
        import torch.distributed as dist

        import portddp.torch  # noqa: F401 (under mpirun: torchrun's variables, as a drop-in script gets them)

        dist.init_process_group("gloo")
else:
    WORLD = portddp.init(jax_distributed=IMPL == "jax-compiled")
(OUT / f"pid.{WORLD.rank}").write_text(str(os.getpid()))
VICTIM = WORLD.size - 1
STEPS = 10_000  # "forever": the test ends the job


def pause(step: int) -> None:
    """Inside the backward pass: the victim parks here until it is killed."""
    if WORLD.rank == VICTIM and step == 3:
        (OUT / "victim").write_text(str(os.getpid()))
        if MODE == "raise":
            # (long, as portddp's own errors are, with the fix at the end: the others must read it all)
            raise RuntimeError("a bug on the last rank only; " + "context " * 80 + "-- the fix: read to the end")
        time.sleep(120)


def torch_job(transport: str) -> None:
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    from portddp.torch import DistributedDataParallel  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1, first_bucket_cap_mb=0.05, transport=transport)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(32, 64)
        h = ddp(x)
        h.register_hook(lambda g, step=step: pause(step))  # runs once backward has begun
        opt.zero_grad()
        h.square().mean().backward()
        opt.step()


def jax_job(strategy: str) -> None:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from portddp.jax import DistributedDataParallel  # noqa: PLC0415

    k = jax.random.split(jax.random.key(0), 3)
    params = {"a": jax.random.normal(k[0], (64, 256)) * 0.1, "b": jax.random.normal(k[1], (256, 256)) * 0.1,
              "c": jax.random.normal(k[2], (256, 8)) * 0.1}
    ddp = DistributedDataParallel(params, bucket_cap_mb=0.1, first_bucket_cap_mb=0.05, strategy=strategy)
    params = ddp.broadcast(params)
    step_box = [0]

    @jax.custom_vjp
    def marker(h):
        return h

    def bwd(_, g):
        jax.debug.callback(lambda: pause(step_box[0]))
        return (g,)

    marker.defvjp(lambda h: (h, None), bwd)

    def loss_fn(p, x):
        h = marker(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]))
        return jnp.mean((h @ p["c"]) ** 2)

    grad_fn = ddp.value_and_grad(loss_fn)
    for step in range(STEPS):
        step_box[0] = step
        x = jax.random.normal(jax.random.key(step * 10 + WORLD.rank), (32, 64))
        _, grads = grad_fn(params, x)
        params = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)


if __name__ == "__main__":
    if IMPL.startswith("torch-"):
        torch_job(IMPL.removeprefix("torch-"))
    else:
        jax_job(IMPL.removeprefix("jax-"))
