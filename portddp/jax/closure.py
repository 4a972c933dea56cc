"""What a loss function reads besides its arguments, and whether it changed since the trace.

portddp compiles loss_fn into its step once per grad_fn and input signature, as jax.jit
does, so values loss_fn reads from outside its arguments -- its closure, the module globals
it names: a GAN's generator parameters in the discriminator's loss, an EMA teacher, a
temperature annealed by the loop -- go into the program as they were at that first call.
jax.value_and_grad, which grad_fn stands in for, reads them at every call. `Captured` finds
those values and says when one was replaced, so that the step is traced again with the new
ones instead of silently computing with the old.

Found: loss_fn's closure cells and the globals its code names (nested lambdas and
comprehensions included), a functools.partial's arguments, a bound method's instance, and
the same in the functions of the user's own code these name, a few calls deep (library code
is not searched). Arrays -- alone, in pytrees, in a Flax NNX module or Variable -- are
compared by identity: a JAX array is immutable, so a new value is a new object (an NNX
Variable's too); Python numbers and strings by value. Not seen: a numpy array changed in
place, and values reached through a module attribute (`config.scale`) or an object that is
neither a pytree nor an NNX module.
"""

from __future__ import annotations

import dis
import functools
import inspect
import types

import jax
import numpy as np

from portddp.jax import flax_nnx

__all__ = ["Captured"]

_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "scipy", "portddp", "chex", "equinox", "haiku", "orbax",
              "functools", "builtins", "math")
_DEPTH = 3  # user functions followed from loss_fn
_MAX_LEAVES = 100_000  # a pytree larger than this is not a captured value anyone changes per step
_SCALARS = (bool, int, float, complex, str)


class Captured:
    """The values `fn` reads from outside its arguments, as held at the last trace."""

    def __init__(self, fn):
        self._fn = fn
        self._held: list[tuple[str, list]] | None = None

    def changed(self) -> str | None:
        """The name of a captured value replaced since the last call (the first call, or a call
        after a change: the values the next trace reads, held from now on), else None."""
        now = _snapshot(self._fn)
        held, self._held = self._held, now
        if held is None:
            return None
        if [name for name, _ in held] != [name for name, _ in now]:
            return next((n for n in {name for name, _ in now} ^ {name for name, _ in held}), now[0][0] if now else "?")
        for (name, before), (_, after) in zip(held, now):
            if len(before) != len(after) or not all(_same(a, b) for a, b in zip(before, after)):
                return name
        return None


def _same(a, b) -> bool:
    if isinstance(a, _SCALARS) or isinstance(b, _SCALARS):
        return type(a) is type(b) and a == b
    return a is b


def _snapshot(fn) -> list[tuple[str, list]]:
    """[(name, the values it holds now)] for everything `fn` reads from outside its arguments."""
    found: list[tuple[str, list]] = []
    seen: set[int] = set()

    def consider(name: str, value, depth: int) -> None:
        if isinstance(value, _SCALARS):
            found.append((name, [value]))
        elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            visit(value, depth - 1, name)
        else:
            values = _arrays_of(value)
            if values:
                found.append((name, values))

    def visit(f, depth: int, where: str) -> None:
        if depth < 0 or id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            for i, arg in enumerate(f.args):
                consider(f"{where} (partial argument {i})", arg, depth + 1)
            for key, arg in f.keywords.items():
                consider(f"{where} (partial argument {key!r})", arg, depth + 1)
            visit(f.func, depth, where)
            return
        if isinstance(f, types.MethodType):
            consider(f"{where}.__self__", f.__self__, depth + 1)
            visit(f.__func__, depth, where)
            return
        if not isinstance(f, types.FunctionType) or (f.__module__ or "").split(".")[0] in _LIBRARIES:
            return
        code = f.__code__
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # (a cell not yet assigned)
                continue
            consider(name, value, depth)
        names = f.__globals__
        for name in _names_of(code):
            if name in names and not isinstance(names[name], (types.ModuleType, type)):
                consider(name, names[name], depth)

    visit(fn, _DEPTH, getattr(fn, "__name__", "loss_fn"))
    return found


@functools.lru_cache(maxsize=1024)
def _names_of(code: types.CodeType) -> tuple[str, ...]:
    """The global names `code` and the code nested in it (lambdas, comprehensions) load, in order
    (not attribute names: `state.params` is no read of a global `params`)."""
    out = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += _names_of(const)
    return tuple(dict.fromkeys(out))


def _arrays_of(value) -> list:
    """The arrays (and Python numbers) `value` holds -- an array, a pytree, a Flax NNX module or
    Variable -- or [] (anything else: an object of the user's that is no pytree)."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return [value]
    if flax_nnx.is_module(value):
        value = flax_nnx.state_of(value)
    try:
        leaves = jax.tree.leaves(value)  # (any registered pytree: dicts, nnx.State, dataclasses, ...)
    except Exception:  # noqa: BLE001 -- (not a pytree JAX can flatten: nothing loss_fn traces as arrays)
        return []
    if len(leaves) > _MAX_LEAVES or len(leaves) == 1 and leaves[0] is value:  # (an object of the user's)
        return []
    return [x for x in leaves if isinstance(x, (jax.Array, np.ndarray, *_SCALARS))]


def describe(fn) -> str:
    """Where `fn` is defined, for messages."""
    try:
        return f"{fn.__qualname__} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError, AttributeError):
        return getattr(fn, "__qualname__", repr(fn))
