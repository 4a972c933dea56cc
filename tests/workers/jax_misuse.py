"""Misuses of portddp.jax that used to give wrong results or raw errors (issue 17, JAX items),
run by tests/test_jax_misuse.py:

    mpirun -n 2 python -m tests.workers.jax_misuse            # every in-process case, one line each
    mpirun -n 2 python -m tests.workers.jax_misuse hook_raises # rank 1's comm hook raises: the job ends
    mpirun -n 2 python -m tests.workers.jax_misuse overlap     # two synchronised steps in two traces
    mpirun -n 2 python -m tests.workers.jax_misuse caught_failure  # a step failed on rank 1, caught there
    XLA_FLAGS=--xla_force_host_platform_device_count=2 mpirun -n 2 python -m tests.workers.jax_misuse mapped

Each in-process case prints `CASE <name> rank=<r> <outcome>` on every rank, where the outcome
is `OK <detail>` or `<ExceptionType>: <message>`; every case fails (or succeeds) alike on every
rank before it leaves a collective half done, so the next case starts clean.
"""

from __future__ import annotations

import functools
import os
import sys

import portddp

MODE = sys.argv[1] if len(sys.argv) > 1 else "cases"
HOOK_RAISES = MODE == "hook_raises"
WORLD = portddp.init(torch_distributed=False, jax_distributed=MODE == "cases")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from portddp.jax import DistributedDataParallel, allreduce_hook  # noqa: E402
from portddp.transport import get_transport  # noqa: E402

CAP_MB = 40 / 2**20  # a few buckets


def init_params():
    rng = np.random.default_rng(0)
    return {"enc": {"w": jnp.asarray(rng.standard_normal((4, 4)), jnp.float32), "b": jnp.zeros(4, jnp.float32)},
            "dec": {"w": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)}}


def loss_fn(p, x):
    return jnp.mean(jnp.tanh(x @ p["enc"]["w"] + p["enc"]["b"]) @ p["dec"]["w"])


def batch(step: int, rows: int = 3):
    return jnp.asarray(np.random.default_rng(100 * step + WORLD.rank).standard_normal((rows, 4)), jnp.float32)


