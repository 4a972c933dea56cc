"""Models used by the demos and tests, written for both frameworks with the same names."""

from portddp.models.mlp import TorchMLP, jax_mlp_apply, jax_params_from_torch, torch_order

__all__ = ["TorchMLP", "jax_mlp_apply", "jax_params_from_torch", "torch_order"]
