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


def run_case(rank: int, fn, *args) -> None:
    """Run a bad-input case: print `PORTDDP_ERROR rank=<r> <message>` and exit 3 if it raises."""
    try:
        fn(*args)
    except Exception as e:  # the message is what is under test
        # one write() per rank: the line is not split when mpirun merges the ranks' output
        os.write(1, f"PORTDDP_ERROR rank={rank} {type(e).__name__}: {e}\n".encode())
        sys.exit(3)
    os.write(1, f"PORTDDP_NO_ERROR rank={rank}\n".encode())
