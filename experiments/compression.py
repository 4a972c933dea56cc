"""Compression hooks: none, fp16, bf16 -- time per iteration and the loss reached.

    mpirun -n 2 python -m experiments.compression
"""

from __future__ import annotations

import dataclasses

from harness import runner
from harness.adapter import HOOKS
from harness.config import parse_config


@dataclasses.dataclass
class Config(runner.ExperimentConfig):
    impls: tuple[str, ...] = dataclasses.field(default=("torch-c10d", "torch-mpi", "jax-hooked"),
                                               metadata={"help": "implementations with comm hooks (native: fp16 "
                                                                 "only on CPU -- PyTorch's bf16 hook needs NCCL)"})


def variants(cfg: Config, world):
    import torch  # noqa: PLC0415

    for hook in HOOKS:
        for impl in cfg.impls:
            if impl == "native" and hook == "bf16" and not torch.cuda.is_available():
                continue  # PyTorch's bf16 hook needs NCCL: native's bf16 row is left out on CPU
            yield runner.Variant(f"{impl} / {hook}", impl, {"hook": hook}, group=hook, params={"hook": hook})


def main(argv=None):
    return runner.run("compression", parse_config(Config, argv, __doc__.split("\n\n")[0]), variants)


if __name__ == "__main__":
    main()
