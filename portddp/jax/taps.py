"""How XLA hands a value to the host in the middle of a program: the pieces every traced
iteration of portddp.jax's hooked strategy is made of (DistributedDataParallel._trace_iteration),
and the checks of what is being traced (the loss function, the transformation around grad_fn).

JAX has no autograd hooks, but a `jax.custom_vjp` function chooses its own backward
rule, and that rule may call the host (`host_call`: `jax.experimental.buffer_callback`,
or `io_callback` on older JAX). `host_tap` is such an
identity: XLA runs its callback the moment the cotangents it was given exist, which
for a bucket's parameters is the moment their gradients exist -- DDP's "gradient
ready" signal. Data dependencies, not program order, schedule an unordered
callback, so the pieces pass a scalar "token" around: `start_token` opens the
iteration and every tap takes its output (no tap can run before the start), and
every tap's callback returns the token's cotangent (whatever needs every bucket
launched waits on their sum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from portddp import env
from portddp.jax import flax_nnx

__all__ = ["UNDER_JVP", "UNDER_MAP", "UNDER_VMAP", "after", "checked_loss", "host_call", "host_tap", "in_current_trace",
           "mapped_over_devices", "reporting", "start_token", "traced", "transformation"]

UNDER_VMAP = (
    "portddp.jax grad_fn (strategy='hooked') cannot run under jax.vmap: its collectives are host callbacks "
    "that reduce one set of gradients per synchronised step, and vmap would run them once per mapped element "
    "(every rank averaging the wrong gradients). Call grad_fn once per step on this rank's whole batch -- vmap "
    "inside loss_fn is fine -- or loop over steps with a Python loop or jax.lax.scan")


UNDER_MAP = (
    "portddp.jax grad_fn (strategy='hooked') cannot run under jax.pmap or jax.shard_map over several of this "
    "process's devices (mapped axes here: {axes}): its collectives are host callbacks that reduce one set of "
    "gradients per process and step, and a mapped program calls them once per device (every rank would average "
    "mixed gradients). Run one rank per device (mpirun -n <devices>, one device each), or use "
    "strategy='compiled', whose psum spans every device of every process")


def mapped_over_devices() -> dict[str, int]:
    """The named axes of an enclosing jax.pmap / jax.shard_map (or named vmap) whose size exceeds 1,
    when this process has more than one device -- {} otherwise (one device per process: the
    host callbacks run once per process whatever the mesh)."""
    from jax._src import core  # noqa: PLC0415 -- no public way to ask for the axes in scope

    if jax.local_device_count() < 2:
        return {}
    return {name: size for name, size in core.get_axis_env().axis_sizes.items() if size > 1}


def host_call(callback, result, *args, fills: bool = False):
    """`io_callback(callback, result, *args)`, refused under jax.vmap (JAX would call it once per
    element, which no collective survives). Unordered: XLA runs it as soon as its inputs exist.
    The callback receives numpy arrays (views of XLA's buffers: read them, never write, never
    keep them past the call) and returns numpy arrays or scalars shaped as `result` (one
    ShapeDtypeStruct, or a list of them). With `fills`, it is called as `callback(outs, *args)`
    instead, with one writable array per leaf of `result` (XLA's own result buffers where it
    can), fills them and returns nothing: the results then cost no copy of their own.

    Where JAX has `jax.experimental.buffer_callback` (CPU), that is what runs: XLA hands the
    callback its own buffers and lets it write the results into XLA's, where io_callback copies
    every operand into a new numpy array, then again with jax.device_put -- two copies of every
    gradient fewer per hooked step (benchmark MLP, one process, no communication: ~55 -> ~40 ms
    per step, the step without callbacks ~25 ms on that machine at that time). Elsewhere
    io_callback; PORTDDP_HOST_CALL=io_callback chooses it everywhere."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        if _buffer_callback is None or jax.default_backend() != "cpu":
            return io_callback(_Allocating(callback, result) if fills else callback, result, *args, ordered=False)
        return _buffer_callback(_InPlace(callback, fills), result, has_side_effect=True)(*args)

    @call.def_vmap
    def _refuse(axis_size, in_batched, *args):
        raise ValueError(UNDER_VMAP)

    # Differentiating through a callback (a gradient of grad_fn's gradients: MAML, a gradient
    # penalty) would need the host's collectives differentiated too: refused in portddp's words.
    guarded = jax.custom_jvp(call)
    guarded.defjvp(_refuse_jvp)
    return guarded(*args)


