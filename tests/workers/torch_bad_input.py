"""Bad input for portddp.torch: each case must fail on *every* rank with a clear
message, never hang. Run by tests/test_torch_ddp.py:

    mpirun -n 2 python -m tests.workers.torch_bad_input CASE TRANSPORT
    mpirun -n 2 python -m tests.workers.torch_bad_input --cases CASE,CASE,... TRANSPORT

Every rank prints `PORTDDP_ERROR rank=<r> <message>` and exits 3, or
`PORTDDP_NO_ERROR rank=<r>` and exits 0 if nothing was raised (with --cases: one
`PORTDDP_CASE` line per case and rank, tests/workers/common.run_cases).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from torch import nn

import portddp
from portddp.launch import detect
from portddp.torch import DistributedDataParallel
from tests.workers import common


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x, use_branch):
        h = torch.relu(self.fc(x))
        if use_branch:
            h = self.branch(h)
        return self.head(h)


class Reused(nn.Module):
    """One layer applied `depth` times under reentrant checkpointing: its gradient hooks fire once
    per application (what static_graph=True learns in the first iteration)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)  # (so that what the checkpoints take requires grad)
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, depth):
        from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

        x = self.inp(x)
        for _ in range(depth):
            x = checkpoint(lambda t: torch.tanh(self.shared(t)), x, use_reentrant=True)
        return self.head(x)


