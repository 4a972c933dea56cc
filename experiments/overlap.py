"""Overlap on vs off: how much faster each implementation is when its buckets are
all-reduced during the backward pass instead of after it (the DDP paper's §5.1),
with the no-communication step of each framework as the floor.

    mpirun -n 2 python -m experiments.overlap
"""

from __future__ import annotations

from harness import runner
from harness.calibrate import OverlapConfig as Config  # (there: the bandwidth sweep checks its options too)
from harness.config import parse_config

OVERLAP_SWITCH = ("torch-c10d", "torch-mpi", "jax-hooked")  # native and compiled have no such switch
NATIVE_DEFAULT_CAP_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb


def variants(cfg: Config, world):
    knobs = {"bucket_cap_mb": cfg.bucket_cap_mb, "first_bucket_cap_mb": min(1.0, cfg.bucket_cap_mb)}
    for impl in cfg.impls:
        framework = "jax" if impl.startswith("jax") else "torch"
        if impl.endswith("-local"):
            yield runner.Variant(impl, impl, {}, group=framework, params={"overlap": None})
            continue
        # Every row at the run's bucket cap, native too: "vs native" compares like with like.
        yield runner.Variant(impl, impl, knobs, group=framework, params={"overlap": True})
        if impl == "native" and cfg.bucket_cap_mb != NATIVE_DEFAULT_CAP_MB:
            # And native as a script gets it, for reference: 25 MB buckets, fewer and larger, so their
            # all-reduces start later in the backward pass (on a slow link that shows).
            yield runner.Variant("native (default caps)", impl, {}, group=framework,
                                 params={"overlap": True, "caps": "default"})
        if impl in OVERLAP_SWITCH:
            yield runner.Variant(f"{impl} (no overlap)", impl, {**knobs, "overlap": False}, group=framework,
                                 params={"overlap": False})


def main(argv=None):
    return runner.run("overlap", parse_config(Config, argv, __doc__.split("\n\n")[0]), variants)


if __name__ == "__main__":
    main()
