"""Fail fast when a rank dies, instead of waiting forever in a collective.

A collective whose peer has died never completes: Gloo may notice a closed
socket, MPI may abort, XLA's collectives may just wait -- each in its own way,
some only after their timeout. `portddp.init()` therefore connects every rank
to every other rank with one plain TCP socket that carries no data while all
is well, and starts a daemon thread per process that waits on them. Whatever
ends a process, the kernel closes its sockets at once (before the process is
even reaped), so the others learn of it within microseconds:

* a normal end (the script returned, raised, or called sys.exit) says goodbye
  first and is let go;
* an uncaught exception sends its one-line summary before the traceback is
  printed: the others stop at once, naming it, instead of waiting for this
  rank in their next collective;
* silence and a closed socket means killed or crashed.

In the last two cases every other rank prints, e.g.

    portddp: rank 2 (pid 41872 on node7) is gone; rank 0 exits now (code 70) ...

to stderr and leaves with exit code 70. The first failure is the one named:
a rank stopped by its watchdog passes its reason on. If the launcher above a
rank disappears, the rank exits the same way, so no orphan is left behind.

A goodbye is not always harmless: a rank whose loop ends early (one batch
fewer, a `sys.exit(0)`) leaves the others waiting in a collective it will
never join. The goodbye therefore carries how many synchronised DDP
iterations the rank finished (`step_started`/`step_finished`, called by
DistributedDataParallel). A survivor that is in (or starts) an iteration the
departed rank never reached, PORTDDP_EARLY_EXIT_GRACE_S seconds (default 5)
after the goodbye, exits the same way, naming the rank, its count and the fix
(`join()` / `ddp.uneven()` for uneven inputs). (The grace lets a rank that
left because of an error every rank hits -- bad input -- raise its own.)

Knobs: `portddp.init(watchdog=False)` or PORTDDP_WATCHDOG=0 turns it off;
PORTDDP_WATCHDOG_S (default 0.25 s) is how often the launcher is checked. A
rank on another host whose machine vanishes without closing its sockets is
caught by the collective timeouts instead (PORTDDP_TIMEOUT_S for c10d and
jax.distributed).
"""

from __future__ import annotations

import atexit
import os
import selectors
import socket
import sys
import threading
import time

__all__ = ["EXIT_CODE", "Watchdog", "listen", "pid_alive", "start", "step_started", "step_finished"]

EXIT_CODE = 70
"""The exit status of a rank that stopped because another rank was lost (EX_SOFTWARE)."""

_BYE, _FAILED, _STOPPED = b"B", b"F", b"S"


class _Steps:
    """This process's synchronised DDP iterations: how many finished, and whether one is under way."""

    completed = 0
    busy = False


_STEPS = _Steps()
_ACTIVE: "Watchdog | None" = None


def step_started() -> None:
    """A DDP iteration (its collectives) begins on this rank: stop now if a peer already left
    before reaching it."""
    _STEPS.busy = True
    if _ACTIVE is not None:
        _ACTIVE.check_departed()


def step_finished() -> None:
    _STEPS.completed += 1
    _STEPS.busy = False


def pid_alive(pid: int) -> bool:
    """Is `pid` a running process? A zombie (dead, not yet reaped) counts as gone."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def listen(host: str) -> tuple[socket.socket, tuple]:
    """A listening socket, and what the other ranks need to reach this one: (address, port,
    hostname, pid)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((host, 0))
    server.listen(1024)
    return server, (host, server.getsockname()[1], socket.gethostname(), os.getpid())


