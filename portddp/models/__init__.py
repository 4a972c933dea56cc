"""Twin models: each written once in PyTorch and once in Flax NNX, with the same
parameter names, order and initial values (portddp.models.convert).

    twin = build_twin("gpt", size="tiny", dtype="float64", seed=0)
    twin.torch_model, twin.nnx_model          # same values, PyTorch / JAX layouts
"""

from __future__ import annotations

import dataclasses

from portddp.models.cnn import TorchCNN, nnx_cnn
from portddp.models.convert import (canonical_specs, jax_canonical, jax_order, nnx_to_torch, rules_for,
                                    torch_to_nnx)
from portddp.models.gpt import GPTConfig, TorchGPT, nnx_gpt
from portddp.models.mlp import TorchMLP, nnx_mlp

__all__ = ["MODELS", "SIZES", "Twin", "build_twin", "build_torch", "torch_loss", "jax_loss", "TorchMLP", "TorchCNN", "TorchGPT", "GPTConfig",
           "canonical_specs", "jax_canonical", "jax_order", "nnx_to_torch", "rules_for", "torch_to_nnx"]

MODELS = ("mlp", "cnn", "gpt")
SIZES = ("tiny", "bench")

# Constructor arguments per model and size; both twins get the same ones.
_ARGS = {
    ("mlp", "tiny"): {"width": 32, "depth": 3, "in_dim": 64, "out_dim": 10},
    ("mlp", "bench"): {"width": 1024, "depth": 8},
    ("cnn", "tiny"): {"in_channels": 1, "channels": (4, 8), "num_classes": 10},
    ("cnn", "bench"): {"in_channels": 1, "channels": (32, 64), "num_classes": 10},
    ("gpt", "tiny"): {"cfg": GPTConfig.tiny()},
    ("gpt", "bench"): {"cfg": GPTConfig.bench()},
}
_BUILD = {"mlp": (TorchMLP, nnx_mlp), "cnn": (TorchCNN, nnx_cnn), "gpt": (TorchGPT, nnx_gpt)}


@dataclasses.dataclass
class Twin:
    name: str
    size: str
    dtype: str
    args: dict
    torch_model: object
    nnx_model: object


def torch_loss(out, y):
    """Mean cross entropy over every prediction (classes for mlp/cnn, next tokens for gpt)."""
    from torch.nn import functional as F  # noqa: PLC0415

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def jax_loss(out, y):
    """The same loss in JAX, written out (log-softmax, pick, mean) like PyTorch computes it."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    logp = jax.nn.log_softmax(out.reshape(-1, out.shape[-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y.reshape(-1, 1), axis=1))


def build_twin(name: str, size: str = "tiny", dtype: str = "float32", seed: int = 0, **overrides) -> Twin:
    """Build the PyTorch model from `seed`, then its NNX twin with the same values.
    JAX float64 needs jax_enable_x64 set by the caller."""
    args, torch_model = _torch_model(name, size, dtype, seed, overrides)
    nnx_model = _BUILD[name][1](**args)
    torch_to_nnx(torch_model, nnx_model)
    return Twin(name, size, dtype, args, torch_model, nnx_model)


def build_torch(name: str, size: str = "tiny", dtype: str = "float32", seed: int = 0, **overrides):
    """build_twin's PyTorch model alone (the same values; no JAX import, no twin in memory)."""
    return _torch_model(name, size, dtype, seed, overrides)[1]


def _torch_model(name: str, size: str, dtype: str, seed: int, overrides: dict):
    import torch  # noqa: PLC0415

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {MODELS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {SIZES}")
    if dtype not in ("float32", "float64"):
        raise ValueError(f"unknown dtype {dtype!r}: choose 'float32' or 'float64'")
    args = {**_ARGS[name, size], **overrides}
    torch.manual_seed(seed)
    return args, _BUILD[name][0](**args).to(getattr(torch, dtype))
