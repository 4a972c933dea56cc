"""Determinism and checkpoint/resume, in two separate jobs (tests/test_reliability.py):

    mpirun -n 2 python -m tests.workers.resume first <dir>    # 10 steps, saving after 5
    mpirun -n 2 python -m tests.workers.resume second <dir>   # 10 steps again; load + 5 steps; torn files

Each case trains a small model with AdamW (PyTorch and Flax NNX: with Dropout,
so the random state matters) and reports a SHA-256 of its final parameters' bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import numpy as np

import portddp

PHASE, OUT = sys.argv[1], Path(sys.argv[2])
WORLD = portddp.init(jax_distributed=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from portddp import checkpoint, launch  # noqa: E402
from portddp.data import regression_batch  # noqa: E402
from tests.workers import common  # noqa: E402

jax.config.update("jax_enable_x64", True)

IN, HID, OUT_DIM, BATCH, STEPS, HALF = 16, 64, 4, 8, 10, 5
IMPLS = ("native", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled", "jax-nnx-hooked", "jax-nnx-compiled")
DTYPES = ("float32", "float64")


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


class TorchCase:
    def __init__(self, impl, dtype, seed=0):
        from portddp.torch import DistributedDataParallel  # noqa: PLC0415

        torch.manual_seed(seed)
        self.dtype = getattr(torch, dtype)
        self.model = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Dropout(0.2), nn.Linear(HID, HID), nn.Tanh(),
                                   nn.Linear(HID, OUT_DIM)).to(self.dtype)
        if impl == "native":
            self.ddp = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=0.01)
        else:
            self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=0.01, first_bucket_cap_mb=0.005,
                                               transport=impl.removeprefix("torch-"))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        torch.manual_seed(1000 + WORLD.rank)  # each rank its own dropout masks

    def train(self, start, stop):
        for step in range(start, stop):
            x, y = (torch.from_numpy(a).to(self.dtype) for a in regression_batch(5, step, WORLD.rank, BATCH, IN,
                                                                                   OUT_DIM, dtype="float64"))
            self.opt.zero_grad()
            nn.functional.mse_loss(self.ddp(x), y).backward()
            self.opt.step()

    def digest(self):
        return digest(p.detach().numpy() for p in self.model.parameters())

    def save(self, path, step, collective=True):
        checkpoint.save(path, self.ddp, step=step, optimizer=self.opt, collective=collective)

    def load(self, path):
        return checkpoint.load(path, self.ddp, optimizer=self.opt).step


class JaxCase:
    def __init__(self, impl, dtype, seed=0):
        from portddp.jax import DistributedDataParallel  # noqa: PLC0415

        k = jax.random.split(jax.random.key(seed), 3)
        self.dtype = dtype
        dims = [(IN, HID), (HID, HID), (HID, OUT_DIM)]
        params = {f"l{i}": {"w": (jax.random.normal(k[i], d) / np.sqrt(d[0])).astype(dtype),
                            "b": jnp.zeros(d[1], dtype)} for i, d in enumerate(dims)}
        self.ddp = DistributedDataParallel(params, bucket_cap_mb=0.01, first_bucket_cap_mb=0.005,
                                           strategy=impl.removeprefix("jax-"))
        self.params = self.ddp.broadcast(params)
        self.tx = optax.adamw(1e-2)
        self.opt_state = self.tx.init(self.params)
        self.grad_fn = self.ddp.value_and_grad(self.loss)
        self.update = jax.jit(self._update)

    @staticmethod
    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["l0"]["w"] + p["l0"]["b"])
        h = jnp.tanh(h @ p["l1"]["w"] + p["l1"]["b"])
        return jnp.mean((h @ p["l2"]["w"] + p["l2"]["b"] - y) ** 2)

    def _update(self, p, s, g):
        u, s = self.tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def train(self, start, stop):
        for step in range(start, stop):
            batch = regression_batch(5, step, WORLD.rank, BATCH, IN, OUT_DIM, dtype=self.dtype)
            _, grads = self.grad_fn(self.params, batch)
            self.params, self.opt_state = self.update(self.params, self.opt_state, grads)

    def digest(self):
        return digest(np.asarray(x) for x in jax.tree.leaves(self.params))

    def save(self, path, step, collective=True):
        checkpoint.save(path, self.ddp, step=step, params=self.params, opt_state=self.opt_state, collective=collective)

    def load(self, path):
        ck = checkpoint.load(path, self.ddp)
        self.params, self.opt_state = ck.params, ck.opt_state
        return ck.step


class NnxCase:
    """A Flax NNX model with per-rank dropout: its random streams live in the model (nnx.Rngs), so a
    bitwise resume saves them with per_rank= and puts them back from Checkpoint.per_rank; its
    BatchNorm statistics and a step counter (the same on every rank) travel as extra=."""

    def __init__(self, impl, dtype, seed=0):
        from flax import nnx  # noqa: PLC0415

        from portddp.jax import DistributedDataParallel  # noqa: PLC0415

        self.nnx, self.dtype = nnx, dtype

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.l1 = nnx.Linear(IN, HID, rngs=rngs, dtype=dtype, param_dtype=dtype)
                self.norm = nnx.BatchNorm(HID, rngs=rngs, dtype=dtype, param_dtype=dtype)
                self.drop = nnx.Dropout(0.2, rngs=rngs)
                self.l2 = nnx.Linear(HID, OUT_DIM, rngs=rngs, dtype=dtype, param_dtype=dtype)
                self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

            def __call__(self, x):
                self.calls.value += 1
                return self.l2(self.drop(jnp.tanh(self.norm(self.l1(x)))))

        # Other seeds give other values and other dropout streams: a resume must restore both.
        self.model = Net(nnx.Rngs(params=seed, dropout=1000 + 10 * seed + WORLD.rank))
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=0.01, first_bucket_cap_mb=0.005,
                                           strategy=impl.removeprefix("jax-nnx-"))
        self.ddp.broadcast(self.model)
        self.opt = nnx.Optimizer(self.model, optax.adamw(1e-2), wrt=nnx.Param)
        self.grad_fn = self.ddp.nnx_value_and_grad(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
        self.update = nnx.jit(lambda opt, model, grads: opt.update(model, grads))  # (one program, not op by op)

    def train(self, start, stop):
        for step in range(start, stop):
            _, grads = self.grad_fn(self.model, regression_batch(5, step, WORLD.rank, BATCH, IN, OUT_DIM,
                                                                 dtype=self.dtype))
            self.update(self.opt, self.model, grads)

    def digest(self):
        return digest(np.asarray(x) for x in jax.tree.leaves(self.nnx.state(self.model, self.nnx.Param, BUFFERS())))

    def save(self, path, step, collective=True):
        nnx = self.nnx
        checkpoint.save(path, self.ddp, step=step, params=nnx.to_pure_dict(nnx.state(self.model, nnx.Param)),
                        opt_state=nnx.to_pure_dict(nnx.state(self.opt)), collective=collective,
                        extra=nnx.to_pure_dict(nnx.state(self.model, BUFFERS())),
                        per_rank=nnx.to_pure_dict(nnx.state(self.model, nnx.RngState)) if collective else None)

    def load(self, path):
        nnx = self.nnx
        ck = checkpoint.load(path, self.ddp)
        for target, what, pure in ((self.model, nnx.Param, ck.params), (self.opt, ..., ck.opt_state),
                                   (self.model, BUFFERS(), ck.extra), (self.model, nnx.RngState, ck.per_rank)):
            state = nnx.state(target, what)
            nnx.replace_by_pure_dict(state, pure)
            nnx.update(target, state)
        return ck.step


def BUFFERS():  # noqa: N802 (a Flax filter, as nnx.Param)
    """A Flax NNX model's state that is neither parameters nor random streams (BatchStat, counters)."""
    from flax import nnx  # noqa: PLC0415

    return nnx.Not(nnx.Any(nnx.Param, nnx.RngState))


