"""Flax NNX front end of portddp.jax: a training step on an `nnx.Module`.

    model = Net(rngs=nnx.Rngs(params=0, dropout=rank))
    ddp = DistributedDataParallel(model)            # or nnx.state(model, nnx.Param)
    ddp.broadcast(model)                            # rank 0's Params and buffers, in place
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    grad_fn = ddp.nnx_value_and_grad(loss_fn)       # loss_fn(model, batch) -> loss
    loss, grads = grad_fn(model, batch)             # grads: nnx.State of the Params, mean over ranks
    optimizer.update(model, grads)

What the split does for the user: `grad_fn` splits the model into its GraphDef
(static), its nnx.Param state (differentiated, bucketed and reduced like any
pytree), its buffers and its other state, runs `loss_fn` on the model merged
back inside portddp's step, and writes the state the forward changed back into
`model` (a change to the Params themselves is refused: each rank would make its
own, and the replicas drift apart). The model's state falls in three parts:

* Params -- every nnx.Param (and subclass), or what DistributedDataParallel's
  `wrt=` filter selects (nnx.LoRAParam; a path filter taking plain array
  attributes): the gradients. A Param that `wrt=` leaves out is frozen: other
  state, equal on every rank from `ddp.broadcast(model)` on.
* Buffers -- every other array that is neither RNG state, an nnx.Param nor an
  nnx.Intermediate: BatchNorm's BatchStat, plain array attributes, custom
  nnx.Variable types. As in PyTorch DDP, `broadcast_buffers=True` (the
  default) replaces each rank's buffers with rank 0's before every synchronised
  forward; after the step each rank keeps the statistics of its own shard,
  which the next step's broadcast overwrites with rank 0's. `sync=False` skips
  the broadcast (as torch's no_sync does).
* Other state -- RNG state (nnx.Rngs streams: RngKey, RngCount), typed PRNG
  keys anywhere, intermediates: carried through the step per rank, never
  broadcast. Like torch's per-process generators, each rank draws its own
  dropout masks from its own streams: seed them per rank (e.g.
  `nnx.Rngs(params=0, dropout=rank)`) for different masks, or alike for equal
  ones; `ddp.broadcast(model)` leaves them alone.

Uneven inputs: `for batch in ddp.uneven(batches)` yields `ddp.JOINED` once this
rank is out of batches; `grad_fn(model, ddp.JOINED)` shadows the others' step
and returns (None, the mean grads). As in torch's join(), with broadcast_buffers
every step of the loop starts from the buffers of the highest rank that still
has a batch, which a joined rank takes into its model too (its other state is
left alone), and when the loop ends every rank takes the last joiner's buffers
into each model its grad_fn stepped eagerly in the loop.

strategy="pmap" maps one process's devices, which share the process's model:
every device starts from the same state (so the same RNG streams) and the
first device's resulting state is kept.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

__all__ = ["broadcast", "frozen_of", "is_module", "named_errors", "params_of", "split", "value_and_grad"]


def _nnx():
    from flax import nnx  # noqa: PLC0415 -- Flax is needed only for NNX models

    return nnx


def is_module(x) -> bool:
    """Whether `x` is a Flax nnx.Module (False without importing Flax when it was never loaded)."""
    return "flax.nnx" in sys.modules and isinstance(x, _nnx().Module)


def state_of(module):
    """Everything a module holds (nnx.state): its arrays are what a trace reading it captures."""
    return _nnx().state(module)


def params_of(x, wrt=None):
    """A module's differentiated state (`wrt`, an nnx filter; default nnx.Param); anything else as it is."""
    if not is_module(x):
        if wrt is not None:
            raise TypeError(f"wrt= picks what to differentiate in a Flax nnx.Module; DistributedDataParallel got "
                            f"a {type(x).__name__}: pass the pytree of exactly what you differentiate instead")
        return x
    state = _nnx().state(x, _trained(wrt))
    if not jax.tree.leaves(state):
        raise ValueError(_nothing_to_train(x, wrt))
    return state


def _trained(wrt):
    """The nnx filter for the state DistributedDataParallel differentiates: `wrt=`, else nnx.Param."""
    return _nnx().Param if wrt is None else wrt


