"""The emulated cluster (portddp/cluster.py): real namespaces, veth links, tc shaping, real MPI and Gloo.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from portddp import cluster
from tests import mpi

WHY = cluster.unavailable()
needs_cluster = pytest.mark.skipif(WHY is not None, reason=f"no emulated cluster here: {WHY}")


@pytest.mark.parametrize("text,bps", [("1gbit", 1e9), ("500mbit", 5e8), ("2.5gbit", 2.5e9), ("640Mbit", 6.4e8),
                                      ("unlimited", None)])
def test_parse_rate(text, bps):
    assert cluster.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "-1gbit", "0.0mbit", ""])
def test_parse_rate_refuses_nonsense_naming_it(text):
    with pytest.raises(ValueError, match=f"link rate {text!r} not understood: use e.g. 1gbit"):
        cluster.parse_rate(text)


def _ours() -> set[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {n for n in names if n.startswith(cluster.PREFIX)} | {
        w.rstrip(":").split("@")[0] for w in links.split() if w.startswith(cluster.PREFIX)}


@needs_cluster
def test_a_shaped_link_carries_its_rate_and_everything_is_removed():
    """A TCP stream between two hosts of a 500 Mbit/s cluster: within 10 % of the rate; nothing left after."""
    with cluster.Cluster(2, "500mbit") as c:
        receiver = subprocess.Popen([*c.exec_prefix(1), sys.executable, "-c", (
            "import socket,time\n"
            f"s=socket.create_server(('{c.addresses[1]}', 5201)); c,_=s.accept(); n=0; t=None\n"
            "while True:\n"
            "    d=c.recv(1<<20)\n"
            "    if not d: break\n"
            "    t=t or time.perf_counter(); n+=len(d)\n"
            "print(n*8/(time.perf_counter()-t))\n")], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        subprocess.run([*c.exec_prefix(0), sys.executable, "-c", (
            "import socket,time\n"
            f"s=socket.create_connection(('{c.addresses[1]}', 5201)); b=b'x'*(1<<20)\n"
            "for _ in range(60): s.sendall(b)\n"
            "s.close()\n")], check=True, timeout=60)
        bps = float(receiver.communicate(timeout=60)[0])
        sent = c.interface_bytes()[0]["tx_bytes"]
        setup_s = c.setup_s
    assert 0.90 * 5e8 <= bps <= 1.10 * 5e8, f"measured {bps / 1e6:.0f} Mbit/s on a 500 Mbit/s link"
    assert sent >= 60 * 2**20, sent  # the stream crossed h0's interface
    assert setup_s + c.teardown_s < 10, (setup_s, c.teardown_s)
    assert not {n for n in _ours() if str(c.job) in n}, _ours()


@needs_cluster
def test_every_implementation_crosses_the_link(tmp_path):
    """The overlap experiment on 2 hosts: each implementation's hosts send what a ring all-reduce of its
    gradients implies (within 10 %, headers included) -- a transport that bypassed the link would not."""
    proc = mpi.run(None, "portddp.cli", "run", "overlap", "-n", "2", "--hosts", "2", "--link", "2gbit", "--",
                   "--width", "512", "--depth", "4", "--rounds", "1", "--steps-per-round", "3", "--warmup", "2",
                   "--out-dir", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "overlap-n2-h2-2gbit.json").read_text())
    assert payload["cluster"]["hosts"] == 2 and payload["cluster"]["link"] == "2gbit"
    seen = set()
    for row in payload["rows"]:
        if row["impl"].endswith("-local"):
            assert row["wire_bytes_per_step"] < 0.01 * row["param_bytes"], row["label"]
            continue
        ratio = row["wire_bytes_per_step"] / row["param_bytes"]  # n=2: a ring sends the gradients once
        assert 0.98 <= ratio <= 1.10, (row["label"], ratio)
        seen.add(row["impl"])
    assert seen == {"native", "torch-c10d", "torch-mpi", "jax-hooked", "jax-compiled"}, seen
    assert "h0: sent" in proc.stderr and "removed" in proc.stderr
    # The report shows the cluster run with its bytes and bound, and replays it in the simulator.
    from comparisons.report import build  # noqa: PLC0415

    md = (build(tmp_path, tmp_path / "report").parent / "report.md").read_text()
    assert "emulated cluster: 2 hosts x 1 rank(s), 2gbit links" in md and "### On the wire" in md
    wire = md.split("### On the wire")[1].split("\n\n")[1]
    assert wire.count("\n| torch-") >= 4 and "| jax-hooked |" in wire, wire
    sim = mpi.run(None, "portddp.cli", "simulate", str(tmp_path / "overlap-n2-h2-2gbit.json"), "--world", "64",
                  "--link", "10gbit", "--bucket-cap", "1", timeout=60)
    assert sim.returncode == 0 and "prediction at 64 ranks, link 10 Gbit/s: step" in sim.stdout, sim.stderr


@needs_cluster
def test_equivalence_on_two_hosts(tmp_path):
    """Every implementation trains the same on the cluster as on one machine (the harness's own bound)."""
    proc = mpi.run(None, "portddp.cli", "compare", "-n", "2", "--hosts", "2", "--link", "1gbit", "--",
                   "--model", "mlp", "--steps", "3", "--out", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = list(tmp_path.glob("*/result.json"))
    assert results and all(json.loads(p.read_text())["ok"] for p in results)


@needs_cluster
def test_a_killed_launcher_leaves_nothing_after_the_next_start():
    """kill -9 of `portddp cluster` while its job runs: the next start removes its namespaces, links and
    the processes still inside them."""
    launcher = subprocess.Popen([sys.executable, "-m", "portddp.cluster", "-n", "2", "--hosts", "2", "--",
                                 "sleep", "60"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not {n for n in _ours() if n.startswith(f"{cluster.PREFIX}{launcher.pid}h")}:
        assert time.monotonic() < deadline, "the cluster never came up"
        time.sleep(0.1)
    time.sleep(1.0)  # the job's processes are inside by now
    inside = subprocess.run(["ip", "netns", "pids", f"{cluster.PREFIX}{launcher.pid}h1"], capture_output=True,
                            text=True).stdout.split()
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    stale = {n for n in _ours() if str(launcher.pid) in n}
    assert stale, "nothing to clean up? (the test did not catch the cluster alive)"
    removed = cluster.cleanup_stale()
    assert stale <= set(removed), (stale, removed)
    assert not {n for n in _ours() if str(launcher.pid) in n}
    from portddp.watchdog import pid_alive  # noqa: PLC0415 -- a zombie (dead, not yet reaped) counts as gone

    time.sleep(0.5)
    assert inside and not [p for p in inside if pid_alive(int(p))], inside


def test_without_root_the_cluster_says_what_is_missing():
    if os.geteuid() == 0:
        # As nobody, from a copy of the package that nobody can read (the checkout may sit in a
        # directory only root can enter, e.g. one made by mktemp -d).
        readable = Path(tempfile.mkdtemp(prefix="pddp-nobody-"))
        try:
            readable.chmod(0o755)
            shutil.copytree(Path(mpi.ROOT) / "portddp", readable / "portddp",
                            ignore=shutil.ignore_patterns("__pycache__"))
            why = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                                  "portddp.cluster", "--check"], capture_output=True, text=True, cwd=readable,
                                 env={**os.environ, "PYTHONPATH": str(readable)})
        finally:
            shutil.rmtree(readable, ignore_errors=True)
    else:
        why = subprocess.run([sys.executable, "-m", "portddp.cluster", "--check"], capture_output=True, text=True)
    if "No such file" in why.stderr or "setpriv: " in why.stderr:
        pytest.skip(f"cannot drop privileges here: {why.stderr.strip()[:200]}")
    assert why.returncode == 1 and "unavailable: not root (network namespaces need root)" in why.stdout, why


@needs_cluster
def test_sigterm_to_the_launcher_stops_the_job_and_removes_everything():
    launcher = subprocess.Popen([sys.executable, "-m", "portddp.cluster", "-n", "2", "--hosts", "2", "--",
                                 "sleep", "60"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not {n for n in _ours() if n.startswith(f"{cluster.PREFIX}{launcher.pid}h")}:
        assert time.monotonic() < deadline, "the cluster never came up"
        time.sleep(0.1)
    time.sleep(1.0)
    inside = subprocess.run(["ip", "netns", "pids", f"{cluster.PREFIX}{launcher.pid}h0"], capture_output=True,
                            text=True).stdout.split()
    launcher.send_signal(signal.SIGTERM)
    launcher.communicate(timeout=30)
    assert launcher.returncode != 0
    assert not {n for n in _ours() if str(launcher.pid) in n}, _ours()
    from portddp.watchdog import pid_alive  # noqa: PLC0415

    assert inside and not [p for p in inside if pid_alive(int(p))], inside
