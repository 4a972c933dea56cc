"""Communication hooks for portddp.jax: the same idea and names as portddp.torch.hooks.

A hook is `hook(state, bucket) -> Handle` (portddp.transport.Handle); once the
handle is done, `bucket.buffer()` holds the reduced flat gradients. Gradients
reach the bucket undivided when a hook is registered: the hook divides, before
the sum, so half precision sums do not overflow.

    ddp.register_comm_hook(None, fp16_compress_hook)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from portddp.transport import Handle

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook"]


def allreduce_hook(state, bucket) -> Handle:
    """Mean over ranks: divide, then sum. `ddp.register_comm_hook(None, allreduce_hook)`"""
    buffer = bucket.buffer()
    np.multiply(buffer, 1.0 / bucket.world_size, out=buffer, casting="unsafe")
    return bucket.allreduce(buffer)


def _compress_hook(bucket, dtype) -> Handle:
    buffer = bucket.buffer()
    # Cast, then divide before the sum: a sum of undivided float16 gradients overflows first.
    compressed = buffer.astype(dtype) / dtype(bucket.world_size)

    def decompress(_handle):  # on the comm thread, before the handle reports done
        buffer[...] = compressed.astype(buffer.dtype)

    return bucket.allreduce(compressed, on_done=decompress)


def fp16_compress_hook(state, bucket) -> Handle:
    """Reduce in float16 (half the bytes). `ddp.register_comm_hook(None, fp16_compress_hook)`"""
    return _compress_hook(bucket, np.float16)


def bf16_compress_hook(state, bucket) -> Handle:
    """Reduce in bfloat16: float32's range, float16's bytes. `ddp.register_comm_hook(None, bf16_compress_hook)`"""
    return _compress_hook(bucket, ml_dtypes.bfloat16)


def noop_hook(state, bucket) -> Handle:
    """No communication at all: the headroom measurement (gradients stay local, undivided).
    `ddp.register_comm_hook(None, noop_hook)`"""
    handle = Handle()
    handle.done_ns = handle.launch_ns
    handle._event.set()
    return handle
