"""Multi-rank checks of portddp.jax (hooked strategy), run by tests/test_jax_ddp.py:

    mpirun -n 2 python -m tests.workers.jax_equivalence

Each rank writes one JSON line per scenario (tests/workers/common.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import portddp

WORLD = portddp.init(torch_distributed=False)  # before jax: pins XLA to one thread per rank

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_enable_x64", True)

from portddp.data import global_batch, regression_batch  # noqa: E402
from portddp.jax import (DistributedDataParallel, allreduce_hook, bf16_compress_hook,  # noqa: E402
                         fp16_compress_hook, noop_hook)
from portddp.transport import get_transport  # noqa: E402
from tests.workers import common  # noqa: E402

IN, HID, OUT, BATCH, STEPS, LR = 16, 32, 4, 8, 5, 0.1
CAP_MB = 0.004


def init_params(seed: int, dtype):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "l1": {"w": (jax.random.normal(k[0], (IN, HID)) * 0.3).astype(dtype), "b": jnp.zeros(HID, dtype)},
        "l2": {"w": (jax.random.normal(k[1], (HID, HID)) * 0.3).astype(dtype), "b": jnp.zeros(HID, dtype)},
        "head": {"w": (jax.random.normal(k[2], (HID, OUT)) * 0.3).astype(dtype), "b": jnp.zeros(OUT, dtype)},
    }


def loss_fn(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
    h = jnp.tanh(h @ p["l2"]["w"] + p["l2"]["b"])
    return jnp.mean((h @ p["head"]["w"] + p["head"]["b"] - y) ** 2)


def batch(step, rank, dtype):
    return regression_batch(3, step, rank, BATCH, IN, OUT, dtype=dtype)


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def rel_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / max(1.0, float(jnp.max(jnp.abs(y)))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def vs_global_batch(dtype: str, overlap: bool, micro: int = 1):
    """K SGD steps against one process on the concatenated global batch.
    `micro` > 1: local accumulation (sync=False) then ddp.reduce, as no_sync would."""
    params = init_params(100 + WORLD.rank, dtype)  # differs per rank: broadcast must fix it
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB / 4, overlap=overlap)
    params = ddp.broadcast(params)
    grad_fn = ddp.value_and_grad(loss_fn)
    ref = init_params(100, dtype)
    ref_grad = jax.jit(jax.grad(loss_fn))
    for step in range(STEPS):
        if micro == 1:
            _, grads = grad_fn(params, batch(step, WORLD.rank, dtype))
        else:
            acc = None
            for m in range(micro):
                _, g = grad_fn(params, batch(step * micro + m, WORLD.rank, dtype), sync=False)
                acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
            grads = ddp.reduce(acc)
        params = sgd(params, grads)
        ref_acc = None
        for m in range(micro):
            gb = global_batch(regression_batch, WORLD.size, 3, step * micro + m, batch=BATCH, in_dim=IN,
                              out_dim=OUT, dtype=dtype)
            g = ref_grad(ref, gb)
            ref_acc = g if ref_acc is None else jax.tree.map(jnp.add, ref_acc, g)
        ref = sgd(ref, ref_acc)
    ev = ddp.stats()["events"] if micro == 1 else None
    common.report(WORLD.rank, f"global_batch/{dtype}/overlap={overlap}/micro={micro}",
                  max_rel=rel_diff(params, ref), buckets=len(ddp.bucket_plan.buckets),
                  first_launch_before_backward_end=(min(b.launch_ns for b in ev.buckets) < ev.backward_end_ns)
                  if ev else None,
                  ordered=all(a.launch_ns <= b.launch_ns for a, b in zip(ev.buckets, ev.buckets[1:])) if ev else None)


def hooks_vs_numpy():
    params = init_params(100, "float32")
    x = batch(0, WORLD.rank, "float32")
    mine = [np.asarray(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss_fn))(params, x))]
    allg = get_transport().allgather_object(mine)
    for hook, np_dtype in ((fp16_compress_hook, np.float16), (bf16_compress_hook, ml_dtypes.bfloat16),
                           (allreduce_hook, np.float32), (noop_hook, None)):
        ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB)
        ddp.register_comm_hook(None, hook)
        _, grads = ddp.value_and_grad(loss_fn)(params, x)
        worst = scale = 0.0
        for k, got in enumerate(jax.tree.leaves(grads)):
            if np_dtype is None:
                want = mine[k]
            else:
                want = None
                for r in range(WORLD.size):
                    term = (allg[r][k].astype(np_dtype) / np_dtype(WORLD.size)).astype(np_dtype)
                    want = term if want is None else (want + term).astype(np_dtype)
                want = want.astype(np.float32)
            worst = max(worst, float(np.abs(np.asarray(got) - want).max()))
            scale = max(scale, float(np.abs(want).max()))
        common.report(WORLD.rank, f"hook_{hook.__name__}", max_diff=worst, scale=scale)


def main():
    for dtype in ("float64", "float32"):
        for overlap in (True, False):
            vs_global_batch(dtype, overlap)
    vs_global_batch("float64", True, micro=3)
    hooks_vs_numpy()


if __name__ == "__main__":
    main()