def frozen_of(x, wrt) -> list:
    """The leaves of the Params that `wrt` leaves out (frozen), in a module or in a step's "other"
    state (where split puts them); none without wrt= (every Param is trained) or for a plain pytree."""
    if wrt is None or not (is_module(x) or type(x).__name__ == "State"):
        return []
    nnx = _nnx()
    frozen = nnx.All(nnx.Param, nnx.Not(wrt))
    return jax.tree.leaves(nnx.state(x, frozen) if is_module(x) else x.filter(frozen))


def _nothing_to_train(model, wrt) -> str:
    nnx = _nnx()
    what = "no nnx.Param" if wrt is None else f"nothing that wrt={wrt!r} selects"
    arrays = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
              if jnp.issubdtype(getattr(x, "dtype", jnp.int32), jnp.floating)]
    seen = f" (its floating-point arrays: {', '.join(arrays[:4])}{' ...' if len(arrays) > 4 else ''})" if arrays else ""
    return (f"{type(model).__name__} holds {what}{seen}, so DistributedDataParallel has no gradient to reduce. "
            "portddp.jax differentiates a module's nnx.Param variables and treats its other arrays as buffers "
            "(broadcast from rank 0, as PyTorch DDP's): hold trainable arrays in nnx.Param (self.w = "
            "nnx.Param(...)), or pass DistributedDataParallel(model, wrt=...) the filter your nnx.Optimizer's "
            "wrt= uses (e.g. one that selects plain array attributes by name)")


def _is_buffer(_path, x) -> bool:
    """The nnx filter for buffers: arrays that are neither RNG state, PRNG keys, intermediates nor an
    nnx.Param (a Param left out of DistributedDataParallel's wrt= is frozen: carried per rank, equal
    on every rank from ddp.broadcast(model) on, never reduced nor broadcast again -- like a PyTorch
    parameter with requires_grad=False)."""
    nnx = _nnx()
    if isinstance(x, nnx.RngState | nnx.Intermediate | nnx.Param):
        return False
    value = x.get_value() if isinstance(x, nnx.Variable) else x
    dtype = getattr(value, "dtype", None)
    return dtype is not None and not jnp.issubdtype(dtype, jax.dtypes.prng_key)


def split(model, others: frozenset | None = None, wrt=None):
    """(graphdef, params, buffers, other): the three kinds of state described in the module docstring,
    params being what `wrt` selects (default nnx.Param). `others`: paths classified "other" before
    (split_for); they stay other -- a Variable holding a Python number (a per-rank counter) is an array
    once a step has updated it, but is no buffer of rank 0's to broadcast for that."""
    nnx = _nnx()
    if not others:
        return nnx.split(model, _trained(wrt), _is_buffer, ...)
    return nnx.split(model, _trained(wrt), lambda path, x: path not in others and _is_buffer(path, x), ...)


def paths(state) -> frozenset:
    return frozenset(path for path, _ in state.flat_state())


def split_for(ddp, model):
    """split(model) as `ddp` first saw it: what was other at its first split (broadcast or the first
    step) stays other at every later one, so the step's state keeps its structure."""
    out = split(model, getattr(ddp, "_nnx_others", None), ddp._nnx_wrt)
    if getattr(ddp, "_nnx_others", None) is None:
        ddp._nnx_others = paths(out[3])
    return out


