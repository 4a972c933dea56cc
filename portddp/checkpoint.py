"""Checkpoint and resume, for portddp.torch and portddp.jax alike.

    from portddp import checkpoint

    # PyTorch: module (through the DDP wrapper) and optimizer, restored in place
    checkpoint.save("run/ckpt", ddp, step=step, optimizer=opt)
    step = checkpoint.load("run/ckpt", ddp, optimizer=opt).step

    # JAX: pytrees in, pytrees out
    checkpoint.save("run/ckpt", ddp, step=step, params=params, opt_state=opt_state)
    ck = checkpoint.load("run/ckpt", ddp)
    params, opt_state, step = ck.params, ck.opt_state, ck.step

What is saved: the parameters (and buffers), the optimizer state, the step,
every rank's random-number state (Python, numpy and torch; each rank gets its
own back) and the bucket plan in use, so that a resumed run reduces in exactly
the same buckets -- training 5 steps, saving, and resuming in a fresh job for 5
more gives bitwise the parameters of 10 uninterrupted steps (tests/test_reliability.py).

How: every rank's RNG state is gathered; rank 0 writes the file -- to a
temporary file in the same directory, fsync'ed, then renamed over the old one
(the old one is first kept as `<path>.prev`), so a crash mid-save never leaves
a half-written checkpoint under the real name. The file is a header (magic,
format version, payload length, SHA-256 of the payload) and a pickled payload
of numpy arrays and plain values. `load` reads it on every rank, checks length
and checksum, and, if any rank finds it torn, truncated, missing or made for
another model, every rank raises CheckpointError naming the file and the fix
(the previous checkpoint is named when there is one). Load only checkpoints
you trust: the payload is a pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import random
import struct
from pathlib import Path

import numpy as np


__all__ = ["Checkpoint", "CheckpointError", "save", "load"]

MAGIC = b"PORTDDP-CKPT"
VERSION = 2
_HEADER = struct.Struct(f"<{len(MAGIC)}sIQ32s")  # magic, version, payload bytes, sha256(payload)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, torn, truncated, or of another model."""


@dataclasses.dataclass
class Checkpoint:
    step: int
    params: object = None  # JAX: the parameter pytree (PyTorch restores the module in place)
    opt_state: object = None  # JAX: the optimizer state pytree
    extra: object = None  # whatever was passed as `extra`


# ---------------------------------------------------------------- framework glue
def _is_torch(ddp) -> bool:
    return type(ddp).__module__.startswith("portddp.torch")


def _allgather(ddp, obj) -> list:
    if _is_torch(ddp):
        return ddp._comm.allgather_object(obj)
    return ddp._transport.allgather_object(obj) if ddp._transport is not None else [obj]


def _to_numpy(tree):
    """Tensors and jax arrays -> numpy (dtype kept, bfloat16 included), recursively."""
    if hasattr(tree, "detach") and hasattr(tree, "numpy"):  # torch.Tensor
        import torch  # noqa: PLC0415

        t = tree.detach().cpu()
        return ("torch.bfloat16", t.view(torch.int16).numpy().copy()) if t.dtype == torch.bfloat16 else t.numpy().copy()
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_to_numpy(v) for v in tree)
    if type(tree).__module__.startswith(("jax", "jaxlib")) or hasattr(tree, "_fields") or \
            type(tree).__module__.startswith(("optax", "flax")):
        import jax  # noqa: PLC0415

        return jax.tree.map(np.asarray, tree)
    return tree


