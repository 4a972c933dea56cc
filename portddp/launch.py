"""Who am I, and who else is there: rank and world from the launcher.

Three ways to start, one `World` value:

* `mpirun -n K python ...` -- ranks from MPI (mpi4py). Rank 0 picks a free TCP
  port and its own reachable address and broadcasts both over MPI, so c10d and
  jax.distributed need no extra configuration. `MASTER_ADDR` / `MASTER_PORT`
  override the choice (e.g. a job spanning hosts with several interfaces).
* `torchrun --nproc-per-node K ...` -- ranks and rendezvous from its env vars.
* plain `python ...` -- a world of one.

`init()` also initialises the c10d default process group (Gloo on CPU, NCCL
when asked for and CUDA is present) and pins each rank to its share of the
cores: ranks on one host compete for the same cores otherwise.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import ipaddress
import os
import random
import re
import socket
import stat
import sys
import time
from pathlib import Path

from portddp.watchdog import env_seconds

__all__ = ["World", "detect", "init", "world", "mpi_comm", "allgather_object", "export_torchrun_env",
           "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout (seconds) for c10d where neither init(timeout_s=...) nor the
PORTDDP_TIMEOUT_S environment variable sets one (read by init, not at import: a bad
value on one rank then stops every rank instead of leaving them waiting for it)."""


def _timeout_from_env() -> float:
    return env_seconds("PORTDDP_TIMEOUT_S", DEFAULT_TIMEOUT_S)


_INIT_SETTINGS = "portddp.init: settings"


def _agree(obj, problem: str | None, name: str) -> list:
    """Every rank's `obj` (allgather_object; for init's own exchange, before any DDP, an MPI allgather
    of its own, checked by name alike but not counted among the collectives the stall inspector
    numbers), with this rank's `problem` (a setting it could not read, or None) beside it: if any rank
    has one, every rank raises it, naming the rank -- a rank raising alone would leave the others
    waiting in this collective, and itself in MPI_Finalize's."""
    if name == _INIT_SETTINGS:
        comm = mpi_comm()
        got = unpack_named(allgather_pickled(comm, (name, (obj, problem))), name, comm.rank)
    else:
        got = allgather_object((obj, problem), name=name)
    bad = [(r, p) for r, (_, p) in enumerate(got) if p is not None]
    if bad:
        raise ValueError("; ".join(f"rank {r}: {p}" for r, p in bad)
                         + (" (every rank stops: fix it where it is set)" if len(got) > 1 else ""))
    return [o for o, _ in got]

# Rank variables set by the MPI launchers we know (MPICH/Hydra, Open MPI, Slurm's PMI).
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str  # "mpirun", "torchrun" or "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _first_env(names, default=None):
    for n in names:
        if n in os.environ:
            return os.environ[n]
    return default


def _launched_by_mpi() -> bool:
    """Whether this process is a rank mpirun started: its launcher's variables, not merely inherited
    -- a DataLoader worker started with "spawn" or "forkserver", or a helper process a rank starts,
    has them too, but is no rank (MPI_Init would abort it: "PMI_Init returned -1"). Such a worker has
    a multiprocessing parent; under MPICH's launcher a rank holds the socket named by PMI_FD, which
    a process it starts does not inherit (subprocess closes it). Decided once per process, before
    MPI_Init (which may close that socket)."""
    global _LAUNCHED_BY_MPI
    if _LAUNCHED_BY_MPI is None or _LAUNCHED_BY_MPI[0] != os.getpid():  # (a forked child decides for itself)
        _LAUNCHED_BY_MPI = os.getpid(), _first_env(_MPI_RANK_VARS) is not None and _started_as_rank()
    return _LAUNCHED_BY_MPI[1]


_LAUNCHED_BY_MPI: tuple[int, bool] | None = None  # (pid, the answer) of the process that decided


def started_by_an_mpi_rank() -> bool:
    """A process with an mpirun rank's variables that is no rank itself: one the rank started
    (torch.multiprocessing.spawn, a multiprocessing or subprocess child)."""
    return _first_env(_MPI_RANK_VARS) is not None and not _launched_by_mpi()


