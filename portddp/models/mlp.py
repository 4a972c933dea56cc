"""`mlp`: a stack of Linear layers -- the DDP paper's favourite microbenchmark
shape -- in PyTorch and in Flax NNX, with mirrored attribute paths.

TorchMLP(1024, 8) is the benchmark model of the issues: 8 x 4 MB of weights.
"""

from __future__ import annotations

import torch
from torch import nn


class TorchMLP(nn.Module):
    """`depth` x Linear with ReLU between them (none after the last)."""

    def __init__(self, width: int = 1024, depth: int = 8, in_dim: int | None = None, out_dim: int | None = None):
        super().__init__()
        dims = [in_dim or width] + [width] * (depth - 1) + [out_dim or width]
        self.layers = nn.ModuleList(nn.Linear(dims[k], dims[k + 1]) for k in range(depth))

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def nnx_mlp(width: int = 1024, depth: int = 8, in_dim: int | None = None, out_dim: int | None = None):
    """The Flax NNX twin of TorchMLP (values come from torch_to_nnx)."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    class NnxMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            dims = [in_dim or width] + [width] * (depth - 1) + [out_dim or width]
            self.layers = nnx.List([nnx.Linear(dims[k], dims[k + 1], rngs=rngs) for k in range(depth)])

        def __call__(self, x):
            for k, layer in enumerate(self.layers):
                x = layer(x)
                if k < len(self.layers) - 1:
                    x = jax.nn.relu(x)
            return x

    return NnxMLP(nnx.Rngs(0))
