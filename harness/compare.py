"""What "the same training" means, as numbers: the deviation measure and its bounds (DESIGN.md).

    deviation(got, want)     # max over tensors of max|a - b| / max(1, max|b|)
"""

from __future__ import annotations

__all__ = ["BOUNDS", "SAME_FRAMEWORK_BOUND", "deviation", "worst_deviation"]

BOUNDS = {"float64": 1e-10, "float32": 1e-3}
"""Against the reference. float64: DESIGN.md. float32: measured, not assumed -- after 10 AdamW steps on
gpt at n=3, jax-ref (one JAX process, no communication at all) is 2.3e-4 from torch-ref: Adam divides by
sqrt(v) and so amplifies the two frameworks' different rounding. The bound covers that with a margin."""
SAME_FRAMEWORK_BOUND = {"float64": 1e-10, "float32": 1e-4}
"""Against the own framework's single-process reference: what DDP itself may add (measured <= 2e-5)."""


def deviation(got: dict, want: dict) -> float:
    """Worst relative difference over same-named arrays: max|a - b| / max(1, max|b|)."""
    import numpy as np  # noqa: PLC0415

    if set(got) != set(want):
        raise RuntimeError(f"tensor names differ: {sorted(set(got) ^ set(want))[:5]}")
    return max(float(np.abs(got[k] - want[k]).max() / max(1.0, float(np.abs(want[k]).max()))) for k in want)


def worst_deviation(losses: list, trace: list, reference: tuple) -> dict:
    """Worst loss / gradient / parameter deviation over the steps from a (losses, [StepTrace]) reference."""
    dev = {"loss": 0.0, "grads": 0.0, "params": 0.0}
    for k, t in enumerate(trace):
        dev["loss"] = max(dev["loss"], abs(losses[k] - reference[0][k]) / max(1.0, abs(reference[0][k])))
        dev["grads"] = max(dev["grads"], deviation(t.grads, reference[1][k].grads))
        dev["params"] = max(dev["params"], deviation(t.params, reference[1][k].params))
    return dev