def refuse_mpi_outside_ranks(what: str, instead: str) -> None:
    """`what` (portddp.torch's transport='mpi', portddp.jax's hooked strategy) needs MPI ranks: in a
    process an mpirun rank started, MPI_Init would abort it ("PMI_Init returned -1"). `instead`: the
    other way, for the message."""
    if started_by_an_mpi_rank():
        raise ValueError(
            f"{what} needs MPI ranks, and this process (pid {os.getpid()}) is not one: an mpirun rank started it "
            "(torch.multiprocessing.spawn, multiprocessing, subprocess), and MPI cannot be joined from there. Let "
            f"mpirun start one process per rank (`mpirun -n K python train.py` without spawn), or {instead}")


def _started_as_rank() -> bool:
    import multiprocessing  # noqa: PLC0415

    if multiprocessing.parent_process() is not None:
        return False
    fd = os.environ.get("PMI_FD", "")
    if fd.isdigit():
        try:
            return stat.S_ISSOCK(os.fstat(int(fd)).st_mode)
        except OSError:
            return False
    return True


def mpi_comm():
    """MPI.COMM_WORLD (importing mpi4py initialises MPI with thread support)."""
    # MPICH's nonblocking all-reduce (the MPI transport's, across hosts): a ring, which keeps every
    # link busy at once; its default algorithm took 1.6x as long over TCP with 3 hosts (README).
    os.environ.setdefault("MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM", "tsp_ring")
    from mpi4py import MPI  # noqa: PLC0415 -- MPI_Init happens at import; only when needed

    if MPI.COMM_WORLD.Get_size() == 1:
        # A job of one (also a script started without mpirun) has no peer to attach to the /dev/shm
        # segment MPICH made in MPI_Init: its name can go now, so that no way of ending leaves it
        # behind (several ranks: portddp.init, after their first collective).
        from portddp import watchdog  # noqa: PLC0415

        watchdog.unlink_mpi_shared_memory()
    return MPI.COMM_WORLD


def detect() -> World:
    """Read rank/world from the launcher's environment (no communication)."""
    if _launched_by_mpi():
        comm = mpi_comm()
        local = int(_first_env(_MPI_LOCAL_VARS, comm.rank))
        local_size = int(_first_env(_MPI_LOCAL_SIZE_VARS, comm.size))
        return World(comm.rank, comm.size, local, local_size, "mpirun")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return World(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
            "torchrun",
        )
    return World(0, 1, 0, 1, "none")


def export_torchrun_env(rendezvous: bool = False) -> None:
    """Under mpirun, give this process torchrun's variables, so scripts written for torchrun
    (reading RANK, LOCAL_RANK, WORLD_SIZE, ... or calling init_process_group() with env://)
    run unchanged. RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE come from the MPI
    launcher's own variables (no communication); with `rendezvous`, MASTER_ADDR and
    MASTER_PORT too -- rank 0 picks them and broadcasts them over MPI, so every rank must
    call it at the same point. Variables already set are kept."""
    w = detect() if _launched_by_mpi() else None
    if w is None:
        return
    for name, value in (("RANK", w.rank), ("WORLD_SIZE", w.size), ("LOCAL_RANK", w.local_rank),
                        ("LOCAL_WORLD_SIZE", w.local_size)):
        os.environ.setdefault(name, str(value))
    if rendezvous and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        global _CHOSEN_PORT
        users = os.environ.get("MASTER_PORT")
        addr, port = rendezvous_address(w)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        if not users:
            _CHOSEN_PORT = str(port)


_CHOSEN_PORT: str | None = None
"""MASTER_PORT as portddp chose it (not the user): the JAX coordinator then gets a free port of its
own rather than MASTER_PORT + 1, which nobody checked was free."""


def _reachable_address() -> str | None:
    """A non-loopback IPv4 address of this host, or None.

    The UDP connect sends nothing; it only asks the kernel which interface
    would route outwards."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            addr = s.getsockname()[0]
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addr = info[4][0]
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    except OSError:
        pass
    return None


def _port_taken(port: int) -> str | None:
    """Why `port` cannot be listened on here (None: it can)."""
    if not 0 < port < 65536:  # (MASTER_PORT=65535 + 1 for the JAX coordinator: bind() would raise)
        return "there is no such TCP port"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _until_listening(addr: str, port: int, within_s: float = 5.0) -> None:
    """Wait (up to `within_s`) until rank 0's JAX coordinator accepts connections. A client that
    connects before the service listens is retried by gRPC after a 1 s back-off: every rank then
    started ~0.9 s late (jax.distributed.initialize took 0.9-1.0 s here; 0.2 s with the others 0.2 s
    behind rank 0). An address that does not resolve, or the time running out, leaves it to
    jax.distributed's own retries, timeout and messages, as before."""
    try:  # (once: a slow lookup must not be paid at every try)
        family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with socket.socket(family, kind, proto) as probe:
            probe.settimeout(0.5)
            try:
                probe.connect(where)
                return
            except OSError:
                pass
        time.sleep(0.005)


