"""Fail fast when a rank dies, instead of waiting forever in a collective.

A collective whose peer has died never completes: Gloo may notice a closed
socket, MPI may abort, XLA's collectives may just wait -- each in its own way,
some only after their timeout. `portddp.init()` therefore starts one daemon
thread per process that watches the other ranks on the same host (their pids,
exchanged at init) and the launcher above it. A rank that ends normally -- its
script returned, or raised, or called sys.exit -- leaves a marker file at
exit (atexit) and is let go. A rank that dies of an uncaught exception leaves
a `.failed` marker with its error instead. When a rank disappears without a
clean marker (killed, crashed, os._exit, an uncaught exception) every
surviving rank prints

    portddp: rank 2 (pid 41872 on node7) is gone; rank 0 exits now (code 70) ...

to stderr and leaves with exit code 70, within `PORTDDP_WATCHDOG_S` (default
0.25 s) of the loss. If the launcher itself disappears, the rank exits the
same way, so no orphan is left behind.

Knobs: `portddp.init(watchdog=False)` or PORTDDP_WATCHDOG=0 turns it off;
PORTDDP_WATCHDOG_S sets the polling interval. Ranks on other hosts are not
watched (their pids mean nothing here): a lost remote rank is caught by the
launcher (mpirun tears the job down) or by the collective timeouts
(PORTDDP_TIMEOUT_S for c10d and jax.distributed).
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import sys
import tempfile
import threading
import time

__all__ = ["EXIT_CODE", "Watchdog", "start"]

EXIT_CODE = 70
"""The exit status of a rank that stopped because another rank was lost (EX_SOFTWARE)."""


def _alive(pid: int) -> bool:
    """Is `pid` a running process? A zombie (dead, not yet reaped) counts as gone."""
    if _HAS_PROC:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state not in ("Z", "X")
    try:  # no /proc: ask the kernel whether it could signal it (zombies then count as alive)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HAS_PROC = os.path.isdir("/proc/self")


class Watchdog:
    def __init__(self, rank: int, peers: list[tuple[str, int]], interval_s: float):
        host = socket.gethostname()
        self.rank = rank
        self.size = len(peers)
        self.interval_s = interval_s
        self.watched = {r: pid for r, (h, pid) in enumerate(peers) if h == host and r != rank}
        self.host = host
        self.parent = os.getppid()
        # One directory per job (rank 0's host and pid name it) for the clean-exit markers.
        self.markers = marker_dir(*peers[0])
        os.makedirs(self.markers, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="portddp-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.finished)
        # A collective may notice first (Gloo: "Connection closed by peer"): an exception that
        # ends the program is then explained the same way, naming the rank instead of a socket.
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught

    def _marker(self, rank: int, kind: str = "") -> str:
        return os.path.join(self.markers, f"{rank}{kind}")

    def lost(self) -> str | None:
        """What is gone, right now (None: every watched rank and the launcher are alive). A rank
        that ended by an uncaught exception or was stopped by its own watchdog passes on what
        happened to it, so every survivor names the first loss."""
        dead = [(r, pid) for r, pid in list(self.watched.items()) if not _alive(pid)]
        for r, _ in dead:
            if os.path.exists(self._marker(r)):
                del self.watched[r]  # it ended normally
        dead = [(r, pid) for r, pid in dead if r in self.watched]
        told = []  # (when, what) from ranks that left word of why they went
        for r, pid in dead:
            for kind in (".failed", ".stopped"):
                try:
                    with open(self._marker(r, kind)) as f:
                        when, text = f.read().split(" ", 1)
                except (OSError, ValueError):
                    continue
                told.append((float(when), text if kind == ".stopped" else
                             f"rank {r} (pid {pid} on {self.host}) failed with {text}"))
                break
            else:
                return f"rank {r} (pid {pid} on {self.host}) is gone"  # killed: no word at all
        if told:
            return min(told)[1]  # the first failure is the cause; the later ones its echoes
        if os.getppid() != self.parent:
            return f"the launcher (pid {self.parent}) is gone"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            what = self.lost()
            if what is not None and not self._stop.is_set():
                self._exit(what)

    def _on_uncaught(self, kind, value, tb) -> None:
        """This rank dies of an uncaught exception: tell the others (a `.failed` marker, so they
        stop at once instead of waiting for this rank in a collective), print it as usual, and
        if that exception was only the echo of a lost rank (a collective failing because a peer
        died), say which."""
        summary = f"{kind.__name__}: {(str(value).splitlines() or [''])[0][:300]}"
        try:
            with open(self._marker(self.rank, ".failed"), "w") as f:
                f.write(f"{time.time():.6f} {summary}")
        except OSError:
            pass
        self.stop()
        self._excepthook(kind, value, tb)
        # A peer's sockets close while it is still exiting, a moment before the kernel shows it
        # dead: give a comm error that moment to be explained.
        what, deadline = self.lost(), time.monotonic() + 1.0
        while what is None and time.monotonic() < deadline:
            time.sleep(0.05)
            what = self.lost()
        if what is not None:
            self._exit(what, "", marker=False)

    def _exit(self, what: str, detail: str = "", marker: bool = True) -> None:
        msg = (f"portddp: {what}; rank {self.rank} exits now (code {EXIT_CODE}) rather than wait for collectives "
               f"that can never finish{detail}\n")
        try:
            if marker:
                with open(self._marker(self.rank, ".stopped"), "w") as f:
                    f.write(f"{time.time():.6f} {what}")
            os.write(2, msg.encode())
        finally:
            os._exit(EXIT_CODE)

    def stop(self) -> None:
        self._stop.set()
        if sys.excepthook == self._on_uncaught:
            sys.excepthook = self._excepthook

    def finished(self) -> None:
        """At a normal exit: stop watching, leave the marker; the last rank out tidies up."""
        self.stop()
        if os.path.exists(self._marker(self.rank, ".failed")):
            return  # not a normal end: the others were told
        try:
            open(self._marker(self.rank), "w").close()
            if sum(name.isdigit() for name in os.listdir(self.markers)) >= self.size:
                shutil.rmtree(self.markers, ignore_errors=True)
        except OSError:
            pass


def marker_dir(host: str, pid: int) -> str:
    """Where the clean-exit markers of the job whose rank 0 is (host, pid) go."""
    return os.path.join(tempfile.gettempdir(), f"portddp-{host}-{pid}")


def start(rank: int, peers: list[tuple[str, int]], interval_s: float | None = None) -> Watchdog | None:
    """Watch `peers` ((hostname, pid) of every rank, in rank order); None when turned off."""
    if os.environ.get("PORTDDP_WATCHDOG", "1") in ("0", "false", "no", "off"):
        return None
    if interval_s is None:
        interval_s = float(os.environ.get("PORTDDP_WATCHDOG_S", 0.25))
    if not interval_s > 0:
        raise ValueError(f"PORTDDP_WATCHDOG_S={interval_s!r}: pass a polling interval in seconds > 0")
    return Watchdog(rank, peers, interval_s)
