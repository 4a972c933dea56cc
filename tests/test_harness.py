"""The harness below experiments/ and comparisons/, single process: the package boundaries,
config parsing, result files, the adapter's workloads (milliseconds each)."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.adapter import Workload
from harness.config import parse_config
from harness.results import read_result, write_result

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Top-level module names a file imports (anywhere in it, lazy imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_entry_points_are_leaves_and_the_library_never_imports_the_harness():
    for folder in ("experiments", "comparisons"):
        for path in (ROOT / folder).glob("*.py"):
            bad = {m for m in _imports(path) if m.split(".")[0] in ("experiments", "comparisons")}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}: entry points import harness/, not each other"
    for path in (ROOT / "harness").glob("*.py"):
        bad = {m for m in _imports(path) if m.split(".")[0] in ("experiments", "comparisons")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the harness sits below the entry points"
    for path in (ROOT / "portddp").rglob("*.py"):
        if path.name == "cli.py":
            continue  # dispatches to them lazily (next test)
        bad = {m for m in _imports(path) if m.split(".")[0] in ("experiments", "comparisons", "harness")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the library must not depend on the harness"


def test_cli_imports_no_harness_until_a_subcommand_needs_it():
    code = ("import sys, portddp.cli; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('experiments', 'comparisons', 'harness')); print(bad); assert not bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_only_the_library_is_installed():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["portddp*"]' in text


@dataclasses.dataclass
class _Config:
    steps: int = dataclasses.field(default=5, metadata={"help": "optimizer steps"})
    caps: tuple[float, ...] = dataclasses.field(default=(1.0, 4.0), metadata={"help": "caps"})
    sweep: bool = dataclasses.field(default=True, metadata={"help": "sweep"})


def test_parse_config_has_a_flag_per_field():
    assert parse_config(_Config, []) == _Config()
    assert parse_config(_Config, ["--steps", "3", "--caps", "2", "8", "--no-sweep"]) == _Config(3, (2.0, 8.0), False)


def test_results_are_written_whole_and_read_back_with_their_version(tmp_path):
    path = write_result(tmp_path / "sub" / "x.json", {"portddp_version": "9.9", "rows": [1]})
    assert json.loads(path.read_text())["rows"] == [1] and not list(path.parent.glob("*.tmp"))
    assert read_result(path, "9.9")["rows"] == [1]
    with pytest.raises(ValueError, match="written by portddp 9.9"):
        read_result(path, "0.1")


def test_workloads_data_and_models():
    bench = Workload(width=16, depth=2, batch=4)
    x, y = bench.batch_for(0, 1)
    assert bench.regression and x.shape == y.shape == (4, 16)
    gx, _ = bench.batch_for(0, 1, world_size=3)  # the global batch: every rank's, in rank order
    assert gx.shape == (12, 16) and np.array_equal(gx[4:8], x)
    tiny = Workload(model="mlp", size="tiny", batch=4, dtype="float64")
    x, y = tiny.batch_for(2, 0)
    assert not tiny.regression and x.shape == (4, 64) and x.dtype == np.float64 and y.dtype == np.int64
    gelu = Workload(width=32, depth=3, activation="gelu")
    assert "GELU" in gelu.describe() and gelu.torch_model().act.__name__ == "gelu"
    gpt = Workload(model="gpt", size="tiny", batch=2)
    assert gpt.batch_for(0, 0)[0].shape == (2, gpt.block_size)


@pytest.mark.parametrize("field,value,message", [("model", "resnet", "unknown model 'resnet'"),
                                                 ("optimizer", "lamb", "unknown optimizer 'lamb'"),
                                                 ("activation", "tanh", "unknown activation 'tanh'")])
def test_workload_refuses_unknown_values(field, value, message):
    with pytest.raises(SystemExit, match=message):
        Workload(**{field: value}).validate()


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "--rounds 0 measures nothing (the timed steps come from the interleaved rounds): pass "
                        "--rounds 1 or more"),
    (["--rounds", "-1"], "--rounds -1 measures nothing"),
    (["--steps-per-round", "0"], "--steps-per-round 0 measures nothing (each round times that many steps per "
                                 "variant): pass --steps-per-round 1 or more"),
    (["--warmup", "-1"], "--warmup -1 is not a number of untimed steps per variant (0: none): pass --warmup 0 or more"),
    (["--warmup-rounds", "-2"], "--warmup-rounds -2 is not a number of untimed rounds"),
    (["--ranks", "-1"], "--ranks -1 is not a number of ranks the run must have (0: any): pass --ranks 0 or more")])
def test_experiment_refuses_a_schedule_that_measures_nothing_before_anything_starts(argv, message, monkeypatch):
    """(--rounds 0 wrote a result of NaN medians over a good one; --steps-per-round 0 ended in a
    ZeroDivisionError.) Refused on every rank alike, before portddp.init or any model."""
    from harness import runner  # noqa: PLC0415

    def started(*_, **__):
        raise AssertionError("the experiment started")

    monkeypatch.setattr(runner.portddp, "init", started)
    monkeypatch.setattr(runner.malloc, "keep_freed_memory", started)
    cfg = parse_config(runner.ExperimentConfig, argv)
    with pytest.raises(SystemExit) as exit_:
        runner.run("overlap", cfg, started)
    assert str(exit_.value.code).startswith(message) and "\n" not in str(exit_.value.code), exit_.value.code


@pytest.mark.parametrize("module,argv,message", [
    ("overlap", ["--bucket-cap-mb", "-1"], "--bucket-cap-mb -1 is not a bucket size: pass megabytes > 0, e.g. "
                                           "--bucket-cap-mb 4 (inf: one bucket per dtype)"),
    ("overlap", ["--bucket-cap-mb", "nan"], "--bucket-cap-mb nan is not a bucket size"),
    ("bucket_sweep", ["--caps", "1", "0"], "--caps 0 is not a bucket size")])
def test_experiment_refuses_a_bad_bucket_cap_in_one_line(module, argv, message, monkeypatch):
    """(Was a traceback on every rank from DistributedDataParallel's check, once the run had started.)"""
    import importlib  # noqa: PLC0415

    from harness import runner  # noqa: PLC0415

    def started(*_, **__):
        raise AssertionError("the experiment started")

    monkeypatch.setattr(runner.portddp, "init", started)
    cfg = parse_config(importlib.import_module(f"experiments.{module}").Config, argv)
    with pytest.raises(SystemExit) as exit_:
        runner.run(module, cfg, started)
    assert str(exit_.value.code).startswith(message), exit_.value.code


def test_bench_refuses_negative_mlp_rounds():
    from experiments.bench import Config  # noqa: PLC0415

    with pytest.raises(SystemExit, match="--mlp-rounds -1 is not a number of rounds: pass --mlp-rounds 1 or more"):
        Config(mlp_rounds=-1).validate_schedule()
    Config(mlp_rounds=0).validate_schedule()  # 0: as many as --rounds


def test_a_row_records_the_events_of_its_median_iteration():
    """portddp.simulate fits the link on one iteration's bucket durations: the row keeps the median
    iteration's events (was: the last iteration's, an outlier in a noisy run skewed the fit)."""
    from harness.runner import _median_events  # noqa: PLC0415
    from portddp.timeline import IterationEvents  # noqa: PLC0415

    events = [IterationEvents(rank=0, forward_start_ns=k, finalize_end_ns=k + 1) for k in range(5)]
    times = [0.5, 0.1, 0.3, 9.0, 0.2]  # the last iteration but one is the outlier; the median is 0.3
    assert _median_events(times, [{"events": e, "iteration_time": 1.0} for e in events]) is events[2]
    assert _median_events(times, [{} for _ in events]) is None  # (native: no events of its own)
    assert _median_events([], []) is None


def test_a_compiled_row_keeps_its_median_steps_span_too():
    """jax-compiled's one span per step (XLA schedules its collectives inside the program) comes with
    each step's stats, so the row keeps the median step's, as the others' (a review: its Gantt bar was
    the last step's, 7978 ms under a title saying 6550.9 ms, the median)."""
    from tests import mpi  # noqa: PLC0415

    code = ("import portddp\nfrom harness.adapter import Workload, make_trainer\n"
            "t = make_trainer('jax-compiled', Workload(model='mlp', size='tiny'), portddp.init(jax_distributed=True))\n"
            "for _ in range(3):\n"
            "    took = t.step()\n"
            "    e = t.stats()['events']\n"
            "    print('SPAN', took, (e.finalize_end_ns - e.forward_start_ns) / 1e9, flush=True)\n")
    proc = subprocess.run([mpi.mpirun_path(), "-n", "1", sys.executable, "-c", code], cwd=mpi.ROOT,
                          capture_output=True, text=True, timeout=240)
    spans = [tuple(map(float, line.split()[1:])) for line in proc.stdout.splitlines() if line.startswith("SPAN")]
    assert len(spans) == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    for took, span in spans:
        assert span == pytest.approx(took, abs=1e-6)


@pytest.mark.parametrize("module,argv,message", [
    ("experiments.no_sync", ["--every", "2", "0"], "--every 0: pass 1 or more (micro-batches per sync)"),
    ("experiments.overlap", ["--batch", "0"], "--batch 0: pass 1 or more"),
    ("experiments.overlap", ["--lr", "-0.5"], "--lr -0.5: pass 0 or more"),
    ("experiments.overlap", ["--lr", "nan"], "--lr nan: pass 0 or more"),
    ("comparisons.equivalence", ["--steps", "0"], "--steps 0: pass 1 or more (optimizer steps)"),
    ("comparisons.equivalence", ["--global-batch", "0"], "--global-batch 0: pass 1 or more"),
    ("comparisons.equivalence", ["--bucket-cap-mb", "-1"], "--bucket-cap-mb -1.0: pass more than 0"),
    ("comparisons.equivalence", ["--bucket-cap-mb", "nan"], "--bucket-cap-mb nan: pass more than 0"),
    ("comparisons.mixed", ["--steps", "-1"], "--steps -1: pass 1 or more")])
def test_values_that_would_measure_or_compare_nothing_are_refused_at_parse(module, argv, message, capsys):
    """(--every 0 ended in an UnboundLocalError; --steps 0 made the equivalence harness print EQUIVALENT
    over nothing, --global-batch 0 trained 1 sample per rank; --bucket-cap-mb -1 and --lr -1 were
    tracebacks from DistributedDataParallel and torch.optim.)"""
    import importlib  # noqa: PLC0415

    with pytest.raises(SystemExit) as exit_:
        parse_config(importlib.import_module(module).Config, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_an_output_directory_that_is_a_file_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """(--out-dir on a file failed with FileExistsError after the whole measurement -- ~10 minutes of
    bench; report --out and --results on a file were tracebacks or 'no results'.)"""
    from comparisons import report  # noqa: PLC0415
    from harness import runner  # noqa: PLC0415
    from harness.results import out_dir_problem  # noqa: PLC0415

    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert out_dir_problem(tmp_path / "new" / "dir", "--out") is None
    assert out_dir_problem(a_file / "sub", "--out") == (f"--out {a_file / 'sub'} lies under {a_file}, which is a "
                                                        "file: pass a directory (made if missing)")

    def started(*_, **__):
        raise AssertionError("the experiment started")

    monkeypatch.setattr(runner.portddp, "init", started)
    cfg = parse_config(runner.ExperimentConfig, ["--out-dir", str(a_file)])
    with pytest.raises(SystemExit, match=f"--out-dir {a_file} is a file: pass a directory"):
        runner.run("overlap", cfg, started)
    for argv, message in (([ "--results", str(a_file)], "is a file: pass the directory the experiments wrote"),
                          (["--results", str(tmp_path / "none")], "(it does not exist): run the experiments first"),
                          (["--results", str(tmp_path), "--out", str(a_file)], f"--out {a_file} is a file")):
        with pytest.raises(SystemExit) as exit_:
            report.main(argv)
        assert exit_.value.code == 2, argv


def test_the_mixed_job_refuses_a_single_rank():
    from comparisons import mixed  # noqa: PLC0415

    with pytest.raises(SystemExit, match="the mixed job needs 2 or more ranks"):
        mixed.main(["--steps", "1"])


def test_long_groups_say_where_they_are_while_building_warming_up_and_timing():
    """A line at most every 20 s, from the group's start: building and warming up included (a review:
    the demo's gpt group said nothing for 4-5 minutes after 'building and warming up')."""
    from harness.runner import _heartbeat  # noqa: PLC0415

    said = []
    beat = _heartbeat(lambda line, flush: said.append(line), every_s=0.0)
    beat("torch-c10d built")
    beat("torch-c10d: warm-up step 1/2")
    beat("round 1/3")
    assert [line.split(" (")[0].strip() for line in said] == ["torch-c10d built", "torch-c10d: warm-up step 1/2",
                                                            "round 1/3"]
    assert all(line.endswith("s so far)") for line in said)
    quiet = []
    beat = _heartbeat(lambda line, flush: quiet.append(line))
    beat("round 1/3")
    assert quiet == []  # (a short group: no line)
