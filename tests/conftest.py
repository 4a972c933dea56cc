"""Suite-wide: leave no MPICH shared-memory segment behind; share JAX's compiled programs between jobs.

MPICH (ch4, posix shm) unlinks its /dev/shm segments in MPI_Finalize; a job whose rank is SIGKILLed
(tests/test_reliability.py does that on purpose) or that is stopped by portddp's watchdog never
gets there, and each such job would leave a few MB in /dev/shm for good. Tests run one at a time,
so the segments that appear while a test runs are its jobs'; once the test is over its processes
are gone (the tests check that), and the names can go too.

Many jobs of the suite compile the same XLA programs (a worker's two separate jobs, the same model at
several world sizes): JAX's persistent compilation cache, in a directory of this session's own, lets
a later process load what an earlier one compiled instead of compiling it again. The executables are
the ones XLA built; tracing still runs in every process. A cache the caller set is left alone.
"""

from __future__ import annotations

import glob
import os

import pytest

_SEGMENTS = "/dev/shm/mpich_shm_*"


@pytest.fixture(scope="session", autouse=True)
def _jax_compilation_cache(tmp_path_factory):
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax-compilation-cache")))
        env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # (default 1 s: a test's programs are small)
        yield


@pytest.fixture(autouse=True)
def _no_leftover_mpich_segments():
    before = set(glob.glob(_SEGMENTS))
    yield
    for path in set(glob.glob(_SEGMENTS)) - before:
        try:
            os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove
