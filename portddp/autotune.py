"""`bucket_cap_mb="auto"`: try a few bucket caps on the real job, keep the fastest.

Horovod's autotune plays this role for its fusion buffer; here the search is a
plain sweep, because the space is one number and the job is already running:

    iteration 0                 the first cap; the gradient order is observed (as always)
    then `rounds` rounds; in    `warmup` iterations (re-planning costs time here; JAX traces
    each, every candidate       each plan once and keeps it), then `measured` timed ones
    then                        every rank's medians are gathered; the cap with the lowest
                                worst-rank median wins, on every rank alike; the plan is
                                rebuilt once more with it, and the choice is logged

The candidates take turns round by round, so a slow spell of a shared machine
hits them alike instead of condemning whichever was being tried.

An iteration's time is the time from one synchronised forward (portddp.torch)
or grad_fn call (portddp.jax) to the next: the whole training step, optimizer
included, which is what the cap should make short. Framework-free: each DDP
calls `start_iteration` and supplies the collective for `decide`.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence

__all__ = ["CANDIDATES_MB", "CapTuner"]

CANDIDATES_MB = (1.0, 5.0, 25.0, 100.0)
"""Caps tried by default: per-layer buckets up to (nearly) one bucket for mid-sized models."""

log = logging.getLogger("portddp")


class CapTuner:
    def __init__(self, candidates: Sequence[float] = CANDIDATES_MB, warmup: int = 1, measured: int = 2,
                 rounds: int = 3):
        if not candidates or warmup < 0 or measured < 1 or rounds < 1:
            raise ValueError(f"CapTuner needs candidates, warmup >= 0, measured >= 1 and rounds >= 1; got "
                             f"{candidates!r}, {warmup}, {measured}, {rounds}")
        self.candidates = [float(c) for c in candidates]
        self.warmup, self.measured, self.rounds = warmup, measured, rounds
        self.times_s: list[list[float]] = [[] for _ in self.candidates]
        self.chosen: float | None = None
        self._iteration = 0  # synchronised iterations started so far
        self._last_start: int | None = None

    @property
    def first(self) -> float:
        return self.candidates[0]

    @property
    def done(self) -> bool:
        return self.chosen is not None

    @property
    def iterations(self) -> int:
        """Synchronised iterations before the choice is made (the choice applies from the next)."""
        return 1 + self.rounds * len(self.candidates) * (self.warmup + self.measured)

    def _slot(self, iteration: int) -> tuple[int, int] | None:
        """(candidate, position within its turn) of a trial iteration; None for iteration 0;
        (len(candidates), 0) once the trials are over."""
        if iteration == 0:
            return None
        turn, pos = divmod(iteration - 1, self.warmup + self.measured)
        if turn >= self.rounds * len(self.candidates):
            return len(self.candidates), 0
        return turn % len(self.candidates), pos

    def start_iteration(self, now_ns: int) -> float | None:
        """A synchronised iteration starts now: the cap it must use, or None when the trials are
        over and `decide` must be called (by every rank: it is a collective)."""
        finished = self._iteration - 1
        if (self._last_start is not None and (slot := self._slot(finished)) is not None
                and slot[0] < len(self.candidates) and slot[1] >= self.warmup):
            self.times_s[slot[0]].append((now_ns - self._last_start) * 1e-9)
        self._last_start = now_ns
        slot = self._slot(self._iteration)
        self._iteration += 1
        if slot is None:
            return self.first
        if slot[0] >= len(self.candidates):
            return None
        return self.candidates[slot[0]]

    def decide(self, allgather: Callable[[list[float]], list[list[float]]], rank: int = 0) -> float:
        """Every rank's medians -> the cap whose slowest rank is fastest; the same on every rank."""
        mine = [statistics.median(t) for t in self.times_s]
        everyone = allgather(mine)
        worst = [max(ranks[c] for ranks in everyone) for c in range(len(self.candidates))]
        best = min(range(len(self.candidates)), key=lambda c: (worst[c], c))
        self.chosen = self.candidates[best]
        self._worst = worst
        if rank == 0:
            tried = ", ".join(f"{c:g} MB {w * 1e3:.1f} ms" for c, w in zip(self.candidates, worst))
            log.info("bucket_cap_mb='auto' chose %g MB (median step time, slowest rank: %s)", self.chosen, tried)
        return self.chosen

    def summary(self) -> dict:
        """What stats() reports: candidates, their worst-rank medians (once decided) and the choice."""
        return {"candidates_mb": self.candidates, "chosen_mb": self.chosen,
                "median_s": getattr(self, "_worst", None)}
