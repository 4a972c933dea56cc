"""`portddp`: run experiments, compare implementations, build the report.

    portddp run overlap -n 2            # mpirun -n 2 python -m experiments.overlap
    portddp run bucket_sweep -n 2 -- --caps 1 16
    portddp compare -n 2 -- --model gpt # mpirun -n 2 python -m comparisons.equivalence --model gpt
    portddp mixed -n 3                  # mpirun -n 3 python -m comparisons.mixed
    portddp report                      # python -m comparisons.report
    portddp cluster -n 4 --hosts 2 --link 1gbit -- python train.py   # an emulated cluster (root)
    portddp run overlap -n 2 --hosts 2 --link 500mbit                 # an experiment on it
    portddp simulate results/overlap-n2-h2-1gbit.json --world 64 --link 10gbit --bucket-cap 4 --hop-latency-us 10

run, compare, mixed and report start the entry points of the source checkout
(experiments/, comparisons/ and the harness/ below them), which are not
installed with the library: they need portddp installed from a clone
(`pip install -e .`, as scripts/bootstrap.sh does).
"""
# (This module imports none of those entry points until a subcommand needs one.)

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

EXPERIMENTS = ("bench", "soak", "overlap", "bucket_sweep", "no_sync", "compression", "scaling")
ON_THEIR_OWN = {"bandwidth": "an overlap run per link rate, each on an emulated cluster",
                "simulate_validate": "the validation grid's overlap runs on emulated clusters"}
"""experiments/ modules that launch runs themselves (README: Layout)."""


