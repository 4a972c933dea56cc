"""The strategies that leave scheduling to XLA: "compiled" and "pmap".

Pure functions of (strategy, bucket plan, layout, step function): they return
the compiled step and, once it has been compiled, what XLA made of it; they
never see the DistributedDataParallel object. Both put one psum per bucket
(`psum_buckets`: flatten, divide by the world size, sum, split) inside the
compiled step and let XLA decide when each runs. "compiled" maps over all
processes with `shard_map` (jax.distributed + CPU collectives); "pmap" maps over
this process's devices. What XLA actually did -- how many all-reduces survive,
where they sit in the schedule -- is read back from the optimised HLO
(`hlo_facts`), because XLA:CPU may combine the buckets into one all-reduce at
the end of the backward pass.

Uneven inputs (DistributedDataParallel.uneven, "compiled"): while some rank has
run out, every process runs a variant of the step that takes one more input,
this process's weight (1, or 0 for a joined rank, which feeds zeros shaped like
the others' batch), and zeroes the gradients of weight 0 before the psums --
one program, the same collectives, on every process.

Step counts ("compiled"): every call takes this process's step slot (protocol.step_slot of its
grad_fn calls so far, sync=False ones included) as one more input and all-gathers it inside the program, beside the
bucket psums; the caller compares the gathered counts (portddp.protocol.check_same_step), so
that a sync=False step on some ranks only -- which from then on pairs one rank's step k+1 with
the others' step k in every psum -- fails on every rank instead of training on silently.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from portddp.buckets import BucketPlan
from portddp.jax.layout import Layout
from portddp.shm import is_half

__all__ = ["DATA_AXIS", "Step", "hlo_facts", "make_reduce", "make_step", "pmap_world", "psum_buckets"]

DATA_AXIS = "data"
"""The one axis gradients are averaged over: bound by the process mesh
(compiled) or by jax.pmap (pmap), and named by every psum in psum_buckets."""


class Step(NamedTuple):
    """A compiled step and what XLA made of it (`hlo_facts`, filled when it is first compiled)."""

    run: Callable
    hlo: dict


def psum_buckets(plan: BucketPlan, layout: Layout, leaves: list, axis_name: str, inv_world: float,
                 live=None) -> list:
    """Inside a compiled step: each bucket flattened, divided by the world size, summed with one
    psum, and split back. Takes and returns the pytree's leaf list (only JAX processes take part,
    so the pytree's own layout will do).

    `live`: a boolean that is True at run time but that XLA cannot know, and that differs per
    process as far as it can tell (derived from a process-sharded input). Each process traces its
    own program, and XLA drops the psum of a bucket it finds constant -- a leaf this rank's loss
    does not use has a zero gradient at compile time --, so without it that rank would issue one
    all-reduce fewer and pair the next bucket's with its peers' (wrong sums, or a hang). Selecting
    on it keeps every bucket's psum in every process's program, at no arithmetic cost."""
    out = list(leaves)
    for bucket in plan.buckets:
        flat = jnp.concatenate([leaves[layout.leaf_of[k]].reshape(-1) for k in bucket.params])
        # Divide before the sum, as the hooked strategy and PyTorch do (half types: the product in
        # float32, rounded once, as PyTorch's mul -- not by a 1/n rounded to the half type).
        if is_half(np.dtype(flat.dtype)):
            scaled = (flat.astype(jnp.float32) * jnp.float32(inv_world)).astype(flat.dtype)
        else:
            scaled = flat * jnp.asarray(inv_world, flat.dtype)
        if live is not None:
            scaled = jnp.where(live, scaled, scaled + 1)
        flat = jax.lax.psum(scaled, axis_name)
        for k, off in zip(bucket.params, bucket.offsets):
            i = layout.leaf_of[k]
            out[i] = flat[off:off + plan.specs[k].numel].reshape(layout.leaf_shapes[i])
    return out


def pmap_world(requested: int | None) -> int:
    available = jax.local_device_count()
    if requested is None:
        return available
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"pmap_devices={requested!r}: pass a number of local devices >= 1")
    if requested > available:
        raise ValueError(
            f"strategy='pmap' asked for {requested} devices but this process has {available}: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={requested} before JAX starts "
            "(CPU), or ask for fewer"
        )
    return requested


def process_devices(world: int):
    """One device per process (its first), in process order; and this process's."""
    first: dict = {}
    for d in jax.devices():
        first.setdefault(d.process_index, d)
    if len(first) != world:
        raise RuntimeError(
            f"strategy='compiled' sees {len(first)} JAX process(es) but the job has {world} ranks: call "
            "portddp.init(jax_distributed=True) before any JAX computation"
        )
    return [first[p] for p in sorted(first)], first[jax.process_index()]


