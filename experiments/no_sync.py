"""Gradient accumulation: synchronise every n = 1, 2, 4, 8 micro-batches
(no_sync / sync=False in between) and report the time per sample.

    mpirun -n 2 python -m experiments.no_sync
"""

from __future__ import annotations

import dataclasses

from harness import runner
from harness.config import parse_config


@dataclasses.dataclass
class Config(runner.ExperimentConfig):
    every: tuple[int, ...] = dataclasses.field(default=(1, 2, 4, 8), metadata={"help": "micro-batches per sync", "least": 1})
    impls: tuple[str, ...] = dataclasses.field(default=("native", "torch-c10d", "torch-mpi", "jax-hooked",
                                                        "jax-compiled"),
                                               metadata={"help": "implementations"})


def variants(cfg: Config, world):
    for n in cfg.every:
        for impl in cfg.impls:
            yield runner.Variant(f"{impl} / {n}", impl, {"no_sync_every": n}, group=f"every {n}",
                                 params={"no_sync_every": n, "samples_per_step": n * cfg.batch * world.size})


def main(argv=None):
    return runner.run("no_sync", parse_config(Config, argv, __doc__.split("\n\n")[0]), variants)


if __name__ == "__main__":
    main()
