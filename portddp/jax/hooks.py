"""Communication hooks for portddp.jax: the same idea and names as portddp.torch.hooks.

A hook is `hook(state, bucket) -> Handle` (portddp.transport.Handle); once the
handle is done, `bucket.buffer()` holds the reduced flat gradients. Gradients
reach the bucket undivided when a hook is registered: the hook divides, before
the sum, so half precision sums do not overflow.

    ddp.register_comm_hook(None, fp16_compress_hook)
    ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=10, ddp=ddp),
                           powerSGD_hook)
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np

from portddp.shm import torch_half, torch_serially
from portddp.transport import Handle

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "noop_hook", "PowerSGDState",
           "powerSGD_hook"]


def allreduce_hook(state, bucket) -> Handle:
    """Mean over ranks: divide, then sum. `ddp.register_comm_hook(None, allreduce_hook)`"""
    buffer = bucket.buffer()
    np.multiply(buffer, 1.0 / bucket.world_size, out=buffer, casting="unsafe")
    return bucket.allreduce(buffer)


def _compress_hook(bucket, dtype) -> Handle:
    buffer = bucket.buffer()
    torch = _torch_for_half(buffer)
    # Cast, then divide (by the world size itself, as PyTorch's hook) before the sum: a sum of
    # undivided float16 gradients overflows first.
    if torch is not None:
        compressed = np.empty(buffer.shape, dtype)
        src, dst = torch.from_numpy(buffer.reshape(-1)), torch_half(torch, compressed)
        for part in torch_serially(buffer.size):  # (no OpenMP team on this callback thread)
            dst[part].copy_(src[part]).div_(bucket.world_size)
    else:
        compressed = (buffer.astype(dtype).astype(np.float32) / np.float32(bucket.world_size)).astype(dtype)

    def decompress(handle):
        result = handle.result
        if torch is not None and result.flags.writeable and result.flags.c_contiguous:
            src, dst = torch_half(torch, result), torch.from_numpy(buffer.reshape(-1))
            for part in torch_serially(buffer.size):
                dst[part].copy_(src[part])
        else:
            buffer[...] = result
        return buffer

    return bucket.allreduce(compressed).then(decompress)


def _torch_for_half(buffer: np.ndarray):
    """torch, to cast a float32 bucket to float16 or bfloat16 and back and to divide it (and, once
    loaded, to sum it: portddp.shm.half_add): numpy converts float16 one element at a time -- cast,
    divide, sum and cast back ~13 ns an element here, ~1 in torch's vectorised loops (bfloat16 through
    ml_dtypes ~4), the same values but for NaN payloads (a gpt step's fp16 hook took 10 x bf16's).
    portddp depends on torch; a JAX rank loads it only here, as for PowerSGD. A float64 bucket stays
    with numpy, which rounds it to 16 bits once (torch goes through float32)."""
    if buffer.dtype != np.float32 or not buffer.flags.c_contiguous:
        return None
    import torch  # noqa: PLC0415

    return torch


def fp16_compress_hook(state, bucket) -> Handle:
    """Reduce in float16 (half the bytes). `ddp.register_comm_hook(None, fp16_compress_hook)`"""
    return _compress_hook(bucket, np.float16)


def bf16_compress_hook(state, bucket) -> Handle:
    """Reduce in bfloat16: float32's range, float16's bytes. `ddp.register_comm_hook(None, bf16_compress_hook)`"""
    return _compress_hook(bucket, ml_dtypes.bfloat16)


def noop_hook(state, bucket) -> Handle:
    """No communication at all: the headroom measurement (gradients stay local, undivided).
    `ddp.register_comm_hook(None, noop_hook)`"""
    return Handle.completed(bucket.buffer())


# --------------------------------------------------------------------------- PowerSGD
# Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
# Optimization" (NeurIPS 2019), with the choices of PyTorch's powerSGD_hook, so that the two
# train alike (tests/test_jax_powersgd.py compares them step by step).


class PowerSGDState:
    """PowerSGD's settings and what it remembers between iterations (the names of PyTorch's
    `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`).

        ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=10),
                               powerSGD_hook)

    Args:
        process_group: only None (accepted so PyTorch-style calls run unchanged): the hook
            reduces on the DDP's own transport.
        matrix_approximation_rank: r; each compressed gradient matrix M (n x m) travels as
            P (n x r) and Q (m x r). Lower is smaller and coarser.
        start_powerSGD_iter: plain all-reduce for this many iterations first (PowerSGD is biased;
            a warm-up helps). Must be > 1 with error feedback or warm start: the bucket plan is
            rebuilt after the first iteration, and the remembered per-bucket state assumes it fixed.
        min_compression_rate: compress a matrix only when n*m > (n+m)*r * min_compression_rate;
            the others go uncompressed, in one all-reduce with the bucket's Ps.
        use_error_feedback: remember what compression lost (per bucket) and add it to the next
            iteration's gradients.
        warm_start: start each iteration's power step from the last iteration's Q instead of a
            fresh random one.
        orthogonalization_epsilon: added to each column norm in Gram-Schmidt (guards all-zero columns).
        random_seed: seeds `rng`, which draws one seed per random Q initialisation, in bucket order.
        ddp: not needed (GradBucket.gradients() gives the per-parameter views); kept for a
            bucket object without gradients(), whose DDP's bucket_plan then gives the shapes.
    """

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0, ddp=None):
        if process_group is not None:
            raise ValueError("portddp.jax's PowerSGD reduces on the DDP's own transport: pass process_group=None")
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                "start_powerSGD_iter must be > 1 with error feedback or warm start: the bucket plan is rebuilt "
                "after the first iteration, and PowerSGD's per-bucket memory assumes the plan no longer changes")
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.ddp = ddp
        # Draws the seed of each random initialisation of Q, in the same order on every rank.
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, np.ndarray] = {}  # bucket index -> what compression lost there
        self.q_memory_dict: dict[int, np.ndarray] = {}  # bucket index -> last Qs (warm start)
        self.iter = 0  # iterations finished (advanced by the last bucket of each)
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, elements before, elements after), summed over every compressed bucket."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after else 0.0), before, after


def _bucket_gradients(state: PowerSGDState, bucket) -> list[np.ndarray]:
    """One view of the bucket buffer per parameter, shaped like it (PyTorch's bucket.gradients())."""
    if hasattr(bucket, "gradients"):
        return list(bucket.gradients())
    if state.ddp is None:
        raise TypeError("powerSGD_hook needs each parameter's shape in the bucket: pass the DDP as "
                        "PowerSGDState(..., ddp=ddp)")
    plan = state.ddp.bucket_plan
    planned, buffer = plan.buckets[bucket.index()], bucket.buffer()
    if planned.numel != buffer.size:
        raise RuntimeError(f"bucket {bucket.index()} holds {buffer.size} elements but the plan says {planned.numel}")
    return [buffer[off:off + plan.specs[k].numel].reshape(plan.specs[k].shape)
            for k, off in zip(planned.params, planned.offsets)]


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision buckets are compressed in float32 (numpy has no fast half matmul); P and Q
    still travel in the bucket's dtype."""
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def _orthogonalize(matrix: np.ndarray, epsilon: float = 0) -> None:
    """Orthonormalise the columns of `matrix` (n x r) in place: Gram-Schmidt for r <= 2, as PyTorch
    does (and always for half precision), else a QR factorisation."""
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype.itemsize >= 4:
        matrix[...] = np.linalg.qr(matrix, mode="reduced")[0]
        return
    work = matrix.astype(_compute_dtype(matrix.dtype), copy=False)
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero column gives NaN, as in PyTorch
        for i in range(rank):
            col = work[:, i:i + 1]
            col /= np.sqrt(np.sum(col * col, axis=0, keepdims=True)) + epsilon
            if i + 1 < rank:
                rest = work[:, i + 1:]
                rest -= np.sum(col * rest, axis=0, keepdims=True) * col
    if work is not matrix:
        matrix[...] = work


def _random_normal(shapes: list[tuple[int, ...]], seed: int, dtype: np.dtype) -> list[np.ndarray]:
    """Standard normal arrays drawn one after another from torch.Generator().manual_seed(seed):
    the very numbers PyTorch's powerSGD_hook draws for the same seed, so both start from the same Q."""
    import torch  # noqa: PLC0415 -- portddp depends on torch; imported only when PowerSGD initialises a Q

    generator = torch.Generator().manual_seed(int(seed))
    torch_dtype = torch.float64 if dtype == np.float64 else torch.float16 if dtype == np.float16 else torch.float32
    if dtype == ml_dtypes.bfloat16:
        torch_dtype = torch.bfloat16
    draws = [torch.randn(shape, generator=generator, dtype=torch_dtype) for shape in shapes]
    if torch_dtype == torch.bfloat16:  # numpy has no bfloat16: through float32, exactly
        return [d.float().numpy().astype(dtype) for d in draws]
    return [d.numpy() for d in draws]


class _PowerSGDHandle(Handle):
    """The handle powerSGD_hook returns. Its first collective (the uncompressed gradients and the
    Ps) is under way when the hook returns; `wait()` finishes the bucket -- orthogonalise P,
    Q = M^T P, all-reduce the Qs, M = P Q^T / world -- on the waiting thread. The Q all-reduce is
    launched there, not from the comm thread when the Ps arrive: DDP waits for its buckets in plan
    order after launching them all, so every rank issues its collectives in the same order (a
    launch from the comm thread could land before or after the next bucket's, differently per rank)."""

    __slots__ = ("_rest",)

    def __init__(self, first: Handle, finish):
        super().__init__()
        self.launch_ns = first.launch_ns
        self._rest = finish

    def wait(self, timeout: float | None = None):
        if self._rest is not None:
            finish, self._rest = self._rest, None
            self.start_ns = time.perf_counter_ns()
            try:
                self.result = finish()
            except BaseException as e:
                self._error = e
            self.done_ns = time.perf_counter_ns()
            self._finish()
        return super().wait(timeout)


def powerSGD_hook(state: PowerSGDState, bucket) -> Handle:
    """PowerSGD gradient compression (PyTorch's `powerSGD_hook`, on numpy buffers).

    Before `state.start_powerSGD_iter` iterations: a plain mean (`allreduce_hook`). Then, per bucket:
    add the remembered error; view each gradient as a matrix M (its first dimension by the rest);
    matrices worth compressing (`min_compression_rate`) go as M ~ P Q^T of rank r, the others as
    they are. One all-reduce carries the uncompressed gradients and every P = M Q (Q: last
    iteration's with warm start, else random); after it, orthogonalise each P, all-reduce every
    Q = M^T P, and write M = P Q^T / world. The error is what this rank's gradients lost.

        ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=10),
                               powerSGD_hook)
    """
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(None, bucket)

    b, world = bucket.index(), bucket.world_size
    buffer = bucket.buffer()
    dtype = buffer.dtype
    work = _compute_dtype(dtype)

    if state.use_error_feedback:
        if b in state.error_dict and state.error_dict[b].shape == buffer.shape:
            buffer += state.error_dict[b]
        local = buffer.copy()  # with the error added: what this rank wants reduced
    tensors = _bucket_gradients(state, bucket)

    # Which gradients to compress, as (n x m) matrices of rank r; grouped by shape, first seen
    # first (PyTorch's order, which fixes the order of the Ps and Qs and of the random draws).
    by_shape: dict[tuple[int, int], list[np.ndarray]] = {}
    uncompressed = []
    for tensor in tensors:
        if tensor.size == 0:  # nothing to compress (nor to reshape into a matrix)
            uncompressed.append(tensor)
            continue
        matrix = tensor.reshape(tensor.shape[0] if tensor.ndim else 1, -1)
        if not np.shares_memory(matrix, buffer):
            raise RuntimeError(f"bucket {b}: a gradient is not a contiguous view of the bucket buffer")
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if (n + m) * r * state.min_compression_rate < n * m:
            by_shape.setdefault((n, m), []).append(matrix)
            state.total_numel_after_compression += (n + m) * r
        else:
            uncompressed.append(tensor)
            state.total_numel_after_compression += n * m
    matrices = [mat for group in by_shape.values() for mat in group]
    ranks = [min(*mat.shape, state.matrix_approximation_rank) for mat in matrices]

    # Q: last iteration's (orthogonalised again), or fresh random ones.
    q_sizes = [mat.shape[1] * r for mat, r in zip(matrices, ranks)]
    q_memory = state.q_memory_dict.get(b)
    if not state.warm_start or q_memory is None or q_memory.size != sum(q_sizes):
        q_memory = np.empty(sum(q_sizes), dtype)
        draws = _random_normal([(1, mat.shape[1], r) for mat, r in zip(matrices, ranks)],
                               state.rng.randint(1_000_000_000), dtype)
        offset = 0
        for draw, size in zip(draws, q_sizes):
            q_memory[offset:offset + size] = draw.reshape(-1)
            offset += size
        state.q_memory_dict[b] = q_memory
    qs, offset = [], 0
    for mat, r in zip(matrices, ranks):
        qs.append(q_memory[offset:offset + mat.shape[1] * r].reshape(mat.shape[1], r))
        offset += mat.shape[1] * r
    for q in qs:
        _orthogonalize(q, state.orthogonalization_epsilon)

    # One all-reduce: [uncompressed gradients | P of every matrix].
    n_flat = sum(t.size for t in uncompressed)
    first = np.empty(n_flat + sum(mat.shape[0] * r for mat, r in zip(matrices, ranks)), dtype)
    offset = 0
    for tensor in uncompressed:
        first[offset:offset + tensor.size] = tensor.reshape(-1)
        offset += tensor.size
    ps = []
    for mat, q, r in zip(matrices, qs, ranks):
        p = first[offset:offset + mat.shape[0] * r].reshape(mat.shape[0], r)
        p[...] = mat.astype(work, copy=False) @ q.astype(work, copy=False)
        ps.append(p)
        offset += p.size
    first_handle = bucket.allreduce(first)

    def finish():
        first_handle.wait()
        offset = 0
        for tensor in uncompressed:  # their mean
            tensor[...] = (first[offset:offset + tensor.size] / world).reshape(tensor.shape)
            offset += tensor.size
        for p in ps:
            _orthogonalize(p, state.orthogonalization_epsilon)
        for mat, p, q in zip(matrices, ps, qs):
            q[...] = mat.astype(work, copy=False).T @ p.astype(work, copy=False)
        if q_memory.size:  # (a bucket with nothing to compress: every rank skips it alike)
            bucket.allreduce(q_memory).wait()
            q_memory[...] /= world
        for mat, p, q in zip(matrices, ps, qs):
            mat[...] = p.astype(work, copy=False) @ q.astype(work, copy=False).T
        if state.use_error_feedback:
            state.error_dict[b] = local - buffer
        if not state.warm_start:
            state.q_memory_dict.pop(b, None)
        state.maybe_increase_iter(bucket)
        return buffer

    return _PowerSGDHandle(first_handle, finish)