UNDER_JVP = (
    "portddp.jax grad_fn (strategy='hooked') cannot be differentiated (a gradient of its gradients: MAML, a "
    "gradient penalty, jax.hessian): its collectives are host callbacks, which JAX cannot differentiate. Put "
    "the inner derivative inside loss_fn with plain jax.grad (MAML's inner step, the penalty's gradient), so "
    "that grad_fn differentiates and averages only the outer loss")


def _refuse_jvp(primals, tangents):
    raise ValueError(UNDER_JVP)


class _InPlace:
    """A host callback as buffer_callback runs it: XLA's operand buffers in (as numpy views), the
    results written into XLA's result buffers (by the callback itself, if it `fills` them)."""

    def __init__(self, callback, fills: bool = False):
        self.callback, self.fills = callback, fills

    def __call__(self, _ctx, out, *args):
        targets = [np.asarray(buf) for buf in jax.tree.leaves(out)]
        if self.fills:
            self.callback(targets, *(np.asarray(a) for a in args))
            return
        results = self.callback(*(np.asarray(a) for a in args))
        for target, value in zip(targets, jax.tree.leaves(results), strict=True):
            if np.shape(value) != target.shape:  # (io_callback checks this too; numpy would broadcast)
                raise RuntimeError(f"host callback {self.callback!r} returned shape {np.shape(value)} where XLA "
                                   f"expects {target.shape}")
            target[...] = value


class _Allocating:
    """A filling host callback (`host_call(..., fills=True)`) as io_callback runs it: new arrays."""

    def __init__(self, callback, result):
        self.callback, self.result = callback, result

    def __call__(self, *args):
        outs = [np.empty(r.shape, r.dtype) for r in jax.tree.leaves(self.result)]
        self.callback(outs, *args)
        return jax.tree.unflatten(jax.tree.structure(self.result), outs)


def _find_buffer_callback():
    if env.choice("PORTDDP_HOST_CALL", "buffer", ("buffer", "io_callback")) == "io_callback":
        return None
    try:
        from jax.experimental.buffer_callback import buffer_callback  # noqa: PLC0415 (jax >= 0.7)
    except ImportError:
        return None
    return buffer_callback


_buffer_callback = _find_buffer_callback()


def host_tap(on_backward, keep_primal: bool = False, on_trace=None):
    """`tap(x, token) -> x`, whose backward rule calls `on_backward` on the host with (the primal
    value if `keep_primal`,) the token and the cotangents of x, as soon as XLA has computed them.
    It passes the cotangents on unchanged, and the callback's float32 result becomes the token's
    cotangent: whatever depends on that has to wait for the callback.

    `on_trace()` runs when the backward rule is traced. JAX traces it only if some output of the
    tap reaches the loss (unused outputs within it get zero cotangents, instantiated)."""

    @jax.custom_vjp
    def tap(x, token):
        return x

    def fwd(x, token):
        return x, (x if keep_primal else None, token)

    def bwd(residual, g):
        if on_trace is not None:
            on_trace()
        done = host_call(on_backward, jax.ShapeDtypeStruct((), jnp.float32), *jax.tree.leaves((residual, g)))
        return g, done

    tap.defvjp(fwd, bwd)
    return tap


def start_token(on_forward):
    """`start(x) -> token`, whose forward calls `on_forward()` on the host (it opens the
    iteration). Every tap takes the token, so no tap's callback can run before it; the taps'
    callbacks return the token's cotangents, which flow back into `start`'s input -- a value that
    exists only once every bucket has been launched."""

    @jax.custom_vjp
    def start(x):
        return host_call(lambda _x: on_forward(), jax.ShapeDtypeStruct((), jnp.float32), x)

    start.defvjp(lambda x: (start(x), None), lambda _, ct: (ct,))
    return start


