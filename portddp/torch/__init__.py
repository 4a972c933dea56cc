"""portddp on PyTorch: `DistributedDataParallel` and its comm hooks.

Mirrors `portddp.jax`: the same public names, so the two can be read side by side.
"""

from portddp.torch import dropin
from portddp.torch.ddp import DistributedDataParallel, GradBucket
from portddp.torch.hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook

__all__ = [
    "DistributedDataParallel",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
    "noop_hook",
]

dropin.install()
dropin.recognise_in_checkpoints(DistributedDataParallel)