def _free_port() -> int:
    """A TCP port nothing is bound to here now, for a server another call starts later (c10d's store,
    JAX's coordinator), from outside the kernel's ephemeral range where it leaves room. A port the
    kernel hands out itself (a bind to port 0) lies inside that range, where until the server listens
    any other process's bind to port 0 or outgoing connection may be given it too -- the server then
    fails to start, or a peer connects to a stranger's socket and waits for ever. Outside the range
    only a process naming the same port can meet it."""
    pool = _port_pool()
    if pool is not None:
        pick = random.SystemRandom()  # (not the script's seeded `random`: every job would pick alike)
        for _ in range(64):
            port = pick.randint(*pool)
            if _port_taken(port) is None:
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _port_pool() -> tuple[int, int] | None:
    """Where _free_port picks from: below the ephemeral range, under 30000 (Kubernetes' NodePorts
    start there; on a node's host network they are redirected with no socket listening), or above
    it; None where neither leaves 2000 ports. Its top is one below the last: the JAX coordinator
    takes MASTER_PORT + 1 (in a process the rank starts, which does not know portddp chose it)."""
    lo, hi = _ephemeral_range()
    below, above = (15000, min(lo - 2, 29999)), (hi + 1, 65534)
    return next((p for p in (below, above) if p[1] - p[0] >= 2000), None)


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks from for a bind to port 0 and for outgoing connections."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # (Linux's default; the pool below it is outside macOS's 49152-65535 too)
    return lo, hi


def rendezvous_address(w: World, purpose: str = "c10d") -> tuple[str, int]:
    """(address, port) of rank 0, the same on every rank.

    Under mpirun rank 0 chooses and broadcasts; under torchrun the env has it.
    MASTER_PORT is used for c10d; the JAX coordinator takes MASTER_PORT + 1."""
    offset = 0 if purpose == "c10d" else 1
    if w.launcher != "mpirun":
        if "MASTER_PORT" not in os.environ and w.size > 1:
            raise RuntimeError(f"{w.launcher} launch without MASTER_PORT: set MASTER_ADDR and MASTER_PORT")
        port = int(os.environ["MASTER_PORT"]) + offset if "MASTER_PORT" in os.environ else _free_port()
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), port
    comm = mpi_comm()
    hosts = _hostnames()  # (a collective, once: before rank 0 goes its own way)
    local = _one_host(w)
    mine = None
    if w.rank == 0:
        addr = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if local else _reachable_address())
        asked = os.environ.get("MASTER_PORT")
        if offset and asked == _CHOSEN_PORT:
            asked = None  # portddp's own choice for c10d: nobody asked for the port after it
        port = int(asked) + offset if asked else _free_port()
        mine = (addr, port, socket.gethostname(), _port_taken(port) if asked else None)
    addr, port, host0, taken = comm.bcast(mine, root=0)
    if taken is not None:  # every rank raises, not only rank 0 (the others would wait for it forever)
        variable = "MASTER_PORT" if offset == 0 else f"MASTER_PORT (+{offset} for the {purpose} coordinator)"
        raise RuntimeError(f"port {port} on rank 0 ({host0}) is already in use ({taken}), and {variable} asks for "
                           "it: set MASTER_PORT to a free port, or unset it and portddp picks one")
    if addr is None:
        # Loopback is only reachable when every rank shares rank 0's host.
        if any(h != host0 for h in hosts):
            raise RuntimeError(
                f"rank 0 ({host0}) found no non-loopback address, but the job spans hosts "
                f"{sorted(set(hosts))}: set MASTER_ADDR to an address of {host0} the others can reach"
            )
        addr = "127.0.0.1"
    return addr, port


_HOSTNAMES: list[str] | None = None


