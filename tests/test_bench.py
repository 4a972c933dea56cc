"""experiments.bench and experiments.soak, on a small MLP: they run, measure what they claim,
and end with the lines the README quotes. (The real runs are minutes long: see README.)"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import pytest

from tests import mpi

HEADLINE = ("torch_c10d_vs_native", "torch_best_vs_native", "torch_best_vs_limit", "jax_hooked_vs_limit",
            "jax_hooked_overlap")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = mpi.run(2, "experiments.bench", "--models", "mlp", "--width", "128", "--depth", "3", "--batch", "8",
                   "--warmup", "2", "--rounds", "1", "--mlp-rounds", "0", "--steps-per-round", "2", "--sweep-impls", "torch-mpi",
                   "--out-dir", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "bench-n2.json").read_text())


def test_last_line_holds_the_headline_ratios(bench):
    stdout, payload = bench
    last = dict(kv.split("=") for kv in stdout.strip().splitlines()[-1].split())
    for key in HEADLINE:  # ratios of times are positive; the overlap ratio lies in [0, 1]
        assert (0 <= float(last[key]) <= 1) if key.endswith("overlap") else float(last[key]) > 0, last
    assert "torch_mpi_auto_vs_best_fixed" in last
    assert payload["headline"].keys() >= set(HEADLINE)


def test_every_implementation_is_measured_side_by_side(bench):
    _, payload = bench
    labels = {r["label"] for r in payload["rows"] if r["group"] == "mlp"}
    assert labels == {"torch-local", "native", "torch-c10d", "torch-mpi", "torch-mpi+view", "native-again",
                      "jax-local", "jax-hooked", "jax-compiled"}
    aa = payload["models"]["mlp"]["native_again_vs_native"]  # the A/A check: native DDP twice
    rows = {r["label"]: r for r in payload["rows"] if r["group"] == "mlp"}
    assert aa == pytest.approx(rows["native-again"]["median_s"] / rows["native"]["median_s"]) and aa > 0
    assert len(payload["models"]["mlp"]["native_again_vs_native_rounds"]) == 2
    for r in payload["rows"]:
        assert len(r["times_s"]) == 2 and r["median_s"] > 0, r["label"]


def test_a_step_takes_its_slowest_ranks_time(bench):
    """Each step's time is the slowest rank's (limits included), so a median is never below rank
    0's; the model's line also gives the ratios to the limits as rank 0 alone measured them."""
    stdout, payload = bench
    for r in payload["rows"]:
        assert r["median_s"] >= r["rank0_median_s"] > 0, r["label"]
    mine = payload["models"]["mlp"]
    for key in ("torch_best_vs_limit", "jax_hooked_vs_limit"):
        rows = {r["label"]: r for r in payload["rows"] if r["group"] == "mlp"}
        label, ref = (mine["torch_best"], "torch-local") if key.startswith("torch") else ("jax-hooked", "jax-local")
        assert mine[f"{key}_rank0"] == pytest.approx(rows[label]["rank0_median_s"] / rows[ref]["rank0_median_s"])
        assert mine[key] == pytest.approx(rows[label]["median_s"] / rows[ref]["median_s"])


def test_gradient_as_bucket_view_holds_one_copy_of_the_gradients_not_two(bench):
    _, payload = bench
    rows = {r["label"]: r for r in payload["rows"] if r["group"] == "mlp"}
    n_bytes = (128 * 128 + 128) * 3 * 4 / 2**20
    assert rows["torch-mpi"]["grad_mb"] == pytest.approx(2 * n_bytes)
    assert rows["torch-mpi+view"]["grad_mb"] == pytest.approx(n_bytes)


def test_auto_chose_one_of_the_swept_caps(bench):
    _, payload = bench
    auto = next(r for r in payload["rows"] if r["params"].get("bucket_cap_mb") == "auto")
    fixed = {r["params"]["bucket_cap_mb"] for r in payload["rows"] if r["group"] == "mlp: caps"} - {"auto"}
    assert auto["auto"]["chosen_mb"] in fixed
    assert auto["vs_best_fixed"] > 0


def test_soak_reports_memory_threads_and_files(tmp_path):
    out = tmp_path / "soak.json"
    proc = mpi.run(2, "experiments.soak", "--iterations", "40", "--warmup", "10", "--every", "10", "--width", "64",
                   "--depth", "2", "--batch", "8", "--impls", "torch-mpi", "jax-hooked", "--out", str(out),
                   timeout=240)
    payload = json.loads(out.read_text())
    assert [r["impl"] for r in payload["results"]] == ["torch-mpi", "jax-hooked"], proc.stdout[-2000:]
    for row in payload["results"]:
        for rank in row["ranks"]:
            assert len(rank["samples"]) == 4 and rank["samples"][0]["open_files"] > 0
    assert proc.returncode == (0 if all(r["ok"] for r in payload["results"]) else 1)
    assert "torch-mpi_rss_growth=" in proc.stdout.splitlines()[-1]


def test_soak_summarize_names_a_missing_or_foreign_file_and_is_in_the_help(tmp_path, capsys):
    """(A missing file was a raw FileNotFoundError; --help did not mention --summarize.)"""
    from experiments import soak  # noqa: PLC0415

    missing = tmp_path / "soak.json"
    with pytest.raises(SystemExit, match=re.escape(f"no soak result at {missing}: run the soak first (mpirun -n 2 "
                                                   "python -m experiments.soak, which writes results/soak/soak.json)"
                                                   ", or pass the path of a run's JSON")):
        soak.main(["--summarize", str(missing)])
    missing.write_text(json.dumps({"experiment": "overlap", "rows": []}))
    with pytest.raises(SystemExit, match="soak.json: not a soak result"):
        soak.main(["--summarize", str(missing)])
    with pytest.raises(SystemExit):
        soak.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "python -m experiments.soak --summarize RESULT.json: print a finished run's table again" in out, out
    with pytest.raises(SystemExit, match="--every 0 is not a number of steps: pass --every 1 or more"):
        soak.main(["--every", "0"])


def test_every_row_reports_cpu_per_iteration_by_thread_group(bench):
    stdout, payload = bench
    for r in payload["rows"]:
        cpu = r["cpu"]
        assert len(cpu["per_rank"]) == 2, r["label"]
        assert cpu["total"] == pytest.approx(sum(cpu[g] for g in ("main", "comm", "xla", "other")))
        assert cpu["main"] > 0, r["label"]
    rows = {r["label"]: r for r in payload["rows"] if r["group"] == "mlp"}
    assert rows["torch-local"]["cpu"]["comm"] < rows["torch-mpi"]["cpu"]["comm"]  # no comm thread work alone
    # ... and the ratios of CPU beside those of time, per row and in each model's summary line
    assert rows["torch-mpi"]["cpu_vs_limit"] == pytest.approx(rows["torch-mpi"]["cpu"]["total"]
                                                              / rows["torch-local"]["cpu"]["total"])
    assert rows["jax-hooked"]["cpu_vs_limit"] == pytest.approx(rows["jax-hooked"]["cpu"]["total"]
                                                               / rows["jax-local"]["cpu"]["total"])
    model_line = next(line for line in stdout.splitlines() if line.startswith("mlp: "))
    summary = dict(kv.split("=") for kv in model_line.removeprefix("mlp: ").split())
    for key in ("cpu_torch_c10d_vs_native", "cpu_torch_best_vs_limit", "cpu_jax_hooked_vs_limit"):
        assert float(summary[key]) > 0, summary


def test_cpu_meter_tells_a_spinning_thread_from_a_waiting_one():
    """The CPU meter groups threads by name: a comm thread that spins costs its wall time in CPU,
    one that blocks costs next to nothing."""
    import threading  # noqa: PLC0415
    import time  # noqa: PLC0415

    from harness.measure import CpuMeter, thread_group  # noqa: PLC0415

    assert thread_group(None, "python", True) == "main"
    assert thread_group("portddp-mpi-comm", "python", False) == "comm"
    assert thread_group(None, "pt_gloo_runloop", False) == "comm"
    assert thread_group(None, "tf_XLAEigen", False) == "xla"
    assert thread_group("portddp-watchdog", "python", False) == "other"

    def measure(target) -> dict:
        stop = threading.Event()
        thread = threading.Thread(target=target, args=(stop,), name="portddp-mpi-comm", daemon=True)
        thread.start()
        meter = CpuMeter()
        meter.start()
        time.sleep(0.3)
        meter.stop(steps=3)
        stop.set()
        thread.join()
        return meter.per_step()

    def spin(stop):
        while not stop.is_set():
            pass

    spinning, waiting = measure(spin), measure(lambda stop: stop.wait())
    # Per step (0.1 s of wall time): the spinner burns what the shared cores give it (all of it on an
    # idle machine, a fifth on a busy one), the waiter next to nothing; the main thread slept.
    assert spinning["comm"] > 0.01 and waiting["comm"] < spinning["comm"] / 20, (spinning, waiting)
    assert spinning["main"] < 0.01 and spinning["wall"] == pytest.approx(0.1, rel=0.5)
    assert spinning["threads"]["portddp-mpi-comm"] == pytest.approx(spinning["comm"])


def test_cpu_meter_reports_the_median_turn():
    """Like the step times beside it, CPU per step is a median over turns: one turn that burnt ten
    times the CPU (a page-fault storm, a stray recompilation) does not move it."""
    import time  # noqa: PLC0415

    from harness.measure import CpuMeter  # noqa: PLC0415

    def burn(seconds: float) -> None:  # CPU of this thread, whatever else the machine runs
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    meter = CpuMeter()
    for seconds in (0.02, 0.2, 0.02, 0.02, 0.2):
        meter.start()
        burn(seconds)
        meter.stop(steps=2)
    per = meter.per_step()
    assert 0.009 < per["main"] < 0.03, per  # 10 ms per step in the median turn; the mean would be 46
    assert per["total"] >= per["main"] and per["wall"] >= 0.009, per
    assert CpuMeter().per_step()["total"] == 0.0


def test_cpu_meter_counts_the_calling_threads_short_turns():
    """A turn far shorter than a scheduler tick (a tiny step) still counts the calling thread's CPU:
    its schedstat lags until the next tick, so it is read from time.thread_time() (a 1 ms turn once
    read 0 s, and the benchmark test above it failed on `main > 0`)."""
    from harness.measure import CpuMeter  # noqa: PLC0415

    meter = CpuMeter()
    for _ in range(20):
        meter.start()
        sum(range(20_000))  # ~0.3 ms of Python, no system call (asking the kernel for the time would update it)
        meter.stop(steps=1)
    assert all(turn["main"] > 0 for turn in meter.turns), [turn["main"] for turn in meter.turns]


def test_a_frozen_heap_still_collects_what_the_steps_leave():
    """The runner freezes what is alive before its timed turns, so the collection before each turn
    walks only what was made since: cycles the steps leave are still collected there, the frozen
    objects are left alone, and everything is collectable again after the block."""
    import gc  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    from harness.measure import frozen_heap, no_collection  # noqa: PLC0415

    class Node:
        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

    old = Node()
    gone_old = weakref.ref(old)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del old
        step_garbage = Node()
        gone_new = weakref.ref(step_garbage)
        del step_garbage
        with no_collection():
            assert gone_new() is None  # made inside the block: collected before the turn
        assert gone_old() is not None  # frozen: left alone
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone_old() is None


@pytest.mark.parametrize("bind", ["cores", "none"])
def test_portddp_run_binds_each_rank_to_its_share_of_the_cores(tmp_path, bind):
    """`portddp run` gives each rank its own physical cores out of those it may use (mpirun
    -bind-to user:CPU lists) when the ranks fit, and the result says so (each rank's affinity,
    the command to rerun it); with --bind none, or more ranks than cores, every rank may run
    anywhere it could."""
    import os  # noqa: PLC0415

    from portddp.cli import _physical_cores, binding  # noqa: PLC0415

    mine = os.sched_getaffinity(0)
    cores = _physical_cores(mine)
    mpirun = mpi.mpirun_path()
    assert binding(len(cores) + 1, "cores", mpirun) == [] and binding(1, "none", mpirun) == []
    assert binding(1, "cores", None) == []  # (not MPICH's mpirun: no -bind-to it might not speak)
    proc = mpi.run(None, "portddp.cli", "run", "bench", "-n", "2", "--bind", bind, "--", "--models", "mlp",
                   "--width", "64", "--depth", "2", "--batch", "4", "--impls", "torch-local", "--no-sweep",
                   "--warmup", "1", "--rounds", "1", "--steps-per-round", "1", "--out-dir", str(tmp_path),
                   timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "bench-n2.json").read_text())
    rank0 = set(payload["environment"]["affinity"])
    bound = bind == "cores" and len(cores) >= 2
    if bound:  # rank 0: the first half of the physical cores, hyperthread siblings included
        assert rank0 == {cpu for core in cores[:len(cores) // 2] for cpu in core}, (rank0, cores)
    else:
        assert rank0 == mine
    assert ("-bind-to user:" in payload["command"]) == bound, payload["command"]


def test_the_view_variant_can_be_chosen_alone():
    from experiments import bench as experiment

    def labels(*impls):
        cfg = experiment.Config(models=("mlp",), impls=impls, sweep=False)
        return [v.label for v in experiment.variants(cfg, None)], cfg.implementations()

    assert labels("torch-mpi+view") == (["torch-mpi+view"], {"torch-mpi"})
    assert labels("torch-local", "torch-mpi") == (["torch-local", "torch-mpi", "torch-mpi+view"],
                                                   {"torch-local", "torch-mpi"})


def test_step_profile_times_the_steps_and_writes_a_profile_per_rank(tmp_path):
    proc = mpi.run(2, "experiments.step_profile", "torch-mpi+view", "mlp", timeout=240,
                   env={"STEPS": "2", "OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split()[:4] for line in lines] == [["rank", str(r), "torch-mpi+view", "mlp:"] for r in (0, 1)], \
        proc.stdout  # (a line each: each rank writes its line whole, so the two cannot interleave)
    if shutil.which("perf") and "profile in" in lines[0]:  # (perf may be refused, e.g. perf_event_paranoid)
        assert (tmp_path / "perf-torch-mpi+view-mlp-0.data").stat().st_size > 0


def test_phase_probe_times_each_phase_of_each_implementation_on_every_rank():
    """Each rank's line per implementation (and, with --lockstep, per implementation with a barrier
    before its optimizer step: the barrier a phase of its own, zero in the other rows); one named
    twice is built twice, its second row `<name>#2` (an A/A check)."""
    proc = mpi.run(2, "experiments.phase_probe", "mlp", "1", "torch-local", "torch-mpi+view", "torch-local",
                   "--lockstep", timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    impls = sorted(f"{impl}{lockstep}" for impl in ("torch-local", "torch-mpi+view", "torch-local#2")
                   for lockstep in ("", "+lockstep"))
    assert [line.split()[:4] for line in lines] == [["rank", str(r), "mlp", impl] for r in (0, 1)
                                                    for impl in impls], proc.stdout
    for line in lines:
        step = float(line.split()[5])
        walls = dict(re.findall(r"(zero_grad|batch|forward|backward|barrier|optimizer) ([0-9.]+) /", line))
        assert len(walls) == 6 and 0 < step and max(map(float, walls.values())) <= step, line  # (medians)
        if "lockstep" not in line:
            assert float(walls["barrier"]) < 0.1, line  # no barrier: the phase is empty


def test_phase_probe_names_its_usage_on_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "experiments.phase_probe", "resnet"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "usage: phase_probe [mlp|gelu-mlp|gpt]" in proc.stderr, proc.stderr[-2000:]


def test_hook_overhead_prints_each_rows_excess_over_native_per_parameter():
    proc = mpi.run(2, "experiments.hook_overhead", "1", "3", "--rounds", "2", timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    totals = re.findall(r"^ *(\d+) parameters, us of main-thread CPU per forward\+backward: (.*)$", proc.stdout, re.M)
    assert [n for n, _ in totals] == ["2", "6"], proc.stdout  # (rank 0 prints, once per size)
    for _, cells in totals:
        us = dict(re.findall(r"(\S+) ([0-9]+)", cells))
        assert sorted(us) == sorted(("local", "native", "c10d", "mpi", "mpi+view")) and all(float(v) > 0 for v in us.values())
    excess = re.findall(r"over native DDP: c10d [+-]\d+ \([+-][0-9.]+/param\)  mpi [+-]\d+ .*mpi\+view [+-]\d+",
                        proc.stdout)
    assert len(excess) == 2, proc.stdout


def test_hook_overhead_refuses_one_rank_and_bad_sizes():
    proc = subprocess.run([sys.executable, "-m", "experiments.hook_overhead", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "layers and --rounds must be at least 1" in proc.stderr, proc.stderr[-2000:]


def test_each_model_line_gives_the_ratios_range_over_the_rounds(bench):
    """The per-round ratios of medians: their range says how much one run's ratio can move."""
    from experiments.bench import per_round, summarise  # noqa: PLC0415

    assert per_round([1, 2, 3, 2, 2, 2, 9], [1, 1, 1, 2, 2, 2, 1], 3) == [2.0, 1.0]  # (a last partial round: left out)

    def row(label, times):
        return {"label": label, "group": "mlp", "params": {"model": "mlp"}, "median_s": sorted(times)[len(times) // 2],
                "times_s": times, "metrics": {"overlap_ratio": 0.5}}

    rows = [row("native", [0.10] * 6), row("torch-c10d", [0.10, 0.11, 0.10, 0.12, 0.13, 0.12]),
            row("torch-local", [0.05] * 6), row("torch-mpi", [0.06] * 3 + [0.07] * 3)]
    _, tables = summarise(rows, steps_per_round=3)
    mine = dict(tables)["mlp"]
    assert mine["torch_c10d_vs_native_rounds"] == pytest.approx([1.0, 1.2])
    assert mine["torch_best_vs_limit_rounds"] == pytest.approx([1.2, 1.4])
    assert "jax_hooked_vs_limit_rounds" not in mine  # no JAX rows
    stdout, payload = bench  # and the real run prints and stores them
    line = next(x for x in stdout.splitlines() if x.startswith("mlp: "))
    assert "torch_c10d_vs_native_rounds=" in line and "jax_hooked_vs_limit_rounds=" in line, line
    lo, hi = payload["models"]["mlp"]["torch_c10d_vs_native_rounds"]
    assert 0 < lo <= hi, (lo, hi)


def test_each_ratio_carries_its_standard_error_within_the_run(bench):
    """bootstrap_se: the spread of a ratio of medians over redraws of the run's rounds -- zero when
    every round gives the same ratio, larger the more the rounds disagree, the same on every call."""
    from experiments.bench import bootstrap_se  # noqa: PLC0415

    ref = [0.10, 0.11, 0.09] * 8
    assert bootstrap_se([2 * t for t in ref], ref, 3) == pytest.approx(0.0, abs=1e-12)
    steady = [t * (1.0 + 0.01 * (r % 2)) for r in range(8) for t in ref[:3]]
    shaky = [t * (1.0 + 0.20 * (r % 2)) for r in range(8) for t in ref[:3]]
    assert 0 < bootstrap_se(steady, ref, 3) < bootstrap_se(shaky, ref, 3) < 0.2
    assert bootstrap_se(shaky, ref, 3) == bootstrap_se(shaky, ref, 3)
    assert math.isnan(bootstrap_se(ref[:5], ref[:5], 3))  # one whole round: nothing to redraw
    _, payload = bench  # the real run stores one per headline ratio (its single round: NaN)
    mine = payload["models"]["mlp"]
    assert {"torch_c10d_vs_native_se", "torch_best_vs_limit_se", "native_again_vs_native_se"} <= mine.keys(), mine


def test_runs_summary_of_one_run_prints_its_means_without_a_nan_spread(tmp_path, capsys):
    """(Over a single run every ratio printed '+- nan'.)"""
    from experiments import bench_runs  # noqa: PLC0415

    path = tmp_path / "bench-n2.json"
    path.write_text(json.dumps({"experiment": "bench", "models": {"mlp": {"torch_best_vs_limit": 1.15,
                                                                          "torch_c10d_vs_native": 1.01}}}))
    bench_runs.main([str(path)])
    out = capsys.readouterr().out
    assert "nan" not in out, out
    assert re.search(r"mlp torch_best_vs_limit +1\.150 \(1 run\) +<= 1\.20: met in 1 of 1", out), out


def test_runs_summary_counts_the_runs_meeting_each_target(tmp_path, capsys):
    """experiments.bench_runs: per model and ratio, the runs meeting issue 16's target, and the runs
    meeting every one together (gpt's bounds are its own); a file that is not a bench result is refused."""
    from experiments import bench_runs

    runs = [{"gpt": {"torch_best_vs_limit": 1.04, "torch_c10d_vs_native": 1.01, "native_again_vs_native": 0.99},
             "mlp": {"torch_best_vs_limit": 1.15}},
            {"gpt": {"torch_best_vs_limit": 1.06, "torch_c10d_vs_native": 1.02, "native_again_vs_native": 1.01},
             "mlp": {"torch_best_vs_limit": 1.19}},
            {"gpt": {"torch_best_vs_limit": 1.03, "torch_c10d_vs_native": 1.04},
             "mlp": {"torch_best_vs_limit": 1.10}}]
    paths = []
    for i, models in enumerate(runs):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps({"experiment": "bench", "models": models}))
    summary = bench_runs.main([str(p) for p in paths])
    rows = {(r["model"], r["ratio"]): r for r in summary["rows"]}
    best = rows[("gpt", "torch_best_vs_limit")]
    assert best["target"] == 1.05 and best["met"] == 2 and best["mean"] == pytest.approx(1.0433333)
    assert rows[("mlp", "torch_best_vs_limit")]["target"] == 1.20 and rows[("mlp", "torch_best_vs_limit")]["met"] == 3
    assert rows[("gpt", "torch_c10d_vs_native")]["met"] == 2
    assert rows[("gpt", "native_again_vs_native")]["values"] == [0.99, 1.01, None]  # no target: not counted
    both = rows[("gpt", "torch_c10d_vs_both_natives")]  # c10d / mean(native, native again), no target
    assert both["values"] == [pytest.approx(1.01 / 0.995), pytest.approx(1.02 / 1.005), None] and "met" not in both
    assert summary["met_all"] == 1  # run 1 misses gpt's 1.05, run 2 c10d's 1.03
    assert "every target met together in 1 of 3 run(s)" in capsys.readouterr().out
    other = tmp_path / "overlap.json"
    other.write_text(json.dumps({"experiment": "overlap"}))
    with pytest.raises(SystemExit, match="not an experiments.bench result"):
        bench_runs.main([str(other)])
    with pytest.raises(SystemExit, match="missing.json: cannot read a benchmark result"):
        bench_runs.main([str(tmp_path / "missing.json")])
