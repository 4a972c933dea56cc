"""portddp.jax in the idioms of Flax NNX and optax, run by tests/test_jax_dropin.py:

    mpirun -n 2 python -m tests.workers.jax_dropin          # hooked and compiled, one JSON line each
    python -m tests.workers.jax_dropin pmap                 # pmap (2 forced host devices)
    mpirun -n 2 python -m tests.workers.jax_dropin bad CASE # one bad input: an error on every rank
    mpirun -n 2 python -m tests.workers.jax_dropin bad all  # every case in one job, lines prefixed [CASE]

Scenarios: an NNX model with BatchNorm and Dropout trained with nnx.Optimizer
(optax.adamw) in float64 against a single-process per-shard reference; leaves
the loss does not use; has_aux. The reference for the NNX model runs, in one
process, each rank's shard through a copy of the model holding that rank's RNG
streams and rank 0's batch statistics (what broadcast_buffers gives each rank
before the forward), averages the gradients, and applies the same optimizer:
BatchNorm statistics are per shard by design, so that -- not one global batch
-- is what the distributed step must equal.
"""

from __future__ import annotations

import os
import sys

import portddp
from portddp.launch import detect

if detect().size == 1:  # before JAX starts: devices for the pmap strategy
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
# jax.distributed (for strategy="compiled") costs seconds to start: only where a strategy needs it.
_BAD_CASE = sys.argv[2] if sys.argv[1:2] == ["bad"] else None
WORLD = portddp.init(torch_distributed=False, jax_distributed=_BAD_CASE in (None, "all", "compiled_inside_jit",
                                                                           "key_in_batch_compiled",
                                                                           "scalar_in_batch_compiled"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_enable_x64", True)

from portddp.data import regression_batch  # noqa: E402
from portddp.jax import DistributedDataParallel  # noqa: E402
from tests.workers import common  # noqa: E402

IN, HID, OUT, BATCH, STEPS = 6, 16, 3, 8, 4
F64 = jnp.float64
CAP_MB = 600 / 2**20  # a few small buckets


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # No bias before BatchNorm (which removes it): its gradient would be pure rounding noise, which adamw's
        # g / (|g| + eps) turns into updates of ~1e-11 that differ between any two summation orders.
        self.l1 = nnx.Linear(IN, HID, use_bias=False, rngs=rngs, dtype=F64, param_dtype=F64)
        self.bn = nnx.BatchNorm(HID, rngs=rngs, dtype=F64, param_dtype=F64)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(HID, OUT, rngs=rngs, dtype=F64, param_dtype=F64)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def net(rank: int, params_seed: int) -> Net:
    # Params from params_seed; dropout masks from this rank's own stream.
    return Net(nnx.Rngs(params=params_seed, dropout=1000 + rank))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def batch_of(rank: int, step: int):
    return regression_batch(5, step, rank, BATCH, IN, OUT, dtype="float64")


def rel_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / max(1.0, float(jnp.max(jnp.abs(y)))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def plain(tree):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree)


def reference(world: int, broadcast_buffers: bool = True):
    """One process, one model copy per rank (same Params, that rank's dropout stream); each step:
    rank 0's batch stats into every copy (if broadcast_buffers), each copy's shard, mean gradient,
    one adamw update each."""
    copies = [net(r, params_seed=100) for r in range(world)]
    opts = [nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param) for m in copies]
    grad = nnx.value_and_grad(loss_fn)
    losses, stats = [], []
    for step in range(STEPS):
        rank0_stats = nnx.state(copies[0], nnx.BatchStat)
        for m in copies if broadcast_buffers else []:
            nnx.update(m, rank0_stats)
        out = [grad(m, batch_of(r, step)) for r, m in enumerate(copies)]
        mean = jax.tree.map(lambda *g: sum(g) / world, *[g for _, g in out])
        for m, opt in zip(copies, opts):
            opt.update(m, mean)
        losses.append([float(loss) for loss, _ in out])
        stats = [nnx.state(m, nnx.BatchStat) for m in copies]  # each rank's after its own shard
    return copies[0], losses, stats


def nnx_train(strategy: str, jit: bool = False, broadcast_buffers: bool = True):
    """BatchNorm + Dropout, nnx.Optimizer(adamw), STEPS steps through portddp."""
    model = net(WORLD.rank, params_seed=100 + WORLD.rank)  # Params differ per rank: broadcast fixes them
    model.bn.mean[...] = model.bn.mean[...] + WORLD.rank  # so do the buffers
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB / 4, strategy=strategy,
                                  broadcast_buffers=broadcast_buffers)
    ddp.broadcast(model)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    grad_fn = ddp.nnx_value_and_grad(loss_fn)

    def train_step(model, optimizer, batch):
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    if jit:
        train_step = nnx.jit(train_step)
    losses = [float(train_step(model, optimizer, batch_of(WORLD.rank, step))) for step in range(STEPS)]
    ref, ref_losses, ref_stats = reference(WORLD.size, broadcast_buffers)
    mask = np.asarray(model.drop(jnp.ones(64)) != 0).tolist()  # this rank's next dropout mask
    common.report(
        WORLD.rank, f"nnx_train/{strategy}" + ("/nnx.jit" if jit else "") + ("" if broadcast_buffers else
                                                                             "/broadcast_buffers=False"),
        params_rel=rel_diff(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param)),
        stats_rel=rel_diff(nnx.state(model, nnx.BatchStat), ref_stats[WORLD.rank]),
        loss_rel=max(abs(a - b[WORLD.rank]) / max(1.0, abs(b[WORLD.rank])) for a, b in zip(losses, ref_losses)),
        rng_count=int(model.drop.rngs.count[...]), buckets=len(ddp.bucket_plan.buckets),
        grads_type=type(grad_fn(model, batch_of(WORLD.rank, 0), sync=False)[1]).__name__, mask=mask)