def after(token, tree):
    """`tree` (the forward's other inputs: the batch, the model's state), whose numeric arrays
    exist only once `token` does: nothing the loss computes from them -- a data check in the
    user's own callback, say -- runs before the callback that opened the iteration. (XLA runs
    whatever does not depend on it whenever it likes: a step that failed there never opened, so
    a rank that caught the error and went on counted one step fewer than its peers and averaged
    its next step with their current one.) Each array gets the token times zero added (the token
    is 0.0; XLA folds neither away) -- a pass over the inputs, paid only inside the caller's own
    jit, where the step is counted when it opens; no gradient flows through the token."""
    zero = jax.lax.stop_gradient(token) * 0

    def tie(x):
        if not isinstance(x, jax.Array) or x.size == 0:
            return x
        if x.dtype == jnp.bool_:
            return x | (zero != 0)
        if jnp.issubdtype(x.dtype, jnp.number):
            return x + zero.astype(x.dtype)
        return x  # (a typed PRNG key, say: nothing to add it to)

    return jax.tree.map(tie, tree)


def reporting(callback, errors: list):
    """`callback` as a host callback: an exception it raises is also kept in `errors`, so that
    grad_fn raises portddp's message instead of XLA's wrapper around it."""

    def run(*args):
        try:
            return callback(*args)
        except ReferenceError as e:
            if "no longer exists" not in str(e):  # (not the proxy through which callbacks hold their DDP)
                errors.append(e)
                raise
            error = RuntimeError(
                "the portddp.jax DistributedDataParallel this compiled program was traced with has been "
                "garbage-collected: keep it (or its grad_fn) alive for as long as programs traced with it run")
            errors.append(error)
            raise error from e
        except Exception as e:
            errors.append(e)
            raise

    return run


def in_current_trace(x) -> bool:
    """Whether `x` is a value of the program being traced now (not of an earlier, finished trace,
    nor of an outer one)."""
    from jax._src import core  # noqa: PLC0415 -- no public way to ask which trace is current

    return isinstance(x, core.Tracer) and x._trace is core.trace_ctx.trace


def traced(tree) -> bool:
    """Whether `tree` holds tracers: grad_fn is being traced into the caller's jit, scan or vmap."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


DERIVATIVE = "jax.grad (or jax.jvp, jax.hessian: a derivative of grad_fn)"


def transformation(tree) -> str:
    """Which transformation traces `tree`, as named in error messages."""
    kinds = {type(x).__name__ for x in jax.tree_util.tree_leaves(tree)}
    if "BatchTracer" in kinds:
        return "jax.vmap"
    if kinds & {"JVPTracer", "LinearizeTracer"}:
        return DERIVATIVE
    return "jax.jit (or lax.scan, nnx.jit: any trace)"


def checked_loss(loss_fn, has_aux: bool, via: str = "value_and_grad"):
    """loss_fn as `(x, batch) -> (loss, aux)` (aux None without has_aux), checked at trace time to
    return a floating-point scalar loss (the same error on every rank, before any collective).
    `via`: the DistributedDataParallel method loss_fn was given to (its errors name it)."""
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def checked(x, batch):
        held = flax_nnx.variables_in(batch)
        out = loss_fn(x, batch)
        flax_nnx.unchanged_by_loss(held)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                got = f"a {type(out).__name__} of {len(out)} values" if isinstance(out, tuple | list) else \
                    f"one array of shape {jnp.shape(out)}" if hasattr(out, "shape") else f"a {type(out).__name__}"
                raise TypeError(f"has_aux=True: loss_fn must return a pair (loss, aux); {name!r} returned {got}")
            loss, aux = out
        elif isinstance(out, tuple | list):
            raise TypeError(
                f"loss_fn must return a scalar; {name!r} returned a {type(out).__name__} of {len(out)} values: to "
                f"return (loss, aux) pass has_aux=True (ddp.{via}(loss_fn, has_aux=True); grad_fn then "
                "returns ((loss, aux), grads)), or return only the loss")
        else:
            loss, aux = out, None
        if jnp.shape(loss) != ():
            raise TypeError(f"loss_fn must return a scalar; {name!r} returned shape {jnp.shape(loss)}: reduce it "
                            "(e.g. .mean()) inside loss_fn")
        if not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
            raise TypeError(f"loss_fn must return a floating-point scalar; {name!r} returned "
                            f"{jnp.result_type(loss)}: gradients need a real-valued loss")
        return loss, aux

    return checked
