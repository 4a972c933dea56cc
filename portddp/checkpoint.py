"""Checkpoint and resume, for portddp.torch and portddp.jax alike.

    from portddp import checkpoint

    # PyTorch: module (through the DDP wrapper) and optimizer, restored in place
    if rank == 0:                                   # native DDP's idiom: rank 0 saves alone
        checkpoint.save("run/ckpt", ddp, step=step, optimizer=opt)
    checkpoint.save("run/ckpt", ddp, step=step, optimizer=opt, collective=True)  # on every rank
    step = checkpoint.load("run/ckpt", ddp, optimizer=opt).step                  # on every rank

    # JAX: pytrees in, pytrees out
    checkpoint.save("run/ckpt", ddp, step=step, params=params, opt_state=opt_state)
    ck = checkpoint.load("run/ckpt", ddp)
    params, opt_state, step = ck.params, ck.opt_state, ck.step

    # Flax NNX with per-rank dropout: the model's random streams, each rank's own; its other
    # state (BatchNorm statistics, counters) as extra
    buffers = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))
    checkpoint.save("run/ckpt", ddp, step=step, params=nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                    opt_state=nnx.to_pure_dict(nnx.state(opt)), extra=nnx.to_pure_dict(nnx.state(model, buffers)),
                    per_rank=nnx.to_pure_dict(nnx.state(model, nnx.RngState)), collective=True)
    ck = checkpoint.load("run/ckpt", ddp)   # then nnx.replace_by_pure_dict + nnx.update with
                                            # ck.params, ck.opt_state, ck.extra and ck.per_rank

What is saved: the parameters (and, from PyTorch, the module's buffers; from JAX, what
`extra=` holds), the optimizer state, the step,
the random-number state (Python, numpy and torch) and the bucket plan in use,
so that a resumed run reduces in exactly the same buckets. The parameters and
the optimizer state are the same on every rank, so rank 0 writes them alone.
The random states are not: `save(..., collective=True)`, called on every rank,
gathers every rank's and `load` gives each rank its own back -- training 5
steps, saving, and resuming in a fresh job for 5 more then gives bitwise the
parameters of 10 uninterrupted steps (tests/test_reliability.py). Without
`collective=True`, save never communicates: rank 0 writes its own random
state only (the file says so), other ranks' calls do nothing, and load
restores the random state on rank 0 only (`Checkpoint.rng_restored`).
What else differs per rank -- a Flax NNX model's `nnx.RngState`, which lives
in the model, not in a global generator -- goes in `per_rank=` (collective
saves only); load hands each rank its own as `Checkpoint.per_rank`.

The file: a header (magic, format version, payload length, SHA-256 of the
payload) and a payload that is an uncompressed `.npz` archive -- the arrays,
and one JSON document (`meta.json`, stored as bytes) that holds everything
else and names the arrays where they belong. Nested dicts (any key type, order
kept), lists, tuples and NamedTuples (optax states, by importable class name),
tensors and jax/numpy arrays (any dtype, bfloat16 included, bit for bit),
numbers, strings and None round-trip exactly; nothing is pickled, and reading
a file never runs code from it (`np.load(allow_pickle=False)`).

How it is written: to a temporary file `.<name>.tmp-<pid>` in the same
directory, fsync'ed, then renamed over the old one (the old one is first kept
as `<path>.prev`), so a crash mid-save never leaves a half-written checkpoint
under the real name. A save that fails (disk full) removes its temporary file.
`load` reads it on every rank and checks length and checksum; if any rank
finds it torn, truncated, or made for another model, every rank raises
CheckpointError naming the file and the fix (the previous checkpoint is named
when there is one). If `path` itself is missing -- a save killed between its
two renames -- load takes the newest intact file beside it (the finished
temporary file, else `<path>.prev`), says so, and returns it as
`Checkpoint.path`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import struct
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

from portddp import launch

__all__ = ["Checkpoint", "CheckpointError", "save", "load", "read", "write", "find", "encode", "decode"]

MAGIC = b"PORTDDP-CKPT"
VERSION = 3  # 2: a pickled payload (portddp before the npz format)
_HEADER = struct.Struct(f"<{len(MAGIC)}sIQ32s")  # magic, version, payload bytes, sha256(payload)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, torn, truncated, or of another model) or written."""


