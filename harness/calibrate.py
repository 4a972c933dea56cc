"""The emulated cluster's "matched" link rate: where one step's gradients take as long on the
wire as the backward pass computes (`portddp run overlap --hosts 2 --link matched`).

    rate, facts = matched_rate(n=2, hosts=2, extra=["--batch", "2048"])    # e.g. "600mbit"
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

from harness.runner import ExperimentConfig
from portddp import cluster

__all__ = ["OverlapConfig", "run_overlap", "matched_rate"]


@dataclasses.dataclass
class OverlapConfig(ExperimentConfig):
    """The overlap experiment's options (experiments/overlap.py), here so that the runs started from the
    harness -- the calibration, the bandwidth sweep -- can check them before a cluster is made."""

    impls: tuple[str, ...] = dataclasses.field(
        default=("native", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled", "torch-local", "jax-local"),
        metadata={"help": "implementations"})
    bucket_cap_mb: float = dataclasses.field(default=4.0, metadata={"help": "bucket cap (MB): several buckets"})


def run_overlap(n: int, hosts: int, link: str, out_dir: str, extra: list[str]) -> dict:
    """One `overlap` experiment on a fresh cluster; its result JSON. `out_dir` is where it goes,
    whatever `extra` says: the script's own arguments may hold an --out-dir of their own, and
    the calibration must neither write into the user's results nor look for its JSON there
    (argparse keeps an option's last value: ours comes last)."""
    code = cluster.run(n, hosts, link, [sys.executable, "-m", "experiments.overlap", *extra, "--out-dir", out_dir])
    if code != 0:
        raise SystemExit(f"the overlap experiment failed on a {hosts}-host cluster at {link} (exit {code})")
    return json.loads((Path(out_dir) / f"overlap-n{n}-h{hosts}-{cluster.rate_name(link)}.json").read_text())


def matched_rate(n: int, hosts: int, extra: list[str]) -> tuple[str, dict]:
    """One short calibration run on an unshaped link measures the backward compute time and the
    bytes a host sends per step; the rate is their ratio (rounded to 10 Mbit/s)."""
    print("calibration: --link matched: first a short run on an unshaped link (torch-c10d, 2 rounds) to measure "
          "the backward pass and the bytes a host sends per step; its result is discarded", flush=True)
    # (the pid in its name: after a kill -9, the next cluster's start removes it -- cluster.cleanup_stale)
    with tempfile.TemporaryDirectory(prefix=f"{cluster.CALIBRATE_DIR}{os.getpid()}-") as tmp:
        payload = run_overlap(n, hosts, "unlimited", tmp, [*extra, "--impls", "torch-c10d", "--rounds", "2",
                                                           "--steps-per-round", "3"])
    row = next(r for r in payload["rows"] if r["label"] == "torch-c10d (no overlap)")
    backward_s = row["metrics"]["backward_compute_time"]
    wire_bytes = row["wire_bytes_per_step"]
    mbit = max(10, round(wire_bytes * 8 / backward_s / 1e6 / 10) * 10)
    facts = {"backward_compute_s": backward_s, "wire_bytes_per_step": wire_bytes, "rate_mbit": mbit}
    print(f"calibration: backward compute {backward_s * 1e3:.1f} ms, {wire_bytes / 1e6:.1f} MB per host per step "
          f"-> link {mbit} Mbit/s (wire time = backward compute)", flush=True)
    return f"{mbit}mbit", facts
