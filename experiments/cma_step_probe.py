"""The cross-memory-attach idea of experiments/cma_probe.py inside a real hooked step (issue 16).

    mpirun -bind-to user:0,1 -n 2 python -m experiments.cma_step_probe [mlp|gelu-mlp]
    GROUP=3 mpirun -bind-to user:0,1 -n 2 python -m experiments.cma_step_probe   # 3 layers per tap

A prototype, not portddp: every GROUP layers of the benchmark MLP pass a tap whose backward
calls `buffer_callback` with the layers' gradients (XLA's buffers) and the results it must fill
(XLA's buffers). The callback blocks: it exchanges the buffers' addresses with the peer, sums its
half of each gradient from its own buffer and the peer's (read with `process_vm_readv`) straight
into its result buffer, waits for the peer, reads the peer's half of the result from the peer's
result buffer, waits again. While the callback runs every buffer is XLA's to lend, so nothing can
move under it -- the safe form of the in-place idea -- at the price of no overlap within the rank.
It runs beside the local jitted step and portddp.jax hooked in interleaved rounds and prints
each one's median ms per step and ratio to the local step (CPU of the whole process, and the
callbacks' own), after checking the gradients are bitwise portddp.jax hooked's.
"""

from __future__ import annotations

import os
import sys
import time

import portddp

WORLD = portddp.init(torch_distributed=False)  # before JAX starts: one compute thread per rank

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402
from mpi4py import MPI  # noqa: E402

from harness.cma import BLOCK, read_remote  # noqa: E402
from portddp.jax import DistributedDataParallel  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, PEER = COMM.rank, 1 - COMM.rank
PIDS = COMM.allgather(os.getpid())
GROUP = int(os.environ.get("GROUP", 1))  # layers per tap
INV = np.float32(0.5)
_block = np.empty(BLOCK, np.float32)
_callback_cpu = [0.0]


def _halves(n: int, mine: bool) -> tuple[int, int]:
    half = n // 2
    return (0, half) if (RANK == 0) == mine else (half, n)


def reduce_in_place(_ctx, outs, *grads) -> None:
    """(buffer_callback) outs[k] = (grads[k] on rank 0 + grads[k] on rank 1) / 2, bitwise as portddp."""
    t = time.thread_time()
    outs = [np.asarray(o).reshape(-1) for o in jax.tree.leaves(outs)]
    grads = [np.asarray(g).reshape(-1) for g in grads]
    theirs = COMM.allgather([(g.ctypes.data, o.ctypes.data) for g, o in zip(grads, outs)])[PEER]
    for g, o, (peer_g, _) in zip(grads, outs, theirs):
        lo, hi = _halves(g.size, mine=True)
        for s in range(lo, hi, BLOCK):
            e = min(s + BLOCK, hi)
            b = _block[:e - s]
            read_remote(PIDS[PEER], peer_g + s * 4, b)
            np.multiply(b, INV, out=b)
            np.multiply(g[s:e], INV, out=o[s:e])
            np.add(*((o[s:e], b) if RANK == 0 else (b, o[s:e])), out=o[s:e])  # a0 + a1, rank order
    COMM.Barrier()
    for o, (_, peer_o) in zip(outs, theirs):
        lo, hi = _halves(o.size, mine=False)
        read_remote(PIDS[PEER], peer_o + lo * 4, o[lo:hi])
    COMM.Barrier()  # the peer has read my half before XLA may reuse my buffers
    _callback_cpu[0] += time.thread_time() - t


@jax.custom_vjp
def tap(x):
    return x


def _tap_bwd(_, g):
    leaves = jax.tree.leaves(g)
    out = buffer_callback(reduce_in_place, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves],
                          has_side_effect=True)(*leaves)
    return (jax.tree.unflatten(jax.tree.structure(g), out),)


tap.defvjp(lambda x: (x, None), _tap_bwd)


def main() -> None:
    if COMM.size != 2:
        raise SystemExit("run on 2 ranks: mpirun -n 2 python -m experiments.cma_step_probe")
    gelu = (sys.argv[1:2] or ["mlp"])[0] == "gelu-mlp"
    depth, width, batch = (6, 1280, 48) if gelu else (8, 1024, 64)  # the benchmark's shapes
    act = jax.nn.gelu if gelu else jax.nn.relu
    rng = np.random.default_rng(0)
    params = [{"w": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32),
               "b": jnp.zeros(width, jnp.float32)} for _ in range(depth)]
    x = jnp.asarray(np.random.default_rng(1 + RANK).standard_normal((batch, width)), jnp.float32)

    def loss_fn(p, x):
        for layer in p[:-1]:
            x = act(x @ layer["w"] + layer["b"])
        return jnp.mean((x @ p[-1]["w"] + p[-1]["b"]) ** 2)

    def tapped_loss(p, x):
        return loss_fn([layer for i in range(0, len(p), GROUP) for layer in tap(p[i:i + GROUP])], x)

    def sgd(p, g):
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)

    grad_fn = DistributedDataParallel(params).value_and_grad(loss_fn)
    steps = {"local": jax.jit(lambda p, x: sgd(p, jax.grad(loss_fn)(p, x))),
             "hooked": jax.jit(lambda p, x: sgd(p, grad_fn(p, x)[1])),
             "cma-in-place": jax.jit(lambda p, x: sgd(p, jax.grad(tapped_loss)(p, x)))}
    hooked = jax.jit(lambda p, x: grad_fn(p, x)[1])(params, x)
    probe = jax.jit(jax.grad(tapped_loss))(params, x)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(hooked), jax.tree.leaves(probe)))
    state = dict.fromkeys(steps, params)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in steps}
    order = list(steps)
    for r in range(7):
        for name in order[r % 3:] + order[:r % 3]:
            for _ in range(2):  # warm this variant's buffers up again
                state[name] = jax.block_until_ready(steps[name](state[name], x))
            COMM.Barrier()
            _callback_cpu[0] = 0.0
            t, c = time.perf_counter(), time.process_time()
            for _ in range(4):
                state[name] = jax.block_until_ready(steps[name](state[name], x))
            times[name].append(((time.perf_counter() - t) / 4e-3, (time.process_time() - c) / 4e-3,
                                _callback_cpu[0] / 4e-3))
    if RANK == 0:
        limit = np.median([w for w, _, _ in times["local"]])
        print(f"gradients bitwise portddp.jax hooked's: {same}; {GROUP} layer(s) per tap")
        for name, rows in times.items():
            wall, cpu, cb = (np.median([row[i] for row in rows]) for i in range(3))
            print(f"{name:13s} {wall:6.1f} ms  {wall / limit:.3f} x local  CPU {cpu:6.1f} ms  "
                  f"callbacks' CPU {cb:5.2f} ms")


if __name__ == "__main__":
    main()
