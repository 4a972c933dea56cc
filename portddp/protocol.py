"""The collectives both portddp.torch and portddp.jax issue, in the same order.

Every rank must issue the same collectives in the same order, whatever
framework it runs -- that is what lets one `mpirun` job mix PyTorch and JAX
ranks (comparisons/mixed.py). Over the MPI transport the sequence is:

construction          allgather(config), launcher channel  agree on caps and transport (below)
                      allgather(specs)                     agree on the model
broadcast             allgather(specs); Bcast per bucket   rank 0's parameters, in bucket layout
                      (PyTorch: then Bcast of buffers, coalesced by dtype)
iteration 2, once     Bcast(int64[n] ready order)          rebuild the plan from rank 0's order
each iteration        Allreduce per bucket, in plan order  the mean gradients
                      Allreduce(int32[n] "used" counts)    who produced which gradient
                      (check_finite: int32[2n], the second half counting NaN/Inf gradients;
                      if any, allgather(names) of each rank's non-finite parameters)

Specs are (name, shape, dtype) in registration order, in the canonical
(PyTorch) layout; a bucket's flat buffer holds its parameters back to back in
the plan's order. This module holds the framework-free checks of that
exchange, so both sides fail with the same words.

The config exchange runs over the launcher's own channel (MPI's COMM_WORLD
under mpirun, c10d under torchrun), not over the transport under test: two
ranks that disagree about the transport would otherwise never meet.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_same_config", "check_same_specs", "nonfinite_error", "unused_parameters_error"]


def check_same_config(everyone: Sequence[dict]) -> None:
    """Raise on every rank if any rank's DDP arguments (bucket caps, transport) differ from rank 0's."""
    for r, theirs in enumerate(everyone[1:], start=1):
        for key, ours in everyone[0].items():
            if theirs.get(key) != ours:
                raise ValueError(
                    f"DistributedDataParallel arguments differ across ranks: {key} is {ours!r} on rank 0 but "
                    f"{theirs.get(key)!r} on rank {r}; every rank must pass the same {key} (the bucket plans and "
                    "the collectives they issue must match)"
                )


def check_same_specs(everyone: Sequence[Sequence[tuple]], what: str, item: str, items: str) -> None:
    """Raise on every rank if any rank's (name, shape, dtype) list differs from rank 0's.

    `everyone` is the allgathered list (identical on every rank, so every rank
    raises the same error); `what` starts the message, `item`/`items` name entries."""
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        for k, (a, b) in enumerate(zip(ref, theirs)):
            if tuple(a) != tuple(b):
                raise ValueError(
                    f"{what}: {item} #{k} is {_show(a)} on rank 0 but {_show(b)} on rank {r}; every rank must "
                    "build the same model before wrapping it"
                )
        if len(ref) != len(theirs):
            longer, r_long = (ref, 0) if len(ref) > len(theirs) else (theirs, r)
            raise ValueError(
                f"{what}: rank 0 has {len(ref)} {items}, rank {r} has {len(theirs)}; the first one only rank "
                f"{r_long} has is {_name(longer[min(len(ref), len(theirs))][0])}. Every rank must build the same "
                "model before wrapping it"
            )


def _name(name: str) -> str:
    return name if name.startswith("[") else repr(name)


def _show(spec) -> str:
    name, shape, dtype = spec
    return f"{_name(name)} {tuple(shape)} {dtype}"


def unused_parameters_error(names: Sequence[str], counts: Sequence[int], world: int, rank: int,
                            seen: Sequence[int]) -> RuntimeError:
    """The error every rank raises when some rank produced no gradient for a parameter."""
    lost = [(names[i], c) for i, c in enumerate(counts) if c < world]
    here = [names[i] for i, s in enumerate(seen) if not s]
    shown = ", ".join(f"{_name(n)} (on {world - c} of {world} ranks)" for n, c in lost[:10])
    more = f" (+{len(lost) - 10} more)" if len(lost) > 10 else ""
    return RuntimeError(
        f"parameters received no gradient in this backward pass: {shown}{more}; on this rank ({rank}): "
        f"{here or 'none'}. If parameters may go unused, pass find_unused_parameters=True; if they are never "
        "used, set requires_grad=False on them"
    )


def nonfinite_error(everyone: Sequence[Sequence[str]], rank: int) -> FloatingPointError:
    """The error every rank raises when check_finite found NaN/Inf in some rank's local gradients."""
    where = "; ".join(f"rank {r}: {', '.join(_name(n) for n in names[:5])}" + (" ..." if len(names) > 5 else "")
                      for r, names in enumerate(everyone) if names)
    return FloatingPointError(
        f"non-finite gradients (NaN or Inf) found by check_finite -- {where} (this is rank {rank}). .grad was "
        "left as it was; look at the loss and the inputs of those ranks, lower the learning rate, or skip the step"
    )
