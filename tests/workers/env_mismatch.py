"""A job whose ranks set a portddp environment variable differently (tests/test_transport.py).

    mpirun -n 2 python -m tests.workers.env_mismatch <rank>:<NAME>=<value> ...

Each `<rank>:<NAME>=<value>` is set on that rank only, before portddp starts; then every rank
builds a DistributedDataParallel on transport="mpi" and takes one step."""

from __future__ import annotations

import os
import sys

rank = int(os.environ.get("PMI_RANK", "0"))
for arg in sys.argv[1:]:
    who, setting = arg.split(":", 1)
    if int(who) == rank:
        name, value = setting.split("=", 1)
        os.environ[name] = value

import torch  # noqa: E402

import portddp  # noqa: E402
from portddp.torch import DistributedDataParallel  # noqa: E402

portddp.init()
ddp = DistributedDataParallel(torch.nn.Linear(4, 4), transport="mpi")
ddp(torch.randn(2, 4)).sum().backward()
print(f"rank {rank} stepped", flush=True)