def rel(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / max(1.0, float(jnp.max(jnp.abs(y)))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def hooked_under_scan():
    """Legal: lax.scan over two steps of a hooked grad_fn gives the eager steps' gradients."""
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(loss_fn)
    eager = [grad_fn(params, batch(s))[1] for s in range(2)]
    _, scanned = jax.lax.scan(lambda c, x: (c, grad_fn(params, x)[1]), 0, jnp.stack([batch(0), batch(1)]))
    worst = max(rel(jax.tree.map(lambda g: g[s], scanned), eager[s]) for s in range(2))
    assert worst < 1e-6, worst
    return f"max_rel={worst:.1e}"


def steps_in_one_jit():
    """Legal: two synchronised grad_fn calls in one jax.jit -- two SGD steps unrolled, then SAM's
    pair (the second gradient at params moved along the first) and two micro-batches averaged --
    give the eager calls' numbers. The second call's iteration used to open while the first one's
    buckets were still being reduced (host callbacks run in data order only), mixing the two."""
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(loss_fn)
    sgd = lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g)  # noqa: E731

    def unrolled(p, x0, x1):
        p = sgd(p, grad_fn(p, x0)[1])
        return sgd(p, grad_fn(p, x1)[1])

    def sam(p, x0, x1):
        g = grad_fn(p, x0)[1]
        return sgd(p, grad_fn(sgd(p, jax.tree.map(lambda a: -0.5 * a, g)), x0)[1])

    def two_micro(p, x0, x1):
        return sgd(p, jax.tree.map(lambda a, b: (a + b) / 2, grad_fn(p, x0)[1], grad_fn(p, x1)[1]))

    worst = 0.0
    for fn in (unrolled, sam, two_micro):
        eager = fn(params, batch(0), batch(1))
        worst = max(worst, rel(jax.jit(fn)(params, batch(0), batch(1)), eager))
    assert worst < 1e-6, worst
    return f"max_rel={worst:.1e}"


def report(name: str, outcome: str) -> None:
    """`CASE <name> rank=<r> <outcome>` in one write() (mpirun does not split it when it merges the
    ranks' output)."""
    os.write(1, f"CASE {name} rank={WORLD.rank} {outcome}\n".encode())


def two_ddps_in_one_jit():
    """Legal: two DistributedDataParallels (a GAN's two models) whose grad_fns share one jax.jit,
    with other amounts of work per rank: each gets its own mean. Their steps share one transport;
    XLA ordered their host callbacks as each rank's timing fell, and the ranks summed one DDP's
    buckets with the other's (at equal sizes, silently)."""
    pa, pb = init_params(), jax.tree.map(lambda x: x * 2, init_params())
    ga = DistributedDataParallel(pa, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(loss_fn)
    gb = DistributedDataParallel(pb, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(
        lambda p, x: jnp.mean(jnp.sin(x @ p["enc"]["w"] - p["enc"]["b"]) @ p["dec"]["w"]) ** 2)
    rows_a, rows_b = (300, 3) if WORLD.rank == 0 else (3, 300)  # A's buckets ready first on rank 1, B's on rank 0
    xa, xb = batch(0, rows_a), batch(1, rows_b)
    eager = ga(pa, xa)[1], gb(pb, xb)[1]
    both = jax.jit(lambda pa, pb, xa, xb: (ga(pa, xa)[1], gb(pb, xb)[1]))(pa, pb, xa, xb)
    worst = max(rel(both[0], eager[0]), rel(both[1], eager[1]))
    assert worst < 1e-6, worst
    return f"max_rel={worst:.1e}"


def uneven_steps_in_one_jit():
    """Legal: two synchronised grad_fn calls in one jax.jit (two micro-batches averaged, then the
    first's update feeding the second) under ddp.uneven(), rank 0 running out two steps early: the
    jitted loop gives the eager loop's parameters. A joined rank's two shadow iterations in one
    program are chained like steps (nothing else orders them for XLA)."""
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    sgd = lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g)  # noqa: E731

    def two_micro(p, x0, x1):
        return sgd(p, jax.tree.map(lambda a, b: (a + b) / 2, grad_fn(p, x0)[1], grad_fn(p, x1)[1]))

    def unrolled(p, x0, x1):
        return sgd(sgd(p, grad_fn(p, x0)[1]), grad_fn(p, x1)[1])

    pairs = [(batch(2 * s), batch(2 * s + 1)) for s in range(2 + 2 * WORLD.rank)]
    worst = 0.0
    for fn in (two_micro, unrolled):
        out = {}
        for mode, run in (("eager", fn), ("jit", jax.jit(fn))):
            p = params
            for b in ddp.uneven(pairs):
                p = run(p, *((b, b) if b is ddp.JOINED else b))
            out[mode] = p
        worst = max(worst, rel(out["jit"], out["eager"]))
    assert worst < 1e-6, worst
    return f"max_rel={worst:.1e}"


def rngs_as_third_argument():
    """The Flax MNIST tutorial's grad_fn(model, batch, rngs): named as sync's place (was "'RngStream' object is
    not iterable": an nnx.Rngs answers any attribute, `shape` too -- an audit)."""
    from flax import nnx  # noqa: PLC0415

    params = init_params()
    DistributedDataParallel(params).value_and_grad(loss_fn)(params, batch(0), nnx.Rngs(0))


def extra_positional_input():
    """grad_fn(params, x, y): the third argument is sync, named as such (was numpy's "truth value of
    an array ... is ambiguous"), on every rank before any collective."""
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(
        lambda p, x, y: loss_fn(p, x) + jnp.mean(y))
    grad_fn(params, batch(0), jnp.zeros((3, 1)))


def steps_in_two_traces():
    """Refused: one synchronised step inside lax.scan, one after it, in one jit -- they cannot be
    chained, and the second used to open its iteration over the first's (silently wrong sums).
    Whether a rank sees the overlap depends on XLA's scheduling: the one that does raises, the
    others are stopped by the watchdog naming it."""
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(loss_fn)

    @jax.jit
    def step(p, xs, x):
        _, scanned = jax.lax.scan(lambda c, xi: (c, grad_fn(p, xi)[1]), 0, xs)
        return scanned, grad_fn(p, x)[1]

    for s in range(20):  # (a rank that happens not to overlap goes on; one that does raises)
        jax.block_until_ready(step(params, jnp.stack([batch(s)]), batch(s + 1)))


def grad_fn_under_shard_map():
    """Refused at trace time on every rank: with 2 devices per process, a hooked grad_fn under
    jax.shard_map or jax.pmap ran its host callbacks once per device (wrong sums, or a wrong
    diagnosis)."""
    from jax.sharding import PartitionSpec  # noqa: PLC0415

    params = init_params()
    grad_fn = DistributedDataParallel(params).value_and_grad(loss_fn)
    mesh = jax.make_mesh((2,), ("d",), devices=jax.local_devices()[:2])
    x = jax.device_put(batch(0, rows=4), jax.NamedSharding(mesh, PartitionSpec("d")))
    for name, run in (("shard_map", lambda: jax.jit(jax.shard_map(
            lambda x: grad_fn(params, x)[1], mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec()))(x)),
                      ("pmap", lambda: jax.pmap(lambda x: grad_fn(params, x)[1])(batch(0, rows=4).reshape(2, 2, 4)))):
        try:
            run()
            outcome = "OK (not refused)"
        except ValueError as e:
            outcome = f"ValueError: {e}"
        report(name, outcome)
    try:  # called eagerly on a batch laid over both devices (was: XLA's RET_CHECK on its host callbacks)
        auto = jax.sharding.Mesh(np.array(jax.local_devices()[:2]), ("d",))  # (a mesh of the classic, automatic kind)
        grad_fn(params, jax.device_put(batch(0, rows=4), jax.NamedSharding(auto, PartitionSpec("d"))))
        outcome = "OK (not refused)"
    except ValueError as e:
        outcome = f"ValueError: {e}"
    report("split_batch", outcome)


def held_gradients_lent():
    """Legal: eager hooked steps lend the reduced buckets as the gradients (zero copy); gradients the
    caller still holds -- the arrays, a numpy view of one, arrays a donating jit consumed -- are
    never overwritten by later steps."""
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    params = ddp.broadcast(params)
    grad_fn, local = ddp.value_and_grad(loss_fn), jax.jit(jax.grad(loss_fn))

    def mean_of_ranks(step):  # every rank's batch is known here: the mean, computed locally
        grads = [local(params, jnp.asarray(np.random.default_rng(100 * step + r).standard_normal((3, 4)),
                                            jnp.float32)) for r in range(WORLD.size)]
        return jax.tree.map(lambda *g: sum(g) / WORLD.size, *grads)

    donate = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g), donate_argnums=1)
    held, kept, zero_copy = [], None, False
    for step in range(5):
        grads = grad_fn(params, batch(step))[1]
        leaves = jax.tree.leaves(grads)
        zero_copy |= any(b.ctypes.data <= x.unsafe_buffer_pointer() < b.ctypes.data + b.nbytes
                         for x in leaves for b in ddp._buffers)
        if step == 0:
            kept = np.asarray(grads["enc"]["w"])  # a numpy view of the lent memory
        if step == 1:
            donate(params, grads)  # consumed: its memory may be reused
            continue
        held.append((step, grads))
    worst = max(rel(g, mean_of_ranks(step)) for step, g in held)
    worst = max(worst, float(np.max(np.abs(kept - mean_of_ranks(0)["enc"]["w"]))))
    assert worst < 1e-6, worst
    return f"held={len(held)} zero_copy={zero_copy}"


