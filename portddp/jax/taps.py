"""How XLA hands a value to the host in the middle of a program: the pieces every traced
iteration of portddp.jax's hooked strategy is made of (DistributedDataParallel._trace_iteration),
and the checks of what is being traced (the loss function, the transformation around grad_fn).

JAX has no autograd hooks, but a `jax.custom_vjp` function chooses its own backward
rule, and that rule may call the host with `io_callback`. `host_tap` is such an
identity: XLA runs its callback the moment the cotangents it was given exist, which
for a bucket's parameters is the moment their gradients exist -- DDP's "gradient
ready" signal. Data dependencies, not program order, schedule an unordered
callback, so the pieces pass a scalar "token" around: `start_token` opens the
iteration and every tap takes its output (no tap can run before the start), and
every tap's callback returns the token's cotangent (whatever needs every bucket
launched waits on their sum).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

__all__ = ["UNDER_VMAP", "checked_loss", "host_call", "host_tap", "keep_freed_memory", "reporting", "start_token", "traced",
           "transformation"]

UNDER_VMAP = (
    "portddp.jax grad_fn (strategy='hooked') cannot run under jax.vmap: its collectives are host callbacks "
    "that reduce one set of gradients per synchronised step, and vmap would run them once per mapped element "
    "(every rank averaging the wrong gradients). Call grad_fn once per step on this rank's whole batch -- vmap "
    "inside loss_fn is fine -- or loop over steps with a Python loop or jax.lax.scan")


def host_call(callback, result, *args):
    """`io_callback(callback, result, *args)`, refused under jax.vmap (JAX would call it once per
    element, which no collective survives). Unordered: XLA runs it as soon as its inputs exist.
    The callback receives numpy arrays (read-only) and returns numpy arrays or scalars shaped as
    `result` (one ShapeDtypeStruct, or a list of them)."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        if _DIRECT is None or jax.default_backend() not in _DIRECT_PLATFORMS:
            return io_callback(callback, result, *args, ordered=False)
        flat, tree = jax.tree.flatten(result)
        outs = _DIRECT.bind(*args, callback=_Flat(callback),
                            result_avals=tuple(jax.core.ShapedArray(r.shape, r.dtype) for r in flat))
        return jax.tree.unflatten(tree, outs)

    @call.def_vmap
    def _refuse(axis_size, in_batched, *args):
        raise ValueError(UNDER_VMAP)

    return call(*args)


class _Flat:
    """A host callback as XLA's Python-callback custom call expects it: a tuple of numpy arrays.
    Hashable by identity (a primitive's parameters are compared when JAX caches traces)."""

    def __init__(self, callback):
        self.callback = callback

    def __call__(self, *args):
        out = self.callback(*args)
        out = out if isinstance(out, tuple | list) else (out,)
        return tuple(np.asarray(x) for x in out)


def _direct_primitive():
    """`io_callback` without its copy: io_callback's implementation hands the callback jax arrays
    made from XLA's operands with `jax.device_put` -- one more copy of every gradient (32 MB per
    step on the benchmark MLP: 43 -> 37 ms per step in one process, measured). This primitive
    lowers to the same custom call (`emit_python_callback`, with io_callback's unordered effect:
    scheduled by data dependencies, never removed) and passes XLA's operands to the callback as
    the numpy arrays XLA made of them. It uses JAX internals; None (io_callback is used) where
    they are missing, or with PORTDDP_HOST_CALL=io_callback."""
    if os.environ.get("PORTDDP_HOST_CALL", "direct") == "io_callback":
        return None
    try:
        from jax._src import callback as jax_callback  # noqa: PLC0415
        from jax._src import dispatch  # noqa: PLC0415
        from jax._src.interpreters import mlir  # noqa: PLC0415
        from jax.extend.core import Primitive  # noqa: PLC0415

        emit, effect = jax_callback.emit_python_callback, jax_callback._IOEffect
        if not {"has_side_effect", "returns_token"} <= set(inspect.signature(emit).parameters):
            return None
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    prim = Primitive("portddp_host_call")
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_effectful_abstract_eval(lambda *avals, callback, result_avals: (result_avals, {effect}))

    def lowering(ctx, *args, callback, result_avals):
        results, _, _ = emit(ctx, callback, None, list(args), ctx.avals_in, ctx.avals_out,
                             has_side_effect=True, returns_token=False)
        return results

    for platform in _DIRECT_PLATFORMS:
        mlir.register_lowering(prim, lowering, platform=platform)
    return prim


_DIRECT_PLATFORMS = ("cpu", "cuda", "rocm")  # where emit_python_callback needs nothing special (TPU does)


_DIRECT = _direct_primitive()


def keep_freed_memory() -> None:
    """Have glibc keep the large blocks this process frees instead of returning them to the kernel.

    Every hooked step hands each gradient to the host and back: XLA copies the operands into
    fresh numpy arrays and the results into fresh buffers of its own, tens of MB per step. By
    default glibc serves blocks that large with mmap and unmaps them when freed (or trims the
    top of the heap), so each step faults every page in again and the kernel zeroes it: on the
    benchmark MLP, in one process, 53 -> 43 ms per step with this setting (the step with no
    callbacks: 18 ms). mallopt(M_MMAP_THRESHOLD = 32 MB) keeps blocks below 32 MB on the heap,
    mallopt(M_TRIM_THRESHOLD = 2 GB) keeps freed heap memory mapped. The cost: the process keeps
    its peak heap size. Process-wide, once; PORTDDP_MALLOC=system leaves glibc's defaults."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED or os.environ.get("PORTDDP_MALLOC", "keep") == "system":
        return
    _MALLOC_TUNED = True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, (1 << 31) - 1)


_MALLOC_TUNED = False


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


def reporting(callback, errors: list):
    """`callback` as a host callback: an exception it raises is also kept in `errors`, so that
    grad_fn raises portddp's message instead of XLA's wrapper around it."""

    def run(*args):
        try:
            return callback(*args)
        except Exception as e:
            errors.append(e)
            raise

    return run


def traced(tree) -> bool:
    """Whether `tree` holds tracers: grad_fn is being traced into the caller's jit, scan or vmap."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def transformation(tree) -> str:
    """Which transformation traces `tree`, as named in error messages."""
    if any(type(x).__name__ == "BatchTracer" for x in jax.tree_util.tree_leaves(tree)):
        return "jax.vmap"
    return "jax.jit (or lax.scan, nnx.jit: any trace)"


def checked_loss(loss_fn, has_aux: bool):
    """loss_fn as `(x, batch) -> (loss, aux)` (aux None without has_aux), checked at trace time to
    return a floating-point scalar loss (the same error on every rank, before any collective)."""
    name = getattr(loss_fn, "__name__", repr(loss_fn))

    def checked(x, batch):
        out = loss_fn(x, batch)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                got = f"a {type(out).__name__} of {len(out)} values" if isinstance(out, tuple | list) else \
                    f"one array of shape {jnp.shape(out)}" if hasattr(out, "shape") else f"a {type(out).__name__}"
                raise TypeError(f"has_aux=True: loss_fn must return a pair (loss, aux); {name!r} returned {got}")
            loss, aux = out
        elif isinstance(out, tuple | list):
            raise TypeError(
                f"loss_fn must return a scalar; {name!r} returned a {type(out).__name__} of {len(out)} values: to "
                "return (loss, aux) pass has_aux=True (ddp.value_and_grad(loss_fn, has_aux=True); grad_fn then "
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
