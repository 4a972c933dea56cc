"""Experiments on a tiny model, then the report built from their JSON."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests import mpi

TINY = ["--width", "64", "--depth", "3", "--batch", "8", "--warmup", "2", "--rounds", "1", "--steps-per-round", "2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    runs = [(2, "overlap", ["--bucket-cap-mb", "0.01"]), (2, "bucket_sweep", ["--caps", "0.01", "inf"]),
            (2, "no_sync", ["--every", "1", "2"]), (2, "compression", []),
            (1, "scaling", ["--impls", "torch-c10d", "jax-hooked"]), (2, "scaling", ["--impls", "torch-c10d", "jax-hooked"])]
    for n, experiment, extra in runs:
        proc = mpi.run(n, f"experiments.{experiment}", *TINY, *extra, "--out-dir", str(out), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_overlap_experiment_measures_every_variant(results):
    payload = json.loads((results / "overlap-n2.json").read_text())
    labels = {r["label"] for r in payload["rows"]}
    assert {"native", "torch-c10d", "torch-c10d (no overlap)", "torch-mpi (no overlap)", "jax-hooked",
            "jax-hooked (no overlap)", "jax-compiled", "torch-local", "jax-local", "native (default caps)"} <= labels
    knobs = {r["label"]: r["knobs"] for r in payload["rows"]}
    # native at the run's cap, like portddp's rows; and once as a script gets it, at its own defaults
    assert knobs["native"]["bucket_cap_mb"] == knobs["torch-c10d"]["bucket_cap_mb"] == 0.01
    assert knobs["native (default caps)"] == {}
    for r in payload["rows"]:
        assert r["median_s"] > 0 and len(r["times_s"]) == 2
        if r["impl"] in ("torch-c10d", "torch-mpi", "jax-hooked"):
            ev = r["events"]
            launches = [b["launch_ns"] for b in ev["buckets"]]
            # with overlap, the first bucket goes before backward ends; without, none does
            assert (min(launches) < ev["backward_end_ns"]) is r["params"]["overlap"], r["label"]


def test_chrome_trace_has_a_track_per_rank_and_comm_thread(results):
    trace = json.loads((results / "overlap-n2.trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"} <= names
    assert any(e.get("name", "").startswith("bucket ") and e["ph"] == "X" for e in trace)
    assert any(e.get("name") == "step (XLA-scheduled)" for e in trace)  # the compiled strategy's spans


def test_report_has_plots_and_tables(results, tmp_path):
    proc = mpi.run(None, "comparisons.report", "--results", str(results), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    for heading in ("Where the time goes", "Overlap on vs off", "Bucket size", "PyTorch's own metrics", "World size",
                    "Gradient accumulation", "Compression hooks"):
        assert heading in md
    assert "mpirun -n 2 python -m experiments.overlap" in md
    assert "ResNet50, Gloo 26.8 %" in md
    assert "Buckets of 0.01 MB (the first 0.01 MB) in every row but *native (default caps)*" in md
    assert "| native (default caps) |" in md and "(at the same bucket cap)" in md
    for png in ("gantt.png", "bucket_sweep.png", "scaling.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:4] == b"\x89PNG"
    html = (tmp_path / "rep" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "<table>" in html


def test_report_names_foreign_and_missing_results(tmp_path):
    (tmp_path / "overlap-n2.json").write_text(json.dumps({"experiment": "overlap", "portddp_version": "0.0.1",
                                                          "rows": []}))
    (tmp_path / "broken.json").write_text("{not json")
    proc = mpi.run(None, "comparisons.report", "--results", str(tmp_path), "--out", str(tmp_path / "rep"))
    assert proc.returncode != 0
    assert "no readable results under" in proc.stderr and "rerun the experiments that wrote them" in proc.stderr
    assert "overlap-n2.json: written by portddp 0.0.1" in proc.stderr and "broken.json: unreadable" in proc.stderr
    assert not (tmp_path / "rep").exists()  # no empty report folder left behind


def test_experiment_asks_for_more_ranks_than_launched():
    proc = mpi.run(None, "experiments.overlap", *TINY, "--ranks", "2", timeout=120)
    assert proc.returncode != 0
    assert "asked for 2 ranks but launched with 1: run `mpirun -n 2 python -m experiments.overlap`" in proc.stderr


def test_cli_help_and_unknown_experiment():
    ok = mpi.run(None, "portddp.cli", "--help", timeout=60)
    assert ok.returncode == 0 and "portddp run overlap -n 2" in ok.stdout
    bad = mpi.run(None, "portddp.cli", "run", "warp_drive", timeout=60)
    assert bad.returncode != 0 and "invalid choice: 'warp_drive'" in bad.stderr and "bucket_sweep" in bad.stderr
    assert sys.executable


def test_benchmark_section_comes_from_the_json_alone(tmp_path):
    """The report shows the benchmark's own ratios, headline and CPU columns, from its JSON (no
    experiment code is imported to recompute them)."""
    import portddp  # noqa: PLC0415

    cpu = {"total": 0.08, "main": 0.06, "comm": 0.018, "xla": 0.0, "other": 0.002, "wall": 0.2, "per_rank": []}
    rows = [{"label": label, "impl": label, "group": "gelu-mlp", "params": {"model": "gelu-mlp"}, "metrics": {},
             "median_s": s, "times_s": [s, s], "vs_native": s / 0.2, "vs_limit": s / 0.1, "cpu": cpu}
            for label, s in (("torch-local", 0.1), ("native", 0.2))]
    payload = {"experiment": "bench", "portddp_version": portddp.__version__, "command": "mpirun -n 2 python -m "
               "experiments.bench", "rows": rows, "headline": {"torch_c10d_vs_native": 1.234}, "environment": {},
               "models": {"gelu-mlp": {"torch_c10d_vs_native": 1.234, "torch_c10d_vs_native_se": 0.0123,
                                       "torch_c10d_vs_native_rounds": [1.1, 1.3], "torch_best_vs_limit": 1.5}}}
    (tmp_path / "bench-n2.json").write_text(json.dumps(payload))
    proc = mpi.run(None, "comparisons.report", "--results", str(tmp_path), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "### gelu-mlp" in md and "| CPU ms / it | main | comm | xla | other |" in md
    assert "| native | 200.0 (200–200) | 1.000 | 2.000 | – | – | 80.0 | 60.0 | 18.0 | 0.0 | 2.0 |" in md
    assert "`torch_c10d_vs_native=1.234`" in md
    # each ratio with its precision within the run, as far as the JSON gives it
    assert "| portddp.torch c10d vs native | 1.234 ± 0.012 (rounds 1.100–1.300) |" in md, md
    assert "| portddp.torch best vs limit | 1.500 |" in md and "hooked vs limit" not in md


# -- the report from hand-made JSON, in process (no experiment run) ------------------------------------------
def _row(label: str, impl: str, overlap, median_s: float, times: int = 2) -> dict:
    return {"label": label, "impl": impl, "group": impl.split("-")[0], "params": {"overlap": overlap}, "knobs": {},
            "metrics": {"overlap_ratio": 0.5}, "median_s": median_s, "times_s": [median_s] * times, "loss": 1.0,
            "events": None}


def _result(tmp_path, stem: str, experiment: str, world: int = 2, **fields) -> dict:
    import portddp  # noqa: PLC0415

    payload = {"experiment": experiment, "portddp_version": portddp.__version__, "world": {"size": world},
               "command": f"mpirun -n {world} python -m experiments.{experiment}", "cluster": None, **fields}
    (tmp_path / f"{stem}.json").write_text(json.dumps(payload))
    return payload


def _report(tmp_path) -> tuple[str, str]:
    from comparisons import report  # noqa: PLC0415

    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    return (tmp_path / "rep" / "report.md").read_text(), (tmp_path / "rep" / "report.html").read_text()


def test_a_result_without_timed_iterations_costs_its_section_one_line_not_the_report(tmp_path):
    """(An overlap run with --rounds 0, from before such runs were refused, wrote NaN medians and no
    times: the report died of an IndexError in np.percentile.)"""
    _result(tmp_path, "overlap-n2", "overlap", rows=[_row("native", "native", True, math.nan, times=0),
                                                      _row("torch-local", "torch-local", None, math.nan, times=0)])
    _result(tmp_path, "no_sync-n2", "no_sync", rows=[{**_row("native / 1", "native", True, 0.01),
                                                      "params": {"samples_per_step": 16}}])
    _result(tmp_path, "compression-n2", "compression", rows=[])
    md, html = _report(tmp_path)
    path = tmp_path / "overlap-n2.json"
    assert (f"## Overlap on vs off (one machine, ranks over shared memory / loopback)\n\nNot shown: {path} has no "
            f"timed iterations for 'native', 'torch-local' (median NaN): rerun the experiment with --rounds and "
            f"--steps-per-round of 1 or more\n") in md, md
    assert "Where the time goes" not in md  # (no empty Gantt section above that line)
    assert f"Not shown: {tmp_path / 'compression-n2.json'} holds no measured rows: rerun the experiment" in md
    assert "| native / 1 | 10.0 (10–10) | 625 | 0.50 |" in md  # the usable sections as ever (IQR beside medians)
    assert f"Not shown: {path} has no timed iterations" in html


def test_world_size_tables_are_each_labelled_with_their_ranks(tmp_path):
    """(Four tables back to back rendered as one, its headers repeated as rows.)"""
    for n in (4, 1, 3, 2):
        _result(tmp_path, f"scaling-n{n}", "scaling", world=n, rows=[_row("torch-c10d", "torch-c10d", True, n / 100)])
    _result(tmp_path, "scaling-n5", "scaling", world=5, rows=[_row("torch-c10d", "torch-c10d", True, math.nan, 0)])
    md, html = _report(tmp_path)
    section = md[md.index("## World size"):]
    heads = [line for line in section.splitlines() if line.startswith("### ")]
    assert heads == ["### 1 rank", "### 2 ranks", "### 3 ranks", "### 4 ranks", "### 5 ranks"], section
    assert "### 3 ranks\n\n| variant | median ms / iteration | overlap ratio |\n|---|---|---|\n| torch-c10d | 30.0 |" \
        in section
    assert f"### 5 ranks\n\nNot shown: {tmp_path / 'scaling-n5.json'} has no timed iterations" in section
    world = html[html.index("<h2>World size</h2>"):]
    assert world.count("<table>") == 4 and world.count("<h3>") == 5 and "<h3>2 ranks</h3>" in world
    assert (tmp_path / "rep" / "scaling.png").exists()


def test_prediction_and_bandwidth_texts_name_what_was_run(tmp_path):
    """(The prediction text said "2 and 3 hosts" and the bandwidth title "... 400mbit links" whatever the
    runs were.)"""
    def run(link, rate_bps):
        return {"cluster": {"hosts": 2, "link": link, "rate_bps": rate_bps}, "world": {"size": 2},
                "rows": [_row("torch-c10d", "torch-c10d", True, 0.1), _row("torch-c10d (no overlap)", "torch-c10d",
                                                                          False, 0.12)]}

    _result(tmp_path, "bandwidth-n2-h2", "bandwidth", runs=[run("unlimited", None), run("400mbit", 4e8),
                                                             run("1gbit", 1e9)], calibration=None)
    points = [{"impl": "torch-c10d", "hosts": 2, "world": 2, "rate": rate, "cap": cap, "overlap": overlap,
               "predicted_s": 0.1, "measured_s": 0.1, "error": 0.0, "predict_s": 0.001}
              for rate in ("500mbit", "2gbit") for cap in (4.0, 16.0) for overlap in (True, False)]
    _result(tmp_path, "simulate_validate", "simulate_validate", points=points, source={"hosts": 2, "rate": "1gbit",
                                                                                      "cap": 4.0},
            per_impl={"torch-c10d": {"median_abs_error": 0.0, "worst_abs_error": 0.0, "points": len(points)}},
            worst_predict_s=0.001, models={})
    md, _ = _report(tmp_path)
    assert "## Overlap against bandwidth (emulated cluster: 2 hosts x 1 rank(s), 400mbit, 1gbit and unlimited " \
           "links)" in md, md
    assert "| 400mbit | 20.0 % |" in md
    assert ("Each point of the grid (links 500mbit and 2gbit x bucket caps 4 and 16 MB x overlap on and off, 2 "
            "hosts) predicted") in md, md
    assert "3 hosts" not in md