def dropped_ddp_is_freed():
    """Legal: a hooked DDP the caller drops is freed, and its buckets' shared memory returns, after
    eager (lending) steps, steps inside the caller's jit and uneven inputs alike -- JAX's caches
    keep the compiled programs and their host callbacks, which must not keep the DDP (a sweep
    building one DDP after another filled the shared window and fell back to copies)."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    shm = get_transport()._shm
    free = (lambda: sum(hi - lo for lo, hi in shm._free)) if shm is not None else (lambda: 0)
    gc.collect()
    before, alive = free(), []
    for mode in ("eager", "jit", "uneven"):
        params = init_params()
        ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
        params = ddp.broadcast(params)
        grad_fn = ddp.value_and_grad(loss_fn)
        step = jax.jit(grad_fn) if mode == "jit" else grad_fn
        batches = [batch(s) for s in range(2 + WORLD.rank)] if mode == "uneven" else [batch(0), batch(1)]
        grads = None
        for b in ddp.uneven(batches) if mode == "uneven" else batches:
            grads = step(params, b)[1]
        del grads
        ref = weakref.ref(ddp)
        del ddp, grad_fn, step
        gc.collect()
        if ref() is not None:
            alive.append(mode)
    assert not alive, f"still alive after del + gc.collect(): {alive}"
    assert free() == before, (free(), before)
    return f"freed=3 shm_back={shm is not None}"


def program_outlives_its_ddp():
    """A step jitted around grad_fn, run again after the DDP and grad_fn were dropped (the program
    stays in JAX's cache; its callbacks hold the DDP weakly): refused on every rank, naming why,
    before any collective."""
    import gc  # noqa: PLC0415

    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    holder = {"grad_fn": grad_fn}
    step = jax.jit(lambda p, x: holder["grad_fn"](p, x)[1])
    jax.block_until_ready(step(params, batch(0)))
    del ddp, grad_fn, holder["grad_fn"]
    gc.collect()
    try:
        jax.block_until_ready(step(params, batch(1)))
    except Exception as e:  # XLA's error quotes the callback's traceback; its last line is ours
        raise RuntimeError(str(e).strip().splitlines()[-1].removeprefix("RuntimeError: ")) from None
    return "ran"


def pmap_under_mpirun():
    """strategy='pmap' in a job of 2 processes: each would train alone; refused on every rank."""
    DistributedDataParallel(init_params(), strategy="pmap")
    return "no error"


def differentiate_grad_fn(strategy="hooked"):
    """MAML's outer gradient taken through a grad_fn: refused in portddp's words (hooked: JAX said
    "Buffer callbacks do not support JVP"; compiled: refused in jit's words, an audit found)."""
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB,
                                      strategy=strategy).value_and_grad(loss_fn)
    outer = lambda p: loss_fn(jax.tree.map(lambda a, b: a - 0.1 * b, p, grad_fn(p, batch(0))[1]), batch(1))  # noqa: E731
    jax.grad(outer)(params)
    return "no error"


def hooked_vmap():
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(loss_fn)
    jax.vmap(grad_fn, in_axes=(None, 0))(params, jnp.stack([batch(0), batch(1)]))


def hooked_vmap_of_jit():
    params = init_params()
    grad_fn = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB).value_and_grad(loss_fn)
    jax.vmap(jax.jit(grad_fn), in_axes=(None, 0))(params, jnp.stack([batch(0), batch(1)]))


def compiled_vmap():
    params = init_params()
    grad_fn = DistributedDataParallel(params, strategy="compiled").value_and_grad(loss_fn)
    jax.vmap(grad_fn, in_axes=(None, 0))(params, jnp.stack([batch(0), batch(1)]))


def compiled_scan():
    params = init_params()
    grad_fn = DistributedDataParallel(params, strategy="compiled").value_and_grad(loss_fn)
    jax.lax.scan(lambda c, x: (c, grad_fn(params, x)[1]), 0, jnp.stack([batch(0), batch(1)]))


