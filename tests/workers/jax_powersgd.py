"""portddp.jax's powerSGD_hook against PyTorch's, run by tests/test_jax_powersgd.py:

    mpirun -n 2 python -m tests.workers.jax_powersgd

Two kinds of scenario, each reporting one JSON line per rank (tests/workers/common.py):

- hook/...: the two hooks alone, on the same gradients. Every rank makes the same random
  per-rank gradients each iteration and hands them to PyTorch's powerSGD_hook (on c10d, in a
  GradBucket-like object) and to portddp.jax's (on portddp's MPI transport); the largest
  difference of the reduced buckets, over all iterations.
- train/...: the same model, weights and batches trained with SGD by torch's native DDP +
  PyTorch's powerSGD_hook and by portddp.jax (strategy="hooked") + portddp.jax's, the JAX
  parameters held in PyTorch's layout ((out, in) weights, so both view each gradient as the
  same matrix). Both record what each bucket holds, so a difference cannot come from the plans.
  train/plain_allreduce (PowerSGD never starts) measures what the two frameworks' own float32
  gradients differ by.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

import portddp

WORLD = portddp.init()  # c10d (native DDP) and MPI (portddp.jax's hooked strategy)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from portddp.data import regression_batch  # noqa: E402
from portddp.jax import Canonical, DistributedDataParallel, GradBucket, PowerSGDState, powerSGD_hook  # noqa: E402
from portddp.jax.comm import MPIComm  # noqa: E402
from tests.workers import common  # noqa: E402

IN, HID, OUT, BATCH, LR = 16, 32, 4, 8, 0.05


# ----------------------------------------------------------------- the hooks alone
class TorchBucket:
    """What PyTorch's powerSGD_hook uses of a torch.distributed.GradBucket."""

    def __init__(self, index, buffer, shapes, num_buckets):
        self._index, self._buffer, self._last = index, buffer, index == num_buckets - 1
        self._grads, off = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            self._grads.append(buffer[off:off + n].view(shape))
            off += n

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def is_last(self):
        return self._last


class JaxBucket(GradBucket):
    """portddp.jax's GradBucket over a hand-made buffer (its gradients() gives the per-parameter views)."""

    def __init__(self, index, buffer, shapes, num_buckets):
        offsets = np.cumsum([0] + [int(np.prod(s)) for s in shapes])[:-1]
        grads = [buffer[o:o + int(np.prod(s))].reshape(s) for o, s in zip(offsets, shapes)]
        super().__init__(index, buffer, [str(s) for s in shapes], grads, num_buckets, MPIComm())


def hooks_alone(name, buckets, iters=6, dtype=np.float32, jax_buckets=None, **kw):
    """`buckets`: per bucket, its parameter shapes (`jax_buckets`: portddp.jax's, if they differ --
    by zero-size ones, which PyTorch's hook cannot reshape). Largest |torch - jax| / max(1, |torch|)
    per iteration."""
    t_state = torch_psgd.PowerSGDState(process_group=None, **kw)
    j_state = PowerSGDState(**kw)
    diffs = []
    for it in range(iters):
        rng = np.random.default_rng([7, it, WORLD.rank])
        grads = [rng.standard_normal(sum(int(np.prod(s)) for s in shapes)).astype(dtype) for shapes in buckets]
        # PyTorch's, one bucket at a time: its hook waits for collectives inside its futures'
        # callbacks, and with several buckets in flight in this bare harness gloo deadlocks.
        # (The order of the buckets' work is the same: each draws its random seed at the call.)
        t_bufs = [torch.from_numpy(g.copy()) for g in grads]
        t_out = [torch_psgd.powerSGD_hook(t_state, TorchBucket(b, t_bufs[b], shapes, len(buckets))).wait().numpy()
                 for b, shapes in enumerate(buckets)]
        # portddp.jax's as DDP calls it: every bucket's hook, then the waits in bucket order.
        j_bufs = [g.copy() for g in grads]
        handles = [powerSGD_hook(j_state, JaxBucket(b, j_bufs[b], shapes, len(buckets)))
                   for b, shapes in enumerate(jax_buckets or buckets)]
        for h in handles:
            h.wait()
        diffs.append(max(float(np.max(np.abs(t - j)) / max(1.0, float(np.max(np.abs(t)))))
                         for t, j in zip(t_out, j_bufs)))
    common.report(WORLD.rank, f"hook/{name}", max_rel=max(diffs), per_iter=diffs, iters=iters,
                  iter_torch=t_state.iter, iter_jax=j_state.iter,
                  compressed_rate_torch=t_state.compression_stats()[0] if t_state.total_numel_after_compression else 0,
                  compressed_rate_jax=j_state.compression_stats()[0])