class Watchdog:
    def __init__(self, rank: int, server: socket.socket, peers: list[tuple], interval_s: float,
                 connect_timeout_s: float = 60.0):
        self.rank, self.peers, self.interval_s = rank, peers, interval_s
        self.parent = os.getppid()
        self.socks: dict[int, socket.socket] = {}
        # Lower ranks are dialled, higher ranks dial us: every pair gets exactly one socket.
        for r in range(rank):
            s = socket.create_connection(peers[r][:2], timeout=connect_timeout_s)
            s.sendall(rank.to_bytes(4, "little"))
            self.socks[r] = s
        server.settimeout(connect_timeout_s)
        for _ in range(rank + 1, len(peers)):
            s, _addr = server.accept()
            s.settimeout(connect_timeout_s)
            self.socks[int.from_bytes(_recv_exactly(s, 4), "little")] = s
        server.close()
        for s in self.socks.values():
            s.setblocking(False)
        self._lock = threading.Lock()
        self._done = False
        self._selector = selectors.DefaultSelector()
        for r, s in self.socks.items():
            self._selector.register(s, selectors.EVENT_READ, r)
        # Written to at exit: the thread ends before the interpreter does (a daemon thread waking up
        # during finalization can abort the process).
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending = {r: b"" for r in self.socks}
        self._departed: dict[int, int] = {}  # rank -> synchronised iterations it finished before leaving
        self._departed_at: dict[int, float] = {}
        self._grace_s = float(os.environ.get("PORTDDP_EARLY_EXIT_GRACE_S", 5.0))
        self._thread = threading.Thread(target=self._run, name="portddp-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.finished)
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught

    def _who(self, r: int) -> str:
        return f"rank {r} (pid {self.peers[r][3]} on {self.peers[r][2]})"

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            events = self._selector.select(self.interval_s)
            for key, _ in events:
                r = key.data
                if r is None:
                    return  # finished(): this rank is ending normally
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if data:
                    self._pending[r] += data
                    if not self._pending[r].endswith(b"\n"):
                        continue
                what = self._verdict(r, self._pending[r], closed=not data)
                if what == "":
                    self._forget(r)
                elif what is not None:
                    self._exit(what)
            if os.getppid() != self.parent:
                self._exit(f"the launcher (pid {self.parent}) is gone")
            for r, at in list(self._departed_at.items()):
                if time.monotonic() - at >= self._grace_s:
                    what = self._left_early(r)
                    if what is not None:
                        self._exit(what)

    def _verdict(self, r: int, message: bytes, closed: bool) -> str | None:
        """"" for a peer that said goodbye, the loss to report, or None (nothing decided yet)."""
        kind, text = message[:1], message[1:].decode(errors="replace").strip()
        if kind == _BYE:
            # Judged from the thread's loop after a grace period: a rank that left because of an
            # error this rank is about to hit as well (bad input, raised on every rank) is no culprit.
            self._departed[r] = int(text or 0)
            self._departed_at[r] = time.monotonic()
            return ""
        if kind == _FAILED:
            return f"{self._who(r)} failed with {text}"
        if kind == _STOPPED:
            return text
        return f"{self._who(r)} is gone" if closed else None

    def _left_early(self, r: int) -> str | None:
        """The loss to report if rank r, gone after its last iteration, is needed by the one under way here."""
        done = self._departed[r]
        if not (_STEPS.busy and _STEPS.completed >= done):
            return None
        return (f"{self._who(r)} left without an error (its script returned or called sys.exit) after {done} synchronised iteration(s), while this "
                f"rank is in iteration {_STEPS.completed + 1}, whose collectives need every rank. Give every rank "
                "the same number of batches (e.g. DistributedSampler with drop_last=True), or wrap the training "
                "loop in `with ddp.join():` for uneven inputs (portddp.jax: `for batch in ddp.uneven(batches):`)")

    def check_departed(self) -> None:
        """From step_started(): a peer that already left makes this iteration impossible -- once its
        goodbye is older than the grace period (before that, this rank may be about to fail on the same
        bad input by itself; the thread's loop judges it then)."""
        now = time.monotonic()
        for r, at in list(self._departed_at.items()):
            what = self._left_early(r) if now - at >= self._grace_s else None
            if what is not None:
                self._exit(what)

    def _forget(self, r: int) -> None:
        self._selector.unregister(self.socks[r])
        self.socks.pop(r).close()

    def _tell_all(self, kind: bytes, text: str = "") -> None:
        line = kind + text.replace("\n", " ").encode() + b"\n"
        for s in list(self.socks.values()):
            try:
                s.setblocking(True)
                s.settimeout(1.0)
                s.sendall(line)
            except OSError:
                pass

    def _exit(self, what: str, detail: str = "") -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        msg = (f"portddp: {what}; rank {self.rank} exits now (code {EXIT_CODE}) rather than wait for collectives "
               f"that can never finish{detail}\n")
        try:
            os.write(2, msg.encode())
            self._tell_all(_STOPPED, what)  # the others then name the first failure, not this rank
        finally:
            os._exit(EXIT_CODE)

    # ------------------------------------------------------------- this rank ends
    def _on_uncaught(self, kind, value, tb) -> None:
        """This rank dies of an uncaught exception. If that exception only echoes a lost peer (a
        collective failing because a peer died), the thread is about to say so: give it a moment.
        Otherwise tell the others, so that they stop at once naming it, and print it as usual."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline and not self._done:
            time.sleep(0.02)
        with self._lock:
            if self._done:
                return
            self._done = True
        summary = f"{kind.__name__}: {(str(value).splitlines() or [''])[0][:300]}"
        self._tell_all(_FAILED, summary)
        sys.excepthook = self._excepthook
        self._excepthook(kind, value, tb)

    def finished(self) -> None:
        """At exit: if nothing went wrong, say goodbye, so that the others let this rank go; then
        stop the thread."""
        with self._lock:
            say_bye, self._done = not self._done, True
        if say_bye:
            self._tell_all(_BYE, str(_STEPS.completed))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


def start(rank: int, server: socket.socket, peers: list[tuple], interval_s: float | None = None) -> Watchdog:
    """Connect to every rank in `peers` ((address, port, hostname, pid) each, in rank order, from
    `listen`) and watch them."""
    if interval_s is None:
        interval_s = float(os.environ.get("PORTDDP_WATCHDOG_S", 0.25))
    if not interval_s > 0:
        raise ValueError(f"PORTDDP_WATCHDOG_S={interval_s!r}: pass a polling interval in seconds > 0")
    global _ACTIVE
    _ACTIVE = Watchdog(rank, server, peers, interval_s)
    return _ACTIVE


def enabled() -> bool:
    return os.environ.get("PORTDDP_WATCHDOG", "1") not in ("0", "false", "no", "off")


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a rank closed its watchdog connection during set-up")
        data += chunk
    return data