def _hostnames() -> list[str]:
    """Every rank's hostname, in rank order (under mpirun; an allgather the first time: every rank
    calls this at the same point)."""
    global _HOSTNAMES
    if _HOSTNAMES is None:
        _HOSTNAMES = mpi_comm().allgather(socket.gethostname())
    return _HOSTNAMES


def _one_host(w: World) -> bool:
    """Whether every rank of the job runs on this host: then rank 0's rendezvous and the watchdog
    listen on loopback, and no traffic of portddp's own goes to an interface address. Not on an
    emulated cluster, whose "hosts" talk over their links. Under mpirun: the launcher counts every
    rank as local (MPI_LOCALNRANKS or the like) and every rank has this hostname (_hostnames: two
    machines may share a hostname). Under torchrun: LOCAL_WORLD_SIZE, set, equals WORLD_SIZE. When in doubt: no (an address the other
    hosts reach, as before)."""
    if "PORTDDP_CLUSTER" in os.environ:
        return False
    if w.launcher != "mpirun":
        return "LOCAL_WORLD_SIZE" in os.environ and w.local_size == w.size
    return w.local_size == w.size and len(set(_hostnames())) == 1


def _pin_threads(w: World, num_threads: int | None) -> int:
    """Give each rank its share of the cores: in torch, in numpy's BLAS and (if JAX has not
    computed anything yet) in XLA. numpy's OpenBLAS otherwise starts a thread per core in
    every rank, and its idle threads spin: on two cores shared by two ranks that alone made
    every step half as fast.

    XLA's CPU client sizes its compute pool when it starts, from the PJRT_NPROC (or NPROC)
    environment variable if set, else from the cores this process may run on;
    `--xla_cpu_multi_thread_eigen` no longer limits it (jax 0.10: a jitted matmul still ran
    on two threads). Without it, two ranks on two cores ran four XLA compute threads whose
    idle workers spin: one JAX step in four took 3-5 x its median, burning CPU all along.
    The default share is the host's cores over its ranks, at most the cores this rank may
    run on (bound, or in a container)."""
    import numpy  # noqa: F401, PLC0415 -- loads its BLAS, so that the limit below reaches it
    import threadpoolctl  # noqa: PLC0415

    from portddp.lazy import after_import  # noqa: PLC0415

    if num_threads is not None and not (isinstance(num_threads, int) and num_threads >= 1):
        raise ValueError(f"portddp.init(num_threads={num_threads!r}): pass a whole number of threads, 1 or more "
                         "(or leave it out: the host's cores over its ranks)")
    if num_threads is None:
        # On an emulated cluster (portddp.cluster) every "host" shares this machine's cores.
        sharing = w.size if "PORTDDP_CLUSTER" in os.environ else w.local_size
        share = (os.cpu_count() or 1) // max(1, sharing)
        if hasattr(os, "sched_getaffinity"):  # (a rank bound to its cores, or a restricted container)
            share = min(share, len(os.sched_getaffinity(0)))
        num_threads = max(1, share)
    # (in torch when a script imports it: a JAX-only job need not load torch)
    after_import("torch", lambda torch: torch.set_num_threads(num_threads))
    threadpoolctl.threadpool_limits(num_threads)
    if not _xla_started():  # (XLA reads these when its CPU client starts)
        if "PJRT_NPROC" not in os.environ and "NPROC" not in os.environ:  # (the user's own win)
            os.environ["PJRT_NPROC"] = str(num_threads)  # the size of XLA's compute pool
        flags = os.environ.get("XLA_FLAGS", "")
        if num_threads == 1 and "xla_cpu_multi_thread_eigen" not in flags:  # (older XLA's Eigen)
            os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
    return num_threads


