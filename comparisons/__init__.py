"""The equivalence harness and the mixed-framework job, each run on every rank as `python -m comparisons.<name>`."""

import atexit
import gc

atexit.register(gc.freeze)  # (runs last: the exit skips collecting torch's heap -- experiments/__init__.py)
