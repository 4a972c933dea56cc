"""The benchmark: every implementation side by side, per model, in one run.

    mpirun -n 2 python -m experiments.bench                # or: portddp run bench -n 2
    mpirun -n 2 python -m experiments.bench --models mlp --rounds 5

For the benchmark MLP (8 x Linear(1024, 1024), batch 64 per rank), issue 16's
second MLP (`gelu-mlp`: 6 x Linear(1280, 1280) + GELU, batch 48 per rank) and
the ~25M parameter `gpt` twin: the step with no communication (torch-local,
jax-local: the limits), native DDP (Gloo), portddp.torch (c10d; mpi; mpi with
gradient_as_bucket_view), native DDP again (an A/A check: how far this run can
tell two equal steps apart), portddp.jax (hooked, compiled). Warm-up, then
interleaved rounds (noise hits every implementation alike: 8 on gpt, 30 on the
MLPs, whose steps are short); per-iteration medians (a step's time is its
slowest rank's: a synchronous step cannot beat that, so neither can a limit,
which rank 0's alone would understate when the other rank is slower), ratios to
native DDP and to the framework's own limit, overlap ratio, exposed
communication, CPU seconds per iteration per rank (all threads, and split: the
main thread, the comm threads -- portddp's MPI comm thread, Gloo's --, XLA's
named pools, the rest: a comm thread that spins shows up here, not in the
time), the memory holding gradients after a step (every distinct .grad storage
plus portddp's bucket buffers), and the peak resident memory each one added
while it was built and warmed up (Linux VmHWM; memory an earlier variant freed
can be reused, so read it as approximate). Then, on the MLP, a fixed-cap sweep
beside bucket_cap_mb="auto". JSON in results/bench-n<N>.json (the ratios and
the headline included: the report only reads it); the last line holds the
headline ratios (each the worst over the models).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from harness import runner
from harness.runner import GPT_BATCH, MODELS, VIEW_OF, bench_model_fields
from harness.adapter import IMPLEMENTATIONS
from harness.config import parse_config
from harness.results import write_result
from portddp.autotune import CANDIDATES_MB, CapTuner

TORCH_DDP = ("torch-c10d", "torch-mpi", "torch-mpi+view")
HEADLINE = ("torch_c10d_vs_native", "torch_best_vs_native", "torch_best_vs_limit", "jax_hooked_vs_limit",
            "jax_hooked_overlap")


@dataclasses.dataclass
class Config(runner.ExperimentConfig):
    models: tuple[str, ...] = dataclasses.field(default=tuple(MODELS), metadata={"help": "of " + ", ".join(MODELS)})
    impls: tuple[str, ...] = dataclasses.field(default=IMPLEMENTATIONS, metadata={"help": "implementations (torch-mpi: with and without gradient_as_bucket_view; "
                                                       "torch-mpi+view: with only)"})
    gpt_batch: int = dataclasses.field(default=GPT_BATCH, metadata={"help": "gpt: sequences per rank per step"})
    sweep: bool = dataclasses.field(default=True, metadata={"help": "the MLP's fixed-cap sweep beside 'auto'"})
    native_again: bool = dataclasses.field(
        default=True, metadata={"help": "native DDP a second time, after the portddp.torch rows (native-again): an "
                                        "A/A check, whose ratio to native is how far this run can tell two equal "
                                        "steps apart"})
    split_frameworks: bool = dataclasses.field(
        default=False, metadata={"help": "time PyTorch and JAX variants in separate groups (half the models in "
                                         "memory at once: for many ranks on one host; ratios stay within a group)"})
    sweep_impls: tuple[str, ...] = dataclasses.field(default=("torch-mpi", "jax-hooked"),
                                                     metadata={"help": "implementations in the sweep"})
    rounds: int = dataclasses.field(
        default=8, metadata={"help": "interleaved rounds (gpt's, the sweep's; each gpt round ~20 s: its ratios move "
                                     "~4 %% from round to round)"})
    mlp_rounds: int = dataclasses.field(
        default=30, metadata={"help": "interleaved rounds on the MLPs (0: --rounds): their steps are ~10x shorter than "
                                      "gpt's, so four times the samples still take a fraction of gpt's time (two Gloo "
                                      "rows' ratio spreads ~1/sqrt(2) as far from run to run as with 15)"})
    steps_per_round: int = dataclasses.field(default=3, metadata={"help": "timed steps per variant per round"})
    warmup: int = dataclasses.field(default=6, metadata={"help": "untimed steps per variant (JAX compiles here)"})
    warmup_rounds: int = dataclasses.field(
        default=1, metadata={"help": "untimed interleaved rounds before the timed ones (the first rounds of a run "
                                     "fault pages back in that another variant's steps handed back)"})

    def implementations(self) -> set[str]:  # the cap sweep builds its own implementations too
        return {*(VIEW_OF.get(i, i) for i in self.impls), *(self.sweep_impls if self.sweep else ())}

    def validate_schedule(self) -> None:
        super().validate_schedule()
        if self.mlp_rounds < 0:
            raise SystemExit(f"--mlp-rounds {self.mlp_rounds} is not a number of rounds: pass --mlp-rounds 1 or more "
                             "(0: as many as --rounds)")
        if self.gpt_batch < 1:
            raise SystemExit(f"--gpt-batch {self.gpt_batch}: at least one sequence per rank: pass --gpt-batch 1 "
                             "or more")


def _auto_warmup() -> int:
    """Steps 'auto' needs before its choice is made (portddp.autotune's schedule), plus one."""
    return CapTuner().iterations + 1


def variants(cfg: Config, world):
    unknown = [m for m in cfg.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}: choose from {tuple(MODELS)}")
    for model in cfg.models:
        shape = bench_model_fields(model, cfg.gpt_batch)
        for label, impl, knobs in (
            ("torch-local", "torch-local", {}),
            ("native", "native", {}),
            ("torch-c10d", "torch-c10d", {}),
            ("torch-mpi", "torch-mpi", {}),
            ("torch-mpi+view", "torch-mpi", {"gradient_as_bucket_view": True}),
            *((("native-again", "native", {}),) if cfg.native_again else ()),
            ("jax-local", "jax-local", {}),
            ("jax-hooked", "jax-hooked", {}),
            ("jax-compiled", "jax-compiled", {}),
        ):
            if impl not in cfg.impls and label not in cfg.impls:  # (torch-mpi+view alone: its label)
                continue
            group = f"{model} ({impl.split('-')[0] if impl != 'native' else 'torch'})" if cfg.split_frameworks \
                else model
            yield runner.Variant(label, impl, knobs, group=group, params={"model": model}, model=shape,
                                 rounds=(cfg.mlp_rounds or None) if model != "gpt" else None)
    if cfg.sweep:
        for impl in cfg.sweep_impls:
            for cap in CANDIDATES_MB:
                yield runner.Variant(f"{impl} @ {cap:g} MB", impl, {"bucket_cap_mb": cap}, group="mlp: caps",
                                     params={"bucket_cap_mb": cap}, model=MODELS["mlp"])
            yield runner.Variant(f"{impl} @ auto", impl, {"bucket_cap_mb": "auto"}, group="mlp: caps",
                                 params={"bucket_cap_mb": "auto"}, model=MODELS["mlp"],
                                 warmup=_auto_warmup())


def per_round(times: list[float], ref: list[float], k: int) -> list[float]:
    """The ratio of the two variants' medians in each round (k timed steps of each per round,
    in order): how far one run's ratio of medians moves from round to round."""
    n = min(len(times), len(ref)) // k * k
    return [statistics.median(times[i:i + k]) / statistics.median(ref[i:i + k]) for i in range(0, n, k)]


def bootstrap_se(times: list[float], ref: list[float], k: int, resamples: int = 400, seed: int = 0) -> float:
    """The standard error, within this run, of the ratio of the two variants' medians: its
    standard deviation over `resamples` redraws of the run's rounds with replacement (a round's
    steps of both variants drawn together: they ran side by side; a fixed seed, so a run's
    JSON always says the same). A ratio less than about two of these from a target can read
    on either side of it in another run of the same code. NaN with fewer than 2 rounds."""
    import numpy as np  # noqa: PLC0415

    n = min(len(times), len(ref)) // k
    if n < 2:
        return math.nan
    a, b = (np.asarray(x[:n * k], dtype=float).reshape(n, k) for x in (times, ref))
    rounds = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ratios = np.median(a[rounds].reshape(resamples, -1), axis=1) / np.median(b[rounds].reshape(resamples, -1), axis=1)
    return float(np.std(ratios, ddof=1))


SPREAD = {"torch_c10d_vs_native": ("torch-c10d", "native"), "torch_best_vs_limit": (None, "torch-local"),
          "jax_hooked_vs_limit": ("jax-hooked", "jax-local"), "native_again_vs_native": ("native-again", "native")}
"""The headline ratios whose per-round range and standard error each model's line shows (None: the
best torch row)."""


def summarise(rows: list[dict], steps_per_round: int = 3) -> tuple[dict, list[tuple[str, dict]]]:
    """Per model: each row's ratios to native DDP and to its framework's limit (written into
    the rows); the headline (worst over models); the range over the rounds of the headline's
    ratios (`<key>_rounds`: [lowest, highest]) and their standard error within the run
    (`<key>_se`, bootstrap_se); and the sweep's auto-vs-best-fixed ratios."""
    headline: dict[str, float] = {}
    tables = []
    for model in dict.fromkeys(r["params"]["model"] for r in rows if "model" in r["params"]):
        by = {r["label"]: r for r in rows if r["params"].get("model") == model}
        med = {k: r["median_s"] for k, r in by.items()}
        cpu = {k: (r.get("cpu") or {}).get("total") for k, r in by.items()}
        for label, r in by.items():
            limit_label = "jax-local" if label.startswith("jax") else "torch-local"
            limit = med.get(limit_label)
            r["vs_native"] = r["median_s"] / med["native"] if "native" in med else math.nan
            r["vs_limit"] = r["median_s"] / limit if limit else math.nan
            # The same ratios of CPU per iteration (all threads): steadier than those of time on a
            # shared machine, and blind to waiting -- the two together say which one a DDP costs.
            r["cpu_vs_native"] = _ratio(cpu[label], cpu.get("native"))
            r["cpu_vs_limit"] = _ratio(cpu[label], cpu.get(limit_label))
        best = min((label for label in TORCH_DDP if label in by), key=lambda k: med[k], default=None)
        mine = {}
        if "torch-c10d" in by:
            mine["torch_c10d_vs_native"] = by["torch-c10d"]["vs_native"]
        if best:
            mine |= {"torch_best_vs_native": by[best]["vs_native"], "torch_best_vs_limit": by[best]["vs_limit"],
                     "torch_best": best}
        if "jax-hooked" in by:
            mine |= {"jax_hooked_vs_limit": by["jax-hooked"]["vs_limit"],
                     "jax_hooked_overlap": by["jax-hooked"]["metrics"].get("overlap_ratio", math.nan)}
        # The same two ratios as rank 0 alone measured them (a rank slower by itself raises a
        # communicating variant's time, not rank 0's limit: the gap is that rank's).
        for key, label, ref in (("torch_best_vs_limit_rank0", best, "torch-local"),
                                ("jax_hooked_vs_limit_rank0", "jax-hooked", "jax-local")):
            if label in by and ref in by and "rank0_median_s" in by[ref]:
                mine[key] = by[label]["rank0_median_s"] / by[ref]["rank0_median_s"]
        if "native-again" in by and "native" in by:  # the A/A check: the same step twice
            mine["native_again_vs_native"] = by["native-again"]["vs_native"]
        if "torch-c10d" in by:
            mine["cpu_torch_c10d_vs_native"] = by["torch-c10d"]["cpu_vs_native"]
        if best:
            mine["cpu_torch_best_vs_limit"] = by[best]["cpu_vs_limit"]
        if "jax-hooked" in by:
            mine["cpu_jax_hooked_vs_limit"] = by["jax-hooked"]["cpu_vs_limit"]
        for key, (label, ref) in SPREAD.items():
            label = label or best
            if label in by and ref in by:
                ratios = per_round(by[label]["times_s"], by[ref]["times_s"], steps_per_round)
                if ratios:
                    mine[f"{key}_rounds"] = [min(ratios), max(ratios)]
                    mine[f"{key}_se"] = bootstrap_se(by[label]["times_s"], by[ref]["times_s"], steps_per_round)
        tables.append((model, mine))
        for k in HEADLINE:  # the worst model decides: "overlap" is better high, the rest low
            if k in mine:
                worse = min if k.endswith("overlap") else max
                headline[k] = worse(headline.get(k, mine[k]), mine[k])
    sweep = [r for r in rows if r["group"] == "mlp: caps"]
    for impl in dict.fromkeys(r["impl"] for r in sweep):
        fixed = [r for r in sweep if r["impl"] == impl and r["params"]["bucket_cap_mb"] != "auto"]
        auto = [r for r in sweep if r["impl"] == impl and r["params"]["bucket_cap_mb"] == "auto"]
        if fixed and auto:
            best = min(fixed, key=lambda r: r["median_s"])
            key = impl.replace("-", "_") + "_auto_vs_best_fixed"
            headline[key] = auto[0]["median_s"] / best["median_s"]
            auto[0]["vs_best_fixed"] = headline[key]
            auto[0]["best_fixed_mb"] = best["params"]["bucket_cap_mb"]
    return headline, tables


def _ratio(a, b) -> float:
    return a / b if a is not None and b else math.nan


CPU_COLUMNS = ("CPU ms", "main", "comm", "xla", "other")
"""CPU milliseconds per iteration per rank (mean over ranks): all threads, then by group (harness.measure)."""


def cpu_cells(row: dict, fmt) -> list[str]:
    cpu = row.get("cpu") or {}
    return [fmt(cpu[k] * 1e3) if k in cpu else fmt(None) for k in ("total", "main", "comm", "xla", "other")]


def print_tables(payload: dict, headline: dict, tables) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=200)
    for group in dict.fromkeys(r["group"] for r in payload["rows"]):
        steps = len(next(r for r in payload["rows"] if r["group"] == group)["times_s"])
        table = Table(title=f"{group} -- {payload['world']['size']} ranks, medians over {steps} steps")
        for col in ("implementation", "iteration ms", "vs native", "vs limit", "overlap ratio", "exposed comm ms",
                    *CPU_COLUMNS, "grad MB", "peak MB", "cap MB"):
            table.add_column(col, justify="right")
        for r in (r for r in payload["rows"] if r["group"] == group):
            m = r["metrics"]

            def num(x, fmt):
                return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

            cap = r["params"].get("bucket_cap_mb") or m.get("bucket_cap_mb")
            if r.get("auto"):
                cap = f"auto->{r['auto'].get('chosen_mb')}"
            table.add_row(r["label"], num(r["median_s"] * 1e3, ".1f"), num(r.get("vs_native"), ".3f"),
                          num(r.get("vs_limit", r.get("vs_best_fixed")), ".3f"), num(m.get("overlap_ratio"), ".2f"),
                          num(m.get("exposed_comm_time", math.nan) * 1e3, ".1f"),
                          *cpu_cells(r, lambda x: num(x, ".1f")), num(r.get("grad_mb"), ".0f"),
                          num(r.get("peak_mb"), ".0f"),
                          str(cap if cap is not None else "-"))
        console.print(table)
    for model, mine in tables:
        print(f"{model}: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                                      f"{k}={v[0]:.3f}-{v[1]:.3f}" if isinstance(v, list) else f"{k}={v}"
                                      for k, v in mine.items()))
    print(" ".join(f"{k}={v:.3f}" for k, v in headline.items()), flush=True)


def main(argv=None):
    cfg = parse_config(Config, argv, __doc__.split("\n\n")[0])
    payload = runner.run("bench", cfg, variants)
    headline, tables = summarise(payload["rows"], cfg.steps_per_round)
    payload["headline"] = headline
    payload["models"] = dict(tables)
    if payload["world"]["rank"] == 0:
        write_result(payload["path"], payload)
        print_tables(payload, headline, tables)
    return payload


if __name__ == "__main__":
    main()
