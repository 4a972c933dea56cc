"""What a loss function reads besides its arguments, and whether it changed since the trace.

portddp compiles loss_fn into its step once per grad_fn and input signature, as jax.jit
does, so values loss_fn reads from outside its arguments -- its closure, the module globals
it names: a GAN's generator parameters in the discriminator's loss, an EMA teacher, a
temperature annealed by the loop -- go into the program as they were at that first call.
jax.value_and_grad, which grad_fn stands in for, reads them at every call. `Captured` finds
those values and says when one was replaced, so that the step is traced again with the new
ones instead of silently computing with the old.

Found: loss_fn's closure cells and the globals its code loads (nested lambdas and
comprehensions included), a functools.partial's arguments, the attributes a bound method
reads from its instance -- also a callable object's, whose `__call__` is that method -- and
of an object of the user's that a closure cell or global holds (`hp.temperature`, by the
attribute names the code loads), and the same in the functions of the user's own code these
name, a few calls deep (library code is not searched). JAX arrays -- alone, in pytrees, in a Flax NNX
module -- are watched by identity, and only those the trace made constants (`learn`): a new
value is a new object, a JAX array being immutable (an NNX Variable's value too); numpy arrays
by identity; numbers and strings bound to a name by value. Not seen: a number inside a
container (the trace inlines numbers: whether it read one cannot be told), a numpy array
changed in place, values reached through a module or class attribute (`config.scale` where
`config` is a module), and attributes two objects deep (`cfg.optim.scale`). An object's attributes
are those it holds itself: in its `__dict__`, a NamedTuple's fields, `__slots__` (a frozen
`dataclass(slots=True)`'s); a property's value is not computed.
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
_SCALARS = (bool, int, float, complex, str, np.generic)


class Captured:
    """The values `fn` reads from outside its arguments, as the last trace read them.

    `learn(consts)` after each trace: of the JAX arrays found, only those the trace made constants
    (`jax.make_jaxpr(...).consts`) are watched -- a global TrainState whose `apply_fn` alone the
    loss uses is not watched for its parameters --, numbers, strings and numpy arrays always (a
    number goes into a program as a literal, a numpy array as a copy). Held strongly: the program
    holds them as constants anyway, and identity needs them alive."""

    def __init__(self, fn):
        self._fn = fn
        self._held: list[tuple[str, list]] | None = None  # None: nothing learnt (before the first trace)
        self.retraces = 0

    def changed(self) -> str | None:
        """The name of a watched value replaced since the last trace, else None (also before the
        first trace)."""
        if self._held is None:
            return None
        now = dict(_snapshot(self._fn))
        for name, held in self._held:
            values = now.get(name)
            if values is None or len(values) != len(held) or not all(
                    h is None or _same(h, v) for h, v in zip(held, values)):
                self._held = None  # (learnt again after the trace this change calls for)
                self.retraces += 1
                return name
        return None

    @property
    def learnt(self) -> bool:
        return self._held is not None

    def reads_arrays(self) -> bool:
        """Whether `fn` reads any JAX array from outside its arguments: only then are the trace's
        constants worth finding (`learn` needs None otherwise)."""
        return any(isinstance(v, jax.Array) for _, values in _snapshot(self._fn) for v in values)

    def learn(self, consts) -> None:
        """Right after a trace: hold what it read. `consts`: its constants, or None if unknown
        (then every array found is watched)."""
        kept = None if consts is None else {id(c) for c in consts}
        self._held = [(name, [v if kept is None or not isinstance(v, jax.Array) or id(v) in kept else None
                              for v in values]) for name, values in _snapshot(self._fn)]
        self._held = [(name, held) for name, held in self._held if any(h is not None for h in held)]


def _same(a, b) -> bool:
    if isinstance(a, _SCALARS) or isinstance(b, _SCALARS):
        # (by value: an equal number is the same literal in a program; NaN equals NaN here)
        return type(a) is type(b) and (a == b or a != a and b != b)
    return a is b


def _snapshot(fn) -> list[tuple[str, list]]:
    """[(name, the values it holds now)] for everything `fn` reads from outside its arguments."""
    found: list[tuple[str, list]] = []
    seen: set[int] = set()
    made: list = []  # the bound methods made here, alive until the end: `seen` holds their ids

    def consider(name: str, value, depth: int, attrs: tuple[str, ...] = ()) -> None:
        """`attrs`: the attribute names the code that reads `value` loads (for an object of the user's)."""
        if isinstance(value, _SCALARS):
            found.append((name, [value]))
        elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial)) or _call_of(value):
            visit(value, depth - 1, name)
        else:
            values = _arrays_of(value)
            if values:
                found.append((name, values))
            if attrs and _is_users_object(value):  # (hp.temperature: one level deep)
                for attr, held in _attributes(value, attrs):
                    # (beside arrays found above, the numbers: a NamedTuple's, which a trace inlines)
                    if not values or isinstance(held, _SCALARS):
                        consider(f"{name}.{attr}", held, depth)

    def visit(f, depth: int, where: str) -> None:
        if depth < 0 or id(f) in seen:
            return
        seen.add(id(f))
        if (call := _call_of(f)) is not None:  # a callable object: its __call__, bound (self.temperature)
            made.append(types.MethodType(call, f))
            visit(made[-1], depth, where)
            return
        if isinstance(f, functools.partial):
            for i, arg in enumerate(f.args):
                consider(f"{where} (partial argument {i})", arg, depth + 1)
            for key, arg in f.keywords.items():
                consider(f"{where} (partial argument {key!r})", arg, depth + 1)
            visit(f.func, depth, where)
            return
        if isinstance(f, types.MethodType):
            owner = f.__self__
            read = _attributes_of(f.__func__.__code__) if hasattr(f.__func__, "__code__") else ()
            if _arrays_of(owner) or not _is_users_object(owner):
                consider(f"{where}.__self__", owner, depth + 1, read)
            else:  # an object of the user's: the attributes the method reads (self.temperature)
                for attr, held in _attributes(owner, read):
                    consider(f"self.{attr}", held, depth + 1)
            visit(f.__func__, depth, where)
            return
        if not isinstance(f, types.FunctionType) or (f.__module__ or "").split(".")[0] in _LIBRARIES:
            return
        code = f.__code__
        attrs = _attributes_of(code)
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # (a cell not yet assigned)
                continue
            consider(name, value, depth, attrs)
        names = f.__globals__
        for name in _names_of(code):
            if name in names and not isinstance(names[name], (types.ModuleType, type)):
                consider(name, names[name], depth, attrs)

    visit(fn, _DEPTH, getattr(fn, "__name__", "loss_fn"))
    # One name per entry (two instances of one class both read `self.scale`): numbered in the order found,
    # which is the same at every snapshot.
    times: dict[str, int] = {}
    named = []
    for name, values in found:
        times[name] = times.get(name, 0) + 1
        named.append((name if times[name] == 1 else f"{name} #{times[name]}", values))
    return named