def _xla_started() -> bool:
    """Has JAX created its backends (and XLA read its thread settings)? Importing jax does not;
    the first computation or jax.devices() does."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is not None and bool(getattr(bridge, "_backends", True))  # (unknown jax: assume so)


_WORLD: World | None = None
MADE_C10D = False
"""True once init() has created c10d's default group (portddp.torch lets a script's own
init_process_group() adopt it)."""
_C10D_PID = 0  # the process that made it


def world() -> World:
    """The World of the last init(), or what the launcher says if init() was not called."""
    return _WORLD if _WORLD is not None else detect()


def init(
    backend: str | None = None,
    *,
    world_size: int | None = None,
    timeout_s: float | None = None,
    num_threads: int | None = None,
    torch_distributed: bool = True,
    jax_distributed: bool = False,
    watchdog: bool = True,
) -> World:
    """Join the job: detect rank/world and initialise c10d's default group.

    backend: "gloo" (default), or "nccl" (needs CUDA; each rank takes GPU local_rank).
    world_size: the size you expect; a launcher that disagrees is an error.
    timeout_s: collective timeout (default PORTDDP_TIMEOUT_S or 300 s).
    num_threads: compute threads per rank, in torch, numpy's BLAS and XLA (default: cores /
        ranks on this host; XLA's only before JAX's first computation: PJRT_NPROC, below).
    torch_distributed: False skips c10d (e.g. transport="mpi" only).
    jax_distributed: also start jax.distributed (CPU collectives over Gloo), which
        portddp.jax's "compiled" strategy needs; call init() before any JAX computation.
    watchdog: watch the other ranks on this host and exit (code 70, naming the lost
        rank) as soon as one dies, instead of hanging in a collective (portddp.watchdog).
    """
    global _WORLD, _WATCHDOG_DECLINED
    w = detect()
    if world_size is not None and world_size != w.size:
        raise RuntimeError(
            f"portddp.init(world_size={world_size}) but the launcher ({w.launcher}) started "
            f"{w.size} process(es): launch with `mpirun -n {world_size} ...` or pass world_size={w.size}"
        )
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    _pin_threads(w, num_threads)
    problem = None
    if timeout_s is None:
        try:
            timeout_s = _timeout_from_env()
        except ValueError as e:
            problem, timeout_s = str(e), DEFAULT_TIMEOUT_S
    elif not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise ValueError(f"portddp.init(timeout_s={timeout_s!r}): pass the collective timeout in seconds, a number > 0")
    if w.launcher == "mpirun" and w.size > 1:  # (under torchrun its agent stops the others when one rank fails)
        _agree(None, problem, _INIT_SETTINGS)
    elif problem is not None:
        raise ValueError(problem)
    export_torchrun_env(rendezvous=w.size > 1)
    if torch_distributed:
        _init_c10d(w, backend or "gloo", timeout_s)
    _WORLD = w
    _WATCHDOG_DECLINED = not watchdog
    if watchdog and w.size > 1:
        # Before jax.distributed: a rank that fails to start it (e.g. its port taken) then stops the
        # others, instead of leaving them waiting for its coordinator until the timeout.
        _start_watchdog(w, torch_distributed, timeout_s)
    if jax_distributed:
        _init_jax(w, timeout_s)
    return w


_WATCHDOG = None
_WATCHDOG_DECLINED = False  # portddp.init(watchdog=False)


def ensure_watchdog() -> None:
    """Start portddp.watchdog from a DistributedDataParallel's construction when portddp.init() did
    not (a torchrun-style script that calls init_process_group itself, or a transport="mpi" script
    that calls nothing): without it a rank that raises or ends early leaves the others waiting in
    MPI's shared memory forever (c10d: until its timeout). The construction's config check is a
    collective of every rank at the same point; the watchdog's address exchange runs beside it. Not
    after portddp.init(watchdog=False) or with PORTDDP_WATCHDOG=0."""
    w = world()
    if _WATCHDOG is not None or _WATCHDOG_DECLINED or w.size == 1:
        return
    dist = sys.modules.get("torch.distributed")
    torch_distributed = dist is not None and dist.is_available() and dist.is_initialized()
    try:
        timeout_s, problem = _scripts_timeout_s(dist if torch_distributed else None), None
    except ValueError as e:  # (a bad PORTDDP_TIMEOUT_S: carried in the exchange, as the watchdog's own settings)
        timeout_s, problem = DEFAULT_TIMEOUT_S, str(e)
    _start_watchdog(w, torch_distributed=torch_distributed, by="DDP construction", timeout_s=timeout_s,
                    problem=problem, stall_s=_scripts_stall_s(timeout_s))


def _scripts_stall_s(timeout_s: float) -> float:
    """The stall inspector's default in a script without portddp.init(): shortly before the script's own
    timeout, where native DDP's job would fail -- at 80 % of it, a wait native allows (rank 0 evaluating
    alone for 25 of the default 30 minutes) was stopped, an audit found; 30 s leave the inspector time to
    ask every rank before c10d's own error (80 % of a timeout under 150 s)."""
    return max(0.8 * timeout_s, timeout_s - 30.0)