@dataclasses.dataclass
class Checkpoint:
    step: int
    params: object = None  # JAX: the parameter pytree (PyTorch restores the module in place)
    opt_state: object = None  # JAX: the optimizer state pytree
    extra: object = None  # whatever was passed as `extra`
    path: Path | None = None  # the file loaded (not `path` when load fell back to an intact neighbour)
    rng_restored: bool = False  # this rank's random state was in the file (collective save, or rank 0)
    per_rank: object = None  # this rank's `per_rank` of a collective save (e.g. its nnx.RngState)


# ============================================================ the file format (framework-free)
# A tree becomes JSON plus named arrays. JSON objects in the encoded form are always tagged:
#   {"$d": [[key, value], ...], "$c": "OrderedDict"?}   dict (keys of any encodable type, order kept)
#   {"$t": [...]}                                       tuple (a JSON list is a list)
#   {"$nt": "module:QualName", "f": [fields], "v": [...]} NamedTuple
#   {"$a": "a7", "k": kind, "dt": dtype?}               array a7 of the archive; kind: numpy array
#                                                       ("np"), numpy scalar ("scalar"), "torch", "jax",
#                                                       "jaxkey" (a typed PRNG key array's data, and
#                                                       "impl": its kind, e.g. "threefry2x32");
#                                                       dt: the dtype of a raw unsigned view (bfloat16...)
#   {"$coo": [size], "i": indices, "v": values, "c": coalesced}  a sparse COO torch tensor (the momentum
#                                                       of SGD on an nn.Embedding(sparse=True))
def encode(tree, arrays: dict, where: str = "") -> object:
    """`tree` as a JSON value; its arrays go into `arrays` (name -> numpy array)."""
    if tree is None or isinstance(tree, (bool, str)):
        return tree
    if isinstance(tree, (int, float)) and type(tree) in (int, float):
        return tree
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tree, torch.Tensor):
        if tree.layout == torch.sparse_coo:
            return {"$coo": list(tree.shape), "c": tree.is_coalesced(),
                    "i": encode(tree._indices(), arrays, f"{where} indices"),
                    "v": encode(tree._values(), arrays, f"{where} values")}
        if tree.layout != torch.strided:
            raise TypeError(f"a checkpoint cannot hold the {tree.layout} tensor at {where or 'the top'}: it stores "
                            "dense and sparse COO tensors (convert it first, e.g. .to_sparse_coo() or .to_dense())")
        return _array(*_torch_to_numpy(tree, torch), "torch", arrays, where)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(tree, jax.Array):
        if jax.numpy.issubdtype(tree.dtype, jax.dtypes.prng_key):  # (nnx.Rngs' keys): their data, and the kind
            out = _array(np.asarray(jax.random.key_data(tree)), None, "jaxkey", arrays, where)
            return out | {"impl": str(jax.random.key_impl(tree))}
        return _array(np.asarray(tree), None, "jax", arrays, where)
    if isinstance(tree, np.ndarray):
        return _array(tree, None, "np", arrays, where)
    if isinstance(tree, np.generic):
        return _array(np.asarray(tree), None, "scalar", arrays, where)
    if isinstance(tree, dict) and type(tree) in (dict, OrderedDict):
        out = {"$d": [[encode(k, arrays, f"{where} key"), encode(v, arrays, f"{where}[{k!r}]")]
                      for k, v in tree.items()]}
        if type(tree) is OrderedDict:
            out["$c"] = "OrderedDict"
        return out
    if isinstance(tree, list) and type(tree) is list:
        return [encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        cls = type(tree)
        return {"$nt": f"{cls.__module__}:{cls.__qualname__}", "f": list(cls._fields),
                "v": [encode(v, arrays, f"{where}.{f}") for f, v in zip(cls._fields, tree)]}
    if type(tree) is tuple:
        return {"$t": [encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(tree)]}
    raise TypeError(f"a checkpoint cannot hold the {type(tree).__module__}.{type(tree).__qualname__} at "
                    f"{where or 'the top'}: it stores arrays and tensors, numbers, strings, None, and dicts, lists, "
                    "tuples and NamedTuples of them, without pickle (convert it first, e.g. a Flax nnx.State with "
                    "nnx.to_pure_dict(state))")


def _array(a: np.ndarray, dt: str | None, kind: str, arrays: dict, where: str) -> dict:
    if a.dtype.hasobject:
        raise TypeError(f"a checkpoint cannot hold the object array at {where or 'the top'} (it would need pickle)")
    out = {"$a": f"a{len(arrays)}", "k": kind}
    if a.dtype.kind == "V" and dt is None:  # bfloat16, float8, ... (ml_dtypes): .npy cannot name them; keep the bits
        dt, a = a.dtype.name, a.view(f"u{a.dtype.itemsize}")
    if dt is not None:
        out["dt"] = dt
    arrays[out["$a"]] = a
    return out


def _torch_to_numpy(t, torch) -> tuple[np.ndarray, str | None]:
    t = t.detach().cpu().resolve_conj().resolve_neg()
    try:
        return t.numpy(), None
    except TypeError:  # bfloat16, float8, ...: numpy has no such dtype; keep the bits, name the dtype
        raw = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        return raw.numpy().view(f"u{t.element_size()}"), str(t.dtype).removeprefix("torch.")


def decode(value, arrays) -> object:
    """The tree `encode` made `value` from (`arrays`: name -> numpy array, e.g. an NpzFile)."""
    if isinstance(value, list):
        return [decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "$a" in value:
        return _from_array(value, arrays[value["$a"]])
    if "$d" in value:
        items = [(_hashable(decode(k, arrays)), decode(v, arrays)) for k, v in value["$d"]]
        return OrderedDict(items) if value.get("$c") == "OrderedDict" else dict(items)
    if "$t" in value:
        return tuple(decode(v, arrays) for v in value["$t"])
    if "$nt" in value:
        return _named_tuple(value["$nt"], value["f"])(*(decode(v, arrays) for v in value["v"]))
    if "$coo" in value:
        import torch  # noqa: PLC0415

        return torch.sparse_coo_tensor(decode(value["i"], arrays), decode(value["v"], arrays), value["$coo"],
                                       is_coalesced=value["c"], check_invariants=True)  # (indices from a file)
    raise CheckpointError(f"unknown entry in the checkpoint's structure: {sorted(value)}")


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _from_array(spec: dict, a: np.ndarray):
    kind, dt = spec["k"], spec.get("dt")
    if kind == "torch":
        import torch  # noqa: PLC0415

        t = torch.from_numpy(np.array(a, copy=True))
        if dt is not None:
            t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize])
            t = t.view(getattr(torch, dt))
        return t
    if dt is not None:
        import ml_dtypes  # noqa: PLC0415 -- JAX's own dtypes package

        a = a.view(getattr(ml_dtypes, dt))
    if kind == "jax":
        import jax.numpy as jnp  # noqa: PLC0415

        return jnp.asarray(a)
    if kind == "jaxkey":
        import jax  # noqa: PLC0415

        return jax.random.wrap_key_data(np.array(a, copy=True), impl=spec["impl"])
    if kind == "scalar":
        return a[()]
    return np.array(a, copy=True)


