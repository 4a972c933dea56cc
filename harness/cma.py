"""Reading another process's memory: Linux cross-memory attach (`process_vm_readv`), for the
probes of experiments/cma_probe.py and experiments/cma_step_probe.py (issue 16: could the hooked
strategy read its peer's gradients instead of packing them into shared memory?).

    read_remote(pid, address, into)    # into.nbytes bytes at `address` in process `pid`

Needs ptrace permission over `pid` (same user; Yama ptrace_scope 0, or 1 with PR_SET_PTRACER).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

BLOCK = 64 * 1024
"""float32 elements per process_vm_readv call in the probes (256 KB: stays in cache)."""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                                   ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def read_remote(pid: int, address: int, into: np.ndarray) -> None:
    """Copy into.nbytes bytes at `address` in process `pid` into `into` (C-contiguous)."""
    local, remote = _IoVec(into.ctypes.data, into.nbytes), _IoVec(address, into.nbytes)
    if _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != into.nbytes:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv of {into.nbytes} bytes from pid {pid}: {os.strerror(err)}")
