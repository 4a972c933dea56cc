"""A training script written for torchrun and native DDP, with only the DDP import changed.

    mpirun -n 2 python -m tests.workers.torchrun_style [--portddp-init]

It decides whether it is distributed from RANK, reads LOCAL_RANK/WORLD_SIZE,
calls init_process_group itself (env://), accumulates gradients nanoGPT-style
through require_backward_grad_sync, and at the end trains the same model with
native DDP in the same job and reports whether the two agree. With
--portddp-init, portddp.init() runs first and the script's own
init_process_group must adopt its group."""

import os
import sys

import torch
from torch import nn

from portddp.torch import DistributedDataParallel as DDP  # the one changed line
from torch.distributed import destroy_process_group, init_process_group  # noqa: I001 (after, as in nanoGPT)

from tests.workers import common

if "--portddp-init" in sys.argv:
    import portddp

    portddp.init()

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = "cpu"
    master_process = ddp_rank == 0
else:
    ddp_rank, ddp_world_size, master_process = 0, 1, True
torch.set_num_threads(1)


transports = []  # each wrapper's (portddp's: $PORTDDP_TRANSPORT, else c10d)


def train(wrapper):
    torch.manual_seed(1337)
    model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12), nn.LayerNorm(12), nn.Linear(12, 3))
    if ddp:
        model = wrapper(model, device_ids=None)
        transports.append(getattr(model, "transport", "native"))
    raw = model.module if ddp else model
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(100 + ddp_rank)
    accum = 2
    for it in range(4):
        for micro in range(accum):
            if ddp:
                model.require_backward_grad_sync = micro == accum - 1
            x, y = torch.randn(6, 12, generator=gen), torch.randint(0, 3, (6,), generator=gen)
            loss = nn.functional.cross_entropy(model(x), y) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return raw


ours = train(DDP)
native = train(nn.parallel.DistributedDataParallel)
equal = all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), native.state_dict().values()))
common.report(ddp_rank, "torchrun_style", distributed=ddp, world=ddp_world_size, bitwise=equal,
              local_rank=int(os.environ.get("LOCAL_RANK", -1)), transport=transports[0] if transports else None)
if ddp:
    destroy_process_group()
# PyTorch's own C++ teardown after destroy_process_group() sometimes aborts the process ("terminate called
# without an active exception", ~1 run in 10, with or without portddp; README, Reliability): the results are
# written by now, so run the exit handlers and leave without it, as the torchrun test does.
import atexit  # noqa: E402

atexit._run_exitfuncs()
sys.stdout.flush()
os._exit(0)
