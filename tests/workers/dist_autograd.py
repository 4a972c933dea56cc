"""DDP under torch.distributed.autograd (RPC training, the pattern of pytorch/examples'
distributed/rpc/ddp_rpc): refused on every rank by portddp.torch, whose hooks never see gradients
that go to a dist_autograd context (before: no error, each rank stepped on its own gradient).
Two processes of torch.multiprocessing, loopback only (tests/test_torch_misuse.py):

    python -m tests.workers.dist_autograd PORT1 PORT2
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from portddp.torch import DistributedDataParallel


def worker(rank: int, ports: tuple[str, str]) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{ports[0]}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[1]}"))
    try:
        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.ones(3, 4)).sum().backward()  # outside a context: fine
        with dist_autograd.context() as cid:
            try:
                dist_autograd.backward(cid, [model(torch.ones(3, 4)).sum()])
                os.write(1, f"PORTDDP_NO_ERROR rank={rank}\n".encode())
            except NotImplementedError as e:  # (one write per line: the two processes share stdout)
                os.write(1, f"PORTDDP_ERROR rank={rank} {type(e).__name__}: {e}\n".encode())
    finally:
        rpc.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(tuple(sys.argv[1:3]),), nprocs=2, join=True)