def _checkout() -> Path:
    """The source checkout holding experiments/, comparisons/ and harness/, put on this process's
    path and its children's (PYTHONPATH), so that `portddp run` works from any directory."""
    root = Path(__file__).resolve().parents[1]
    if not all((root / d / "__init__.py").is_file() for d in ("experiments", "comparisons", "harness")):
        raise SystemExit(f"portddp: the experiments, comparisons and harness are not installed with the library; "
                         f"{root} holds none: install portddp from a clone (`pip install -e .` in it, or "
                         f"`bash scripts/bootstrap.sh`)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, paths)])
    return root


def binding(n: int, bind: str = "cores", mpirun: str | None = None) -> list[str]:
    """mpirun's arguments that give each of `n` ranks its own share of the physical cores this
    process may use (`-bind-to user:0+1,2+3`: explicit CPU lists, so a taskset or cgroup
    restriction and hyperthread siblings are respected), when `bind` is "cores", the ranks fit,
    and `mpirun` is MPICH's (Hydra); else none.

    Unbound, the OS moves each rank's threads (compute, comm thread, Gloo's) across all
    cores, and on a machine whose cores all compute one rank's comm thread preempts the
    other rank's backward pass: on 2 cores, torch MPI with gradient_as_bucket_view went
    from 1.22-1.29 to 1.14-1.23 x its limit bound (docs/performance-log.md). Open MPI binds
    small jobs to cores by default; MPICH's mpirun does not."""
    if n < 1:
        raise ValueError(f"n={n} ranks: pass 1 or more")
    if bind == "none" or not hasattr(os, "sched_getaffinity") or not _is_hydra(mpirun):
        return []
    cores = _physical_cores(os.sched_getaffinity(0))
    k = len(cores) // n
    if k == 0:
        return []
    ranks = ["+".join(str(cpu) for core in cores[r * k:(r + 1) * k] for cpu in core) for r in range(n)]
    return ["-bind-to", "user:" + ",".join(ranks)]


def _physical_cores(cpus) -> list[tuple[int, ...]]:
    """The logical CPUs of `cpus` grouped by physical core (hyperthread siblings together), in
    order; each CPU its own core where Linux does not say."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        cores.setdefault(siblings, []).append(cpu)
    return [tuple(c) for c in cores.values()]


def _is_hydra(mpirun: str | None) -> bool:
    """Is this MPICH's mpirun (Hydra), whose -bind-to user:... binding() speaks?"""
    if mpirun is None:
        return False
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in out.stdout


def _mpirun(n: int, module: str, args: list[str], hosts: int | None = None, link: str = "1gbit",
            fallback: bool = False, bind: str = "cores") -> int:
    if "-h" in args or "--help" in args:  # the module's help, once (not once per rank, nor on a cluster)
        return subprocess.call([sys.executable, "-m", module, *args])
    if hosts:
        from portddp import cluster  # noqa: PLC0415

        why = cluster.unavailable()
        if why is not None:
            if not fallback:
                raise SystemExit(f"portddp: no emulated cluster here: {why}")
            print(f"portddp: no emulated cluster here ({why}): running on this machine's loopback instead",
                  flush=True)
            os.environ["PORTDDP_CLUSTER_UNAVAILABLE"] = why
            return _mpirun(n, module, args, bind=bind)
        if link == "matched":
            try:
                link, facts = importlib.import_module("harness.calibrate").matched_rate(n, hosts, args)
                os.environ["PORTDDP_CALIBRATION"] = json.dumps(facts)  # (the run's JSON and report show it)
            except KeyboardInterrupt as e:  # (Ctrl-C, or SIGTERM/SIGHUP inside a calibration cluster: it was removed)
                print("portddp: interrupted while measuring the matched link rate; nothing is left behind",
                      file=sys.stderr, flush=True)
                return getattr(e, "exit_code", 130)

        print(f"$ portddp cluster -n {n} --hosts {hosts} --link {link} -- python -m {module} {' '.join(args)}",
              flush=True)
        return cluster.main(["-n", str(n), "--hosts", str(hosts), "--link", link, "--", sys.executable, "-m",
                             module, *args])
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("mpirun not found: install portddp's dependencies (the mpich wheel provides it)")
    bound = binding(n, bind, mpirun)
    os.environ["PORTDDP_MPIRUN_BIND"] = " ".join(bound)  # (recorded in the results: harness.runner)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n > cpus:
        print(f"portddp: note: {n} ranks on {cpus} CPU(s): ranks share cores, so their compute and communication "
              "compete and times measure that contention (correctness is unaffected)", file=sys.stderr, flush=True)
    cmd = [mpirun, *bound, "-n", str(n), sys.executable, "-m", module, *args]
    print("$ " + " ".join(["mpirun", *cmd[1:]]).replace(sys.executable, "python"), flush=True)
    return _call(cmd)


def _call(cmd: list[str]) -> int:
    """Run mpirun and wait. Ctrl-C reaches mpirun too (the terminal signals the whole foreground
    group), which stops its ranks: wait for that (30 s at most, or until a second Ctrl-C), then
    stop it ourselves, and exit 130 with one line instead of a traceback."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=30)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except (KeyboardInterrupt, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        print("portddp: interrupted; mpirun and its ranks have stopped", file=sys.stderr, flush=True)
        return 130


def _preflight(command: str, module: str, args: list[str]) -> None:
    """Parse the module's own options here, once, before mpirun or a cluster starts: a misspelled
    option (`--hots 2`) or a bad value is refused in one line, not once per rank after the launch."""
    if args[:1] == ["--summarize"]:  # (soak's other mode: no config to parse)
        return
    from harness.config import parse_config  # noqa: PLC0415
    from harness.runner import ExperimentConfig  # noqa: PLC0415

    config = getattr(importlib.import_module(module), "Config", ExperimentConfig)
    name = module.rsplit(".", 1)[1]
    prog = f"portddp run {name} [-n N] [--hosts H] [--link RATE] [--]" if command == "run" else \
        f"portddp {command} [-n N] [--hosts H] [--link RATE] [--]"
    cfg = parse_config(config, args, prog=prog)
    # ... and the values every rank would refuse once launched (each with its own copy of the message)
    if isinstance(cfg, ExperimentConfig):
        from harness.adapter import check_implementations  # noqa: PLC0415
        from portddp.models import MODELS  # noqa: PLC0415

        cfg.validate_schedule()
        check_implementations(sorted(cfg.implementations()))
        if isinstance(getattr(cfg, "model", None), str) and cfg.model not in MODELS:
            raise SystemExit(f"--model {cfg.model}: unknown model; choose one of {', '.join(MODELS)}")


def _check(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Refuse the options run, compare and mixed cannot honour, in one line naming the value and the
    fix (through `p`, the subcommand's parser), before mpirun or any namespace is started."""
    if ns.hosts is None:
        if ns.ranks < 1:
            p.error(f"-n {ns.ranks}: a job needs at least one rank: pass -n 1 or more")
        if ns.link is not None:
            p.error(f"--link {ns.link} applies only to an emulated cluster: add --hosts H (e.g. --hosts 2), or "
                    "drop --link")
        if ns.or_loopback:
            p.error("--or-loopback applies only to an emulated cluster (where none can be made, run on loopback): "
                    "add --hosts H, or drop it -- without --hosts the job runs on loopback anyway")
        return
    if ns.bind is not None and not ns.or_loopback:
        p.error(f"--bind {ns.bind} applies only without --hosts (each emulated host runs its own ranks): drop --bind "
                "(with --or-loopback it applies where the job falls back to this machine)")
    from portddp import cluster  # noqa: PLC0415

    try:  # (-n too: at least one rank per host)
        cluster.check_job(ns.ranks, ns.hosts, None if ns.link in (None, "matched") else ns.link)
    except ValueError as e:
        p.error(str(e))


def _module_help(command: str, module: str) -> str:
    """The epilog of run/compare/mixed: --help before `--` shows this wrapper's options only, so say
    where the module's own are (parsed before any rank starts: no mpirun needed)."""
    name = module.rsplit(".", 1)[1]
    job = f"portddp run {name}" if command == "run" else f"portddp {command}"
    return (f"the {'experiment' if command == 'run' else 'module'}'s own options (passed on after --):\n"
            f"  {job} -- --help\n  python -m {module} --help    (the same; no mpirun needed)")


def main(argv=None) -> int:
    summary, examples = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="portddp", description=summary,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=examples)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"] and argv[1:2] and argv[1] in ON_THEIR_OWN:
        parser.exit(2, f"portddp run: {argv[1]} starts its own jobs ({ON_THEIR_OWN[argv[1]]}), so it is not run "
                    f"under mpirun: run `python -m experiments.{argv[1]} --help` from the checkout's root\n")
    named = argv[1] if argv[:1] == ["run"] and argv[1:2] and argv[1] in EXPERIMENTS else "EXPERIMENT"
    sub = parser.add_subparsers(dest="command", required=True)
    raw = {"formatter_class": argparse.RawDescriptionHelpFormatter}  # (the epilog's command lines kept whole)
    run = sub.add_parser("run", help="run an experiment under mpirun", **raw,
                         epilog=_module_help("run", f"experiments.{named}"))
    run.add_argument("experiment", choices=EXPERIMENTS)
    jobs = {"run": run, "compare": sub.add_parser("compare", help="the equivalence harness under mpirun", **raw,
                                                  epilog=_module_help("compare", "comparisons.equivalence")),
            "mixed": sub.add_parser("mixed", help="the mixed PyTorch + JAX job under mpirun", **raw,
                                    epilog=_module_help("mixed", "comparisons.mixed"))}
    for p in jobs.values():
        p.add_argument("-n", "--ranks", type=int, default=2, help="number of ranks (mpirun -n), 1 or more; "
                       "every other argument is passed on (see the module's --help)")
        p.add_argument("--hosts", type=int, default=None, help="run on an emulated cluster of this many hosts "
                       "(network namespaces; needs root), ranks spread evenly: -n a multiple of it")
        # Default None, not 1gbit: a --link without --hosts is refused rather than silently ignored.
        p.add_argument("--link", default=None, help="with --hosts: each host's link rate per direction, with "
                       "its unit (default 1gbit; 500mbit, 2.5gbit; 0 or unlimited: no shaping), or 'matched': the "
                       "rate at which the gradients' wire time equals the backward compute time (measured first)")
        p.add_argument("--or-loopback", action="store_true", help="with --hosts: where no cluster can be made, "
                       "run on this machine instead (the results say why)")
        p.add_argument("--bind", choices=("cores", "none"), default=None,
                       help="without --hosts: 'cores' (default) binds each rank to its own share of the "
                       "physical cores (MPICH's mpirun -bind-to user:CPU lists) when the ranks fit; 'none' "
                       "leaves placement to the OS")
    sub.add_parser("report", help="build the report from result JSON (--results DIR --out DIR)", add_help=False)
    sub.add_parser("simulate", help="predict an iteration at another scale from a measured one (RESULT.json "
                   "--world N --link RATE --bucket-cap MB ...)", add_help=False)
    sub.add_parser("cluster", help="run a command as an MPI job on an emulated cluster (-n N --hosts H "
                   "--link RATE -- COMMAND...)", add_help=False)
    if argv[:1] == ["simulate"]:
        from portddp import simulate  # noqa: PLC0415

        return simulate.main(argv[1:])
    if argv[:1] == ["cluster"]:
        from portddp import cluster  # noqa: PLC0415

        return cluster.main(argv[1:])
    if argv[:1] == ["report"]:  # forwarded whole: `portddp report --help` shows the report's own options
        _checkout()
        return importlib.import_module("comparisons.report").main([a for a in argv[1:] if a != "--"],
                                                                  prog="portddp report")
    ns, extra = parser.parse_known_args(argv)
    args = [a for a in extra if a != "--"]
    if not ({"-h", "--help"} & set(args)):  # (the module's help needs no valid job: _mpirun prints it)
        _check(jobs[ns.command], ns)
    _checkout()
    module = {"run": f"experiments.{getattr(ns, 'experiment', '')}", "compare": "comparisons.equivalence",
              "mixed": "comparisons.mixed"}[ns.command]
    if not ({"-h", "--help"} & set(args)):
        _preflight(ns.command, module, args)
    return _mpirun(ns.ranks, module, args, ns.hosts, ns.link or "1gbit", ns.or_loopback, ns.bind or "cores")


if __name__ == "__main__":
    sys.exit(main())