def other_shapes(strategy: str):
    params = init_params()
    grad_fn = DistributedDataParallel(params, strategy=strategy).value_and_grad(loss_fn)
    grad_fn(params, batch(0))
    bigger = {**params, "dec": {"w": jnp.zeros((4, 3), jnp.float32)}}
    grad_fn(bigger, batch(1))


def other_dtype():
    params = init_params()
    grad_fn = DistributedDataParallel(params).value_and_grad(loss_fn)
    grad_fn(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), batch(0).astype(jnp.bfloat16))


def accumulate_inside_jit():
    """Legal: rank 0 accumulates two micro-batches with grad_fn(sync=False) inside its own jax.jit,
    rank 1 eagerly; then a synchronised step. Every call counts as a step (the counts are compared
    at the reduction), so the ranks agree and the step succeeds."""
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    local = jax.jit(lambda p, x: grad_fn(p, x, sync=False)) if WORLD.rank == 0 else \
        (lambda p, x: grad_fn(p, x, sync=False))
    for s in range(2):
        jax.block_until_ready(local(params, batch(s)))
    jax.block_until_ready(grad_fn(params, batch(2)))
    return f"steps={ddp._step_count}"


def local_step_on_one_rank(strategy: str, then: str = "step"):
    """Rank 0 runs one grad_fn(sync=False) step more than rank 1, then both synchronise (a step,
    or ddp.reduce() of what they accumulated): every psum from then on would pair rank 0's step
    k+1 with rank 1's step k. Or (`reduce_on_one_rank`) rank 0 synchronises a step while rank 1
    reduces what it holds. Refused on every rank, naming both steps (the compiled program
    all-gathers the step counts beside its psums; the hooked one sends them with its used counts)."""
    params = init_params()
    ddp = DistributedDataParallel(params, strategy=strategy, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    grad_fn(params, batch(0))
    if then == "reduce":  # rank 0 accumulates two local steps, rank 1 one; both reduce
        local = [grad_fn(params, batch(s), sync=False)[1] for s in range(2 - WORLD.rank)]
        ddp.reduce(jax.tree.map(lambda *gs: sum(gs), *local))
        return "no error"
    if then == "reduce_on_one_rank":  # rank 0 synchronises a step, rank 1 reduces what it has
        if WORLD.rank == 0:
            grad_fn(params, batch(1))
        else:
            ddp.reduce(jax.tree.map(jnp.ones_like, params))
        return "no error"
    if WORLD.rank == 0:
        grad_fn(params, batch(1), sync=False)
    grad_fn(params, batch(2))
    return "no error"


def reduce_before_any_step(strategy: str):
    """Rank 0 accumulates one grad_fn(sync=False) step, rank 1 none (its gradients from elsewhere);
    both call ddp.reduce(): rank 1's count is 0, which the check used to read as a join() shadow's
    and let pass. Refused on every rank, naming rank 1 as the one that never stepped."""
    params = init_params()
    ddp = DistributedDataParallel(params, strategy=strategy, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    local = grad_fn(params, batch(0), sync=False)[1] if WORLD.rank == 0 else jax.tree.map(jnp.ones_like, params)
    ddp.reduce(local)
    return "no error"


def same_local_steps_compiled():
    """Legal: both ranks accumulate two sync=False steps, then ddp.reduce() (compiled): the counts
    agree, and the reduced gradients are the mean of the two ranks' sums."""
    params = init_params()
    ddp = DistributedDataParallel(params, strategy="compiled", bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    acc = jax.tree.map(lambda a, b: a + b, *(grad_fn(params, batch(s), sync=False)[1] for s in range(2)))
    reduced = ddp.reduce(acc)
    everyone = get_transport().allgather_object([np.asarray(x) for x in jax.tree.leaves(acc)])
    mean = [sum(xs) / 2 for xs in zip(*everyone)]
    worst = max(float(np.max(np.abs(np.asarray(r) - m))) for r, m in zip(jax.tree.leaves(reduced), mean))
    assert worst < 1e-6, worst
    return f"steps={ddp._step_count} max_abs={worst:.1e}"


def reduce_inside_jit():
    """ddp.reduce() reduces arrays on the host: inside jit it is refused, naming the traced way."""
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    grad_fn = ddp.value_and_grad(loss_fn)
    jax.jit(lambda p, x: ddp.reduce(grad_fn(p, x, sync=False)[1]))(params, batch(0))


def model_grew():
    """A Flax NNX model given a new layer after it was wrapped: the error names the new leaves."""
    from flax import nnx  # noqa: PLC0415

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 4, rngs=rngs)
            self.l2 = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            x = self.l2(jnp.tanh(self.l1(x)))
            return self.l3(x) if hasattr(self, "l3") else x

    model = Net(nnx.Rngs(0))
    grad_fn = DistributedDataParallel(model).nnx_value_and_grad(lambda m, x: jnp.mean(m(x)))
    grad_fn(model, batch(0))
    model.l3 = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    grad_fn(model, batch(1))


def buffers_differ_compiled():
    """strategy='compiled', a BatchStat of another shape on rank 1 and no ddp.broadcast(model):
    named on every rank before the program runs (XLA's broadcast of it aborted the process)."""
    from flax import nnx  # noqa: PLC0415

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 2, rngs=rngs)
            self.stat = nnx.BatchStat(jnp.zeros(3 + WORLD.rank))

        def __call__(self, x):
            return self.l1(x) + self.stat.value.sum()

    model = Net(nnx.Rngs(0))
    grad_fn = DistributedDataParallel(model, strategy="compiled").nnx_value_and_grad(lambda m, x: jnp.mean(m(x)))
    grad_fn(model, batch(0))
    return "no error"


def buffers_on_one_rank(strategy: str):
    """Rank 0's model has a BatchStat, rank 1's has none (the same Params): rank 1 would skip the
    buffer broadcast rank 0 issues and the next collectives would pair wrongly (MPI's raw error;
    compiled: a Gloo timeout). Named on every rank at the first synchronised step."""
    from flax import nnx  # noqa: PLC0415

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 2, rngs=rngs)
            if WORLD.rank == 0:
                self.stat = nnx.BatchStat(jnp.zeros(3))

        def __call__(self, x):
            return self.l1(x) + (self.stat.value.sum() if WORLD.rank == 0 else 0.0)

    model = Net(nnx.Rngs(0))
    grad_fn = DistributedDataParallel(model, strategy=strategy).nnx_value_and_grad(lambda m, x: jnp.mean(m(x)))
    grad_fn(model, batch(0))
    return "no error"


