"""World-size scaling: run once per world size; the report puts the runs together.

    for n in 1 2 3 4; do mpirun -n $n python -m experiments.scaling; done

Scaling efficiency (in the report) = t(1 rank) / t(n ranks) at a fixed batch per rank.
On a 2-core machine n = 3 and 4 oversubscribe: they must finish, not scale.
"""

from __future__ import annotations

from harness import runner
from harness.config import parse_config


def variants(cfg: runner.ExperimentConfig, world):
    for impl in cfg.impls:
        yield runner.Variant(impl, impl, {}, group=f"n={world.size}", params={"world": world.size})


def main(argv=None):
    return runner.run("scaling", parse_config(runner.ExperimentConfig, argv, __doc__.split("\n\n")[0]), variants)


if __name__ == "__main__":
    main()
