"""What a leaf larger than 32 MB costs a hooked step in page faults (portddp.malloc.keep_freed_memory).

    mpirun -bind-to user:0,1 -n 2 python -m experiments.big_leaf_probe [hooked|compiled]  # portddp's malloc settings
    PORTDDP_MALLOC=system mpirun ... python -m experiments.big_leaf_probe                  # glibc's defaults
    GLIBC_TUNABLES=glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647 \
        mpirun ...                                                                        # XLA's threads too

A 50000 x 512 float32 embedding (102 MB, the size of a GPT-2 token embedding's order) and a small
head, batch of 256 token ids per rank: the local jitted SGD step, then the same step through
portddp.jax hooked (or compiled), 5 steps each after 3 of warm-up; per step, the median wall time and the minor
page faults of the process (resource.getrusage). The hooked step hands XLA's 102 MB gradient
buffer to the host and gets the reduced one back in a fresh XLA buffer: glibc serves a block that
large with its own mmap (beyond the 32 MB cap of M_MMAP_THRESHOLD) and unmaps it when freed, so
every page faults again each step unless M_MMAP_MAX is 0. XLA's own threads (the local step's
and the compiled strategy's big buffers) allocate from their own arenas, whose heaps stop at 64
MB: glibc maps such a block afresh whatever M_MMAP_MAX says, unless every thread shares the main
arena (glibc.malloc.arena_max=1, which has to be set before the process starts).
"""

from __future__ import annotations

import os
import resource
import sys
import time

import portddp

STRATEGY = (sys.argv[1:] or ["hooked"])[0]
if STRATEGY not in ("hooked", "compiled"):
    raise SystemExit(f"unknown strategy {STRATEGY!r}: hooked or compiled")
WORLD = portddp.init(torch_distributed=False, jax_distributed=STRATEGY == "compiled")  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from portddp.jax import DistributedDataParallel  # noqa: E402

VOCAB, WIDTH, TOKENS = 50_000, 512, 256


def loss_fn(p, ids):
    return jnp.mean((p["emb"][ids] @ p["w"]) ** 2)


def main() -> None:
    rng = np.random.default_rng(0)
    params = {"emb": jnp.asarray(rng.standard_normal((VOCAB, WIDTH)) * 0.01, jnp.float32),
              "w": jnp.asarray(rng.standard_normal((WIDTH, 10)) * 0.1, jnp.float32)}
    ids = jnp.asarray(np.random.default_rng(WORLD.rank).integers(0, VOCAB, TOKENS))
    grad_fn = DistributedDataParallel(params, strategy=STRATEGY).value_and_grad(loss_fn)
    sgd = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g))
    synchronised = (lambda p, i: sgd(p, grad_fn(p, i)[1])) if STRATEGY == "compiled" else \
        jax.jit(lambda p, i: sgd(p, grad_fn(p, i)[1]))  # (compiled runs its own program: not under jit)
    steps = {"local": jax.jit(lambda p, i: sgd(p, jax.grad(loss_fn)(p, i))), STRATEGY: synchronised}
    for name, step in steps.items():
        p = params
        for _ in range(3):
            p = jax.block_until_ready(step(p, ids))
        times, faults = [], []
        for _ in range(5):
            f, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            p = jax.block_until_ready(step(p, ids))
            times.append(time.perf_counter() - t)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
        if WORLD.rank == 0:
            print(f"PORTDDP_MALLOC={os.environ.get('PORTDDP_MALLOC', 'keep')} {name:8s} "
                  f"{1e3 * np.median(times):6.1f} ms per step, {np.median(faults):6.0f} page faults per step "
                  f"(the embedding is {VOCAB * WIDTH * 4 // 4096} pages)", flush=True)


if __name__ == "__main__":
    main()