def crossed_unused_leaves_compiled():
    """Rank 0's loss uses only leaf a, rank 1's only leaf c, each leaf its own bucket. Each process
    traces its own compiled program, and XLA dropped the psum of a bucket whose gradient it found
    constant (zeros): rank 0 summed its bucket a with rank 1's bucket c -- wrong gradients on both,
    silently (or a hang, where the counts of all-reduces differed). Now equal to hooked's."""
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32),
              "c": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)}

    def loss(p, x):
        return jnp.mean((x @ p["a"]) ** 2) if WORLD.rank == 0 else jnp.mean((x @ p["c"]) ** 3)

    cap = 32 / 2**20  # one (4, 2) float32 leaf per bucket
    got = {strategy: DistributedDataParallel(params, strategy=strategy, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
           .value_and_grad(loss)(params, batch(0))[1] for strategy in ("compiled", "hooked")}
    return f"max_rel={rel(got['compiled'], got['hooked']):.1e}"


def wrt_on_one_rank():
    """Rank 0 trains only its LoRA weights (wrt=nnx.LoRAParam), rank 1 every Param: named as the
    argument that differs, on every rank (it was reported as the first differing leaf)."""
    from flax import nnx  # noqa: PLC0415

    model = nnx.LoRA(4, 2, 3, base_module=nnx.Linear(4, 3, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
    DistributedDataParallel(model, wrt=nnx.LoRAParam if WORLD.rank == 0 else None)
    return "no error"


def reverse_loss(p, x):
    """Uses its two equal-sized parameters in the reverse of their order: a re-plan swaps them."""
    return jnp.mean(jnp.tanh(jnp.tanh(x @ p["b"]) @ p["a"]))


def eager_and_jitted(first_jitted_step: dict | None = None, local_jitted_on: int | None = None):
    """Legal: rank 1 calls the hooked grad_fn inside jax.jit from step `first_jitted_step[1]` on,
    rank 0 eagerly throughout -- or (`local_jitted_on`) every step starts with a grad_fn(sync=False)
    call, inside jax.jit on that rank, eager on the other, before an eager synchronised one. Two
    equal-sized parameters, one per bucket. A rank calling eagerly re-plans from the order
    gradients arrived in; a traced program cannot: every rank must end with the same plan (an
    eager rank used to re-plan alone, and its buckets then summed one parameter with the other's)."""
    params = {"a": jnp.eye(4) * 0.5 + 0.01, "b": jnp.eye(4) * 0.3 - 0.02}
    cap = 4 * 4 * 4 / 2**20
    ddp = DistributedDataParallel(params, bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    grad_fn = ddp.value_and_grad(reverse_loss)
    jitted = jax.jit(grad_fn)
    start = (first_jitted_step or {}).get(WORLD.rank)
    local = jax.jit(lambda p, x: grad_fn(p, x, sync=False)) if WORLD.rank == local_jitted_on else (
        lambda p, x: grad_fn(p, x, sync=False))
    worst = 0.0
    for step in range(3):
        if local_jitted_on is not None:
            local(params, batch(step, 4))
        xs = [jnp.asarray(np.random.default_rng(100 * step + r).standard_normal((3, 4)), jnp.float32) for r in range(2)]
        want = jax.tree.map(lambda a, b: (a + b) / 2, *(jax.grad(reverse_loss)(params, x) for x in xs))
        _, grads = (jitted if start is not None and step >= start else grad_fn)(params, xs[WORLD.rank])
        worst = max(worst, rel(grads, want))
    plans = get_transport().allgather_object([list(b.params) for b in ddp.bucket_plan.buckets])
    return f"same_plan={plans[0] == plans[1]} max_rel_ok={worst < 1e-5}"


def other_containers():
    """The same leaf paths in other containers (a tuple where DDP was built with a list)."""
    params = [jnp.ones((4, 2), jnp.float32), jnp.zeros(2, jnp.float32)]
    grad_fn = DistributedDataParallel(params).value_and_grad(lambda p, x: jnp.mean(x @ p[0] + p[1]))
    grad_fn(tuple(params), batch(0))


def per_rank_init(strategy, jitted=False):
    """Every rank initialises its own parameters (another seed) and never calls ddp.broadcast():
    eager grad_fn refuses to average different models; under the caller's jit, a warning."""
    import warnings  # noqa: PLC0415

    params = jax.tree.map(lambda x: x + WORLD.rank, init_params())
    grad_fn = DistributedDataParallel(params, strategy=strategy).value_and_grad(loss_fn)
    if not jitted:
        grad_fn(params, batch(0))
        return "no error"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(grad_fn)(params, batch(0))
    return "warned: " + "; ".join(str(w.message) for w in caught if w.category is RuntimeWarning)


def one_element_apart(strategy):
    """(A review, 2026-12-06: the digest sampled 4096 values per leaf, so ranks whose 8192-value
    leaf differed at one element trained apart silently.) Every value counts now."""
    params = {**init_params(), "big": jnp.zeros(8192, jnp.float32).at[1].set(float(WORLD.rank))}
    grad_fn = DistributedDataParallel(params, strategy=strategy).value_and_grad(
        lambda p, x: loss_fn(p, x) + jnp.sum(p["big"] ** 2))
    grad_fn(params, batch(0))
    return "no error"


def per_rank_init_reduce(strategy):
    """As per_rank_init, but the ranks only accumulate sync=False steps and then call reduce():
    that reduction is the first synchronised step, refused as grad_fn's."""
    params = jax.tree.map(lambda x: x + WORLD.rank, init_params())
    ddp = DistributedDataParallel(params, strategy=strategy)
    ddp.reduce(ddp.value_and_grad(loss_fn)(params, batch(0), sync=False)[1])
    return "no error"


def abstract_init(strategy, apart=True):
    """Built from abstract shapes (jax.eval_shape: no values to compare at construction), each rank then
    making its own parameters: the first synchronised step compares them (found by an audit: the
    replicas trained apart, exit 0); equal ones train."""
    params = jax.tree.map(lambda x: x + WORLD.rank * apart, init_params())
    grad_fn = DistributedDataParallel(jax.eval_shape(init_params), strategy=strategy).value_and_grad(loss_fn)
    loss, _ = grad_fn(params, batch(0))
    return f"loss={float(loss):.3f}"


def scaled_loss(p, x, k):
    return loss_fn(p, x) * k


def grad_fn_built_every_step(strategy, new_lambdas=0):
    """grad_fn built inside the step (Flax's tutorials' shape, eager under compiled/pmap): the same
    loss_fn gives the same grad_fn and program (an audit: a new trace and compile at every step, all
    kept); a new lambda at every step gets a new one, the grad_fns remembered -- and so the programs
    kept -- bounded (here to 4), and a warning once twice that many came from the same code (a lambda's, a
    functools.partial's function's: one each); a bound method
    asked for again (a new object each time) is the same grad_fn too."""
    import gc  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    import portddp.jax.ddp  # noqa: PLC0415

    params = init_params()
    ddp = DistributedDataParallel(params, strategy=strategy)
    holder = type("Holder", (), {"loss": lambda self, p, x: loss_fn(p, x)})()
    same = len({id(ddp.value_and_grad(loss_fn)) for _ in range(3)}) * len({id(ddp.value_and_grad(holder.loss))
                                                                        for _ in range(3)})
    for step in range(3):
        ddp.value_and_grad(loss_fn)(params, batch(step))
    kept, portddp.jax.ddp._GRAD_FNS_KEPT = portddp.jax.ddp._GRAD_FNS_KEPT, 4
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(new_lambdas):
                ddp.value_and_grad(lambda p, x, k=float(step): loss_fn(p, x) * k)(params, batch(step))
                ddp.value_and_grad(functools.partial(scaled_loss, k=float(step)))(params, batch(step))
    finally:
        portddp.jax.ddp._GRAD_FNS_KEPT = kept
    gc.collect()  # (the grad_fns forgotten, and with them their programs)
    programs = sum(len(state.steps) for state in ddp._plans.values())
    warned = sum("made by the same code 8 times" in str(w.message) for w in caught)
    return f"grad_fns={same} programs={programs} warned={warned}"


def buffer_shape_drifts(strategy, same_bytes=False):
    """A buffer the step writes with a shape of each rank's own after the first step (sized by the
    batch, the last one smaller on some ranks): named on every rank -- compiled aborted in XLA's Gloo,
    or, at equal byte counts, took rank 0's bytes in another shape silently (an audit, 2026-12-07)."""
    from flax import nnx  # noqa: PLC0415

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(4, 2, rngs=rngs)
            self.last = nnx.Variable(jnp.zeros((3, 2)))

        def __call__(self, x):
            seen, y = self.last.get_value().sum(), self.l(x)
            shape = ((3, 4) if WORLD.rank == 0 else (4, 3)) if same_bytes else y.shape
            self.last.set_value(jnp.zeros(shape) + y.sum())
            return y + 0 * seen

    model = Net(nnx.Rngs(0))
    grad_fn = DistributedDataParallel(model, strategy=strategy).nnx_value_and_grad(lambda m, x: jnp.mean(m(x)))
    for step in range(3):
        grad_fn(model, batch(step, rows=3 + (step > 0) * WORLD.rank))
    return "no error"


def broadcast_then_step():
    """The same per-rank initialisation, then ddp.broadcast(): legal, no extra check."""
    params = jax.tree.map(lambda x: x + WORLD.rank, init_params())
    ddp = DistributedDataParallel(params)
    params = ddp.broadcast(params)
    loss, _ = ddp.value_and_grad(loss_fn)(params, batch(0))
    return f"loss={float(loss):.3f}"


def numpy_float64_params(strategy: str):
    """Parameters made with numpy (float64) while jax_enable_x64 is off, as jax.grad takes them: the
    gradients are float32 (what JAX computes in); broadcast, three steps, the global batch's grads."""
    rng = np.random.default_rng(0)
    params = {"enc": {"w": rng.standard_normal((4, 4)), "b": np.zeros(4)}, "dec": {"w": rng.standard_normal((4, 2))}}
    ddp = DistributedDataParallel(params, strategy=strategy)
    params, ref = ddp.broadcast(params), params
    grad_fn = ddp.value_and_grad(loss_fn)
    worst = 0.0
    for step in range(3):
        _, grads = grad_fn(params, batch(step))
        whole = jnp.concatenate([jnp.asarray(np.random.default_rng(100 * step + r).standard_normal((3, 4)),
                                             jnp.float32) for r in range(WORLD.size)])
        want = jax.grad(loss_fn)(ref, whole)
        worst = max(worst, rel(grads, want))
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, want)
    return f"max_rel={worst:.1e} dtypes={sorted({str(g.dtype) for g in jax.tree.leaves(grads)})}"


def with_hook(hook):
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(None, hook)
    ddp.value_and_grad(loss_fn)(params, batch(0))


def hook_compiled():
    """(An audit: the compiled strategy stored the hook and never called it -- fp16 compression or
    PowerSGD silently not applied, a hook on one rank only never compared.)"""
    DistributedDataParallel(init_params(), strategy="compiled").register_comm_hook(None, allreduce_hook)


def reduce_after_a_failed_reduce():
    """A comm hook that raises once (on every rank) in ddp.reduce(): the next reduce() and the next
    step work (the failed reduce() used to keep the iteration marked open, refusing every later one)."""
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)
    calls = [0]

    def flaky(state, bucket):
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("transient")
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, flaky)
    grad_fn = ddp.value_and_grad(loss_fn)
    _, local = grad_fn(params, batch(0), sync=False)
    try:
        ddp.reduce(local)
        return "not raised"
    except RuntimeError as e:
        assert "transient" in str(e), e
    ddp.reduce(local)
    grad_fn(params, batch(1))
    return "recovered"


def not_a_handle(state, bucket):
    allreduce_hook(state, bucket).wait()
    return bucket.buffer()  # the array, not its Handle


def one_element(state, bucket):
    return bucket.allreduce(bucket.buffer()[:1].copy())


def half_bucket(state, bucket):
    return bucket.allreduce(bucket.buffer()[: bucket.buffer().size // 2].copy())


CASES = {
    "hooked_under_scan": hooked_under_scan,
    "accumulate_inside_jit": accumulate_inside_jit,
    "hooked_vmap": hooked_vmap,
    "hooked_vmap_of_jit": hooked_vmap_of_jit,
    "compiled_vmap": compiled_vmap,
    "compiled_scan": compiled_scan,
    "other_shapes_hooked": lambda: other_shapes("hooked"),
    "other_shapes_compiled": lambda: other_shapes("compiled"),
    "other_dtype_hooked": other_dtype,
    "reduce_inside_jit": reduce_inside_jit,
    "per_rank_init_hooked": lambda: per_rank_init("hooked"),
    "per_rank_init_reduce_hooked": lambda: per_rank_init_reduce("hooked"),
    "per_rank_init_reduce_compiled": lambda: per_rank_init_reduce("compiled"),
    "per_rank_init_compiled": lambda: per_rank_init("compiled"),
    **{f"abstract_init_{kind}": (lambda kind=kind: abstract_init(kind)) for kind in ("hooked", "compiled")},
    "abstract_init_equal_hooked": lambda: abstract_init("hooked", apart=False),
    "buffer_shape_drifts_compiled": lambda: buffer_shape_drifts("compiled"),  # (hooked: rank 1 alone raises)
    "buffer_shape_drifts_same_bytes_compiled": lambda: buffer_shape_drifts("compiled", same_bytes=True),
    "grad_fn_built_every_step_compiled": lambda: grad_fn_built_every_step("compiled"),
    "grad_fn_new_every_step_hooked": lambda: grad_fn_built_every_step("hooked", new_lambdas=11),
    "per_rank_init_jitted": lambda: per_rank_init("hooked", jitted=True),
    "one_element_apart_hooked": lambda: one_element_apart("hooked"),
    "one_element_apart_compiled": lambda: one_element_apart("compiled"),
    "broadcast_then_step": broadcast_then_step,
    "wrt_on_one_rank": wrt_on_one_rank,
    "crossed_unused_leaves_compiled": crossed_unused_leaves_compiled,
    "numpy_float64_params_hooked": lambda: numpy_float64_params("hooked"),
    "numpy_float64_params_compiled": lambda: numpy_float64_params("compiled"),
    "local_step_on_one_rank_hooked": lambda: local_step_on_one_rank("hooked"),
    "local_step_on_one_rank_compiled": lambda: local_step_on_one_rank("compiled"),
    "local_step_on_one_rank_compiled_reduce": lambda: local_step_on_one_rank("compiled", then="reduce"),
    "step_here_reduce_there_compiled": lambda: local_step_on_one_rank("compiled", then="reduce_on_one_rank"),
    "same_local_steps_compiled": same_local_steps_compiled,
    "steps_in_one_jit": steps_in_one_jit,
    "two_ddps_in_one_jit": two_ddps_in_one_jit,
    "uneven_steps_in_one_jit": uneven_steps_in_one_jit,
    "extra_positional_input": extra_positional_input,
    "rngs_as_third_argument": rngs_as_third_argument,
    "held_gradients_lent": held_gradients_lent,
    "dropped_ddp_is_freed": dropped_ddp_is_freed,
    "program_outlives_its_ddp": program_outlives_its_ddp,
    "pmap_under_mpirun": pmap_under_mpirun,
    "differentiate_grad_fn": differentiate_grad_fn,
    "differentiate_grad_fn_compiled": lambda: differentiate_grad_fn("compiled"),
    "buffers_differ_compiled": buffers_differ_compiled,
    "buffers_on_one_rank_hooked": lambda: buffers_on_one_rank("hooked"),
    "buffers_on_one_rank_compiled": lambda: buffers_on_one_rank("compiled"),
    "eager_here_jitted_there": lambda: eager_and_jitted({1: 0}),
    "eager_then_jitted_on_one_rank": lambda: eager_and_jitted({1: 1}),
    "jitted_local_steps_on_one_rank": lambda: eager_and_jitted(local_jitted_on=1),
    "reduce_before_any_step_hooked": lambda: reduce_before_any_step("hooked"),
    "reduce_before_any_step_compiled": lambda: reduce_before_any_step("compiled"),
    "model_grew": model_grew,
    "other_containers": other_containers,
    "reduce_after_a_failed_reduce": reduce_after_a_failed_reduce,
    "hook_not_a_handle": lambda: with_hook(not_a_handle),
    "hook_one_element": lambda: with_hook(one_element),
    "hook_half_bucket": lambda: with_hook(half_bucket),
    "hook_compiled": hook_compiled,
}


def hook_raises():
    """Rank 1's comm hook raises: its error names the hook, the bucket and the original error; the
    other ranks are stopped by the watchdog, naming rank 1 (nothing is caught here)."""
    params = init_params()
    ddp = DistributedDataParallel(params, bucket_cap_mb=CAP_MB, first_bucket_cap_mb=CAP_MB)

    def flaky_hook(state, bucket):
        if WORLD.rank == 1:
            raise ValueError("boom in the hook")
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, flaky_hook)
    ddp.value_and_grad(loss_fn)(params, batch(0))


def caught_step_failure():
    """Rank 1's jitted step 1 fails at run time in a data check of the user's (a callback on the
    batch), which the script catches and goes on. The check used to run before the callback that
    opens the iteration, so the failed step was never counted: rank 1's step 2 was averaged with
    rank 0's step 1 from then on, silently. Each step's gradient tells its step (10 s + rank, so
    the mean is 10 s + 0.5): printed per step, or the error it raised."""
    failing = [False]

    def check(x):
        if failing[0]:
            raise RuntimeError("corrupt record")
        return x

    def loss(p, b):
        return jnp.sum(p["w"] * jax.pure_callback(check, jax.ShapeDtypeStruct(b.shape, b.dtype), b))

    params = {"w": jnp.zeros(3, jnp.float32)}
    grad_fn = jax.jit(DistributedDataParallel(params).value_and_grad(loss))
    for s in range(4):
        failing[0] = WORLD.rank == 1 and s == 1
        try:
            g = float(grad_fn(params, jnp.full(3, 10.0 * s + WORLD.rank, jnp.float32))[1]["w"][0])
            outcome = f"OK grad={g} expected={10.0 * s + 0.5}"
        except Exception as e:  # noqa: BLE001 (what the script does with it)
            outcome = f"{type(e).__name__}: {str(e).splitlines()[-1]}"
        report(f"caught_step_failure_{s}", outcome)


def main() -> None:
    if MODE != "cases":
        {"hook_raises": hook_raises, "overlap": steps_in_two_traces, "mapped": grad_fn_under_shard_map,
         "caught_failure": caught_step_failure}[MODE]()
        return
    for name, case in CASES.items():
        try:
            outcome = f"OK {case() or ''}"
        except Exception as e:  # the message is what is under test
            outcome = f"{type(e).__name__}: {e}"
        report(name, outcome)
    get_transport().barrier()  # leave together


if __name__ == "__main__":
    main()
