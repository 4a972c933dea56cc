"""Drop-in checks: training-script patterns run on portddp.torch and on native DDP, compared.

    mpirun -n 2 python -m tests.workers.torch_dropin [c10d|mpi ...]

Every scenario trains the same model from the same weights on the same per-rank
batches twice -- once wrapped by torch.nn.parallel.DistributedDataParallel and
once by portddp's, constructed with the same (native) arguments -- and reports
the largest difference of parameters and buffers (bitwise expected at n=2)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import prune
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.optim.swa_utils import AveragedModel

import portddp
from portddp.data import regression_batch
from portddp.torch import DistributedDataParallel
from tests.workers import common
from tests.workers.torch_equivalence import BATCH, IN, OUT, make, max_diff

NativeDDP = nn.parallel.DistributedDataParallel
CAP_MB = 0.004


def batch(step, rank, dtype=torch.float32):
    x, y = regression_batch(11, step, rank, BATCH, IN, OUT, dtype="float64")
    return torch.from_numpy(x).to(dtype), torch.from_numpy(y).to(dtype)


def loss_of(ddp, step, rank, dtype=torch.float32, **kw):
    x, y = batch(step, rank, dtype)
    return nn.functional.mse_loss(ddp(x, **kw), y)


def report(name, **fields):
    common.report(dist.get_rank(), name, **fields)


def same_on_every_rank(tensors) -> bool:
    """Whether `tensors` (parameters, gradients) hold the same values on every rank."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def pair(transport, model_kw=None, ddp_args=(), ddp_kw=None, edit=None):
    """(native DDP, portddp DDP) around two identical models, built with the same native arguments."""
    models = [make(**(model_kw or {})) for _ in range(2)]
    if edit is not None:
        models = [edit(m) for m in models]
    native = NativeDDP(models[0], *ddp_args, **(ddp_kw or {}))
    ours = DistributedDataParallel(models[1], *ddp_args, transport=transport, **(ddp_kw or {}))
    return native, ours


def compare(name, transport, native, ours, train, **extra):
    """Train both, report the largest difference; `extra` fields that are callables are evaluated
    after the training."""
    train(native)
    train(ours)
    diff, equal = max_diff(native.module, ours.module)
    report(f"{name}/{transport}", max_diff=diff, bitwise=equal,
           **{k: v() if callable(v) else v for k, v in extra.items()})


def sgd_steps(steps=4, **kw):
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            opt.zero_grad()
            loss_of(ddp, step, dist.get_rank(), **kw).backward()
            opt.step()
    return train


# --------------------------------------------------------------- scenarios
def native_signature(transport):
    """Positional native arguments (device_ids=None, output_device=None, dim, broadcast_buffers,
    init_sync, process_group, bucket_cap_mb) and the attributes scripts read."""
    native, ours = pair(transport, ddp_args=(None, None, 0, True, True, None, CAP_MB))
    attrs = {}
    for name in ("device_ids", "output_device", "dim", "static_graph", "bucket_bytes_cap",
                 "require_backward_grad_sync", "require_forward_param_sync", "device", "broadcast_buffers",
                 "find_unused_parameters", "gradient_as_bucket_view"):
        attrs[name] = [str(getattr(native, name)), str(getattr(ours, name))]
    same_group = ours.process_group is native.process_group if transport == "c10d" else ours.process_group is not None
    compare("native_signature", transport, native, ours, sgd_steps(), attrs=attrs, same_group=bool(same_group))


def module_interface(transport):
    """state_dict keys, load_state_dict, buffers, named_parameters, train/eval, .double() after wrapping."""
    native, ours = pair(transport, model_kw={"batchnorm": True}, ddp_kw={"bucket_cap_mb": CAP_MB})
    keys_equal = list(native.state_dict()) == list(ours.state_dict())
    names_equal = [n for n, _ in native.named_parameters()] == [n for n, _ in ours.named_parameters()]
    buffers_equal = [n for n, _ in native.named_buffers()] == [n for n, _ in ours.named_buffers()]
    ours.eval()
    eval_reaches = not ours.module.training and not ours.module.bn.training
    ours.train()
    sgd_steps(2)(native), sgd_steps(2)(ours)
    state = {k: v.clone() for k, v in native.state_dict().items()}
    fresh = DistributedDataParallel(make(batchnorm=True), bucket_cap_mb=CAP_MB, transport=transport)
    fresh.load_state_dict(state)
    loaded = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values()))
    report(f"module_interface/{transport}", keys_equal=keys_equal, names_equal=names_equal,
           buffers_equal=buffers_equal, eval_reaches=eval_reaches, loaded=loaded)
    # .double() after wrapping: the buckets follow (native DDP cannot: compared with a float64 model wrapped natively)
    native64 = NativeDDP(make(torch.float64), bucket_cap_mb=CAP_MB)
    ours64 = DistributedDataParallel(make(), bucket_cap_mb=CAP_MB, transport=transport).double()
    compare("double_after_wrap", transport, native64, ours64, sgd_steps(3, dtype=torch.float64),
            bucket_dtypes=sorted({b.dtype for b in ours64.bucket_plan.buckets}))


def compiled(transport):
    """torch.compile of the wrapper, and of the module before wrapping (aot_eager: the
    compiled forward and backward graphs without a C++ toolchain)."""
    for where in ("after", "before"):
        models = [make() for _ in range(2)]
        if where == "before":
            models = [torch.compile(m, backend="aot_eager") for m in models]
        native = NativeDDP(models[0])  # default caps: compiled native DDP needs first bucket <= the others
        ours = DistributedDataParallel(models[1], transport=transport)
        if where == "after":
            native, ours = (torch.compile(d, backend="aot_eager") for d in (native, ours))
        train = sgd_steps(3)
        train(native), train(ours)
        diff, equal = max_diff(models[0], models[1])
        report(f"compile_{where}/{transport}", max_diff=diff, bitwise=equal)


def accumulation(transport):
    """nanoGPT's gradient accumulation: require_backward_grad_sync set by hand on the last micro-step."""
    def train(ddp):
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for step in range(3):
            for micro in range(3):
                ddp.require_backward_grad_sync = micro == 2
                (loss_of(ddp, step * 3 + micro, dist.get_rank()) / 3).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    # (bucket_cap_mb=0: one tensor per bucket, as native -- the first version refused it)
    compare("accumulation", transport, *pair(transport, ddp_kw={"bucket_cap_mb": 0}), train)