def run(case: str, transport: str) -> None:
    if case == "world_size":
        portddp.init(world_size=detect().size + 3)
        return
    if case == "process_group_mismatch":
        # A c10d group of one per process, made before portddp.init() looks.
        import torch.distributed as dist  # noqa: PLC0415

        from portddp.launch import _free_port  # noqa: PLC0415

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        portddp.init()
        return
    if case == "master_port_in_use":  # something else listens on MASTER_PORT (rank 0 opens it first)
        import socket  # noqa: PLC0415

        from portddp.launch import _free_port, mpi_comm  # noqa: PLC0415

        port = mpi_comm().bcast(_free_port() if detect().rank == 0 else None, root=0)
        jax = transport == "jax"  # the JAX coordinator listens on MASTER_PORT + 1
        if detect().rank == 0:
            squatter = socket.create_server(("", port + jax))  # noqa: F841 -- held until the process ends
        mpi_comm().Barrier()
        os.environ["MASTER_PORT"] = str(port)
        portddp.init(torch_distributed=not jax, jax_distributed=jax)
        return
    w = portddp.init()
    last = w.rank == w.size - 1
    if case == "shape_mismatch":
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 9 if last else 8))
        DistributedDataParallel(model, transport=transport)
    elif case == "count_mismatch":
        layers = [nn.Linear(8, 8) for _ in range(3 if last else 2)]
        DistributedDataParallel(nn.Sequential(*layers), transport=transport)
    elif case in ("unused_some_ranks", "unused_all_ranks"):
        ddp = DistributedDataParallel(Branchy(), bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002,
                                      transport=transport)
        use = case == "unused_some_ranks" and w.rank == 0
        ddp(torch.randn(4, 8), use_branch=use).sum().backward()
    elif case.startswith("bad_cap="):
        DistributedDataParallel(nn.Linear(4, 4), bucket_cap_mb=_literal(case.split("=", 1)[1]), transport=transport)
    elif case.startswith("bad_first_cap="):
        DistributedDataParallel(nn.Linear(4, 4), first_bucket_cap_mb=_literal(case.split("=", 1)[1]),
                                transport=transport)
    elif case == "unknown_transport":
        DistributedDataParallel(nn.Linear(4, 4), transport="carrier-pigeon")
    elif case == "dtype_mismatch":
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        DistributedDataParallel(model.double() if last else model, transport=transport)
    elif case == "cap_differs":
        DistributedDataParallel(nn.Linear(4, 4), bucket_cap_mb=5.0 if last else 25.0, transport=transport)
    elif case in ("frozen_on_one_rank", "last_frozen_on_one_rank"):  # rank 1 freezes a middle (the last) layer
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        if last:
            model[1 if case == "frozen_on_one_rank" else 2].requires_grad_(False)
        DistributedDataParallel(model, transport=transport)
    elif case == "buffers_flag_differs":  # the buffer broadcast before every forward, on one rank only
        DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), broadcast_buffers=not last,
                                transport=transport)
    elif case == "transport_differs":
        DistributedDataParallel(nn.Linear(4, 4), transport="mpi" if last else "c10d")
    elif case == "sparse_gradient_outside_embedding":  # (nn.Embedding(sparse=True)'s own are reduced: test_dropin)
        class Table(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(10, 4))

            def forward(self, ids):
                return nn.functional.embedding(ids, self.weight, sparse=True)

        ddp = DistributedDataParallel(Table(), transport=transport)
        ddp(torch.tensor([1, 2, 3])).sum().backward()
    elif case == "sparse_delayed":
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
        DistributedDataParallel(model, delay_all_reduce_named_params=[("0.weight", model[0].weight)],
                                param_to_hook_all_reduce=model[1].weight, transport=transport)
    elif case == "sparse_on_one_rank":
        DistributedDataParallel(nn.Embedding(10, 4, sparse=last), transport=transport)
    elif case == "backward_twice":
        ddp = DistributedDataParallel(nn.Linear(4, 4), transport=transport)
        out = ddp(torch.randn(2, 4)).sum()
        out.backward(retain_graph=True)
        out.backward()
    elif case == "modified_after_wrap":
        model = nn.Sequential(nn.Linear(4, 4))
        ddp = DistributedDataParallel(model, transport=transport)
        model.append(nn.Linear(4, 2))
        ddp(torch.randn(2, 4))
    elif case == "double_on_one_rank":  # (an audit: the ranks were told only of "different collectives")
        model = nn.Sequential(nn.Linear(4, 4))
        ddp = DistributedDataParallel(model, transport=transport)
        if w.rank == 1:
            model.double()
        ddp(torch.randn(2, 4, dtype=model[0].weight.dtype))
    elif case == "replaced_after_wrap":  # same names and shapes, new objects: native leaves their gradients unreduced
        model = nn.Sequential(nn.Linear(4, 4))
        ddp = DistributedDataParallel(model, transport=transport)
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        ddp(torch.randn(2, 4))
    elif case in ("crossed_ddps", "crossed_ddps_world_group", "crossed_ddps_subgroup"):  # other orders (a GAN's)
        group = {"process_group": torch.distributed.group.WORLD} if case.endswith("world_group") else {
            "process_group": torch.distributed.new_group(list(range(w.size)))} if case.endswith("subgroup") else {}
        a, b = (DistributedDataParallel(nn.Linear(16, 4), transport=transport, **group) for _ in range(2))
        la, lb = a(torch.randn(4, 16)).sum(), b(torch.randn(4, 16)).sum()
        for loss in ((la, lb) if last else (lb, la)):
            loss.backward()
    elif case == "nonfinite":
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport,
                                      check_finite=True)
        x = torch.full((2, 4), float("nan") if last else 1.0)
        ddp(x).sum().backward()
    elif case == "device_ids_on_cpu":
        DistributedDataParallel(nn.Linear(4, 4), [0], transport=transport)
    elif case == "nested_ddp":  # DDP(DDP(model)): refused at construction, naming the fix
        DistributedDataParallel(DistributedDataParallel(nn.Linear(4, 4), transport=transport), transport=transport)
    elif case == "mixed_precision":
        DistributedDataParallel(nn.Linear(4, 4), mixed_precision=object(), transport=transport)
    elif case == "bucket_cap_mb_list":
        DistributedDataParallel(nn.Linear(4, 4), bucket_cap_mb_list=[1, 25], transport=transport)
    elif case == "delay_without_hook_param":
        lin = nn.Linear(4, 4)
        DistributedDataParallel(lin, delay_all_reduce_named_params=[("weight", lin.weight)], transport=transport)
    elif case == "meta_device":
        DistributedDataParallel(nn.Linear(4, 4, device="meta"), transport=transport)
    elif case == "sync_batchnorm_on_cpu":
        DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), transport=transport)
    elif case == "forward_without_backward":
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        for step in range(2):
            loss = ddp(torch.ones(2, 4)).sum()
            if not (last and step == 0):  # the last rank skips one backward ("no valid targets: continue")
                loss.backward()
    elif case == "forward_without_backward_everywhere":
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        for step in range(3):
            loss = ddp(torch.ones(2, 4)).sum()
            if step != 1:  # step 1: a validation loss, computed with autograd on, on every rank
                loss.backward()
    elif case == "join_twice":  # two epochs of uneven inputs, each in its own join(): legal
        from torch.distributed.algorithms.join import Join  # noqa: PLC0415

        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ddp = DistributedDataParallel(model, transport=transport)
        for _epoch in range(2):
            with Join([ddp]):
                for _ in range(3 + 2 * w.rank):
                    ddp(torch.randn(8, 4)).sum().backward()
        ddp(torch.randn(8, 4)).sum().backward()
    elif case == "late_hook_in_join":  # a hook registered after the first step, inside join(): refused
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

        ddp = DistributedDataParallel(nn.Linear(4, 2), transport=transport)
        with ddp.join():
            for step in range(3):
                if step == 1:
                    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                ddp(torch.randn(8, 4)).sum().backward()
    elif case == "partial_hook_everywhere":  # a functools.partial hook on every rank: legal
        import functools  # noqa: PLC0415

        from portddp.torch.hooks import allreduce_hook  # noqa: PLC0415

        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        ddp.register_comm_hook(None, functools.partial(allreduce_hook))
        ddp(torch.ones(2, 4)).sum().backward()
    elif case == "double_after_wrap":  # .double() replaces the buffers: the synced ones must be the new ones
        from portddp.launch import allgather_object  # noqa: PLC0415

        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ddp = DistributedDataParallel(model, transport=transport).double()
        for _ in range(3):
            ddp(torch.randn(8, 4, dtype=torch.float64) + w.rank).sum().backward()
        ddp.eval()
        with torch.no_grad():  # starts from rank 0's buffers (synced), and evaluation leaves them alone
            ddp(torch.randn(8, 4, dtype=torch.float64))
        stats = allgather_object(model[1].running_mean.tolist())
        if stats[0] != stats[-1]:
            raise AssertionError(f"BatchNorm statistics differ across ranks after .double(): {stats}")
    elif case in ("buffer_dtype", "buffer_count"):  # the buffers rank 0 broadcasts differ on the last rank
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        if case == "buffer_dtype" and last:
            model[1].running_var.data = model[1].running_var.data.double()
        elif case == "buffer_count" and last:
            model.register_buffer("extra", torch.zeros(2))
        ddp = DistributedDataParallel(model, transport=transport)
        ddp(torch.ones(2, 4)).sum().backward()
    elif case == "sync_then_no_sync_one_backward":  # one backward through a synced and a no_sync forward
        ddp = DistributedDataParallel(nn.Linear(4, 2), transport=transport)
        synced = ddp(torch.ones(2, 4))
        with ddp.no_sync():
            local = ddp(torch.ones(2, 4))
        (synced + local).sum().backward()
    elif case.startswith("static_graph_depth_"):  # a layer reused fewer / more times than in the first iteration
        ddp = DistributedDataParallel(Reused(), transport=transport, static_graph=True)
        for depth in (2, 1) if case.endswith("fewer") else (1, 2):
            ddp(torch.ones(2, 4), depth).sum().backward()
    elif case == "unfrozen_after_wrap":
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)
        ddp = DistributedDataParallel(model, transport=transport)
        ddp(torch.ones(2, 4)).sum().backward()
        model[0].weight.requires_grad_(True)
        ddp(torch.ones(2, 4)).sum().backward()
    elif case.startswith("hook_"):  # a comm hook that breaks native's contract
        import torch.distributed as dist  # noqa: PLC0415

        def one_element(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer()[:1])
            return fut

        def not_a_future(state, bucket):
            return bucket.buffer()

        def half(state, bucket):
            return dist.all_reduce(bucket.buffer()[: bucket.buffer().numel() // 2], async_op=True).get_future()

        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        hook = {"hook_one_element": one_element, "hook_not_a_future": not_a_future, "hook_half": half}[case]
        ddp.register_comm_hook(None, hook)
        ddp(torch.ones(2, 4)).sum().backward()
    elif case == "one_batch_fewer":  # no join(): the last rank's loop ends one batch early
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        for _ in range(2 if last else 3):
            ddp(torch.ones(2, 4)).sum().backward()
    elif case == "exit_before_construction":  # the last rank's script ends before it builds its DDP
        if last:
            sys.exit(0)
        DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
    elif case == "exit_before_checkpoint":  # every rank trains; the last skips the collective save
        from portddp import checkpoint  # noqa: PLC0415

        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        for _ in range(2):
            ddp(torch.ones(2, 4)).sum().backward()
        if not last:
            checkpoint.save(os.environ["PORTDDP_TEST_DIR"] + "/ckpt", ddp, step=2, collective=True)
    elif case == "rank0_only_eval":  # `if rank == 0: evaluate` through the wrapper, after the last step
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        ddp = DistributedDataParallel(model, transport=transport)
        for step in range(4):
            ddp(torch.randn(8, 4) + w.rank).sum().backward()
            if step == 3 and w.rank == 0:
                ddp.eval()
                with torch.no_grad():
                    ddp(torch.randn(8, 4))
                ddp.train()
    elif case == "buffer_shape_after_wrap":  # a mask registered in the first forward, sized by each rank's input
        class Masked(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

            def forward(self, x):
                if not hasattr(self, "mask"):
                    self.register_buffer("mask", torch.tril(torch.ones(len(x), len(x))))
                return self.bn(self.fc(self.mask @ x))

        ddp = DistributedDataParallel(Masked(), transport=transport)
        for _ in range(3):
            ddp(torch.randn(4 + 2 * w.rank, 4)).sum().backward()
    elif case == "some_ranks_hook":
        from portddp.torch.hooks import fp16_compress_hook  # noqa: PLC0415

        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        if w.rank == 0:
            ddp.register_comm_hook(None, fp16_compress_hook)
        ddp(torch.ones(2, 4)).sum().backward()
    elif case == "no_sync_on_some_ranks":  # rank 0 accumulates locally for one step, the others do not
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        for step in range(3):
            local = ddp.no_sync() if (step == 1 and w.rank == 0) else contextlib.nullcontext()
            with local:
                ddp(torch.ones(2, 4)).sum().backward()
    elif case == "stalled_rank":  # the last rank computes 30 s before its backward: everyone waits
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), transport=transport)
        for step in range(2):
            loss = ddp(torch.ones(2, 4)).sum()
            if last and step == 1:
                time.sleep(30)
            loss.backward()
    elif case == "create_graph":  # native: values averaged, higher-order graph local (with a warning)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        reference = [p.detach().clone() for p in model.parameters()]
        ddp = DistributedDataParallel(model, transport=transport)
        xs = [torch.randn(5, 4) + r for r in range(w.size)]
        ddp(xs[w.rank]).pow(2).sum().backward(create_graph=True)
        # the mean of every rank's local gradient, computed here without DDP
        local = []
        for x in xs:
            m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            with torch.no_grad():
                for p, ref in zip(m.parameters(), reference):
                    p.copy_(ref)
            m(x).pow(2).sum().backward()
            local.append(m[0].weight.grad)
        mean = torch.stack(local).mean(0)
        grad = model[0].weight.grad
        close = torch.allclose(grad, mean, atol=1e-6)
        line = f"CREATE_GRAPH rank={w.rank} requires_grad={grad.requires_grad} grad={close} mean=True\n"
        os.write(1, line.encode())  # one write(): mpirun does not split the line when it merges the ranks' output
        penalty = sum((p.grad ** 2).sum() for p in model.parameters())
        torch.autograd.grad(penalty, list(model.parameters()))  # the local higher-order graph is intact
    else:
        raise SystemExit(f"unknown case {case!r}")


def _literal(text):
    try:
        return float(text)
    except ValueError:
        return text


def main():
    argv = sys.argv[1:]
    named = 2 if argv[:1] == ["--cases"] else 1  # the case (or --cases and the list), then the transport
    if len(argv) not in (named, named + 1):
        raise SystemExit("usage: python -m tests.workers.torch_bad_input {CASE | --cases CASE,CASE,...} "
                         "[c10d|mpi]")
    common.main(detect().rank, run, argv if len(argv) > named else [*argv, "c10d"])


if __name__ == "__main__":
    main()