def broadcast(ddp, model):
    """Rank 0's Params and buffers into `model` on every rank (RNG state stays per rank); returns `model`.
    Every rank must pass the same structure, shapes and dtypes (checked first, errors name the leaf)."""
    from portddp.protocol import check_same_config, check_same_specs  # noqa: PLC0415

    _graphdef, params, buffers, _other = split_for(ddp, model)
    params = ddp.broadcast(params)
    if ddp._nnx_wrt is not None:  # and the Params left out of wrt= (frozen): once, here
        nnx = _nnx()
        buffers = nnx.merge_state(buffers, nnx.state(model, nnx.All(nnx.Param, nnx.Not(ddp._nnx_wrt))))
    leaves = jax.tree_util.tree_flatten_with_path(buffers)[0]
    if ddp.world_size > 1:
        everyone = ddp._comm.allgather_object({
            "broadcast_buffers": ddp.broadcast_buffers,
            "specs": [(jax.tree_util.keystr(p), tuple(jnp.shape(x)), jnp.dtype(x.dtype).name) for p, x in leaves]})
        check_same_config([{"broadcast_buffers": e["broadcast_buffers"]} for e in everyone])
        check_same_specs([e["specs"] for e in everyone], "model buffers differ across ranks", "buffer", "buffers")
    values = ddp._sync_buffers([x for _, x in leaves], synchronises=False, src=0)  # (rank 0's, also inside uneven())
    buffers = jax.tree.unflatten(jax.tree.structure(buffers), [jnp.asarray(v) for v in values])
    _nnx().update(model, params, buffers)
    return model


def take_buffers(ddp, model, src: int) -> None:
    """Rank `src`'s buffers (the ones a step broadcasts) into `model` on every rank (ddp.uneven()'s end)."""
    _graphdef, _params, buffers, _other = split_for(ddp, model)
    leaves, tree = jax.tree.flatten(buffers)
    if leaves:
        values = ddp._sync_buffers(leaves, synchronises=False, src=src)
        _nnx().update(model, jax.tree.unflatten(tree, [jnp.asarray(v) for v in values]))


def filter_name(wrt) -> str:
    """`wrt=` as the config check shows it across ranks: what it selects, never an address (a
    filter function's repr differs per process)."""
    if wrt is None:
        return "None (nnx.Param)"
    if isinstance(wrt, type) or callable(wrt) and hasattr(wrt, "__qualname__"):
        return f"{wrt.__module__}.{wrt.__qualname__}"
    text = repr(wrt)
    return text if " at 0x" not in text else type(wrt).__name__


def named_errors(step, *args):
    """Run `step`; Flax's error for state mutated across a trace boundary becomes portddp's, with the fix."""
    try:
        return step(*args)
    except Exception as e:
        if type(e).__name__ != "TraceContextError":
            raise
        raise _state_outside_the_model(f"Flax: {str(e).split(' (')[0]}") from None


def variables_in(batch) -> list:
    """[(variable, its value)] for the Flax NNX Variables inside `batch` (an nnx.Rngs passed in, a
    module), before loss_fn runs: `unchanged_by_loss` then tells whether it updated one."""
    if "flax.nnx" not in sys.modules:
        return []
    nnx = _nnx()
    found = jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(v, v.get_raw_value()) for v in found if isinstance(v, nnx.Variable)]


def unchanged_by_loss(held: list) -> None:
    """Refuse an update loss_fn made to a Variable passed in the batch: the step runs loss_fn on a copy
    of the batch, so the update would be lost -- an nnx.Rngs in the batch would give the same dropout
    masks at every step. (Called eagerly, Flax itself refuses it: `named_errors`; inside nnx.jit it
    would not.)"""
    for variable, value in held:
        if variable.get_raw_value() is not value:
            raise _state_outside_the_model(f"its {type(variable).__name__} was updated")


def _state_outside_the_model(detail: str) -> RuntimeError:
    return RuntimeError(
        f"loss_fn changed Flax NNX state that is not part of the model ({detail}): "
        "portddp traces loss_fn into its own compiled step, so an nnx.Rngs (or any nnx.Variable) captured "
        "from outside, or passed in the batch, cannot be updated there (the update would be lost: the same "
        "dropout masks at every step). Keep it in the model -- e.g. nnx.Dropout(rate, rngs=rngs) holds its "
        "own stream -- and use ddp.nnx_value_and_grad(loss_fn)(model, batch), which carries the "
        "model's RNG state and buffers through the step")