def amp(transport):
    """bfloat16 autocast + GradScaler (a minGPT-style trainer on CPU)."""
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(ddp, step, dist.get_rank())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    compare("amp", transport, *pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB}), train)


def uneven(transport, divide_by_initial_world_size=True):
    """join(): rank r has 2 + 2r batches; the last joiner's model ends on every rank."""
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(2 + 2 * dist.get_rank()):
                opt.zero_grad()
                loss_of(ddp, step, dist.get_rank()).backward()
                opt.step()
    name = "join" if divide_by_initial_world_size else "join_effective_world"
    native, ours = pair(transport, model_kw={"batchnorm": True}, ddp_kw={"bucket_cap_mb": CAP_MB})
    compare(name, transport, native, ours, train)


def join_before_the_rebuild(transport):
    """join() where a rank joins before its first step (no batch at all: rank 1) or right after it (rank 2
    at n=3), so before the plan rebuild the others make at their second step: its shadow meets their
    rebuild as native's joined rank does (portddp's hung -- c10d: the rebuild's broadcast crossed the
    join notice; MPI: the joined rank kept the old buckets). Bitwise as native."""
    def train(ddp, accumulate):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with ddp.join():
            for step in range((4, 0, 1)[dist.get_rank()]):
                opt.zero_grad()
                if accumulate:  # a no_sync() micro-batch first: the re-plan comes at its forward, as native's
                    with ddp.no_sync():
                        loss_of(ddp, step + 10, dist.get_rank()).backward()
                loss_of(ddp, step, dist.get_rank()).backward()
                opt.step()
    for name, accumulate in (("join_before_the_rebuild", False), ("join_accumulating", True)):
        native, ours = pair(transport, model_kw={"batchnorm": True}, ddp_kw={"bucket_cap_mb": CAP_MB})
        compare(name, transport, native, ours, lambda ddp: train(ddp, accumulate))


def uneven_throw(transport):
    """join(throw_on_early_termination=True): every rank raises once one runs out."""
    ours = DistributedDataParallel(make(), bucket_cap_mb=CAP_MB, transport=transport)
    steps = 0
    try:
        with ours.join(throw_on_early_termination=True):
            for step in range(2 + 2 * dist.get_rank()):
                loss_of(ours, step, dist.get_rank()).backward()
                steps += 1
        message = None
    except RuntimeError as e:
        message = str(e)
    report(f"join_throw/{transport}", message=message, steps=steps)


def powersgd(transport):
    """PyTorch's own hooks, unmodified: PowerSGD (plain and batched) and fp16_compress_wrapper."""
    cases = {
        "powersgd": lambda: (powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                         start_powerSGD_iter=2, min_compression_rate=0.5),
                             powerSGD_hook.powerSGD_hook),
        # (batched_powerSGD_hook fails inside PyTorch 2.13 itself, on native DDP too: its _orthogonalize
        # asserts a 3-D batch and is handed a 2-D matrix)
        "powersgd_rank2_no_warm_start": lambda: (powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3, min_compression_rate=0.5,
            warm_start=False), powerSGD_hook.powerSGD_hook),
        "fp16_wrapper": lambda: (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        # (PowerSGD's docs' recommendation: it works on bucket.gradients() of the float16 buffer)
        "fp16_wrapper_powersgd": lambda: (powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5),
            default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)),
        "native_fp16": lambda: (None, default_hooks.fp16_compress_hook),
    }
    for name, make_hook in cases.items():
        native, ours = pair(transport, ddp_kw={"bucket_cap_mb": 0.01})
        native.register_comm_hook(*make_hook())
        ours.register_comm_hook(*make_hook())
        compare(name, transport, native, ours, sgd_steps(5))


def _padding_hook(_state, bucket):
    """Pads bucket.buffer() with resize_() before its all-reduce, as batched_powerSGD_hook does."""
    t = bucket.buffer()
    n = t.numel()
    t.resize_(n + 7)
    t[n:] = 0
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0][:n].div_(dist.get_world_size()))


def padding_hook(transport):
    """A hook that grows its bucket.buffer(): as native on c10d, bitwise (portddp took the grown size for the
    bucket's: "resolved to a (5722,) tensor, but the bucket holds 5729"); on MPI's shared-memory window, which
    cannot grow, refused naming the fix (was torch's bare "Trying to resize storage that is not resizable")."""
    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": 0.002})
    native.register_comm_hook(None, _padding_hook)
    ours.register_comm_hook(None, _padding_hook)
    if transport == "c10d":
        compare("padding_hook", transport, native, ours, sgd_steps(4))
        return
    try:
        sgd_steps(1)(ours)
        message = None
    except RuntimeError as e:
        message = str(e)
    report(f"padding_hook/{transport}", message=message)


def forwards_per_backward(transport):
    """Several forwards through the wrapper into one backward, their number per rank: each rank's batch
    in micro-batches of its own count (rank 0 three, the others two), concatenated; then a term through
    the wrapper on rank 0 only. As native, bitwise (portddp counted a step per forward: 'ranks reached
    this gradient reduction at different steps'). A backward skipped on one rank is still named: the
    misuse tests."""
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        rank = dist.get_rank()
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step, rank, torch.float32)
            out = torch.cat([ddp(c) for c in x.chunk(3 if rank == 0 else 2)])
            loss = nn.functional.mse_loss(out, y)
            if rank == 0 and step % 2:
                loss = loss + 0.1 * ddp(x[:2]).pow(2).mean()
            loss.backward()
            opt.step()

    native, ours = pair(transport)
    compare("forwards_per_backward", transport, native, ours, train)