def _named_tuple(name: str, fields: list):
    """The NamedTuple class `module:QualName`, from a module already imported (or a submodule of an
    imported package, e.g. optax._src.transform once optax is): a file never makes portddp import
    anything else."""
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None and module_name.split(".")[0] in sys.modules:
        import importlib  # noqa: PLC0415

        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
    cls = module
    for part in qualname.split(".") if module is not None else []:
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == fields):
        raise CheckpointError(f"the checkpoint holds a {qualname} ({module_name}) with fields {fields}, which cannot "
                              f"be rebuilt here: import {module_name.split('.')[0]} (the version that saved it) "
                              "before loading")
    return cls


def pack(payload) -> bytes:
    """A tree as the bytes of an uncompressed .npz: its arrays, and `meta.json` with the rest."""
    arrays: dict = {}
    meta = json.dumps(encode(payload, arrays), allow_nan=True).encode()
    arrays["meta.json"] = np.frombuffer(meta, dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def unpack(body: bytes):
    with np.load(io.BytesIO(body), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return decode(json.loads(arrays.pop("meta.json").tobytes()), arrays)


def write(path, payload) -> Path:
    """Write `payload` (a tree) to `path` atomically; the old file becomes `<path>.prev`. On failure
    nothing but the old files is left."""
    path = Path(path)
    body = pack(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = _HEADER.pack(MAGIC, VERSION, len(body), hashlib.sha256(body).digest())
    tmp = _tmp(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # else it fills the disk further, and lingers
        raise
    if path.exists():
        os.replace(path, _previous(path))  # the last good one stays until the new one is whole
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the renames themselves survive a crash
    finally:
        os.close(dir_fd)
    for stale in _leftovers(path):  # finished temporary files of saves killed before their rename
        stale.unlink(missing_ok=True)
    return path


def _tmp(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.tmp-{pid}")


def _leftovers(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.tmp-*"), key=lambda p: p.stat().st_mtime, reverse=True)


def _previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def read(path, with_digest: bool = False):
    """The verified payload of a checkpoint file (no collective; raises CheckpointError); with
    `with_digest`, (payload, the SHA-256 of its payload in hex)."""
    path = Path(path)
    prev = _previous(path)
    fix = (f"; the previous checkpoint {prev} is intact -- resume from it with load('{prev}', ...)"
           if prev.exists() and _intact(prev) else "")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}{fix}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}{fix}") from None
    if len(raw) < _HEADER.size or raw[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path} is not a portddp checkpoint (or its header is torn: {len(raw)} bytes){fix}")
    _, version, length, digest = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise CheckpointError(f"{path} has checkpoint format {version}; this portddp reads format {VERSION}"
                              + (" (format 2 was pickled: load it with the portddp that wrote it)" if version == 2
                                 else ""))
    body = raw[_HEADER.size:]
    if len(body) != length:
        raise CheckpointError(f"{path} is truncated: its header promises {length} bytes of payload, the file holds "
                              f"{len(body)} (a save interrupted or a copy cut short){fix}")
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: the SHA-256 of its payload does not match its header{fix}")
    try:
        return (unpack(body), digest.hex()) if with_digest else unpack(body)
    except CheckpointError:
        raise
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path} has an intact checksum but an unreadable payload ({e}){fix}") from None


def _intact(path: Path) -> bool:
    try:
        read(path)
        return True
    except CheckpointError:
        return False


def find(path) -> Path:
    """The file to load for `path`: `path` itself if it exists (read() judges it), else the newest intact
    file a save leaves beside it when killed between its two renames -- its finished temporary file,
    then `<path>.prev` -- else `path` (read() then says there is none)."""
    path = Path(path)
    if path.exists():
        return path
    for candidate in [*_leftovers(path), _previous(path)]:
        if candidate.exists() and _intact(candidate):
            return candidate
    return path


# ============================================================ the frontends
def _frontend(ddp) -> str:
    torch_ddp = getattr(sys.modules.get("portddp.torch"), "DistributedDataParallel", None)
    if torch_ddp is not None and isinstance(ddp, torch_ddp):
        return "torch"
    jax_ddp = getattr(sys.modules.get("portddp.jax"), "DistributedDataParallel", None)
    if jax_ddp is not None and isinstance(ddp, jax_ddp):
        return "jax"
    raise TypeError(f"checkpoint.save/load take a portddp.torch or portddp.jax DistributedDataParallel, not "
                    f"{type(ddp).__module__}.{type(ddp).__qualname__}")


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch  # noqa: PLC0415

        torch.set_rng_state(state["torch"])


def _model_specs(ddp) -> list:
    return [[s.name, list(s.shape), str(s.dtype)] for s in ddp.bucket_plan.specs]


def save(path, ddp, *, step: int, optimizer=None, params=None, opt_state=None, extra=None, per_rank=None,
         collective: bool = False) -> Path | None:
    """Save a checkpoint; rank 0 writes `path` atomically and returns it (None elsewhere).

    PyTorch: pass `optimizer` (the module comes from the DDP wrapper).
    JAX: pass `params` and `opt_state` (any pytrees of dicts, lists, tuples, NamedTuples).
    `extra`: anything of the same kinds (numbers, strings, arrays, ...), rank 0's.
    `per_rank` (collective=True only): the same kinds, each rank's own -- gathered, and given back
    to each rank by load as `Checkpoint.per_rank`: a Flax NNX model's random streams
    (`nnx.to_pure_dict(nnx.state(model, nnx.RngState))`, per-rank dropout), a data loader's position.

    collective=False (default): no communication -- call it on rank 0 only (`if rank == 0:`, as
    with native DDP) or on every rank (the others do nothing). The file holds rank 0's random
    state only, and load restores it on rank 0 only.
    collective=True: call it on every rank; every rank's random state is gathered (load gives each
    rank its own back: bitwise resume), and a failed write raises on every rank. Called on some
    ranks only, it waits for the others: the stall inspector (PORTDDP_STALL_S) then names it."""
    frontend = _frontend(ddp)
    if frontend == "torch" and params is not None:
        raise TypeError("portddp.torch checkpoints take the module from the DDP wrapper: pass optimizer=, not params=")
    if frontend == "jax" and params is None:
        raise TypeError("portddp.jax checkpoints need params= (and opt_state= if there is one)")
    if per_rank is not None and not collective:
        raise ValueError("checkpoint.save(per_rank=...) needs collective=True (called on every rank): each rank's "
                         "per_rank is gathered to rank 0, which writes them all")
    rank = launch.world().rank
    if collective:
        # Each rank encodes its own per_rank (numpy arrays and JSON travel; a JAX key array would not).
        mine, error = None, None
        try:
            arrays = {}
            mine = (encode(per_rank, arrays, "per_rank"), arrays) if per_rank is not None else None
        except Exception as e:  # (every rank must hear of it: the others wait in the gather below)
            error = f"could not write checkpoint {path}: on rank {rank}, {type(e).__name__}: {e}"
        gathered = launch.allgather_object((_rng_state(), mine, error), name="checkpoint save")
        rngs = [g[0] for g in gathered]
        given = [r for r, g in enumerate(gathered) if g[1] is not None]
        if given and len(given) < len(gathered):
            error = (f"could not write checkpoint {path}: per_rank was passed on rank(s) {given} only; pass it "
                     "on every rank (or on none)")
        error = next((g[2] for g in gathered if g[2]), error)
        if error:
            raise CheckpointError(error)
    else:
        rngs = [_rng_state()]
    if rank != 0:
        if collective:
            error = launch.allgather_object(None, name="checkpoint save: written")[0]
            if error:
                raise CheckpointError(f"rank 0: {error}")
        return None
    error, written = None, None
    try:
        payload = {
            "framework": frontend,
            "step": int(step),
            "world_size": ddp.world_size,
            "specs": _model_specs(ddp),
            "plan": ddp.plan_state(),
            "rng": rngs,
            "rng_ranks": "all" if collective else [0],
            "extra": extra,
        }
        if per_rank is not None:
            payload["per_rank"] = [decode(*g[1]) for g in gathered]
        if frontend == "torch":
            payload["module"] = ddp.module.state_dict()
            payload["optimizer"] = optimizer.state_dict() if optimizer is not None else None
            payload["optimizer_class"] = _class_name(optimizer) if optimizer is not None else None
        else:
            payload["params"] = params
            payload["opt_state"] = opt_state
        written = write(path, payload)
    except Exception as e:  # every rank must hear of it, not only rank 0 (the others wait for its word)
        error = f"could not write checkpoint {path}: {e}" if isinstance(e, OSError | TypeError) else \
            f"could not write checkpoint {path}: {type(e).__name__}: {e}"
    if collective:
        launch.allgather_object(error, name="checkpoint save: written")
    if error:
        raise CheckpointError(error)
    return written


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_optimizer_class(used, payload, optimizer) -> None:
    """An optimizer of another class whose hyperparameters the saved groups lack is refused: torch would
    take the state and fail at the next step (an SGD's state in an Adam: KeyError 'betas'). Another
    class with the same hyperparameters (a subclass, the same class imported under another module
    name) loads."""
    saved = payload.get("optimizer_class")  # (absent from checkpoints written before 2026-12-06)
    groups = payload["optimizer"].get("param_groups") or [{}]
    lacking = sorted(set(optimizer.defaults) - set(groups[0]))
    if saved is not None and saved.rsplit(".", 1)[-1] != type(optimizer).__qualname__ and lacking:
        raise CheckpointError(f"{used} holds the state of a {saved} optimizer, but load() got a "
                              f"{_class_name(optimizer)}, whose hyperparameters {', '.join(lacking)} it lacks: pass "
                              "an optimizer of the class that was saved")


def load(path, ddp, *, optimizer=None) -> Checkpoint:
    """Load a checkpoint on every rank (a collective: if any rank cannot, every rank raises).

    PyTorch: restores the module, `optimizer`, the random state and the bucket plan in place.
    JAX: restores the random state and plan, and returns params and opt_state. The random state
    is restored on every rank from a collective save, on rank 0 only otherwise (`rng_restored`).
    If `path` is missing (a save killed between its renames), the newest intact file beside it
    is loaded instead, and named on stderr and in `Checkpoint.path`.

    No rank reads before every rank has arrived: after `if rank == 0: save(...)` the others reach
    load while rank 0 is still writing (they would find no file, or its temporary one)."""
    frontend = _frontend(ddp)
    launch.allgather_object(None, name="checkpoint load")
    error, payload, used, digest = None, None, Path(path), None
    try:
        used = find(path)
        payload, digest = read(used, with_digest=True)
        _check_matches(payload, ddp, used, frontend)
    except CheckpointError as e:
        error = str(e)
    rank = launch.world().rank
    everyone = launch.allgather_object((error, str(used), payload["step"] if payload else None, digest),
                                       name="checkpoint load: read")
    bad = [(r, e) for r, (e, _, _, _) in enumerate(everyone) if e]
    if bad:
        r, e = bad[0]
        raise CheckpointError(error or f"rank {r} cannot load the checkpoint: {e}")
    if len({(u, s) for _, u, s, _ in everyone}) > 1:
        raise CheckpointError("the ranks would load different checkpoints: " + "; ".join(
            f"rank {r}: {u} (step {s})" for r, (_, u, s, _) in enumerate(everyone)) + ". Give every rank the same "
            "path on a file system they share")
    if len({d for _, _, _, d in everyone}) > 1:  # (the same path and step, other contents: node-local disks)
        raise CheckpointError(
            f"the ranks read different checkpoints at {used} (step {payload['step']}): the SHA-256 of its payload "
            "is " + ", ".join(f"{d[:12]} on rank {r}" for r, (_, _, _, d) in enumerate(everyone)) + " -- each "
            "rank found its own file (a node-local disk?), and the replicas would resume apart. Give every rank "
            "the same file: a file system they share, or rank 0's file copied to every node")
    if used != Path(path) and rank == 0:
        sys.stderr.write(f"portddp: {path} is missing (a save interrupted between its two renames?); loading {used}, "
                         f"the newest intact checkpoint beside it (step {payload['step']})\n")
    rng_ranks = payload["rng_ranks"]
    restored = rng_ranks == "all" or rank in rng_ranks
    if restored:
        _set_rng_state(payload["rng"][rank if rng_ranks == "all" else rng_ranks.index(rank)])
    mine = payload.get("per_rank", [None] * (rank + 1))[rank]
    ddp.load_plan_state(payload["plan"])
    if frontend == "torch":
        ddp.module.load_state_dict(payload["module"])
        if optimizer is not None:
            if payload["optimizer"] is None:
                raise CheckpointError(f"{used} holds no optimizer state (it was saved without optimizer=)")
            _check_optimizer_class(used, payload, optimizer)
            optimizer.load_state_dict(payload["optimizer"])
        return Checkpoint(step=payload["step"], extra=payload["extra"], path=used, rng_restored=restored,
                          per_rank=mine)
    ddp._values_differ = []  # every rank loaded the same parameters (no need to compare them again)
    return Checkpoint(step=payload["step"], params=payload["params"], opt_state=payload["opt_state"],
                      extra=payload["extra"], path=used, rng_restored=restored, per_rank=mine)


def _check_matches(payload: dict, ddp, path, frontend: str) -> None:
    if payload["framework"] != frontend:
        raise CheckpointError(f"{path} was saved by portddp.{payload['framework']}; this is portddp.{frontend}")
    if payload["world_size"] != ddp.world_size and payload["rng_ranks"] == "all":
        # (a save by rank 0 alone holds replicated state and rank 0's random state: it loads at any size)
        raise CheckpointError(f"{path} was saved by a job of {payload['world_size']} ranks; this one has "
                              f"{ddp.world_size}: the per-rank random states it holds (collective=True) would not "
                              f"line up. Resume with mpirun -n {payload['world_size']}, or, to change the world "
                              "size, save with `if rank == 0: save(...)` (collective=False), which keeps rank 0's "
                              "random state only and loads at any world size")
    mine = _model_specs(ddp)
    saved = payload["specs"]
    if saved != mine:
        diff = next((k for k, (a, b) in enumerate(zip(saved, mine)) if a != b), min(len(mine), len(saved)))
        there = _show(saved[diff]) if diff < len(saved) else "nothing"
        here = _show(mine[diff]) if diff < len(mine) else "nothing"
        raise CheckpointError(f"{path} is for another model: parameter #{diff} is {there} there but {here} here")


def _show(spec) -> str:
    name, shape, dtype = spec
    return f"{name!r} {tuple(shape)} {dtype}"
