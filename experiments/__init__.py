"""portddp's experiments, each run on every rank as `python -m experiments.<name>` (by `portddp run`)."""

import atexit
import gc
import sys

# Run as `python -m experiments.<name>` (sys.argv[0] is "-m" while Python finds the module; not where the
# CLI or pytest imports this package): freeze the heap after every other Python exit handler (portddp's,
# weakref.finalize's; this one was registered first), so the interpreter's last collection skips what was
# alive at exit -- torch's whole heap, ~0.5 s of CPU a process on 2 cores, for nothing. The rule that
# comes with it: nothing in these programs may rely on a collection at exit to flush or close a file
# (each closes its own with `with`). MPI_Finalize (mpi4py's, at the C level) runs later still. The same
# in comparisons/ and tests/workers/, the other packages whose modules are mpirun's ranks.
#
# And each line of output reaches mpirun in one write: unbuffered (PYTHONUNBUFFERED, as the test suite and
# many launchers set it) a print writes its text and its newline apart, and mpirun, which passes on what each
# rank writes as it comes, can then run one rank's line straight into another's. Still flushed at every
# newline, as unbuffered output is (a print with end="" waits for its line's end, or its flush=True).
if sys.argv[:1] == ["-m"]:
    atexit.register(gc.freeze)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)
