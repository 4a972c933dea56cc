"""An emulated cluster on one machine: hosts as network namespaces, links shaped with `tc`.

    portddp cluster -n 4 --hosts 2 --link 1gbit -- python -m experiments.overlap

runs the command as an MPI job of 4 ranks on 2 emulated hosts (2 ranks each,
like GPUs per node). Every host is a network namespace with its own hostname
(a UTS namespace: `h0`, `h1`, ...), one interface `eth0` with an address in a
private /24, joined to the others through a veth pair and a bridge (the
switch). Both ends of each host's veth are shaped with a token bucket
(`tc qdisc ... tbf rate RATE`), so RATE holds per direction, as on a real NIC.
Nothing gets an address outside the job's namespaces; the root namespace's
side of every link has none.

The job is launched the way a real multi-host MPI job is: MPICH's `mpirun`
runs on the first host with `-hosts h0,h1 -ppn K -iface eth0`, and its
launcher ("ssh") is a small script that starts each host's proxy inside that
host's namespace. MPICH therefore sees K ranks per host: shared memory within
a host, TCP (libfabric's tcp provider on eth0) between hosts. Each namespace
gets an /etc/hosts (through `ip netns exec`'s /etc/netns/NAME/) mapping every
host name to its address, so Gloo (c10d and XLA's CPU collectives),
jax.distributed, portddp's rendezvous and its watchdog all resolve and use the
hosts' addresses: every implementation's traffic between hosts crosses the
shaped links. `GLOO_SOCKET_IFNAME=eth0` pins Gloo's interface as well.

Cleanup: everything is removed when the job ends -- normally, on an error, on
Ctrl-C or SIGTERM. If the launcher itself is killed (`kill -9`), the next
start finds the namespaces and links of jobs whose launcher is gone (by their
`pddp<pid>` prefix), kills what still runs inside them and removes them, and
their launcher directories (`portddp-cluster-<pid>-*` in the temporary
directory, holding hydra's `to-host` script) too.
Needs root (creating network namespaces); without it, a clear error says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from portddp import env
from portddp.watchdog import mpich_segments_in, mpich_segments_in_use, pid_alive

__all__ = ["Cluster", "parse_rate", "check_job", "interface_bytes", "run", "cleanup_stale", "PREFIX"]

PREFIX = "pddp"
"""Every namespace and link of a job is named pddp<launcher pid>...: stale ones are found by it."""
IFACE = "eth0"
SUBNET = "10.213.{job}.{host}"
NETNS_ETC = Path("/etc/netns")
MAX_HOSTS = 250
"""One /24 per job: host addresses .1 to .250."""
LAUNCHER_DIR = "portddp-cluster-"
"""A job's launcher directory (hydra's `to-host`) is <tempdir>/portddp-cluster-<launcher pid>-XXXXXXXX: stale
ones are found by it."""
CALIBRATE_DIR = "portddp-calibrate-"
"""The matched rate's calibration run writes into <tempdir>/portddp-calibrate-<pid>-XXXXXXXX (harness.calibrate)."""
MIN_RATE = 1e6
"""bits/s: the slowest link a cluster is made with."""
BURST_MS = env.number("PORTDDP_CLUSTER_BURST_MS", 4.0, unit="milliseconds")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate: str) -> float | None:
    """'1gbit' -> 1e9 bits/s, '500mbit', '2.5gbit', 'unlimited' or '0' -> None (no shaping).

    A bare number other than 0 is refused: read as bits/s (tc's meaning), `--link 1000` would
    shape every host to 1 kbit/s, which nobody means. A rate of zero or below with a unit
    (`0mbit`, `-1gbit`) is refused too, saying so: a bare `0` is the one spelling of "no shaping"
    besides `unlimited`, a link that carries nothing is none."""
    text = str(rate).strip().lower()
    if text in ("unlimited", "none", "inf", "0"):
        return None
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps|b)?(?:/s)?", text)
    if not m:
        raise ValueError(f"link rate {rate!r} not understood: use e.g. 1gbit, 500mbit, 2.5gbit, or unlimited"
                         + ("; 'matched' (measured first) is for portddp run / compare / mixed --link matched"
                            if str(rate).strip().lower() == "matched" else ""))
    if float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not above zero: pass a rate, e.g. 1gbit or 500mbit; unlimited (or a "
                         f"bare 0) for no shaping")
    if m.group(3) in ("bps", "b"):  # tc reads "bps" as bytes/s; "gb", "MB" say bytes to most readers
        raise ValueError(f"link rate {rate!r} looks like bytes per second (tc reads 'bps' so): write the rate in "
                         f"bits with 'bit', e.g. {m.group(1)}{m.group(2)}bit for {m.group(1)} {m.group(2).upper()}bit/s, "
                         f"or {float(m.group(1)) * 8:g}{m.group(2)}bit for {m.group(1)} {m.group(2).upper()}B/s")
    if not m.group(2) and not m.group(3):
        raise ValueError(f"link rate {rate!r} has no unit: write one, e.g. 1000mbit or 1gbit ({m.group(1)}bit if "
                         f"you do mean {m.group(1)} bits/s); 0 or unlimited: no shaping")
    return float(m.group(1)) * _UNITS[m.group(2)]


