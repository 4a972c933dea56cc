"""The suite's worker programs, each run on every rank as `python -m tests.workers.<name>`."""

import atexit
import gc
import sys

if sys.argv[:1] == ["-m"]:  # (run as a rank: the exit skips collecting torch's heap, lines go out whole --
    atexit.register(gc.freeze)  # experiments/__init__.py)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)
