"""A rank forks a child mid-training -- a background checkpoint writer -- twice: one child fails,
the other exits (tests/test_reliability.py):

    mpirun -n 2 python -m tests.workers.forked_child

The child inherits the rank's watchdog (its exit handler, excepthook and sockets) but is not the
rank: the job must train on to the end. (Before, the child's exception or exit told the peers that
rank 1 had failed or left, and a healthy job stopped, naming the parent.) The child goes through
what an uncaught exception and a normal exit run in Python -- sys.excepthook, the atexit
handlers -- and then ends with os._exit(), as multiprocessing's workers do: a forked child cannot
tear down the parent's MPI (MPICH's finalize, or even the interpreter's own teardown, in a child
of an mpi4py process ends the job: "BAD TERMINATION") nor its Gloo group (whose destructor waits
for threads that stayed in the parent, with native DDP too).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import portddp

WORLD = portddp.init(torch_distributed=False)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from portddp.torch import DistributedDataParallel  # noqa: E402

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
ddp = DistributedDataParallel(model, transport="mpi")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
children = {}
for step in range(12):
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step in (2, 5) and WORLD.rank == 1:
        mode = "raise" if step == 2 else "exit"
        child = children[mode] = os.fork()
        if child == 0:
            torch.save(model.state_dict(), os.devnull)
            code = 3
            if mode == "raise":
                try:
                    raise OSError("disk full while saving (in the child)")
                except OSError:
                    sys.excepthook(*sys.exc_info())
                    code = 1
            atexit._run_exitfuncs()
            os._exit(code)
    time.sleep(0.25)  # (the peers would hear a child's word within ~0.25 s)
for mode, child in children.items():
    _, status = os.waitpid(child, 0)
    print(f"rank {WORLD.rank}: {mode} child's exit status {os.waitstatus_to_exitcode(status)}", flush=True)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
print(f"rank {WORLD.rank}: trained 12 steps, parameters {flat.sum().item():.17g}", flush=True)
