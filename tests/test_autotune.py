"""portddp/autotune.py alone: CapTuner's trial schedule, what it times, and the choice it makes
from every rank's medians (the allgather is a plain function returning what a collective would)."""

from __future__ import annotations

import logging

import pytest

from portddp.autotune import CANDIDATES_MB, CapTuner

MS = 1_000_000  # ns


def run_trials(tuner: CapTuner, duration_ms) -> list:
    """Start iterations until the tuner returns None; iteration k lasts duration_ms(k, cap) ms.
    Returns the caps it handed out, None included."""
    caps, now = [], 0
    for k in range(tuner.iterations + 1):
        cap = tuner.start_iteration(now)
        caps.append(cap)
        if cap is None:
            break
        now += int(duration_ms(k, cap) * MS)
    return caps


def test_defaults():
    t = CapTuner()
    assert t.candidates == list(CANDIDATES_MB) and t.first == CANDIDATES_MB[0]
    assert (t.warmup, t.measured, t.rounds) == (1, 2, 3)
    assert t.iterations == 1 + 3 * len(CANDIDATES_MB) * 3
    assert not t.done and t.chosen is None


def test_schedule_takes_turns_round_by_round_then_none():
    t = CapTuner([1, 5], warmup=1, measured=2, rounds=2)
    assert t.iterations == 13
    caps = run_trials(t, lambda k, cap: 1)
    assert caps == [1.0] + [1.0] * 3 + [5.0] * 3 + [1.0] * 3 + [5.0] * 3 + [None]
    assert len(caps) == t.iterations + 1  # None comes exactly at the first iteration after the trials
    assert all(type(c) is float for c in caps[:-1])


def test_only_measured_iterations_are_timed():
    # the warmup iteration of each turn (re-planning, tracing) is slow and must not count;
    # nor is iteration 0 (the first cap, while the gradient order is observed)
    t = CapTuner([1, 5], warmup=1, measured=2, rounds=2)

    def duration(k, cap):
        if k == 0:
            return 500
        return 1000 if (k - 1) % 3 == 0 else {1.0: 10, 5.0: 4}[cap]

    run_trials(t, duration)
    assert t.times_s == [pytest.approx([0.010] * 4), pytest.approx([0.004] * 4)]


def test_without_warmup_every_trial_iteration_is_timed():
    t = CapTuner([2, 3, 4], warmup=0, measured=1, rounds=1)
    assert t.iterations == 4
    caps = run_trials(t, lambda k, cap: 100 if k == 0 else cap)
    assert caps == [2.0, 2.0, 3.0, 4.0, None]
    assert t.times_s == [pytest.approx([0.002]), pytest.approx([0.003]), pytest.approx([0.004])]


def test_start_iteration_keeps_returning_none_after_the_trials_without_warmup():
    t = CapTuner([1, 2], warmup=0, measured=1, rounds=1)
    assert run_trials(t, lambda k, cap: 1)[-1] is None
    assert t.start_iteration(10 * MS) is None


def test_start_iteration_keeps_returning_none_after_the_trials():
    t = CapTuner([1, 2], warmup=1, measured=1, rounds=1)
    assert run_trials(t, lambda k, cap: 1)[-1] is None
    assert t.start_iteration(100 * MS) is None
    assert t.times_s == [pytest.approx([0.001]), pytest.approx([0.001])]  # nothing added by the extra call


def fake_allgather(*others, rank=0):
    """What the launcher's allgather returns: every rank's list in rank order, this rank's
    (`rank`) among `others`. Also returns the list of what this rank sent."""
    seen = []

    def allgather(mine):
        seen.append(mine)
        everyone = list(others)
        everyone.insert(rank, mine)
        return everyone

    return allgather, seen


def timed_tuner(ms_per_cap: dict) -> CapTuner:
    t = CapTuner(list(ms_per_cap), warmup=0, measured=3, rounds=1)
    run_trials(t, lambda k, cap: ms_per_cap[cap])
    return t


def test_decide_sends_this_ranks_medians_and_keeps_the_fastest():
    t = timed_tuner({1.0: 9, 5.0: 3, 25.0: 6})
    allgather, seen = fake_allgather()
    assert t.decide(allgather) == 5.0
    assert seen == [pytest.approx([0.009, 0.003, 0.006])]
    assert t.done and t.chosen == 5.0


def test_decide_uses_the_median_not_the_mean():
    t = CapTuner([1, 5], warmup=0, measured=3, rounds=1)
    # cap 1: 2, 2, 100 ms (one hiccup: mean 35, median 2); cap 5: 3, 3, 3 ms
    run_trials(t, lambda k, cap: [0, 2, 2, 100, 3, 3, 3][k])
    allgather, seen = fake_allgather()
    assert t.decide(allgather) == 1.0
    assert seen[0] == pytest.approx([0.002, 0.003])


def test_the_cap_whose_slowest_rank_is_fastest_wins():
    # this rank alone would pick 5 MB; rank 1 is very slow with it
    t = timed_tuner({1.0: 10, 5.0: 4})
    allgather, _ = fake_allgather([0.012, 0.020], rank=0)
    assert t.decide(allgather, rank=0) == 1.0
    assert t.summary() == {"candidates_mb": [1.0, 5.0], "chosen_mb": 1.0,
                           "median_s": pytest.approx([0.012, 0.020])}


def test_every_rank_chooses_the_same_cap():
    medians = {0: {1.0: 10, 5.0: 4, 25.0: 7}, 1: {1.0: 6, 5.0: 9, 25.0: 8}, 2: {1.0: 11, 5.0: 5, 25.0: 5}}
    sent = {r: [ms * 1e-3 for ms in m.values()] for r, m in medians.items()}
    chosen = {r: timed_tuner(m).decide(fake_allgather(*(sent[o] for o in medians if o != r), rank=r)[0], rank=r)
              for r, m in medians.items()}
    # worst over ranks: 1 MB 11 ms, 5 MB 9 ms, 25 MB 8 ms -- a cap no rank would pick alone
    assert chosen == {0: 25.0, 1: 25.0, 2: 25.0}


def test_a_tie_goes_to_the_earlier_candidate():
    t = timed_tuner({25.0: 5, 1.0: 5, 5.0: 7})
    assert t.decide(fake_allgather()[0]) == 25.0


def test_summary_before_the_choice():
    t = CapTuner([1, 5])
    assert t.summary() == {"candidates_mb": [1.0, 5.0], "chosen_mb": None, "median_s": None}


def test_only_rank_zero_logs_the_choice(caplog):
    for rank in (1, 0):
        t = timed_tuner({1.0: 10, 5.0: 4})
        with caplog.at_level(logging.INFO, logger="portddp"):
            t.decide(fake_allgather([0.001, 0.001], rank=rank)[0], rank=rank)
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage() == ("bucket_cap_mb='auto' chose 5 MB (median step time, slowest rank: "
                                              "1 MB 10.0 ms, 5 MB 4.0 ms)")


@pytest.mark.parametrize("kwargs", [dict(candidates=()), dict(warmup=-1), dict(measured=0), dict(rounds=0)])
def test_bad_settings_are_refused_naming_them(kwargs):
    with pytest.raises(ValueError, match=r"CapTuner needs candidates, warmup >= 0, measured >= 1 and rounds >= 1; "
                                         r"got "):
        CapTuner(**kwargs)
