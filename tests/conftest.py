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
A program with a host callback -- every hooked strategy's step -- is never cached by JAX, though.

XLA compiles the suite's programs with LLVM's optimisations off (`--xla_backend_optimization_level=0`,
set here, before any test or job starts JAX; the two tests that give a job XLA_FLAGS of its own
compile at XLA's default): the suite's models are tiny, so compiling is most of a
JAX job's time (the JAX test files ran 193 s -> 150 s), and no test depends on how fast XLA's code
runs -- what they compare is computed by programs compiled alike, within the tolerances they name.
Outside the suite (the benchmark, the experiments, the demo) XLA's defaults hold; a level the caller set wins.

A suite started in the background of a non-interactive shell (`bash .ci/run &`) inherits SIGINT ignored,
and so would every job it starts: the Ctrl-C tests then saw nothing happen. Python's own handler is put
back (the jobs, after exec, get the default action, and Python its handler again).
"""

from __future__ import annotations

import glob
import os
import signal

import pytest

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_SEGMENTS = "/dev/shm/mpich_shm_*"

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


@pytest.fixture(scope="session", autouse=True)
def _bytecode_of_the_sessions_own(tmp_path_factory):
    """Where the caller's shell sets PYTHONDONTWRITEBYTECODE, every rank of every job would compile
    portddp's, the experiments' and the workers' sources again (~0.2 s of CPU a process, a few hundred
    processes): the jobs write and reuse bytecode in a directory of this session's own instead, and
    the working tree stays as the caller wants it."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or "PYTHONPYCACHEPREFIX" in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as env:
        env.delenv("PYTHONDONTWRITEBYTECODE")
        env.setenv("PYTHONPYCACHEPREFIX", str(tmp_path_factory.mktemp("bytecode")))
        yield


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
    """The segments that appeared during the test and that no process uses any more. (Until 2026-12-07
    every new one went: also those of another MPI job running beside the suite, whose ranks were
    meeting in MPI_Init -- that job then hung there for good, its ranks in two segments of one name:
    watchdog.mpich_segments_in_use.)"""
    before = set(glob.glob(_SEGMENTS))
    yield
    if new := set(glob.glob(_SEGMENTS)) - before:
        from portddp.watchdog import mpich_segments_in_use  # noqa: PLC0415

        for path in new - mpich_segments_in_use():
            try:
                os.unlink(path)
            except OSError:
                pass  # gone already, or not ours to remove
