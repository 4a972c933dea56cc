"""glibc's handling of large freed blocks, which a CPU training step meets every iteration.

A step frees and allocates again tens of MB of gradients (zero_grad(set_to_none=True) in
PyTorch; XLA's fresh result buffers in portddp.jax's hooked strategy). By default glibc serves
blocks that large with mmap and unmaps them when freed (or trims the top of the heap), so
every step faults every page in again and the kernel zeroes it -- time that lands on
whichever step touches the memory first (MKL's matmul writing a fresh gradient, a bucket
copy), not on the code that freed it.
"""

from __future__ import annotations

import ctypes

from portddp import env

__all__ = ["keep_freed_memory"]

_TUNED = False


def keep_freed_memory() -> None:
    """Have glibc keep the large blocks this process frees instead of returning them to the kernel.

    mallopt(M_MMAP_MAX = 0) serves large blocks from the heap, mallopt(M_MMAP_THRESHOLD = 32 MB)
    keeps blocks below 32 MB on the heap where M_MMAP_MAX is not honoured, mallopt(M_TRIM_THRESHOLD
    = 2 GB) keeps freed heap memory mapped. The cost: the process keeps its peak heap size.
    Process-wide, once; PORTDDP_MALLOC=system leaves glibc's defaults. A no-op where the C
    library is not glibc.

    portddp.jax's hooked strategy calls it when it is built: every hooked step hands each
    gradient to the host and back in fresh buffers (benchmark MLP, one process: 51 -> 39 ms per
    step; a 102 MB leaf: 85-88 ms and 25000 page faults per step -> 37-54 ms and 0-5000 faults).
    The benchmark harness calls it before it builds any variant, so every row runs with it. A
    PyTorch job on CPU that zeroes its gradients with set_to_none=True may call it too (gpt, one
    process, minor faults per step: torch-local 445 -> 0, native DDP 149 -> 41). portddp.torch
    does not call it itself: there the fresh buffers are autograd's, made alike with native DDP
    or with no DDP at all, so changing the process's allocator is the script's choice, not the
    wrapper's (portddp.jax hooked's fresh buffers are its own callbacks').
    """
    global _TUNED
    if _TUNED or env.choice("PORTDDP_MALLOC", "keep", ("keep", "system")) == "system":
        return
    _TUNED = True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, (1 << 31) - 1)