GENERATOR = {"w": jnp.ones(IN, F64)}  # read by critic_loss from the module's globals; the loop replaces it


def critic_loss(params, batch):
    """A GAN critic's loss: it reads the generator's current parameters from a global."""
    x, _ = batch
    fake = x * GENERATOR["w"]
    return jnp.mean(jax.nn.softplus(-(x @ params["w"]))) + jnp.mean(jax.nn.softplus(fake @ params["w"]))


def captured_values(strategy: str):
    """loss_fn reading values that change between steps from outside its arguments -- a global pytree
    (a GAN's generator), a closure cell (an annealed temperature), an NNX teacher module updated in
    place -- computes with the current ones at every step, as jax.value_and_grad does (before, the
    values of the first trace, silently), and says once that it compiles again for each change."""
    import warnings  # noqa: PLC0415

    global GENERATOR
    xs = [batch_of(r, 0) for r in range(WORLD.size)]
    everyone = (np.concatenate([x for x, _ in xs]), np.concatenate([y for _, y in xs]))
    critic = {"w": jnp.linspace(-1.0, 1.0, IN, dtype=F64)}
    temperature = 1.0
    teacher = nnx.Linear(IN, OUT, rngs=nnx.Rngs(3), dtype=F64, param_dtype=F64)

    def distil_loss(model, batch):
        x, _ = batch
        return jnp.mean((model(x) - teacher(x) / temperature) ** 2)

    student = nnx.Linear(IN, OUT, rngs=nnx.Rngs(4), dtype=F64, param_dtype=F64)
    critic_fn = DistributedDataParallel(critic, strategy=strategy).value_and_grad(critic_loss)
    distil_fn = DistributedDataParallel(student, strategy=strategy).nnx_value_and_grad(distil_loss)
    gaps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _, got = critic_fn(critic, xs[WORLD.rank])
            _, want = jax.value_and_grad(critic_loss)(critic, everyone)
            _, got_nnx = distil_fn(student, xs[WORLD.rank])
            want_nnx = nnx.grad(distil_loss)(student, everyone)
            gaps.append(max(rel_diff(got, want), rel_diff(nnx.state(got_nnx, nnx.Param), nnx.state(want_nnx, nnx.Param))))
            GENERATOR = {"w": GENERATOR["w"] * 0.5 + 0.3}
            temperature *= 2.0
            teacher.kernel[...] = teacher.kernel[...] * 0.5 + 0.1
    said = [str(w.message) for w in caught if "from outside its arguments" in str(w.message)]
    common.report(WORLD.rank, f"captured/{strategy}", gaps=gaps, warnings=len(said),
                  names=sorted({m.split(" reads ")[1].split(" ")[0] for m in said}))
    GENERATOR = {"w": jnp.ones(IN, F64)}


