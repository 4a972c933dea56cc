"""The collectives both portddp.torch and portddp.jax issue, in the same order.

Every rank must issue the same collectives in the same order, whatever
framework it runs -- that is what lets one `mpirun` job mix PyTorch and JAX
ranks (comparisons/mixed.py). Over the MPI transport the sequence is:

construction          allgather(config), launcher channel  agree on caps and transport (below)
                      allgather([specs, digest])           agree on the model (digest: JAX's of the
                                                           values, None from PyTorch, which broadcasts)
broadcast             allgather([specs, None]);            rank 0's parameters, in bucket layout
                      Bcast per bucket
                      (PyTorch: then Bcast of buffers, coalesced by dtype)
first JAX step, if    allgather(digest)                    refuse to average different models
values differed and                                        (every rank a JAX one: with a PyTorch
no broadcast                                               rank the digests are never compared)
iteration 2, once     Bcast(int64[n] ready order)          rebuild the plan from rank 0's order
each iteration        Allreduce per bucket, in plan order  the mean gradients
                      Allreduce(int32[n] "used" counts)    who produced which gradient
                      (check_finite: int32[2n], the second half counting NaN/Inf gradients;
                      if any, allgather(names) of each rank's non-finite parameters),
                      then int32[world]: each rank's step count in its own slot
first iteration       allgather(comm hook name or None)     the same hook on every rank (PyTorch: again
                                                           at the iteration after a later
                                                           register_comm_hook)
before a forward      Bcast(buffers + int64[3] header)      rank 0's buffers (PyTorch; Flax NNX: its
                      BatchStat etc.) and who sent them: (iterations done, synchronises?, syncs so far)

Specs are (name, shape, dtype) in registration order, in the canonical
(PyTorch) layout; a bucket's flat buffer holds its parameters back to back in
the plan's order. This module holds the framework-free checks of that
exchange, so both sides fail with the same words.

Checkpoints (portddp/checkpoint.py) add, over the launcher's channel:

checkpoint.save(collective=True)  allgather((RNG state, per_rank, error)) "checkpoint save"
                                  allgather(write error) "checkpoint save: written"
checkpoint.load                   allgather(None)        "checkpoint load" (every rank there:
                                                         rank 0's own save is finished)
                                  allgather((error, file, step)) "checkpoint load: read"
(checkpoint.save without collective=True issues none: rank 0 may save alone.)

Every collective is announced to portddp.watchdog's stall inspector with
`watchdog.collective(name)`, its waits wrapped in `watchdog.waiting(name)`;
names read "iteration <n> <what>" inside an iteration (what: "bucket <k>",
"buffer broadcast", "unused-count", ...), so that the inspector can say which
collective each rank is in, and the first one whose name differs across ranks.
Named launcher-channel allgathers (`launch.allgather_object(obj, name=...)`)
also compare the names across ranks and raise on a mismatch, and so does
every transport allgather (under the name last announced, its iteration
number aside).

The config exchange runs over the launcher's own channel (MPI's COMM_WORLD
under mpirun, c10d under torchrun), not over the transport under test: two
ranks that disagree about the transport would otherwise never meet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from portddp import env

__all__ = ["SHADOW", "buffer_layout", "buffer_sync_header", "check_buffer_sync_header", "check_same_config",
           "check_same_frozen", "check_same_hook",
           "check_same_specs", "check_same_step", "ddp_number", "hook_result_error", "nonfinite_error", "step_slot",
           "unused_parameters_error"]


_FRAMEWORKS = ("torch", "jax")  # keys of the arguments only one framework's DDP has


def check_same_config(everyone: Sequence[dict]) -> None:
    """Raise on every rank if any rank's DDP arguments (bucket caps, transport) differ from rank 0's.
    The arguments only one framework has (under the key "torch" or "jax": broadcast_buffers, ...)
    are compared among the ranks that send them (a job may mix PyTorch and JAX ranks)."""
    def flat(d, other):
        out = {k: v for k, v in d.items() if k not in _FRAMEWORKS}
        for fw in _FRAMEWORKS:
            if fw in d and fw in other:
                out.update(d[fw])
        return out

    for r, theirs in enumerate(everyone[1:], start=1):
        ref, theirs = flat(everyone[0], theirs), flat(theirs, everyone[0])
        for key in [*ref, *(k for k in theirs if k not in ref)]:
            ours = ref.get(key)
            if theirs.get(key) != ours:
                raise ValueError(
                    f"DistributedDataParallel arguments differ across ranks: {key} is {ours!r} on rank 0 but "
                    f"{theirs.get(key)!r} on rank {r}; every rank must pass the same {key} (the bucket plans and "
                    "the collectives they issue must match)"
                )


def check_same_specs(everyone: Sequence[Sequence[tuple]], what: str, item: str, items: str,
                     frozen: Sequence[Sequence[tuple] | None] | None = None) -> None:
    """Raise on every rank if any rank's (name, shape, dtype) list differs from rank 0's.

    `everyone` is the allgathered list (identical on every rank, so every rank
    raises the same error); `what` starts the message, `item`/`items` name entries;
    `frozen`: each rank's frozen parameters' specs, where known (then a parameter
    trainable on some ranks only is named frozen only if it is frozen on the others)."""
    ref = everyone[0]
    for r, theirs in enumerate(everyone[1:], start=1):
        known = None if frozen is None or frozen[0] is None or frozen[r] is None else (frozen[0], frozen[r])
        for k, (a, b) in enumerate(zip(ref, theirs)):
            if tuple(a) != tuple(b):
                if a[0] != b[0]:
                    _refuse_frozen_on_some_ranks(what, items, ref, theirs, r, known, guess=True)
                    _refuse_other_names(what, items, ref, theirs, r)
                raise ValueError(
                    f"{what}: {item} #{k} is {_show(a)} on rank 0 but {_show(b)} on rank {r}; every rank must "
                    f"build the same model before wrapping it{_x64_hint(a, b)}"
                )
        if len(ref) != len(theirs):
            _refuse_frozen_on_some_ranks(what, items, ref, theirs, r, known, guess=False)  # (the last ones, frozen)
            longer, r_long = (ref, 0) if len(ref) > len(theirs) else (theirs, r)
            raise ValueError(
                f"{what}: rank 0 has {len(ref)} {items}, rank {r} has {len(theirs)}; the first one only rank "
                f"{r_long} has is {_name(longer[min(len(ref), len(theirs))][0])}. Every rank must build the same "
                "model before wrapping it"
            )


def _x64_hint(a, b) -> str:
    """A hint where two specs differ only in a 64- against a 32-bit dtype of one kind (JAX's x64 flag)."""
    pair = {str(a[2]), str(b[2])}
    if tuple(a[:2]) == tuple(b[:2]) and pair in ({"float64", "float32"}, {"int64", "int32"},
                                                 {"complex128", "complex64"}, {"uint64", "uint32"}):
        return (" (64 bits on one rank, 32 on the other: JAX's jax_enable_x64 -- or JAX_ENABLE_X64 -- set on some "
                "ranks only?)")
    return ""


def _refuse_other_names(what: str, items: str, ref, theirs, r: int) -> None:
    """Raise, naming them, when rank r's entries and rank 0's are not the same names (an extra layer on
    one rank: its leaf paired by position with another name read as a rename)."""
    ours, others = [s[0] for s in ref], [s[0] for s in theirs]
    ours_set, others_set = set(ours), set(others)
    only_ref = [n for n in ours if n not in others_set]
    only_theirs = [n for n in others if n not in ours_set]
    if only_ref or only_theirs:
        raise ValueError(f"{what}: rank 0 and rank {r} have different {items}: {_names(only_ref)} only on rank 0, "
                         f"{_names(only_theirs)} only on rank {r}. Every rank must build the same model before "
                         "wrapping it")


def _refuse_frozen_on_some_ranks(what: str, items: str, ref, theirs, r: int, frozen, guess: bool) -> None:
    """Raise when rank r's trainable parameters are rank 0's minus some (or the other way round):
    frozen with requires_grad=False on some ranks only, or missing there. `frozen`: (rank 0's, rank
    r's) frozen specs, which tell the two apart; unknown (None), frozen is assumed if `guess`, else
    both are named."""
    if "trainable" not in items:
        return
    ours, others = [s[0] for s in ref], [s[0] for s in theirs]
    ours_set, others_set = set(ours), set(others)
    only_ref = [n for n in ours if n not in others_set]
    only_theirs = [n for n in others if n not in ours_set]
    if bool(only_ref) == bool(only_theirs):
        return
    differ = (f"{what}: rank 0 and rank {r} wrap different {items}: {_names(only_ref)} only on rank 0, "
              f"{_names(only_theirs)} only on rank {r}")
    fix = "Every rank must build the same model and freeze the same parameters before wrapping it"
    # (what else leaves a parameter out of a rank's plan, where the frozen sets do not tell: portddp.torch)
    other = ("; delay_all_reduce_named_params and _set_params_and_buffers_to_ignore_for_model leave them out too, "
             "and must name the same parameters on every rank")
    if frozen is not None:
        frozen_0, frozen_r = ({s[0] for s in f} for f in frozen)
        if not (set(only_ref) <= frozen_r and set(only_theirs) <= frozen_0):
            return
    elif not guess:
        raise ValueError(f"{differ} -- the other rank built its model without them, or set requires_grad=False on "
                         f"them (which leaves them out of its plan){other}. {fix}")
    raise ValueError(f"{differ}; a parameter set to requires_grad=False on some ranks only is left out of their "
                     f"plans{other if frozen is None else ''}. {fix}")


def _names(names: list, most: int = 5) -> str:
    if not names:
        return "none"
    shown = ", ".join(_name(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _name(name: str) -> str:
    return name if name.startswith("[") else repr(name)


def _show(spec) -> str:
    name, shape, dtype, *sparse = spec  # ("sparse",) after them: a torch parameter with a sparse gradient
    return f"{_name(name)} {tuple(shape)} {dtype}" + (" with a sparse gradient (nn.Embedding(sparse=True))" if sparse
                                                      else "")


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
        "used, set requires_grad=False on them before wrapping (frozen after it, they stay the wrapper's, as "
        "native DDP's)"
    )


def nonfinite_error(everyone: Sequence[Sequence[str]], rank: int, kept: str = ".grad was left as it was") \
        -> FloatingPointError:
    """The error every rank raises when check_finite found NaN/Inf in some rank's local gradients;
    `kept`: what became of this step's gradients (JAX: none are returned)."""
    where = "; ".join(f"rank {r}: {', '.join(_name(n) for n in names[:5])}" + (" ..." if len(names) > 5 else "")
                      for r, names in enumerate(everyone) if names)
    return FloatingPointError(
        f"non-finite gradients (NaN or Inf) found by check_finite -- {where} (this is rank {rank}). {kept}; "
        "look at the loss and the inputs of those ranks, lower the learning rate, or skip the step"
    )


def check_same_frozen(everyone: Sequence[Sequence]) -> None:
    """The third item of the model check (a PyTorch rank's frozen parameters, sent when it is about
    to broadcast them; a JAX rank has none and sends two items): every rank, of either framework,
    raises alike if the lists differ, before any rank broadcasts them."""
    lists = [e[2] if len(e) > 2 and e[2] is not None else None for e in everyone]
    if all(x is None for x in lists):
        return
    check_same_specs([x or [] for x in lists], "model mismatch across ranks", "frozen parameter",
                     "frozen (requires_grad=False) parameters")


def check_same_buffers(everyone: Sequence[Sequence]) -> None:
    """The fourth item of the model check (a PyTorch rank's buffers, where they are broadcast):
    every rank raises alike if the lists differ, before any rank broadcasts them. Not compared
    where some rank sent none (a JAX rank of a mixed job: its buffers come with each step)."""
    lists = [e[3] if len(e) > 3 else None for e in everyone]
    if any(x is None for x in lists):
        return
    check_same_specs(lists, "model mismatch across ranks (the buffers rank 0 broadcasts)", "buffer", "buffers")


def agreed_strides(everyone: Sequence[Sequence], count: int) -> list[tuple | None]:
    """The fifth item of the model check (a PyTorch rank's parameters' strides, where one is laid
    out densely in another order than C's -- channels_last, a transposed weight -- else None):
    per parameter, the strides every rank sent alike, else None. Native's reducer lays such a
    gradient out in its bucket slot in memory order; portddp does where every rank would lay it
    out the same -- else (strides differ across ranks, which native refuses, or a JAX rank of a
    mixed job, which sends none) in C order, the same slot for the same element everywhere."""
    lists = [e[4] if len(e) > 4 and e[4] is not None else [None] * count for e in everyone]
    return [ours if all(theirs[i] == ours for theirs in lists) else None for i, ours in enumerate(lists[0])]


BROADCAST_CHECK = "broadcast of rank 0's model: model check"
"""The name of the model check before a broadcast of rank 0's parameters (portddp.torch's at
construction, portddp.jax's ddp.broadcast(): one collective in a mixed job)."""

REPLAN_CHECK = "model check after a re-plan (a parameter's dtype, device or shape changed)"
"""(portddp.torch) The check at the forward after `.to()`/`.double()`/`p.data = ...` re-planned the buckets:
met by a rank alone when only that rank made the change (the stall report and the collectives check say so: watchdog.desync_hint)."""


SHADOW = 0  # the step slot of a rank that shadows the others in join(): not compared


_STEP_BITS = 20  # a step slot: the DDP's number above these bits, the step count + 1 in them
_STEP_MASK = (1 << _STEP_BITS) - 1


def ddp_number(built: int) -> int:
    """What a DistributedDataParallel puts in the upper bits of its step slots: 1-15 from the order
    the process built its world-wide DDPs in (`built` = 1, 2, ...; the 16th is 1 again), 0 for one
    over a subgroup (not compared)."""
    return 1 + (built - 1) % 15 if built > 0 else 0


def step_slot(step: int, ddp: int = 0) -> int:
    """What a training rank puts in its slot of the step exchange: its step count + 1, so that a
    rank that has not run a step yet (a JAX ddp.reduce() before any grad_fn call) is compared
    too (modulo 2**20 - 1); 0 (SHADOW) is left to join() shadows. Above it, `ddp` (ddp_number):
    which of the process's DistributedDataParallels reduces here. Below 2**24, so exact where the
    slots travel in a float32 bucket's tail."""
    return (ddp << _STEP_BITS) + step % _STEP_MASK + 1


def check_same_step(slots: Sequence[int], rank: int) -> None:
    """Raise on every rank if the ranks reached this reduction at different steps, or with other
    DistributedDataParallels.

    `slots` holds each rank's `step_slot(step count, its DDP's number)` (SHADOW: a rank that
    shadows the others in join(), not compared), exchanged in the per-iteration "used" collective
    or, for JAX's compiled strategy, gathered inside the program. A step is a forward with autograd
    on through the wrapper (no_sync ones included; JAX: a grad_fn call). A rank that ran one step
    locally that the others synchronised would otherwise average its step k+1 with the others'
    step k from then on, silently; ranks that run two DDPs' backward passes in other orders (a
    GAN's discriminator first on one rank, its generator first on another) sum one model's buckets
    with the other's. (A rank that skips a whole step looks like one with fewer batches: the
    watchdog names it when it ends.) PORTDDP_CHECK_STEPS=0 turns the step check off (not the DDP
    check)."""
    counted = [(r, int(n)) for r, n in enumerate(slots) if n != SHADOW]
    ddps = {n >> _STEP_BITS for _, n in counted}
    if len(ddps) > 1 and 0 not in ddps:
        where = ", ".join(f"rank {r} its DistributedDataParallel #{n >> _STEP_BITS}" for r, n in counted)
        raise RuntimeError(
            f"the ranks reduced different DistributedDataParallels here ({where}, numbered in the order each "
            f"process built them, modulo 15; this is rank {rank}): their buckets were summed with another model's. "
            "Every rank must run its DDPs' backward passes in the same order (a GAN: the discriminator's loss, then "
            "the generator's, on every rank) and build them in the same order")
    steps = {n & _STEP_MASK for _, n in counted}
    if len(steps) <= 1 or not env.flag("PORTDDP_CHECK_STEPS", True):
        return
    where = ", ".join(f"rank {r} at step {(n & _STEP_MASK) - 1}" for r, n in counted)
    never = [r for r, n in counted if n & _STEP_MASK == 1]
    raise RuntimeError(
        f"ranks reached this gradient reduction at different steps ({where}; this is rank {rank}; a step is a "
        "forward with autograd on through the wrapper, no_sync ones included -- JAX: a grad_fn call): some rank "
        "ran a step locally that the others synchronised, or the other way round (no_sync() / sync=False on some "
        "ranks only, a backward skipped on some ranks, a step that raised on some ranks and was caught and skipped "
        "there), so its gradients were being averaged with another step's; "
        "an evaluation forward with autograd on, on some ranks only (`if rank == 0: ddp(val_batch)`), counts as "
        "a step too: run it under torch.no_grad() or through ddp.module(...). "
        + (f"Rank(s) {', '.join(map(str, never))} reduced before running any step (JAX: ddp.reduce() before any "
           "grad_fn call; compute the local gradients with grad_fn(..., sync=False) on every rank). " if never else "")
        + "Every rank must run the same steps; give ranks with fewer batches join() (JAX: ddp.uneven()). If ranks "
        "accumulate different numbers of local steps on purpose, set PORTDDP_CHECK_STEPS=0")


def check_rebuild_order(order: Sequence[int], n: int, rank: int) -> list[int]:
    """Rank 0's gradient order as the plan rebuild's broadcast delivered it (-1: not observed):
    the observed indices, or an error on a rank that received something else -- its broadcast
    was paired with another collective of rank 0's."""
    observed = [int(i) for i in order if i >= 0]
    if len(order) == n and all(i < n for i in observed) and len(set(observed)) == len(observed):
        return observed
    raise RuntimeError(
        f"the bucket plan's rebuild on rank {rank} received something other than rank 0's gradient order from rank "
        "0's broadcast: the ranks issued different collectives here -- most likely a forward of the "
        "DistributedDataParallel wrapper on some ranks only (rank-0-only evaluation: its buffer broadcast met "
        "this one). Evaluate on every rank, or on one rank through ddp.module(...)")


def hook_result_error(hook: str, bucket: int, got: str, size: int, dtype: str, future: str) -> RuntimeError:
    """A comm hook's result is not the reduced bucket (both frontends: `future` is "future" or "handle")."""
    return RuntimeError(
        f"comm hook {hook}'s {future} for bucket {bucket} resolved to {got}, but the bucket holds {size} {dtype} "
        "gradients: return the whole reduced bucket (bucket.buffer() after the reduction), not a part or a "
        "summary of it")


def check_same_hook(everyone: Sequence[tuple[str, dict] | None], rank: int) -> None:
    """Raise on every rank if the comm hooks registered differ across ranks (checked once, at the
    first synchronised iteration, before any bucket is reduced). Each rank's entry: None (no hook)
    or (the hook's name, the settings of its state every rank must share: common.hook_settings)."""
    names = [None if e is None else e[0] for e in everyone]
    if len(set(names)) > 1:
        where = ", ".join(f"rank {r}: {h or 'none'}" for r, h in enumerate(names))
        raise RuntimeError(
            f"comm hooks differ across ranks ({where}; this is rank {rank}): every rank must call "
            "register_comm_hook with the same hook before the first backward, or (portddp.torch) at the same "
            "later step: a hook registered on some ranks only reduces buckets of other sizes than the others', "
            "which MPI and Gloo cannot pair")
    if names[0] is None:
        return
    first = everyone[0][1]
    for r, (_, settings) in enumerate(everyone):
        for key in sorted(set(first) & set(settings)):  # (both frameworks' PowerSGD: the settings they share)
            if first[key] != settings[key]:
                raise RuntimeError(
                    f"comm hook {names[0]}'s state differs across ranks: {key} is {first[key]} on rank 0 but "
                    f"{settings[key]} on rank {r} (this is rank {rank}). Every rank must register the hook with "
                    "the same settings, random_seed included: PowerSGD's ranks must compress alike, or their sums "
                    "mix matrices of other shapes (Gloo aborts, MPI hangs) or other random projections (silently)")


def buffer_sync_header(iterations: int, synchronises: bool, syncs: int, layout: int = 0) -> list[int]:
    """What a buffer broadcast carries besides the buffers: the sender's state, and `layout`, a
    digest of its buffers' shapes and dtypes (buffer_layout)."""
    return [int(iterations), int(synchronises), int(syncs), int(layout)]


def buffer_layout(shapes_and_dtypes: Sequence[tuple]) -> int:
    """A digest (int64) of the buffers' (shape, dtype name) in order, the same in every process."""
    text = ";".join(f"{tuple(int(n) for n in shape)}:{dtype}" for shape, dtype in shapes_and_dtypes)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def check_buffer_sync_header(theirs: Sequence[int], mine: Sequence[int], src: int, rank: int,
                             any_forward: bool = False) -> None:
    """Raise if the buffers just received were sent for another forward than this rank's.

    A forward on some ranks only broadcasts buffers the others receive in another forward.
    `any_forward` (portddp.torch): that is legal when only the kind of forward differs -- native
    DDP syncs buffers before a forward that follows a synchronising one, so `if rank == 0:
    evaluate(ddp)` under no_grad between two steps (nanoGPT's estimate_loss on a model with
    buffers) sends rank 0's buffers in its first evaluation forward, which the others receive in
    their next training forward, and rank 0's next training forward sends none: the same buffers
    at the same forwards as without it. The iteration count, the number of syncs and the layout
    must still agree."""
    if list(theirs) == list(mine):
        return
    it_src, sync_src, n_src, layout_src = theirs
    it_me, sync_me, n_me, layout_me = mine
    if any_forward and [it_src, n_src, layout_src] == [it_me, n_me, layout_me]:
        return
    if [it_src, sync_src, n_src] == [it_me, sync_me, n_me] and layout_src != layout_me:
        raise RuntimeError(
            f"the buffers rank {src} broadcast differ in shape or dtype from this rank's ({rank}), so this rank's "
            "were overwritten with bytes of another layout: a buffer registered or replaced after wrapping with "
            "another shape on some ranks (e.g. a mask sized by each rank's own sequence length). Every rank must "
            "hold the same buffers (shapes, dtypes, order): make it the same on every rank, keep per-rank state "
            "out of the module's buffers (a plain tensor attribute), or pass broadcast_buffers=False")

    def forward(it, sync, n):
        return (f"buffer sync #{n + 1}, for a forward {'that synchronises gradients' if sync else 'without gradient sync (no_grad/eval/no_sync)'}"
                f" after {it} synchronised iterations")

    raise RuntimeError(
        f"rank {src} broadcast its buffers in {forward(it_src, sync_src, n_src)}, but this rank ({rank}) is in "
        f"{forward(it_me, sync_me, n_me)}: a forward of the DistributedDataParallel wrapper ran on some ranks only "
        "(e.g. `if rank == 0: ddp(val_batch)`). Every forward of the wrapper syncs buffers and is collective: "
        "evaluate on one rank through ddp.module(...), or evaluate on every rank")

