"""A stack of Linear layers -- the DDP paper's favourite microbenchmark shape --
in PyTorch and as a JAX function of a parameter dict, with the same names.

The JAX parameters are a flat dict keyed by the PyTorch parameter names
("0.weight", "0.bias", "2.weight", ...), kernels stored (in, out) as JAX
convention has it, so `torch_order()` gives both sides the same bucket plan.
"""

from __future__ import annotations

import numpy as np
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


def jax_params_from_torch(model: TorchMLP) -> dict[str, np.ndarray]:
    """The same values as numpy arrays in JAX layout: Linear kernels transposed to (in, out)."""
    return {name: (p.detach().numpy().T if name.endswith("weight") else p.detach().numpy()).copy()
            for name, p in model.named_parameters()}


def torch_order(model: TorchMLP) -> list[str]:
    """The registration order as portddp.jax `order=` names (keystr of each dict key)."""
    return [f"['{name}']" for name, _ in model.named_parameters()]


def jax_mlp_apply(params: dict, x):
    """The forward pass of TorchMLP on the dict from jax_params_from_torch."""
    import jax.numpy as jnp  # noqa: PLC0415

    linear = sorted({int(k.split(".")[0]) for k in params})
    for n, k in enumerate(linear):
        x = x @ params[f"{k}.weight"] + params[f"{k}.bias"]
        if n < len(linear) - 1:
            x = jnp.maximum(x, 0)
    return x
