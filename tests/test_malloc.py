"""portddp.malloc: glibc keeps the large blocks a step frees (no page faults on reuse)."""

from __future__ import annotations

import os
import subprocess
import sys

from portddp import malloc

_REALLOCATE = """
import resource, sys
import numpy as np
from portddp import malloc
if sys.argv[1] == "keep":
    malloc.keep_freed_memory()
def faults_of_a_fresh_64mb_array():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(16 << 20, np.float32)  # every page touched
    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    del a
    return after - before
faults_of_a_fresh_64mb_array()
print(min(faults_of_a_fresh_64mb_array() for _ in range(3)))
"""


def test_freed_large_blocks_are_reused_without_page_faults():
    """keep_freed_memory(): a 64 MB block freed and allocated again comes back with its pages
    (XLA's fresh result buffers, PyTorch's fresh gradients every step; each page faulted in and
    zeroed otherwise). The
    control, glibc's defaults, maps and unmaps it: its pages fault again (fewer than one per
    4 KB page where numpy asks for transparent huge pages)."""
    faults = {}
    for mode in ("keep", "system"):
        proc = subprocess.run([sys.executable, "-c", _REALLOCATE, mode], capture_output=True, text=True,
                              env={**os.environ, "PORTDDP_MALLOC": mode}, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        faults[mode] = int(proc.stdout.split()[-1])
    assert faults["system"] > 0 and faults["keep"] <= faults["system"] // 10, faults


def test_keep_freed_memory_is_idempotent():
    malloc.keep_freed_memory()
    malloc.keep_freed_memory()
    assert malloc._TUNED or os.environ.get("PORTDDP_MALLOC") == "system"
