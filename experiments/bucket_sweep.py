"""Bucket-size sweep: per-iteration time and overlap ratio against the bucket cap
(the DDP paper's bucket-size study), per implementation.

    mpirun -n 2 python -m experiments.bucket_sweep
    mpirun -n 2 python -m experiments.bucket_sweep --caps 1 16 --impls torch-c10d jax-hooked
"""

from __future__ import annotations

import dataclasses
import math

from harness import runner
from harness.config import parse_config


@dataclasses.dataclass
class Config(runner.ExperimentConfig):
    caps: tuple[float, ...] = dataclasses.field(default=(0.25, 1.0, 4.0, 16.0, 64.0, math.inf),
                                                metadata={"help": "bucket caps in MB (inf: one bucket)"})


def variants(cfg: Config, world):
    for cap in cfg.caps:
        label = "one bucket" if math.isinf(cap) else f"{cap:g} MB"
        for impl in cfg.impls:
            if impl.endswith("-local"):
                continue
            # first bucket = the cap itself: the sweep varies one number
            yield runner.Variant(f"{impl} @ {label}", impl, {"bucket_cap_mb": cap, "first_bucket_cap_mb": cap},
                                 group=label, params={"bucket_cap_mb": cap})


def main(argv=None):
    return runner.run("bucket_sweep", parse_config(Config, argv, __doc__.split("\n\n")[0]), variants)


if __name__ == "__main__":
    main()
