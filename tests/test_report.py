"""Experiments on a tiny model, then the report built from their JSON."""

from __future__ import annotations

import json
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
            "jax-hooked (no overlap)", "jax-compiled", "torch-local", "jax-local"} <= labels
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
    assert "no results under" in proc.stderr
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
