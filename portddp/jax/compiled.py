"""The strategies that leave scheduling to XLA: "compiled" and "pmap".

Both put one psum per bucket (DistributedDataParallel.psum_buckets: flatten,
divide by the world size, sum, split) inside the compiled step and let XLA
decide when each runs. "compiled" maps over all processes with `shard_map`
(jax.distributed + CPU collectives); "pmap" maps over this process's devices.
What XLA actually did -- how many all-reduces survive, where they sit in the
schedule -- is read back from the optimised HLO (`hlo_facts`), because XLA:CPU
may combine the buckets into one all-reduce at the end of the backward pass.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["DATA_AXIS", "make_step", "make_reduce", "hlo_facts", "pmap_world"]

DATA_AXIS = "data"
"""The one axis gradients are averaged over: bound by the process mesh
(compiled) or by jax.pmap (pmap), and named by every psum in psum_buckets."""


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


def _split_for_devices(batch, n: int):
    def split(x):
        x = np.asarray(x)
        if x.shape[0] % n:
            raise ValueError(f"strategy='pmap' splits the batch over {n} devices, but a batch leaf has "
                             f"{x.shape[0]} rows: use a multiple of {n}")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(split, batch)


def _reduced(ddp, grads):
    leaves, treedef = jax.tree.flatten(grads)
    return jax.tree.unflatten(treedef, ddp.psum_buckets(leaves, DATA_AXIS))


def make_step(ddp, loss_fn):
    """(params, batch) -> (loss, mean grads) with XLA scheduling the bucket psums."""

    def per_shard(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if ddp.strategy == "pmap":
            return jax.lax.pmean(loss, DATA_AXIS), _reduced(ddp, grads)
        return loss[None], _reduced(ddp, grads)

    if ddp.strategy == "pmap":
        fn = jax.pmap(per_shard, axis_name=DATA_AXIS, in_axes=(None, 0),
                      devices=jax.local_devices()[: ddp.world_size])

        def step(params, batch):
            split = _split_for_devices(batch, ddp.world_size)
            if not ddp._hlo:
                ddp._hlo = hlo_facts(fn.lower(params, split).compile().as_text())
            loss, grads = fn(params, split)
            return loss[0], jax.tree.map(lambda g: g[0], grads)

        return step

    devices, mine = process_devices(ddp.world_size)
    mesh = jax.sharding.Mesh(np.array(devices), (DATA_AXIS,))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA_AXIS))
    # check_vma=False: with it, JAX would psum the gradients of the replicated
    # params by itself; we want exactly one psum per bucket, ours.
    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(DATA_AXIS)),
                               out_specs=(P(DATA_AXIS), P()), check_vma=False))

    def step(params, batch):
        # Every process holds the same params: together they are one replicated global array.
        gparams = jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            np.shape(x), replicated, [jax.device_put(x, mine)]), params)
        gbatch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharded, np.asarray(x)), batch)
        if not ddp._hlo:
            ddp._hlo = hlo_facts(fn.lower(gparams, gbatch).compile().as_text())
        loss, grads = fn(gparams, gbatch)
        return loss.addressable_data(0)[0], jax.tree.map(lambda g: g.addressable_data(0), grads)

    return step


def make_reduce(ddp):
    """grads -> mean over ranks, bucket by bucket, as a compiled step."""
    if ddp.strategy == "pmap":
        # One process: every device already holds the same accumulated gradients.
        n = ddp.world_size
        fn = jax.pmap(lambda g: _reduced(ddp, g), axis_name=DATA_AXIS, devices=jax.local_devices()[:n])
        return lambda grads: jax.tree.map(lambda g: g[0], fn(jax.tree.map(
            lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), grads)))

    devices, _ = process_devices(ddp.world_size)
    mesh = jax.sharding.Mesh(np.array(devices), (DATA_AXIS,))
    sharded = NamedSharding(mesh, P(DATA_AXIS))
    # Each process's gradients are one row of a (world, ...) array.
    fn = jax.jit(jax.shard_map(lambda g: _reduced(ddp, jax.tree.map(lambda x: x[0], g)), mesh=mesh,
                               in_specs=P(DATA_AXIS), out_specs=P(), check_vma=False))

    def reduce(grads):
        stacked = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharded, np.asarray(x)[None]),
                               grads)
        return jax.tree.map(lambda g: g.addressable_data(0), fn(stacked))

    return reduce


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