def rank0_eval(transport):
    """`if rank == 0: evaluate(ddp)` under no_grad between steps, through the wrapper, on a model with
    buffers (nanoGPT's estimate_loss, with its causal-mask buffer): native pairs rank 0's buffer
    broadcast in its first evaluation forward with the others' next training forward, and rank 0's next
    training forward sends none -- the same buffers at the same forwards as without it. Evaluations in
    eval mode and in train mode (BatchNorm's statistics move after the broadcast, on rank 0 only, as
    native), after steps of two accumulated micro-batches (require_backward_grad_sync toggled, as
    nanoGPT) and of one. Bitwise as native (portddp refused it: 'a forward of the wrapper ran on some
    ranks only')."""
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        rank = dist.get_rank()
        for step in range(6):
            micro = 2 if step < 3 else 1
            for m in range(micro):
                ddp.require_backward_grad_sync = m == micro - 1
                x, y = batch(10 * step + m, rank)
                nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            if rank == 0 and step in (1, 2, 4):
                ddp.train(step == 2)  # (step 2: no_grad forwards in train mode)
                with torch.no_grad():
                    for k in range(3):
                        ddp(batch(100 + k, 0)[0])
                ddp.train()
        ddp.require_backward_grad_sync = True

    native, ours = pair(transport, model_kw={"batchnorm": True})
    compare("rank0_eval", transport, native, ours, train)


def late_hook(transport):
    """A comm hook registered after two steps (compression switched on after a warm-up), as native
    allows: it reduces from the next iteration on -- also when registered between a forward and its
    backward (native's reducer takes it at the next bucket: ours at the next iteration, so the
    forward without a backward, an evaluation under grad mode, leaves nothing half done)."""
    for name, when in (("late_fp16", "before_forward"), ("late_fp16_after_eval_forward", "after_forward")):
        def train(ddp, when=when):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            for step in range(5):
                if step == 2 and when == "before_forward":
                    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                if step == 2 and when == "after_forward":
                    loss_of(ddp, 99, dist.get_rank())  # a forward under grad mode whose backward never runs
                    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                opt.zero_grad()
                loss_of(ddp, step, dist.get_rank()).backward()
                opt.step()

        native, ours = pair(transport, ddp_kw={"bucket_cap_mb": 0.01})
        if when == "before_forward":
            compare(name, transport, native, ours, train)
        else:  # (native cannot take a forward without its backward: compare with the hook registered before it)
            train(ours)
            sgd_native = lambda ddp: train(ddp, when="before_forward")  # noqa: E731
            sgd_native(native)
            diff, equal = max_diff(native.module, ours.module)
            report(f"{name}/{transport}", max_diff=diff, bitwise=equal)


def builtin_hooks(transport):
    """Native's private _register_builtin_comm_hook (older tutorials), both of its C++ hooks."""
    for kind in ("ALLREDUCE", "FP16_COMPRESS"):
        native, ours = pair(transport, ddp_kw={"bucket_cap_mb": 0.01})
        for ddp in (native, ours):
            ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, kind))
        compare(f"builtin_{kind.lower()}", transport, native, ours, sgd_steps(4))


def fused_optim(transport):
    """Native's private _register_fused_optim (an optimizer stepped in the comm hook, per bucket; the script
    calls no optimizer.step()): all parameters with SGD, and a subset with Adam (optim_params)."""
    for optim, kw, subset in ((torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, False), (torch.optim.Adam, {"lr": 1e-2},
                                                                                       True)):
        native, ours = pair(transport, ddp_kw={"bucket_cap_mb": 0.01})
        for ddp in (native, ours):
            ddp._register_fused_optim(optim, optim_params=list(ddp.parameters())[:2] if subset else None, **kw)

        def train(ddp):
            for step in range(4):
                loss_of(ddp, step, dist.get_rank()).backward()
                ddp.zero_grad(set_to_none=True)

        compare(f"fused_{optim.__name__.lower()}", transport, native, ours, train)


def buffer_sync(transport):
    """Every combination of no_sync, broadcast_buffers, train()/eval() and find_unused_parameters
    on a BatchNorm model: buffers and parameters bitwise as native's."""
    for broadcast in (True, False):
        for find_unused in (False, True):
            def train(ddp):
                opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
                rank = dist.get_rank()
                for step in range(3):
                    with ddp.no_sync():
                        loss_of(ddp, 10 * step, rank).backward()
                    loss_of(ddp, 10 * step + 1, rank).backward()
                    opt.step()
                    opt.zero_grad()
                    ddp.eval()
                    with torch.no_grad():
                        ddp(batch(10 * step + 2, rank)[0])
                        ddp(batch(10 * step + 3, rank)[0])
                    ddp.train()
            native, ours = pair(transport, model_kw={"batchnorm": True},
                                ddp_kw={"bucket_cap_mb": CAP_MB, "broadcast_buffers": broadcast,
                                        "find_unused_parameters": find_unused})
            compare(f"buffers_b{int(broadcast)}_u{int(find_unused)}", transport, native, ours, train)

    def two_views(ddp):  # SimCLR's step: two forwards (buffers synchronised before each), one backward
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        rank = dist.get_rank()
        for step in range(3):
            (x, _), (y, _) = batch(2 * step, rank), batch(2 * step + 1, rank)
            z1, z2 = ddp(x), ddp(y)
            opt.zero_grad()
            (z1 - z2).square().mean().backward()
            opt.step()
    native, ours = pair(transport, model_kw={"batchnorm": True}, ddp_kw={"bucket_cap_mb": CAP_MB})
    compare("buffers_two_forwards", transport, native, ours, two_views)


def nosync_unused(transport):
    """find_unused_parameters + no_sync() accumulation, as a mixture of experts trains: the branch
    gets gradients in the no_sync micro-step only, on some ranks; native counts it as used and
    averages its accumulated gradient at the synchronised step (with and without the bucket view)."""
    for view in (False, True):
        def train(ddp):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
            rank = dist.get_rank()
            for step in range(4):
                opt.zero_grad()
                with ddp.no_sync():
                    loss_of(ddp, 10 * step, rank, use_branch=(rank + step) % 2 == 0).backward()
                loss_of(ddp, 10 * step + 1, rank).backward()
                opt.step()
        native, ours = pair(transport, model_kw={"branch": True},
                            ddp_kw={"bucket_cap_mb": CAP_MB, "find_unused_parameters": True,
                                    "gradient_as_bucket_view": view})
        compare("nosync_unused" + ("_view" if view else ""), transport, native, ours, train)


