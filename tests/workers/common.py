"""Helpers shared by the multi-rank test workers."""

from __future__ import annotations

import json
import os
import sys


def report(rank: int, name: str, **fields) -> None:
    """One JSON line per scenario into $PORTDDP_RESULTS/rank<r>.jsonl (stdout without it)."""
    line = json.dumps({"scenario": name, "rank": rank, **fields})
    out = os.environ.get("PORTDDP_RESULTS")
    if out:
        with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
            f.write(line + "\n")
    else:
        print(line, flush=True)


def run_cases(rank: int, fn, cases: list[str], *args) -> None:
    """Several bad-input cases in one job, one after another (one launch instead of one per case:
    starting two ranks with torch and JAX costs seconds): `PORTDDP_CASE <case> rank=<r>` and then
    `PORTDDP_ERROR <message>` (newlines as \\n) or `PORTDDP_NO_ERROR` per case, then a barrier.
    Only for cases that fail alike on every rank and leave no collective half done."""
    from mpi4py import MPI  # noqa: PLC0415

    for case in cases:
        try:
            fn(case, *args)
            outcome = "PORTDDP_NO_ERROR"
        except Exception as e:  # the message is what is under test
            outcome = "PORTDDP_ERROR " + f"{type(e).__name__}: {e}".replace("\n", "\\n")
        os.write(1, f"PORTDDP_CASE {case} rank={rank} {outcome}\n".encode())
        MPI.COMM_WORLD.Barrier()


def main(rank: int, fn, argv: list[str]) -> None:
    """A bad-input worker's command line: `CASE [ARGS...]`, or `--cases CASE,CASE,... [ARGS...]`."""
    if argv[:1] == ["--cases"]:
        run_cases(rank, fn, argv[1].split(","), *argv[2:])
    else:
        run_case(rank, fn, *argv)


def run_case(rank: int, fn, *args) -> None:
    """Run a bad-input case: print `PORTDDP_ERROR rank=<r> <message>` and exit 3 if it raises."""
    try:
        fn(*args)
    except Exception as e:  # the message is what is under test
        # one write() per rank: the line is not split when mpirun merges the ranks' output
        os.write(1, f"PORTDDP_ERROR rank={rank} {type(e).__name__}: {e}\n".encode())
        sys.exit(3)
    os.write(1, f"PORTDDP_NO_ERROR rank={rank}\n".encode())
