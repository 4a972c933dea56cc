"""The emulated cluster (portddp/cluster.py): real namespaces, veth links, tc shaping, real MPI and Gloo.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
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


@pytest.mark.parametrize("text", ["fast", "1gbitx", "1 gbit/h", ""])
def test_parse_rate_refuses_nonsense_naming_it(text):
    with pytest.raises(ValueError, match=f"link rate {text!r} not understood: use e.g. 1gbit"):
        cluster.parse_rate(text)


@pytest.mark.parametrize("text", ["0mbit", "0.0mbit", "-1gbit", "-5", "0.0"])
def test_parse_rate_refuses_a_rate_of_zero_or_below_saying_so(text):
    """(Such a rate was "not understood", beside a bare 0 accepted: a bare 0 is the documented
    spelling of no shaping, a rate that carries nothing is refused as such.)"""
    with pytest.raises(ValueError, match=rf"link rate {text!r} is not above zero: pass a rate, e.g. 1gbit or "
                                         rf"500mbit; unlimited \(or a bare 0\) for no shaping"):
        cluster.parse_rate(text)


@pytest.mark.parametrize("text", ["1000", "1000/s", "2.5", " 10 "])
def test_parse_rate_refuses_a_bare_number_asking_for_a_unit(text):
    """A bare number would be bits/s: `--link 1000` would shape to 1 kbit/s. Refused, naming it and the fix."""
    with pytest.raises(ValueError, match=rf"link rate {text!r} has no unit: write one, e.g. 1000mbit or 1gbit"):
        cluster.parse_rate(text)


@pytest.mark.parametrize("text,bits", [("100MBps", "100mbit"), ("10gb", "10gbit"), ("10GB", "10gbit"), ("5kbps", "5kbit")])
def test_parse_rate_refuses_byte_looking_units(text, bits):
    """tc reads 'bps' as bytes per second; 'gb' and 'MB' read as bytes: refused, not taken as bits."""
    with pytest.raises(ValueError, match=rf"link rate {text!r} looks like bytes per second .* e\.g\. {bits} "):
        cluster.parse_rate(text)


@pytest.mark.parametrize("text,bps", [("0", None), ("1000bit", 1e3), ("1000kbit", 1e6), ("1g", 1e9)])
def test_parse_rate_zero_is_unlimited_and_units_are_taken(text, bps):
    assert cluster.parse_rate(text) == bps


@pytest.mark.parametrize("text,name", [("10Gbit/s", "10gbit"), ("10 Gbit", "10gbit"), ("10G", "10gbit"),
                                       ("2.50gbit", "2.5gbit"), ("1000mbit", "1000mbit"), ("0", "unlimited"),
                                       ("inf", "unlimited"), ("600000000bit", "600000000bit"),
                                       ("1234567kbit", "1234567kbit"), ("0.5gbit", "0.5gbit")])
def test_a_rate_has_one_spelling_in_file_names(text, name):
    """(`--link 10Gbit/s` wrote overlap-n2-h2-10Gbit/s.json: a directory and a file.)"""
    assert cluster.rate_name(text) == name and cluster.parse_rate(name) == cluster.parse_rate(text)


def test_the_token_bucket_is_a_timer_tick_of_traffic_and_a_few_frames_at_least():
    """(It was 256 KiB at least: a 64 KiB message crossed a 1 Mbit/s link in 16 ms, not 524.)"""
    assert cluster.burst_bytes(1e9) == 500_000 and cluster.burst_bytes(10e6) == 4 * 1518
    assert cluster.burst_bytes(10e6, mtu=9000) == 4 * 9018


@pytest.fixture
def nothing_made(monkeypatch):
    """Fail the test at the first `ip`/`tc` command (a namespace, link or probe), directory or mpirun."""
    def made(*cmd, **_):
        raise AssertionError(f"something was made or started: {cmd}")

    monkeypatch.setattr(cluster, "_run", made)
    monkeypatch.setattr(cluster.subprocess, "Popen", made)
    monkeypatch.setattr(cluster.tempfile, "TemporaryDirectory", made)


@pytest.mark.parametrize("argv,message", [
    (["-n", "3", "--hosts", "2"], "-n 3 ranks do not spread evenly over 2 hosts: pass a multiple of 2"),
    (["--link", "fast"], "link rate 'fast' not understood: use e.g. 1gbit, 500mbit, 2.5gbit, or unlimited"),
    (["--link", "1000"], "link rate '1000' has no unit: write one, e.g. 1000mbit or 1gbit (1000bit if you do mean "
                         "1000 bits/s); 0 or unlimited: no shaping"),
    (["--link", "0mbit"], "link rate '0mbit' is not above zero: pass a rate, e.g. 1gbit or 500mbit; unlimited (or a "
                          "bare 0) for no shaping"),
    (["--link=-1gbit"], "link rate '-1gbit' is not above zero: pass a rate, e.g. 1gbit or 500mbit; unlimited (or "
                        "a bare 0) for no shaping"),
    (["--link", "500bit"], "link rate '500bit' is below 1 Mbit/s, the slowest link the emulated cluster shapes "
                           "(tbf's token bucket holds at least four full frames, 49 ms of traffic at 1 Mbit/s, which "
                           "pass unshaped): pass 1mbit or more"),  # (was a traceback from tc: 'rate 0kbit')
    (["--hosts", "0"], "--hosts 0: pass 1 to 250 emulated hosts"),
    (["--hosts", "251", "-n", "251"], "--hosts 251: pass 1 to 250 emulated hosts"),
    (["-n", "0", "--hosts", "1"], "-n 0: a job needs at least one rank per host: pass a multiple of 1 (-n 1, 2, ...)"),
    (["-n", "-2", "--hosts", "2"], "-n -2: a job needs at least one rank per host: pass a multiple of 2 (-n 2, 4, "
                                   "...)"),
])
def test_main_refuses_a_job_it_cannot_run_in_one_line_before_making_anything(argv, message, nothing_made, capsys):
    with pytest.raises(SystemExit) as exit_:
        cluster.main([*argv, "--", "python", "-c", "pass"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.endswith(f"portddp cluster: error: {message}\n"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--rates", "1gbit", "0mbit"], "link rate '0mbit' is not above zero: pass a rate, e.g. 1gbit or 500mbit; "
                                    "unlimited (or a bare 0) for no shaping"),
    (["--rates", "matched", "500mbit", "fast"], "link rate 'fast' not understood: use e.g. 1gbit"),
    (["--rates", "1000"], "link rate '1000' has no unit"),
    (["--rates", "250mbit", "0.5kbit"], "link rate '0.5kbit' is below 1 Mbit/s"),
    (["-n", "3", "--hosts", "2"], "-n 3 ranks do not spread evenly over 2 hosts: pass a multiple of 2"),
    (["--hosts", "0"], "--hosts 0: pass 1 to 250 emulated hosts")])
def test_bandwidth_sweep_refuses_every_rate_before_the_first_cluster(argv, message, nothing_made, monkeypatch):
    """(A bad rate was found inside the per-rate loop, a traceback after the rates before it ran.)"""
    from experiments import bandwidth  # noqa: PLC0415

    def started(*_, **__):
        raise AssertionError("the sweep started")

    for name in ("run_overlap", "matched_rate"):
        monkeypatch.setattr(bandwidth, name, started)
    monkeypatch.setattr(cluster, "require_root", started)
    with pytest.raises(SystemExit) as exit_:
        bandwidth.main([*argv, "--", "--batch", "8"])
    assert str(exit_.value.code).startswith(f"experiments.bandwidth: {message}"), exit_.value.code


def test_bandwidth_sweep_refuses_the_overlap_options_before_the_first_cluster(nothing_made, monkeypatch, capsys):
    """(`-- --bogus` was an argparse error of every rank, after a cluster was made and MPI started.)"""
    from experiments import bandwidth  # noqa: PLC0415

    monkeypatch.setattr(cluster, "require_root", lambda: pytest.fail("the sweep started"))
    with pytest.raises(SystemExit) as exit_:
        bandwidth.main(["--rates", "1gbit", "--", "--bogus"])
    assert exit_.value.code == 2 and "error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_bandwidth_help_shows_its_defaults_and_where_the_overlap_options_go(capsys):
    from experiments import bandwidth  # noqa: PLC0415

    with pytest.raises(SystemExit):
        bandwidth.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[-- OVERLAP_ARGS ...]" in out and "MPI ranks in all" in out and "emulated hosts, 1 to 250" in out
    assert "(default: 250mbit 500mbit 1gbit 2gbit 5gbit unlimited)" in out
    assert "arguments after `--` go to every run of the overlap experiment" in out
    assert "python -m experiments.overlap --help" in out


def test_run_refuses_uneven_ranks_before_making_anything(nothing_made):
    """The API (harness.calibrate, experiments.simulate_validate) as well: no cluster made, then refused."""
    with pytest.raises(ValueError, match="-n 3 ranks do not spread evenly over 2 hosts: pass a multiple of 2"):
        cluster.run(3, 2, "1gbit", ["true"], quiet=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_launcher_directories_go_and_live_ones_stay(tmp_path, monkeypatch):
    """A launcher directory whose launcher is gone is removed (tempfile's name, with or without the pid,
    holding the to-host script that enters that launcher's namespaces); a live launcher's stays, and so
    does anything else that merely starts with the prefix (a user's directory, one without the script,
    one whose name and script disagree)."""
    monkeypatch.setattr(cluster.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(cluster, "_run", lambda *cmd, **_: subprocess.CompletedProcess(cmd, 0, "", ""))  # no netns
    dead, alive = _dead_pid(), os.getpid()
    dirs = {name: tmp_path / name for name in (f"portddp-cluster-{dead}-ab1_cd2e", f"portddp-cluster-{alive}-xyz0abc1",
                                               "portddp-cluster-old0dead", "portddp-cluster-old0live",
                                               "portddp-cluster-unknown1", "portddp-calibrate-x1y2z3w4",
                                               "portddp-cluster-2024-11-05-baseline", f"portddp-cluster-{dead}-noscrpt",
                                               f"portddp-cluster-{dead}-mismatch")}
    for d in dirs.values():
        d.mkdir()
    for name, pid in ((f"portddp-cluster-{dead}-ab1_cd2e", dead), ("portddp-cluster-old0dead", dead),
                      ("portddp-cluster-old0live", alive), ("portddp-cluster-2024-11-05-baseline", dead),
                      (f"portddp-cluster-{dead}-mismatch", dead + 1)):
        (dirs[name] / "to-host").write_text(f"  h0) set -- ip netns exec pddp{pid}h0 unshare --uts sh -c ;;\n")
    (tmp_path / f"portddp-cluster-{dead}-file0000").write_text("not a directory")
    # The matched rate's calibration directory (a kill -9 during calibration left it), and /etc/netns entries
    # whose namespace is gone (a teardown cut short): by the pid in their names.
    for name in (f"portddp-calibrate-{dead}-k2j4h6g8", f"portddp-calibrate-{alive}-a1b2c3d4"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
    etc = tmp_path / "etc-netns"
    monkeypatch.setattr(cluster, "NETNS_ETC", etc)
    for name in (f"{cluster.PREFIX}{dead}h1", f"{cluster.PREFIX}{alive}h0", f"{cluster.PREFIX}x{dead}h0"):
        (etc / name).mkdir(parents=True)
        (etc / name / "hosts").write_text("127.0.0.1 localhost\n")
    removed = cluster.cleanup_stale()
    gone = {f"portddp-cluster-{dead}-ab1_cd2e", "portddp-cluster-old0dead", f"portddp-calibrate-{dead}-k2j4h6g8"}
    assert sorted(removed) == sorted([str(etc / f"{cluster.PREFIX}{dead}h1"), *(str(dirs[n]) for n in gone)]), removed
    assert {p.name for p in tmp_path.iterdir()} == set(dirs) - gone | {f"portddp-cluster-{dead}-file0000", etc.name}
    assert {p.name for p in etc.iterdir()} == {f"{cluster.PREFIX}{alive}h0", f"{cluster.PREFIX}x{dead}h0"}


def test_a_signal_during_teardown_waits_until_everything_is_removed(tmp_path, monkeypatch):
    """A Ctrl-C that arrives mid-teardown, in a process with a second thread (numpy's OpenBLAS starts some;
    the kernel may hand the signal to any of them): every link and namespace is still removed, then the
    KeyboardInterrupt is raised (a blocked signal mask held for the calling thread only: 2 of 5 ran)."""
    ran = []

    def slow(*cmd, **_):
        ran.append(cmd)
        time.sleep(0.05)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cluster, "_run", slow)
    monkeypatch.setattr(cluster, "_kill_inside", lambda _ns: None)
    monkeypatch.setattr(cluster, "NETNS_ETC", tmp_path)
    c = cluster.Cluster(2, "1gbit")
    c._made = True
    done = threading.Event()
    other = threading.Thread(target=done.wait, args=(10,))
    other.start()
    threading.Timer(0.06, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            c.destroy()
    finally:
        done.set()
        other.join()
    removals = [cmd for cmd in ran if "del" in cmd]  # (besides: `ip netns pids`, which segments the job mapped)
    assert len(removals) == 5 and not c._made, ran


def _ours() -> set[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {n for n in names if n.startswith(cluster.PREFIX)} | {
        w.rstrip(":").split("@")[0] for w in links.split() if w.startswith(cluster.PREFIX)}


def _h0_to_h1(c, port: int, receiver: str, sender: str) -> tuple[str, str]:
    """A TCP connection from host h0 to h1 of cluster `c`: `receiver` runs on h1 with the accepted socket as `c`,
    `sender` on h0 with the connected one as `s` (both with socket and time imported); their outputs."""
    head = "import socket,time\n"
    listening = subprocess.Popen([*c.exec_prefix(1), sys.executable, "-c", (
        f"{head}s=socket.create_server(('{c.addresses[1]}', {port})); c,_=s.accept()\n{receiver}")],
        stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    sent = subprocess.run([*c.exec_prefix(0), sys.executable, "-c", (
        f"{head}s=socket.create_connection(('{c.addresses[1]}', {port}))\n{sender}")], check=True, timeout=60,
        capture_output=True, text=True).stdout
    return listening.communicate(timeout=60)[0], sent


@needs_cluster
def test_a_shaped_link_carries_its_rate_and_everything_is_removed():
    """A TCP stream between two hosts of a 500 Mbit/s cluster: within 10 % of the rate; nothing left after."""
    with cluster.Cluster(2, "500mbit") as c:
        bps, _ = _h0_to_h1(c, 5201, receiver=(
            "n=0; t=None\n"
            "while True:\n"
            "    d=c.recv(1<<20)\n"
            "    if not d: break\n"
            "    t=t or time.perf_counter(); n+=len(d)\n"
            "print(n*8/(time.perf_counter()-t))\n"), sender=(
            "b=b'x'*(1<<20)\n"
            "for _ in range(60): s.sendall(b)\n"
            "s.close()\n"))
        bps = float(bps)
        sent = c.interface_bytes()[0]["tx_bytes"]
        setup_s = c.setup_s
    assert 0.90 * 5e8 <= bps <= 1.10 * 5e8, f"measured {bps / 1e6:.0f} Mbit/s on a 500 Mbit/s link"
    assert sent >= 60 * 2**20, sent  # the stream crossed h0's interface
    assert setup_s + c.teardown_s < 10, (setup_s, c.teardown_s)
    assert not {n for n in _ours() if str(c.job) in n}, _ours()


@needs_cluster
def test_a_small_message_takes_its_wire_time():
    """128 KiB over a 20 Mbit/s link: at least 80 % of its 52 ms on the wire (the token bucket lets only a few
    frames pass at full speed), and not much more."""
    with cluster.Cluster(2, "20mbit") as c:
        _, took = _h0_to_h1(c, 5202, receiver=(
            "n=0\n"
            "while n < 3 * (128 << 10):\n"
            "    n += len(c.recv(1 << 20))\n"
            "    if n % (128 << 10) == 0: c.sendall(b'k')\n"), sender=(
            "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); r=[]\n"
            "for _ in range(3):\n"
            "    time.sleep(0.2); t=time.perf_counter(); s.sendall(b'x' * (128 << 10)); s.recv(1)\n"
            "    r.append(time.perf_counter() - t)\n"
            "print(min(r))\n"))
    wire = (128 << 10) * 8 / 20e6
    assert 0.8 * wire <= float(took) <= 2.0 * wire, f"{float(took) * 1e3:.1f} ms for {wire * 1e3:.1f} ms on the wire"


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
def test_matched_link_calibrates_apart_from_the_users_out_dir(tmp_path):
    """--link matched first calibrates on an unshaped link, with the user's own arguments: an --out-dir
    among them must not catch the calibration's JSON (it crashed looking for it, and left it in the
    user's results for the report to pick up)."""
    proc = mpi.run(None, "portddp.cli", "run", "overlap", "-n", "2", "--hosts", "2", "--link", "matched", "--",
                   "--width", "256", "--depth", "2", "--rounds", "1", "--steps-per-round", "2", "--warmup", "1",
                   "--impls", "torch-c10d", "--out-dir", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "calibration: backward compute" in proc.stdout
    results = sorted(p.name for p in tmp_path.glob("overlap-*.json") if not p.name.endswith(".trace.json"))
    assert len(results) == 1 and results[0].startswith("overlap-n2-h2-") and results[0].endswith("mbit.json"), results
    # the calibration that chose the rate travels with the run (the report states it beside the backward)
    cal = json.loads((tmp_path / results[0]).read_text())["calibration"]
    assert results[0] == f"overlap-n2-h2-{cal['rate_mbit']}mbit.json" and cal["backward_compute_s"] > 0, cal


@needs_cluster
def test_equivalence_on_two_hosts(tmp_path):
    """Every implementation trains the same on the cluster as on one machine (the harness's own bound)."""
    proc = mpi.run(None, "portddp.cli", "compare", "-n", "2", "--hosts", "2", "--link", "1gbit", "--",
                   "--model", "mlp", "--steps", "3", "--out", str(tmp_path), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = list(tmp_path.glob("*/result.json"))
    assert results and all(json.loads(p.read_text())["ok"] for p in results)
    # c10d's store names each client from the hosts file (was: a DNS query, unreachable in a namespace, and
    # "The hostname of the client socket cannot be retrieved. err=-3" at every connection)
    assert "cannot be retrieved" not in proc.stdout + proc.stderr


@needs_cluster
def test_a_killed_launcher_leaves_nothing_after_the_next_start():
    """kill -9 of `portddp cluster` while its job runs: the next start removes its namespaces, links,
    the processes still inside them and its launcher directory (hydra's to-host)."""
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
    launcher_dirs = {str(p) for p in Path(tempfile.gettempdir()).glob(f"portddp-cluster-{launcher.pid}-*")}
    assert launcher_dirs and all(Path(p, "to-host").is_file() for p in launcher_dirs), launcher_dirs
    removed = cluster.cleanup_stale()
    assert stale | launcher_dirs <= set(removed), (stale, launcher_dirs, removed)
    assert not {n for n in _ours() if str(launcher.pid) in n}
    assert not [p for p in launcher_dirs if os.path.exists(p)], launcher_dirs
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
def test_a_users_mpi_job_stopped_midway_leaves_no_segment_in_dev_shm():
    """(An audit: a user's own mpi4py script -- not portddp's, which unlinks early -- stopped mid-all-reduce left
    MPICH's 1 MB segment per host in /dev/shm, which only MPI_Finalize removes; and hydra_pmi_proxy's topology
    file in /tmp, which the teardown's SIGKILL kept it from removing.)"""
    hydra_files = os.path.join(tempfile.gettempdir(), "hydra_hwloc_xmlfile_*")
    files_before = set(glob.glob(hydra_files))
    code = ("from mpi4py import MPI; import numpy as np, sys\n"
            "a = np.ones(4_000_000, np.float32); b = np.empty_like(a)\n"
            "for i in range(10_000):\n    MPI.COMM_WORLD.Allreduce(a, b)\n    print('STEP', i, flush=True)\n")
    before = set(glob.glob("/dev/shm/mpich_*"))
    launcher = subprocess.Popen([sys.executable, "-m", "portddp.cluster", "-n", "2", "--hosts", "2", "--link",
                                 "200mbit", "--", sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(90, launcher.kill)  # (a job that never prints must not stall the suite)
    guard.start()
    try:
        assert "STEP" in launcher.stdout.readline(), "the job never ran"
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        guard.cancel()
        launcher.kill()
    left = {Path(p).name for p in set(glob.glob("/dev/shm/mpich_*")) - before} - cluster._mapped_segments(
        Path("/proc").glob("[0-9]*/maps"))  # (another job's, mapped by its live ranks, may appear meanwhile)
    assert not left, (left, err[-2000:])
    held = set().union(*(cluster._hydra_files(p.name) for p in Path("/proc").glob("[0-9]*")))  # (others' live jobs')
    assert not {Path(p) for p in set(glob.glob(hydra_files)) - files_before} - held, err[-2000:]


@needs_cluster
@pytest.mark.parametrize("sig, times, code", [(signal.SIGTERM, 1, 143), (signal.SIGHUP, 1, 129),
                                              (signal.SIGINT, 6, 130)], ids=["sigterm", "sighup", "ctrl-c-x6"])
def test_a_signal_to_the_launcher_stops_the_job_and_removes_everything(sig, times, code):
    """SIGTERM; SIGHUP (a closed terminal or ssh session: it reached only the launcher, which died of it and
    left the job running and every namespace behind); Ctrl-C pressed again and again (one landing in the
    teardown cut it short, leaving the bridge and an /etc/netns entry)."""
    launcher = subprocess.Popen([sys.executable, "-m", "portddp.cluster", "-n", "2", "--hosts", "2", "--",
                                 "sleep", "60"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while not {n for n in _ours() if n.startswith(f"{cluster.PREFIX}{launcher.pid}h")}:
        assert time.monotonic() < deadline, "the cluster never came up"
        time.sleep(0.1)
    time.sleep(1.0)
    inside = subprocess.run(["ip", "netns", "pids", f"{cluster.PREFIX}{launcher.pid}h0"], capture_output=True,
                            text=True).stdout.split()
    for _ in range(times):
        with contextlib.suppress(ProcessLookupError):
            launcher.send_signal(sig)
        time.sleep(0.05)
    launcher.communicate(timeout=30)
    # (128 + the signal; Ctrl-C: 130, or the signal itself for one arriving after everything was removed, as Python
    # ends on a KeyboardInterrupt nothing catches -- a shell reports both as 130)
    assert launcher.returncode == code or (sig == signal.SIGINT and launcher.returncode == -sig), launcher.returncode
    assert not {n for n in _ours() if str(launcher.pid) in n}, _ours()
    assert not list(cluster.NETNS_ETC.glob(f"{cluster.PREFIX}{launcher.pid}h*"))
    from portddp.watchdog import pid_alive  # noqa: PLC0415

    assert inside and not [p for p in inside if pid_alive(int(p))], inside