def join_unused(transport):
    """join() + find_unused_parameters: every rank uses the branch at step 1, the last step of the
    rank that joins first, and nobody after. Native's joined rank contributes the used map of its
    last reduction, so the others write zeros into the branch's .grad (momentum keeps moving it)."""
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        rank = dist.get_rank()
        with ddp.join():
            for step in range(2 + 2 * rank):
                opt.zero_grad()
                loss_of(ddp, step, rank, use_branch=step == 1).backward()
                opt.step()
    native, ours = pair(transport, model_kw={"branch": True},
                        ddp_kw={"bucket_cap_mb": CAP_MB, "find_unused_parameters": True})
    compare("join_unused", transport, native, ours, train)


def static_graph_checkpoint(transport):
    """static_graph=True with reentrant activation checkpointing."""
    native, ours = pair(transport, model_kw={"checkpointed": True},
                        ddp_kw={"bucket_cap_mb": CAP_MB, "static_graph": True})
    compare("static_graph_checkpoint", transport, native, ours, sgd_steps(4))


class TwoHeads(nn.Module):
    """Returns two outputs; the scripts below put only the first in the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(99)
        self.body, self.a, self.b = nn.Linear(IN, 32), nn.Linear(32, OUT), nn.Linear(32, OUT)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def static_graph_ignored_output(transport):
    """static_graph=True, an output the loss ignores: its head gets no gradient (.grad None), so AdamW's
    weight decay leaves it alone. Compared with native's find_unused_parameters=True: native's own
    static_graph leaves the second iteration unreduced (local gradients, silently) and raises at the
    third -- a difference README lists."""
    def train(ddp):
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.1)
        for step in range(3):
            x, y = batch(step, dist.get_rank())
            first, _ = ddp(x)
            opt.zero_grad()
            nn.functional.mse_loss(first, y).backward()
            opt.step()
    native = NativeDDP(TwoHeads(), bucket_cap_mb=CAP_MB, find_unused_parameters=True)
    ours = DistributedDataParallel(TwoHeads(), bucket_cap_mb=CAP_MB, static_graph=True, transport=transport)
    compare("static_graph_ignored_output", transport, native, ours, train,
            grad_as_native=lambda: ours.module.b.weight.grad is None and native.module.b.weight.grad is None)


@dataclasses.dataclass
class HeadsOut:
    first: torch.Tensor
    second: torch.Tensor


class DataclassHeads(TwoHeads):
    def forward(self, x):
        return HeadsOut(*super().forward(x))


def static_graph_dataclass_output(transport):
    """static_graph=True and a forward returning a @dataclass (a review, 2026-12-06): native's output walk
    does not look inside it and never reduces the first iteration (each rank steps on its own
    gradients: the ranks drift apart, silently); portddp reduces every iteration, bitwise as native
    without static_graph. The ranks' parameters are compared too."""
    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            x, y = batch(step, dist.get_rank())
            out = ddp(x)
            opt.zero_grad()
            (nn.functional.mse_loss(out.first, y) + nn.functional.mse_loss(out.second, y)).backward()
            opt.step()
    native = NativeDDP(DataclassHeads(), bucket_cap_mb=CAP_MB)
    ours = DistributedDataParallel(DataclassHeads(), bucket_cap_mb=CAP_MB, static_graph=True, transport=transport)

    compare("static_graph_dataclass_output", transport, native, ours, train,
            ranks_agree=lambda: same_on_every_rank(ours.module.parameters()))


class _Cut(torch.autograd.Function):
    """Identity forward; backward returns no gradient (None): the layers below get undefined ones."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


class CutBody(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(98)
        self.body, self.a = nn.Linear(IN, 32), nn.Linear(32, OUT)

    def forward(self, x):
        return self.a(_Cut.apply(torch.relu(self.body(x))))


def undefined_grad(transport):
    """Gradient hooks that fire with an undefined gradient (a custom Function returning None), without
    find_unused_parameters: native reduces them as zeros and writes the zeros into .grad; so does portddp."""
    native = NativeDDP(CutBody(), bucket_cap_mb=CAP_MB)
    ours = DistributedDataParallel(CutBody(), bucket_cap_mb=CAP_MB, transport=transport)

    def train(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            x, y = batch(step, dist.get_rank())
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    compare("undefined_grad", transport, native, ours, train,
            grad_as_native=lambda: (ours.module.body.weight.grad is not None
                                    and native.module.body.weight.grad is not None))


def rewrap(transport):
    """The module wrapped again (the old wrapper dropped, or still referenced): the new wrapper trains
    as native's does, the old one's hooks are gone (they used to fire on every later backward), and
    using the old one raises."""
    def train(ddp_class, model, **kw):
        keep = []
        for phase in range(2):
            ddp = ddp_class(model, bucket_cap_mb=CAP_MB, **kw)
            keep.append(ddp)  # phase 0's wrapper stays alive: superseded, not freed
            sgd_steps(2)(ddp)
        return keep
    models = [make(), make()]
    train(NativeDDP, models[0])
    old, _new = train(DistributedDataParallel, models[1], transport=transport)
    try:
        old(batch(0, dist.get_rank())[0])
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    diff, equal = max_diff(models[0], models[1])
    import io  # noqa: PLC0415

    torch.save(models[1], io.BytesIO())  # the wrapped module stays picklable (nothing of portddp's on it)
    report(f"rewrap/{transport}", max_diff=diff, bitwise=equal,
           old_refused=refused.startswith("this DistributedDataParallel's parameters were wrapped again"))


def init_and_delay(transport):
    """init_sync=False, forward_sync_buffers=False, delay_all_reduce_named_params."""
    def skew(model):  # ranks start different: init_sync=False must keep it that way
        with torch.no_grad():
            model.fc1.bias.add_(dist.get_rank())
        return model
    native, ours = pair(transport, model_kw={"batchnorm": True}, edit=skew,
                        ddp_kw={"bucket_cap_mb": CAP_MB, "init_sync": False})
    compare("init_sync_false", transport, native, ours, sgd_steps(2))
    native, ours = pair(transport, model_kw={"batchnorm": True},
                        ddp_kw={"bucket_cap_mb": CAP_MB, "forward_sync_buffers": False})
    compare("forward_sync_buffers_false", transport, native, ours, sgd_steps(3))
    # Delayed parameters are averaged like the others. (Not compared with native's delayed path: it
    # all-reduces, without waiting, from a hook that fires before their gradients are accumulated.)
    models = [make() for _ in range(2)]
    native = NativeDDP(models[0], bucket_cap_mb=CAP_MB)
    ours = DistributedDataParallel(models[1], bucket_cap_mb=CAP_MB, transport=transport,
                                   delay_all_reduce_named_params=[("fc1.weight", models[1].fc1.weight)],
                                   param_to_hook_all_reduce=models[1].head.weight)
    compare("delay_all_reduce", transport, native, ours, sgd_steps(3))


class HeadCheckpointed(nn.Module):
    """The last layer under reentrant activation checkpointing: its gradients, the first of the
    backward pass, arrive inside a nested pass that ends before the other layers' begin."""

    def forward(self, x, use_branch=False):
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return torch.utils.checkpoint.checkpoint(self.head, h, use_reentrant=True)


