"""Overlap speedup against link bandwidth, on the emulated cluster (needs root).

    python -m experiments.bandwidth                      # 2 ranks on 2 hosts, 250 Mbit/s ... unlimited
    python -m experiments.bandwidth --rates 500mbit 1gbit -- --batch 256

For each link rate this starts a fresh cluster (portddp.cluster) and runs the
`overlap` experiment on it (every implementation, overlap on and off; the
arguments after `--` go to it), then merges the runs into one JSON
(results/bandwidth-n<N>-h<H>.json) for the report: the overlap speedup of each
implementation against bandwidth, next to the DDP paper's figures.

`--rates matched` is the rate the main job picks, "a link where communication
takes about as long as the backward pass" (harness.calibrate.matched_rate).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.calibrate import matched_rate, run_overlap
from harness.results import write_result
from portddp import cluster

DEFAULT_RATES = ("250mbit", "500mbit", "1gbit", "2gbit", "5gbit", "unlimited")


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
