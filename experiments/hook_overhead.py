"""What portddp.torch's Python costs per parameter against native DDP's C++ reducer.

    mpirun -bind-to user:0,1 -n 2 python -m experiments.hook_overhead            # 1, 6 and 50 layers
    mpirun -bind-to user:0,1 -n 2 python -m experiments.hook_overhead 100 --rounds 60

A model of LAYERS small blocks (Linear(32, 32) + GELU: two parameters each, 4 KB of weights),
so that the copies are negligible and what is left is each implementation's per-parameter and
per-step bookkeeping: the no-communication model, native DDP and portddp.torch on c10d and on
MPI (with and without gradient_as_bucket_view), built alike and run in interleaved rounds of 10
steps (a barrier before each turn, no garbage collection inside one). Prints, per model size,
the median main-thread CPU of the forward and backward (the wrapper's hooks, packs, launches
and the wait for the last bucket; not the optimizer, which is the same code in every row) and
each row's excess over native DDP, per step and per parameter. The benchmark's models have 12
(gelu-mlp), 16 (mlp) and 100 (gpt) parameters.
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness.measure import frozen_heap, no_collection, rotated

ROWS = ("local", "native", "c10d", "mpi", "mpi+view")


def _model(layers: int):
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(32, 32), nn.GELU())])


def _rows(layers: int) -> dict:
    import torch  # noqa: PLC0415

    from portddp.torch import DistributedDataParallel as DDP  # noqa: PLC0415

    return {"local": _model(layers),
            "native": torch.nn.parallel.DistributedDataParallel(_model(layers)),
            "c10d": DDP(_model(layers), transport="c10d"),
            "mpi": DDP(_model(layers), transport="mpi"),
            "mpi+view": DDP(_model(layers), transport="mpi", gradient_as_bucket_view=True)}


def measure(layers: int, rounds: int) -> dict[str, float]:
    """Median main-thread CPU (us) of one forward + backward, per row."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    rows = _rows(layers)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in rows.items()}
    x = torch.randn(8, 32)

    def step(k: str) -> int:
        opts[k].zero_grad()
        start = time.thread_time_ns()
        rows[k](x).square().mean().backward()
        taken = time.thread_time_ns() - start
        opts[k].step()
        return taken

    for k in rows:
        for _ in range(20):
            step(k)
    taken: dict[str, list[int]] = {k: [] for k in rows}
    with frozen_heap():
        for r in range(rounds):
            for k in rotated(ROWS, r):
                dist.barrier()
                with no_collection():
                    taken[k] += [step(k) for _ in range(10)]
    return {k: statistics.median(v) / 1e3 for k, v in taken.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.hook_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("layers", nargs="*", type=int, default=[1, 6, 50],
                        help="model sizes, in Linear(32, 32) + GELU blocks (two parameters each)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds of 10 steps per row")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.layers) or args.rounds < 1:
        parser.error("layers and --rounds must be at least 1")
    import torch  # noqa: PLC0415

    import portddp  # noqa: PLC0415

    torch.set_num_threads(1)
    world = portddp.init()
    if world.size < 2:
        raise SystemExit("run it on 2 ranks or more: mpirun -bind-to user:0,1 -n 2 python -m experiments.hook_overhead")
    for layers in args.layers:
        us = measure(layers, args.rounds)
        if world.rank == 0:
            params = 2 * layers
            cells = "  ".join(f"{k} {us[k]:.0f}" for k in ROWS)
            excess = "  ".join(f"{k} {us[k] - us['native']:+.0f} ({(us[k] - us['native']) / params:+.1f}/param)"
                               for k in ROWS[2:])
            print(f"{params:4d} parameters, us of main-thread CPU per forward+backward: {cells}\n"
                  f"     over native DDP: {excess}", flush=True)


if __name__ == "__main__":
    main()
