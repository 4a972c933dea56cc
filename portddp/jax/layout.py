"""The pytree a portddp.jax DistributedDataParallel was built for, and its canonical layout.

The bucket plan (portddp.buckets) numbers parameters k = 0, 1, ... in registration
order and knows each one's name, shape and dtype -- the PyTorch twin's, in a job that
mixes frameworks. A pytree numbers its leaves in its own flatten order, names them by
key path (`jax.tree_util.keystr`) and may store a weight transposed (Flax's Dense
kernel is (in, out), torch's Linear weight (out, in)). `Layout` is the map between
the two: `leaf_of[k]` is parameter k's leaf, `perm[k]` how to transpose it into the
canonical layout. Everything in portddp.jax past this module speaks parameter k.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from portddp.buckets import BucketPlan, ParamSpec
from portddp.shm import is_half

__all__ = ["Canonical", "Layout", "copy_scaled"]

REDUCED_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""The parameter dtypes portddp.jax buckets and reduces (float16 and bfloat16 summed in float32 on MPI)."""

_TILE = 256  # elements per side of the blocks a transposing copy moves (1024^2 float32: 8.3 -> 1.7 ms)


class Canonical(NamedTuple):
    """How one pytree leaf appears in the bucket plan: under `name`, transposed by `perm`.

    With these, a JAX rank uses the exact names, shapes and flat layout of a
    PyTorch twin (portddp.models.jax_canonical builds them), which is what lets
    one job mix the two frameworks (comparisons/mixed.py)."""

    leaf: str  # jax.tree_util.keystr of the leaf's path
    name: str  # the name every rank agrees on, e.g. the PyTorch parameter name
    perm: tuple[int, ...] | None  # canonical array = leaf.transpose(perm); None: as is