def _moved(before, after):
    """Per leaf of the trained state `before` (loss_fn's input), whether loss_fn gave it a new value
    (`after`, read back from the model): None when the trace kept every one (the usual case: the
    step's program then holds no comparison). A leaf some transformation passed through (nnx.remat)
    is a new array of the same value: compared in the program, where NaN equals NaN. In a compiled
    or pmap step, any rank's or device's change is every one's (their aux is the first device's)."""
    from portddp.jax.compiled import DATA_AXIS  # noqa: PLC0415

    after = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(after)[0]}
    leaves = jax.tree_util.tree_flatten_with_path(before)[0]
    new = [after.get(jax.tree_util.keystr(path), x) for path, x in leaves]
    if all(y is x for (_, x), y in zip(leaves, new)):
        return None
    moved = jnp.stack([jnp.int32(0) if y is x else (~jnp.array_equal(x, y, equal_nan=True)).astype(jnp.int32)
                       for (_, x), y in zip(leaves, new)])
    try:
        return jax.lax.pmax(moved, DATA_AXIS)
    except NameError:  # (no such axis: a hooked or local step, each rank its own)
        return moved


def _refuse_moved(params, moved) -> None:
    """Raise if `moved` (_moved's flags) says loss_fn changed a leaf of `params`; inside the user's
    jit (hooked grad_fn), when the program runs."""
    from portddp.jax.taps import traced  # noqa: PLC0415

    def names(flags):
        return [jax.tree_util.keystr(path) for (path, _), m in
                zip(jax.tree_util.tree_flatten_with_path(params)[0], flags.tolist()) if m]

    if traced(moved):
        skeleton = _paths_only(params)
        jax.debug.callback(lambda flags: _refuse_moved(skeleton, flags), moved)
    elif moved.any():
        raise _trained_state_changed(names(moved))


def _paths_only(tree):
    """`tree` with 0 for every leaf: its paths, for naming leaves later, without holding its arrays."""
    return jax.tree.map(lambda _: 0, tree)


def _trained_state_changed(names: list[str]) -> RuntimeError:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return RuntimeError(
        f"loss_fn changed the value of trained state {shown} in the forward (the state DistributedDataParallel's "
        "wrt= selects: differentiated, its gradient averaged over the ranks). nnx.value_and_grad would write the "
        "change back into the model; under data parallelism each rank makes it from its own batch (an in-place "
        "max-norm renormalisation of the rows it looks up, a running statistic selected by wrt=), so the replicas "
        "would drift apart: portddp refuses it rather than drop it or let them drift. Make the change outside "
        "loss_fn, the same on every rank (e.g. renormalise after optimizer.update(model, grads)), or leave that "
        "state out of wrt= (a BatchStat is a buffer by default)")


_SIMPLE = (bool, int, float, complex, str, bytes, type(None))


def _plain_attributes(model) -> dict:
    """{(module path, name): value} of the modules' plain Python attributes (numbers, strings, None, tuples
    of them): NNX keeps them in the GraphDef, not in any State that nnx.update carries."""
    nnx = _nnx()
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for name, value in vars(node).items():
                if not name.startswith(("_pytree__", "_object__", "_graph_node__")) and (
                        isinstance(value, _SIMPLE) or isinstance(value, tuple) and all(
                            isinstance(v, _SIMPLE) for v in value)):
                    out[(tuple(path), name)] = value
    return out


class _Static:
    """A GraphDef that holds an unhashable plain attribute (`self.cfg = {"act": "relu"}`, a list):
    hashable for jit's static argument and the traces' keys, equal by the GraphDef's own equality."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, _loose_hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Static) and self.graphdef == other.graphdef


def _static(graphdef):
    try:
        hash(graphdef)
        return graphdef
    except TypeError:
        return _Static(graphdef)


def _loose_hash(x) -> int:
    """A hash that agrees with == for what a GraphDef holds, looking inside what cannot be hashed
    (equal values hash alike; unequal ones may collide, which == then tells apart)."""
    try:
        return hash(x)
    except TypeError:
        pass
    if dataclasses.is_dataclass(x):
        return hash((type(x), *(_loose_hash(getattr(x, f.name)) for f in dataclasses.fields(x))))
    if isinstance(x, (list, tuple)):
        return hash((type(x), *map(_loose_hash, x)))
    if isinstance(x, dict):
        return hash(frozenset((k, _loose_hash(v)) for k, v in x.items()))
    return hash(type(x))


def _signature(tree) -> tuple:
    """What a jit trace of `tree` is reused for: its structure and each leaf's shape and dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((jnp.shape(x), jnp.result_type(x)) if hasattr(x, "dtype") else type(x) for x in leaves)