def rate_name(rate: str) -> str:
    """A rate's one spelling, for file names and labels: '10 Gbit/s' and '10G' -> '10gbit', '0' -> 'unlimited'
    (parse_rate's checks first: a rate it refuses is refused here, with its message)."""
    if parse_rate(rate) is None:
        return "unlimited"
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)", str(rate).strip().lower().removesuffix("/s").removesuffix("bit"))
    number = m.group(1).lstrip("0") or "0"
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return f"{'0' + number if number.startswith('.') else number}{m.group(2)}bit"


def check_rate(rate: str) -> float | None:
    """parse_rate, and refuse what the emulation cannot shape faithfully (bits/s; None: unshaped)."""
    bps = parse_rate(rate)
    if bps is not None and bps < MIN_RATE:
        frames_ms = burst_bytes(MIN_RATE) * 8 / MIN_RATE * 1e3
        raise ValueError(f"link rate {rate!r} is below {MIN_RATE / 1e6:g} Mbit/s, the slowest link the emulated cluster "
                         f"shapes (tbf's token bucket holds at least four full frames, {frames_ms:.0f} ms of traffic "
                         f"at {MIN_RATE / 1e6:g} Mbit/s, which pass unshaped): pass {MIN_RATE / 1e6:g}mbit or more")
    return bps


