"""portddp/timeline.py alone: the DESIGN.md metrics on hand-built event timelines whose answers
are known, `union_length`, the stats()/JSON round trip and the Chrome-trace export.

Timestamps are small integers of nanoseconds; the metrics come back in seconds."""

from __future__ import annotations

import json

import pytest

from portddp.timeline import BucketEvents, IterationEvents, chrome_trace, union_length

NS = 1e-9


def iteration(forward_end, backward_end, *buckets, forward_start=0, finalize_end=0, rank=0):
    """IterationEvents from (launch, done) pairs; a bucket is ready when it is launched."""
    return IterationEvents(rank=rank, forward_start_ns=forward_start, forward_end_ns=forward_end,
                           backward_end_ns=backward_end, finalize_end_ns=finalize_end,
                           buckets=[BucketEvents(index=k, nbytes=1000 * (k + 1), ready_ns=launch, launch_ns=launch,
                                                 done_ns=done) for k, (launch, done) in enumerate(buckets)])


def approx(ns):
    return pytest.approx(ns * NS, abs=1e-15)


# ---- union_length

@pytest.mark.parametrize("intervals, clip, want", [
    ([], None, 0),
    ([(0, 10)], None, 10),
    ([(0, 10), (20, 25)], None, 15),  # disjoint
    ([(20, 25), (0, 10)], None, 15),  # unsorted
    ([(0, 10), (5, 15)], None, 15),  # overlapping
    ([(0, 30), (5, 15)], None, 30),  # nested
    ([(0, 10), (10, 20)], None, 20),  # touching
    ([(3, 3)], None, 0),  # zero-length
    ([(0, 10), (20, 40)], (5, 30), 15),  # clipped at both ends
    ([(0, 10)], (10, 20), 0),  # only touches the clip window
    ([(0, 10)], (50, 60), 0),  # outside it
])
def test_union_length(intervals, clip, want):
    assert union_length(intervals, clip=clip) == want


def test_union_length_takes_a_generator():
    assert union_length((a, a + 2) for a in (0, 1, 10)) == 5


# ---- the metrics

def test_some_buckets_overlap_backward():
    # forward ends at 100, backward at 200; bucket 0 [120,150] inside it, bucket 1 [160,260] half out
    m = iteration(100, 200, (120, 150), (160, 260)).metrics()
    assert m["backward_compute_time"] == approx(100)
    assert m["backward_comm_time"] == approx(260 - 120)  # last done - first launch
    assert m["backward_compute_comm_overlap_time"] == approx(200 - 120)  # backward end - first launch
    assert m["exposed_comm_time"] == approx(260 - 200)
    # communicating while computing: [120,150] + [160,200] = 70 of the union's 30 + 100
    assert m["overlap_ratio"] == pytest.approx(70 / 130)


def test_no_bucket_overlaps_backward():
    # overlap=False: every bucket launched at or after backward end
    m = iteration(0, 100, (100, 150), (150, 180)).metrics()
    assert m["overlap_ratio"] == 0.0
    assert m["backward_compute_comm_overlap_time"] == 0.0
    assert m["backward_comm_time"] == approx(80)
    assert m["exposed_comm_time"] == approx(80)


def test_launched_after_backward_end_clamps_overlap_time_at_zero():
    m = iteration(0, 100, (110, 150)).metrics()
    assert m["backward_compute_comm_overlap_time"] == 0.0  # not -10 ns
    assert m["exposed_comm_time"] == approx(50)
    assert m["backward_comm_time"] == approx(40)


def test_every_bucket_overlaps_backward():
    m = iteration(0, 1000, (100, 200), (300, 400)).metrics()
    assert m["overlap_ratio"] == 1.0
    assert m["exposed_comm_time"] == 0.0
    # the comm time spans the gap between the buckets, the ratio's union does not
    assert m["backward_comm_time"] == approx(300)
    assert m["backward_compute_comm_overlap_time"] == approx(900)


def test_a_bucket_done_before_backward_ends_is_never_exposed():
    m = iteration(0, 500, (100, 300)).metrics()
    assert m["exposed_comm_time"] == 0.0  # not -200 ns
    assert m["overlap_ratio"] == 1.0
    # exposed time is measured to the last bucket done, whichever bucket that is
    m = iteration(0, 500, (100, 700), (200, 300)).metrics()
    assert m["exposed_comm_time"] == approx(200)
    assert m["backward_comm_time"] == approx(600)


def test_concurrent_buckets_count_once_in_the_ratio():
    # two all-reduces in flight at once: [100,300] and [200,400], backward ends at 300
    m = iteration(0, 300, (100, 300), (200, 400)).metrics()
    assert m["overlap_ratio"] == pytest.approx(200 / 300)


def test_ratio_clips_communication_before_forward_end():
    # (a bucket launched before forward end: only its part inside [forward end, backward end] is hidden)
    m = iteration(100, 200, (50, 150)).metrics()
    assert m["overlap_ratio"] == pytest.approx(0.5)
    assert m["backward_compute_comm_overlap_time"] == approx(150)


def test_zero_length_buckets_give_a_ratio_of_zero_not_a_division_error():
    m = iteration(0, 100, (50, 50)).metrics()
    assert m["overlap_ratio"] == 0.0
    assert m["backward_comm_time"] == 0.0
    assert m["exposed_comm_time"] == 0.0


