"""Result JSON: written atomically by rank 0, read back with the version checked.

Every experiment writes one JSON (`results/<experiment>-n<N>[-h<H>-<rate>].json`)
holding its command, config, world, environment and rows; the report reads
nothing else.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

__all__ = ["write_result", "read_result", "environment", "median", "out_dir_problem"]


def out_dir_problem(path: str | os.PathLike, flag: str) -> str | None:
    """Why `path` cannot be (made into) an output directory, in one line naming `flag` and the fix,
    or None: checked before a run starts, not when its results are written at the end."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == path else f"lies under {p}, which is a file"
                return f"{flag} {path} {what}: pass a directory (made if missing)"
            if not os.access(p, os.W_OK | os.X_OK):
                return f"{flag} {path}: {p} is not writable: pass a directory you may write"
            return None
    return None


def write_result(path: str | os.PathLike, payload: dict) -> Path:
    """Write `payload` as JSON to `path` (a temporary file renamed over it: never half a file), stamped
    with when it was written (`written_utc`, unless it has one: the report dates each command by it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    stamped = {"written_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **payload}
    tmp.write_text(json.dumps(stamped, indent=2, default=str))
    tmp.replace(path)
    return path


def read_result(path: str | os.PathLike, version: str | None = None) -> dict:
    """A result JSON; with `version`, refused (ValueError naming the file) if another portddp wrote it."""
    payload = json.loads(Path(path).read_text())
    if version is not None and payload.get("portddp_version") != version:
        raise ValueError(f"{path}: written by portddp {payload.get('portddp_version')}, this is {version}; "
                         f"rerun the experiment")
    return payload


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def environment() -> dict:
    """The software and machine a result was measured on."""
    import numpy  # noqa: PLC0415
    import torch  # noqa: PLC0415

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        # The CPUs this rank may run on (`portddp run` binds each rank to its own: mpirun -bind-to user:...).
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
    }