def _set_plain_attributes(model, changes) -> None:
    nnx = _nnx()
    nodes = {tuple(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
    for (path, name), value in changes:
        if path in nodes:
            setattr(nodes[path], name, value)


def value_and_grad(ddp, loss_fn, has_aux: bool):
    """DistributedDataParallel.nnx_value_and_grad: see there and the module docstring."""
    from portddp.jax.taps import checked_loss, traced as is_traced  # noqa: PLC0415

    nnx = _nnx()
    checked = checked_loss(loss_fn, has_aux, via="nnx_value_and_grad")
    # Plain Python attributes loss_fn changed (a call counter, a flag; the shape of the last batch): found
    # while the step is traced, and set on the model after each step, as nnx.value_and_grad and nnx.jit
    # leave them. A trace is reused for the same GraphDef (which holds them: a new value means a new trace,
    # as under nnx.jit) and the same shapes and dtypes of everything else, so that is what they are kept by.
    plain_changes: dict = {}
    traced: list = []

    def pure(graphdef, params, state, batch):
        # copy=True: fresh Variables owned by this trace (the step differentiates inside jit, and
        # Flax refuses to mutate a Variable created at another trace level).
        model = nnx.merge(graphdef.graphdef if isinstance(graphdef, _Static) else graphdef, params, *state, copy=True)
        before = _plain_attributes(model)
        loss, aux = checked(model, batch)
        after = _plain_attributes(model)
        _, trained, buffers, other = split(model, paths(state[1]), ddp._nnx_wrt)
        # Variables loss_fn removed -- a value sown by an evaluation forward between two steps, popped by
        # loss_fn with this step's (Flax's VAE example): nnx.value_and_grad removes them from the model. The
        # step hands back their old values in their places (a compiled step's state keeps its structure),
        # and grad_fn removes them from the model after it.
        removed = paths(state[1]) - paths(other)
        if removed:
            other = nnx.merge_state(other, state[1].filter(lambda path, _x: path in removed))
        traced.append((tuple((k, v) for k, v in after.items() if k not in before or before[k] is not v
                             and before[k] != v), removed))
        return loss, ((aux, _moved(params, trained)), (buffers, other))

    step = ddp._grad_step(pure, loss_fn)

    unchecked: list = []  # an eager sync=False step's flags, checked at the next call (not waiting for it)

    def grad_fn(model, batch, sync: bool = True):
        if not is_module(model):
            raise TypeError(f"nnx_value_and_grad's grad_fn takes (model, batch) with an nnx.Module; got "
                            f"{type(model).__name__}: for a parameter pytree use ddp.value_and_grad(loss_fn)")
        graphdef, params, buffers, other = split_for(ddp, model)
        graphdef = _static(graphdef)
        inputs = (params, buffers, other, batch)
        if ddp._uneven is not None and not is_traced(params):  # its buffers are synchronised at the loop's end
            ddp._uneven.remember(model)
        traced.clear()
        if unchecked:
            _refuse_moved(*unchecked.pop())
        loss, aux, (buffers, other), grads = step(graphdef, params, (buffers, other), batch, sync)
        if aux is not None:  # (None: this rank has joined)
            aux, moved = aux
            if moved is not None and (sync or is_traced(moved)):  # (a synchronised step waited for its sum)
                _refuse_moved(params, moved)
            elif moved is not None:
                unchecked.append((_paths_only(params), moved))
        nnx.update(model, buffers, other)
        # (only traces that changed something are kept: a model that changes none pays nothing per step)
        if batch is not ddp.JOINED and (traced and any(traced[-1]) or plain_changes):
            key = (graphdef, _signature(inputs))
            if traced:  # traced by this call (its last trace, if it traced twice: they saw the same inputs)
                plain_changes[key] = traced[-1]
            changes, removed = plain_changes.get(key, ((), ()))
            if removed:
                nnx.pop(model, lambda path, _x: path in removed)
            if changes:
                _set_plain_attributes(model, changes)
        return ((loss, aux) if has_aux else loss), grads

    return grad_fn
