"""A stack of Linear layers: the DDP paper's favourite microbenchmark shape."""

from __future__ import annotations

from torch import nn


class TorchMLP(nn.Sequential):
    """`depth` x Linear(width, width) with ReLU between them (none after the last).

    TorchMLP(1024, 8) is the benchmark model of the issues: 8 x 4 MB of weights."""

    def __init__(self, width: int = 1024, depth: int = 8, in_dim: int | None = None, out_dim: int | None = None):
        dims = [in_dim or width] + [width] * (depth - 1) + [out_dim or width]
        layers: list[nn.Module] = []
        for k in range(depth):
            layers.append(nn.Linear(dims[k], dims[k + 1]))
            if k < depth - 1:
                layers.append(nn.ReLU())
        super().__init__(*layers)