def _scripts_timeout_s(dist) -> float:
    """How long a script that did not call portddp.init() lets a collective wait, for the stall
    inspector (which speaks 30 s before it, at 80 % of a short one): PORTDDP_TIMEOUT_S where set, else its own process
    group's timeout, else PyTorch's default (30 minutes) -- as native DDP would wait, so that
    legitimate work on one rank (an evaluation or a checkpoint on rank 0 only) is not cut short."""
    if "PORTDDP_TIMEOUT_S" in os.environ:
        return _timeout_from_env()
    if dist is not None:
        import torch  # noqa: PLC0415

        try:
            group = dist.distributed_c10d._get_default_group()
            return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 (a backend without CPU, or other options: PyTorch's default)
            pass
    return _TORCH_DEFAULT_TIMEOUT_S


_TORCH_DEFAULT_TIMEOUT_S = 1800.0  # torch.distributed's default_pg_timeout (not imported for JAX scripts)


def allgather_object(obj, *, name: str | None = None) -> list:
    """Every rank's `obj`, in rank order, over the launcher's own channel (MPI's COMM_WORLD
    under mpirun, c10d under torchrun): independent of whichever transport a DDP uses.

    `name` (e.g. "checkpoint save") names the collective for portddp.watchdog's stall inspector
    and is checked: if the ranks met in differently named calls (each thinking it was in another
    collective), every rank raises, naming each rank's call, instead of using the wrong objects."""
    from portddp import watchdog  # noqa: PLC0415

    w = world()
    if w.size == 1:
        return [obj]
    label = name or "allgather_object"
    watchdog.collective(label)
    if w.launcher == "mpirun":
        with watchdog.waiting(label):
            got = allgather_pickled(mpi_comm(), (name, obj))
    else:
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_initialized():
            if started_by_an_mpi_rank():
                raise RuntimeError(
                    f"this process (pid {os.getpid()}) was started by an mpirun rank (spawn, multiprocessing, "
                    f"subprocess) and inherited its RANK={w.rank} and WORLD_SIZE={w.size}, but it is no MPI rank and "
                    "c10d is not initialised here: call torch.distributed.init_process_group(...) in it first (as a "
                    "spawned worker of a torchrun script does), or do this in the rank mpirun started")
            raise RuntimeError(f"launched by {w.launcher} with {w.size} ranks but c10d is not initialised: "
                               "call portddp.init() or torch.distributed.init_process_group() first")
        got = [None] * w.size
        with watchdog.waiting(label):
            dist.all_gather_object(got, (name, obj))
    return unpack_named(got, name, w.rank)


def test_then_sleep(request, max_pause: float = 1e-3, spin_s: float = 0.0, hold=None) -> None:
    """Wait for a nonblocking MPI request without spinning: test it (which drives MPI's progress)
    for `spin_s`, then sleep between tests, 20 us at first, doubling up to `max_pause`. With `hold`
    (watchdog.deferred_interrupt's), a KeyboardInterrupt meanwhile goes to it and the wait goes on."""
    pause, spin_until = 20e-6, time.perf_counter() + spin_s
    while True:
        try:
            if request.Test():
                return
            if time.perf_counter() > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, max_pause)
        except KeyboardInterrupt as e:
            if hold is None:
                raise
            hold(e)


def allgather_pickled(comm, obj, wait=None) -> list:
    """Every rank's `obj` over the MPI communicator `comm`, in rank order. mpi4py's own
    `comm.allgather(obj)` is a blocking MPI call, which polls a core for as long as a peer is late
    (6.1 of the 8 CPU seconds a rank waited for a peer busy elsewhere: loading data, writing a
    checkpoint, compiling): here the sizes, then the pickled bytes, go in two nonblocking
    allgathers, each waited for with `wait(request)` -- by default tests and sleeps on this
    thread, a Ctrl-C meanwhile raised once both are done (abandoned half-way, the next collective
    would pair with them on the other ranks)."""
    import pickle  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    from portddp import watchdog  # noqa: PLC0415

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    with watchdog.deferred_interrupt() as (hold, release):
        if wait is None:
            def wait(request):
                test_then_sleep(request, spin_s=50e-6, hold=hold)
        # (C ints, as mpi4py's own object allgather sends them: a rank that meets this in mpi4py's
        # blocking one -- a mistake -- exchanges alike, and unpack_named names the mismatch)
        sizes = np.empty(comm.size, np.intc)
        wait(comm.Iallgather([np.array([data.size], np.intc), MPI.INT], [sizes, MPI.INT]))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.intc)
        everyone = np.empty(int(sizes.sum()), np.uint8)
        wait(comm.Iallgatherv([data, MPI.BYTE], [everyone, sizes, starts, MPI.BYTE]))
        release()
    return [pickle.loads(everyone[a:a + n].tobytes()) for a, n in zip(starts, sizes)]


