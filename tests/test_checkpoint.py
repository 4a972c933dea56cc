"""The checkpoint file format, alone (single process, no mpirun): exact round trips of the
optimizer states both frameworks produce, no pickle, torn files, and the atomic write's failure
cases (a failed save leaves nothing behind; a kill between the two renames is recovered by
load's choice of file). The mpirun save/resume tests are in tests/test_reliability.py."""

from __future__ import annotations

import os
import resource
import signal
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from portddp import checkpoint
from portddp.checkpoint import CheckpointError


def same(a, b, where="") -> None:
    """Exactly equal: the same types (tuple vs list, NamedTuple class, tensor vs array), the same
    keys in the same order, bitwise the same array contents and dtypes."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "torch":
        assert a.dtype == b.dtype and a.shape == b.shape and a.layout == b.layout, where
        import torch  # noqa: PLC0415

        if a.layout == torch.sparse_coo:
            assert a.is_coalesced() == b.is_coalesced(), where
            same(a._indices(), b._indices(), f"{where} indices")
            same(a._values(), b._values(), f"{where} values")
            return

        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)), where
    elif hasattr(a, "dtype") and hasattr(a, "shape"):  # numpy or jax array, numpy scalar
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def roundtrip(tree):
    return checkpoint.unpack(checkpoint.pack(tree))


def test_plain_values_containers_and_numpy_round_trip_exactly():
    tree = {"int": 3, "big": 2**70, "float": 0.1, "neg0": -0.0, "nan": float("nan"), "inf": float("-inf"),
            "none": None, "bool": True, "str": "é", 7: "an int key", (1, "a"): "a tuple key",
            "list": [1, [2.5, None]], "tuple": (1, (2,), ()), "od": OrderedDict([("b", 1), ("a", 2)]),
            "arr": np.arange(6, dtype=np.int16).reshape(2, 3), "f64": np.array([np.pi]), "empty": np.zeros((0, 3)),
            "scalar": np.float32(0.9), "zero_d": np.array(5, dtype=np.uint64), "fortran": np.asfortranarray(
                np.arange(6.0).reshape(2, 3)), "bool_arr": np.array([True, False])}
    same(tree, roundtrip(tree))
    assert checkpoint.pack(tree) == checkpoint.pack(roundtrip(tree))  # deterministic bytes


def test_torch_states_round_trip_exactly():
    torch = pytest.importorskip("torch")
    from torch import nn  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.Linear(2, 2))
    model[3].weight.requires_grad_(False)
    half = nn.Linear(2, 2).to(torch.bfloat16)
    for opt in (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True),
                torch.optim.AdamW([{"params": list(model[0].parameters()), "lr": 1e-2},
                                   {"params": list(model[2].parameters()), "betas": (0.8, 0.9)}])):
        model(torch.randn(5, 3)).sum().backward()
        model[2].bias.grad = None  # no gradient for one parameter: SGD keeps momentum_buffer None
        opt.step()
        state = opt.state_dict()
        back = roundtrip(state)
        same(state, back)
        fresh = type(opt)(model.parameters() if not isinstance(opt, torch.optim.AdamW) else opt.param_groups)
        fresh.load_state_dict(back)
        same(fresh.state_dict(), state)
    sgd0 = torch.optim.SGD(model.parameters(), lr=0.1)  # momentum 0: momentum_buffer None (some versions)
    model(torch.randn(5, 3)).sum().backward()
    sgd0.step()
    for sd in (sgd0.state_dict(), {"state": {0: {"momentum_buffer": None}}, "param_groups": [{"params": [0]}]},
               model.state_dict(), half.state_dict(), {"rng": torch.get_rng_state(), "c": torch.tensor(1 + 2j)}):
        same(sd, roundtrip(sd))
    tensor_bf16 = torch.tensor(3.0, dtype=torch.bfloat16)  # a 0-d tensor of a dtype numpy lacks
    same(tensor_bf16, roundtrip(tensor_bf16))


def test_sparse_optimizer_state_round_trips_exactly_and_other_layouts_are_refused():
    """SGD with momentum on an nn.Embedding(sparse=True) keeps its momentum as a sparse COO tensor
    (portddp.torch reduces sparse gradients): saved and loaded as it was, coalesced or not."""
    torch = pytest.importorskip("torch")
    from torch import nn  # noqa: PLC0415

    torch.manual_seed(0)
    table = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(table.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        table(torch.tensor([1, 4, 4, 7])).sum().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    assert state["state"][0]["momentum_buffer"].layout == torch.sparse_coo
    back = roundtrip(state)
    same(state, back)
    fresh = torch.optim.SGD(table.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(back)
    same(fresh.state_dict(), state)
    raw = torch.sparse_coo_tensor(torch.tensor([[2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4,))  # uncoalesced
    same(raw, roundtrip(raw))
    with pytest.raises(TypeError, match=r"torch\.sparse_csr tensor at \['m'\].*dense and sparse COO"):
        checkpoint.pack({"m": torch.eye(2).to_sparse_csr()})


def test_optax_and_jax_states_round_trip_exactly():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp  # noqa: PLC0415

    params = {"w": jnp.ones((3, 2)), "b": [jnp.zeros(2, jnp.bfloat16), jnp.arange(3)]}
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    for tx in (optax.adam(1e-3), optax.sgd(0.1, momentum=0.9), optax.sgd(0.1),
               optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
               optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)):
        state = tx.init(params)
        _, state = tx.update(grads, state, params)
        back = roundtrip({"params": params, "opt_state": state})
        same({"params": params, "opt_state": state}, back)
    same(optax.EmptyState(), roundtrip(optax.EmptyState()))



def test_jax_prng_keys_and_a_flax_nnx_models_random_streams_round_trip_exactly():
    """Typed key arrays (nnx.Rngs holds them) keep their kind and bits: what per_rank= carries."""
    jax = pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    keys = {"fry": jax.random.key(3), "rbg": jax.random.split(jax.random.key(4, impl="rbg"), 3),
            "rngs": nnx.to_pure_dict(nnx.state(Net(nnx.Rngs(params=0, dropout=7)), nnx.RngState))}
    back = roundtrip(keys)
    flat, flat_back = jax.tree.leaves(keys), jax.tree.leaves(back)
    assert jax.tree.structure(keys) == jax.tree.structure(back) and len(flat) == 4
    for a, b in zip(flat, flat_back):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        if jax.numpy.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(b))
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()



def test_per_rank_needs_a_collective_save(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    from portddp.jax import DistributedDataParallel  # noqa: PLC0415

    params = {"w": jnp.ones((2, 2))}
    ddp = DistributedDataParallel(params)
    with pytest.raises(ValueError, match=r"per_rank=\.\.\.\) needs collective=True \(called on every rank\)"):
        checkpoint.save(tmp_path / "ck", ddp, step=1, params=params, per_rank={"n": 1})
    assert not list(tmp_path.iterdir())
    checkpoint.save(tmp_path / "ck", ddp, step=1, params=params, per_rank={"pos": 17}, collective=True)
    assert checkpoint.load(tmp_path / "ck", ddp).per_rank == {"pos": 17}


def test_no_pickle_anywhere():
    with pytest.raises(TypeError, match=r"cannot hold the builtins.set at \['s'\]: it stores arrays"):
        checkpoint.pack({"s": {1, 2}})
    with pytest.raises(TypeError, match="object array at"):
        checkpoint.pack({"o": np.array([object()])})
    body = checkpoint.pack({"x": np.ones(3)})
    with np.load(__import__("io").BytesIO(body), allow_pickle=False) as npz:
        assert sorted(npz.files) == ["a0", "meta.json"]


def test_a_named_tuple_from_a_package_that_is_not_imported_is_refused(monkeypatch):
    import collections  # noqa: PLC0415

    Point = collections.namedtuple("Point", "x y")
    Point.__module__ = "not_imported_pkg.sub"
    body = checkpoint.pack(Point(1, 2))
    with pytest.raises(CheckpointError, match=r"holds a Point \(not_imported_pkg.sub\).*import not_imported_pkg"):
        checkpoint.unpack(body)


# ------------------------------------------------------------------- files
def test_write_keeps_the_previous_file_and_read_verifies(tmp_path):
    path = tmp_path / "ck"
    checkpoint.write(path, {"step": 1})
    checkpoint.write(path, {"step": 2})
    assert checkpoint.read(path) == {"step": 2} and checkpoint.read(path.with_name("ck.prev")) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.prev"]
    raw = path.read_bytes()
    (tmp_path / "trunc").write_bytes(raw[:-3])
    with pytest.raises(CheckpointError, match=r"is truncated: its header promises \d+ bytes of payload, the file holds"):
        checkpoint.read(tmp_path / "trunc")
    (tmp_path / "corrupt").write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="is corrupt: the SHA-256 of its payload does not match its header"):
        checkpoint.read(tmp_path / "corrupt")
    (tmp_path / "old").write_bytes(raw[:12] + struct.pack("<I", 2) + raw[16:])
    with pytest.raises(CheckpointError, match="has checkpoint format 2; this portddp reads format 3 .format 2 was "
                                              "pickled"):
        checkpoint.read(tmp_path / "old")
    with pytest.raises(CheckpointError, match="is not a portddp checkpoint"):
        checkpoint.read(tmp_path / "ck.prev" if False else _junk(tmp_path))


def _junk(tmp_path: Path) -> Path:
    (tmp_path / "junk").write_bytes(b"hello")
    return tmp_path / "junk"


def test_a_save_that_fails_leaves_no_temporary_file_and_the_old_checkpoint_intact(tmp_path):
    """Disk full, as the file-size limit makes it (no root needed): the write fails half way."""
    path = tmp_path / "ck"
    checkpoint.write(path, {"step": 1})
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError):
            checkpoint.write(path, {"step": 2, "big": np.zeros(100_000)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert checkpoint.read(path) == {"step": 1}
    checkpoint.write(path, {"step": 3})  # and the next save works
    assert checkpoint.read(path) == {"step": 3}


def test_a_kill_between_the_two_renames_is_recovered_by_find(tmp_path, monkeypatch):
    """path -> path.prev done, the finished temporary file not yet renamed: find() takes the temporary
    file (the newest intact one); with no temporary file, path.prev; with nothing, path (read() then
    says 'no checkpoint at')."""
    path = tmp_path / "ck"
    checkpoint.write(path, {"step": 1})
    real_replace = os.replace

    def killed_at_second_rename(src, dst):
        if Path(dst) == path:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_second_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.write(path, {"step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    tmp = tmp_path / f".ck.tmp-{os.getpid()}"
    assert not path.exists() and tmp.exists() and (tmp_path / "ck.prev").exists()
    assert checkpoint.find(path) == tmp and checkpoint.read(tmp) == {"step": 2}
    # a torn temporary file (killed while writing) is passed over for the intact .prev
    (tmp_path / ".ck.tmp-1").write_bytes(tmp.read_bytes()[:40])
    os.utime(tmp_path / ".ck.tmp-1", (tmp.stat().st_mtime + 10,) * 2)
    assert checkpoint.find(path) == tmp
    tmp.unlink()
    assert checkpoint.find(path) == tmp_path / "ck.prev"
    (tmp_path / "ck.prev").unlink()
    assert checkpoint.find(path) == path
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        checkpoint.read(checkpoint.find(path))
    checkpoint.write(path, {"step": 3})  # a finished save clears the leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_another_world_size_loads_a_rank_0_save_and_refuses_a_collective_one(tmp_path):
    """A save by rank 0 alone holds replicated state and rank 0's random state: it loads in a job of
    another size (to evaluate at -n 1, or to go on with more ranks). A collective save holds every
    rank's random state, which would not line up: refused, naming both ways. (The files are a
    single-process save with the saving job's size rewritten, as a job of 2 would have written it.)"""
    jnp = pytest.importorskip("jax.numpy")
    from portddp.jax import DistributedDataParallel  # noqa: PLC0415

    params = {"w": jnp.arange(4.0).reshape(2, 2)}
    ddp = DistributedDataParallel(params)
    for collective in (False, True):
        path = tmp_path / f"ck{collective}"
        checkpoint.save(path, ddp, step=3, params=params, collective=collective)
        payload = checkpoint.read(path)
        payload["world_size"] = 2
        if collective:
            payload["rng"] = payload["rng"] * 2
        checkpoint.write(path, payload)
        if collective:
            with pytest.raises(CheckpointError, match=r"saved by a job of 2 ranks; this one has 1: the per-rank random "
                                                      r"states it holds \(collective=True\) would not line up\. Resume "
                                                      r"with mpirun -n 2, or, to change the world size, save with"):
                checkpoint.load(path, ddp)
        else:
            got = checkpoint.load(path, ddp)
            assert got.step == 3 and got.rng_restored
            same(np.asarray(got.params["w"]), np.asarray(params["w"]))
