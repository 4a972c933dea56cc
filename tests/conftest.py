"""Suite-wide: leave no MPICH shared-memory segment behind.

MPICH (ch4, posix shm) unlinks its /dev/shm segments in MPI_Finalize; a job whose rank is SIGKILLed
(tests/test_reliability.py does that on purpose) or that is stopped by portddp's watchdog never
gets there, and each such job would leave a few MB in /dev/shm for good. Tests run one at a time,
so the segments that appear while a test runs are its jobs'; once the test is over its processes
are gone (the tests check that), and the names can go too.
"""

from __future__ import annotations

import glob
import os

import pytest

_SEGMENTS = "/dev/shm/mpich_shm_*"


@pytest.fixture(autouse=True)
def _no_leftover_mpich_segments():
    before = set(glob.glob(_SEGMENTS))
    yield
    for path in set(glob.glob(_SEGMENTS)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove
