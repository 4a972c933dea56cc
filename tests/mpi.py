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
    return _run([sys.executable, "-m", module, *args], n, timeout, env)


def run_script(n: int | None, path, *args: str, timeout: float = 240, env: dict | None = None):
    """Run `python path args` (a script a test wrote) under `mpirun -n n`, as run() does a module."""
    return _run([sys.executable, str(path), *args], n, timeout, env)


def _run(cmd: list, n: int | None, timeout: float, env: dict | None):
    if n is not None:
        cmd = [mpirun_path(), "-n", str(n), *cmd]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = ((x or b"").decode(errors="replace") if isinstance(x, bytes) else (x or "")
                    for x in (e.stdout, e.stderr))
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s (a hang?)\n{out[-3000:]}\n{err[-3000:]}")


def collect(n: int, module: str, out: Path, *args: str) -> dict:
    """Run a results-writing worker on n ranks (plain python for n=1); return
    {(scenario, rank): row} from the JSON lines every rank wrote."""
    proc = run(None if n == 1 else n, module, *args, env={"PORTDDP_RESULTS": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(row["scenario"], row["rank"]): row for rank_rows in rows(proc, out, n) for row in rank_rows}


def rows(proc, out: Path, n: int) -> list[list[dict]]:
    """Every rank's JSON lines from $PORTDDP_RESULTS=out, rank by rank. A rank that wrote none fails
    the test with the job's exit status and output (a job that exits 0 without a rank's results
    is a bug of its own, not a missing file)."""
    import json  # noqa: PLC0415

    missing = [r for r in range(n) if not (out / f"rank{r}.jsonl").exists()]
    if missing:
        pytest.fail(f"ranks {missing} wrote no results to {out} (exit status {proc.returncode}; there: "
                    f"{sorted(p.name for p in out.iterdir())})\nstdout:\n{proc.stdout[-3000:]}\n"
                    f"stderr:\n{proc.stderr[-3000:]}")
    return [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(n)]


def each_rank(results, scenario: str):
    """(n, [row of rank 0, row of rank 1, ...]) for one scenario; all ranks must have reported."""
    n, rows = results
    got = [rows.get((scenario, r)) for r in range(n)]
    assert all(got), f"{scenario}: missing from ranks {[r for r, g in enumerate(got) if g is None]}"
    return n, got


def errors_on_every_rank(proc, n: int, pattern: str) -> None:
    """Every rank printed `PORTDDP_ERROR rank=<r> <message>` and the message matches."""
    import re  # noqa: PLC0415

    errors = dict(re.findall(r"PORTDDP_ERROR rank=(\d+) (.*)", proc.stdout))
    assert sorted(errors) == [str(r) for r in range(n)], proc.stdout + proc.stderr[-2000:]
    for rank, message in errors.items():
        assert re.search(pattern, message), f"rank {rank}: {message}"


def run_cases(n: int, module: str, cases: list[str], *args: str, timeout: float = 120) -> dict:
    """Run several bad-input cases of a worker in one job (`--cases`, tests/workers/common.py);
    return {case: {rank: outcome}}, the outcome `PORTDDP_ERROR <message>` or `PORTDDP_NO_ERROR`.
    A case that fails on some ranks only leaves the others waiting: the stall inspector names
    them after 20 s (PORTDDP_STALL_S), well inside the job's timeout."""
    import re  # noqa: PLC0415

    proc = run(n, module, "--cases", ",".join(cases), *args, timeout=timeout, env={"PORTDDP_STALL_S": "20"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes: dict = {}
    for case, rank, outcome in re.findall(r"PORTDDP_CASE (\S+) rank=(\d+) (.*)", proc.stdout):
        outcomes.setdefault(case, {})[int(rank)] = outcome
    return outcomes


def case_errors_on_every_rank(outcomes: dict, case: str, n: int, pattern: str) -> None:
    """Like errors_on_every_rank, for one case of run_cases."""
    import re  # noqa: PLC0415

    got = outcomes.get(case, {})
    assert sorted(got) == list(range(n)), f"{case}: outcomes of ranks {sorted(got)}: {got}"
    for rank, outcome in got.items():
        assert outcome.startswith("PORTDDP_ERROR ") and re.search(pattern, outcome), f"{case}, rank {rank}: {outcome}"