_KEY_FIX = ("Keep RNG state in the model (nnx.Rngs, carried per rank by nnx_value_and_grad), or pass keys as "
            "their data -- jax.random.key_data(keys), one key a row: shape (rows, ...) -- and make them keys again "
            "inside loss_fn with jax.random.wrap_key_data")


def _split_for_devices(batch, n: int):
    def split(x):
        if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
            raise ValueError(f"a batch leaf is a JAX PRNG key: strategy='pmap' splits every batch leaf along its first "
                             f"axis over the {n} devices, which a key cannot be. " + _KEY_FIX)
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError(f"strategy='pmap' splits every batch leaf along its first axis over the {n} devices, but "
                             f"a batch leaf is a scalar ({x.dtype}): give it a leading batch axis (a value for every "
                             "row: jnp.broadcast_to(x, (rows,))), or keep it out of the batch -- a constant that "
                             "never changes in loss_fn's closure, RNG state in the model (nnx.Rngs)")
        if x.shape[0] % n:
            raise ValueError(f"strategy='pmap' splits the batch over {n} devices, but a batch leaf has "
                             f"{x.shape[0]} rows: use a multiple of {n}")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(split, batch)


def _reducer(plan: BucketPlan, layout: Layout, world: int):
    def reduced(grads, live=None):
        leaves, treedef = jax.tree.flatten(grads)
        return jax.tree.unflatten(treedef, psum_buckets(plan, layout, leaves, DATA_AXIS, 1.0 / world, live))

    return reduced


def _state_arrays(state):
    """The step's per-rank state with every leaf an array: an nnx.Variable may hold a Python number
    (a step counter), which crosses the program as a 0-d array (as through a jitted hooked step)."""
    return jax.tree.map(lambda x: x if hasattr(x, "dtype") else jnp.asarray(x), () if state is None else state)