def check_job(n: int, hosts: int, link: str | None = None) -> None:
    """Refuse, with a ValueError naming the value and the fix, a job no cluster can run: called
    before anything is made, so that a typo costs no namespaces (and no traceback from main).
    `link` None: not checked (e.g. 'matched', a rate measured later)."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"--hosts {hosts}: pass 1 to {MAX_HOSTS} emulated hosts")
    if n < 1:
        raise ValueError(f"-n {n}: a job needs at least one rank per host: pass a multiple of {hosts} "
                         f"(-n {hosts}, {2 * hosts}, ...)")
    if n % hosts:
        raise ValueError(f"-n {n} ranks do not spread evenly over {hosts} hosts: pass a multiple of {hosts}")
    if link is not None:
        check_rate(link)


def burst_bytes(bits_per_s: float, mtu: int = 1500) -> int:
    """tbf's token bucket: what a link may send at full speed after an idle spell.

    BURST_MS of traffic at the rate (a timer tick at HZ=250: a bucket of 1 ms lost its tokens whenever
    the sender waited for a core, and a loaded 2-core machine carried 411 Mbit/s on a 500 Mbit/s link),
    and at least four full frames. Until 2026-12-06 it was 256 KiB at least, so that below ~500 Mbit/s
    a message of that size crossed at full speed (64 KiB over 1 Mbit/s in 16 ms, not 524)."""
    return max(int(bits_per_s / 8 * BURST_MS / 1e3), 4 * (mtu + 18))


def _tc_rate(bits_per_s: float) -> str:
    return f"{int(bits_per_s)}bit"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def require_root() -> None:
    """Network namespaces need root; say so (and what would work) instead of failing halfway."""
    if os.geteuid() != 0:
        raise SystemExit(
            "portddp cluster: creating network namespaces needs root (ip netns add). Run it as root (e.g. `sudo "
            ".venv/bin/portddp cluster ...`), or inside a user namespace where you are root: `unshare --user "
            "--map-root-user --mount --net --fork .venv/bin/portddp cluster ...` (needs "
            "kernel.unprivileged_userns_clone=1)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"portddp cluster: `{tool}` not found: install iproute2")


def unavailable() -> str | None:
    """Why an emulated cluster cannot be made here (None: it can): root, iproute2, namespaces, tbf."""
    if os.geteuid() != 0:
        return "not root (network namespaces need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        link = _run("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
        if link.returncode != 0:
            return f"cannot create veth links: {link.stderr.strip()}"
        tbf = _run("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit", "burst", "256kb",
                   "latency", "100ms", check=False)
        if tbf.returncode != 0:
            return f"cannot shape links with tc tbf: {tbf.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def cleanup_stale() -> list[str]:
    """Remove the namespaces, links, /etc/netns entries and launcher directories of jobs whose
    launcher is gone; return them (names, and the directories' paths)."""
    removed = []
    names = _run("ip", "netns", "list", check=False).stdout.split()
    links = re.findall(rf"^\d+: ({PREFIX}\d+[a-z]\d*)[@:]", _run("ip", "-o", "link", "show", check=False).stdout,
                       re.M)
    for name in sorted(set(n for n in names if n.startswith(PREFIX)) | set(links)):
        m = re.match(rf"{PREFIX}(\d+)", name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        if name in names:
            _kill_inside(name)
            _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        else:
            _run("ip", "link", "del", name, check=False)
        removed.append(name)
    # /etc/netns entries left without their namespace (a teardown cut short)
    for entry in sorted(NETNS_ETC.glob(f"{PREFIX}*")) if NETNS_ETC.is_dir() else []:
        m = re.fullmatch(rf"{PREFIX}(\d+)h\d+", entry.name)
        if m and entry.is_dir() and not entry.is_symlink() and not pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed + _cleanup_stale_dirs()


def _cleanup_stale_dirs() -> list[str]:
    """The launcher directories (<tempdir>/portddp-cluster-*) of jobs whose launcher is gone, removed.

    Its owner is the pid in its name; a directory made before the name carried it (a random suffix
    only) is attributed by the namespaces its `to-host` script enters (pddp<pid>h...). One whose
    owner cannot be told is left alone, as is every one whose owner still runs, and (in a shared /tmp)
    every one another user made."""
    removed = []
    for path in sorted(Path(tempfile.gettempdir()).glob(CALIBRATE_DIR + "*")):  # (its pid in its name, nothing else)
        named = re.fullmatch(rf"{re.escape(CALIBRATE_DIR)}(\d+)-[a-z0-9_]{{8}}", path.name)
        if (named and path.is_dir() and not path.is_symlink() and path.lstat().st_uid == os.geteuid()
                and not pid_alive(int(named.group(1)))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    for path in sorted(Path(tempfile.gettempdir()).glob(LAUNCHER_DIR + "*")):
        # Only what a launcher made: tempfile's name (<pid>- and 8 characters, or the 8 alone before
        # the pid was in it) holding the to-host script that enters that launcher's namespaces.
        named = re.fullmatch(rf"{re.escape(LAUNCHER_DIR)}(?:(\d+)-)?[a-z0-9_]{{8}}", path.name)
        if named is None or path.is_symlink() or not path.is_dir() or path.lstat().st_uid != os.geteuid():
            continue
        try:
            script = re.search(rf"\b{PREFIX}(\d+)h\d", (path / "to-host").read_text())
        except (OSError, UnicodeDecodeError):
            continue
        if script is None or (named.group(1) and named.group(1) != script.group(1)):
            continue
        if pid_alive(int(script.group(1))):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _kill_inside(netns: str) -> None:
    for pid in _run("ip", "netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@dataclasses.dataclass
class Cluster:
    """H emulated hosts joined by a switch, each host's link shaped to `link` per direction."""

    hosts: int
    link: str = "1gbit"
    job: int = dataclasses.field(default_factory=os.getpid)
    mtu: int = dataclasses.field(default_factory=lambda: env.number("PORTDDP_CLUSTER_MTU", 1500, unit="bytes",
                                                                    least=576, integer=True))

    def __post_init__(self):
        if self.hosts < 1 or self.hosts > MAX_HOSTS:
            raise ValueError(f"hosts={self.hosts}: pass 1 to {MAX_HOSTS} emulated hosts")
        self.rate = check_rate(self.link)
        self.link = rate_name(self.link)  # (it names the job's result files: one spelling, no '/' or space)
        self.names = [f"{PREFIX}{self.job}h{h}" for h in range(self.hosts)]
        self.hostnames = [f"h{h}" for h in range(self.hosts)]
        self.addresses = [SUBNET.format(job=self.job % 250, host=h + 1) for h in range(self.hosts)]
        self.bridge = f"{PREFIX}{self.job}b"
        self.uplinks = [f"{PREFIX}{self.job}v{h}" for h in range(self.hosts)]
        self._made = False
        self.setup_s = self.teardown_s = None
        self.job_segments: set[str] = set()  # MPICH's /dev/shm segments this job's ranks mapped (note_job_leftovers)
        self.job_files: set[Path] = set()  # hydra's topology files its processes hold open (note_job_leftovers)

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> "Cluster":
        require_root()
        if stale := cleanup_stale():  # (a launcher killed with SIGKILL: its job was still running until now)
            print(f"portddp cluster: removed what launchers that are gone left behind (their jobs' processes "
                  f"killed): {', '.join(stale)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        self.setup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _create(self) -> None:
        self._made = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        # (each address also as IPv4-mapped IPv6, which is how c10d's dual-stack store sees its clients:
        # without it their names went to DNS, unreachable here -- "hostname of the client socket cannot be
        # retrieved. err=-3" at every connection)
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n::ffff:{a} {n}\n" for a, n in zip(self.addresses, self.hostnames))
        for ns, uplink, addr, hostname in zip(self.names, self.uplinks, self.addresses, self.hostnames):
            _run("ip", "netns", "add", ns)
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts_file)
            (NETNS_ETC / ns / "hostname").write_text(hostname + "\n")
            _run("ip", "link", "add", uplink, "type", "veth", "peer", "name", IFACE, "netns", ns)
            _run("ip", "link", "set", uplink, "master", self.bridge, "up")
            if self.mtu != 1500:
                _run("ip", "link", "set", uplink, "mtu", str(self.mtu))
                _run("ip", "-n", ns, "link", "set", IFACE, "mtu", str(self.mtu))
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                # Both directions: host -> switch on the host's side, switch -> host on the bridge's.
                burst = burst_bytes(self.rate, self.mtu)
                for where in (("-n", ns, "qdisc", "add", "dev", IFACE), ("qdisc", "add", "dev", uplink)):
                    _run("tc", *where, "root", "tbf", "rate", _tc_rate(self.rate), "burst", str(burst),
                         "latency", "100ms")

    def destroy(self) -> None:
        """Remove everything; a Ctrl-C, SIGTERM or hang-up arriving meanwhile waits until it is done (a
        second Ctrl-C used to cut the teardown short, leaving the bridge and an /etc/netns entry)."""
        if not self._made:
            return
        t0 = time.perf_counter()
        with _signals_held():
            self.note_job_leftovers()
            for ns in self.names:
                _kill_inside(ns)
                _run("ip", "netns", "del", ns, check=False)
                shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            for path in self.job_files:  # (their processes, just killed, never removed them)
                path.unlink(missing_ok=True)
            for link in [*self.uplinks, self.bridge]:
                _run("ip", "link", "del", link, check=False)
            self._made = False
        self.teardown_s = time.perf_counter() - t0

    def note_job_leftovers(self) -> None:
        """Remember the MPICH segments the processes on the hosts map now: the job's own, which only
        MPI_Finalize unlinks -- a job stopped before it leaves them in /dev/shm (the hosts share it);
        and the topology files in /tmp that MPICH's launcher on each host (hydra_pmi_proxy) holds open
        and removes only when it exits on its own, which one killed by the teardown never does."""
        for ns in self.names:
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                self.job_segments |= _mapped_segments([Path(f"/proc/{pid}/maps")])
                self.job_files |= _hydra_files(pid)

    # ------------------------------------------------------------------ running
    def exec_prefix(self, host: int) -> list[str]:
        """Run a command on `host`: its network namespace, its own hostname."""
        return ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostnames[host]} && exec "$@"', "sh"]

    def env(self) -> dict[str, str]:
        """What every rank needs to use the hosts' interface, whatever it talks over."""
        return {
            # MPICH between hosts: libfabric's tcp provider on eth0 (UCX, the other netmod, would find
            # the other namespaces' ranks on the same machine and use shared memory across "hosts").
            "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFACE,
            "GLOO_SOCKET_IFNAME": IFACE,  # c10d's Gloo
            "PORTDDP_CLUSTER": json.dumps({"hosts": self.hosts, "link": self.link, "rate_bps": self.rate,
                                           "interface": IFACE, "hostnames": self.hostnames,
                                           "addresses": self.addresses}),
        }

    def mpirun(self, n: int, command: Sequence[str], launcher_dir: str) -> list[str]:
        """The command line that runs `command` as n ranks, n/H per host, from host 0."""
        check_job(n, self.hosts)
        ssh = Path(launcher_dir) / "to-host"
        # hydra calls: to-host [options] HOST COMMAND...; HOST is h<i>.
        cases = "\n".join(f"  {h}) set -- {shlex.join(self.exec_prefix(i))} ;;"
                          for i, h in enumerate(self.hostnames))
        ssh.write_text("#!/bin/sh\n# portddp cluster: hydra's launcher, one emulated host per namespace\n"
                       "while [ \"${1#-}\" != \"$1\" ]; do shift; done\nhost=$1; shift\n"
                       f"cmd=\"$*\"\ncase $host in\n{cases}\n  *) echo \"unknown host $host\" >&2; exit 2 ;;\n"
                       "esac\nexec \"$@\" sh -c \"$cmd\"\n")
        ssh.chmod(0o755)
        mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
        if mpirun is None:
            raise SystemExit("mpirun not found: install portddp's dependencies (the mpich wheel provides it)")
        return [*self.exec_prefix(0), mpirun, "-launcher", "ssh", "-launcher-exec", str(ssh),
                "-hosts", ",".join(self.hostnames), "-ppn", str(n // self.hosts), "-iface", IFACE,
                "-n", str(n), *command]

    def interface_bytes(self) -> list[dict]:
        """Bytes each host's interface has sent and received so far (its namespace's counters)."""
        out = []
        for ns, hostname in zip(self.names, self.hostnames):
            stats = json.loads(_run("ip", "-n", ns, "-s", "-j", "link", "show", IFACE).stdout)[0]["stats64"]
            out.append({"host": hostname, "tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"]})
        return out


def interface_bytes(iface: str | None = None) -> dict | None:
    """From inside a cluster job: this host's interface counters (tx, rx bytes), or None outside one."""
    info = cluster_info()
    if info is None:
        return None
    iface = iface or info["interface"]
    stats = Path("/sys/class/net") / iface / "statistics"
    return {"tx_bytes": int((stats / "tx_bytes").read_text()), "rx_bytes": int((stats / "rx_bytes").read_text())}


def cluster_info() -> dict | None:
    """The PORTDDP_CLUSTER description a job runs under (hosts, link, addresses), or None."""
    info = os.environ.get("PORTDDP_CLUSTER")
    return json.loads(info) if info else None


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_held():
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done, then act as they would have (the first one).
    Python handlers that note them, not a blocked signal mask: that holds for the calling thread only, and
    the kernel hands a process-directed signal to any other thread (numpy's OpenBLAS starts some), whose
    arrival Python still turns into an exception in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: arrived.append(signum)) for sig in _STOPS
                if signal.getsignal(sig) not in (signal.SIG_IGN, None)}  # (None: a handler set outside Python)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if arrived and callable(handler := previous.get(arrived[0])):
        handler(arrived[0], None)
    elif arrived and previous.get(arrived[0]) is signal.SIG_DFL:
        signal.raise_signal(arrived[0])


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal, a dropped ssh session), handled as Ctrl-C is (the job
    stopped, the cluster removed), but exit 128 + the signal (143, 129), not 130."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.exit_code = 128 + signum


def _interrupt(signum, _frame):
    raise _Terminated(signum)


def run(n: int, hosts: int, link: str, command: Sequence[str], quiet: bool = False) -> int:
    """Create the cluster, run `command` on it as an n-rank MPI job, remove everything; the job's exit code.
    SIGTERM and SIGHUP are handled like Ctrl-C: the job is stopped and the cluster removed (the job runs
    in a session of its own, so a closing terminal reaches only the launcher, which must pass it on). A
    job no cluster can run (check_job) raises ValueError before anything is made."""
    check_job(n, hosts, link)
    # (a signal ignored on purpose stays ignored: under nohup, SIGHUP is)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        return _run_job(n, hosts, link, command, quiet)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_job(n: int, hosts: int, link: str, command: Sequence[str], quiet: bool) -> int:
    say = (lambda *a: None) if quiet else (lambda msg: print(f"portddp cluster: {msg}", file=sys.stderr, flush=True))
    # The launcher's pid in the directory's name: after a kill -9, the next start removes it (cleanup_stale).
    made = []
    try:
        with tempfile.TemporaryDirectory(prefix=f"{LAUNCHER_DIR}{os.getpid()}-") as tmp, \
                Cluster(hosts, link) as cluster:
            made.append(cluster)
            say(f"{hosts} host(s) {', '.join(f'{h}={a}' for h, a in zip(cluster.hostnames, cluster.addresses))}, "
                f"link {cluster.link} per direction, {n // hosts} rank(s) per host (set up in {cluster.setup_s:.2f} "
                "s)")
            before = cluster.interface_bytes()
            argv = cluster.mpirun(n, list(command), tmp)
            proc = subprocess.Popen(argv, env={**os.environ, **cluster.env()}, start_new_session=True)
            try:
                code = proc.wait()
            except BaseException as e:  # Ctrl-C, SIGTERM (see main): stop the job, then clean up
                cluster.note_job_leftovers()  # (before the ranks go: which MPICH segments are this job's)
                # (the job is in a session of its own: it hears of a Ctrl-C as a Ctrl-C, from here)
                first = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
                for stop, wait_s in ((first, 5), (signal.SIGTERM, 5), (signal.SIGKILL, None)):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, stop)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=wait_s)
                        break
                raise
            after = cluster.interface_bytes()
            for b, a in zip(before, after):
                say(f"{a['host']}: sent {(a['tx_bytes'] - b['tx_bytes']) / 1e6:.1f} MB, received "
                    f"{(a['rx_bytes'] - b['rx_bytes']) / 1e6:.1f} MB")
    finally:
        if made and made[0].teardown_s is not None:  # (also when interrupted: namespaces, links, job gone)
            left = _remove_unused_segments(made[0].job_segments)
            say(f"removed (teardown {made[0].teardown_s:.2f} s" + (
                f"; and the {len(left)} shared-memory segment(s) MPICH left in /dev/shm, its ranks stopped before "
                f"MPI_Finalize: {', '.join(left)}" if left else "") + ")")
    return code


