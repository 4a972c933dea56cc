"""Uneven inputs in portddp.jax (ddp.uneven), run by tests/test_jax_uneven.py:

    mpirun -n 2 python -m tests.workers.jax_uneven              # every scenario, one JSON line each
    mpirun -n 3 python -m tests.workers.jax_uneven early hooked # no uneven(): the last rank stops
    mpirun -n 3 python -m tests.workers.jax_uneven early compiled   # one batch early (the watchdog)

Rank r has 2 + r batches. Each scenario trains a small MLP in float64 with SGD with
momentum through `for batch in ddp.uneven(batches)`, and compares the parameters with a
reference computed in this process without portddp: at each step the mean gradient is the
sum over the ranks that still have a batch, divided by the world size (or, with
divide_by_initial_world_size=False, by how many ranks have one).
"""

from __future__ import annotations

import sys
import warnings

import portddp

_EARLY = sys.argv[1:2] in (["early"], ["break"])
_STRATEGY = sys.argv[2] if _EARLY else None
WORLD = portddp.init(torch_distributed=False, jax_distributed=not _EARLY or _STRATEGY == "compiled")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Flax keeps BatchNorm's statistics in float32 whatever its dtypes: its own float64 update warns.
warnings.filterwarnings("ignore", "scatter inputs have incompatible types", FutureWarning)

from portddp.data import regression_batch  # noqa: E402
from portddp.jax import DistributedDataParallel, allreduce_hook  # noqa: E402
from tests.workers import common  # noqa: E402

IN, HID, OUT, BATCH = 5, 8, 3, 4
LR, MOMENTUM = 0.05, 0.9
CAP_MB = 200 / 2**20  # a few small buckets


def init_params():
    rng = np.random.default_rng(7)
    return {"l1": {"w": jnp.asarray(rng.standard_normal((IN, HID)) / 3), "b": jnp.zeros(HID, jnp.float64)},
            "l2": {"w": jnp.asarray(rng.standard_normal((HID, OUT)) / 3), "b": jnp.zeros(OUT, jnp.float64)}}


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    return jnp.mean((h @ params["l2"]["w"] + params["l2"]["b"] - y) ** 2)


def batches_of(rank: int) -> list:
    return [regression_batch(3, step, rank, BATCH, IN, OUT, dtype="float64") for step in range(2 + rank)]


def sgd(params, velocity, grads):
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    return jax.tree.map(lambda p, v: p - LR * v, params, velocity), velocity


def reference(world: int, divide_by_initial_world_size: bool = True):
    params = init_params()
    velocity = jax.tree.map(jnp.zeros_like, params)
    data = [batches_of(r) for r in range(world)]
    for step in range(max(len(d) for d in data)):
        present = [d[step] for d in data if step < len(d)]
        grads = [jax.grad(loss_fn)(params, b) for b in present]
        divisor = world if divide_by_initial_world_size else len(present)
        params, velocity = sgd(params, velocity, jax.tree.map(lambda *g: sum(g) / divisor, *grads))
    return params


def flat(tree) -> list[float]:
    return [float(v) for x in jax.tree.leaves(tree) for v in np.asarray(x).reshape(-1)]


def train(name: str, strategy: str, jit: bool = False, divide_by_initial_world_size: bool = True,
          hook: bool = False) -> None:
    params = init_params()
    ddp = DistributedDataParallel(params, strategy=strategy, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB,
                                  check_finite=hook)
    if hook:  # a comm hook and check_finite's longer used counts: a joined rank must issue them too
        ddp.register_comm_hook(None, allreduce_hook)
    params = ddp.broadcast(params)
    velocity = jax.tree.map(jnp.zeros_like, params)
    grad_fn = ddp.value_and_grad(loss_fn)

    def step(params, velocity, batch):
        loss, grads = grad_fn(params, batch)
        return (*sgd(params, velocity, grads), loss)

    if jit:
        step = jax.jit(step)
    steps, joined, losses = 0, 0, []
    for batch in ddp.uneven(batches_of(WORLD.rank), divide_by_initial_world_size=divide_by_initial_world_size):
        joined += batch is ddp.JOINED
        params, velocity, loss = step(params, velocity, batch)
        losses.append(None if loss is None else float(loss))
        steps += 1
    expected = reference(WORLD.size, divide_by_initial_world_size)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))
    common.report(WORLD.rank, name, steps=steps, joined=joined, losses=losses, max_abs_diff=diff,
                  params=flat(params), buckets=len(ddp.bucket_plan.buckets))


