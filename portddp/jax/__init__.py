"""portddp on JAX: `DistributedDataParallel` and its comm hooks.

Mirrors `portddp.torch`: the same public names, so the two can be read side by side.
"""

from portddp.jax.ddp import JOINED, STRATEGIES, Canonical, DistributedDataParallel, GradBucket, Joined
from portddp.jax.hooks import (PowerSGDState, allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook,
                               powerSGD_hook)

__all__ = [
    "Canonical",
    "JOINED",
    "Joined",
    "DistributedDataParallel",
    "GradBucket",
    "PowerSGDState",
    "STRATEGIES",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "noop_hook",
    "powerSGD_hook",
]
