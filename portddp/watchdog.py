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
DistributedDataParallel) and how many of portddp's collectives it issued
(`collective()`, below). A survivor that is in (or starts) an iteration the
departed rank never reached, or waits in any other collective of portddp's
that rank never issued (a model check at construction, a checkpoint save),
PORTDDP_EARLY_EXIT_GRACE_S seconds (default 5) after the goodbye, exits the
same way, naming the rank, its counts and the fix (`join()` / `ddp.uneven()`
for uneven inputs). (The grace lets a rank that left because of an error every
rank hits -- bad input -- raise its own.)

Stalls and desyncs (the role of Horovod's stall inspector and PyTorch's desync
debug mode): every collective portddp issues is announced with
`collective(name)` -- a per-process sequence number and a name such as
"iteration 12 bucket 3" or "checkpoint save" -- and every wait for one is
wrapped in `with waiting(name):`. When a rank has waited longer than
PORTDDP_STALL_S seconds (default: 80 % of PORTDDP_TIMEOUT_S, i.e. 240 s, so it
speaks before c10d's own timeout -- without portddp.init(), 30 s before the script's
own process group timeout, PyTorch's 30 minutes by default, or at 80 % of a timeout under
150 s; 0 turns it off), the lowest live rank asks
every rank over these sockets where it is (its sequence number, its last
collectives' names, waiting since when or computing since when, iterations
done), and every rank prints the same table -- naming the rank(s) behind, or
the first collective whose name differs across ranks -- and exits 70. The
watchdog threads answer even while their main threads are blocked in a
collective.

SIGTERM (from a scheduler, or forwarded by mpirun) stops the rank at once even
while its main thread is blocked in a collective (the signal wakes this
thread), and the others exit naming it; the signalled rank exits 143 (128 +
SIGTERM). A SIGTERM handler of the script's own, installed after
`portddp.init()`, takes precedence. SIGINT (Ctrl-C) raises KeyboardInterrupt
as in any script, but a main thread blocked in a collective would raise it
only once the collective ends (that is, when the peer it waits for comes):
a Ctrl-C not delivered a second later, with the main thread waiting for a
collective (not in a compiled step, which ends by itself), exits 130 the same
way, naming the collective -- unless the script has a SIGINT handler of its own.

Knobs: `portddp.init(watchdog=False)` or PORTDDP_WATCHDOG=0 turns it off;
PORTDDP_WATCHDOG_S (default 0.25 s) is how often the launcher is checked. A
rank on another host whose machine vanishes without closing its sockets is
caught by the collective timeouts instead (PORTDDP_TIMEOUT_S for c10d and
jax.distributed).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

from portddp import env

__all__ = ["EXIT_CODE", "Watchdog", "collective", "current", "listen", "pid_alive", "start", "stall_report",
           "step_started", "step_finished", "subgroups_in_use", "waiting"]

EXIT_CODE = 70
"""The exit status of a rank that stopped because another rank was lost (EX_SOFTWARE)."""

_BYE, _FAILED, _STOPPED = b"B", b"F", b"S"
_PEERS_PRINT_S = 2.0  # the longest a rank that stops the job waits for the others to print their lines
# The stall inspector: "report your state" (from the inspecting rank), the answer (JSON), and "I have
# waited past PORTDDP_STALL_S" (to the inspecting rank).
_QUERY, _ANSWER, _STALLED = b"Q", b"A", b"W"
_NEWLINE = "\x1e"  # a message is one line: newlines travel as this
_RING = 64  # names of the last collectives kept per process (for the desync check)
_LEFT_WAIT_S = 0.5  # a wait this old, in a collective a departed rank never issued, cannot finish


class _Steps:
    """This process's synchronised DDP iterations: how many finished, and whether one is under way."""

    completed = 0
    busy = False


_STEPS = _Steps()
_ACTIVE: "Watchdog | None" = None


class _Progress:
    """This process's collectives: how many issued, the names of the last _RING, and whether a
    thread waits for one (since when) or not (computing since when)."""

    seq = 0
    names = [""] * _RING
    waiters = 0
    waiting_since: float | None = None
    waiting_for = ""
    waiting_computes = False  # the wait is a compiled program that also computes (portddp.jax compiled)
    idle_since = time.monotonic()
    raised: tuple[float, str] | None = None  # (when, what) the last portddp call that raised to the script
    lock = threading.Lock()


_PROGRESS = _Progress()
_NULL = nullcontext()


def collective(name: str) -> None:
    """This rank issues its next collective, named e.g. "iteration 12 bucket 3" or "checkpoint save".
    Every rank must issue the same names in the same order. Two stores, no system call: cheap
    enough for every bucket."""
    p = _PROGRESS
    p.seq += 1
    p.names[p.seq % _RING] = name


def current() -> str:
    """The name of the collective this rank issued last ("" before the first)."""
    p = _PROGRESS
    return p.names[p.seq % _RING] if p.seq else ""