# ----------------------------------------------------------------- training
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = Affine(IN)
        self.fc1 = nn.Linear(IN, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, OUT)
        self.out = Affine(OUT)

    def forward(self, x):
        return self.out(self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(self.inp(x)))))))


class Affine(nn.Module):
    """x * scale + shift: 1-D parameters only."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.shift = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return x * self.scale + self.shift


def jax_loss(p, batch):
    """Net's forward on parameters in PyTorch's layout: y = x W^T + b."""
    x, y = batch
    x = x * p["inp.scale"] + p["inp.shift"]
    h = jnp.tanh(x @ p["fc1.weight"].T + p["fc1.bias"])
    h = jnp.tanh(h @ p["fc2.weight"].T + p["fc2.bias"])
    return jnp.mean(((h @ p["head.weight"].T + p["head.bias"]) * p["out.scale"] + p["out.shift"] - y) ** 2)


_PLAIN: dict = {}  # train/plain_allreduce's final JAX parameters


def train(name, steps=6, cap_mb=25.0, jax_cap_mb=None, hook=True, **kw):
    torch.manual_seed(1234)
    model = Net()
    names = [n for n, _ in model.named_parameters()]
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}

    # PyTorch: native DDP + PyTorch's hook, recording what each bucket holds.
    ddp_t = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    name_of = {id(p): n for n, p in model.named_parameters()}
    t_seen = []
    t_state = torch_psgd.PowerSGDState(process_group=None, **kw)

    def t_hook(state, bucket):
        t_seen.append([bucket.index(), [name_of[id(p)] for p in bucket.parameters()]])
        return torch_psgd.powerSGD_hook(state, bucket)

    if hook:
        ddp_t.register_comm_hook(t_state, t_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    # portddp.jax: the same parameters, names and registration order.
    jax_cap_mb = jax_cap_mb or cap_mb
    ddp_j = DistributedDataParallel(params, bucket_cap_mb=jax_cap_mb, first_bucket_cap_mb=jax_cap_mb, strategy="hooked",
                                    canonical=[Canonical(jax.tree_util.keystr((jax.tree_util.DictKey(n),)), n, None)
                                               for n in names])
    params = ddp_j.broadcast(params)
    j_state = PowerSGDState(**kw)  # GradBucket.gradients() gives the shapes
    j_seen = []

    def j_hook(state, bucket):
        j_seen.append([bucket.index(), bucket.parameters()])
        return powerSGD_hook(state, bucket)

    if hook:
        ddp_j.register_comm_hook(j_state, j_hook)
    grad_fn = ddp_j.value_and_grad(jax_loss)

    diffs = []
    for step in range(steps):
        x, y = regression_batch(5, step, WORLD.rank, BATCH, IN, OUT)
        opt.zero_grad()
        nn.functional.mse_loss(ddp_t(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        _, grads = grad_fn(params, (x, y))
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
        diffs.append(max(float(np.max(np.abs(p.detach().numpy() - np.asarray(params[n])))
                               / max(1.0, float(p.detach().abs().max())))
                         for n, p in model.named_parameters()))
    # Has PowerSGD done anything? The compressed parameters' mean gradient differs from the plain mean.
    final = {n: np.asarray(params[n]) for n in names}
    if not hook:
        _PLAIN.update(final)
    vs_plain = max((float(np.max(np.abs(final[n] - _PLAIN[n]))) for n in names), default=0.0) if _PLAIN else 0.0
    common.report(WORLD.rank, f"train/{name}", max_rel=max(diffs), vs_plain=vs_plain, per_step=diffs, steps=steps,
                  buckets_torch=t_seen[-len(t_seen) // steps:] if hook else [],
                  buckets_jax=j_seen[-len(j_seen) // steps:] if hook else [],
                  iter_torch=t_state.iter, iter_jax=j_state.iter,
                  rate_jax=j_state.compression_stats()[0], errors=sorted(j_state.error_dict))


def main():
    mlp = [[(OUT,), (OUT, HID), (HID,), (HID, HID), (HID,), (HID, IN)]]
    hooks_alone("rank1", mlp, start_powerSGD_iter=2, min_compression_rate=2)
    hooks_alone("rank1_compress_biases", mlp, start_powerSGD_iter=2, min_compression_rate=0.5)
    hooks_alone("rank2", mlp, matrix_approximation_rank=2, start_powerSGD_iter=3, min_compression_rate=1)
    hooks_alone("rank2_no_warm_start", mlp, matrix_approximation_rank=2, start_powerSGD_iter=2,
                min_compression_rate=1, warm_start=False)
    hooks_alone("rank1_no_error_feedback_no_warm_start", mlp, start_powerSGD_iter=1, use_error_feedback=False,
                warm_start=False)
    # float64: the same algorithm, so the two agree to float64 rounding
    hooks_alone("rank1_float64", mlp, dtype=np.float64, start_powerSGD_iter=2, min_compression_rate=0.5)
    hooks_alone("rank2_float64", mlp, dtype=np.float64, matrix_approximation_rank=2, start_powerSGD_iter=2,
                min_compression_rate=1)
    hooks_alone("rank4_qr", mlp, matrix_approximation_rank=4, start_powerSGD_iter=2, min_compression_rate=1)
    hooks_alone("epsilon", mlp, start_powerSGD_iter=2, orthogonalization_epsilon=1e-8)
    # several buckets, one of them with 1-D gradients only (nothing compressed there)
    hooks_alone("buckets_with_1d_only", [[(OUT,), (HID,), (HID,)], [(OUT, HID)], [(HID, HID), (HID, IN), (3, 4, 5)]],
                start_powerSGD_iter=2)

    # zero-size gradients among them: left uncompressed (no matrix to make), the rest as PyTorch's
    hooks_alone("zero_size_leaves", [[(OUT, HID), (HID,)]], jax_buckets=[[(0, 12), (OUT, HID), (HID,), (0,)]],
                start_powerSGD_iter=2)

    train("plain_allreduce", hook=False)
    train("rank1", start_powerSGD_iter=2)
    train("rank2", matrix_approximation_rank=2, start_powerSGD_iter=3, min_compression_rate=1)
    # portddp.jax in two buckets: all but inp (6960 bytes), then inp's scale and shift (1-D only:
    # nothing compressed, but a random seed drawn, as PyTorch does); PyTorch in one. The matrices get
    # the same first random Qs (the first seed), so the two still agree. (Native DDP + PyTorch's hook
    # is not reliable with several buckets on gloo: it issues its P and Q all-reduces from future
    # callbacks, in an order that can differ per rank (a gloo size mismatch), and with 3+ buckets its
    # callbacks wait on gloo's 2 threads (a deadlock); the hooks-alone scenarios cover several buckets.)
    train("rank1_jax_two_buckets", jax_cap_mb=6960 / 2**20, start_powerSGD_iter=2)
    train("rank2_jax_two_buckets", jax_cap_mb=6960 / 2**20, matrix_approximation_rank=2, start_powerSGD_iter=3,
          min_compression_rate=1)


if __name__ == "__main__":
    main()
    dist.barrier()