_SHM = Path("/dev/shm")


def _mapped_segments(maps_files) -> set[str]:
    """The names of the MPICH segments (/dev/shm/mpich_*) that the processes of these /proc/<pid>/maps
    files map (one unreadable -- gone meanwhile, or not ours to read -- counts as mapping none)."""
    mapped = set()
    for maps in maps_files:
        try:
            text = maps.read_text()
        except OSError:
            continue
        mapped.update(Path(p).name for p in mpich_segments_in(text))
    return mapped


def _hydra_files(pid: str) -> set[Path]:
    """The files hydra_hwloc_xmlfile_* (in the temporary directory) that process `pid` holds open
    (none where it is gone)."""
    held = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = Path(os.readlink(fd))
                if target.name.startswith("hydra_hwloc_xmlfile_") and target.is_absolute():
                    held.add(target)
    return held


def _remove_unused_segments(names: set[str]) -> list[str]:
    """Remove the segments `names` (a job's own, note_job_leftovers) once no process maps them or holds
    them open any more (the job's ranks, SIGKILLed by the teardown, may take a moment to go); returns
    the removed names. MPICH unlinks them in MPI_Finalize only; a rank's portddp.init does it early, a
    user's own MPI script does not."""
    if not names:
        return []

    def in_use() -> set[str]:
        return {Path(p).name for p in mpich_segments_in_use()}

    deadline = time.monotonic() + 2.0
    while names & in_use() and time.monotonic() < deadline:
        time.sleep(0.1)
    removed = []
    for name in sorted(names - in_use()):
        with contextlib.suppress(OSError):
            (_SHM / name).unlink()
            removed.append(name)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="portddp cluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-n", "--ranks", type=int, default=2, help="MPI ranks in all (a multiple of --hosts)")
    parser.add_argument("--hosts", type=int, default=2, help=f"emulated hosts, 1 to {MAX_HOSTS} (ranks spread "
                        "evenly)")
    parser.add_argument("--link", default="1gbit", help="each host's link rate per direction, with its unit "
                        "(1gbit, 500mbit, 2.5gbit); 0 or unlimited: no shaping")
    parser.add_argument("--check", action="store_true", help="only say whether a cluster can be made here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs (after --)")
    ns = parser.parse_args(argv)
    if ns.check:
        why = unavailable()
        print("portddp cluster: available" if why is None else f"portddp cluster: unavailable: {why}")
        return 0 if why is None else 1
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        parser.error("give the command to run, e.g. -- python -m experiments.overlap")
    try:
        check_job(ns.ranks, ns.hosts, ns.link)
    except ValueError as e:  # one line naming the value and the fix, before any namespace is made
        parser.error(str(e))
    try:
        return run(ns.ranks, ns.hosts, ns.link, command)
    except _Terminated as e:
        return e.exit_code  # (128 + the signal, as a shell reports a job it ended)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
