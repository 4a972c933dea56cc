"""`mlp`: a stack of Linear layers -- the DDP paper's favourite microbenchmark
shape -- in PyTorch and in Flax NNX, with mirrored attribute paths.

TorchMLP(1024, 8) is the benchmark model of the issues: 8 x 4 MB of weights;
TorchMLP(1280, 6, activation="gelu") is issue 16's second MLP (6 x 6.25 MB).
"""

from __future__ import annotations

import torch
from torch import nn


ACTIVATIONS = ("relu", "gelu")  # gelu: the exact (erf) form, PyTorch's default; JAX must be told


class TorchMLP(nn.Module):
    """`depth` x Linear with ReLU (or GELU) between them (none after the last)."""

    def __init__(self, width: int = 1024, depth: int = 8, in_dim: int | None = None, out_dim: int | None = None,
                 activation: str = "relu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: choose one of {ACTIVATIONS}")
        self.act = {"relu": torch.relu, "gelu": nn.functional.gelu}[activation]
        dims = [in_dim or width] + [width] * (depth - 1) + [out_dim or width]
        self.layers = nn.ModuleList(nn.Linear(dims[k], dims[k + 1]) for k in range(depth))

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = self.act(x)
        return x


def nnx_mlp(width: int = 1024, depth: int = 8, in_dim: int | None = None, out_dim: int | None = None,
            activation: str = "relu"):
    """The Flax NNX twin of TorchMLP (values come from torch_to_nnx)."""
    import functools  # noqa: PLC0415

    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    # jax.nn.gelu defaults to the tanh approximation; PyTorch's default is the exact erf form.
    act = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=False)}[activation]

    class NnxMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            dims = [in_dim or width] + [width] * (depth - 1) + [out_dim or width]
            self.layers = nnx.List([nnx.Linear(dims[k], dims[k + 1], rngs=rngs) for k in range(depth)])

        def __call__(self, x):
            for k, layer in enumerate(self.layers):
                x = layer(x)
                if k < len(self.layers) - 1:
                    x = act(x)
            return x

    return NnxMLP(nnx.Rngs(0))