def _key_impls(tree) -> tuple:
    """Per leaf of `tree`: the PRNG implementation of a typed key array, else None (hashable)."""
    return tuple(jax.random.key_impl(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else None
                 for x in jax.tree.leaves(tree))


def _keys_as_data(tree, impls: tuple):
    """Typed PRNG keys -> their uint32 data, so they can cross process-sharded arrays and pmap."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if i is None else jax.random.key_data(x) for x, i in zip(leaves, impls)])


def _data_as_keys(tree, impls: tuple):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if i is None else jax.random.wrap_key_data(x, impl=i)
                                        for x, i in zip(leaves, impls)])


def make_step(strategy: str, plan: BucketPlan, layout: Layout, fn, world: int, broadcast_buffers: bool) -> Step:
    """`(static, params, state, batch, scale=None, steps=0) -> (loss, aux, new_state, mean grads,
    every process's step count (None for pmap))` with XLA
    scheduling the bucket psums, for `fn(static, params, state, batch) -> (loss, (aux, new_state))`
    (see DistributedDataParallel._grad_step). `state` is per rank: "compiled" passes it as
    one row per process, and with broadcast_buffers its buffers (`state[0]`) become rank 0's (inside
    ddp.uneven(): the highest rank's with a batch)
    by an all_gather inside the program; "pmap" hands every device the process's state and
    keeps the first device's result (one process: its buffers are rank 0's already)."""
    reduced, hlo = _reducer(plan, layout, world), {}

    def per_shard(static, impls, params, state, batch, steps=None, scale=None):
        if strategy == "compiled":
            state = jax.tree.map(lambda x: x[0], state)  # this process's row
        state = _data_as_keys(state, impls)
        if strategy == "compiled" and state and broadcast_buffers:
            src = 0
            if scale is not None:  # ddp.uneven(): the highest rank with a batch, as torch's join()
                ranks = jnp.arange(world)
                src = jnp.max(jnp.where(jax.lax.all_gather(scale[0], DATA_AXIS) > 0, ranks, 0))
            state = (jax.tree.map(lambda x: jax.lax.all_gather(x, DATA_AXIS)[src], state[0]), *state[1:])
        (loss, (aux, new_state)), grads = jax.value_and_grad(
            lambda p: fn(static, p, state, batch), has_aux=True)(params)
        if jax.tree.structure(new_state) != jax.tree.structure(state) or _key_impls(new_state) != impls:
            raise ValueError(
                f"strategy={strategy!r}: the step changed the structure of the model's state (a Variable added or "
                "removed -- e.g. values stored with Module.sow, an nnx.Intermediate -- or an RNG key replaced by "
                "another kind): a compiled step's state must keep its structure. Take sown values out inside "
                "loss_fn (nnx.pop(model, nnx.Intermediate), returned as aux with has_aux=True), or use "
                "strategy='hooked'")
        new_state = _keys_as_data(new_state, impls)
        if scale is not None:  # ddp.uneven(): a joined rank (scale 0) adds zeros, whatever its forward gave,
            grads = jax.tree.map(lambda g: jnp.where(scale[0] > 0, g, jnp.zeros_like(g)), grads)
            # ... and keeps the state it came with (its buffers: the ones just received)
            new_state = jax.tree.map(lambda new, old: jnp.where(scale[0] > 0, new, old), new_state,
                                     _keys_as_data(state, impls))
        if strategy == "pmap":
            return jax.lax.pmean(loss, DATA_AXIS), aux, new_state, reduced(grads)
        rows = jax.tree.map(lambda x: jnp.asarray(x)[None], (loss, aux, new_state))
        # (the step count is never negative: `live` keeps every bucket's psum, see psum_buckets)
        return (*rows, jax.lax.all_gather(steps[0], DATA_AXIS), reduced(grads, live=steps[0] >= 0))

    programs: dict = {}  # per (static, impls[, weighted]): the compiled program

    if strategy == "pmap":
        local_mesh = _pmap_mesh(world)

        def step(static, params, state, batch, scale=None, steps=0):  # noqa: ARG001 -- one process: no joins, one count
            state = _state_arrays(state)
            impls = _key_impls(state)
            fn_ = programs.get((static, impls))
            if fn_ is None:
                # Params and state in one unmapped argument: jax.pmap misaligns in_axes after an
                # argument that is an empty pytree (the state of a plain pytree's step).
                fn_ = programs[static, impls] = jax.pmap(
                    lambda ps, b: per_shard(static, impls, *ps, b), axis_name=DATA_AXIS,
                    in_axes=(None, 0), devices=jax.local_devices()[:world])
            split = _split_for_devices(batch, world)
            state_data = _keys_as_data(state, impls)
            with _under(local_mesh):
                if not hlo:
                    hlo.update(hlo_facts(fn_.lower((params, state_data), split).compile().as_text()))
                loss, aux, new_state, grads = fn_((params, state_data), split)
            return (_first_row(loss), _first_row(aux), _data_as_keys(_first_row(new_state), impls), _first_row(grads),
                    None)

        return Step(step, hlo)

    devices, mine = process_devices(world)
    mesh = jax.sharding.Mesh(np.array(devices), (DATA_AXIS,))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA_AXIS))

    def step(static, params, state, batch, scale=None, steps: int = 0):
        """`scale` (inside ddp.uneven()): this process's weight, 1 or 0 (joined);
        every process then runs the weighted program, which zeroes a joined rank's gradients.
        `steps`: this process's step count; the result's last item holds every process's."""
        state = _state_arrays(state)
        impls = _key_impls(state)
        weighted = scale is not None
        fn_ = programs.get((static, impls, weighted))
        if fn_ is None:
            # check_vma=False: with it, JAX would psum the gradients of the replicated
            # params by itself; we want exactly one psum per bucket, ours.
            fn_ = programs[static, impls, weighted] = jax.jit(jax.shard_map(
                lambda p, s, b, n, *w: per_shard(static, impls, p, s, b, n, *w), mesh=mesh,
                in_specs=(P(), P(DATA_AXIS), P(DATA_AXIS), P(DATA_AXIS)) + ((P(DATA_AXIS),) if weighted else ()),
                out_specs=(P(DATA_AXIS),) * 3 + (P(), P()), check_vma=False))
        # Every process holds the same params: together they are one replicated global array.
        gparams = jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            np.shape(x), replicated, [jax.device_put(x, mine)]), params)
        gbatch = jax.tree_util.tree_map_with_path(
            lambda path, x: _process_rows(sharded, x, f"batch leaf {jax.tree_util.keystr(path) or '(the batch)'}"),
            batch)
        gstate = jax.tree.map(lambda x: _process_rows(sharded, np.asarray(x)[None], "state"),
                              _keys_as_data(state, impls))
        args = (gparams, gstate, gbatch, _process_rows(sharded, np.asarray([steps], np.int32), "steps"))
        if weighted:
            args += (_process_rows(sharded, np.asarray([scale], np.float32), "scale"),)
        # Under the processes' mesh: a mesh the script set around its training loop (jax.set_mesh, as
        # Flax's nnx.with_partitioning examples do) made shard_map refuse ours ("the context mesh ...
        # should match the mesh passed to shard_map").
        with _under(mesh):
            if not hlo:
                hlo.update(hlo_facts(fn_.lower(*args).compile().as_text()))
            loss, aux, new_state, counts, grads = fn_(*args)
        return (_first_row(loss), _first_row(aux), _data_as_keys(_first_row(new_state), impls),
                jax.tree.map(lambda g: g.addressable_data(0), grads), _counts(counts))

    return Step(step, hlo)


