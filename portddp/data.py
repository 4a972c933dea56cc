"""Deterministic per-rank batches as numpy arrays, shared by both frameworks.

A batch is a pure function of (seed, step, rank): any process can rebuild any
rank's batch, which is how a single-process reference trains on exactly the
global batch the ranks saw (the concatenation over ranks, in rank order).
"""

from __future__ import annotations

import numpy as np

__all__ = ["regression_batch", "global_batch"]


def regression_batch(seed: int, step: int, rank: int, batch: int, in_dim: int, out_dim: int,
                     dtype="float32") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) with x ~ N(0, 1) of shape (batch, in_dim) and a noisy linear target."""
    rng = np.random.default_rng([seed, step, rank])
    x = rng.standard_normal((batch, in_dim))
    w = np.random.default_rng([seed, 2**31 - 1]).standard_normal((in_dim, out_dim)) / np.sqrt(in_dim)
    y = x @ w + 0.1 * rng.standard_normal((batch, out_dim))
    return x.astype(dtype), y.astype(dtype)


def global_batch(make, world: int, *args, **kwargs):
    """Concatenate `make(..., rank=r, ...)` over ranks 0..world-1 (the reference's batch)."""
    parts = [make(*args, rank=r, **kwargs) for r in range(world)]
    return tuple(np.concatenate(xs) for xs in zip(*parts))