def allgather_named(allgather, obj, rank: int) -> list:
    """`allgather(obj)` (any transport's object allgather), checked as `allgather_object(name=...)`
    is, under the name of the collective this rank issued last (portddp.watchdog.collective)."""
    from portddp import watchdog  # noqa: PLC0415

    name = watchdog.current() or None
    return unpack_named(allgather((name, obj)), name, rank)


def unpack_named(got: list, name: str | None, rank: int) -> list:
    """The objects of an allgather of (name, obj) pairs, once every rank's name is `name`'s: ranks
    that met in differently named calls (each thinking it is in another collective) raise, on every
    rank, naming each rank's call, instead of using the wrong objects. An iteration number in a
    name ("iteration 3: model check") is not compared: the step checks judge those."""
    def bare(n):
        return re.sub(r"^iteration \d+: ", "", n) if isinstance(n, str) else n

    # (a rank inside another collective may send anything: not a (name, obj) pair at all)
    pairs = [g if isinstance(g, tuple) and len(g) == 2 else (f"another collective ({type(g).__name__})", None)
             for g in got]
    names = [n for n, _ in pairs]
    if name is not None and any(bare(n) != bare(name) for n in names):
        where = "; ".join(f"rank {r}: {n or 'an unnamed allgather_object'!r}" for r, n in enumerate(names))
        fix = f"e.g. call {bare(name)!r} on every rank, or on none"
        if len({"watchdog addresses" in str(n) for n in names}) > 1:
            fix = "the watchdog is on for some ranks only: set PORTDDP_WATCHDOG, and portddp.init(watchdog=...), " \
                  "alike on every rank"
        from portddp.watchdog import desync_hint  # noqa: PLC0415

        hint = desync_hint(set(map(str, names)))  # (what usually causes this pair: then instead of the generic fix)
        raise RuntimeError(f"the ranks met in different collectives -- {where} (this is rank {rank}). Every rank "
                           "must make the same calls in the same order" + (hint or f" ({fix})"))
    return [o for _, o in pairs]


def _start_watchdog(w: World, torch_distributed: bool, timeout_s: float = DEFAULT_TIMEOUT_S,
                    by: str = "portddp.init", problem: str | None = None, stall_s: float | None = None) -> None:
    """Connect every rank to every other for portddp.watchdog, once per process. `problem`: a setting
    this rank could not read (carried in the address exchange, which then stops every rank). `stall_s`:
    the stall inspector's default (else 80 % of `timeout_s`)."""
    global _WATCHDOG
    from portddp import watchdog  # noqa: PLC0415

    if _WATCHDOG is not None:
        return
    if w.launcher != "mpirun" and not torch_distributed:
        return  # no channel to exchange addresses on before any collective
    # Its settings first: a bad one on any rank travels in the address exchange and stops every rank.
    # (Every rank makes the same calls up to that exchange: _one_host may gather the hostnames.)
    config = server = me = None
    try:
        if not watchdog.enabled():
            if problem is not None:
                raise ValueError(problem)
            return
        config = watchdog.settings(stall_s=0.8 * timeout_s if stall_s is None else stall_s)
    except ValueError as e:
        problem = problem or str(e)
    local = _one_host(w)
    if problem is None:
        try:
            server, me = watchdog.listen("127.0.0.1" if local else (_reachable_address() or "127.0.0.1"))
        except OSError as e:
            problem = f"the watchdog could not listen on this host ({e})"
    try:
        peers = _agree(me, problem, f"{by}: watchdog addresses")
    except ValueError:
        if server is not None:
            server.close()
        raise
    if w.launcher == "mpirun":  # every rank is past MPI_Init, attached to MPICH's segment: its name can go
        watchdog.unlink_mpi_shared_memory()
    try:
        _WATCHDOG = watchdog.start(w.rank, server, peers, config)
    except OSError as e:  # every rank ends up here (a peer it waits for never connects): run without it
        import warnings  # noqa: PLC0415

        warnings.warn(f"portddp: rank {w.rank} runs without the watchdog (could not connect the ranks: {e}); "
                      "a lost rank will be noticed by the collective timeouts only", stacklevel=2)


