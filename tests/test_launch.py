"""World detection and init() without a launcher, under torchrun-style env, and the NCCL path."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from portddp.launch import World, _port_pool, detect
from tests import mpi


def test_alone_is_a_world_of_one(monkeypatch):
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert detect() == World(0, 1, 0, 1, "none")


def test_a_job_of_one_leaves_no_mpi_shared_memory_however_it_ends():
    """(A single-process run killed by SIGTERM left MPICH's /dev/shm/mpich_shm_* segment in RAM: only
    MPI_Finalize removes it, and portddp.init unlinks it only for several ranks.) Its name is gone
    as soon as MPI is up; the process keeps its mapping."""
    proc = subprocess.Popen([sys.executable, "-c", "from portddp.launch import mpi_comm; mpi_comm(); "
                             "print('up', flush=True); import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, cwd=mpi.ROOT)
    try:
        assert proc.stdout.readline().strip() == "up"
        with open(f"/proc/{proc.pid}/maps") as maps:
            segments = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/mpich_" in line}
        assert segments and all(s.endswith("(deleted)") for s in segments), segments
    finally:
        proc.kill()
        proc.wait()


def test_torchrun_environment(monkeypatch):
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert detect() == World(3, 4, 1, 2, "torchrun")


def test_one_host_under_torchrun_only_when_local_world_size_says_so(monkeypatch):
    """Loopback for the rendezvous and the watchdog only when LOCAL_WORLD_SIZE, set, covers the job: a
    launcher that sets RANK and WORLD_SIZE alone (Slurm-style scripts) may span hosts."""
    from portddp import launch  # noqa: PLC0415

    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "PORTDDP_CLUSTER",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not launch._one_host(detect())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not launch._one_host(detect())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch._one_host(detect())
    monkeypatch.setenv("PORTDDP_CLUSTER", "{}")  # an emulated cluster's hosts talk over their links
    assert not launch._one_host(detect())


def test_mpirun_world_and_rendezvous():
    # one write() per rank: a record is not split when mpirun merges the ranks' output
    """Rank and world from mpirun; on one host, the rendezvous and the watchdog on loopback (no traffic
    of portddp's own to an interface address)."""
    # (the peer's address is read before a barrier: a rank that has written its record and left
    # makes the other's watchdog close the socket to it -- getpeername() then fails, EBADF)
    code = ("import os, torch, portddp, torch.distributed as d; from portddp import launch; w = portddp.init(); "
            "peer = launch._WATCHDOG.socks[1 - w.rank].getpeername()[0]; launch.allgather_object(None); "
            "os.write(1, f'WORLD {w.rank} {w.size} {w.launcher} {d.get_rank()} {d.get_world_size()} "
            "{torch.get_num_threads()} {os.environ[\"MASTER_ADDR\"]} {peer} {os.environ[\"MASTER_PORT\"]}\\n'.encode())")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([mpi.mpirun_path(), "-n", "2", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, env=env)
    records = sorted(re.findall(r"WORLD (\d+) (\d+) (\w+) (\d+) (\d+) (\d+) (\S+) (\S+) (\d+)", proc.stdout))
    assert len(records) == 2, proc.stdout + proc.stderr
    pool = _port_pool()
    for r, (rank, size, launcher, c10d_rank, c10d_size, threads, master, peer, port) in enumerate(records):
        assert (int(rank), int(size), launcher, int(c10d_rank), int(c10d_size)) == (r, 2, "mpirun", r, 2)
        assert int(threads) >= 1
        assert master == "127.0.0.1" and peer == "127.0.0.1", (master, peer)
        # portddp's choice of port: outside the range the kernel hands out to other processes (_free_port),
        # where it leaves room
        assert port == records[0][-1] and (pool is None or pool[0] <= int(port) <= pool[1]), (port, pool)


def test_init_gives_xla_one_compute_thread_per_rank_share():
    """init(num_threads=1) before JAX starts: XLA's CPU client sizes its compute pool to it (PJRT_NPROC;
    --xla_cpu_multi_thread_eigen alone no longer limits it), so two ranks on two cores do not run
    four compute threads. Counted as the process's XLA compute threads after a jitted matmul."""
    code = ("import os, jax, jax.numpy as jnp, portddp\n"  # (importing jax first is fine: it computed nothing)
            "portddp.init(num_threads=1, torch_distributed=False, watchdog=False)\n"
            "x = jnp.ones((512, 512)); jax.jit(lambda a: a @ a)(x).block_until_ready()\n"
            "names = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
            "print('XLA-THREADS', sum(n.startswith('tf_XLA') for n in names), os.environ.get('PJRT_NPROC'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "PJRT_NPROC", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "XLA-THREADS 1 1" in proc.stdout, proc.stdout + proc.stderr


def test_a_jax_rank_loads_neither_torch_nor_torchdynamo_and_torch_still_gets_its_threads():
    """A rank's start pays for what it uses: init(torch_distributed=False) loads no torch (~1 s), yet
    a script that imports torch afterwards gets init's thread count there; importing portddp.torch
    and training a step loads no TorchDynamo (1.2 s: only torch.compile needs it)."""
    code = ("import sys, portddp\n"
            "portddp.init(num_threads=1, torch_distributed=False, watchdog=False)\n"
            "print('TORCH-LOADED', 'torch' in sys.modules)\n"
            "import torch\n"
            "print('TORCH-THREADS', torch.get_num_threads())\n"
            "from portddp.torch import DistributedDataParallel\n"
            "m = DistributedDataParallel(torch.nn.Linear(4, 4), transport='mpi')\n"
            "m(torch.ones(2, 4)).sum().backward()\n"
            "print('DYNAMO-LOADED', 'torch._dynamo' in sys.modules, m.module.weight.grad is not None)\n"
            "torch.optim.SGD(m.parameters(), lr=0.1).step()  # (PyTorch loads TorchDynamo here)\n"
            "print('DISABLED', [getattr(f, '_torchdynamo_disable', False) for f in\n"
            "                   (DistributedDataParallel._pre_forward, DistributedDataParallel._post_forward)])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TORCH-LOADED False" in proc.stdout and "TORCH-THREADS 1" in proc.stdout, proc.stdout
    assert "DYNAMO-LOADED False True" in proc.stdout, proc.stdout
    # once it is loaded, what talks to other ranks is kept out of compiled graphs, as native's is
    assert "DISABLED [True, True]" in proc.stdout, proc.stdout


def test_a_setting_for_a_module_not_yet_imported_survives_lookups_and_failed_imports(tmp_path):
    """after_import acts at the module's first successful import: not at a lookup
    (importlib.util.find_spec, as libraries probe for torch), nor at an import that fails; an action
    that raises is logged, never raised into the script's import."""
    (tmp_path / "flaky.py").write_text(
        "import os\nif not os.environ.get('FLAKY_OK'):\n    raise ImportError('not yet')\nvalue = 1\n")
    code = ("import importlib.util, os, sys\n"
            "from portddp.lazy import after_import\n"
            "seen = []\n"
            "after_import('flaky', lambda m: seen.append(m.value))\n"
            "after_import('flaky', lambda m: 1 / 0)\n"
            "after_import('flaky', lambda m: seen.append(m.value + 1))\n"
            "assert importlib.util.find_spec('flaky') is not None and seen == []\n"
            "try:\n    import flaky\nexcept ImportError:\n    pass\n"
            "os.environ['FLAKY_OK'] = '1'\n"
            "import flaky\n"
            "print('SEEN', seen, any(type(f).__name__ == '_AfterImport' for f in sys.meta_path))\n"
            "after_import('flaky', lambda m: seen.append('now'))\n"
            "print('LATER', seen)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SEEN [1, 2] False" in proc.stdout and "LATER [1, 2, 'now']" in proc.stdout, proc.stdout
    assert "ZeroDivisionError" in proc.stderr  # (logged)


def test_num_threads_is_checked_when_init_is_called():
    import portddp  # noqa: PLC0415

    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match=rf"num_threads={bad!r}\): pass a whole number of threads, 1 or more"):
            portddp.init(num_threads=bad, torch_distributed=False, watchdog=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_nccl_without_cuda_says_so():
    code = "import portddp; portddp.init(backend='nccl')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "backend='nccl' needs CUDA" in proc.stderr and "use backend='gloo'" in proc.stderr


def test_unknown_backend():
    import portddp  # noqa: PLC0415

    with pytest.raises(ValueError, match="unknown backend 'mpi-ish'"):
        portddp.init(backend="mpi-ish", torch_distributed=False)


def test_torch_and_jax_distributed_in_one_process():
    code = ("import os, portddp, torch.distributed as d; w = portddp.init(jax_distributed=True); import jax; "
            "os.write(1, f'BOTH {w.rank} {d.get_world_size()} {jax.process_count()} {jax.process_index()}\\n'.encode())")
    proc = subprocess.run([mpi.mpirun_path(), "-n", "2", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120)
    # Ranks share one stdout: match records, not lines.
    found = sorted(re.findall(r"BOTH (\d) (\d) (\d) (\d)", proc.stdout))
    assert found == [("0", "2", "2", "0"), ("1", "2", "2", "1")], proc.stdout + proc.stderr


@pytest.mark.parametrize("name,value,zero_means", [("PORTDDP_TIMEOUT_S", "abc", None), ("PORTDDP_TIMEOUT_S", "0", None),
                                                   ("PORTDDP_TIMEOUT_S", "-5", None), ("PORTDDP_WATCHDOG_S", "nan", None),
                                                   ("PORTDDP_STALL_S", "-1", "the stall inspector off")])
def test_time_settings_in_the_environment_are_checked_naming_the_variable(monkeypatch, name, value, zero_means):
    """(Was: float()'s bare "could not convert string to float: 'abc'" while portddp was imported, or
    c10d's "timed out after 0ms" connecting.)"""
    from portddp.watchdog import env_seconds  # noqa: PLC0415

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^{name}='{value}': set it to a number of seconds > 0.*, or unset it"):
        env_seconds(name, 300, zero_means=zero_means)
    monkeypatch.setenv(name, "2.5")
    assert env_seconds(name, 300, zero_means=zero_means) == 2.5
    monkeypatch.setenv("PORTDDP_STALL_S", "0")
    assert env_seconds("PORTDDP_STALL_S", 240, zero_means="the stall inspector off") == 0
    monkeypatch.delenv(name)
    assert env_seconds(name, 300) == 300


@pytest.mark.parametrize("name,value,how", [("PORTDDP_TIMEOUT_S", "abc", "init"), ("PORTDDP_TIMEOUT_S", "abc", "ddp"),
                                            ("PORTDDP_STALL_S", "-1", "ddp")])
def test_a_bad_setting_on_one_rank_stops_every_rank_naming_it(name, value, how):
    """(An audit: PORTDDP_STALL_S=abc on rank 1 alone -- rank 1 raised after the watchdog's address exchange,
    rank 0 waited for its connection and then in c10d for ever, past 420 s; PORTDDP_TIMEOUT_S=abc raised while
    portddp was imported, the others waited likewise.) Checked before the first exchange, carried in it: init()'s
    own exchange for the timeout; the watchdog's address exchange for its settings (PORTDDP_STALL_S,
    PORTDDP_WATCHDOG_S, PORTDDP_EARLY_EXIT_GRACE_S: one reader, watchdog.settings), here from a DDP's
    construction without init()."""
    code = ("import portddp, torch\n"
            + ("portddp.init()\n" if how == "init" else "")
            + "from portddp.torch import DistributedDataParallel as DDP\n"
              "DDP(torch.nn.Linear(2, 2), transport='mpi')\nprint('BUILT', flush=True)\n")
    proc = subprocess.run([mpi.mpirun_path(), "-n", "1", sys.executable, "-c", code, ":", "-n", "1", "-env", name, value,
                           sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=mpi.ROOT)
    assert proc.returncode != 0 and "BUILT" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    # (the message itself, not the line: mpirun merges the ranks' tracebacks as they are written, and the
    # exception's type and its message are separate writes -- "ValueError    : rank 1: ..." was seen once)
    said = re.findall(rf"rank 1: {name}='{re.escape(value)}': set it to a number of seconds.*every rank "
                      r"stops: fix it where it is set", proc.stderr)
    assert len(said) == 2 and proc.stderr.count("ValueError") >= 2, proc.stderr[-3000:]  # rank 0's and rank 1's


def test_transport_c10d_without_a_process_group_says_so_in_natives_words():
    code = ("import torch\nfrom portddp.torch import DistributedDataParallel as DDP\n"
            "try:\n    DDP(torch.nn.Linear(2, 2))\nexcept ValueError as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PORTDDP_", "RANK", "WORLD_SIZE"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=mpi.ROOT)
    assert re.search(r"REFUSED Default process group has not been initialized, please make sure to call "
                     r"init_process_group\. \(transport='c10d' needs a c10d process group: .*portddp\.init\(\)",
                     out.stdout), out.stdout + out.stderr[-2000:]


def test_transport_mpi_in_a_c10d_group_made_by_spawn_is_refused_on_every_rank(tmp_path):
    """The DDP tutorial's torch.multiprocessing.spawn script with PORTDDP_TRANSPORT=mpi: each child was an MPI
    world of one, and the ranks trained apart, exit 0 (an audit). Refused, naming the fix, in every child."""
    script = tmp_path / "spawned.py"
    script.write_text(
        "import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp\n"
        "from portddp.torch import DistributedDataParallel as DDP\n"
        "def child(rank, port):\n"
        "    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=2)\n"
        "    try:\n"
        "        DDP(torch.nn.Linear(2, 2), transport='mpi')\n"
        "        os.write(1, f'BUILT {rank}\\n'.encode())\n"
        "    except ValueError as e:\n"
        "        os.write(1, f'REFUSED {rank} {e}\\n'.encode())  # (one write: the children share stdout)\n"
        "    dist.destroy_process_group()\n"
        "if __name__ == '__main__':\n"
        "    mp.spawn(child, args=(int(sys.argv[1]),), nprocs=2)\n")
    from portddp.launch import _free_port  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PORTDDP_", "RANK", "WORLD_SIZE"))}
    proc = subprocess.run([sys.executable, str(script), str(_free_port())], capture_output=True, text=True,
                          timeout=120, cwd=mpi.ROOT, env=env)
    refused = re.findall(r"REFUSED (\d) transport='mpi' needs MPI ranks, and this process is rank \1 of a c10d group "
                         r"of 2 made without mpirun \(torch\.multiprocessing\.spawn.*MPI sees a world of 1 here.*use "
                         r"transport='c10d'", proc.stdout)
    assert sorted(refused) == ["0", "1"] and "BUILT" not in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_processes_a_rank_starts_are_no_ranks():
    """DataLoader workers started with "spawn" / "forkserver" and a helper subprocess import
    portddp.torch again under mpirun's inherited variables: they must not run MPI_Init (which
    aborted them), and the ranks train on alike. Such a process asking for transport='mpi' is told
    what it is (it was told torchrun had started the job)."""
    proc = mpi.run(2, "tests.workers.spawned_child", timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # mpirun merges the ranks' output as written, and an unbuffered print writes its text and its newline
    # apart: one rank's line could run straight into the other's (tests/workers/__init__.py now sends lines
    # whole; the patterns hold either way: each match ends where the next tag begins).
    end = r"(?=SPAWNED rank=|MPI_CHILD rank=|JAX_CHILD rank=|$)"
    rows = re.findall(r"SPAWNED rank=(\d) digest=(\S+?) helper_rc=(\d+) helper='([^']*)'", proc.stdout)
    assert sorted(r[0] for r in rows) == ["0", "1"], proc.stdout + proc.stderr[-3000:]
    assert len({r[1] for r in rows}) == 1, rows  # the same parameters on both ranks
    assert all(r[2] == "0" and r[3] == "helper ok" for r in rows), rows
    refusals = re.findall(r"MPI_CHILD rank=\d (.*?)" + end, proc.stdout, re.M)
    assert len(refusals) == 2 and all(re.search(r"transport='mpi' needs MPI ranks, and this process \(pid \d+\) is "
                                                r"not one: an mpirun rank started it", m) for m in refusals), refusals
    refusals = re.findall(r"JAX_CHILD rank=\d (.*?)" + end, proc.stdout, re.M)  # (portddp.jax's hooked strategy alike)
    assert len(refusals) == 2 and all(re.search(r"strategy='hooked' \(its collectives go over MPI\) needs MPI ranks, "
                                                r"and this process \(pid \d+\) is not one", m) for m in refusals), refusals


def test_the_stall_inspector_of_a_script_without_init_waits_as_long_as_its_group():
    """A DDP built without portddp.init() (a torchrun script with the import changed) starts the
    watchdog itself; its stall inspector speaks 30 s before the script's own process group timeout
    (PyTorch's 30 minutes by default; 80 % of a short one), not at 80 % of portddp's 300 s: rank 0
    evaluating alone for minutes (nanoGPT's estimate_loss) is legitimate there, as under native DDP."""
    code = (
        "import datetime, os, torch.distributed as dist\n"
        "from portddp import launch\n"
        "print('none', launch._scripts_timeout_s(None))\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d' % launch._free_port(), rank=0, "
        "world_size=1, timeout=datetime.timedelta(seconds=1234))\n"
        "print('group', launch._scripts_timeout_s(dist))\n"
        "os.environ['PORTDDP_TIMEOUT_S'] = '77'\n"
        "print('env', launch._scripts_timeout_s(dist))\n"
        "dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if k != "PORTDDP_TIMEOUT_S"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(line.split() for line in out.stdout.splitlines())
    assert float(got["none"]) == 1800.0 and float(got["group"]) == 1234.0, got
    assert float(got["env"]) == 77.0, got  # PORTDDP_TIMEOUT_S, where set, decides
    from portddp import launch  # noqa: PLC0415

    assert [launch._scripts_stall_s(t) for t in (1800.0, 1234.0, 77.0)] == [1770.0, 1204.0, 0.8 * 77.0]



def test_a_group_of_one_warns_unless_the_script_passed_it(monkeypatch):
    """A DDP whose group has one rank in a job of three trains alone: said when the group is the default
    one (the script never initialised the launcher's world), not for `process_group=dist.new_group([2])`
    (an audit: the warning told a rank training on its own subgroup on purpose to call portddp.init())."""
    from types import SimpleNamespace  # noqa: PLC0415

    from portddp import launch  # noqa: PLC0415
    from portddp.torch.native import NativeInterface  # noqa: PLC0415

    monkeypatch.setattr(launch, "detect", lambda: World(2, 3, 2, 3, "mpirun"))
    alone = SimpleNamespace(world_size=1, transport="c10d")
    with pytest.warns(RuntimeWarning, match=r"this job has 3 ranks \(mpirun\), but DistributedDataParallel's c10d "
                                            r"group has 1: every rank will train its own model"):
        NativeInterface._warn_if_alone(alone)
    import warnings  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NativeInterface._warn_if_alone(alone, process_group=object())


@pytest.mark.parametrize("name,value,reader,pattern", [
    ("PORTDDP_SHM_SCRATCH_MB", "0", "shm.scratch_mb", r"a number of MB >= 0\.0625"),
    ("PORTDDP_SHM_SCRATCH_MB", "abc", "shm.scratch_mb", r"a number of MB >= 0\.0625"),
    ("PORTDDP_SHM_ARENA_MB", "-1", "shm.arena_mb", r"a number of MB > 0, or 0 \(no arena"),
    ("PORTDDP_MPI_ALLREDUCE", "nccl", "transport._settings", r"one of shm, mpi"),
    ("PORTDDP_MPI_WAIT", "spinn", "transport._settings", r"one of spin, sleep"),
    ("PORTDDP_EARLY_EXIT_GRACE_S", "nan", None, r"a number of seconds > 0, or 0 \(a rank that left is named at once\)"),
    ("PORTDDP_CLUSTER_MTU", "1500.5", "cluster.Cluster", r"a whole number of bytes >= 576"),
    ("PORTDDP_CHECK_STEPS", "maybe", "env.flag", r"1 \(or true, yes, on\) or 0 \(or false, no, off\)"),
])
def test_other_settings_in_the_environment_are_checked_naming_the_variable(monkeypatch, name, value, reader, pattern):
    """Every PORTDDP_* variable is read through portddp.env: a bad value names the variable, what it takes and
    its default (were: float()'s "could not convert string to float", numpy's "range() arg 3 must not be zero"
    for a scratch of 0, a misspelt choice or "false" silently taken for the default)."""
    import importlib  # noqa: PLC0415

    from portddp import env  # noqa: PLC0415

    monkeypatch.setenv(name, value)
    calls = {"shm.scratch_mb": lambda f: f(), "shm.arena_mb": lambda f: f(), "transport._settings": lambda f: f(),
             "cluster.Cluster": lambda f: f(hosts=2), "env.flag": lambda f: f(name, True)}
    if reader is None:
        call = lambda: env.number(name, 5.0, unit="seconds", zero_means="a rank that left is named at once")  # noqa: E731
    else:
        module, attr = reader.split(".")
        call = lambda: calls[reader](getattr(importlib.import_module(f"portddp.{module}"), attr))  # noqa: E731
    with pytest.raises(ValueError, match=rf"^{name}='{re.escape(value)}': set it to .*{pattern}.*, or unset it"):
        call()
    monkeypatch.setenv(name, "  ")
    if reader is not None:
        call()  # empty: the default


def test_switches_in_the_environment_take_the_usual_spellings(monkeypatch):
    from portddp import env  # noqa: PLC0415

    for value, want in [("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("yes", True)]:
        monkeypatch.setenv("PORTDDP_CHECK_STEPS", value)
        assert env.flag("PORTDDP_CHECK_STEPS", True) is want
    monkeypatch.setenv("PORTDDP_MPI_WAIT", "SLEEP")
    assert env.choice("PORTDDP_MPI_WAIT", "", ("spin", "sleep")) == "sleep"


def test_a_jax_rank_waits_for_the_coordinator_to_listen_then_goes_on_and_gives_up_in_time():
    """Ranks other than 0 connect to the JAX coordinator only once it listens (gRPC retries a refused
    client after a 1 s back-off, which every JAX job paid); with nobody listening, the wait ends on
    its own and jax.distributed's own retries take over."""
    import socket  # noqa: PLC0415
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from portddp.launch import _free_port, _until_listening  # noqa: PLC0415

    port = _free_port()
    start = time.monotonic()
    _until_listening("127.0.0.1", port, within_s=0.3)  # nobody there
    assert 0.3 <= time.monotonic() - start < 5
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        late = threading.Timer(0.2, server.listen)  # the coordinator comes up while the rank waits
        late.start()
        start = time.monotonic()
        _until_listening("127.0.0.1", port, within_s=30)
        waited = time.monotonic() - start
        late.join()
    assert 0.2 <= waited < 10, waited
    try:  # an IPv6 address (unbracketed here: _init_jax strips the brackets jax.distributed wants)
        server = socket.socket(socket.AF_INET6)
        server.bind(("::1", 0))
    except OSError:
        return  # (no IPv6 loopback here)
    with server:
        server.listen()
        start = time.monotonic()
        _until_listening("::1", server.getsockname()[1], within_s=30)
        assert time.monotonic() - start < 2


def test_jax_distributed_starts_on_an_ipv6_master_addr():
    """A torchrun-style start (RANK, WORLD_SIZE, MASTER_ADDR, no mpirun) with MASTER_ADDR=::1, as torch takes
    it: the JAX coordinator's address is bracketed ([::1]:port); unbracketed, the ranks never met."""
    import socket  # noqa: PLC0415

    from portddp.launch import _free_port  # noqa: PLC0415

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    code = ("import portddp, jax\nw = portddp.init(torch_distributed=False, jax_distributed=True)\n"
            "print('MET', w.rank, jax.process_count(), flush=True)\n")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_"))}
    ranks = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": port})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=90)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    for r, out in enumerate(outs):
        assert f"MET {r} 2" in out, out[-2000:]
