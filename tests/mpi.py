"""Launch `mpirun -n K python -m <module>` from a test, with a timeout, so a
hang fails the test instead of stalling the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BIN = Path(sys.executable).parent


def mpirun_path() -> str:
    found = shutil.which("mpirun", path=str(_BIN)) or shutil.which("mpirun")
    if found is None:
        pytest.fail("mpirun not found: install the project (`pip install -e .[dev]` brings the mpich wheel)")
    return found


def run(n: int | None, module: str, *args: str, timeout: float = 240, env: dict | None = None):
    """Run `python -m module args` under `mpirun -n n` (plain python when n is None)."""
    cmd = [sys.executable, "-m", module, *args]
    if n is not None:
        cmd = [mpirun_path(), "-n", str(n), *cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (a hang?)\n{out[-3000:]}")