def make(impl, dtype, seed=0):
    case = NnxCase if impl.startswith("jax-nnx") else JaxCase if impl.startswith("jax") else TorchCase
    return case(impl, dtype, seed)


def torn_files(path: Path) -> None:
    """A truncated and a corrupted copy: refused on every rank, naming the file and the previous one.
    A missing one beside an intact .prev (a save killed between its renames): .prev is loaded."""
    case = make("torch-c10d", "float32")
    for kind in ("truncated", "corrupt", "missing"):
        bad = OUT / f"torn-{kind}"
        if WORLD.rank == 0:
            shutil.copy(path, bad)
            shutil.copy(path, _prev(bad))  # an intact previous checkpoint beside it
            raw = bad.read_bytes()
            if kind == "truncated":
                bad.write_bytes(raw[: len(raw) // 2])
            elif kind == "corrupt":
                bad.write_bytes(raw[:-10] + bytes(b ^ 0xFF for b in raw[-10:]))
            else:
                bad.unlink()
        launch.allgather_object(None)  # the files exist before anyone reads them
        try:
            ck = checkpoint.load(bad, case.ddp, optimizer=case.opt)
            message, used, step = None, str(ck.path), ck.step
        except checkpoint.CheckpointError as e:
            message, used, step = str(e), None, None
        common.report(WORLD.rank, f"torn/{kind}", message=message, prev=str(_prev(bad)), used=used, step=step)


def interrupted_save(path: Path) -> None:
    """Killed between the two renames: <p> already moved to <p>.prev (step 5), the finished temporary
    file (step 7) not yet renamed to <p>. load(<p>) takes the temporary file, on every rank."""
    case = make("torch-c10d", "float32")
    case.load(path)
    newer = OUT / "newer.ckpt"
    case.save(newer, 7)
    target = OUT / "interrupted.ckpt"
    if WORLD.rank == 0:
        shutil.copy(path, _prev(target))
        shutil.copy(newer, target.with_name(f".{target.name}.tmp-999999"))
    launch.allgather_object(None)
    ck = checkpoint.load(target, case.ddp, optimizer=case.opt)
    common.report(WORLD.rank, "interrupted", used=str(ck.path), step=ck.step)


def node_local(path: Path) -> None:
    """Each rank reads a file of its own at the same path and step (node-local disks holding other
    saves; here each rank's own directory, the path relative to it): refused on every rank naming both
    digests (an audit: the replicas resumed apart, silently)."""
    case = make("torch-c10d", "float32")
    node = OUT / f"node{WORLD.rank}"
    node.mkdir(exist_ok=True)
    payload = checkpoint.read(path)
    payload["extra"] = {"written_on": WORLD.rank}  # (another file at the same step)
    checkpoint.write(node / "local.ckpt", payload)
    launch.allgather_object(None)
    here = os.getcwd()
    os.chdir(node)
    try:
        checkpoint.load("local.ckpt", case.ddp, optimizer=case.opt)
        message = None
    except checkpoint.CheckpointError as e:
        message = str(e)
    finally:
        os.chdir(here)
    common.report(WORLD.rank, "node_local", message=message)


def rank0_only(impl: str) -> None:
    """Native DDP's idiom, `if rank == 0: save(...)`: no hang, the file is written; load on every rank
    restores the random state on rank 0 only."""
    case = make(impl, "float32")
    case.train(0, 2)
    path = OUT / f"rank0-{impl}.ckpt"
    if WORLD.rank == 0:
        case.save(path, 2, collective=False)
    case.train(2, 3)  # the others went on meanwhile
    case = make(impl, "float32", seed=9)
    ck = checkpoint.load(path, case.ddp, **({"optimizer": case.opt} if isinstance(case, TorchCase) else {}))
    common.report(WORLD.rank, f"rank0/{impl}", step=ck.step, rng_restored=ck.rng_restored)


def save_then_load(impl: str) -> None:
    """The README's lines one after the other, `if rank == 0: save(...)` then `load(...)` on every
    rank, rank 0 slow to save (1 s): the others must not read before its file is there."""
    import time  # noqa: PLC0415

    case = make(impl, "float32")
    case.train(0, 2)
    path = OUT / f"at-once-{impl}.ckpt"
    if WORLD.rank == 0:
        time.sleep(1.0)
        case.save(path, 2, collective=False)
    ck = checkpoint.load(path, case.ddp, **({"optimizer": case.opt} if isinstance(case, TorchCase) else {}))
    common.report(WORLD.rank, f"at_once/{impl}", step=ck.step, used=str(ck.path) == str(path))


def other_optimizer(path: Path) -> None:
    """The saved AdamW's state loaded into an SGD (torch takes it; an SGD's into an Adam failed at the next
    step with KeyError 'betas')."""
    class Tuned(torch.optim.AdamW):  # (a subclass, with the saved class's hyperparameters: loads)
        pass

    messages = []
    for other in (torch.optim.SGD, Tuned):
        case = make("torch-c10d", "float32")
        case.opt = other(case.model.parameters(), lr=0.1)
        try:
            case.load(path)
            messages.append(None)
        except checkpoint.CheckpointError as e:
            messages.append(str(e))
    common.report(WORLD.rank, "other_optimizer", message=messages[0], subclass=messages[1])


def failed_save(path: Path) -> None:
    """Rank 0's disk is full (a file-size limit there): every rank raises, no temporary file is left."""
    import resource  # noqa: PLC0415
    import signal  # noqa: PLC0415

    case = make("torch-c10d", "float32")
    target = OUT / "full" / "ck"
    target.parent.mkdir(exist_ok=True)
    if WORLD.rank == 0:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        case.save(target, 1)
        message = None
    except checkpoint.CheckpointError as e:
        message = str(e)
    finally:
        if WORLD.rank == 0:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    launch.allgather_object(None)
    common.report(WORLD.rank, "failed_save", message=message, left=sorted(p.name for p in target.parent.iterdir()))


def _prev(p: Path) -> Path:
    return p.with_name(p.name + ".prev")


def main():
    for impl in IMPLS:
        for dtype in DTYPES:
            name = f"{impl}/{dtype}"
            path = OUT / f"{impl}-{dtype}.ckpt"
            full = make(impl, dtype)
            if PHASE == "first" and impl != "native":  # saved on the way: the second job's 10 steps, which
                full.train(0, HALF)                    # save nothing, must still be bitwise these
                full.save(path, HALF)
                full.train(HALF, STEPS)
            else:
                full.train(0, STEPS)
            common.report(WORLD.rank, f"{PHASE}/full/{name}", digest=full.digest())
            if PHASE == "second" and impl != "native":
                resumed = make(impl, dtype, seed=123)  # other initial values: the checkpoint must win
                start = resumed.load(path)
                resumed.train(start, STEPS)
                common.report(WORLD.rank, f"resumed/{name}", digest=resumed.digest(), start=start)
    if PHASE == "second":
        torn_files(OUT / "torch-c10d-float32.ckpt")
        interrupted_save(OUT / "torch-c10d-float32.ckpt")
        node_local(OUT / "torch-c10d-float32.ckpt")
        for impl in ("torch-mpi", "jax-hooked"):
            rank0_only(impl)
            save_then_load(impl)
        other_optimizer(OUT / "torch-c10d-float32.ckpt")
        failed_save(OUT / "torch-c10d-float32.ckpt")


if __name__ == "__main__":
    main()
