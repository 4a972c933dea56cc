"""The MPI transport's all-reduce beside MPI's own, Gloo's and the memory-traffic floor.

    python -m experiments.allreduce_bench                   # 2 ranks on this host, 32 MB, ~1 minute
    python -m experiments.allreduce_bench --size-mb 8 -n 3
    python -m experiments.allreduce_bench --cluster --link 1gbit   # 4 ranks on 2 emulated hosts (root)

The driver starts the MPI jobs itself (one per MPICH setting that needs its own process); inside
one job every variant runs on the same buffers in interleaved rounds, so ratios come from side by
side measurements. Per variant: median milliseconds per all-reduce on rank 0, CPU milliseconds
that rank's process used per all-reduce (its main thread sleeps in `Handle.wait`, so this is the
comm thread's), bytes its host's interface sent per all-reduce (emulated cluster only), and the
ratio to the floor, and the page faults rank 0 took per all-reduce (a buffer mapped afresh faults
in every page). A late-peer probe measures what waiting costs: rank 0 arrives 0.5 s early,
CPU seconds per second of waiting. The last line holds the ratios.

floor: the memory traffic of the shared-memory scheme done on private copies, no synchronisation:
each rank sums its 1/n slice of n buffers, a cache-sized chunk at a time, and writes each chunk's
sum into all n buffers, all ranks at once -- one read and one write of every element per rank, the
least an all-reduce that leaves the sum in every rank's memory can move.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# -- inside the MPI job --------------------------------------------------------------------------
def _tx_bytes() -> int:
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def worker(args) -> None:
    import portddp  # noqa: PLC0415

    # c10d (Gloo) beside MPI (and jax.distributed for XLA's CPU collectives with --xla)
    world = portddp.init(jax_distributed=args.xla)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    from portddp.shm import _reduce_into  # noqa: PLC0415 -- the floor runs the scheme's own arithmetic
    from portddp.transport import get_transport  # noqa: PLC0415

    t = get_transport()
    sync = MPI.COMM_WORLD.Dup()
    rank, n = t.rank, t.size
    count = int(args.size_mb * (1 << 20)) // 4
    data = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
    shm = t._shm
    window = t.empty(count, np.float32)
    private = np.empty(count, np.float32)
    tensor = torch.empty(count, dtype=torch.float32)
    L = t.local_size
    peers = [np.random.default_rng(j).standard_normal(count).astype(np.float32) for j in range(L)]
    mine = peers[t.local_rank]
    lo, hi = count * t.local_rank // L, count * (t.local_rank + 1) // L

    def floor():  # the shared-memory scheme's arithmetic and copies on private buffers, no synchronisation
        parts = [p[lo:hi] for p in peers]
        _reduce_into([parts[t.local_rank]] + [q for j, q in enumerate(parts) if j != t.local_rank], parts,
                     t.local_rank)

    def via_transport(buf, impl, spin):
        def go():
            t._shm, t._spin = (shm if impl == "shm" else None), spin
            try:
                t.allreduce(buf).wait(timeout=120)
            finally:
                t._shm, t._spin = shm, False
        return go

    variants = {"floor (memory traffic)": (floor, None)}
    if shm is not None:
        variants["portddp shm, zero-copy"] = (via_transport(window, "shm", False), window)
        variants["portddp shm, copy"] = (via_transport(private, "shm", False), private)
    variants["MPI Allreduce (blocking)"] = (via_transport(private, "mpi", True), private)
    variants["MPI Iallreduce + test/sleep"] = (via_transport(private, "mpi", False), private)
    variants["Gloo (torch.distributed)"] = (lambda: dist.all_reduce(tensor), tensor)
    if args.xla:
        variants.update(_xla_variants(n, count, data))
    names = list(variants)
    skip = set(args.skip.split(",")) if args.skip else set()
    names = [x for x in names if not any(s and s in x for s in skip)]
    times = {k: [] for k in names}
    cpus = {k: [] for k in names}
    wire = {k: [] for k in names}
    faults = {k: [] for k in names}
    for rnd in range(args.warmup + args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            fn, buf = variants[name]
            for _ in range(args.reps):
                if buf is not None:
                    buf[...] = torch.from_numpy(data) if isinstance(buf, torch.Tensor) else data
                sync.Barrier()
                tx, c0, w0, f0 = _tx_bytes(), time.process_time(), time.perf_counter(), _minor_faults()
                fn()
                w, c, sent = time.perf_counter() - w0, time.process_time() - c0, _tx_bytes() - tx
                if rnd >= args.warmup:
                    times[name].append(w)
                    cpus[name].append(c)
                    wire[name].append(sent)
                    faults[name].append(_minor_faults() - f0)
    # correctness on the way: every variant leaves the same sum (float32: close)
    ref = data.copy()
    sync.Allreduce(MPI.IN_PLACE, ref)
    for name in names:
        buf = variants[name][1]
        if buf is not None:
            got = buf.numpy() if isinstance(buf, torch.Tensor) else buf
            assert np.allclose(got, ref, rtol=1e-5, atol=1e-5), name
    # what waiting for a late peer costs (rank 0 is early by 0.5 s)
    late = {}
    for name in names:
        fn, buf = variants[name]
        if buf is None:
            continue
        sync.Barrier()
        if rank != 0:
            time.sleep(0.5)
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        late[name] = (time.process_time() - c0) / (time.perf_counter() - w0)
    copy_ms = []
    a, b = np.empty(count, np.float32), data.copy()
    for _ in range(5):
        sync.Barrier()
        w0 = time.perf_counter()
        np.copyto(a, b)
        copy_ms.append((time.perf_counter() - w0) * 1e3)
    if rank == 0:
        print("BENCH " + json.dumps({
            "label": args.label, "n": n, "local": L, "hosts": n // L, "mb": args.size_mb,
            "copy_gbs": 2 * count * 4 / statistics.median(copy_ms) / 1e6,
            "rows": {k: {"ms": statistics.median(times[k]) * 1e3, "cpu_ms": statistics.median(cpus[k]) * 1e3,
                         "wire_mb": statistics.median(wire[k]) / 1e6, "late_cpu": late.get(k),
                         "faults": statistics.median(faults[k])} for k in names},
        }), flush=True)
    sync.Barrier()
    del world


def _minor_faults() -> int:
    """Page faults this process has taken so far (a buffer mapped afresh faults in every page)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _xla_variants(n: int, count: int, data: np.ndarray) -> dict:
    """XLA:CPU's cross-process all-reduce (jax.distributed + jax_cpu_collectives_implementation, Gloo
    by default): a jitted shard_map psum over one row per process, as portddp.jax's compiled
    strategy runs it -- the program alone (input already a device array, block_until_ready), and
    with the host round trip the strategy pays (numpy in, numpy out)."""
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = [next(d for d in devices if d.process_index == p) for p in range(n)]
    mine = next(d for d in devices if d.process_index == jax.process_index())
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    sharded = NamedSharding(mesh, P("x"))
    fn = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g[0], "x"), mesh=mesh, in_specs=P("x"), out_specs=P(),
                               check_vma=False))
    row = data[None]
    x = jax.make_array_from_single_device_arrays((n, count), sharded, [jax.device_put(row, mine)])
    fn(x).block_until_ready()
    out = {}

    def program():
        out["r"] = fn(x).block_until_ready()

    def round_trip():
        g = jax.make_array_from_process_local_data(sharded, data[None])
        out["r"] = np.asarray(fn(g).addressable_data(0))

    return {f"XLA psum ({jax.config.jax_cpu_collectives_implementation}), program": (program, None),
            "XLA psum, numpy in and out": (round_trip, None)}


