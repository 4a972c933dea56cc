"""`portddp`: run experiments, compare implementations, build the report.

    portddp run overlap -n 2            # mpirun -n 2 python -m experiments.overlap
    portddp run bucket_sweep -n 2 -- --caps 1 16
    portddp compare --model gpt -n 2    # mpirun -n 2 python -m comparisons.equivalence --model gpt
    portddp mixed -n 3                  # mpirun -n 3 python -m comparisons.mixed
    portddp report                      # python -m comparisons.report
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

EXPERIMENTS = ("bench", "soak", "overlap", "bucket_sweep", "no_sync", "compression", "scaling", "torch_ddp", "jax_ddp")


def _mpirun(n: int, module: str, args: list[str]) -> int:
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun not found: install portddp's dependencies (the mpich wheel provides it)")
    cmd = [mpirun, "-n", str(n), sys.executable, "-m", module, *args]
    print("$ " + " ".join(cmd[:3] + ["python"] + cmd[4:]), flush=True)
    return subprocess.call(cmd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="portddp", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment under mpirun")
    run.add_argument("experiment", choices=EXPERIMENTS)
    for p in (run, sub.add_parser("compare", help="the equivalence harness under mpirun"),
              sub.add_parser("mixed", help="the mixed PyTorch + JAX job under mpirun")):
        p.add_argument("-n", "--ranks", type=int, default=2, help="number of ranks (mpirun -n); "
                       "every other argument is passed on (see the module's --help)")
    sub.add_parser("report", help="build the report from result JSON (--results DIR --out DIR)")
    ns, extra = parser.parse_known_args(argv)
    args = [a for a in extra if a != "--"]
    if ns.command == "run":
        return _mpirun(ns.ranks, f"experiments.{ns.experiment}", args)
    if ns.command == "compare":
        return _mpirun(ns.ranks, "comparisons.equivalence", args)
    if ns.command == "mixed":
        return _mpirun(ns.ranks, "comparisons.mixed", args)
    from comparisons.report import main as report_main  # noqa: PLC0415

    return report_main(args)


if __name__ == "__main__":
    sys.exit(main())
