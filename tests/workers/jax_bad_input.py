"""Bad input for portddp.jax: each case fails on every rank with a clear message.

    mpirun -n 2 python -m tests.workers.jax_bad_input CASE
    mpirun -n 2 python -m tests.workers.jax_bad_input --cases CASE,CASE,...
"""

from __future__ import annotations

import sys

import portddp

WORLD = portddp.init(torch_distributed=False)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from portddp.jax import DistributedDataParallel  # noqa: E402
from tests.workers import common  # noqa: E402


def run(case: str) -> None:
    last = WORLD.rank == WORLD.size - 1
    params = {"enc": {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}, "dec": {"w": jnp.zeros((4, 2))}}
    if case == "shape_mismatch":
        if last:
            params["dec"]["w"] = jnp.zeros((4, 3))
        DistributedDataParallel(params)
    elif case == "dtype_mismatch":
        if last:
            params["enc"]["b"] = jnp.zeros(4, jnp.bfloat16)
        DistributedDataParallel(params)
    elif case == "structure_mismatch":
        if last:
            params["extra"] = jnp.zeros(3)
        DistributedDataParallel(params)
    elif case == "unknown_strategy":
        DistributedDataParallel(params, strategy="telepathy")
    elif case == "bad_cap":
        DistributedDataParallel(params, bucket_cap_mb=-2)
    elif case == "bad_order":
        DistributedDataParallel(params, order=["['enc']['w']"])
    elif case == "broadcast_mismatch":
        ddp = DistributedDataParallel(params)
        if last:
            params = {**params, "dec": {"w": jnp.zeros((5, 2))}}
        ddp.broadcast(params)
    elif case == "unknown_transport":
        DistributedDataParallel(params, transport="c10d")
    elif case == "pmap_too_many_devices":
        DistributedDataParallel(params, strategy="pmap", pmap_devices=jax.local_device_count() + 3)
    elif case == "integer_leaf":
        params["enc"]["step"] = jnp.zeros((), jnp.int32)
        DistributedDataParallel(params)
    elif case == "python_float_leaf":
        params["enc"]["scale"] = 1.5
        DistributedDataParallel(params)
    elif case == "complex_leaf":
        params["enc"]["phase"] = jnp.zeros(3, jnp.complex64)
        DistributedDataParallel(params)
    elif case == "float8_leaf":
        params["enc"]["scale"] = jnp.ones(4, jnp.float8_e4m3fn)
        DistributedDataParallel(params)
    elif case == "loss_not_scalar":
        ddp = DistributedDataParallel(params)
        ddp.value_and_grad(lambda p, x: x @ p["enc"]["w"])(params, jnp.ones((3, 4)))
    elif case == "cap_differs":
        DistributedDataParallel(params, bucket_cap_mb=5.0 if last else 25.0)
    elif case == "strategy_differs":
        DistributedDataParallel(params, strategy="compiled" if last else "hooked")
    elif case == "nonfinite":
        ddp = DistributedDataParallel(params, check_finite=True)
        x = jnp.full((3, 4), jnp.inf if last else 1.0)
        ddp.value_and_grad(lambda p, x: jnp.sum(jnp.tanh(x @ p["enc"]["w"] + p["enc"]["b"]) @ p["dec"]["w"]))(
            params, x)
    elif case == "check_finite_compiled":
        DistributedDataParallel(params, strategy="compiled", check_finite=True)
    elif case == "compiled_without_jax_distributed":
        DistributedDataParallel(params, strategy="compiled")
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    common.main(WORLD.rank, run, sys.argv[1:])