def test_zero_length_backward():
    m = iteration(100, 100, (100, 130)).metrics()
    assert m["backward_compute_time"] == 0.0
    assert m["overlap_ratio"] == 0.0  # nothing can hide behind no compute
    assert m["exposed_comm_time"] == approx(30)


def test_without_launched_buckets_only_compute_time_is_nonzero():
    # no buckets at all (no_sync), or buckets never launched / never done
    for it in (iteration(10, 60), iteration(10, 60, (0, 0), (40, 0))):
        m = it.metrics()
        assert m == {"backward_compute_time": approx(50), "backward_comm_time": 0.0,
                     "backward_compute_comm_overlap_time": 0.0, "overlap_ratio": 0.0, "exposed_comm_time": 0.0}


def test_unlaunched_buckets_are_left_out_of_the_metrics():
    with_extra = iteration(100, 200, (120, 150), (0, 0), (160, 260)).metrics()
    assert with_extra == iteration(100, 200, (120, 150), (160, 260)).metrics()


def test_metrics_do_not_depend_on_bucket_order():
    a = iteration(100, 200, (120, 150), (160, 260), (130, 170)).metrics()
    b = iteration(100, 200, (130, 170), (160, 260), (120, 150)).metrics()
    assert a == b


def test_metric_names_are_the_design_ones():
    assert set(iteration(0, 10, (1, 2)).metrics()) == {
        "backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time", "overlap_ratio",
        "exposed_comm_time"}


# ---- stats() and the JSON round trip

def test_stats_adds_iteration_time_bucket_count_and_the_events():
    it = iteration(100, 200, (120, 150), (0, 0), forward_start=40, finalize_end=290)
    s = it.stats()
    assert s["iteration_time"] == approx(250)  # forward start -> usable gradients
    assert s["num_buckets"] == 2  # the unlaunched one counts: it is in the plan
    assert s["events"] is it
    assert {k: v for k, v in s.items() if k in it.metrics()} == it.metrics()


def test_events_round_trip_through_json():
    it = iteration(100, 200, (120, 150), (160, 260), forward_start=40, finalize_end=290, rank=3)
    back = IterationEvents.from_dict(json.loads(json.dumps(it.to_dict())))
    assert back == it
    assert isinstance(back.buckets[0], BucketEvents)
    assert back.metrics() == it.metrics()


# ---- Chrome trace

def test_chrome_trace_structure():
    t0 = 1_000_000
    r0 = iteration(t0 + 100_000, t0 + 300_000, (t0 + 150_000, t0 + 250_000), (0, 0), forward_start=t0, rank=0)
    r1 = iteration(t0 + 110_000, t0 + 310_000, (t0 + 200_000, t0 + 400_000), forward_start=t0 + 5_000, rank=1)
    doc = json.loads(chrome_trace([("torch-c10d", [r0, r1])]))
    assert doc["displayTimeUnit"] == "ms"
    ev = doc["traceEvents"]

    assert {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "torch-c10d"}} in ev
    threads = {(e["tid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert threads == {(0, "rank 0 compute"), (1, "rank 0 comm"), (2, "rank 1 compute"), (3, "rank 1 comm")}

    spans = {(e["tid"], e["name"]): e for e in ev if e["ph"] == "X"}
    assert set(spans) == {(0, "forward"), (0, "backward"), (1, "bucket 0"),
                          (2, "forward"), (2, "backward"), (3, "bucket 0")}  # the unlaunched bucket 1: no span
    # microseconds from the earliest forward start of all runs
    assert spans[(0, "forward")]["ts"] == 0 and spans[(0, "forward")]["dur"] == 100
    assert spans[(0, "backward")]["ts"] == 100 and spans[(0, "backward")]["dur"] == 200
    assert spans[(2, "forward")]["ts"] == 5 and spans[(2, "forward")]["dur"] == 105
    bucket = spans[(3, "bucket 0")]
    assert bucket["ts"] == 200 and bucket["dur"] == 200
    assert bucket["args"] == {"bytes": 1000, "ready_us": 200}
    assert all(e["pid"] == 0 for e in ev)


def test_chrome_trace_compiled_step_is_one_span():
    # a compiled step: the host sees only when it started and when its gradients were usable
    step = IterationEvents(rank=1, forward_start_ns=2_000_000, finalize_end_ns=2_750_000)
    hooked = iteration(1_100_000, 1_300_000, (1_200_000, 1_400_000), forward_start=1_000_000, rank=0)
    ev = json.loads(chrome_trace([("jax-hooked", [hooked]), ("jax-compiled", [step])]))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert names == {0: "jax-hooked", 1: "jax-compiled"}
    compiled = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    assert compiled == [{"ph": "X", "pid": 1, "tid": 2, "name": "step (XLA-scheduled)", "ts": 1000.0, "dur": 750.0}]
    assert min(e["ts"] for e in ev if e["ph"] == "X") == 0  # t0 is shared by the runs


def test_chrome_trace_of_nothing_is_an_empty_trace():
    assert json.loads(chrome_trace([])) == {"traceEvents": [], "displayTimeUnit": "ms"}