# -- the driver ----------------------------------------------------------------------------------
def _job(args, label: str, env: dict, skip: str = "") -> dict:
    inner = [sys.executable, "-m", "experiments.allreduce_bench", "--worker", "--label", label,
             "--size-mb", str(args.size_mb), "--rounds", str(args.rounds), "--reps", str(args.reps),
             "--warmup", str(args.warmup)] + (["--skip", skip] if skip else []) + (["--xla"] if args.xla and not skip else [])
    if args.cluster:
        cmd = [sys.executable, "-m", "portddp.cluster", "-n", str(args.n), "--hosts", str(args.hosts),
               "--link", args.link, "--", *inner]
    else:
        mpirun = str(Path(sys.executable).parent / "mpirun")
        cmd = [mpirun if os.path.exists(mpirun) else "mpirun", "-n", str(args.n), *inner]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=1800)
    found = re.findall(r"^BENCH (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(found[0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=None, help="ranks (2; 4 with --cluster)")
    p.add_argument("--size-mb", type=float, default=32.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="all-reduces per variant per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cluster", action="store_true", help="on the emulated cluster (root)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--link", default="1gbit")
    p.add_argument("--no-cvars", action="store_true", help="skip the job with MPIR_CVAR_ENABLE_HEAVY_YIELD=1")
    p.add_argument("--xla", action="store_true", help="also XLA:CPU's cross-process psum (jax.distributed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", default="", help=argparse.SUPPRESS)
    p.add_argument("--skip", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    args.n = args.n or (4 if args.cluster else 2)
    jobs = [_job(args, "default", {})]
    if not args.no_cvars:
        jobs.append(_job(args, "MPIR_CVAR_ENABLE_HEAVY_YIELD=1", {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"},
                         skip="shm,Gloo,Iallreduce,floor"))
    head = jobs[0]
    where = (f"{head['hosts']} emulated hosts x {head['local']} ranks, link {args.link}" if args.cluster
             else f"{head['n']} ranks on one host")
    print(f"all-reduce of {args.size_mb:g} MB float32, {where}; memory copy {head['copy_gbs']:.1f} GB/s "
          f"(read + write); medians of {args.rounds} rounds x {args.reps}, {time.strftime('%Y-%m-%d')}")
    floor = head["rows"].get("floor (memory traffic)", {}).get("ms")
    print("| variant | ms | x floor | CPU ms per all-reduce | page faults per all-reduce | CPU s per s of waiting "
          "| MB sent per host |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for job in jobs:
        for name, row in job["rows"].items():
            label = name if job is head else f"{name}, {job['label']}"
            late = "–" if row["late_cpu"] is None else f"{row['late_cpu']:.3f}"
            wire = f"{row['wire_mb']:.1f}" if args.cluster else "–"
            print(f"| {label} | {row['ms']:.2f} | {row['ms'] / floor:.2f} | {row['cpu_ms']:.2f} | {row['faults']:.0f} "
                  f"| {late} | {wire} |")
            ratios[label] = row["ms"] / floor
    rows = head["rows"]
    best = "portddp shm, zero-copy" if "portddp shm, zero-copy" in rows else "MPI Iallreduce + test/sleep"
    summary = {"shm_vs_floor": rows[best]["ms"] / floor,
               "shm_vs_mpi": rows[best]["ms"] / rows["MPI Allreduce (blocking)"]["ms"],
               "shm_vs_mpi_nonblocking": rows[best]["ms"] / rows["MPI Iallreduce + test/sleep"]["ms"],
               "shm_vs_gloo": rows[best]["ms"] / rows["Gloo (torch.distributed)"]["ms"]}
    if args.cluster:
        summary["shm_wire_vs_mpi"] = rows[best]["wire_mb"] / max(rows["MPI Iallreduce + test/sleep"]["wire_mb"], 1e-9)
    print(" ".join(f"{k}={v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