class SharedCheckpointed(nn.Module):
    """ALBERT's shape: one layer applied twice, each time under reentrant checkpointing, so its
    gradient hooks fire twice per backward (native supports it with static_graph=True)."""

    def forward(self, x, use_branch=False):
        h = torch.relu(self.fc1(x))
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.fc2(t)), h, use_reentrant=True)
        return self.head(h)


def script_patterns(transport):
    """Patterns from public training scripts that once broke: a frozen layer with per-rank
    initialisation (nanoGPT's seed offset: DDP broadcasts rank 0's frozen weights too), the last
    block under reentrant checkpointing without static_graph, and accumulation micro-steps run
    through ddp.module with the last one through the wrapper."""
    rank = dist.get_rank()

    def frozen_per_rank(m):
        with torch.no_grad():
            for q in m.parameters():
                q.add_(0.01 * rank)
        m.fc1.weight.requires_grad_(False)
        return m

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB}, edit=frozen_per_rank)
    compare("frozen_per_rank_init", transport, native, ours, sgd_steps(3))

    def head_checkpointed(m):
        m.__class__ = type("Net", (HeadCheckpointed, type(m)), {})
        return m

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB}, edit=head_checkpointed)
    compare("checkpoint_last_reentrant", transport, native, ours, sgd_steps(3))

    def shared_checkpointed(m):
        m.__class__ = type("Net", (SharedCheckpointed, type(m)), {})
        return m

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB, "static_graph": True}, edit=shared_checkpointed)
    compare("static_graph_shared_checkpointed", transport, native, ours, sgd_steps(4))

    def module_microsteps(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            loss_of(ddp.module, 2 * step, rank).backward()
            loss_of(ddp, 2 * step + 1, rank).backward()
            opt.step()

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB})
    compare("module_microsteps", transport, native, ours, module_microsteps)

    refused = []

    def copies(ddp):
        """An EMA kept with copy.deepcopy(ddp), swa_utils.AveragedModel(ddp), and a torch.save/load
        of the wrapper: compared through the module (its parameters become EMA + SWA + loaded)."""
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        ema, swa = copy.deepcopy(ddp), AveragedModel(ddp)
        for step in range(3):
            opt.zero_grad()
            loss_of(ddp, step, rank).backward()
            opt.step()
            swa.update_parameters(ddp)
            with torch.no_grad():
                for e, q in zip(ema.parameters(), ddp.parameters(), strict=True):
                    e.lerp_(q, 0.1)
        saved = io.BytesIO()
        torch.save(ddp, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        with torch.no_grad():
            out = ema(batch(9, rank)[0]) + swa(batch(9, rank)[0]) + loaded(batch(9, rank)[0])
            for q, e, a, l in zip(ddp.parameters(), ema.parameters(), swa.module.parameters(), loaded.parameters()):
                q.copy_(e + a + l + out.mean())
        if isinstance(ddp, DistributedDataParallel):  # portddp's copy refuses to train alone
            try:
                loss_of(ema, 0, rank).backward()
            except RuntimeError as e:
                refused.append("does not synchronise gradients" in str(e))

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB})
    compare("copies", transport, native, ours, copies, copy_refuses_backward=lambda: refused == [True])


class EmptyFirst(nn.Module):
    """A zero-element parameter registered before the model's (the last bucket, alone, with a
    small cap: on c10d, the one whose all-reduce also carries the used counts)."""

    def __init__(self, inner):
        super().__init__()
        self.empty = nn.Parameter(torch.empty(0, 8))
        self.inner = inner

    def forward(self, x):
        return self.inner(x + self.empty.sum())  # (its gradient comes last: the last bucket after the rebuild too)


class ChannelsLastNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(99)
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def layouts_and_freezing(transport):
    """Found by a bug hunt (2026-12-05): a zero-element parameter (c10d crashed copying the last
    bucket's counts into it); channels_last weights (since 2026-12-06 bucketed in memory order, as
    native's: PowerSGD on them is bitwise native's -- it was 5e-3 apart with C order --, and with
    gradient_as_bucket_view .grad has native's strides); a layer frozen mid-training with
    find_unused_parameters (native treats it as unused; portddp refused it as a changed model)."""
    rank = dist.get_rank()
    # (2 KB: fc1's weight and bias fill a bucket, which the empty parameter then cannot join)
    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": 2048 / 2**20}, edit=EmptyFirst)
    compare("zero_size_param", transport, native, ours, sgd_steps(3))

    def conv_steps(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(5):
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
            ddp(x).square().mean().backward()
            opt.step()

    def strides(ddp):
        return [None if p.grad is None else p.grad.stride() for p in ddp.module.parameters()]

    for view, hook in ((False, False), (True, False), (False, True)):
        models = [ChannelsLastNet().to(memory_format=torch.channels_last) for _ in range(2)]
        native = NativeDDP(models[0], gradient_as_bucket_view=view)
        ours = DistributedDataParallel(models[1], gradient_as_bucket_view=view, transport=transport)
        if hook:  # PowerSGD reads each slot as a C-order matrix: the same elements as native's only
            for ddp in (native, ours):  # if the slot holds them in the same (memory) order
                ddp.register_comm_hook(powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5),
                    powerSGD_hook.powerSGD_hook)
        name = "channels_last" + ("_view" if view else "") + ("_powersgd" if hook else "")
        compare(name, transport, native, ours, conv_steps,
                grad_strides_as_native=lambda native=native, ours=ours: strides(native) == strides(ours))

    def freeze_at_step_1(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            if step == 1:
                ddp.module.fc1.weight.requires_grad_(False)
            opt.zero_grad()
            loss_of(ddp, step, rank).backward()
            opt.step()

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB, "find_unused_parameters": True})
    compare("freeze_later_unused", transport, native, ours, freeze_at_step_1)