def nnx_no_dropout_vs_global_batch(strategy: str):
    """Dropout off (deterministic) and BatchNorm in eval mode: then one process on the global batch is the
    reference, as for any model whose forward has no per-rank state."""
    model = net(WORLD.rank, params_seed=100 + WORLD.rank)
    ddp = DistributedDataParallel(nnx.state(model, nnx.Param), bucket_cap_mb=CAP_MB, strategy=strategy)
    ddp.broadcast(model)
    model.eval()
    grad_fn = ddp.nnx_value_and_grad(loss_fn)
    _, grads = grad_fn(model, batch_of(WORLD.rank, 0))
    # The forward under nnx.remat, which hands every Param back as a new array of the same value: not
    # taken for a change of the trained state (a false refusal, below), nor a cost when the model has none
    remat_fn = ddp.nnx_value_and_grad(lambda m, b: jnp.mean((nnx.remat(lambda m, x: m(x))(m, b[0]) - b[1]) ** 2))
    _, remat_grads = remat_fn(model, batch_of(WORLD.rank, 0))
    if strategy == "hooked":  # (and inside the script's own jit, where the comparison runs in its program)
        _, remat_grads = nnx.jit(remat_fn)(model, batch_of(WORLD.rank, 0))
    ref = net(0, params_seed=100)
    ref.eval()
    xs, ys = zip(*(batch_of(r, 0) for r in range(WORLD.size)))
    want = nnx.grad(loss_fn)(ref, (np.concatenate(xs), np.concatenate(ys)))
    common.report(WORLD.rank, f"nnx_global_batch/{strategy}", max_rel=rel_diff(grads, want),
                  remat_max_rel=rel_diff(remat_grads, want))


# ------------------------------------------------------------------ unused leaves
def unused_leaves(strategy: str):
    """Leaves the loss never uses -- a whole first bucket, and one leaf beside a used one -- and
    (hooked) a leaf only rank 0 uses: zeros where nobody uses them, the global-batch mean otherwise."""
    k = jax.random.split(jax.random.key(7), 3)
    params = {"a": jax.random.normal(k[0], (4, 4), F64), "b": jnp.ones(4, F64),
              "c": jax.random.normal(k[1], (4, 4), F64), "d": jnp.ones(3, F64)}
    rank_dependent = strategy == "hooked"  # one program per process for the XLA strategies

    def loss_on(p, batch, rank):
        x, y = batch
        h = jnp.tanh(x[:, :4] @ p["a"])
        if rank_dependent and rank == 0:  # "c" reaches the loss on rank 0 only
            h = h @ p["c"]
        return jnp.mean((h[:, :OUT] - y) ** 2)

    # Plan (reverse order d, c, b, a): [d] never fires; [c, b] fires on rank 0 only, with b unused; [a].
    ddp = DistributedDataParallel(params, bucket_cap_mb=150 / 2**20, first_bucket_cap_mb=8 / 2**20,
                                  strategy=strategy)
    buckets = [[ddp.bucket_plan.specs[i].name for i in b.params] for b in ddp.bucket_plan.buckets]
    grad_fn = ddp.value_and_grad(lambda p, batch: loss_on(p, batch, WORLD.rank))
    world = WORLD.size if strategy != "pmap" else ddp.world_size
    shards = [batch_of(r, 0) for r in range(world)]
    mine = (np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])) \
        if strategy == "pmap" else shards[WORLD.rank]
    want = jax.grad(lambda p: sum(loss_on(p, s, r) for r, s in enumerate(shards)) / world)(params)
    got = [grad_fn(params, mine)[1] for _ in range(3)]  # the third after the plan rebuild (hooked)
    common.report(WORLD.rank, f"unused/{strategy}", max_rel=max(rel_diff(g, want) for g in got),
                  zero=[bool(jnp.all(got[-1][n] == 0)) for n in "abcd"], buckets=buckets,
                  want_zero=[bool(jnp.all(want[n] == 0)) for n in "abcd"])