def _init_jax(w: World, timeout_s: float) -> None:
    """One CPU device per process, all processes in one jax.distributed job."""
    import jax  # noqa: PLC0415

    if jax.distributed.is_initialized():
        if jax.process_count() != w.size:
            raise RuntimeError(f"jax.distributed is already initialised with {jax.process_count()} processes, "
                               f"but the launcher ({w.launcher}) started {w.size}")
        return
    if w.size == 1:
        return  # a world of one needs no coordinator
    # The coordinator gets its own port: c10d's TCPStore may hold the first one.
    addr, port = rendezvous_address(w, purpose="jax")
    if w.launcher != "mpirun":  # under mpirun rendezvous_address checked it; here rank 0 checks and tells
        taken = _port_taken(port) if w.rank == 0 else None
        import torch.distributed as dist  # noqa: PLC0415

        if dist.is_available() and dist.is_initialized():
            taken = allgather_object(taken, name="portddp.init: port check")[0]
        if taken is not None:
            raise RuntimeError(f"port {port} on rank 0 ({socket.gethostname() if w.rank == 0 else addr}) is already "
                               f"in use ({taken}), and MASTER_PORT (+1 for the jax coordinator) asks for it: set "
                               "MASTER_PORT so that MASTER_PORT + 1 is a free port too")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service takes SIGTERM for itself (a "preemption notice" a training loop must
    # poll): a SIGTERM from mpirun or a scheduler then stopped nothing (one job ran 189 s past it).
    # Off, unless asked for; portddp.watchdog then handles SIGTERM as without JAX.
    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
        jax.config.update("jax_enable_preemption_service", False)
    bare = addr.strip("[]")  # (an IPv6 address, as torch takes it or bracketed; JAX wants it bracketed)
    if w.rank != 0:
        _until_listening(bare, port)
    host = f"[{bare}]" if ":" in bare else bare
    jax.distributed.initialize(coordinator_address=f"{host}:{port}", num_processes=w.size, process_id=w.rank,
                               initialization_timeout=int(timeout_s))
    from portddp import watchdog  # noqa: PLC0415

    watchdog.reclaim()  # its goodbye before jax's shutdown barrier at exit; SIGTERM back


def _init_c10d(w: World, backend: str, timeout_s: float) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA, and torch.cuda.is_available() is False: use backend='gloo'")
    if dist.is_initialized():
        if dist.get_world_size() != w.size or dist.get_rank() != w.rank:
            raise RuntimeError(
                f"a c10d process group already exists with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher ({w.launcher}) says rank {w.rank} of {w.size}: "
                "destroy it first (torch.distributed.destroy_process_group()) or let portddp.init() create it"
            )
        return
    addr, port = rendezvous_address(w)
    if backend == "nccl":
        torch.cuda.set_device(w.local_rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=w.rank,
        world_size=w.size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    global MADE_C10D
    MADE_C10D = True
    destroy_c10d_at_exit()


def destroy_c10d_at_exit() -> None:
    """Take the default c10d group down at exit (once per process): left to the interpreter's teardown,
    Gloo's threads sometimes abort the process ("terminate called without an active exception") after
    the script has finished. For the group portddp.init() made, and under mpirun for the one a
    drop-in script made itself (portddp.torch's init_process_group)."""
    global _C10D_PID
    if _C10D_PID != os.getpid():
        _C10D_PID = os.getpid()
        atexit.register(_destroy_c10d)


def _destroy_c10d() -> None:
    import gc  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    if os.getpid() != _C10D_PID:  # a child forked from the rank: the group is the parent's (its threads are not here)
        return
    if dist.is_initialized():
        # First free what still refers to the group's work (a DDP wrapper the script dropped, its
        # last iteration's futures, in reference cycles the collector has not reached yet): freed
        # after the group, during the interpreter's teardown, they sometimes aborted the process
        # ("terminate called without an active exception") after a script had finished.
        gc.collect()
        try:
            dist.destroy_process_group()
        except Exception:  # at exit, nothing more useful to do with it
            pass
