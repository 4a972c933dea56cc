"""Communication hooks: how a bucket's flat gradient buffer gets reduced.

A hook is `hook(state, bucket) -> torch.futures.Future` whose value is the
reduced flat tensor (native DDP's contract). Register one with
`ddp.register_comm_hook(state, hook)`; without one, the reducer divides while
packing and all-reduces (what `allreduce_hook` does, minus one pass).

When a hook is registered, gradients reach the bucket *undivided*: dividing by
the world size is the hook's job, and it does so before the sum, so half
precision sums do not overflow.

    ddp.register_comm_hook(None, fp16_compress_hook)
"""

from __future__ import annotations

import torch

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook"]


def allreduce_hook(state, bucket) -> torch.futures.Future:
    """Mean over ranks: divide, then sum. `ddp.register_comm_hook(None, allreduce_hook)`"""
    return bucket.allreduce(bucket.buffer().div_(bucket.world_size))


def _compress_hook(bucket, dtype: torch.dtype) -> torch.futures.Future:
    buffer = bucket.buffer()
    # Cast, then divide before the sum: a sum of undivided float16 gradients overflows first.
    compressed = buffer.to(dtype).div_(bucket.world_size)

    def decompress(fut):
        return buffer.copy_(fut.value())

    return bucket.allreduce(compressed).then(decompress)


def fp16_compress_hook(state, bucket) -> torch.futures.Future:
    """Reduce in float16 (half the bytes). `ddp.register_comm_hook(None, fp16_compress_hook)`"""
    return _compress_hook(bucket, torch.float16)


def bf16_compress_hook(state, bucket) -> torch.futures.Future:
    """Reduce in bfloat16: float32's range, float16's bytes. `ddp.register_comm_hook(None, bf16_compress_hook)`"""
    return _compress_hook(bucket, torch.bfloat16)


def noop_hook(state, bucket) -> torch.futures.Future:
    """No communication at all: the headroom measurement (gradients stay local, undivided).
    `ddp.register_comm_hook(None, noop_hook)`"""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
