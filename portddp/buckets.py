"""Framework-free bucket planning: ordered parameter specs -> a BucketPlan.

Both `portddp.torch` and `portddp.jax` plan their buckets here, so a twin
PyTorch model and its JAX copy get the identical plan (and flat layout) from the
identical ordered spec list. The plan is a plain value: JSON in, JSON out.

The assignment rule is PyTorch's (`_compute_bucket_assignment_by_size` in
torch/csrc/distributed/c10d/reducer.cpp), reimplemented, not wrapped:

* tensors are visited in the given order and grouped by (dtype, device) -- a
  flat bucket buffer has one dtype and lives on one device;
* a tensor is never split; it joins the open bucket of its group, and that
  bucket closes as soon as its size reaches the group's current limit;
* a tensor whose gradient is sparse (`ParamSpec.sparse`: an `nn.Embedding` or
  `nn.EmbeddingBag` with sparse=True) gets a bucket of its own, and moves no
  group to its next limit;
* each group walks the list of limits on its own: its first bucket uses
  limits[0], the next limits[1], ... and the last limit repeats;
* leftover open buckets are closed at the end; buckets are then ordered by the
  smallest position they contain, so buckets become ready one after another.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from numbers import Real

__all__ = [
    "MB",
    "ParamSpec",
    "Bucket",
    "BucketPlan",
    "assign_by_size",
    "plan_buckets",
    "rebuild_plan",
    "cap_bytes",
]

MB = 1024 * 1024  # PyTorch's "MB" in bucket_cap_mb is a mebibyte
NO_LIMIT = 2**63 - 1  # PyTorch uses sys.maxsize for "one bucket"

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; expected one of {sorted(_ITEMSIZE)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter as the planner sees it: a name, a shape and a dtype name (and whether its
    gradient is sparse: then it is reduced alone, never packed into a flat buffer)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy-style name: "float32", "bfloat16", ...
    device: str = "cpu"
    sparse: bool = False

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        itemsize(self.dtype)  # validates the name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat buffer holding the gradients of `params` back to back.

    `params` are indices into the plan's spec list, in buffer order;
    `offsets[k]` is where params[k] starts (in elements)."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: str
    device: str
    cap_bytes: int
    sparse: bool = False  # one parameter with a sparse gradient: no flat buffer

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The buckets of one model, in launch order."""

    specs: tuple[ParamSpec, ...]
    buckets: tuple[Bucket, ...]

    # -- lookups -------------------------------------------------------------
    def locate(self) -> list[tuple[int, int]]:
        """For every param index: (bucket index, element offset in that bucket)."""
        where = [(-1, -1)] * len(self.specs)
        for b, bucket in enumerate(self.buckets):
            for p, off in zip(bucket.params, bucket.offsets):
                where[p] = (b, off)
        return where

    def assignment(self) -> list[list[int]]:
        return [list(b.params) for b in self.buckets]

    def describe(self) -> str:
        n, k = len(self.specs), len(self.buckets)
        lines = [f"BucketPlan: {n} param{'s' if n != 1 else ''} in {k} bucket{'s' if k != 1 else ''}"]
        for i, b in enumerate(self.buckets):
            names = [self.specs[p].name for p in b.params]
            shown = ", ".join(names[:4]) + (f", ... (+{len(names) - 4})" if len(names) > 4 else "")
            size = "  sparse, alone" if b.sparse else f"{b.nbytes / MB:8.3f} MB {b.dtype:>8} cap {b.cap_bytes / MB:g} MB"
            lines.append(f"  bucket {i}: {size}  [{shown}]")
        return "\n".join(lines)

    # -- a plain, serialisable value ------------------------------------------
    def to_dict(self) -> dict:
        return {"specs": [_dense_only(s) for s in self.specs], "buckets": [_dense_only(b) for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: dict) -> "BucketPlan":
        specs = tuple(ParamSpec(**{**s, "shape": tuple(s["shape"])}) for s in d["specs"])
        buckets = tuple(
            Bucket(**{**b, "params": tuple(b["params"]), "offsets": tuple(b["offsets"])})
            for b in d["buckets"]
        )
        return cls(specs, buckets)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "BucketPlan":
        return cls.from_dict(json.loads(s))


def _dense_only(item) -> dict:
    """`item` as a dict, `sparse` left out where False (as plans of dense models always were)."""
    d = dataclasses.asdict(item)
    if not d["sparse"]:
        del d["sparse"]
    return d


def cap_bytes(value, what: str) -> int:
    """Turn a cap in MB into bytes, refusing what cannot be a cap.

    `math.inf` means "no cap" (one bucket per dtype); 0, as in native DDP, one tensor per bucket."""
    if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value) or value < 0:
        raise ValueError(
            f"{what}={value!r} is not a valid bucket size: pass a number of megabytes >= 0 "
            f"(e.g. {what}=25.0; 0: one tensor per bucket), or math.inf for a single bucket"
            + (", or 'auto' to time a few caps and keep the fastest" if what == "bucket_cap_mb" else "")
        )
    if math.isinf(value):
        return NO_LIMIT
    return max(1, int(value * MB)) if value > 0 else 0


