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

from harness.calibrate import OverlapConfig, matched_rate, run_overlap
from harness.config import parse_config
from harness.results import write_result
from portddp import cluster

DEFAULT_RATES = ("250mbit", "500mbit", "1gbit", "2gbit", "5gbit", "unlimited")


def check(ns, extra: list[str]) -> None:
    """Refuse the job and every rate before the first cluster is made, in one line naming the value
    and the fix: a typo in the last of six rates would otherwise end the sweep after the others ran."""
    try:
        cluster.check_job(ns.ranks, ns.hosts)
        for rate in ns.rates:
            if rate != "matched":
                cluster.check_rate(rate)
    except ValueError as e:
        raise SystemExit(f"experiments.bandwidth: {e}") from None
    # The overlap experiment's own options, once, here: a typo is refused before the first cluster.
    parse_config(OverlapConfig, extra, prog="python -m experiments.bandwidth ... --")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bandwidth", description=__doc__.split("\n\n")[0],
        usage="%(prog)s [-h] [-n RANKS] [--hosts HOSTS] [--rates RATE ...] [--out-dir OUT_DIR] [-- OVERLAP_ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="arguments after `--` go to every run of the overlap experiment, e.g.\n"
               "  python -m experiments.bandwidth --rates 500mbit 1gbit -- --batch 2048 --rounds 2\n"
               "(its options: python -m experiments.overlap --help)")
    parser.add_argument("-n", "--ranks", type=int, default=2, help="MPI ranks in all, spread evenly over the hosts "
                        "(a multiple of --hosts; default: 2)")
    parser.add_argument("--hosts", type=int, default=2, help=f"emulated hosts, 1 to {cluster.MAX_HOSTS} (default: 2); "
                        "a fresh cluster for each rate")
    parser.add_argument("--rates", nargs="+", default=list(DEFAULT_RATES), metavar="RATE",
                        help="link rates per host and direction, with their unit (250mbit, 2.5gbit); unlimited: no "
                        "shaping; matched: the calibrated rate where wire time = backward compute (default: "
                        + " ".join(DEFAULT_RATES) + ")")
    parser.add_argument("--out-dir", default="results", help="where the merged JSON goes (default: results; "
                        "each run's own under OUT_DIR/bandwidth)")
    ns = parser.parse_args(argv)
    check(ns, extra)
    cluster.require_root()
    try:
        return sweep(ns, extra)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP inside a run's cluster (which was removed)
        print("experiments.bandwidth: interrupted; the cluster of the run under way was removed", file=sys.stderr,
              flush=True)
        return getattr(e, "exit_code", 130)


def sweep(ns, extra: list[str]) -> int:
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