class _Waiting:
    __slots__ = ("name", "computes")

    def __init__(self, name: str, computes: bool):
        self.name, self.computes = name, computes

    def __enter__(self):
        p = _PROGRESS
        with p.lock:
            if p.waiters == 0:
                p.waiting_since, p.waiting_for = time.monotonic(), self.name or p.names[p.seq % _RING]
                p.waiting_computes = self.computes
            p.waiters += 1
        return self

    def __exit__(self, kind, value, tb):
        p = _PROGRESS
        with p.lock:
            p.waiters -= 1
            if p.waiters == 0:
                p.waiting_since, p.idle_since = None, time.monotonic()
        if value is not None and _ACTIVE is not None and isinstance(value, Exception):
            why = _ACTIVE.explain(value)
            if why is not None:  # the collective failed because a peer left: say that, not only how
                raise RuntimeError(why) from value
        return False


def note_raised(exc: BaseException) -> None:
    """A portddp call on this rank raised `exc` to the script. If the script catches it and goes on,
    and this rank falls behind, the stall inspector says so (it said only "has been computing")."""
    _PROGRESS.raised = (time.monotonic(), _summary(type(exc), exc))


def noting_errors(fn):
    """`fn`, with what it raises to the script noted (note_raised): portddp.torch's forward."""
    @functools.wraps(fn)
    def noted(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            note_raised(e)
            raise

    return noted


def waiting(name: str = "", computes: bool = False):
    """Context manager: this thread is blocked waiting for collective(s) -- e.g. around a
    future's or handle's wait(). `name` defaults to the last collective issued. `computes`: the
    wait is a program that computes as well as communicates (portddp.jax's compiled step), so every
    rank in it at once for long is a long step, not a stall. A shared no-op when the watchdog is off."""
    return _NULL if _ACTIVE is None else _Waiting(name, computes)


def _my_state(rank: int) -> dict:
    """What this rank tells the stall inspector."""
    p, now = _PROGRESS, time.monotonic()
    since = p.waiting_since
    seq = p.seq
    return {"rank": rank, "seq": seq, "names": {str(k): p.names[k % _RING] for k in range(max(1, seq - _RING + 1),
                                                                                             seq + 1)},
            "waiting": None if since is None else round(now - since, 3), "waiting_for": p.waiting_for,
            "computes": since is not None and p.waiting_computes,
            "idle": None if since is not None else round(now - p.idle_since, 3),
            "iterations": _STEPS.completed, "in_iteration": _STEPS.busy,
            "raised": None if p.raised is None else [round(now - p.raised[0], 1), p.raised[1]]}


def stall_report(states: dict, stall_s: float, who=lambda r: f"rank {r}", departed: dict | None = None) -> str | None:
    """The stall inspector's verdict from every rank's state (`_my_state`; None for a rank that did
    not answer): a headline and a table, one line each, or None when no rank has waited longer than
    `stall_s` (nothing to report). Pure: the same states give the same text on every rank."""
    departed = departed or {}
    live = {r: s for r, s in states.items() if s is not None}
    stalled = sorted(r for r, s in live.items() if s["waiting"] is not None and s["waiting"] >= stall_s)
    if not stalled:
        return None
    if (not departed and all(s["waiting"] is not None and s.get("computes") for s in live.values())
            and len(live) == len(states) and len({(s["seq"], s["waiting_for"]) for s in live.values()}) == 1):
        return None  # every rank inside the same compiled step: a long step, still running
    names = {r: {int(k): v for k, v in s["names"].items()} for r, s in live.items()}
    top = max(s["seq"] for s in live.values())

    def coll(r, k=None):
        k = live[r]["seq"] if k is None else k
        return f"#{k} '{names[r].get(k, '?')}'" if k > 0 else "none yet"

    def ranks(rs):
        rs = sorted(rs)
        return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))

    waited = max(live[r]["waiting"] for r in stalled)
    # (every rank that waits, also one that started its wait a moment after the first: the ranks leave
    # the collective before it at slightly different times)
    waiting = sorted(r for r, s in live.items() if s["waiting"] is not None)
    head = (f"stall: {ranks(waiting)} waited {'up to ' if len(waiting) > 1 else ''}{waited:.1f} s (over "
            f"PORTDDP_STALL_S={stall_s:g}) for a collective that never completed; ")
    # The first collective whose name differs across the ranks that issued it (a desync), within
    # what every rank remembers.
    low = max([min(n) for n in names.values() if n] or [1])
    desync = None
    for k in range(low, top + 1):
        by_name: dict[str, list] = {}
        for r in live:
            if live[r]["seq"] >= k:
                by_name.setdefault(names[r].get(k, "?"), []).append(r)
        if len(by_name) > 1:
            desync = k, by_name
            break
    behind = sorted(r for r, s in live.items() if s["seq"] < top and s["waiting"] is None) if desync is None else []
    leaders = sorted(r for r, s in live.items() if s["seq"] == top)
    if desync is not None:
        k, by_name = desync
        parts = [f"'{n}' on {ranks(rs)}" for n, rs in sorted(by_name.items(), key=lambda kv: min(kv[1]))]
        head += (f"the ranks issued different collectives: collective #{k} is " + " but ".join(parts) +
                 ". Every rank must issue the same collectives in the same order (the same calls, on every rank)"
                 + desync_hint(set(by_name)))
    elif behind:
        def since(r):  # (a portddp error the script caught since that collective, then went elsewhere)
            raised = live[r].get("raised")
            return ("" if not raised or raised[0] > live[r]["idle"] + 1 else
                    f" (its last portddp call raised {raised[1]} {raised[0]:.0f} s ago, and the script went on)")

        head += (f"{ranks(behind)} {'is' if len(behind) == 1 else 'are'} behind: " + "; ".join(
            f"rank {r}'s last collective is {coll(r)} and it has been computing for {live[r]['idle']:.1f} s since"
            + since(r) for r in behind) + f", while {ranks(leaders)} {'is' if len(leaders) == 1 else 'are'} in "
            f"{coll(leaders[0])}. Find what {'it is' if len(behind) == 1 else 'they are'} doing (a slow step, I/O, "
            "work on some ranks only), or raise PORTDDP_STALL_S if this wait is expected")
    elif departed:
        head += (f"{ranks(departed)} left without an error (see the table) and will never join it. Every rank must "
                 "make the same portddp calls before it ends (for uneven inputs: `with ddp.join():`, "
                 "portddp.jax: `ddp.uneven(batches)`)")
    elif all(s["waiting"] is not None for s in live.values()) and len({s["seq"] for s in live.values()}) == 1:
        head += (f"every rank{' that answered' if len(live) < len(states) else ''} waits in {coll(stalled[0])}: the collective itself does not complete "
                 "(a network problem, or a collective portddp does not see, issued by some ranks only)")
    else:
        head += "no rank is computing behind the others (see the table)"
    missing = sorted(r for r, s in states.items() if s is None)
    if missing:
        head += f"; {ranks(missing)} did not answer (blocked holding the GIL?)"
    rows = [("rank", "process", "collectives", "last collective", "state", "iterations")]
    for r in sorted(states):
        s = states[r]
        if s is None:
            rows.append((str(r), who(r), "?", "?", "no answer", "?"))
            continue
        state = (f"waiting {s['waiting']:.1f} s in '{s['waiting_for']}'" if s["waiting"] is not None
                 else f"computing for {s['idle']:.1f} s")
        mark = " <- behind" if r in behind else ""
        rows.append((str(r), who(r), str(s["seq"]), coll(r) if s["seq"] else "none yet", state + mark,
                     str(s["iterations"])))
    for r, done in sorted(departed.items()):
        if r not in states:
            rows.append((str(r), who(r), "-", "-", "left (goodbye)", str(done)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([head, *table])


def desync_hint(names: set[str]) -> str:
    """What usually makes ranks issue these different collectives ("; ..." or ""), for the stall report
    and for launch.unpack_named's error."""
    def has(what: str) -> bool:
        return any(what in n for n in names)

    from portddp.protocol import REPLAN_CHECK  # noqa: PLC0415

    if has(f": {REPLAN_CHECK}"):
        return ("; a rank in 'model check after a re-plan' re-planned its buckets because its parameters changed "
                "dtype, device or shape after wrapping (.double(), .to(), p.data = ...) where the others did not: "
                "make the same change on every rank, before the same forward")
    if has(": buffer broadcast") and has(": bucket "):
        return ("; a rank in 'buffer broadcast' began its next forward while the others are in a backward's bucket: "
                "it ran a forward without its backward (an exception caught, a `continue` after the forward) where "
                "they did not. Skip a step on every rank or on none (agree first, e.g. all-reduce a flag), or run "
                "such forwards under no_sync() or torch.no_grad()")
    return ""


def subgroups_in_use() -> None:
    """A DDP runs over a process subgroup: this process's iteration and collective counts then mix
    groups, so a peer's departure is no longer judged from them (the stall inspector still runs)."""
    if _ACTIVE is not None:
        _ACTIVE.subgroups_in_use()


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


class _Interrupts:
    """Ctrl-Cs: how many the wakeup fd announced (watchdog thread), how many reached the main
    thread's Python code as KeyboardInterrupt (_on_sigint, minus those a collective's wait holds
    back until it completes: deferred_interrupt)."""

    received = 0
    delivered = 0


_SIGINT = _Interrupts()


def _on_sigint(signum, frame):
    """Python's own SIGINT handler (KeyboardInterrupt), counting what it delivers."""
    _SIGINT.delivered += 1
    raise KeyboardInterrupt


@contextmanager
def deferred_interrupt():
    """Around a wait for a nonblocking collective on the main thread: a KeyboardInterrupt raised
    inside is held back until the collective completes (abandoned half-way, the next collective
    would pair with it on the other ranks), then raised. While held back it counts as not
    delivered, so a wait that does not complete within a second ends the rank (exit 130) as a
    blocking wait would. Yields a function that raises the held one, if any -- call it when the
    collective is done."""
    held: list[BaseException] = []

    def hold(e: BaseException) -> None:
        if not held and signal.getsignal(signal.SIGINT) is _on_sigint:
            _SIGINT.delivered -= 1
        held.append(e)

    def release() -> None:
        if held:
            if signal.getsignal(signal.SIGINT) is _on_sigint:
                _SIGINT.delivered += 1
            raise held[0]

    yield hold, release


class Watchdog:
    def __init__(self, rank: int, server: socket.socket, peers: list[tuple], interval_s: float,
                 connect_timeout_s: float = 60.0, stall_s: float = 0.0, grace_s: float = 5.0):
        self.rank, self.peers, self.interval_s, self.stall_s = rank, peers, interval_s, stall_s
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
        self._send_lock = threading.Lock()  # the thread answers while the main thread may say goodbye
        self._done = False
        self._failed = False  # this rank died of an uncaught exception (it then skips MPI_Finalize)
        self._exiting = False  # _exit is under way (a second SIGTERM handler waits for it)
        self._sigint_at: float | None = None  # a Ctrl-C the main thread may not see while blocked
        self._selector = selectors.DefaultSelector()
        for r, s in self.socks.items():
            self._selector.register(s, selectors.EVENT_READ, r)
        # Written to at exit: the thread ends before the interpreter does (a daemon thread waking up
        # during finalization can abort the process).
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending = {r: b"" for r in self.socks}
        self._stopped: set[int] = set()  # peers that told this rank they stop (their line printed)
        # rank -> (synchronised iterations it finished, collectives it issued, the last one's name) at leaving
        self._departed: dict[int, tuple[int, int | None, str]] = {}
        self._departed_at: dict[int, float] = {}
        self._subgroups = False  # DDPs over process subgroups: departures are judged by the stall inspector
        self._grace_s = grace_s
        # The stall inspector: the inspection under way (answers by rank, deadline), the wait already
        # reported (its start time), and when to inspect alone if the inspecting rank stays silent.
        self._inspection: dict | None = None
        self._reported_wait: float | None = None
        self._fallback_at: float | None = None
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self._selector.register(self._sig_r, selectors.EVENT_READ, "signal")
        self._forked = False  # set in a child forked from this rank (_forget_in_child)
        self._thread = threading.Thread(target=self._run, name="portddp-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.finished)
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught
        self.install_signal_handler()

    def _who(self, r: int) -> str:
        return f"rank {r} (pid {self.peers[r][3]} on {self.peers[r][2]})"

    # --------------------------------------------------------------------- SIGTERM
    def install_signal_handler(self) -> None:
        """(Main thread.) Catch SIGTERM, unless the script has a handler of its own; count Ctrl-Cs
        (SIGINT) as Python's own handler delivers them, unless the script has a handler of its own;
        and have either signal wake this thread: a main thread blocked in a collective never runs a
        Python signal handler. Called again after jax.distributed starts (its preemption notifier
        takes SIGTERM)."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None, self._on_sigterm):
                signal.signal(signal.SIGTERM, self._on_sigterm)
            if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint):
                signal.signal(signal.SIGINT, _on_sigint)
            old = signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            return
        if old not in (-1, self._sig_w.fileno()):  # someone else's (asyncio's): leave it theirs
            signal.set_wakeup_fd(old)

    def _on_sigterm(self, signum, frame) -> None:
        self._terminated(signum)

    def _terminated(self, signum: int) -> None:
        """(Main thread's handler, or the watchdog thread woken by the wakeup fd: both may run.)"""
        if self._thread.is_alive() and not self._done:
            self._exit(f"{self._who(self.rank)} received {signal.Signals(signum).name}", code=128 + signum)
        if self._exiting:  # the other thread is ending this rank, naming the signal: let it
            time.sleep(10)
        signal.signal(signum, signal.SIG_DFL)  # finished already: end the way the signal would
        os.kill(os.getpid(), signum)

    def _on_signal_bytes(self) -> None:
        try:
            data = self._sig_r.recv(512)
        except OSError:
            return
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            self._exit(f"{self._who(self.rank)} received SIGTERM", code=128 + signal.SIGTERM)
        if signal.SIGINT in data and signal.getsignal(signal.SIGINT) is _on_sigint:
            _SIGINT.received += data.count(signal.SIGINT)
            if self._sigint_at is None:
                self._sigint_at = time.monotonic()

    def _check_sigint(self) -> None:
        """A Ctrl-C arrived: Python raises KeyboardInterrupt in the main thread when that thread next
        runs Python code, which a thread blocked in a collective does only when the collective ends
        -- at once if a peer is merely late, never if it is hung. Not delivered a second later, with
        the main thread waiting for a collective (not inside a compiled step, which computes and
        ends by itself): exit 130 as Ctrl-C would, telling the others."""
        if _SIGINT.delivered >= _SIGINT.received:  # KeyboardInterrupt had its way
            self._sigint_at = None
            return
        p = _PROGRESS
        if (time.monotonic() - self._sigint_at >= 1.0 and p.waiting_since is not None
                and not p.waiting_computes):
            self._exit(f"{self._who(self.rank)} received SIGINT (Ctrl-C) while waiting in {p.waiting_for!r}",
                       code=128 + signal.SIGINT)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            events = self._selector.select(self.interval_s)
            for key, _ in events:
                r = key.data
                if r is None:
                    return  # finished(): this rank is ending normally
                if r == "signal":
                    self._on_signal_bytes()
                    continue
                if r not in self.socks:
                    continue
                got = _received_lines(key.fileobj, self._pending[r])
                if got is None:
                    continue
                lines, self._pending[r], closed = got
                if not closed:
                    for line in lines:
                        self._on_line(r, line)
                        if r not in self.socks:
                            break
                    continue
                what = self._verdict(r, self._pending[r], closed=True)
                if what == "":
                    self._forget(r)
                elif what is not None:
                    self._exit(what)
            if os.getppid() != self.parent:
                self._exit(f"the launcher (pid {self.parent}) is gone")
            if self._sigint_at is not None:
                self._check_sigint()
            for r, at in list(self._departed_at.items()):
                if time.monotonic() - at >= self._grace_s:
                    what = self._left_early(r)
                    if what is not None:
                        self._exit(what)
            if self.stall_s > 0:
                self._check_stall()

    def _on_line(self, r: int, line: bytes) -> None:
        kind = line[:1]
        if kind == _QUERY:
            self._send(r, _ANSWER, json.dumps(_my_state(self.rank)))
        elif kind == _ANSWER:
            if self._inspection is not None:
                try:
                    self._inspection["answers"][r] = json.loads(line[1:])
                except ValueError:
                    pass
        elif kind == _STALLED:
            if self._inspection is None:
                self._inspect()
        else:
            what = self._verdict(r, line, closed=False)
            if what == "":
                self._forget(r)
            elif what is not None:
                if kind == _STOPPED:
                    self._stopped.add(r)  # (it has printed its line: _exit need not wait for it)
                self._exit(what)

    def _verdict(self, r: int, message: bytes, closed: bool) -> str | None:
        """"" for a peer that said goodbye, the loss to report, or None (nothing decided yet)."""
        kind, text = message[:1], message[1:].decode(errors="replace").strip().replace(_NEWLINE, "\n")
        if kind == _BYE:
            # Judged from the thread's loop after a grace period: a rank that left because of an
            # error this rank is about to hit as well (bad input, raised on every rank) is no culprit.
            try:
                bye = json.loads(text)
            except ValueError:
                bye = {}
            if not isinstance(bye, dict):  # (a bare count: an older portddp)
                bye = {"iterations": bye if isinstance(bye, int) else 0}
            seq = bye.get("seq")  # (None from an older portddp: its collectives are not judged)
            self._departed[r] = (int(bye.get("iterations", 0)), None if seq is None else int(seq),
                                 str(bye.get("last", "")))
            self._departed_at[r] = time.monotonic()
            return ""
        if kind == _FAILED:
            return f"{self._who(r)} failed with {text}"
        if kind == _STOPPED:
            return text
        return f"{self._who(r)} is gone" if closed else None

    def explain(self, error: Exception) -> str | None:
        """(The thread that waited: main, autograd's or a JAX host callback's.) A collective this rank
        waited in raised `error`: if it is the echo of a peer that left early (Gloo's "Connection closed by peer" once a rank whose loop ended one batch
        early has exited), the reason to raise instead, naming that rank; else None. Its goodbye
        travels on another socket: a connection error waits for it up to half a second."""
        text = str(error)
        if self._subgroups or not any(w in text for w in ("Connection closed", "Connection reset", "Broken pipe")):
            return None  # an error of its own (every rank may raise it): not a peer's departure to judge
        deadline = time.monotonic() + 0.5
        while True:
            for r in list(self._departed):
                why = self._left_early(r, waited=True)
                if why is not None:
                    return f"{why} ({type(error).__name__} from the collective: {(text.splitlines() or [''])[0][:200]})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def subgroups_in_use(self) -> None:
        self._subgroups = True

    def _left_early(self, r: int, waited: bool = False) -> str | None:
        """The loss to report if rank r, gone, is needed by what this rank does: the DDP iteration under
        way here (one it never reached), or any other collective of portddp's this rank waits in that
        rank r never issued (a model check at construction, a checkpoint save, a buffer broadcast).
        `waited`: this rank's last wait just failed (else: it must be waiting now, for a while)."""
        if self._subgroups:  # a rank done with its own group may leave while others train on in theirs
            return None
        done, seq, last = self._departed[r]
        left = (f"{self._who(r)} left without an error (its script returned or called sys.exit) after {done} "
                "synchronised iteration(s)")
        if _STEPS.busy and _STEPS.completed >= done:
            where = f"this rank is in iteration {_STEPS.completed + 1}, whose collectives need every rank"
        else:
            p = _PROGRESS
            since = p.waiting_since
            waiting = waited or (since is not None and time.monotonic() - since >= _LEFT_WAIT_S)
            if seq is None or not waiting or p.seq <= seq:
                return None
            left += f" and {seq} collective(s) (the last {last!r})" if seq else " and before any collective"
            where = f"this rank waits in collective #{p.seq} {p.waiting_for!r}, which needs every rank"
        return (f"{left}, while {where}. Give every rank the same number of batches (e.g. DistributedSampler with "
                "drop_last=True), or wrap the training loop in `with ddp.join():` for uneven inputs (portddp.jax: "
                "`for batch in ddp.uneven(batches):`); every rank must make the same portddp calls (construction, "
                "checkpoint saves, forwards through the wrapper: evaluate on one rank through ddp.module) before it ends")

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

    # ------------------------------------------------------------- the stall inspector
    def _check_stall(self) -> None:
        now = time.monotonic()
        if self._inspection is not None:
            answers = self._inspection["answers"]
            if all(r in answers for r in self.socks) or now >= self._inspection["deadline"]:
                self._conclude()
            return
        since = _PROGRESS.waiting_since
        if since is None or now - since < self.stall_s:
            return
        if self._reported_wait != since:
            self._reported_wait = since
            inspector = min([self.rank, *self.socks])
            if inspector == self.rank:
                self._inspect()
            else:
                self._send(inspector, _STALLED, "")
                self._fallback_at = now + 5.0
        elif self._fallback_at is not None and now >= self._fallback_at:
            self._fallback_at = None  # the inspecting rank never reported: inspect from here
            self._inspect()

    def _inspect(self) -> None:
        self._inspection = {"answers": {self.rank: _my_state(self.rank)}, "deadline": time.monotonic() + 2.0}
        for r in list(self.socks):
            self._send(r, _QUERY, "")

    def _conclude(self) -> None:
        answers = self._inspection["answers"]
        self._inspection = None
        states = {r: answers.get(r) for r in [self.rank, *self.socks]}
        report = stall_report(states, self.stall_s, self._who_short,
                              {r: done for r, (done, _, _) in self._departed.items()})
        if report is not None:
            self._exit(report)

    def _who_short(self, r: int) -> str:
        return f"pid {self.peers[r][3]} on {self.peers[r][2]}"

    # ------------------------------------------------------------------ messages
    def _send(self, r: int, kind: bytes, text: str = "") -> None:
        s = self.socks.get(r)
        if s is None:
            return
        with self._send_lock:
            try:
                s.settimeout(1.0)
                s.sendall(kind + text.replace("\n", _NEWLINE).encode() + b"\n")
            except OSError:
                pass
            finally:
                try:
                    s.setblocking(False)
                except OSError:
                    pass

    def _tell_all(self, kind: bytes, text: str = "") -> None:
        for r in list(self.socks):
            self._send(r, kind, text)

    def _exit(self, what: str, detail: str = "", code: int = EXIT_CODE) -> None:
        """Print why this rank ends, tell the others, and exit once they have printed theirs."""
        with self._lock:
            if self._done:
                return
            self._done = self._exiting = True
        head, _, rest = what.partition("\n")
        msg = (f"portddp: {head}; rank {self.rank} exits now (code {code}) rather than wait for collectives "
               f"that can never finish{detail}\n" + (rest + "\n" if rest else ""))
        try:
            unlink_mpi_shared_memory()  # first: mpirun kills the others as soon as one rank is gone
            os.write(2, msg.encode())
            self._tell_all(_STOPPED, what)  # the others then name the first failure, not this rank
            self._await_peers(_PEERS_PRINT_S)
        finally:
            os._exit(code)

    def _await_peers(self, timeout: float) -> None:
        """Until every peer has printed its own line -- it says so (_STOPPED: every rank that stops tells
        the others after printing, so no two wait for each other) or its connection closes -- or `timeout`:
        mpirun kills every rank as soon as one exits with an error, and a peer whose thread had not yet run
        (a loaded machine) died without a word (seen in the suite, about 1 run in 10 under load)."""
        waiting = {s: r for r, s in self.socks.items() if r not in self._stopped}
        pending = {r: self._pending.get(r, b"") for r in self.socks}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for s in list(waiting):
                try:
                    s.setblocking(False)
                    sel.register(s, selectors.EVENT_READ)
                except (OSError, ValueError, KeyError):  # (closed already: that peer is gone)
                    del waiting[s]
            while waiting and (left := deadline - time.monotonic()) > 0:
                for s in [s for s, r in waiting.items() if r in self._stopped]:  # (heard by the thread meanwhile)
                    del waiting[s]
                    sel.unregister(s)
                try:
                    ready = sel.select(min(left, 0.05))
                except (OSError, ValueError):
                    return
                for key, _ in ready:
                    s = key.fileobj
                    r = waiting.get(s)
                    got = None if r is None else _received_lines(s, pending[r])
                    if got is None:
                        continue
                    lines, pending[r], closed = got
                    if closed or any(line[:1] == _STOPPED for line in lines):
                        del waiting[s]
                        sel.unregister(s)

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
        summary = _summary(kind, value)
        self._failed = True
        self._tell_all(_FAILED, summary)
        sys.excepthook = self._excepthook
        self._excepthook(kind, value, tb)
        if _is_c10d_timeout(value):
            sys.stderr.write(f"portddp: rank {self.rank}: a c10d collective timed out (PORTDDP_TIMEOUT_S, or "
                             "portddp.init(timeout_s=...), bounds it). The stall inspector (PORTDDP_STALL_S, "
                             "below the timeout) names the rank that is behind; see its table above if it ran\n")

    def finished(self) -> None:
        """At exit: if nothing went wrong, say goodbye, so that the others let this rank go; then
        stop the thread. A rank that died of an uncaught exception ends here, with Python's exit
        code 1, after the exit handlers registered since portddp.init (the script's own) ran:
        the handlers registered before -- mpi4py's MPI_Finalize, jax.distributed's shutdown --
        wait for every rank, and the others have just been told to stop without them (MPICH's
        Finalize then blocks in its PMI barrier for ever, seen about once in 15 runs)."""
        if self._forked:  # a child forked from this rank: not the rank (_forget_in_child)
            return
        with self._lock:
            say_bye, self._done = not self._done, True
        if self._failed and threading.current_thread() is threading.main_thread():
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            unlink_mpi_shared_memory()
            os._exit(1)
        if say_bye:
            self._tell_all(_BYE, json.dumps({"iterations": _STEPS.completed, "seq": _PROGRESS.seq,
                                             "last": current()}))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)


def _received_lines(sock, pending: bytes) -> tuple[list[bytes], bytes, bool] | None:
    """What a peer's socket holds now: (its whole lines, the part of a line still to come, whether the
    connection closed -- a read error counts as closed), or None if there was nothing to read yet."""
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    except OSError:
        data = b""
    *lines, rest = (pending + data).split(b"\n")
    return lines, rest, not data


def _summary(kind, value) -> str:
    """One line naming an uncaught exception, for the other ranks. An error raised inside a JAX host
    callback reaches Python wrapped by XLA ("INTERNAL: CpuCallback error: Traceback ..."): the
    inner exception's own line is the one that says what happened."""
    if issubclass(kind, KeyboardInterrupt):
        return "KeyboardInterrupt (SIGINT, Ctrl-C)"
    try:
        text = str(value)
    except Exception as e:  # noqa: BLE001 -- (an exception whose __str__ fails: still named, not taken for a death)
        text = f"<str() of the exception failed: {type(e).__name__}>"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if "Traceback" in first or "CpuCallback error" in first:
        inner = [line for line in lines[1:] if ": " in line and line.split(":", 1)[0].replace(".", "").isidentifier()]
        if inner:
            return f"{_clip(inner[-1])} (raised in a JAX host callback; {kind.__name__})"
        if lines[-1] == "KeyboardInterrupt" or lines[-1].startswith("KeyboardInterrupt:"):
            return f"KeyboardInterrupt (SIGINT, Ctrl-C) in a JAX host callback ({kind.__name__})"
    return f"{kind.__name__}: {_clip(first)}"


_SUMMARY_CHARS = 2000


def _clip(line: str) -> str:
    """A line for the other ranks: whole unless huge -- portddp's errors name the fix at their end,
    and a peer stopped by one must read it too."""
    return line if len(line) <= _SUMMARY_CHARS else line[:_SUMMARY_CHARS] + " [...]"


_SHARED_FILES: set[str] = set()  # portddp.shm's segment files while the ranks map them (see shared_file)


@contextmanager
def shared_file(path: str):
    """Within: `path` is a file the host's ranks are still opening (portddp.shm's segment), removed by
    the exit paths below too -- a rank the watchdog ends inside never reaches its own `finally`."""
    _SHARED_FILES.add(path)
    try:
        yield
    finally:
        _SHARED_FILES.discard(path)


def unlink_mpi_shared_memory() -> None:
    """Remove the /dev/shm files MPICH shares with this host's ranks (`mpich_shm_*`, and `mpich_vci_*`
    with several VCIs; those this process has mapped), which only MPI_Finalize would remove -- else a job whose ranks end
    without it leaves its segment in RAM until reboot. portddp.init calls it (with the watchdog on,
    in a job of several ranks) once every rank has attached -- after its first collective over
    COMM_WORLD: MPICH makes the segment in MPI_Init and never opens it by name again -- so that not
    even SIGKILL leaves one; a rank ending on an error calls it again first thing. The ranks keep
    their mappings. Also portddp.shm's segment file if this rank ends while its peers are still
    opening it (shared_file)."""
    for path in list(_SHARED_FILES):
        try:
            os.unlink(path)
        except OSError:
            pass
    try:
        with open("/proc/self/maps") as maps:
            paths = mpich_segments_in(maps.read())
    except OSError:
        return
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def mpich_segments_in(maps: str) -> set[str]:
    """The paths of MPICH's /dev/shm segments a process maps, from its /proc/<pid>/maps text."""
    return {line.split(None, 5)[5].strip().removesuffix(" (deleted)") for line in maps.splitlines()
            if "/dev/shm/mpich_" in line and len(line.split(None, 5)) == 6}


def mpich_segments_in_use() -> set[str]:
    """The paths of MPICH's /dev/shm segments that some process of this host maps or holds open.

    Only such a segment's name may be removed by anyone but its job: MPICH 5's ranks meet in MPI_Init
    by opening one agreed name (mpich_shm_<job>_<node>), the first creating it; a name removed
    before the last rank has opened it makes that rank create a segment of its own, and the ranks
    then wait for each other in two different segments, forever. A rank holds the file open from
    its creation until it has mapped it. (A process whose /proc files cannot be read counts as using
    none.)"""
    used: set[str] = set()
    for proc in os.scandir("/proc"):
        if not proc.name.isdigit():
            continue
        try:
            with open(f"/proc/{proc.name}/maps") as maps:
                used |= mpich_segments_in(maps.read())
            for fd in os.scandir(f"/proc/{proc.name}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("/dev/shm/mpich_"):
                    used.add(target.removesuffix(" (deleted)"))
        except OSError:
            continue
    return used


def _is_c10d_timeout(value) -> bool:
    try:
        text = str(value)
    except Exception:  # noqa: BLE001 -- (its __str__ fails: no timeout of c10d's)
        return False
    return "Timed out" in text or "timed out" in text and ("gloo" in text.lower() or "c10d" in text.lower())


def env_seconds(name: str, default: float, *, zero_means: str | None = None) -> float:
    """Environment variable `name` as seconds (`default` when unset): a number > 0, or >= 0 where
    `zero_means` says what 0 does; anything else is refused naming the variable and the fix."""
    return env.number(name, default, unit="seconds", zero_means=zero_means, infinite=True)


def settings(stall_s: float | None = None) -> dict:
    """The watchdog's settings from the environment, each checked (ValueError naming a bad one): read
    before the ranks exchange their addresses, so that a bad value on one rank travels in that
    exchange and stops every rank (launch._start_watchdog) -- raised after it, it left the others
    waiting for a watchdog that never connected. `stall_s`: the default for PORTDDP_STALL_S (else
    80 % of PORTDDP_TIMEOUT_S, 300 s)."""
    if stall_s is None:
        stall_s = 0.8 * env_seconds("PORTDDP_TIMEOUT_S", 300)
    return {"interval_s": env_seconds("PORTDDP_WATCHDOG_S", 0.25),
            "stall_s": env_seconds("PORTDDP_STALL_S", stall_s, zero_means="the stall inspector off"),
            "grace_s": env_seconds("PORTDDP_EARLY_EXIT_GRACE_S", 5.0, zero_means="a rank that left is named at once")}


def start(rank: int, server: socket.socket, peers: list[tuple], config: dict | None = None) -> Watchdog:
    """Connect to every rank in `peers` ((address, port, hostname, pid) each, in rank order, from
    `listen`) and watch them, with `config` from `settings()` (read now when None)."""
    global _ACTIVE
    _ACTIVE = Watchdog(rank, server, peers, **(config or settings()))
    return _ACTIVE


def _forget_in_child() -> None:
    """In a process forked from a rank (a background checkpoint writer, a fork-started worker):
    it inherits the watchdog's exit handler, excepthook, SIGTERM handler and sockets, but it is
    not the rank -- its exception or its exit must not tell the peers that the rank failed or
    left (which stopped a healthy job, naming the parent). The child keeps quiet; the rank's
    own watchdog goes on in the parent."""
    w = _ACTIVE
    if w is None:
        return
    w._forked = w._done = True
    if sys.excepthook == w._on_uncaught:
        sys.excepthook = w._excepthook
    try:
        if signal.getsignal(signal.SIGTERM) == w._on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):
        pass


os.register_at_fork(after_in_child=_forget_in_child)


def reclaim() -> None:
    """After a library started that registers exit handlers and signal handlers of its own (e.g.
    jax.distributed: an atexit shutdown that waits for every process, a SIGTERM preemption
    notifier): say goodbye before its exit handler blocks (atexit runs the last registered first),
    and take SIGTERM back (main thread)."""
    if _ACTIVE is not None:
        atexit.unregister(_ACTIVE.finished)
        atexit.register(_ACTIVE.finished)
        _ACTIVE.install_signal_handler()


def enabled() -> bool:
    return env.flag("PORTDDP_WATCHDOG", True)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("a rank closed its watchdog connection during set-up")
        data += chunk
    return data
