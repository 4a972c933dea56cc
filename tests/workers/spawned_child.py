"""A drop-in script's rank starts processes that import the script (or portddp) again: DataLoader
workers with the "spawn" or "forkserver" start method (Python 3.14's default on Linux), and a helper
process (tests/test_launch.py):

    mpirun -n 2 python -m tests.workers.spawned_child

They inherit mpirun's variables but are no rank: importing portddp.torch there used to run MPI_Init
("PMI_Init returned -1"), killing every DataLoader worker and helper under mpirun.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

from portddp.torch import DistributedDataParallel  # the one changed line of a torchrun script


def main() -> None:
    rank = int(os.environ["RANK"])  # (exported from mpirun's variables at the import above)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2), transport="mpi")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = [torch.full((4,), float(i + rank)) for i in range(4)]
    for method in ("spawn", "forkserver"):
        for x in DataLoader(data, batch_size=2, num_workers=1, multiprocessing_context=method):
            ddp(x).sum().backward()
            opt.step()
            opt.zero_grad()
    helper = subprocess.run([sys.executable, "-c", "import portddp.torch; print('helper ok')"],
                            capture_output=True, text=True, timeout=120)
    # Such a process asking for the MPI transport (imagenet's --multiprocessing-distributed under
    # mpirun with PORTDDP_TRANSPORT=mpi) is told it is a rank's child, not that torchrun started it.
    mpi_child = subprocess.run([sys.executable, "-c", MPI_IN_A_CHILD], capture_output=True, text=True, timeout=120)
    jax_child = subprocess.run([sys.executable, "-c", JAX_IN_A_CHILD], capture_output=True, text=True, timeout=120)
    digest = float(sum(p.detach().sum() for p in ddp.parameters()))
    print(f"SPAWNED rank={rank} digest={digest:.6f} helper_rc={helper.returncode} "
          f"helper={helper.stdout.strip() or helper.stderr.strip()[-200:]!r}", flush=True)
    print(f"MPI_CHILD rank={rank} {mpi_child.stdout.strip() or mpi_child.stderr.strip()[-300:]}", flush=True)
    print(f"JAX_CHILD rank={rank} {jax_child.stdout.strip() or jax_child.stderr.strip()[-300:]}", flush=True)


MPI_IN_A_CHILD = """
import torch
from portddp.torch import DistributedDataParallel
try:
    DistributedDataParallel(torch.nn.Linear(2, 2), transport="mpi")
except ValueError as e:
    print(e)
"""

JAX_IN_A_CHILD = """
import jax.numpy as jnp
from portddp.jax import DistributedDataParallel
try:
    DistributedDataParallel({"w": jnp.ones(2)})
except ValueError as e:
    print(e)
"""


if __name__ == "__main__":
    main()
