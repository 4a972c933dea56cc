"""portddp.simulate on hand-built traces with known answers (milliseconds, one process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from portddp.buckets import ParamSpec, plan_buckets, rebuild_plan
from portddp.simulate import LinkModel, Model, Trace, fit_link, simulate

GBIT = 1e9


def trace(ready, nbytes, *, forward=0.1, backward=1.0, world=2, plan=None, other=0.0, finalize=0.0):
    return Trace(forward_s=forward, backward_s=backward, ready_s=tuple(ready), bucket_bytes=tuple(nbytes),
                 launch_s=tuple(0.0 for _ in ready), done_s=tuple(0.0 for _ in ready), finalize_s=finalize,
                 other_s=other, world=world, plan=plan)


WIRE_ONLY = LinkModel(alpha_s=0.0, host_s_per_byte=0.0)
MB = 1_000_000


def wire_s(nbytes, world=2, rate=GBIT):
    return 2 * (world - 1) / world * nbytes * 8 / rate


def test_one_bucket_ready_at_the_end_cannot_overlap():
    t = trace([1.0], [50 * MB], other=0.2, finalize=0.01)
    p = simulate(t, WIRE_ONLY, rate_bps=GBIT)
    assert p.iteration_s == pytest.approx(0.1 + 1.0 + wire_s(50 * MB) + 0.01)
    assert p.step_s == pytest.approx(p.iteration_s + 0.2)
    assert p.exposed_comm_s == pytest.approx(wire_s(50 * MB))
    assert p.overlap_ratio == 0.0


def test_early_buckets_hide_behind_backward_and_only_the_last_is_exposed():
    t = trace([0.2, 0.5, 1.0], [10 * MB, 10 * MB, 5 * MB])
    p = simulate(t, WIRE_ONLY, rate_bps=GBIT)
    assert p.iteration_s == pytest.approx(0.1 + 1.0 + wire_s(5 * MB))
    assert p.exposed_comm_s == pytest.approx(wire_s(5 * MB))
    assert [b["start_s"] for b in p.buckets] == pytest.approx([0.3, 0.6, 1.1])
    hidden = 2 * wire_s(10 * MB)
    assert p.overlap_ratio == pytest.approx(hidden / (hidden + wire_s(5 * MB)))


def test_without_overlap_every_bucket_waits_for_backward_and_they_queue():
    t = trace([0.2, 0.5, 1.0], [10 * MB, 10 * MB, 5 * MB])
    p = simulate(t, WIRE_ONLY, rate_bps=GBIT, overlap=False)
    assert p.iteration_s == pytest.approx(0.1 + 1.0 + wire_s(25 * MB))
    assert p.overlap_ratio == 0.0


def test_a_slow_link_queues_buckets_in_plan_order():
    t = trace([0.1, 0.2], [100 * MB, 1 * MB])
    p = simulate(t, WIRE_ONLY, rate_bps=GBIT)
    first_end = 0.1 + 0.1 + wire_s(100 * MB)  # 0.9 s: past backward's end (1.1 s)? no: 1.0 s
    assert p.buckets[1]["start_s"] == pytest.approx(first_end)
    assert p.iteration_s == pytest.approx(max(1.1, first_end + wire_s(1 * MB)))


def test_world_of_one_communicates_nothing_and_world_size_scales_the_ring():
    t = trace([1.0], [40 * MB], world=2)
    assert simulate(t, WIRE_ONLY, world=1, rate_bps=GBIT).iteration_s == pytest.approx(1.1)
    p64 = simulate(t, WIRE_ONLY, world=64, rate_bps=GBIT)
    assert p64.exposed_comm_s == pytest.approx(wire_s(40 * MB, world=64))


def test_knobs_compression_no_sync_and_compute_scale():
    t = trace([1.0], [40 * MB], other=0.1)
    full = simulate(t, WIRE_ONLY, rate_bps=GBIT)
    half = simulate(t, WIRE_ONLY, rate_bps=GBIT, compression=0.5)
    assert half.exposed_comm_s == pytest.approx(full.exposed_comm_s / 2)
    every4 = simulate(t, WIRE_ONLY, rate_bps=GBIT, no_sync_every=4)
    assert every4.step_s == pytest.approx((3 * (0.1 + 1.0 + 0.1) + full.step_s) / 4)
    fast = simulate(t, WIRE_ONLY, rate_bps=GBIT, compute_scale=0.5)
    assert fast.backward_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="compression=2"):
        simulate(t, WIRE_ONLY, compression=2)


def test_contention_stretches_backward_and_the_communication_beside_it():
    t = trace([0.2, 1.0], [20 * MB, 1 * MB])
    base = simulate(t, WIRE_ONLY, rate_bps=GBIT)
    slowed = simulate(t, Model(WIRE_ONLY, kappa=0.5, kappa_comm=1.0), rate_bps=GBIT)
    assert slowed.backward_s > base.backward_s
    first = slowed.buckets[0]
    assert first["end_s"] - first["start_s"] == pytest.approx(2 * wire_s(20 * MB))


def test_only_the_part_of_an_all_reduce_beside_compute_is_stretched():
    """(Was: the whole all-reduce x (1 + kappa_comm) once it started before backward ended, so a
    large kappa_comm could make overlap predict slower than no overlap.)"""
    from portddp.simulate import _beside_compute  # noqa: PLC0415

    assert _beside_compute(0.0, 1.0, 10.0, 1.0) == pytest.approx(2.0)  # all of it beside compute
    assert _beside_compute(9.0, 1.0, 10.0, 1.0) == pytest.approx(1.0 + 0.5)  # 1 s at half pace, then 0.5 s alone
    assert _beside_compute(10.0, 1.0, 10.0, 1.0) == 1.0  # after backward: its own time


def test_replanning_gives_portddp_buckets_plan():
    specs = [ParamSpec(f"p{i}", (256, 256), "float32") for i in range(12)]
    plan = plan_buckets(specs, 1.0, 0.25)
    ready = [0.1 * (b + 1) for b in range(len(plan.buckets))]
    t = trace(ready, [b.nbytes for b in plan.buckets], plan=plan)
    p = simulate(t, WIRE_ONLY, rate_bps=GBIT, bucket_cap_mb=0.5, first_bucket_cap_mb=0.25)
    order = [i for b in plan.buckets for i in b.params]
    want = rebuild_plan(plan_buckets(specs, 0.5, 0.25), order, 0.5, 0.25)
    assert [b["bytes"] for b in p.buckets] == [b.nbytes for b in want.buckets]
    # Each new bucket is ready when its last parameter is; the last one at the end of backward.
    assert p.buckets[-1]["ready_s"] == pytest.approx(0.1 + ready[-1])
    assert all(a["ready_s"] <= b["ready_s"] for a, b in zip(p.buckets, p.buckets[1:]))


def test_fit_link_recovers_latency_and_host_cost_from_synthetic_sweeps():
    truth = LinkModel(alpha_s=200e-6, host_s_per_byte=2e-9, hop_s=30e-6)
    samples = [(b, n, rate, truth.allreduce_s(b, n, rate)) for b in (1e5, 1e6, 4e6, 16e6, 64e6)
               for n in (2, 4) for rate in (None, 1e9, 10e9)]
    fit = fit_link(samples)
    assert fit.alpha_s == pytest.approx(200e-6, rel=0.02)
    assert fit.hop_s == pytest.approx(30e-6, rel=0.02)
    assert fit.host_s_per_byte == pytest.approx(2e-9, rel=0.05)
    # One world size: the per-step latency cannot be told from the fixed cost; it folds into alpha.
    one = fit_link([s for s in samples if s[1] == 2])
    assert one.hop_s == 0.0 and one.alpha_s == pytest.approx(200e-6 + 2 * 30e-6, rel=0.02)


def test_a_prediction_takes_well_under_a_second():
    import time  # noqa: PLC0415

    specs = [ParamSpec(f"p{i}", (1024, 1024), "float32") for i in range(200)]
    plan = plan_buckets(specs, 25.0, 1.0)
    t = trace([0.01 * (b + 1) for b in range(len(plan.buckets))], [b.nbytes for b in plan.buckets], plan=plan)
    t0 = time.perf_counter()
    simulate(t, Model(WIRE_ONLY, kappa=0.2, kappa_comm=0.3), world=256, rate_bps=10 * GBIT, bucket_cap_mb=4)
    assert time.perf_counter() - t0 < 1.0


# `portddp simulate` (main): a small overlap result, and bad input refused in one line naming value and fix.

def _row(label, impl, *, overlap=True, events=True):
    """A row as harness/runner.py writes it: three buckets of a 6-parameter plan, times in ms."""
    specs = [ParamSpec(f"p{i}", (256, 256), "float32") for i in range(6)]
    plan = plan_buckets(specs, 0.5, 0.25)
    ms = 1_000_000
    fwd_end, bwd_end = 10 * ms, 50 * ms
    buckets, prev = [], 0
    for i, b in enumerate(plan.buckets):
        ready = fwd_end + (i + 1) * 40 * ms // len(plan.buckets)
        launch = max(ready if overlap else bwd_end, prev)
        prev = launch + 5 * ms + b.nbytes // 1000
        buckets.append({"index": i, "nbytes": b.nbytes, "ready_ns": ready, "launch_ns": launch, "done_ns": prev})
    ev = {"forward_start_ns": 0, "forward_end_ns": fwd_end, "backward_end_ns": bwd_end,
          "finalize_end_ns": prev + ms, "buckets": buckets}
    return {"label": label, "impl": impl, "median_s": (prev + 5 * ms) * 1e-9, "knobs": {"bucket_cap_mb": 0.5},
            "plan": plan.to_dict(), "metrics": {}, "events": ev if events else None}


@pytest.fixture
def result(tmp_path):
    import json  # noqa: PLC0415

    rows = [_row("native", "native", events=False), _row("torch-c10d", "torch-c10d"),
            _row("torch-c10d (no overlap)", "torch-c10d", overlap=False), _row("torch-local", "torch-local",
                                                                                 events=False)]
    path = tmp_path / "overlap-n2-h2-600mbit.json"
    path.write_text(json.dumps({"experiment": "overlap", "world": {"size": 2}, "cluster": {"hosts": 2, "rate_bps": 600e6},
                                "rows": rows}))
    return str(path)


def refused(capsys, *argv) -> str:
    """main(argv) must end with one line 'portddp simulate: ... -- ...' and a non-zero status."""
    from portddp.simulate import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code != 0 and message.startswith("portddp simulate: ") and " -- " in message, message
    assert "\n" not in message and "Traceback" not in message
    return message


def test_main_predicts_from_a_valid_result(result, capsys):
    from portddp.simulate import main  # noqa: PLC0415

    assert main([result]) == 0
    out = capsys.readouterr().out
    assert "trace: torch-c10d from" in out and "(2 ranks, link 600 Mbit/s)" in out
    assert "prediction at 2 ranks, link 600 Mbit/s: step" in out  # not given: the trace's world and link
    assert out.rstrip().endswith(" ms)") and "fitted and replayed in " in out
    assert main([result, "--world", "64", "--link", "10gbit", "--bucket-cap", "0.25", "--first-bucket-cap", "0.1",
                 "--compression", "0.5", "--no-sync-every", "2", "--compute-scale", "0.5", "--no-overlap",
                 "--hop-latency-us", "10"]) == 0
    out, err = capsys.readouterr()
    assert "prediction at 64 ranks, link 10 Gbit/s" in out and "ring step" not in err
    assert main([result, "--world", "64"]) == 0  # no latency per ring step: said, not silently taken as 0
    assert "measured at 2 ranks only, which cannot tell the latency of one ring step" in capsys.readouterr().err
    assert main([result, "--world", "1", "--link", "unlimited"]) == 0
    assert "prediction at 1 rank, link unlimited" in capsys.readouterr().out
    assert main([result, "--link", "0"]) == 0  # as for `portddp cluster --link 0`: no limit
    assert "link unlimited" in capsys.readouterr().out.splitlines()[-1]


def test_main_says_a_loopback_trace_describes_this_machine(result, tmp_path, capsys):
    """(A loopback trace was replayed without a word: +38 % on its own measured point.)"""
    import json  # noqa: PLC0415

    from portddp.simulate import main  # noqa: PLC0415

    payload = json.loads(open(result).read())
    del payload["cluster"]
    path = tmp_path / "overlap-n2.json"
    path.write_text(json.dumps(payload))
    assert main([str(path), "--world", "8", "--link", "10gbit"]) == 0
    out, err = capsys.readouterr()
    assert "(2 ranks, link loopback)" in out and "prediction at 8 ranks, link 10 Gbit/s" in out
    assert "ran on this machine's loopback, not on an emulated cluster" in err
    assert main([result]) == 0
    assert "loopback" not in capsys.readouterr().err
    # A cluster of one host is loopback too (a review: a 1-host run at 100 Mbit/s, whose ranks met in shared
    # memory, was fitted as if its bytes had crossed the link, and predicted its own point 10 x too slow).
    payload["cluster"] = {"hosts": 1, "link": "100mbit", "rate_bps": 100e6}
    path.write_text(json.dumps(payload))
    assert main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert "(2 ranks, link loopback)" in out and "ran on one emulated host, whose ranks all-reduced in its shared" in err


def test_main_warns_where_the_model_misses_its_own_measured_point_with_or_without_overlap(result, tmp_path, capsys):
    """A trace whose replay lands more than 10 % from its own measured step is warned of, --no-overlap
    included (a README walkthrough: `replayed ... (-14.2 %)` and no warning with --no-overlap)."""
    import json  # noqa: PLC0415

    from portddp.simulate import main  # noqa: PLC0415

    payload = json.loads(open(result).read())
    row = next(r for r in payload["rows"] if r["label"] == "torch-c10d")
    row["median_s"] *= 1.5  # (the step measured with overlap, as a busy machine could have made it)
    path = tmp_path / "overlap-n2.json"
    path.write_text(json.dumps(payload))
    for extra in ([], ["--no-overlap"]):
        assert main([str(path), *extra]) == 0
        assert "warning: replayed at its own point" in capsys.readouterr().err, extra
    assert main([result, "--no-overlap"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_fit_link_of_one_bucket_size_takes_the_time_beyond_the_wire_as_fixed_whatever_the_rounding():
    """(A review: on an iteration of equal buckets alpha and h fit alike, and rounding picked one -- adding 0-7
    bytes to 4 MiB buckets turned a 64-rank prediction from 3561 into 1852 ms.)"""
    rng = np.random.default_rng(0)
    nbytes = 4 * 2**20 + 4096
    for seed in range(10):
        t = 0.002 + nbytes * 8 / GBIT + np.random.default_rng(seed).normal(0, 1e-3, 8)
        for extra in (np.zeros(8, int), rng.integers(0, 8, 8)):
            fit = fit_link([(nbytes + int(e), 2, GBIT, float(x)) for e, x in zip(extra, t)])
            assert not fit.separable and fit.host_s_per_byte == 0.0
            lower_median = float(np.sort(t - (nbytes + extra) * 8 / GBIT)[3])  # (of 8)
            assert fit.alpha_s == pytest.approx(max(0.0, lower_median), abs=1e-9)
    # Sizes apart by more than SEPARABLE_SPREAD: both are fitted, as from a sweep.
    truth = LinkModel(alpha_s=2e-3, host_s_per_byte=20e-9)
    fit = fit_link([(b, 2, GBIT, truth.allreduce_s(b, 2, GBIT)) for b in (1e6, 4e6, 16e6)])
    assert fit.separable and fit.host_s_per_byte == pytest.approx(20e-9, rel=0.05)
    # One size at two rates: the wire binds at one and the hosts at the other, which tells them apart too.
    truth = LinkModel(alpha_s=1e-3, host_s_per_byte=20e-9)
    fit = fit_link([(4e6, 2, r, truth.allreduce_s(4e6, 2, r)) for r in (100e6, 10 * GBIT)])
    assert fit.separable and fit.alpha_s == pytest.approx(1e-3, rel=0.05)
    assert fit.host_s_per_byte == pytest.approx(20e-9, rel=0.05)


def test_fit_link_is_not_moved_by_an_all_reduce_that_waited_for_a_late_rank():
    """(An audit's busy run: the first bucket of the iteration without overlap took 287 ms, waiting for the
    peer's backward, beside 29-41 ms for the others; least squares made that alpha 31 ms instead of ~1.4.)"""
    truth = LinkModel(alpha_s=1.5e-3, host_s_per_byte=4e-9)
    for sizes in ([4.2e6] * 8, [1e6, 2e6, 4e6, 8e6, 16e6, 1e6, 4e6, 16e6], [4e6, 4e6], [1e6, 25e6]):
        clean = [(b, 2, GBIT, truth.allreduce_s(b, 2, GBIT)) for b in sizes]
        late = [(clean[0][0], 2, GBIT, clean[0][3] + 0.25), *clean[1:]]
        assert fit_link(late).alpha_s == pytest.approx(fit_link(clean).alpha_s, rel=0.02, abs=1e-5)
        assert fit_link(clean).alpha_s == pytest.approx(1.5e-3, rel=0.02)


def test_main_notes_a_fit_it_could_not_separate_and_buckets_quicker_than_the_wire(result, tmp_path, capsys):
    import json  # noqa: PLC0415

    from portddp.simulate import main  # noqa: PLC0415

    payload = json.loads(open(result).read())
    assert main([result]) == 0
    assert "note" not in capsys.readouterr().err  # the fixture's buckets differ in size and take longer than the wire
    for row in payload["rows"]:  # equal buckets, each done in 1 ms: 14 % of a 524 KB bucket's wire time at 600 Mbit/s
        for b in (row.get("events") or {}).get("buckets", []):
            b["nbytes"], b["done_ns"] = 524288, b["launch_ns"] + 1_000_000
    path = tmp_path / "overlap-n2-h2-600mbit.json"
    path.write_text(json.dumps(payload))
    assert main([str(path)]) == 0
    err = capsys.readouterr().err
    assert "all-reduces took 0.14 x the time their bytes need on its 600 Mbit/s link" in err, err
    assert "moved about the same bytes (0.52 MB), which cannot tell a fixed cost" in err


def test_main_refuses_a_one_rank_result_for_more_ranks(result, tmp_path, capsys):
    """A run of one rank all-reduces nothing over any link: it cannot say what 8 ranks would take."""
    import json  # noqa: PLC0415

    one = tmp_path / "overlap-n1.json"
    one.write_text(json.dumps({**json.loads(open(result).read()), "world": {"size": 1}}))
    message = refused(capsys, str(one), "--world", "8", "--link", "1gbit")
    assert "was measured with 1 rank, whose all-reduces send no bytes" in message
    assert "pass the result of a run with 2 ranks or more" in message


def test_main_refuses_a_missing_file_or_directory_saying_what_writes_a_result(result, tmp_path, capsys):
    missing = str(tmp_path / "overlap-n2-h2-999mbit.json")
    message = refused(capsys, missing)
    assert f"{missing} does not exist" in message
    assert "portddp run overlap -n 2 --hosts 2 --link matched" in message and result in message  # the one there
    message = refused(capsys, str(tmp_path))
    assert f"{tmp_path} is a directory" in message and result in message


def test_main_refuses_what_is_not_an_overlap_result(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    message = refused(capsys, str(text))
    assert f"{text} is not JSON" in message and "portddp run overlap" in message
    binary = tmp_path / "blob.json"
    binary.write_bytes(b"\xff\xfe\x00")
    assert f"{binary} is not JSON" in refused(capsys, str(binary))
    other = tmp_path / "calibration.json"
    other.write_text('{"experiment": "calibrate", "rate": "760mbit"}')
    message = refused(capsys, str(other))
    assert f"{other} is not an overlap-experiment result" in message and "portddp run overlap" in message
    chrome = tmp_path / "overlap-n2-h2-600mbit.trace.json"
    chrome.write_text('{"traceEvents": [], "displayTimeUnit": "ms"}')
    message = refused(capsys, str(chrome))
    assert "not an overlap-experiment result" in message
    assert f"pass the result written beside it, {tmp_path / 'overlap-n2-h2-600mbit.json'}" in message


@pytest.mark.parametrize("edit", ["median", "buckets", "row"])
def test_main_refuses_a_result_whose_rows_are_not_the_experiments(result, capsys, edit):
    """(An audit: valid JSON with a string where a number or a list belongs ended in a TypeError traceback.)"""
    import json  # noqa: PLC0415

    payload = json.loads(Path(result).read_text())
    row = next(r for r in payload["rows"] if r["label"] == "torch-c10d")
    if edit == "median":
        row["median_s"] = "fast"
    elif edit == "buckets":
        row["events"]["buckets"] = "many"
    else:
        payload["rows"].append("torch-mpi")
    Path(result).write_text(json.dumps(payload))
    message = refused(capsys, result)
    assert (f"{result}'s row 'torch-c10d' (or its (no overlap) row) is not as the overlap experiment writes it" in message
            if edit != "row" else f"{result} holds rows that are not the overlap experiment's" in message), message


@pytest.mark.parametrize("argv, names, fix", [
    (["--link", "fast"], "--link fast is not a link rate", "e.g. 10gbit or 500mbit"),
    (["--link", "1000"], "--link 1000 is not a link rate (link rate '1000' has no unit", "e.g. 10gbit or 500mbit"),
    (["--bucket-cap", "0"], "--bucket-cap 0 is not a bucket size", "megabytes > 0"),
    (["--first-bucket-cap", "-1"], "--first-bucket-cap -1 is not a bucket size", "megabytes > 0"),
    (["--compute-scale", "0"], "--compute-scale 0 is not a factor", "0.5 for a device twice as fast"),
    (["--compute-scale", "nan"], "--compute-scale nan is not a factor", "a number > 0"),
    (["--no-sync-every", "0"], "--no-sync-every 0 is not a number of steps", "k >= 1"),
    (["--compression", "2"], "--compression 2 is not a fraction", "0 < c <= 1: 0.5 for fp16/bf16"),
    (["--world", "0"], "--world 0 is not a number of ranks", "--world 1 or more"),
    (["--world", "-4"], "--world -4 is not a number of ranks", "--world 1 or more"),
    (["--hop-latency-us", "-5"], "--hop-latency-us -5 is not a latency", "microseconds >= 0"),
])
def test_main_refuses_a_bad_option_naming_it_and_its_value(result, capsys, argv, names, fix):
    message = refused(capsys, result, *argv)
    assert names in message and fix in message.split(" -- ", 1)[1]
    if argv[0] in ("--compute-scale", "--no-sync-every", "--compression"):
        assert "compute_scale=" not in message  # not simulate()'s list of every constraint at once


def test_main_refuses_a_row_without_bucket_events_with_the_true_reason(result, capsys):
    message = refused(capsys, result, "--impl", "native")
    assert "--impl native cannot be replayed" in message and "timed from outside" in message
    assert "XLA" not in message
    assert message.endswith("-- pass --impl one of: torch-c10d")
    message = refused(capsys, result, "--impl", "torch-c10d (no overlap)")
    assert "is the no-overlap half of 'torch-c10d'" in message and message.endswith(
        "-- pass --impl torch-c10d, and --no-overlap to predict without overlap")
    message = refused(capsys, result, "--impl", "torch-local")
    assert "communicates nothing" in message and "pass --impl one of: torch-c10d" in message
    message = refused(capsys, result, "--impl", "torch-mpi")
    assert "has no row 'torch-mpi'" in message and "pass --impl one of: torch-c10d" in message


def test_main_errors_arrive_as_one_line_from_the_command_line(result, tmp_path):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    run = subprocess.run([sys.executable, "-m", "portddp.simulate", result, "--link", "fast"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "portddp simulate: --link fast is not a link rate (link rate 'fast' not understood: use e.g. 1gbit, 500mbit, "
        "2.5gbit, or unlimited) -- write it with its unit, e.g. 10gbit or 500mbit; unlimited (or 0) for no limit"]


@pytest.mark.parametrize("argv,message", [
    (["--caps", "1", "0"], "--caps 0 is not a bucket size: pass megabytes > 0, e.g. --caps 1 4 16"),
    (["--caps", "-4"], "--caps -4 is not a bucket size"),
    (["--caps", "nan"], "--caps nan is not a bucket size"),
    (["--rates", "1gbit", "0mbit"], "link rate '0mbit' is not above zero: pass a rate, e.g. 1gbit or 500mbit"),
    (["--rates", "fast"], "link rate 'fast' not understood"),
    (["--hosts", "2", "0"], "--hosts 0: pass 1 to 250 emulated hosts")])
def test_validation_grid_refuses_every_value_before_the_first_cluster(argv, message, monkeypatch, tmp_path):
    """(A bad cap or rate was found after the cluster was built and MPI started, in a traceback.)"""
    from experiments import simulate_validate  # noqa: PLC0415
    from portddp import cluster  # noqa: PLC0415

    def started(*_, **__):
        raise AssertionError("the grid started")

    monkeypatch.setattr(cluster, "run", started)
    monkeypatch.setattr(simulate_validate, "grid_runs", started)
    with pytest.raises(SystemExit) as exit_:
        simulate_validate.main([*argv, "--out-dir", str(tmp_path / "out")])
    assert str(exit_.value.code).startswith(f"experiments.simulate_validate: {message}"), exit_.value.code
    assert not (tmp_path / "out").exists()