def _is_users_object(value) -> bool:
    """An instance of a class of the user's own code (not of a library's, not a class or module) that
    holds attributes: in its `__dict__`, as a NamedTuple's fields or in `__slots__`."""
    return (not isinstance(value, (type, types.ModuleType))
            and (type(value).__module__ or "").split(".")[0] not in _LIBRARIES
            and (hasattr(value, "__dict__") or bool(_slots_of(type(value)))))


def _attributes(value, names: tuple[str, ...]) -> list[tuple[str, object]]:
    """[(name, value)] of the attributes among `names` that `value` -- an object of the user's -- holds
    itself: in its `__dict__`, or as a NamedTuple's field or a `__slots__` entry (a frozen
    `dataclass(slots=True)`'s too). Read without calling anything of the user's (no properties, no
    `__getattr__`)."""
    own = vars(value) if hasattr(value, "__dict__") else {}
    slots = _slots_of(type(value))
    out = []
    for name in names:
        if name in own:
            out.append((name, own[name]))
        elif name in slots:
            try:
                out.append((name, slots[name].__get__(value, type(value))))
            except AttributeError:  # (a slot not assigned)
                pass
    return out


@functools.lru_cache(maxsize=256)
def _slots_of(cls: type) -> dict[str, object]:
    """{name: descriptor} of the fields a class keeps outside a `__dict__`: a NamedTuple's (its
    `_fields`, read through the class's tuple-index properties) and `__slots__` members, over its
    bases."""
    out: dict[str, object] = {}
    for klass in reversed(cls.__mro__[:-1]):  # (not object)
        if issubclass(klass, tuple) and hasattr(klass, "_fields"):
            out.update((name, klass.__dict__[name]) for name in klass._fields if name in klass.__dict__)
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(klass.__dict__.get(name), types.MemberDescriptorType):
                out[name] = klass.__dict__[name]
    return out


def _call_of(value):
    """The `__call__` function of a callable object of the user's (a loss object), else None. (A Flax NNX
    module is a pytree of arrays: watched as such, not searched as code.)"""
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)) or not _is_users_object(value):
        return None
    call = getattr(type(value), "__call__", None)
    if not isinstance(call, types.FunctionType) or flax_nnx.is_module(value):
        return None
    return call


@functools.lru_cache(maxsize=1024)
def _attributes_of(code: types.CodeType) -> tuple[str, ...]:
    """The attribute names `code` (and the code nested in it) loads, in order."""
    out = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_ATTR", "LOAD_METHOD")]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += _attributes_of(const)
    return tuple(dict.fromkeys(out))


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
    """The arrays `value` holds -- an array, a pytree, a Flax NNX module or Variable -- or []
    (anything else: an object of the user's that is no pytree)."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return [value]
    if flax_nnx.is_module(value):
        value = flax_nnx.state_of(value)
    elif isinstance(value, (list, tuple, dict)) and len(value) > _MAX_LEAVES:
        return []
    try:
        leaves = jax.tree.leaves(value)  # (any registered pytree: dicts, nnx.State, dataclasses, ...)
    except Exception:  # noqa: BLE001 -- (not a pytree JAX can flatten: nothing loss_fn traces as arrays)
        return []
    if len(leaves) > _MAX_LEAVES or len(leaves) == 1 and leaves[0] is value:  # (an object of the user's)
        return []
    # (numbers inside a pytree are not watched: a TrainState's step counts every step, and whether
    # the loss reads it cannot be told from the trace, which inlines numbers)
    return [x for x in leaves if isinstance(x, (jax.Array, np.ndarray))]


def describe(fn) -> str:
    """Where `fn` is defined, for messages."""
    try:
        return f"{fn.__qualname__} ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (TypeError, OSError, AttributeError):
        return getattr(fn, "__qualname__", repr(fn))
