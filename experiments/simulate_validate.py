"""Validate portddp.simulate against the emulated cluster (needs root).

    python -m experiments.simulate_validate                 # runs the grid, then predicts it
    python -m experiments.simulate_validate --reuse         # predicts again from the grid's saved runs

The grid: link rates x bucket caps x overlap on/off x implementations, on 2
hosts (2 ranks) and 3 hosts (3 ranks); each (rate, cap, hosts) is one run of
the `overlap` experiment on a fresh cluster. Every point is predicted from the
trace and model measured at ONE source point (the first rate, the middle cap,
2 hosts; its own two runs are left out of the score): the link model and both
contention terms are fitted there (portddp.simulate.Model.fit), and the
replayed iteration is that point's run without overlap, re-planned for the
target's caps.

What the emulation adds, and the prediction uses: every "host" shares this
machine's cores, so 3 ranks on 2 cores compute max(1, 3/cores) / max(1,
2/cores) times slower than 2 (compute_scale); that is the machine's property,
not a fitted number. jax-compiled (one XLA program, no per-bucket events) and
native DDP (no overlap switch, its own caps) are not replayed.

Last line: median_abs_error=<fraction> worst_abs_error=<fraction> points=<count>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness.results import write_result
from portddp import simulate

IMPLS = ("torch-c10d", "torch-mpi", "jax-hooked")


def grid_runs(rates, caps, hosts_list, out: Path, extra: list[str], reuse: bool) -> list[dict]:
    from portddp import cluster  # noqa: PLC0415

    runs = []
    points = [(h, r, c) for h in hosts_list for r in rates for c in caps]
    saved = [out / f"cap{c:g}" / f"overlap-n{h}-h{h}-{r}.json" for h, r, c in points]
    if reuse and not any(p.exists() for p in saved):
        raise SystemExit(f"simulate_validate: --reuse found no saved grid run under {out} (e.g. {saved[0]}): pass the "
                         "--out-dir of an earlier validation, or leave out --reuse to measure the grid (~13 min)")
    started = time.time()
    for k, (hosts, rate, cap) in enumerate(points, start=1):
        run_dir = out / f"cap{cap:g}"
        path = run_dir / f"overlap-n{hosts}-h{hosts}-{rate}.json"
        if not (reuse and path.exists()):
            print(f"simulate_validate [{k}/{len(points)}]: {hosts} hosts, {rate}, bucket cap {cap:g} MB "
                  f"({time.time() - started:.0f} s so far)", flush=True)
            code = cluster.run(hosts, hosts, rate, [
                sys.executable, "-m", "experiments.overlap", "--out-dir", str(run_dir), "--bucket-cap-mb", str(cap),
                "--impls", *IMPLS, *extra], quiet=True)
            if code != 0:
                raise SystemExit(f"the grid run at {hosts} hosts, {rate}, cap {cap} failed (exit {code})")
        runs.append({"hosts": hosts, "rate": rate, "cap": cap, "payload": json.loads(path.read_text())})
    return runs


def predict_grid(runs: list[dict], cores: int) -> tuple[list[dict], dict]:
    rates = list(dict.fromkeys(r["rate"] for r in runs))  # in the order given: the first is the source's
    caps = sorted({r["cap"] for r in runs})
    src_key = (min(r["hosts"] for r in runs), rates[0], caps[len(caps) // 2])
    source = next(r for r in runs if (r["hosts"], r["rate"], r["cap"]) == src_key)
    n0 = source["payload"]["world"]["size"]
    src_rows = {row["label"]: row for row in source["payload"]["rows"]}
    points, models = [], {}
    for impl in IMPLS:
        on = simulate.Trace.from_row(src_rows[impl], n0)
        off = simulate.Trace.from_row(src_rows[f"{impl} (no overlap)"], n0)
        model = simulate.Model.fit(on, off, simulate.parse_rate(source["rate"]))
        models[impl] = {"alpha_s": model.link.alpha_s, "hop_s": model.link.hop_s,
                        "host_s_per_byte": model.link.host_s_per_byte,
                        "kappa": model.kappa, "kappa_comm": model.kappa_comm}
        for run in runs:
            n = run["payload"]["world"]["size"]
            rows = {row["label"]: row for row in run["payload"]["rows"]}
            scale = max(1.0, n / cores) / max(1.0, n0 / cores)
            for overlap, label in ((True, impl), (False, f"{impl} (no overlap)")):
                if run is source:
                    continue  # the source point: not scored
                t0 = time.perf_counter()
                p = simulate.simulate(off, model, world=n, rate_bps=simulate.parse_rate(run["rate"]),
                                      bucket_cap_mb=run["cap"], first_bucket_cap_mb=min(1.0, run["cap"]),
                                      overlap=overlap, compute_scale=scale)
                took = time.perf_counter() - t0
                measured = rows[label]["median_s"]
                points.append({"impl": impl, "hosts": run["hosts"], "world": n, "rate": run["rate"],
                               "cap": run["cap"], "overlap": overlap, "predicted_s": p.step_s,
                               "measured_s": measured, "error": p.step_s / measured - 1, "predict_s": took})
    return points, {"source": {"hosts": src_key[0], "rate": src_key[1], "cap": src_key[2]}, "models": models}


def check(ns) -> None:
    """Refuse every rate, cap and host count before the first cluster is made, in one line naming
    the value and the fix: the grid runs one at a time for minutes, and a bad value late in it would
    end it in a traceback after the others ran."""
    from portddp import cluster  # noqa: PLC0415

    try:
        for rate in ns.rates:
            cluster.check_rate(rate)
        ns.rates = [cluster.rate_name(rate) for rate in ns.rates]  # (as the runs' file names spell them)
        for hosts in ns.hosts:
            cluster.check_job(hosts, hosts)  # (one rank per host)
    except ValueError as e:
        raise SystemExit(f"experiments.simulate_validate: {e}") from None
    for cap in ns.caps:
        if not cap > 0:  # (NaN too)
            raise SystemExit(f"experiments.simulate_validate: --caps {cap:g} is not a bucket size: pass megabytes "
                             "> 0, e.g. --caps 1 4 16")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m experiments.simulate_validate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     epilog="after --: the overlap experiment's own options for every grid run "
                                            "(default: --batch 1024 --rounds 2 --steps-per-round 3 --warmup 2)")
    parser.add_argument("--rates", nargs="+", default=["1gbit", "500mbit"], help="link rates (the first is the "
                        "source point's)")
    parser.add_argument("--caps", nargs="+", type=float, default=[1.0, 4.0, 16.0], help="bucket caps (MB)")
    parser.add_argument("--hosts", nargs="+", type=int, default=[2, 3], help="hosts (one rank each)")
    parser.add_argument("--out-dir", default="results", help="where the grid's runs (under simulate_validate/) "
                        "and the scores go")
    parser.add_argument("--reuse", action="store_true", help="reuse grid runs already in --out-dir")
    ns = parser.parse_args(argv)
    check(ns)
    extra = extra or ["--batch", "1024", "--rounds", "2", "--steps-per-round", "3", "--warmup", "2"]
    out = Path(ns.out_dir) / "simulate_validate"
    runs = grid_runs(ns.rates, ns.caps, ns.hosts, out, extra, ns.reuse)
    cores = os.cpu_count() or 1
    points, fitted = predict_grid(runs, cores)
    print(f"{'impl':12s} {'hosts':>5s} {'link':>8s} {'cap':>5s} {'overlap':>7s} {'measured':>9s} {'predicted':>9s} "
          f"{'error':>7s}")
    for p in points:
        print(f"{p['impl']:12s} {p['hosts']:5d} {p['rate']:>8s} {p['cap']:5g} {str(p['overlap']):>7s} "
              f"{p['measured_s'] * 1e3:9.1f} {p['predicted_s'] * 1e3:9.1f} {p['error'] * 100:+6.1f}%")
    per_impl = {}
    for impl in IMPLS:
        errs = [abs(p["error"]) for p in points if p["impl"] == impl]
        per_impl[impl] = {"median_abs_error": statistics.median(errs), "worst_abs_error": max(errs),
                          "points": len(errs)}
        print(f"{impl}: median |error| {per_impl[impl]['median_abs_error'] * 100:.1f} %, worst "
              f"{per_impl[impl]['worst_abs_error'] * 100:.1f} % over {len(errs)} points")
    errs = [abs(p["error"]) for p in points]
    payload = {"experiment": "simulate_validate", "portddp_version": runs[0]["payload"]["portddp_version"],
               "command": " ".join(["python -m experiments.simulate_validate", *sys.argv[1:]]),
               "cores": cores, "extra": extra, **fitted, "per_impl": per_impl, "points": points,
               "worst_predict_s": max(p["predict_s"] for p in points)}
    write_result(Path(ns.out_dir) / "simulate_validate.json", payload)
    print(f"slowest prediction: {payload['worst_predict_s'] * 1e3:.1f} ms")
    print(f"median_abs_error={statistics.median(errs):.4f} worst_abs_error={max(errs):.4f} points={len(errs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