def _counts(gathered) -> list[int]:
    """Every process's step count, from the all-gather a compiled program returns."""
    return np.asarray(gathered.addressable_data(0)).tolist()


def _process_rows(sharding, x, what: str):
    """This process's rows of a global array split over the processes along axis 0. `what` names
    the leaf in errors ("batch leaf [1]", "state")."""
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        raise ValueError(f"{what} is a JAX PRNG key: strategy='compiled' splits batch and state leaves along their "
                         "first axis over the processes, which a key cannot be. " + _KEY_FIX)
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"strategy='compiled' splits every batch leaf along its first axis over the processes, "
                         f"but {what} is a scalar ({x.dtype}): give it a leading batch axis, or keep "
                         "per-step constants (and RNG keys) out of the batch -- e.g. RNG state in the model")
    return jax.make_array_from_process_local_data(sharding, x)


def make_reduce(strategy: str, plan: BucketPlan, layout: Layout, world: int):
    """`(grads, steps=0) -> (mean over ranks, every process's step count (None for pmap))`,
    bucket by bucket, as a compiled step."""
    reduced = _reducer(plan, layout, world)
    if strategy == "pmap":
        # One process: every device already holds the same accumulated gradients.
        n = world
        fn = jax.pmap(reduced, axis_name=DATA_AXIS, devices=jax.local_devices()[:n])
        local_mesh = _pmap_mesh(n)

        def reduce_pmap(grads, steps: int = 0):  # noqa: ARG001 -- one process, one count
            with _under(local_mesh):
                out = fn(jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), grads))
            return _first_row(out), None

        return reduce_pmap

    devices, _ = process_devices(world)
    mesh = jax.sharding.Mesh(np.array(devices), (DATA_AXIS,))
    sharded = NamedSharding(mesh, P(DATA_AXIS))
    # Each process's gradients are one row of a (world, ...) array.
    fn = jax.jit(jax.shard_map(
        lambda g, n: (reduced(jax.tree.map(lambda x: x[0], g)), jax.lax.all_gather(n[0], DATA_AXIS)),
        mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(), check_vma=False))

    def reduce(grads, steps: int = 0):
        stacked = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharded, np.asarray(x)[None]),
                               grads)
        with _under(mesh):  # (whatever mesh the script set: see make_step)
            out, counts = fn(stacked, _process_rows(sharded, np.asarray([steps], np.int32), "steps"))
        return jax.tree.map(lambda g: g.addressable_data(0), out), _counts(counts)

    return reduce


def _pmap_mesh(n: int):
    """The mesh of the devices pmap maps over (see _under)."""
    return jax.sharding.Mesh(np.array(jax.local_devices()[:n]), (DATA_AXIS,))


def _first_row(tree):
    """Each leaf's row on this process's first device, as a one-device array (not a view of a
    several-device output: under a script's own mesh, an array of ours cannot meet the script's in one
    operation)."""
    return jax.tree.map(lambda g: g.addressable_data(0)[0], tree)


def _under(mesh):
    """`mesh` as the context mesh: a script that trains inside its own `jax.set_mesh(...)` (Flax's
    nnx.with_partitioning examples) made shard_map and pmap refuse ours ("the context mesh ... should match
    the mesh passed to shard_map"). JAX before 0.7.1 has no jax.set_mesh, nor such a context to leave."""
    set_mesh = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    return set_mesh(mesh) if set_mesh is not None else contextlib.nullcontext()


def hlo_facts(hlo_text: str) -> dict:
    """Where the all-reduces sit in the scheduled, optimised HLO of the entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    body = entry[entry.index("{") + 1: entry.index("\n}")]
    instrs = [line for line in body.splitlines() if " = " in line]
    all_reduce = [k for k, line in enumerate(instrs) if re.search(r"\ball-reduce(-start)?\(", line)]
    compute = [k for k, line in enumerate(instrs) if re.search(r"\b(fusion|dot|convolution|custom-call)\(", line)]
    return {
        "all_reduces": len(all_reduce),
        "instructions": len(instrs),
        "all_reduce_positions": [round(k / max(1, len(instrs)), 3) for k in all_reduce],
        "compute_ops": len(compute),
        "compute_ops_after_first_all_reduce": sum(1 for k in compute if all_reduce and k > all_reduce[0]),
    }