def nnx_batchnorm(strategy: str, jit: bool | str = False) -> None:
    """An NNX model with a BatchNorm buffer, rank r holding 3 - r batches (n=2: rank 1 joins first),
    with nnx.Optimizer: Params as one process computes them, and every rank's BatchStat after each
    step and at the end as torch's join() leaves a module's buffers (the reference below). `jit`:
    the step inside nnx.jit, where the model grad_fn sees is a copy the loop's end cannot reach
    ("last rank": there only -- the others step eagerly; then no rank takes the last joiner's, and
    every rank warns)."""
    import warnings  # noqa: PLC0415

    import optax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(IN, HID, use_bias=False, rngs=rngs, dtype=jnp.float64, param_dtype=jnp.float64)
            self.bn = nnx.BatchNorm(HID, rngs=rngs, dtype=jnp.float64, param_dtype=jnp.float64)
            self.l2 = nnx.Linear(HID, OUT, rngs=rngs, dtype=jnp.float64, param_dtype=jnp.float64)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.bn(self.l1(x))))

    def nnx_loss(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    def stats(model) -> list[np.ndarray]:
        return [np.array(x) for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat))]

    def set_stats(model, values) -> None:
        tree = jax.tree.structure(nnx.state(model, nnx.BatchStat))
        nnx.update(model, jax.tree.unflatten(tree, [jnp.asarray(v) for v in values]))

    def reference(model, data):
        """torch's join() with broadcast_buffers: each step every rank starts from the buffers of the
        highest rank with a batch (a joined rank takes them too); at the end, the last joiner's."""
        optimizer = nnx.Optimizer(model, optax.sgd(LR, momentum=MOMENTUM), wrt=nnx.Param)
        each = [stats(model)] * len(data)
        after = []  # per step: every rank's buffers after it
        for s in range(max(map(len, data))):
            active = [r for r in range(len(data)) if s < len(data[r])]
            start, grads = each[active[-1]], []
            each = [start] * len(data)
            for r in active:
                set_stats(model, start)
                grads.append(nnx.grad(nnx_loss)(model, data[r][s]))
                each[r] = stats(model)
            optimizer.update(model, jax.tree.map(lambda *g: sum(g) / len(data), *grads))
            after.append(each)
        return model, after, each[active[-1]]

    def gap(a, b) -> float:
        return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))

    def batches(rank: int) -> list:
        return [regression_batch(3, step, rank, BATCH, IN, OUT, dtype="float64") for step in range(3 - rank)]

    model = Net(nnx.Rngs(params=11 + WORLD.rank))
    ddp = DistributedDataParallel(model, strategy=strategy, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    ddp.broadcast(model)
    expected, after, final = reference(nnx.clone(model), [batches(r) for r in range(WORLD.size)])
    optimizer = nnx.Optimizer(model, optax.sgd(LR, momentum=MOMENTUM), wrt=nnx.Param)
    grad_fn = ddp.nnx_value_and_grad(nnx_loss)

    def step(model, optimizer, batch):
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    if jit is True or jit == "last rank" and WORLD.rank == WORLD.size - 1:
        step = nnx.jit(step)
    steps = joined = 0
    step_gaps = []  # this rank's buffers after each step against the reference's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in ddp.uneven(batches(WORLD.rank)):
            joined += batch is ddp.JOINED
            step(model, optimizer, batch)
            step_gaps.append(gap(stats(model), after[steps][WORLD.rank]))
            steps += 1
    unsynced = sum("so no rank takes the last joiner's" in str(w.message) for w in caught)
    mine, theirs = nnx.state(model, nnx.Param), nnx.state(expected, nnx.Param)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs)))
    where = {True: "/nnx.jit", "last rank": "/nnx.jit on the last rank"}.get(jit, "")
    common.report(WORLD.rank, f"nnx_batchnorm/{strategy}{where}", steps=steps, joined=joined, unsynced=unsynced,
                  max_abs_diff=diff, params=flat(mine), step_gaps=step_gaps,
                  final_gap=gap(stats(model), final), last_step_gap=gap(stats(model), after[-1][WORLD.rank]))


def throw() -> None:
    params = init_params()
    ddp = DistributedDataParallel(params)
    grad_fn = ddp.value_and_grad(loss_fn)
    steps = 0
    try:
        for batch in ddp.uneven(batches_of(WORLD.rank), throw_on_early_termination=True):
            grad_fn(params, batch)
            steps += 1
        message = None
    except RuntimeError as e:
        message = str(e)
    common.report(WORLD.rank, "throw", steps=steps, message=message)


def early(strategy: str) -> None:
    """No uneven(): the last rank's loop ends one batch early and its script returns."""
    params = init_params()
    ddp = DistributedDataParallel(params, strategy=strategy)
    grad_fn = ddp.value_and_grad(loss_fn)
    last = WORLD.rank == WORLD.size - 1
    for step in range(2 if last else 3):
        grad_fn(params, regression_batch(3, step, WORLD.rank, BATCH, IN, OUT, dtype="float64"))
    print(f"rank {WORLD.rank} finished its loop", flush=True)


def break_alone(strategy: str) -> None:
    """uneven() left with a break on rank 0 after one batch, then a second loop on every rank (a next epoch)."""
    params = init_params()
    ddp = DistributedDataParallel(params, strategy=strategy)
    grad_fn = ddp.value_and_grad(loss_fn)
    for epoch in range(2):
        for k, batch in enumerate(ddp.uneven(batches_of(WORLD.rank))):
            if epoch == 0 and k == 1 and WORLD.rank == 0:
                break
            grad_fn(params, batch)


def main() -> None:
    if _EARLY:
        (early if sys.argv[1] == "early" else break_alone)(_STRATEGY)
        return
    train("hooked", "hooked")
    train("hooked/jit", "hooked", jit=True)
    train("hooked/divide_by_initial_world_size=False", "hooked", divide_by_initial_world_size=False)
    train("hooked/allreduce_hook+check_finite", "hooked", hook=True)
    train("compiled", "compiled")
    nnx_batchnorm("hooked")
    nnx_batchnorm("hooked", jit=True)
    nnx_batchnorm("hooked", jit="last rank")
    nnx_batchnorm("compiled")
    throw()


if __name__ == "__main__":
    main()