# ------------------------------------------------------------------ has_aux
def has_aux(strategy: str):
    params = {"w": jnp.arange(12, dtype=F64).reshape(IN // 2, 4) / 10}

    def loss_aux(p, batch):
        x, _ = batch
        z = x[:, : IN // 2] @ p["w"]
        return jnp.mean(z ** 2), {"z_max": jnp.max(z), "n": jnp.asarray(x.shape[0])}

    ddp = DistributedDataParallel(params, strategy=strategy)
    batch = batch_of(WORLD.rank, 0)
    if strategy == "pmap":
        batch = tuple(np.concatenate(parts) for parts in zip(*(batch_of(r, 0) for r in range(ddp.world_size))))
    (loss, aux), grads = ddp.value_and_grad(loss_aux, has_aux=True)(params, batch)
    (_, plain_aux), _ = ddp.value_and_grad(loss_aux, has_aux=True)(params, batch, sync=False)
    loss2, grads2 = ddp.value_and_grad(lambda p, b: loss_aux(p, b)[0])(params, batch)
    first = batch_of(0, 0) if strategy == "pmap" else batch  # pmap: the first device's aux
    want_loss, want_aux = loss_aux(params, first)
    close = lambda a, b: abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))  # noqa: E731
    fields = {"aux_equal": close(aux["z_max"], want_aux["z_max"]) and int(aux["n"]) == int(want_aux["n"]),
              "local_aux_equal": close(plain_aux["z_max"], loss_aux(params, batch)[1]["z_max"]),
              "grads_rel": rel_diff(grads, grads2), "loss_equal": float(loss) == float(loss2)}
    if strategy != "pmap":
        fields["loss_is_mine"] = abs(float(loss) - float(want_loss)) <= 1e-12 * abs(float(want_loss))
    # NNX: ((loss, aux), grads) too
    model = net(WORLD.rank, 100)
    ddp = DistributedDataParallel(model, strategy=strategy)
    ddp.broadcast(model)
    (_, nnx_aux), nnx_grads = ddp.nnx_value_and_grad(lambda m, b: (loss_fn(m, b), m(b[0]).shape), has_aux=True)(
        model, batch)
    fields["nnx_aux"] = [int(v) for v in nnx_aux]
    fields["nnx_grads_type"] = type(nnx_grads).__name__
    common.report(WORLD.rank, f"has_aux/{strategy}", **fields)


# ------------------------------------------------------------------ Python numbers in Variables
class Counted(nnx.Module):
    """A Param and two Variables holding Python numbers, which the forward updates (a step counter)."""

    def __init__(self):
        self.w = nnx.Param(jnp.arange(IN * OUT, dtype=F64).reshape(IN, OUT) / 10)
        self.calls = nnx.Variable(0)
        self.decay = nnx.Variable(0.5)

    def __call__(self, x):
        self.calls.set_value(self.calls.get_value() + 1)
        self.decay.set_value(self.decay.get_value() * 0.5)
        return x @ self.w


def squared_error(model, batch):
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def _squared_error_step(model, strategy: str):
    """(a DDP of `model`, broadcast; its grad_fn of squared_error; this rank's batch; the global batch)."""
    ddp = DistributedDataParallel(model, strategy=strategy)
    ddp.broadcast(model)
    world = WORLD.size if strategy != "pmap" else ddp.world_size
    shards = [batch_of(r, 0) for r in range(world)]
    whole = tuple(np.concatenate(parts) for parts in zip(*shards))
    return ddp, ddp.nnx_value_and_grad(squared_error), whole if strategy == "pmap" else shards[WORLD.rank], whole


def python_number_state(strategy: str):
    """nnx.Variables holding a Python int and float are carried through every strategy's step, per
    rank (compiled and pmap crashed on a leaf without a dtype; from the second step the updated
    value, an array by then, was taken for a buffer and broadcast from rank 0); gradients are the
    global batch's."""
    model = Counted()
    model.calls.set_value(10 * WORLD.rank)  # per rank: not a buffer of rank 0's, at any step
    _, grad_fn, mine, whole = _squared_error_step(model, strategy)
    for _ in range(3):
        _, grads = grad_fn(model, mine)
    want = nnx.grad(squared_error)(Counted(), whole)
    common.report(WORLD.rank, f"python_numbers/{strategy}", calls=int(model.calls.get_value()), me=WORLD.rank,
                  decay=float(model.decay.get_value()), max_rel=rel_diff(nnx.state(grads, nnx.Param),
                                                                         nnx.state(want, nnx.Param)))


class Warmed(nnx.Module):
    """A plain Python counter and flag the forward changes (static in NNX: held in the GraphDef), beside
    a config held as a dict of lists, which no hash takes (it crashed portddp's jit: "unhashable type")."""

    def __init__(self):
        self.w = nnx.Param(jnp.arange(IN * OUT, dtype=F64).reshape(IN, OUT) / 10)
        self.calls = 0
        self.mode = "warm-up"
        self.cfg = {"scales": [1, 2]}

    def __call__(self, x):
        self.calls += 1
        if self.calls > 2:
            self.mode = "full"
            return self.cfg["scales"][1] * (x @ self.w)
        return x @ self.w


class Rows(nnx.Module):
    """The only plain attribute the forward changes: how many rows its batch had."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((IN, OUT), dtype=F64))
        self.rows = 0

    def __call__(self, x):
        self.rows = x.shape[0]
        return x @ self.w


def plain_attributes(strategy: str):
    """(A review: portddp's grad_fn ran loss_fn on a copy and carried back only Variable state, so a plain
    attribute the forward changed -- a call counter driving a warm-up branch -- never advanced, silently.)
    Four steps: as under nnx.value_and_grad, the counter reaches 4, the branch switches at the third step,
    and the gradients follow it."""
    model = Warmed()
    _, grad_fn, mine, whole = _squared_error_step(model, strategy)
    reference = Warmed()
    worst = 0.0
    for _ in range(4):
        _, grads = grad_fn(model, mine)
        want = nnx.grad(squared_error)(reference, whole)
        worst = max(worst, rel_diff(nnx.state(grads, nnx.Param), nnx.state(want, nnx.Param)))
    # A trace is reused for another step of the same GraphDef and input shapes: the attributes set after it are
    # that trace's (a review: they were kept per GraphDef only, so a step of 4 rows after one of 2 reported 2).
    rows = [4, 4, 2, 4, 4, 2, 2] if strategy != "pmap" else []
    seen = []
    if rows:
        counted = Rows()
        _, rows_fn, mine_rows, _ = _squared_error_step(counted, strategy)
        for n in rows:
            rows_fn(counted, (mine_rows[0][:n], mine_rows[1][:n]))
            seen.append(counted.rows)
    common.report(WORLD.rank, f"plain_attributes/{strategy}", calls=model.calls, mode=model.mode,
                  reference=[reference.calls, reference.mode], max_rel=worst, rows=[rows, seen])


class Sown(nnx.Module):
    """A forward that sows a value (the NNX VAE example's KL term), which its loss pops."""

    def __init__(self):
        self.w = nnx.Param(jnp.arange(IN * OUT, dtype=F64).reshape(IN, OUT) / 10)

    def __call__(self, x):
        y = x @ self.w
        self.sow(nnx.Intermediate, "energy", jnp.mean(y ** 2))
        return y


def sown_loss(model, batch):
    return squared_error(model, batch) + 0.1 * sum(jax.tree.leaves(nnx.pop(model, nnx.Intermediate)))


def sown_after_evaluation(strategy: str):
    """An evaluation forward between steps sows a value that the next step's loss_fn pops with its own,
    as in Flax's VAE example: as under nnx.value_and_grad, that step's loss holds both and the model holds
    neither after it (compiled and pmap refused the step: "the step changed the structure of the model's
    state"; hooked left the stale value in the model, counted again at every later step)."""
    model, reference = Sown(), Sown()
    ddp = DistributedDataParallel(model, strategy=strategy)
    world = WORLD.size if strategy != "pmap" else ddp.world_size
    shards = [batch_of(r, 0) for r in range(world)]
    whole = tuple(np.concatenate(parts) for parts in zip(*shards))
    mine = whole if strategy == "pmap" else shards[WORLD.rank]
    grad_fn, native = ddp.nnx_value_and_grad(sown_loss), nnx.value_and_grad(sown_loss)
    losses, worst, left = [], 0.0, []
    for step in range(4):
        if step % 2 == 0:  # an evaluation forward, on another batch
            for m in (model, reference):
                m(batch_of(WORLD.rank, 7)[0])
        loss, grads = grad_fn(model, mine)
        want_loss, _ = native(reference, mine)
        _, want = nnx.value_and_grad(sown_loss)(Sown(), whole)  # the global batch's gradient, no stale value
        losses.append([float(loss), float(want_loss)])
        worst = max(worst, rel_diff(nnx.state(grads, nnx.Param), nnx.state(want, nnx.Param)))
        left.append(len(jax.tree.leaves(nnx.state(model, nnx.Intermediate))))
    common.report(WORLD.rank, f"sown/{strategy}", losses=losses, max_rel=worst, left=left)


class Partitioned(nnx.Module):
    """A kernel annotated with nnx.with_partitioning, which Flax creates only under a mesh."""

    def __init__(self):
        init = nnx.with_partitioning(lambda *_: jnp.arange(IN * OUT, dtype=F64).reshape(IN, OUT) / 10, (None, "model"))
        self.l = nnx.Linear(IN, OUT, kernel_init=init, param_dtype=F64, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.l(x)


def under_user_mesh(strategy: str):
    """A script that trains inside its own `jax.set_mesh(...)` (Flax's with_partitioning examples): the compiled
    strategy's shard_map refused it with JAX's 'context mesh ... should match the mesh passed to shard_map'.
    Both a synchronised step and sync=False + ddp.reduce give the global batch's gradients."""
    mesh = jax.make_mesh((1,), ("model",), devices=jax.local_devices()[:1])
    with jax.set_mesh(mesh):
        model = Partitioned()
        ddp, grad_fn, mine, whole = _squared_error_step(model, strategy)
        _, grads = grad_fn(model, mine)
        _, local = grad_fn(model, mine, sync=False)
        reduced = ddp.reduce(local)
        want = nnx.grad(squared_error)(Partitioned(), whole)
    common.report(WORLD.rank, f"user_mesh/{strategy}", step=rel_diff(nnx.state(grads, nnx.Param),
                                                                      nnx.state(want, nnx.Param)),
                  reduce=rel_diff(nnx.state(reduced, nnx.Param), nnx.state(want, nnx.Param)))


class Adapted(nnx.Module):
    """A base Linear (nnx.Param), a LoRA adapter on it (nnx.LoRAParam) and a head held as plain arrays
    (Flax's array-leaves style): three ways a module holds trainable-or-not state."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(params=seed)
        self.base = nnx.Linear(IN, HID, rngs=rngs, dtype=F64, param_dtype=F64)
        self.lora = nnx.LoRA(IN, 2, HID, rngs=rngs, dtype=F64, param_dtype=F64)
        self.lora.lora_b.set_value(jax.random.normal(rngs.params(), (2, HID), F64) / 4)  # (zeros: no grad for a)
        self.head = jax.random.normal(rngs.params(), (HID, OUT), F64) / 4
        self.head_b = jnp.zeros(OUT, F64)

    def __call__(self, x):
        return jnp.tanh(self.base(x) + self.lora(x)) @ self.head + self.head_b


def _adapters(path, x) -> bool:  # a path filter, as in Flax's array-leaves example: the LoRA and the plain head
    return isinstance(x, nnx.LoRAParam) or path[-1] in ("head", "head_b")


def wrt_subset(strategy: str):
    """DistributedDataParallel(model, wrt=F) with nnx.Optimizer(model, tx, wrt=F): three sgd steps equal the
    single-process global batch's with nnx.DiffState(0, F); the Params F leaves out are frozen: rank 0's
    after ddp.broadcast(model) (rank 1 starts from other values), no gradient, never changed."""
    mse = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731
    world = 2 if strategy == "pmap" else WORLD.size
    wholes = [tuple(np.concatenate(p) for p in zip(*(batch_of(r, s) for r in range(world)))) for s in range(3)]
    shards = wholes if strategy == "pmap" else [batch_of(WORLD.rank, s) for s in range(3)]
    out = {}
    for name, wrt in (("lora", nnx.LoRAParam), ("path", _adapters)):
        model = Adapted(seed=WORLD.rank)
        ddp = DistributedDataParallel(model, wrt=wrt, strategy=strategy, bucket_cap_mb=CAP_MB)
        ddp.broadcast(model)
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=wrt)
        grad_fn = ddp.nnx_value_and_grad(mse)
        for batch in shards:
            _, grads = grad_fn(model, batch)
            opt.update(model, grads)
        ref = Adapted(seed=0)
        ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=wrt)
        for batch in wholes:
            ref_opt.update(ref, nnx.grad(mse, argnums=nnx.DiffState(0, wrt))(ref, batch))
        out[name] = {"max_rel": rel_diff(nnx.state(model), nnx.state(ref)),
                     "grads": sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
                         nnx.to_pure_dict(grads))[0]),
                     "base_is_rank0s": bool(jnp.array_equal(model.base.kernel[...], Adapted(seed=0).base.kernel[...]))}
    common.report(WORLD.rank, f"wrt/{strategy}", **out)


def changed_on_one_shard(strategy: str):
    """A forward that changes a trained Param only where its shard holds a large input -- the last rank's
    (compiled) or the last device's (pmap, whose aux is the first device's: the change went unseen) -- is
    refused on every rank and for every device."""
    model = net(WORLD.rank, 100)
    ddp = DistributedDataParallel(model, strategy=strategy)
    world = WORLD.size if strategy != "pmap" else ddp.world_size

    def shrinks_when_large(m, b):
        m.l1.kernel[...] = jnp.where(jnp.abs(b[0]).max() > 50, m.l1.kernel[...] * 0.5, m.l1.kernel[...])
        return loss_fn(m, b)

    shards = [batch_of(r, 0) for r in range(world)]
    shards[-1] = (shards[-1][0] * 1000, shards[-1][1])
    mine = (np.concatenate([s[0] for s in shards]), np.concatenate([s[1] for s in shards])) \
        if strategy == "pmap" else shards[WORLD.rank]
    try:
        ddp.nnx_value_and_grad(shrinks_when_large)(model, mine)
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    common.report(WORLD.rank, f"changed_on_one_shard/{strategy}", outcome=outcome)


# ------------------------------------------------------------------ bad input
def bad(case: str) -> None:
    last = WORLD.rank == WORLD.size - 1
    params = {"w": jnp.ones((IN, OUT), F64)}
    batch = batch_of(WORLD.rank, 0)
    mse = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)  # noqa: E731
    if case == "tuple_loss_without_has_aux":
        def returns_pair(p, b):
            return mse(p, b), {"acc": 1.0}

        DistributedDataParallel(params).value_and_grad(returns_pair)(params, batch)
    elif case == "nnx_tuple_loss_without_has_aux":  # (the fix names the method the loss was given to)
        model = net(WORLD.rank, 100)
        DistributedDataParallel(model).nnx_value_and_grad(lambda m, b: (loss_fn(m, b), 0.0))(model, batch)
    elif case == "has_aux_without_pair":
        DistributedDataParallel(params).value_and_grad(mse, has_aux=True)(params, batch)
    elif case == "compiled_inside_jit":
        grad_fn = DistributedDataParallel(params, strategy="compiled").value_and_grad(mse)
        jax.jit(lambda p, b: grad_fn(p, b)[1])(params, batch)
    elif case == "rngs_captured_outside":
        rngs = nnx.Rngs(dropout=WORLD.rank)
        ddp = DistributedDataParallel(params)
        ddp.value_and_grad(lambda p, b: mse(p, b) + 0 * jax.random.normal(rngs.dropout(), ()))(params, batch)
    elif case in ("rngs_in_batch", "rngs_in_batch_nnx_jit"):  # (Flax's MNIST tutorial passes its Rngs so)
        model, drop = net(WORLD.rank, 100), nnx.Dropout(0.5)
        ddp = DistributedDataParallel(model)
        grad_fn = ddp.nnx_value_and_grad(lambda m, b: jnp.mean(drop(m(b[0][0]), rngs=b[1])))
        if case == "rngs_in_batch":
            grad_fn(model, (batch, nnx.Rngs(dropout=WORLD.rank)))
        else:  # (in jit, Flax itself does not refuse it: the stream stayed where it was, the same masks each step)
            nnx.jit(lambda m, b, r: grad_fn(m, (b, r))[0])(model, batch, nnx.Rngs(dropout=WORLD.rank))
    elif case == "key_in_params":
        class Keyed(nnx.Module):
            def __init__(self):
                self.w = nnx.Param(jnp.ones((IN, OUT), F64))
                self.seed = nnx.Param(jax.random.key(0))

        DistributedDataParallel(Keyed())
    elif case == "module_to_pytree_grad_fn":
        model = net(WORLD.rank, 100)
        DistributedDataParallel(model).value_and_grad(loss_fn)(model, batch)
    elif case == "key_in_batch_compiled":
        ddp = DistributedDataParallel(params, strategy="compiled")
        ddp.value_and_grad(lambda p, b: mse(p, b[0]))(params, (batch, jax.random.key(WORLD.rank)))
    elif case == "scalar_in_batch_compiled":
        ddp = DistributedDataParallel(params, strategy="compiled")
        ddp.value_and_grad(lambda p, b: mse(p, b[0]) * b[1])(params, (batch, jnp.float32(0.5)))
    elif case == "buffers_differ":
        model = net(WORLD.rank, 100)
        if last:
            model.bn.mean = nnx.BatchStat(jnp.zeros(HID + 1, model.bn.mean[...].dtype))
        DistributedDataParallel(model).broadcast(model)
    elif case == "no_param_in_module":  # Flax's array-leaves style, its weights plain arrays
        class Plain(nnx.Module):
            def __init__(self):
                self.w = jnp.ones((IN, OUT), F64)

        DistributedDataParallel(Plain())
    elif case == "frozen_params_differ":  # wrt= trains the LoRA (equal); the frozen base is per rank; no broadcast
        model = Adapted(seed=WORLD.rank)
        model.lora = Adapted(seed=0).lora
        ddp = DistributedDataParallel(model, wrt=nnx.LoRAParam)
        ddp.nnx_value_and_grad(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))(model, batch)
    elif case in ("param_changed_in_forward", "param_changed_in_forward_compiled", "param_changed_in_forward_in_jit"):
        # As torch's Embedding(max_norm=) ported to NNX renormalises the rows its batch uses, in the Param itself:
        # each rank changes it from its own batch (nnx.value_and_grad writes it back; portddp dropped it, silently).
        # Here every rank changes it (a rank whose forward did not is stopped as for any other rank's failure).
        model = net(WORLD.rank, 100)

        def renorms(m, b):
            m.l1.kernel[...] = jax.lax.stop_gradient(m.l1.kernel[...] * (0.99 - 0.01 * jnp.abs(b[0][0, 0])))
            return loss_fn(m, b)

        ddp = DistributedDataParallel(model, strategy="compiled" if case.endswith("compiled") else "hooked")
        grad_fn = ddp.nnx_value_and_grad(renorms)
        if case.endswith("in_jit"):  # (raised when the program runs: XLA's error around it)
            jax.block_until_ready(nnx.jit(grad_fn)(model, batch))
        else:
            grad_fn(model, batch)
    elif case == "broadcast_buffers_differ":
        model = net(WORLD.rank, 100)
        DistributedDataParallel(model, broadcast_buffers=not last).broadcast(model)
    else:
        raise SystemExit(f"unknown case {case!r}")


BAD_CASES = ("tuple_loss_without_has_aux", "nnx_tuple_loss_without_has_aux", "has_aux_without_pair", "compiled_inside_jit", "rngs_captured_outside",
             "rngs_in_batch", "rngs_in_batch_nnx_jit",
             "key_in_params", "module_to_pytree_grad_fn", "key_in_batch_compiled", "scalar_in_batch_compiled",
             "buffers_differ", "broadcast_buffers_differ", "no_param_in_module", "frozen_params_differ",
             "param_changed_in_forward", "param_changed_in_forward_compiled", "param_changed_in_forward_in_jit")


def all_bad_cases() -> None:
    """Each case in turn, as common.run_case reports it but prefixed `[case] ` and without exiting;
    a barrier between cases keeps the ranks in step (every case fails before or after a collective
    that all ranks reach, so none is left half done)."""
    from portddp.transport import get_transport  # noqa: PLC0415

    for case in BAD_CASES:
        try:
            bad(case)
            line = f"[{case}] PORTDDP_NO_ERROR rank={WORLD.rank}\n"
        except Exception as e:  # the message is what is under test
            flat = str(e).replace("\n", " ")  # (one line: XLA's error holds the callback's traceback)
            line = f"[{case}] PORTDDP_ERROR rank={WORLD.rank} {type(e).__name__}: {flat}\n"
        os.write(1, line.encode())  # one write() per line: mpirun never splits it
        get_transport().barrier()


def scalar_batch_leaf(strategy: str):
    """A 0-d batch leaf (a per-step constant): compiled and pmap split every batch leaf along its first
    axis, so they refuse it naming the fix (pmap raised IndexError); hooked takes it as it is."""
    params = {"w": jnp.ones((IN, OUT), F64)}
    grad_fn = DistributedDataParallel(params, strategy=strategy).value_and_grad(
        lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2) * b[2])
    x, y = batch_of(WORLD.rank, 0)
    try:
        grad_fn(params, (x, y, jnp.float64(2.0)))
        outcome = "OK"
    except ValueError as e:
        outcome = f"ValueError: {e}"
    common.report(WORLD.rank, f"scalar_batch/{strategy}", outcome=outcome)


def main(strategies):
    """Every scenario for each of `strategies` (pmap: in a world of one, over 2 forced host devices)."""
    for strategy in strategies:
        if strategy != "pmap":
            nnx_train(strategy)
            nnx_no_dropout_vs_global_batch(strategy)
        under_user_mesh(strategy)
        unused_leaves(strategy)
        has_aux(strategy)
        python_number_state(strategy)
        plain_attributes(strategy)
        sown_after_evaluation(strategy)
        wrt_subset(strategy)
        scalar_batch_leaf(strategy)
        captured_values(strategy)
        if strategy != "hooked":
            changed_on_one_shard(strategy)
    if "hooked" in strategies:
        nnx_train("hooked", jit=True)
        nnx_train("hooked", broadcast_buffers=False)


if __name__ == "__main__":
    if _BAD_CASE == "all":
        all_bad_cases()
    elif _BAD_CASE is not None:
        common.run_case(WORLD.rank, bad, _BAD_CASE)
    else:
        main(sys.argv[1:] or ["hooked", "compiled"])
