"""Models used by the demos and tests (the Flax twins arrive with portddp.jax)."""

from portddp.models.mlp import TorchMLP

__all__ = ["TorchMLP"]