class Layout:
    """Pytree <-> parameters in registration order, canonical layout.

    Args: the parameter pytree; `order` (leaf names in registration order) or
    `canonical` (a Canonical per parameter, in registration order); neither: the
    pytree's leaf order under its own names."""

    def __init__(self, params, order=None, canonical=None):
        if order is not None and canonical is not None:
            raise ValueError("pass order= or canonical= (which implies the order), not both")
        paths, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.leaf_names = [jax.tree_util.keystr(p) for p, _ in paths]
        leaves = [leaf for _, leaf in paths]
        if not leaves:
            raise ValueError("DistributedDataParallel needs a pytree with at least one array leaf")
        scalars = [(n, type(x).__name__) for n, x in zip(self.leaf_names, leaves) if not hasattr(x, "dtype")]
        if scalars:
            raise ValueError(
                f"leaf {scalars[0][0]} is a Python {scalars[0][1]}, not an array: make it one (jnp.asarray(value, "
                "jnp.float32)) if it is a parameter, or keep it out of the parameter pytree (a constant: in the "
                "closure of loss_fn or in the batch)")
        keys = [n for n, x in zip(self.leaf_names, leaves) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
        if keys:
            raise ValueError(
                f"leaf {keys[0]} is a JAX PRNG key, which is not a parameter: keep random state out of the "
                "parameters (for Flax NNX: in nnx.Rngs, whose RngState nnx_value_and_grad carries per rank; "
                "pass nnx.state(model, nnx.Param) or the model itself)")
        not_float = [(n, np.dtype(x.dtype).name) for n, x in zip(self.leaf_names, leaves)
                     if not jnp.issubdtype(x.dtype, jnp.floating)]
        complex_ = [n for n, x in zip(self.leaf_names, leaves) if jnp.issubdtype(x.dtype, jnp.complexfloating)]
        if complex_:
            raise ValueError(
                f"leaf {complex_[0]} is complex ({np.dtype(leaves[self.leaf_names.index(complex_[0])].dtype).name}): "
                "portddp.jax reduces real floating-point parameters only; keep the real and imaginary parts as two "
                "real leaves (and build the complex value inside loss_fn)")
        if not_float:
            raise ValueError(
                f"leaf {not_float[0][0]} has dtype {not_float[0][1]}, which has no gradient: pass only the "
                "trainable floating-point parameters and keep integer state elsewhere (for Flax NNX: hold it in "
                "an nnx.Variable, or a subclass such as nnx.BatchStat, not in an nnx.Param -- nnx_value_and_grad "
                f"carries it through the step) ({len(not_float)} such leaves)")
        dtypes = [_dtype(x) for x in leaves]
        odd = [(n, d) for n, d in zip(self.leaf_names, dtypes) if d not in REDUCED_DTYPES]
        if odd:
            raise ValueError(
                f"leaf {odd[0][0]} has dtype {odd[0][1]}, which portddp.jax does not reduce (it reduces "
                f"{', '.join(REDUCED_DTYPES)}): keep the parameter in one of those and cast it inside loss_fn "
                f"({len(odd)} such leaves)")
        self.leaf_shapes = [tuple(np.shape(x)) for x in leaves]
        self.leaf_dtypes = dtypes
        if canonical is None:
            ks = range(len(leaves)) if order is None else self._indices(order, "order")
            canonical = [Canonical(self.leaf_names[i], self.leaf_names[i], None) for i in ks]
        self.leaf_of = self._indices([c.leaf for c in canonical], "canonical")
        self.perm = [c.perm for c in canonical]
        self.names = [c.name for c in canonical]

    def _indices(self, names, what: str) -> list[int]:
        index = {n: i for i, n in enumerate(self.leaf_names)}
        unknown = [n for n in names if n not in index]
        if unknown or len(names) != len(index) or len(set(names)) != len(names):
            missing = sorted(set(index) - set(names))
            raise ValueError(
                f"{what} must list every parameter name exactly once; unknown: {unknown[:5]}, missing: "
                f"{missing[:5]} (names are jax.tree_util.keystr of the leaf paths, e.g. {self.leaf_names[0]!r})")
        return [index[n] for n in names]

    def specs(self, tree) -> list[ParamSpec]:
        """The (name, shape, dtype) of each parameter of `tree` in registration order and canonical
        layout -- or, for a tree of another structure, of each leaf (and the check will say where)."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != self.treedef:
            return [ParamSpec(jax.tree_util.keystr(p), tuple(np.shape(x)), _dtype(x)) for p, x in paths]
        return [ParamSpec(self.names[k], _permuted(tuple(np.shape(paths[i][1])), self.perm[k]),
                          _dtype(paths[i][1])) for k, i in enumerate(self.leaf_of)]

    def check(self, tree) -> list:
        """`tree`'s leaves, after checking it is the pytree we were built with: the same structure
        and, leaf by leaf, the same shape and dtype (works on tracers too: shapes are static)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(self._structure_error(tree, treedef))
        for name, shape, dtype, leaf in zip(self.leaf_names, self.leaf_shapes, self.leaf_dtypes, leaves):
            if tuple(np.shape(leaf)) != shape or _dtype(leaf) != dtype:
                raise ValueError(
                    f"leaf {name} is {tuple(np.shape(leaf))} {_dtype(leaf)} here, but "
                    f"DistributedDataParallel was built for {shape} {dtype}: the bucket plan and its buffers are "
                    "sized and typed for the parameters it was given: keep each leaf's shape and dtype (an update "
                    "computed in another dtype changes it: cast it back, e.g. new.astype(old.dtype)), or build a new "
                    "DistributedDataParallel for new shapes or dtypes")
        return leaves

    def _structure_error(self, tree, treedef) -> str:
        """What differs between `tree` and the pytree we were built with, by leaf path."""
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        new = [p for p in paths if p not in set(self.leaf_names)]
        gone = [p for p in self.leaf_names if p not in set(paths)]
        fix = ("The bucket plan and its buffers are sized for the parameters DistributedDataParallel was built "
               "with: build a new one (and a new optimizer state) after changing the model, and pass the same "
               "pytree (for Flax NNX: the model, or nnx.state(model, nnx.Param)) at every call. Flax NNX: "
               "nnx_value_and_grad differentiates every nnx.Param, or what DistributedDataParallel(model, wrt=...) "
               "selects, so build it from the model itself; to train a subset (LoRA, a frozen backbone) pass the "
               "filter your optimizer uses (DistributedDataParallel(model, wrt=nnx.LoRAParam) beside "
               "nnx.Optimizer(model, tx, wrt=nnx.LoRAParam))")
        if new or gone:
            def some(xs):
                return ", ".join(xs[:5]) + (f" and {len(xs) - 5} more" if len(xs) > 5 else "")
            def leaves(xs):
                return f"{len(xs)} lea{'f' if len(xs) == 1 else 'ves'}"
            what = "; ".join(([f"{leaves(new)} it was not built with: {some(new)}"] if new else [])
                             + ([f"missing {leaves(gone)} it was built with: {some(gone)}"] if gone else []))
            return f"pytree differs from the one DistributedDataParallel was built with: {what}. {fix}"

        def short(d) -> str:
            text = str(d)
            return text if len(text) <= 300 else text[:300] + " ..."
        return (f"pytree structure differs from the one DistributedDataParallel was built with, though its leaves "
                f"have the same paths (other container types or node metadata): got {short(treedef)}, expected "
                f"{short(self.treedef)}. {fix}")

    def leaves_of(self, tree) -> dict[int, object]:
        """{parameter k: its leaf} of a checked `tree`."""
        leaves = self.check(tree)
        return {k: leaves[i] for k, i in enumerate(self.leaf_of)}

    def canonical(self, k: int, leaf) -> np.ndarray:
        """Parameter k's leaf as a numpy array in the canonical layout."""
        leaf = np.asarray(leaf)
        return leaf if self.perm[k] is None else leaf.transpose(self.perm[k])

    def to_tree(self, plan: BucketPlan, values: list):
        """Per-parameter arrays in plan order (canonical layout) -> the pytree, in its own layout.
        Inside a traced program or eagerly (jax or numpy arrays)."""
        out = [None] * len(self.leaf_names)
        ks = [k for bucket in plan.buckets for k in bucket.params]
        for k, value in zip(ks, values):
            if self.perm[k] is not None:
                value = value.transpose(tuple(np.argsort(self.perm[k])))
            out[self.leaf_of[k]] = value
        return jax.tree_util.tree_unflatten(self.treedef, out)


def copy_scaled(dst: np.ndarray, src: np.ndarray, scale: float | None = None) -> None:
    """dst[...] = src (times `scale`), for a `src` that may be a transposed view (Layout.canonical
    of a leaf stored transposed). numpy walks such a copy in dst's order and reads src a column at
    a time, a cache line per element; in 256 x 256 tiles both sides stay in cache (a 1024 x 1024
    float32 kernel: 8.3 -> 1.7 ms here, a 4096 x 1024 one 35 -> 12 ms)."""
    if src.ndim != 2 or src.flags.c_contiguous or src.size <= _TILE * _TILE:
        _copy(dst, src, scale)
        return
    for i in range(0, src.shape[0], _TILE):
        for j in range(0, src.shape[1], _TILE):
            tile = (slice(i, i + _TILE), slice(j, j + _TILE))
            _copy(dst[tile], src[tile], scale)


def _copy(dst: np.ndarray, src: np.ndarray, scale: float | None) -> None:
    if scale is None:
        dst[...] = src
    elif is_half(src.dtype):
        # float16 / bfloat16: the product in float32, rounded once, as PyTorch's mul does (numpy would
        # round 1/3 to the half type first: +0.2 % on every gradient at n=3)
        np.multiply(src, np.float32(scale), out=dst, dtype=np.float32, casting="unsafe")
    else:
        np.multiply(src, scale, out=dst, casting="unsafe")


def _dtype(x) -> str:
    """The dtype JAX computes `x` in, by name: a float64 numpy leaf is float32 unless jax_enable_x64 is
    on (jax.grad's gradient of it is), so a plan built from it matches what the steps produce."""
    dtype = x.dtype
    if not jnp.issubdtype(dtype, jax.dtypes.extended):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return np.dtype(dtype).name


def _permuted(shape: tuple[int, ...], perm) -> tuple[int, ...]:
    return shape if perm is None else tuple(shape[p] for p in perm)
