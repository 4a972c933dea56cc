"""portddp's experiments, each run on every rank as `python -m experiments.<name>` (by `portddp run`)."""

import atexit
import gc

# Registered before any other exit handler, so it runs after all of them (MPI_Finalize among them): the
# interpreter's last collection then skips what was alive at exit -- torch's whole heap, ~0.5 s of CPU a
# process on 2 cores, for nothing: these programs close their files themselves. (Also comparisons/ and
# tests/workers/, the other packages whose modules are mpirun's ranks.)
atexit.register(gc.freeze)