def assign_by_size(
    sizes: Sequence[int],
    keys: Sequence[object],
    limits: Sequence[int],
    alone: Sequence[bool] = (),
    sort: bool = True,
) -> tuple[list[list[int]], list[int]]:
    """Group positions 0..n-1 into buckets; the rule in the module docstring.

    `sizes[i]` is the byte size of tensor i and `keys[i]` its group (dtype,
    device); `alone[i]` (default False) puts tensor i in a bucket of its own (a
    sparse gradient). Returns (buckets as lists of positions, the limit each
    bucket was closed against; a lone tensor's is 0) -- the same pair
    PyTorch's function returns when given no explicit tensor indices; with
    `sort=False`, in the order the buckets closed, as it returns them when given
    the indices (its re-plan from the observed order: a lone sparse tensor's
    bucket then comes before the dense one still open when it arrived).
    """
    if not limits:
        raise ValueError("limits must name at least one bucket size")
    open_buckets: dict[object, list[int]] = {}
    open_bytes: dict[object, int] = {}
    # Each group has its own position in `limits`: the first bucket of every
    # dtype gets the small first-bucket cap, not only the first bucket overall.
    limit_pos: dict[object, int] = {}
    done: list[tuple[list[int], int]] = []
    for i, (size, key) in enumerate(zip(sizes, keys, strict=True)):
        if alone and alone[i]:
            done.append(([i], 0))  # (native's "no size limit" for it)
            continue
        bucket = open_buckets.setdefault(key, [])
        bucket.append(i)
        open_bytes[key] = open_bytes.get(key, 0) + size
        pos = limit_pos.setdefault(key, 0)
        if open_bytes[key] >= limits[pos]:
            done.append((bucket, limits[pos]))
            del open_buckets[key]
            open_bytes[key] = 0
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    for key, bucket in open_buckets.items():
        done.append((bucket, limits[limit_pos[key]]))
    # Ordered by the first tensor they hold: with tensors listed in the order
    # their gradients are expected, bucket k+1 becomes ready after bucket k.
    if sort:
        done.sort(key=lambda item: min(item[0]))
    return [b for b, _ in done], [lim for _, lim in done]


def _make_plan(specs: tuple[ParamSpec, ...], order: Sequence[int], limits: list[int], sort: bool = True) -> BucketPlan:
    ordered = [specs[i] for i in order]
    groups, caps = assign_by_size(
        [s.nbytes for s in ordered], [(s.dtype, s.device) for s in ordered], limits, [s.sparse for s in ordered], sort
    )
    buckets = []
    for positions, cap in zip(groups, caps):
        params = tuple(order[pos] for pos in positions)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += specs[p].numel
        first = specs[params[0]]
        buckets.append(Bucket(params, tuple(offsets), total, first.dtype, first.device, cap, first.sparse))
    return BucketPlan(specs, tuple(buckets))


def _limits(bucket_cap_mb, first_bucket_cap_mb) -> list[int]:
    cap = cap_bytes(bucket_cap_mb, "bucket_cap_mb")
    first = cap_bytes(first_bucket_cap_mb, "first_bucket_cap_mb")
    # A first cap above the regular one would only delay the first launch.
    return [min(first, cap), cap] if first < cap else [cap]


def plan_buckets(
    specs: Iterable[ParamSpec],
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> BucketPlan:
    """The initial plan: `specs` in registration (forward) order.

    Parameters are visited in *reverse* registration order, because backward
    produces gradients roughly in the reverse of the order the forward pass
    used the parameters: the last layer's gradients exist first, so they go in
    the first bucket, which is launched first. The small first bucket gets
    communication going as early as possible.
    """
    specs = tuple(specs)
    if not specs:
        raise ValueError("cannot plan buckets for a model with no trainable parameters")
    limits = _limits(bucket_cap_mb, first_bucket_cap_mb)
    return _make_plan(specs, list(range(len(specs)))[::-1], limits)


def plan_as_registered(
    specs: Iterable[ParamSpec],
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> BucketPlan:
    """Native DDP's plan where it never re-plans (find_unused_parameters=True without static_graph):
    buckets filled in *registration* order -- the first, under the first cap, holds the first
    parameters registered -- then launched in reverse, the bucket of the last-registered ones first.
    The same parameters travel together as in native's buckets, which a comm hook that treats a
    bucket as a whole (one quantisation scale, PowerSGD's matrices) can tell."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("cannot plan buckets for a model with no trainable parameters")
    plan = _make_plan(specs, list(range(len(specs))), _limits(bucket_cap_mb, first_bucket_cap_mb))
    return BucketPlan(specs, tuple(reversed(plan.buckets)))


def rebuild_plan(
    plan: BucketPlan,
    ready_order: Sequence[int],
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
) -> BucketPlan:
    """Re-plan from the order in which gradients were observed to become ready.

    `ready_order` lists param indices as their gradients arrived (one
    iteration, rank 0's observation broadcast to all ranks). Params that never
    became ready (unused) are appended in reverse registration order.
    """
    n = len(plan.specs)
    seen = set()
    order = []
    for i in ready_order:
        i = int(i)
        if not 0 <= i < n or i in seen:
            raise ValueError(f"ready_order is not a permutation of 0..{n - 1}: bad entry {i}")
        seen.add(i)
        order.append(i)
    order += [i for i in range(n - 1, -1, -1) if i not in seen]
    # (unsorted, as native's reducer re-plans: it passes the observed order as tensor indices)
    return _make_plan(plan.specs, order, _limits(bucket_cap_mb, first_bucket_cap_mb), sort=False)
