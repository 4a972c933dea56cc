"""Deterministic per-rank batches as numpy arrays, shared by both frameworks.

A batch is a pure function of (seed, step, rank): any process can rebuild any
rank's batch, which is how a single-process reference trains on exactly the
global batch the ranks saw (the concatenation over ranks, in rank order).

Data sets, all available offline:
* synthetic regression (`regression_batch`) -- the benchmark MLP's data;
* scikit-learn's digits, 8x8 images of 10 classes (`digits_batch`) -- mlp, cnn;
* characters of Python's own documentation, pydoc_data.topics (`char_batch`) -- gpt.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["regression_batch", "digits_batch", "char_batch", "model_batch", "global_batch", "VOCAB"]

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
"""96 tokens: newline and printable ASCII; anything else in the corpus becomes a space."""


def regression_batch(seed: int, step: int, rank: int, batch: int, in_dim: int, out_dim: int,
                     dtype="float32") -> tuple[np.ndarray, np.ndarray]:
    """(x, y) with x ~ N(0, 1) of shape (batch, in_dim) and a noisy linear target."""
    rng = np.random.default_rng([seed, step, rank])
    x = rng.standard_normal((batch, in_dim))
    y = x @ _target_weights(seed, in_dim, out_dim) + 0.1 * rng.standard_normal((batch, out_dim))
    return x.astype(dtype), y.astype(dtype)


@functools.lru_cache(maxsize=4)
def _target_weights(seed: int, in_dim: int, out_dim: int) -> np.ndarray:
    """The regression target's weights: one fixed matrix per (seed, shape), built once."""
    w = np.random.default_rng([seed, 2**31 - 1]).standard_normal((in_dim, out_dim)) / np.sqrt(in_dim)
    w.flags.writeable = False
    return w


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits  # noqa: PLC0415 -- ships its data; no download

    d = load_digits()
    return (d.images / 16.0)[:, None, :, :], d.target.astype(np.int64)


def digits_batch(seed: int, step: int, rank: int, batch: int, flat: bool = False,
                 dtype="float32") -> tuple[np.ndarray, np.ndarray]:
    """(images (batch, 1, 8, 8) in [0, 1], or (batch, 64) if flat; labels (batch,) int64)."""
    images, labels = _digits()
    idx = np.random.default_rng([seed, step, rank]).integers(0, len(images), batch)
    x = images[idx].reshape(batch, -1) if flat else images[idx]
    return x.astype(dtype), labels[idx]


@functools.cache
def _corpus() -> np.ndarray:
    from pydoc_data.topics import topics  # noqa: PLC0415 -- ships with CPython

    text = "".join(topics[k] for k in sorted(topics))
    index = {c: i for i, c in enumerate(VOCAB)}
    return np.array([index.get(c, index[" "]) for c in text], dtype=np.int64)


def char_batch(seed: int, step: int, rank: int, batch: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (batch, block_size), next tokens (batch, block_size)), int64."""
    data = _corpus()
    starts = np.random.default_rng([seed, step, rank]).integers(0, len(data) - block_size - 1, batch)
    x = np.stack([data[s:s + block_size] for s in starts])
    y = np.stack([data[s + 1:s + block_size + 1] for s in starts])
    return x, y


def model_batch(model: str, seed: int, step: int, rank: int, batch: int, dtype="float32", block_size: int = 16):
    """The batch each twin model trains on: digits for mlp (flattened) and cnn, characters for gpt."""
    if model == "mlp":
        return digits_batch(seed, step, rank, batch, flat=True, dtype=dtype)
    if model == "cnn":
        return digits_batch(seed, step, rank, batch, dtype=dtype)
    if model == "gpt":
        return char_batch(seed, step, rank, batch, block_size)
    raise ValueError(f"no data for model {model!r}: choose mlp, cnn or gpt")


def global_batch(make, world: int, *args, **kwargs):
    """Concatenate `make(..., rank=r, ...)` over ranks 0..world-1 (the reference's batch)."""
    parts = [make(*args, rank=r, **kwargs) for r in range(world)]
    return tuple(np.concatenate(xs) for xs in zip(*parts))
