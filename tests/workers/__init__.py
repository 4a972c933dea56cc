"""The suite's worker programs, each run on every rank as `python -m tests.workers.<name>`."""

import atexit
import gc

atexit.register(gc.freeze)  # (runs last: the exit skips collecting torch's heap -- experiments/__init__.py)