class HeadFirst(nn.Module):
    """The head registered first, used last: registration order is not the backward's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.head = nn.Linear(32, OUT)
        self.fc1 = nn.Linear(IN, 32)
        self.fc2 = nn.Linear(32, 32)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class LazyStat(nn.Module):
    """No buffers when wrapped; the first forward registers one holding the rank's own batch mean."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        if not hasattr(self, "mu"):
            self.register_buffer("mu", x.mean(0).detach().clone())
        return self.fc(x - self.mu)


class ComplexWeight(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.fc = nn.Linear(IN, OUT)
        self.w = nn.Parameter(0.1 * torch.randn(IN, OUT, dtype=torch.complex64))

    def forward(self, x):
        return self.fc(x) + (x.to(torch.complex64) @ self.w).abs()


def recording_hook(log):
    """A comm hook that notes each bucket's parameters (shapes) and averages it, as allreduce_hook."""
    def hook(_state, bucket):
        log.append((bucket.index(), [tuple(p.shape) for p in bucket.parameters()]))
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
    return hook


def user_hooks_and_plans(transport):
    """Found by a review of unseen models (2026-12-06), each once different from native: a
    post-accumulate-grad hook the script registers after wrapping (native reduces what it leaves,
    whatever the registration order); find_unused_parameters' buckets (native never re-plans them:
    filled in registration order); a buffer registered after wrapping a module that had none
    (native never broadcasts it); PyTorch's allreduce_hook on complex parameters; pruning after
    wrapping (the same Parameter objects renamed)."""
    bound = 2.0**-10  # (exact in float32)

    def clamp(p):
        p.grad.clamp_(-bound, bound)

    def clamped_steps(ddp):
        for p in ddp.module.parameters():
            p.register_post_accumulate_grad_hook(clamp)
        sgd_steps(3)(ddp)

    native, ours = pair(transport)
    compare("post_accumulate_hook_after_wrap", transport, native, ours, clamped_steps,
            grad_as_native=lambda: max(p.grad.abs().max().item() for p in ours.module.parameters()) <= bound)

    logs = {}
    models = [HeadFirst() for _ in range(2)]
    kw = {"bucket_cap_mb": 2500 / 2**20, "find_unused_parameters": True}
    native, ours = NativeDDP(models[0], **kw), DistributedDataParallel(models[1], transport=transport, **kw)
    for name, ddp in (("native", native), ("ours", ours)):
        ddp.register_comm_hook(None, recording_hook(logs.setdefault(name, [])))
    compare("unused_buckets_as_native", transport, native, ours, sgd_steps(3),
            buckets_as_native=lambda: logs["native"] == logs["ours"])

    models = [LazyStat() for _ in range(2)]
    native, ours = NativeDDP(models[0]), DistributedDataParallel(models[1], transport=transport)
    compare("buffer_registered_after_wrap", transport, native, ours, sgd_steps(3))

    models = [ComplexWeight() for _ in range(2)]
    native, ours = NativeDDP(models[0]), DistributedDataParallel(models[1], transport=transport)
    for ddp in (native, ours):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    compare("complex_allreduce_hook", transport, native, ours, sgd_steps(3))

    def pruned_steps(ddp):
        prune.l1_unstructured(ddp.module.fc2, "weight", amount=0.3)
        sgd_steps(2)(ddp)
        prune.remove(ddp.module.fc2, "weight")
        sgd_steps(2)(ddp)

    native, ours = pair(transport)
    compare("pruned_after_wrap", transport, native, ours, pruned_steps)


def frozen_teacher(transport):
    """DINO's teacher (facebookresearch/dino main_dino.py): wrapped, then frozen (requires_grad=False)
    after wrapping, run under no_grad only and updated as an EMA of the student -- native trains it
    (its reducer keeps the parameters, no backward ever asks for them); portddp once refused it as a
    changed model."""
    rank = dist.get_rank()
    for name, wrap in (("native", lambda m: NativeDDP(m)),
                       ("ours", lambda m: DistributedDataParallel(m, transport=transport))):
        student, teacher = wrap(make(batchnorm=True)), wrap(make(batchnorm=True))
        for p in teacher.parameters():
            p.requires_grad = False
        opt = torch.optim.SGD(student.parameters(), lr=0.05)
        for step in range(3):
            x, _ = batch(step, rank)
            with torch.no_grad():
                target = teacher(x).softmax(-1)
            loss = -(target * student(x).log_softmax(-1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s_ in zip(teacher.module.parameters(), student.module.parameters()):
                    t.mul_(0.9).add_(0.1 * s_)
        if name == "native":
            native = (student, teacher)
    (d1, eq1), (d2, eq2) = max_diff(native[0].module, student.module), max_diff(native[1].module, teacher.module)
    report(f"frozen_teacher/{transport}", max_diff=max(d1, d2), bitwise=eq1 and eq2)


def checkpoint_state_dict(transport):
    """torch.distributed.checkpoint's state-dict API (a review, 2026-12-06: its keys kept portddp's `module.`
    prefix, which it strips for native's class only -- so a checkpoint of one did not load into the other,
    and a full state dict did not load into the bare model). Keys as native's; native's model and optimizer
    state set into portddp's wrapper; portddp's full state dict into the bare model: then both train alike."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict)

    native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB})
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (native, ours)]
    for m, opt in ((native, opts[0]), (ours, opts[1])):
        loss_of(m, 0, dist.get_rank()).backward()
        opt.step()
    (n_model, n_optim), (o_model, o_optim) = get_state_dict(native, opts[0]), get_state_dict(ours, opts[1])
    keys = [list(n_model), list(o_model), list(n_optim["state"]), list(o_optim["state"])]
    fresh = DistributedDataParallel(make(), bucket_cap_mb=CAP_MB, transport=transport)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    # (copies: the optimizer would keep native's own state tensors, which native's steps below update)
    set_state_dict(fresh, fresh_opt, model_state_dict=copy.deepcopy(n_model), optim_state_dict=copy.deepcopy(n_optim))
    bare = make()
    bare.load_state_dict(get_model_state_dict(fresh, options=StateDictOptions(full_state_dict=True)))
    loaded = max_diff(native.module, bare)[1]

    def adam_steps(opt):
        def train(ddp):
            for step in range(1, 4):
                opt.zero_grad()
                loss_of(ddp, step, dist.get_rank()).backward()
                opt.step()
        return train

    adam_steps(opts[0])(native)
    adam_steps(fresh_opt)(fresh)
    diff, equal = max_diff(native.module, fresh.module)
    report(f"checkpoint_state_dict/{transport}", max_diff=diff, bitwise=equal, keys_as_native=keys[0] == keys[1]
           and keys[2] == keys[3] and not any(k.startswith("module.") for k in keys[1]), loaded_into_bare=loaded)


class Twice(nn.Module):
    """One tensor returned under two names (as HF models return the last hidden state twice)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.l = nn.Linear(IN, OUT)

    def forward(self, x):
        h = self.l(x)
        return {"logits": h, "feat": h}


def outputs_through_the_sink(transport):
    """Native passes the outputs through its _DDPSink (clones) with find_unused_parameters (no_sync
    forwards too) and in static_graph's first iteration only (an audit, 2026-12-07: portddp cloned in
    every static_graph iteration and never with find_unused_parameters). A script that scales one
    of two aliased outputs in place, and one that clamps a sigmoid output in place (an error on
    autograd's saved output unless it is a clone), train as native."""
    rank = dist.get_rank()

    def aliased(micro):
        def train(ddp):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            for step in range(3):
                opt.zero_grad()
                for k in range(micro):
                    with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                        out = ddp(batch(micro * step + k, rank)[0])
                        out["logits"].mul_(2.0)
                        out["feat"].pow(2).sum().backward()
                opt.step()
        return train

    for name, kw, micro in (("sink_find_unused", {"find_unused_parameters": True}, 1),
                            ("sink_find_unused_nosync", {"find_unused_parameters": True}, 2),
                            ("sink_static_graph", {"static_graph": True}, 1),
                            ("sink_plain", {}, 1)):
        native, ours = (NativeDDP(Twice(), **kw), DistributedDataParallel(Twice(), transport=transport, **kw))
        compare(name, transport, native, ours, aliased(micro))

    def clamped(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step, rank)
            out = ddp(x)
            out.clamp_(1e-4, 1 - 1e-4)
            nn.functional.binary_cross_entropy(out, torch.sigmoid(y)).backward()
            opt.step()

    native, ours = pair(transport, ddp_kw={"find_unused_parameters": True},
                        edit=lambda m: nn.Sequential(m, nn.Sigmoid()))
    compare("sink_sigmoid_clamped", transport, native, ours, clamped)


def gradient_penalty(transport):
    """WGAN-GP / R1: torch.autograd.grad(out.sum(), x, create_graph=True) -- a pass through the outputs
    that reaches no parameter -- before the loss's backward. With the outputs through the sink
    (find_unused_parameters) it ended the iteration with no gradients in it, and the real backward was
    refused (a review, 2026-12-07); native trains."""
    rank = dist.get_rank()

    def penalised(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad()
            x = batch(step, rank)[0].requires_grad_(True)
            out = ddp(x)
            (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.square().mean() + grad_x.square().mean()).backward()
            opt.step()

    for name, kw in (("penalty_find_unused", {"find_unused_parameters": True}), ("penalty_plain", {})):
        native, ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB, **kw})
        compare(name, transport, native, ours, penalised)
    # static_graph: native's first iteration reduces at the end of the penalty's pass, before any gradient,
    # and its ranks end apart (checked by hand, 2026-12-07); portddp's stay equal.
    ours = pair(transport, ddp_kw={"bucket_cap_mb": CAP_MB, "static_graph": True})[1]
    penalised(ours)
    report(f"penalty_static_graph/{transport}", ranks_agree=same_on_every_rank(ours.module.parameters()))


class SparseNet(nn.Module):
    """Embedding tables with sparse gradients (nn.Embedding / nn.EmbeddingBag(sparse=True)) before a
    dense head: native DDP reduces each such gradient alone, as a sparse tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(77)
        self.emb = nn.Embedding(40, 6, sparse=True)
        self.bag = nn.EmbeddingBag(30, 6, mode="sum", sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, ids, bag_ids=None):
        h = self.emb(ids).mean(1)
        return self.fc(h if bag_ids is None else h + self.bag(bag_ids))


def sparse_loss(ddp, step, rank, use_bag=True):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids, bag_ids = torch.randint(0, 40, (5, 4), generator=g), torch.randint(0, 30, (5, 3), generator=g)
    return ddp(ids, bag_ids if use_bag else None).square().mean()


def sparse_embeddings(transport):
    """Sparse gradients, as native reduces them (Gloo's sparse all-reduce; on MPI the same arithmetic):
    SparseAdam beside Adam; a table used on some ranks only (find_unused_parameters); no_sync
    accumulation; gradient_as_bucket_view with static_graph; a comm hook (PyTorch's allreduce_hook,
    which gets the sparse gradient as its bucket's buffer); join() with uneven inputs."""
    rank = dist.get_rank()

    def pair_sparse(**kw):
        return NativeDDP(SparseNet(), **kw), DistributedDataParallel(SparseNet(), transport=transport, **kw)

    def adam(ddp):
        m = ddp.module
        opts = [torch.optim.SparseAdam([m.emb.weight, m.bag.weight], lr=0.05), torch.optim.Adam(m.fc.parameters(), lr=0.05)]
        for step in range(4):
            for opt in opts:
                opt.zero_grad()
            sparse_loss(ddp, step, rank).backward()
            for opt in opts:
                opt.step()

    def sgd(micro=1, use_bag=lambda step: True):
        def train(ddp):
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(4):
                opt.zero_grad()
                for k in range(micro):
                    with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                        sparse_loss(ddp, micro * step + k, rank, use_bag(micro * step + k)).backward()
                opt.step()
        return train

    def layouts(ddp):  # (after training: the reduced gradients are sparse and coalesced, as native's)
        return [(p.grad.layout, p.grad.is_coalesced()) for p in (ddp.module.emb.weight, ddp.module.bag.weight)]

    for name, kw, train in (
            ("sparse_adam", {"bucket_cap_mb": CAP_MB}, adam),
            ("sparse_nosync", {}, sgd(micro=2)),
            ("sparse_view_static", {"gradient_as_bucket_view": True, "static_graph": True}, sgd())):
        native, ours = pair_sparse(**kw)
        compare(name, transport, native, ours, train, grad_as_native=lambda: layouts(ours) == layouts(native))

    native, ours = pair_sparse()
    for ddp in (native, ours):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    compare("sparse_hook", transport, native, ours, sgd())

    def uneven_sparse(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.join():
            for step in range(2 + rank):
                opt.zero_grad()
                sparse_loss(ddp, step, rank).backward()
                opt.step()

    native, ours = pair_sparse()
    compare("sparse_join", transport, native, ours, uneven_sparse)

    # A table used on some ranks only (find_unused_parameters), where native's reducer fails ("Expected
    # sparse gradient to be defined"): portddp reduces an empty gradient for it there. Against the same
    # training with dense tables (sparse=False), which differs only in how repeated rows are summed.
    def dense_tables(m):
        m.emb.sparse = m.bag.sparse = False
        return m

    sparse, dense = (DistributedDataParallel(m, transport=transport, find_unused_parameters=True, bucket_cap_mb=CAP_MB)
                     for m in (SparseNet(), dense_tables(SparseNet())))
    train = sgd(use_bag=lambda step: (step + rank) % 2 == 0)
    train(sparse)
    train(dense)
    diff, _ = max_diff(sparse.module, dense.module)
    report(f"sparse_unused_vs_dense/{transport}", max_diff=diff, ranks_agree=same_on_every_rank(sparse.module.parameters()))

    # (an audit, 2026-12-07) Two tables summed in the forward get gradients whose values share memory: native
    # divides them in place, twice (half the mean); portddp divides copies -- as the dense tables train.
    class Summed(SparseNet):
        def forward(self, ids, bag_ids=None):
            return self.fc(self.emb(ids) + self.emb2(ids % 7)).mean(1)

    def summed(sparse_tables):
        torch.manual_seed(3)
        m = Summed()
        m.emb2 = nn.Embedding(7, 6, sparse=sparse_tables)
        m.emb.sparse = sparse_tables
        return DistributedDataParallel(m, transport=transport, find_unused_parameters=True)  # (the bag: unused)

    sparse, dense = summed(True), summed(False)
    for ddp in (sparse, dense):
        sgd()(ddp)
    report(f"sparse_tables_summed/{transport}", max_diff=max_diff(sparse.module, dense.module)[0])
    refused = ""
    ddp = DistributedDataParallel(SparseNet(), transport=transport)
    ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    try:
        sgd()(ddp)
    except RuntimeError as e:
        refused = str(e)
    report(f"sparse_powersgd/{transport}", refused="PowerSGD compresses dense buckets" in refused)

    # (a review, 2026-12-07) static_graph, the bag unused on rank 1 after the first step while its .grad stays
    # from before (zero_grad(set_to_none=False)): the mean replaces it there too, as a dense gradient's would.
    ddp = DistributedDataParallel(SparseNet(), transport=transport, static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        sparse_loss(ddp, step, rank, use_bag=step == 0 or rank == 0).backward()
    static_unused_equal = same_on_every_rank([ddp.module.bag.weight.grad.to_dense()])
    # check_finite: a NaN on one rank leaves .grad as it was on every rank -- the sparse one too.
    ddp = DistributedDataParallel(SparseNet(), transport=transport, check_finite=True)
    sparse_loss(ddp.module, 0, rank).backward()  # (through the module: this rank's own gradient)
    local = ddp.module.emb.weight.grad.coalesce()
    ddp.module.emb.weight.grad = None
    refused = False
    try:
        (sparse_loss(ddp, 0, rank) * (float("nan") if rank == 1 else 1.0)).backward()
    except FloatingPointError as e:
        refused = "non-finite gradients" in str(e)
    kept = ddp.module.emb.weight.grad.coalesce()  # (rank 0's: what its own backward gave, not divided or summed)
    report(f"sparse_review/{transport}", static_unused_equal=static_unused_equal,
           finite_grad_untouched=refused and (rank != 0 or torch.equal(kept.indices(), local.indices()) and
                                              torch.equal(kept.values(), local.values())))


def uneven_effective_world(transport):
    uneven(transport, divide_by_initial_world_size=False)


SCENARIOS = [native_signature, module_interface, compiled, accumulation, amp, uneven, uneven_effective_world, join_before_the_rebuild, late_hook, builtin_hooks,
             uneven_throw, powersgd, buffer_sync, nosync_unused, join_unused,
             static_graph_checkpoint, static_graph_ignored_output, undefined_grad, rewrap, init_and_delay,
             script_patterns, layouts_and_freezing, user_hooks_and_plans, frozen_teacher,
             static_graph_dataclass_output, checkpoint_state_dict, padding_hook, forwards_per_backward, rank0_eval, fused_optim,
             sparse_embeddings, outputs_through_the_sink, gradient_penalty]


def main():
    portddp.init()
    warnings.filterwarnings("ignore", category=FutureWarning)
    transports = [a for a in sys.argv[1:] if a in ("c10d", "mpi")] or ["c10d", "mpi"]
    only = [a for a in sys.argv[1:] if a not in ("c10d", "mpi")]
    for transport in transports:
        for scenario in SCENARIOS:
            if not only or getattr(scenario, "__name__", "") in only:
                scenario(transport)


if __name__ == "__main__":
    main()
