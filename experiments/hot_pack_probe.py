"""Does packing each gradient the moment XLA has it (still in cache) beat packing a bucket's
gradients together once the last one exists? (issue 16; one process, no communication)

    taskset -c 0 python -m experiments.hot_pack_probe

The benchmark MLP (8 x Linear(1024, 1024), batch 64), jitted forward and backward, with a host
tap (portddp.jax.taps.host_tap, as the hooked strategy uses) whose callback copies the gradients
times 1/2 into a flat buffer -- the hooked strategy's pack -- once per bucket as the benchmark's
plan groups the layers (1 + 6 + 1 layers: first bucket 1 MB, then 25 MB), or once per layer;
beside the same step with no tap. Interleaved rounds; prints each one's median ms per step and
the callbacks' copying time per step.
"""

from __future__ import annotations

import os
import time

import portddp

portddp.init(torch_distributed=False)  # before JAX starts: one compute thread

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from portddp import malloc  # noqa: E402
from portddp.jax import taps  # noqa: E402

LAYERS, WIDTH, BATCH = 8, 1024, 64
LAYOUTS = {"per bucket": [[7], [1, 2, 3, 4, 5, 6], [0]], "per layer": [[i] for i in reversed(range(LAYERS))],
           "no tap": []}


def main(rounds: int = int(os.environ.get("ROUNDS", 6)), steps: int = 10) -> None:
    malloc.keep_freed_memory()
    rng = np.random.default_rng(0)
    params = [(jnp.asarray(rng.standard_normal((WIDTH, WIDTH), np.float32) * 0.03), jnp.zeros(WIDTH, jnp.float32))
              for _ in range(LAYERS)]
    x, y = (jnp.asarray(rng.standard_normal((BATCH, WIDTH), np.float32)) for _ in range(2))
    flat = np.zeros(LAYERS * (WIDTH * WIDTH + WIDTH), np.float32)
    slots = [(w.reshape(WIDTH, WIDTH), b) for w, b in
             (np.split(part, [WIDTH * WIDTH]) for part in np.split(flat, LAYERS))]
    packing = [0.0]

    def pack(layers):
        def callback(_token, *grads):
            t0 = time.perf_counter()
            for (i, j), g in zip([(i, j) for i in layers for j in (0, 1)], grads):
                np.multiply(g, 0.5, out=slots[i][j])
            packing[0] += time.perf_counter() - t0
            return np.float32(0)
        return callback

    def step_for(groups):
        tapped = [taps.host_tap(pack(g)) for g in groups]

        def loss(ps, token):
            ps = list(ps)
            for tap, g in zip(tapped, groups):
                for i, p in zip(g, tap([ps[i] for i in g], token)):
                    ps[i] = p
            h = x
            for i, (w, b) in enumerate(ps):
                h = h @ w + b
                h = jax.nn.relu(h) if i < LAYERS - 1 else h
            return jnp.mean((h - y) ** 2)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    runs = {name: step_for(groups) for name, groups in LAYOUTS.items()}
    for run in runs.values():
        jax.block_until_ready(run(params, jnp.float32(0)))
    times = {name: [] for name in runs}
    packs = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            packing[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(run(params, jnp.float32(0)))
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
            packs[name].append(packing[0] / steps * 1e3)
    for name in runs:
        print(f"{name:10s}  step {np.median(times[name]):6.2f} ms   packing {np.median(packs[name]):5.2f} ms")


if __name__ == "__main__":
    main()
