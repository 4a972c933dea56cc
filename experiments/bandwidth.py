"""Overlap speedup against link bandwidth, on the emulated cluster (needs root).

    python -m experiments.bandwidth                      # 2 ranks on 2 hosts, 250 Mbit/s ... unlimited
    python -m experiments.bandwidth --rates 500mbit 1gbit -- --batch 256

For each link rate this starts a fresh cluster (portddp.cluster) and runs the
`overlap` experiment on it (every implementation, overlap on and off; the
arguments after `--` go to it), then merges the runs into one JSON
(results/bandwidth-n<N>-h<H>.json) for the report: the overlap speedup of each
implementation against bandwidth, next to the DDP paper's figures.

`matched_rate()` is how the main job picks "a link where communication takes
about as long as the backward pass": one short calibration run on an
unshaped link measures the backward compute time and the bytes a host sends
per step, and the rate is their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import write_result
from portddp import cluster

DEFAULT_RATES = ("250mbit", "500mbit", "1gbit", "2gbit", "5gbit", "unlimited")


def run_overlap(n: int, hosts: int, link: str, out_dir: str, extra: list[str]) -> dict:
    """One `overlap` run on a fresh cluster; its result JSON."""
    code = cluster.run(n, hosts, link, [sys.executable, "-m", "experiments.overlap", "--out-dir", out_dir, *extra])
    if code != 0:
        raise SystemExit(f"the overlap experiment failed on a {hosts}-host cluster at {link} (exit {code})")
    return json.loads((Path(out_dir) / f"overlap-n{n}-h{hosts}-{link}.json").read_text())


def matched_rate(n: int, hosts: int, extra: list[str]) -> tuple[str, dict]:
    """The link rate at which the wire time of one step's gradients equals the backward compute time."""
    with tempfile.TemporaryDirectory(prefix="portddp-calibrate-") as tmp:
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--ranks", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rates", nargs="+", default=list(DEFAULT_RATES), help="link rates ('matched': the "
                        "calibrated rate)")
    parser.add_argument("--out-dir", default="results")
    ns = parser.parse_args(argv)
    cluster.require_root()
    runs, calibration = [], None
    started = time.time()
    for k, rate in enumerate(ns.rates, start=1):
        if rate == "matched":
            rate, calibration = matched_rate(ns.ranks, ns.hosts, extra)
        print(f"bandwidth [{k}/{len(ns.rates)}]: link {rate} ({time.time() - started:.0f} s so far)", flush=True)
        runs.append(run_overlap(ns.ranks, ns.hosts, rate, str(Path(ns.out_dir) / "bandwidth"), extra))
    payload = {"experiment": "bandwidth", "portddp_version": runs[0]["portddp_version"],
               "command": " ".join(["python -m experiments.bandwidth", *sys.argv[1:]]),
               "rates": ns.rates, "calibration": calibration, "runs": runs,
               "path": f"{ns.out_dir}/bandwidth-n{ns.ranks}-h{ns.hosts}.json"}
    print(f"wrote {write_result(payload['path'], payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
