"""Exact weight conversion between a PyTorch model and its Flax NNX twin.

The twins are written so that every NNX attribute path mirrors the PyTorch
parameter name ("blocks.0.attn.c_attn.weight" <-> ('blocks', 0, 'attn',
'c_attn', 'kernel')); only the leaf name and the layout differ, and both
follow from the PyTorch module that owns the tensor:

    nn.Linear     weight (out, in)        -> kernel (in, out)        transposed
    nn.Conv2d     weight (out, in, h, w)  -> kernel (h, w, in, out)  OIHW -> HWIO
    nn.Embedding  weight                  -> embedding
    norm layers   weight / running_mean / running_var -> scale / mean / var

Conversions are pure data movement (transposes), so a float64 round trip is
bitwise. BatchNorm's `num_batches_tracked` has no NNX counterpart and is skipped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from torch import nn

__all__ = ["Rule", "rules_for", "torch_to_nnx", "nnx_to_torch", "canonical_specs", "jax_order", "jax_canonical"]

_NORMS = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d)


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one PyTorch tensor maps to one NNX variable."""

    torch_name: str
    nnx_path: tuple
    layout: str  # "same", "linear" (transpose) or "conv" (OIHW <-> HWIO)
    is_param: bool

    def to_nnx(self, a: np.ndarray) -> np.ndarray:
        if self.layout == "linear":
            return a.T
        if self.layout == "conv":
            return a.transpose(2, 3, 1, 0)
        return a

    def to_torch(self, a: np.ndarray) -> np.ndarray:
        if self.layout == "linear":
            return a.T
        if self.layout == "conv":
            return a.transpose(3, 2, 0, 1)
        return a


def _leaf(module: nn.Module, leaf: str) -> tuple[str, str]:
    if isinstance(module, nn.Linear) and leaf == "weight":
        return "kernel", "linear"
    if isinstance(module, nn.Conv2d) and leaf == "weight":
        return "kernel", "conv"
    if isinstance(module, nn.Embedding) and leaf == "weight":
        return "embedding", "same"
    if isinstance(module, _NORMS):
        return {"weight": "scale", "running_mean": "mean", "running_var": "var"}.get(leaf, leaf), "same"
    return leaf, "same"


def rules_for(model: nn.Module) -> list[Rule]:
    """One rule per parameter (registration order) then per buffer."""
    rules = []
    params = dict(model.named_parameters())
    for name in list(params) + [n for n, _ in model.named_buffers()]:
        if name.endswith("num_batches_tracked"):
            continue
        prefix, _, leaf = name.rpartition(".")
        owner = model.get_submodule(prefix) if prefix else model
        nnx_leaf, layout = _leaf(owner, leaf)
        path = tuple(int(p) if p.isdigit() else p for p in prefix.split(".") if p) + (nnx_leaf,)
        rules.append(Rule(name, path, layout, name in params))
    return rules


def _check_keys(rules: list[Rule], state: dict, shapes: dict) -> None:
    want = {r.torch_name for r in rules}
    got = set(state)
    missing, extra = sorted(want - got), sorted(got - want - {k for k in got if k.endswith("num_batches_tracked")})
    misshaped = [f"{k} {tuple(np.shape(state[k]))} (expected {shapes[k]})"
                 for k in sorted(want & got) if tuple(np.shape(state[k])) != shapes[k]]
    if missing or extra or misshaped:
        raise ValueError(f"state dict does not fit the model: missing {missing}, unexpected {extra}, "
                         f"misshaped {misshaped}")


def torch_to_nnx(torch_model: nn.Module, nnx_model, state_dict: dict | None = None) -> None:
    """Copy a PyTorch state dict (default: torch_model's own) into the NNX twin, in place."""
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    rules = rules_for(torch_model)
    own = torch_model.state_dict()
    state_dict = own if state_dict is None else state_dict
    _check_keys(rules, state_dict, {k: tuple(v.shape) for k, v in own.items()})
    flat = dict(nnx.to_flat_state(nnx.state(nnx_model)))
    for r in rules:
        if r.nnx_path not in flat:
            raise ValueError(f"the NNX twin has no variable at {r.nnx_path} for {r.torch_name!r}")
        value = np.asarray(state_dict[r.torch_name].detach().cpu().numpy()
                           if hasattr(state_dict[r.torch_name], "detach") else state_dict[r.torch_name])
        var = flat[r.nnx_path]
        converted = r.to_nnx(value)
        if tuple(var.get_value().shape) != converted.shape:
            raise ValueError(f"{r.torch_name!r} {value.shape} does not fit NNX {r.nnx_path} "
                             f"{tuple(var.get_value().shape)}")
        var.set_value(jnp.asarray(np.ascontiguousarray(converted)))


def nnx_to_torch(nnx_model, torch_model: nn.Module) -> dict[str, np.ndarray]:
    """The NNX twin's values as a PyTorch-layout state dict of numpy arrays."""
    from flax import nnx  # noqa: PLC0415

    flat = dict(nnx.to_flat_state(nnx.state(nnx_model)))
    return {r.torch_name: np.array(r.to_torch(np.asarray(flat[r.nnx_path].get_value())), order="C")
            for r in rules_for(torch_model)}


def canonical_specs(torch_model: nn.Module):
    """The ordered (name, shape, dtype) list both frameworks plan buckets from."""
    from portddp.buckets import ParamSpec  # noqa: PLC0415

    return [ParamSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for n, p in torch_model.named_parameters() if p.requires_grad]


def jax_order(torch_model: nn.Module, nnx_params) -> list[str]:
    """portddp.jax `order=` names for an NNX nnx.Param state, in PyTorch registration order."""
    import jax  # noqa: PLC0415

    by_path = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(nnx_params)[0]:
        keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)
        keys = tuple(k for k in keys if k != "value")
        by_path[keys] = jax.tree_util.keystr(path)
    return [by_path[r.nnx_path] for r in rules_for(torch_model) if r.is_param]


_PERMS = {"same": None, "linear": (1, 0), "conv": (3, 2, 0, 1)}
"""For each layout: the transpose taking the NNX array to the PyTorch one."""


def jax_canonical(torch_model: nn.Module, nnx_params) -> list:
    """portddp.jax `canonical=` entries: each NNX parameter under its PyTorch name and layout,
    in PyTorch registration order -- the plan and flat buckets of the PyTorch twin, exactly."""
    from portddp.jax import Canonical  # noqa: PLC0415

    leaves = jax_order(torch_model, nnx_params)
    params = [r for r in rules_for(torch_model) if r.is_param]
    return [Canonical(leaf, r.torch_name, _PERMS[r.layout]) for leaf, r in zip(leaves, params)]