def _to_torch(tree):
    import torch  # noqa: PLC0415

    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "torch.bfloat16":
        return torch.from_numpy(tree[1]).view(torch.bfloat16)
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {k: _to_torch(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_torch(v) for v in tree)
    return tree


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    try:
        import torch  # noqa: PLC0415

        state["torch"] = torch.get_rng_state().numpy().copy()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch  # noqa: PLC0415

        torch.set_rng_state(torch.from_numpy(state["torch"]))


def _model_specs(ddp) -> list:
    return [(s.name, s.shape, s.dtype) for s in ddp.bucket_plan.specs]


# ---------------------------------------------------------------------- saving
def save(path, ddp, *, step: int, optimizer=None, params=None, opt_state=None, extra=None) -> Path | None:
    """Save a checkpoint (call on every rank: it gathers every rank's RNG state). Rank 0 writes
    `path` atomically; returns the path on rank 0, None elsewhere.

    PyTorch: pass `optimizer` (the module comes from the DDP wrapper).
    JAX: pass `params` and `opt_state` (any pytrees)."""
    torch_side = _is_torch(ddp)
    if torch_side and params is not None:
        raise TypeError("portddp.torch checkpoints take the module from the DDP wrapper: pass optimizer=, not params=")
    if not torch_side and params is None:
        raise TypeError("portddp.jax checkpoints need params= (and opt_state= if there is one)")
    rngs = _allgather(ddp, _rng_state())
    if ddp.rank != 0:
        written_or_not = _allgather(ddp, None)  # wait until rank 0 has written it
        if written_or_not[0]:
            raise CheckpointError(f"rank 0: {written_or_not[0]}")
        return None
    payload = {
        "framework": "torch" if torch_side else "jax",
        "step": int(step),
        "world_size": ddp.world_size,
        "specs": _model_specs(ddp),
        "plan": ddp.plan_state(),
        "rng": rngs,
        "extra": extra,
    }
    if torch_side:
        payload["module"] = _to_numpy(dict(ddp.module.state_dict()))
        payload["optimizer"] = _to_numpy(optimizer.state_dict()) if optimizer is not None else None
    else:
        payload["params"] = _to_numpy(params)
        payload["opt_state"] = _to_numpy(opt_state)
    error = None
    try:
        written = _write_atomically(Path(path), pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError as e:  # every rank must hear of it, not only rank 0
        error, written = f"could not write checkpoint {path}: {e}", None
    _allgather(ddp, error)
    if error:
        raise CheckpointError(error)
    return written


def _write_atomically(path: Path, body: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _HEADER.pack(MAGIC, VERSION, len(body), hashlib.sha256(body).digest())
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        os.replace(path, _previous(path))  # the last good one stays until the new one is whole
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the renames themselves survive a crash
    finally:
        os.close(dir_fd)
    return path


def _previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


# --------------------------------------------------------------------- loading
def read(path) -> dict:
    """The verified payload of a checkpoint file (no collective; raises CheckpointError)."""
    path = Path(path)
    prev = _previous(path)
    fix = (f"; the previous checkpoint {prev} is intact -- resume from it with load('{prev}', ...)"
           if prev.exists() and _intact(prev) else "")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}{fix}") from None
    if len(raw) < _HEADER.size or raw[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path} is not a portddp checkpoint (or its header is torn: {len(raw)} bytes){fix}")
    _, version, length, digest = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise CheckpointError(f"{path} has checkpoint format {version}; this portddp reads format {VERSION}")
    body = raw[_HEADER.size:]
    if len(body) != length:
        raise CheckpointError(f"{path} is truncated: its header promises {length} bytes of payload, the file holds "
                              f"{len(body)} (a save interrupted or a copy cut short){fix}")
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: the SHA-256 of its payload does not match its header{fix}")
    return pickle.loads(body)


def _intact(path: Path) -> bool:
    try:
        read(path)
        return True
    except CheckpointError:
        return False


def load(path, ddp, *, optimizer=None) -> Checkpoint:
    """Load a checkpoint on every rank (a collective: if any rank cannot, every rank raises).

    PyTorch: restores the module, `optimizer`, this rank's RNG state and the bucket plan in
    place. JAX: restores the RNG state and plan, and returns params and opt_state."""
    error, payload = None, None
    try:
        payload = read(path)
        _check_matches(payload, ddp, path)
    except CheckpointError as e:
        error = str(e)
    errors = _allgather(ddp, error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        raise CheckpointError(error or f"rank {r} cannot load the checkpoint: {e}")
    _set_rng_state(payload["rng"][ddp.rank])
    ddp.load_plan_state(payload["plan"])
    if _is_torch(ddp):
        ddp.module.load_state_dict(_to_torch(payload["module"]))
        if optimizer is not None:
            if payload["optimizer"] is None:
                raise CheckpointError(f"{path} holds no optimizer state (it was saved without optimizer=)")
            optimizer.load_state_dict(_to_torch(payload["optimizer"]))
        return Checkpoint(step=payload["step"], extra=payload["extra"])
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    params = jax.tree.map(jnp.asarray, payload["params"])
    opt_state = jax.tree.map(jnp.asarray, payload["opt_state"]) if payload["opt_state"] is not None else None
    return Checkpoint(step=payload["step"], params=params, opt_state=opt_state, extra=payload["extra"])


def _check_matches(payload: dict, ddp, path) -> None:
    framework = "torch" if _is_torch(ddp) else "jax"
    if payload["framework"] != framework:
        raise CheckpointError(f"{path} was saved by portddp.{payload['framework']}; this is portddp.{framework}")
    if payload["world_size"] != ddp.world_size:
        raise CheckpointError(f"{path} was saved by a job of {payload['world_size']} ranks; this one has "
                              f"{ddp.world_size}: the per-rank random states would not line up. Resume with "
                              f"mpirun -n {payload['world_size']}")
    mine = _model_specs(ddp)
    if [tuple(map(_plain, s)) for s in payload["specs"]] != [tuple(map(_plain, s)) for s in mine]:
        diff = next((k for k, (a, b) in enumerate(zip(payload["specs"], mine)) if tuple(a) != tuple(b)),
                    min(len(mine), len(payload["specs"])))
        saved = payload["specs"][diff] if diff < len(payload["specs"]) else "nothing"
        here = mine[diff] if diff < len(mine) else "nothing"
        raise CheckpointError(f"{path} is for another model: parameter #{diff} is {saved} there but {here} here")


def _plain(x):
    return tuple(x) if isinstance(x, list) else x
