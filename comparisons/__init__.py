"""The equivalence harness and the mixed-framework job, each run on every rank as `python -m comparisons.<name>`."""

import atexit
import gc
import sys

if sys.argv[:1] == ["-m"]:  # (run as a rank: the exit skips collecting torch's heap -- experiments/__init__.py)
    atexit.register(gc.freeze)
