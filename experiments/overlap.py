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


def variants(cfg: Config, world):
    knobs = {"bucket_cap_mb": cfg.bucket_cap_mb, "first_bucket_cap_mb": min(1.0, cfg.bucket_cap_mb)}
    for impl in cfg.impls:
        framework = "jax" if impl.startswith("jax") else "torch"
        if impl.endswith("-local"):
            yield runner.Variant(impl, impl, {}, group=framework, params={"overlap": None})
            continue
        native_knobs = {} if impl == "native" else knobs  # native: its own defaults, for reference
        yield runner.Variant(impl, impl, native_knobs, group=framework, params={"overlap": True})
        if impl in OVERLAP_SWITCH:
            yield runner.Variant(f"{impl} (no overlap)", impl, {**knobs, "overlap": False}, group=framework,
                                 params={"overlap": False})


def main(argv=None):
    return runner.run("overlap", parse_config(Config, argv, __doc__.split("\n\n")[0]), variants)


if __name__ == "__main__":
    main()
