"""What lets a script written for torchrun and native DDP run under mpirun with one changed line.

Importing `portddp.torch` under mpirun

* sets torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the MPI
  launcher's variables, so a script that decides "am I distributed?" from RANK
  takes its distributed path instead of silently training one model per rank;
* sets MASTER_ADDR and MASTER_PORT, unless they are set: rank 0 picks them and
  sends them over MPI (every rank imports at the same point, so the exchange
  is safe; processes the script starts inherit them and exchange nothing), as
  torchrun sets them before the script starts -- scripts read them themselves
  (pytorch/examples' distributed/ddp/example.py does, before
  init_process_group);
* wraps `torch.distributed.init_process_group` so that the script's own call
  after `portddp.init()` has created the default group adopts that group
  instead of failing with "trying to initialize the default process group
  twice". Any other call goes to PyTorch unchanged.

And wherever it is imported, `recognise_in_checkpoints` has torch.distributed.checkpoint's
state-dict API (get_state_dict, set_state_dict, get_model_state_dict...) treat portddp's
DistributedDataParallel as native's: that API names a native DDP's parameters without its
`module.` prefix, telling a DDP by `isinstance` with native's class, so a portddp model's keys
kept the prefix -- checkpoints written before the swap did not load after it, nor the other way.
"""

from __future__ import annotations

import functools
import logging
import os

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from portddp import launch
from portddp.lazy import after_import

__all__ = ["install", "recognise_in_checkpoints"]

_log = logging.getLogger("portddp")


def install() -> None:
    """Export torchrun's variables under mpirun and wrap init_process_group (once)."""
    launch.export_torchrun_env(rendezvous=True)
    if getattr(dist.init_process_group, "__portddp__", False):
        return
    wrapped = _adopting(c10d.init_process_group)
    dist.init_process_group = wrapped
    c10d.init_process_group = wrapped


def _adopting(original):
    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if dist.is_initialized() and launch.MADE_C10D:
            size, rank = kwargs.get("world_size", -1), kwargs.get("rank", -1)
            if size not in (-1, None, dist.get_world_size()) or rank not in (-1, None, dist.get_rank()):
                raise ValueError(
                    f"init_process_group(world_size={size}, rank={rank}) after portddp.init() created a group "
                    f"with rank {dist.get_rank()} of {dist.get_world_size()}: drop the call or the arguments")
            _log.info("init_process_group: adopting the default group portddp.init() created (rank %d of %d)",
                      dist.get_rank(), dist.get_world_size())
            return None
        init_method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        under_mpirun = launch.detect().launcher == "mpirun"
        if (under_mpirun and init_method in (None, "env://") and kwargs.get("store") is None
                and "MASTER_PORT" not in os.environ):
            launch.export_torchrun_env(rendezvous=True)
        made = original(*args, **kwargs)
        if under_mpirun:  # (a script that never destroys it sometimes aborted at exit: see launch)
            launch.destroy_c10d_at_exit()
        return made

    init_process_group.__portddp__ = True
    return init_process_group


_DCP_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def recognise_in_checkpoints(cls) -> None:
    """Add `cls` to the DDP check of torch.distributed.checkpoint.state_dict (its module-level `DDP`, used
    only in `isinstance(obj, DDP)`), now if a script imported it already, else when it does: importing it
    takes ~0.6 s, which a script that never uses it should not pay."""
    def add(module) -> None:
        if not isinstance(module.DDP, tuple):
            module.DDP = (module.DDP, cls)

    after_import(_DCP_STATE_DICT, add)
