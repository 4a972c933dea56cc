"""Build the research report from result JSON: Markdown, self-contained HTML, PNG plots.

    python -m comparisons.report --results results --out reports/latest

Reads whatever is there -- experiments/*.py outputs (bench, overlap, bucket_sweep,
no_sync, compression, scaling-n*, bandwidth, simulate_validate),
comparisons.equivalence result.json files -- and nothing else (no experiment
code is imported: every number it shows is in the JSON), and writes report.md, report.html (plots embedded) and the PNGs. A file from
another portddp version or with missing fields is reported by name and skipped.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import json
import math
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import portddp
from harness.results import out_dir_problem

PAPER_OVERLAP = {  # DDP paper (arXiv:2006.15704) §5.1: speedup from overlapping, per backend
    "ResNet50, NCCL": 38.0, "BERT, NCCL": 35.2, "ResNet50, Gloo": 26.8, "BERT, Gloo": 21.5}
EXPERIMENTS = ("bench", "overlap", "bucket_sweep", "no_sync", "compression", "scaling", "bandwidth",
               "simulate_validate")
HOP_ASSUMED_S = 10e-6  # what-if curves: the latency of one ring step (not measurable with 2 hosts)
_EQUIVALENCE_OUT = "results/equivalence"  # comparisons.equivalence's default --out (its commands omit it)
READ_FROM = "_read_from"  # load() notes in each payload the file it came from: a section that cannot use it names it
COLORS = {"native": "#1f77b4", "torch-c10d": "#ff7f0e", "torch-mpi": "#2ca02c", "jax-hooked": "#d62728",
          "jax-compiled": "#9467bd", "torch-local": "#8c564b", "jax-local": "#7f7f7f"}


def load(results: Path) -> tuple[dict, list[dict], list[str]]:
    """{experiment: [payloads]}, [equivalence results], [problems found, by file]."""
    found: dict[str, list] = {}
    problems = []
    for path in sorted(results.glob("*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"{path}: unreadable ({e})")
            continue
        name = payload.get("experiment")
        if name is None:
            continue  # the demos' own files
        if payload.get("portddp_version") != portddp.__version__:
            problems.append(f"{path}: written by portddp {payload.get('portddp_version')}, this is "
                            f"{portddp.__version__}; rerun the experiment")
            continue
        if name not in EXPERIMENTS or not ({"rows", "runs", "points"} & set(payload)):
            problems.append(f"{path}: not a known experiment result (experiment={name!r})")
            continue
        payload[READ_FROM] = str(path)
        found.setdefault(name, []).append(payload)
    equivalence = []
    for path in sorted(results.glob("equivalence/*/result.json")):
        try:
            equivalence.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            problems.append(f"{path}: unreadable ({e})")
    return found, equivalence, problems


# ------------------------------------------------------------------- plots
def _pyplot():
    """matplotlib's pyplot without a display."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def plot_gantt(payload: dict, out: Path) -> Path | None:
    plt = _pyplot()

    rows = [r for r in payload["rows"] if r.get("events") and r["params"].get("overlap") is not False]
    if not rows:
        return None
    # One time axis for every panel: their lengths compare at a glance.
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.5 + 1.1 * len(rows)), squeeze=False, sharex=True)
    for ax, row in zip(axes[:, 0], rows):
        ev = row["events"]
        t0 = ev["forward_start_ns"]

        def ms(ns, t0=t0):
            return (ns - t0) / 1e6

        if not ev["forward_end_ns"]:  # compiled: XLA schedules compute and all-reduces in one program
            ax.broken_barh([(0, ms(ev["finalize_end_ns"]))], (10, 8), color="#9467bd")
            ax.text(1, 14, "one XLA program: compute and all-reduces scheduled by XLA (not visible from the host)",
                    va="center", fontsize=8, color="white")
            ax.set_yticks([4, 14], ["comm", "compute"])
            ax.set_title(f"{row['label']}: {row['median_s'] * 1e3:.1f} ms/iteration (median)", fontsize=9, loc="left")
            ax.set_xlim(left=0)
            continue
        ax.broken_barh([(0, ms(ev["forward_end_ns"]))], (10, 8), color="#9e9e9e", label="forward")
        ax.broken_barh([(ms(ev["forward_end_ns"]), ms(ev["backward_end_ns"]) - ms(ev["forward_end_ns"]))], (10, 8),
                       color="#1f77b4", label="backward")
        for b in ev["buckets"]:
            if b["launch_ns"] and b["done_ns"]:
                ax.broken_barh([(ms(b["launch_ns"]), max(0.05, ms(b["done_ns"]) - ms(b["launch_ns"])))], (0, 8),
                               color="#ff7f0e" if b["index"] % 2 == 0 else "#d62728")
                ax.text(ms(b["launch_ns"]), 4, str(b["index"]), va="center", fontsize=7, color="white")
        ax.set_yticks([4, 14], ["comm", "compute"])
        ax.set_title(f"{row['label']}: {row['median_s'] * 1e3:.1f} ms/iteration (median); "
                     f"overlap ratio {row['metrics'].get('overlap_ratio', 0):.2f}", fontsize=9, loc="left")
        ax.set_xlim(left=0)
    end = max((r["events"]["finalize_end_ns"] or 0) - r["events"]["forward_start_ns"] for r in rows) / 1e6
    axes[-1, 0].set_xlim(0, max(end, axes[-1, 0].get_xlim()[1]))
    axes[-1, 0].set_xlabel("ms since forward start (one steady-state iteration, rank 0; numbers: bucket index)")
    from matplotlib.patches import Patch  # noqa: PLC0415

    fig.legend(handles=[Patch(color="#9e9e9e", label="forward"), Patch(color="#1f77b4", label="backward"),
                        Patch(color="#ff7f0e", label="bucket all-reduce (alternate colours: neighbouring buckets)"),
                        Patch(color="#9467bd", label="one XLA program")],
               loc="upper right", fontsize=7, ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return _save(plt, fig, out / f"gantt{_where_suffix(payload)}.png")


def plot_buckets(payload: dict, out: Path) -> Path | None:
    plt = _pyplot()

    by_impl: dict[str, list] = {}
    for r in payload["rows"]:
        by_impl.setdefault(r["impl"], []).append(r)
    if not by_impl:
        return None
    caps = sorted({r["params"]["bucket_cap_mb"] for r in payload["rows"]})
    finite = [c for c in caps if not math.isinf(c)]
    one = (max(finite) * 4) if finite else 1.0  # where "one bucket" is drawn

    def x(c):
        return one if math.isinf(c) else c

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for impl, rows in by_impl.items():
        rows = sorted(rows, key=lambda r: x(r["params"]["bucket_cap_mb"]))
        xs = [x(r["params"]["bucket_cap_mb"]) for r in rows]
        a1.plot(xs, [r["median_s"] * 1e3 for r in rows], marker="o", label=impl, color=COLORS.get(impl))
        if any("overlap_ratio" in r["metrics"] for r in rows):
            a2.plot(xs, [r["metrics"].get("overlap_ratio", float("nan")) for r in rows], marker="o", label=impl,
                    color=COLORS.get(impl))
    for ax, ylabel in ((a1, "median ms / iteration"), (a2, "overlap ratio")):
        ax.set_xscale("log", base=2)
        ticks = [x(c) for c in caps]
        ax.set_xticks(ticks, ["one" if math.isinf(c) else f"{c:g}" for c in caps])
        ax.set_xlabel("bucket cap (MB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    a2.set_ylim(0, 1.05)
    fig.tight_layout()
    return _save(plt, fig, out / "bucket_sweep.png")


def plot_scaling(payloads: list[dict], out: Path) -> Path | None:
    plt = _pyplot()

    points = {}
    for p in payloads:
        for r in p["rows"]:
            points.setdefault(r["impl"], {})[p["world"]["size"]] = r["median_s"]
    if not points:
        return None
    worlds = sorted({w for v in points.values() for w in v})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(points)
    for k, (impl, by_world) in enumerate(sorted(points.items())):
        ax.bar([i + k * width for i in range(len(worlds))], [by_world.get(w, 0) * 1e3 for w in worlds], width,
               label=impl, color=COLORS.get(impl))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(worlds))], [f"{w} rank(s)" for w in worlds])
    ax.set_ylabel("median ms / iteration (fixed batch per rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(plt, fig, out / "scaling.png")


def _where_suffix(payload: dict) -> str:
    c = payload.get("cluster")
    return f"-h{c['hosts']}-{c['link']}" if c else ""


def where(payload: dict, links: str | None = None) -> str:
    """Where a run ran: on loopback (one machine), or on the emulated cluster (at `links`, if given: a
    sweep's rates, else the run's own link)."""
    c = payload.get("cluster")
    if not c:
        why = payload.get("cluster_unavailable")
        return ("one machine, ranks over shared memory / loopback"
                + (f"; no emulated cluster could be made here: {why}" if why else ""))
    per = payload["world"]["size"] // c["hosts"]
    return f"emulated cluster: {c['hosts']} hosts x {per} rank(s), {links or c['link']} links"


def swept_links(runs: list[dict]) -> str:
    """The link rates a bandwidth sweep's runs had, slowest first ("250mbit, 1gbit and unlimited"):
    the section's title names what was measured, not only its first run's rate."""
    ordered = sorted(runs, key=lambda r: r["cluster"]["rate_bps"] or math.inf)
    return _and(list(dict.fromkeys(r["cluster"]["link"] for r in ordered)))


def _and(items: list) -> str:
    """'a', 'a and b', 'a, b and c'."""
    words = [str(i) for i in items]
    return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]])) if words else "none"


def _speedups(payload: dict) -> dict[str, float]:
    rows = {r["label"]: r for r in payload["rows"]}
    return {r["impl"]: rows[f"{r['impl']} (no overlap)"]["median_s"] / r["median_s"] - 1
            for r in payload["rows"] if r["params"].get("overlap") is True and f"{r['impl']} (no overlap)" in rows}


def plot_bandwidth(payload: dict, out: Path) -> Path | None:
    """Overlap speedup against link rate, per implementation, beside the DDP paper's figures."""
    plt = _pyplot()

    points: dict[str, list] = {}
    unlimited_x = None
    for run in payload["runs"]:
        rate = run["cluster"]["rate_bps"]
        for impl, sp in _speedups(run).items():
            points.setdefault(impl, []).append((rate, sp * 100))
    finite = [r for pts in points.values() for r, _ in pts if r]
    if not finite:
        return None
    unlimited_x = max(finite) * 2.5
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for impl, pts in sorted(points.items()):
        pts = sorted((r or unlimited_x, sp) for r, sp in pts)
        ax.plot([r / 1e6 for r, _ in pts], [sp for _, sp in pts], "o-", label=impl, color=COLORS.get(impl))
    for (name, value), style in zip(PAPER_OVERLAP.items(), ("--", "--", ":", ":")):
        ax.axhline(value, color="#999", linestyle=style, linewidth=0.8)
        ax.text(min(finite) / 1e6, value + 0.6, f"paper: {name} {value} %", fontsize=7, color="#666")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xscale("log")
    ticks = sorted({r for r in finite} | {unlimited_x})
    ax.set_xticks([t / 1e6 for t in ticks], [f"{t / 1e6:.0f}" if t != unlimited_x else "unlimited" for t in ticks])
    ax.set_xlabel("link rate per host and direction (Mbit/s)")
    ax.set_ylabel("overlap speedup: t(off) / t(on) - 1 (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(plt, fig, out / "bandwidth.png")


def wire_section(payload: dict) -> str:
    """On the cluster: each implementation's iteration beside the bound forward + max(backward, wire
    time), and the bytes its hosts sent per step beside what the plan implies."""
    c, n = payload["cluster"], payload["world"]["size"]
    rows = {r["label"]: r for r in payload["rows"]}
    body = []
    for r in payload["rows"]:
        if r["impl"].endswith("-local") or not r.get("param_bytes"):
            continue
        framework = "jax" if r["impl"].startswith("jax") else "torch"
        local = rows.get(f"{framework}-local")
        ref = rows.get("jax-hooked (no overlap)" if framework == "jax" else "torch-c10d (no overlap)")
        implied = r["param_bytes"] * 2 * (n - 1) / n  # a ring all-reduce: what each host sends per step
        wire_s = implied * 8 / c["rate_bps"] if c.get("rate_bps") else None
        bound = None
        if local and ref and wire_s is not None:
            bwd = ref["metrics"].get("backward_compute_time")
            if bwd:
                bound = local["median_s"] - bwd + max(bwd, wire_s)
        sent = r.get("wire_bytes_per_step")
        body.append([r["label"], f"{r['median_s'] * 1e3:.1f}", f"{bound * 1e3:.1f}" if bound else "–",
                     f"{r['median_s'] / bound:.2f}" if bound else "–",
                     f"{sent / 1e6:.1f}" if sent else "–", f"{implied / 1e6:.1f}",
                     f"{sent / implied:.3f}" if sent else "–"])
    return ("\n### On the wire\n\n" + table(
        ["variant", "ms / iteration", "bound (ms)", "vs bound", "MB sent per host per step",
         "MB the plan implies", "sent / implied"], body)
        + f"\n\nBound: the framework's step without communication, with its backward pass (measured, overlap "
          f"off) replaced by max(backward, wire time); wire time = the bytes a ring all-reduce of the gradients "
          f"makes each host send, 2(n-1)/n x gradient bytes, at {c['link']}. *Sent*: the host's interface "
          "counter over the timed steps (TCP/IP headers included, ~3-5 %), averaged over hosts. A transport "
          "that bypassed the link would show (almost) nothing here.\n")


def _bandwidth_title(payload: dict) -> str:
    runs = payload.get("runs") or [{}]
    try:
        return f"Overlap against bandwidth ({where(runs[0], swept_links(runs))})"
    except (KeyError, TypeError):  # (the section itself then says what the file lacks)
        return "Overlap against bandwidth"


def bandwidth_section(payload: dict) -> str:
    body = []
    for run in sorted(payload["runs"], key=lambda r: r["cluster"]["rate_bps"] or math.inf):
        sp = _speedups(run)
        body.append([run["cluster"]["link"]] + [f"{sp[i] * 100:.1f} %" if i in sp else "–"
                                                for i in ("torch-c10d", "torch-mpi", "jax-hooked")])
    cal = payload.get("calibration")
    note = (f" The matched rate came from a calibration run: backward compute "
            f"{cal['backward_compute_s'] * 1e3:.0f} ms and {cal['wire_bytes_per_step'] / 1e6:.1f} MB per host per "
            f"step on an unshaped link, so {cal['rate_mbit']} Mbit/s.") if cal else ""
    return (table(["link", "torch-c10d", "torch-mpi", "jax-hooked"], body)
            + "\n\nOverlap speedup t(off) / t(on) − 1 at each link rate, one fresh emulated cluster per rate "
              "(each run's full tables are in its own JSON)." + note + "\n")


def plot_prediction(payload: dict, out: Path) -> Path | None:
    """Predicted against measured step time, one point per grid point, per implementation."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = 0.0
    for impl in dict.fromkeys(p["impl"] for p in payload["points"]):
        pts = [p for p in payload["points"] if p["impl"] == impl]
        ax.scatter([p["measured_s"] * 1e3 for p in pts], [p["predicted_s"] * 1e3 for p in pts], s=18, label=impl,
                   color=COLORS.get(impl), marker="o")
        top = max(top, *(max(p["measured_s"], p["predicted_s"]) * 1e3 for p in pts))
    ax.plot([0, top * 1.05], [0, top * 1.05], color="black", linewidth=0.7)
    for k, style in ((0.05, "--"), (0.15, ":")):
        ax.plot([0, top * 1.05], [0, top * 1.05 * (1 + k)], color="#999", linestyle=style, linewidth=0.7)
        ax.plot([0, top * 1.05], [0, top * 1.05 * (1 - k)], color="#999", linestyle=style, linewidth=0.7)
    ax.set_xlabel("measured ms / step")
    ax.set_ylabel("predicted ms / step")
    ax.set_title("dashed: ±5 %, dotted: ±15 %", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(plt, fig, out / "prediction.png")


def plot_what_if(payload: dict, results: Path, out: Path) -> tuple[Path | None, str]:
    """From the validation's source trace: predicted scaling (2 ... 256 ranks) and bucket-cap curves at
    10/25/100 Gbit/s."""
    plt = _pyplot()

    from portddp import simulate  # noqa: PLC0415

    src = payload["source"]
    path = results / "simulate_validate" / f"cap{src['cap']:g}" / (
        f"overlap-n{src['hosts']}-h{src['hosts']}-{src['rate']}.json")
    if not path.exists():
        return None, ""
    run = json.loads(path.read_text())
    rows = {r["label"]: r for r in run["rows"]}
    impl = "torch-c10d"
    world = run["world"]["size"]
    off = simulate.Trace.from_row(rows[f"{impl} (no overlap)"], world)
    m = payload["models"][impl]
    # One ring step's latency cannot be fitted from one world size; assumed 10 us (a datacenter network).
    model = simulate.Model(simulate.LinkModel(m["alpha_s"], m["host_s_per_byte"], hop_s=HOP_ASSUMED_S),
                           m["kappa"], m["kappa_comm"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    worlds = [2, 4, 8, 16, 32, 64, 128, 256]
    caps = [0.25, 0.5, 1, 2, 4, 8, 16, 32, 64]
    lines = []
    for gbit in (10, 25, 100):
        rate = gbit * 1e9
        steps = [simulate.simulate(off, model, world=n, rate_bps=rate).step_s * 1e3 for n in worlds]
        a1.plot(worlds, steps, "o-", label=f"{gbit} Gbit/s")
        by_cap = [simulate.simulate(off, model, world=64, rate_bps=rate, bucket_cap_mb=c,
                                    first_bucket_cap_mb=min(1.0, c)).step_s * 1e3 for c in caps]
        a2.plot(caps, by_cap, "o-", label=f"{gbit} Gbit/s")
        best = caps[min(range(len(caps)), key=by_cap.__getitem__)]
        lines.append(f"{gbit} Gbit/s: {steps[0]:.0f} ms at 2 ranks, {steps[-1]:.0f} ms at 256; at 64 ranks the "
                     f"best cap is {best:g} MB ({min(by_cap):.0f} ms; 0.25 MB: {by_cap[0]:.0f} ms, 64 MB: "
                     f"{by_cap[-1]:.0f} ms)")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("ranks (one per host)")
    a1.set_ylabel("predicted ms / step")
    a1.set_title(f"{impl}, benchmark MLP, caps of the trace", fontsize=9)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("bucket cap (MB), 64 ranks")
    a2.set_title("bucket size", fontsize=9)
    for a in (a1, a2):
        a.legend(fontsize=8)
    fig.tight_layout()
    png = _save(plt, fig, out / "what_if.png")
    return png, "\n".join(f"- {line}" for line in lines)


def what_if_section(payload: dict, results: Path, out: Path) -> tuple[str, Path | None]:
    """The what-if curves and their text; ("", None) where the source point's run is missing."""
    png, text = plot_what_if(payload, results, out)
    if png is None:
        return "", None
    src = payload["source"]
    return ("Predicted from the same source trace (portddp.simulate; per-rank compute as measured there, a ring "
            "all-reduce with the fitted per-collective and per-byte costs, and an assumed "
            f"{HOP_ASSUMED_S * 1e6:.0f} us per ring step, which one world size -- the source's {src['hosts']} "
            "hosts -- cannot separate from the per-collective cost):\n\n" + text + "\n\nThe DDP paper "
            "(§5.2) finds the best bucket size between the extremes, growing with model size; too small "
            "buckets pay per-message latency, too large ones delay the first all-reduce.\n", png)


def prediction_section(payload: dict) -> str:
    body = [[impl, f"{v['median_abs_error'] * 100:.1f} %", f"{v['worst_abs_error'] * 100:.1f} %", v["points"]]
            for impl, v in payload["per_impl"].items()]
    src = payload["source"]
    errs = sorted(((abs(p["error"]), p) for p in payload["points"]), key=lambda e: e[0])
    worst = errs[-1][1]
    grid = _grid(payload["points"])
    return (table(["implementation", "median |error|", "worst |error|", "points"], body)
            + f"\n\nEach point of the grid ({grid}) predicted by "
              f"`portddp.simulate` from one source point ({src['hosts']} hosts, {src['rate']}, {src['cap']:g} MB; its "
              f"own runs are not scored), against the step time measured there. Worst point: {worst['impl']} at "
              f"{worst['hosts']} hosts, {worst['rate']}, {worst['cap']:g} MB, overlap {worst['overlap']}: predicted "
              f"{worst['predicted_s'] * 1e3:.0f} ms, measured {worst['measured_s'] * 1e3:.0f} ms. Slowest single "
              f"prediction: {payload['worst_predict_s'] * 1e3:.1f} ms.\n")


def _grid(points: list[dict]) -> str:
    """What the validation grid spanned, read from its points ("links 1gbit and 500mbit x bucket caps 1, 4
    and 16 MB x overlap on/off, 2 and 3 hosts")."""
    links = _and(list(dict.fromkeys(p["rate"] for p in points)))
    caps = _and([f"{c:g}" for c in sorted({p["cap"] for p in points})])
    hosts = sorted({p["hosts"] for p in points})
    overlap = _and([{True: "on", False: "off"}[o] for o in sorted({p["overlap"] for p in points}, reverse=True)])
    return (f"links {links} x bucket caps {caps} MB x overlap {overlap}, {_and(hosts)} "
            f"host{'s' if hosts != [1] else ''}")


# ------------------------------------------------------------------- tables
def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def overlap_section(payload: dict) -> str:
    rows = {r["label"]: r for r in payload["rows"]}
    out = []
    for r in payload["rows"]:
        if r["params"].get("overlap") is True:
            off = rows.get(f"{r['impl']} (no overlap)")
            speedup = f"{(off['median_s'] / r['median_s'] - 1) * 100:.1f} %" if off else "–"
            m = r["metrics"]
            out.append([r["label"], _ms_spread(r), _ms_spread(off) if off else "–",
                        speedup, f"{m['overlap_ratio']:.2f}" if "overlap_ratio" in m else "–",
                        f"{m['exposed_comm_time'] * 1e3:.1f}" if "exposed_comm_time" in m else "–"])
        elif r["params"].get("overlap") is None:
            out.append([f"{r['impl']} (no communication)", _ms_spread(r), "–", "–", "–", "–"])
    paper = ", ".join(f"{k} {v} %" for k, v in PAPER_OVERLAP.items())
    return (table(["implementation", "overlap on (ms)", "overlap off (ms)", "speedup", "overlap ratio",
                   "exposed comm (ms)"], out)
            + _calibration_text(payload) + _caps_text(payload)
            + "\n\nTimes: median (25th–75th percentile) of the timed iterations; a speedup smaller than that "
              f"spread is noise. Speedup = t(off) / t(on) − 1. The DDP paper's §5.1 reports, on 32 GPUs: {paper}. "
              + ("On the emulated cluster communication waits on a shaped link, as on a real network; the ranks "
                 "still share this machine's cores, so the TCP stack's work competes with compute."
                 if payload.get("cluster") else
                 "Here the ranks share the cores and communicate through memory, so computation and "
                 "communication compete for the same cores: overlap can only hide the waiting, not the work of "
                 "reducing.") + "\n")


def _caps_text(payload: dict) -> str:
    """Which bucket cap each row ran at: the run's for portddp's rows, and native's own defaults where a row
    has them (until 2026-12-07 a run held native there alone)."""
    caps = {r["knobs"].get("bucket_cap_mb") for r in payload["rows"]
            if r["params"].get("overlap") is not None and r["knobs"].get("bucket_cap_mb") is not None}
    if len(caps) != 1:
        return ""
    mb = caps.pop()
    native = [r for r in payload["rows"] if r["impl"] == "native"]
    at_defaults = [r["label"] for r in native if "bucket_cap_mb" not in r["knobs"]]
    text = f"\n\nBuckets of {mb:g} MB (the first {min(1.0, mb):g} MB) in every row"
    if at_defaults and len(native) > 1:
        text += (f" but *{at_defaults[0]}*: native DDP as a script gets it, 25 MB buckets -- fewer and larger, "
                 "so their all-reduces start later in the backward pass")
    elif at_defaults:
        text += " but native DDP's, at its own defaults (25 MB buckets): another bucket plan than portddp's rows"
    return text + "."


def _calibration_text(payload: dict) -> str:
    """--link matched: the rate's calibration, and how the wire time compares with this run's backward."""
    cal, c = payload.get("calibration"), payload.get("cluster")
    if not cal or not c or not c.get("rate_bps"):
        return ""
    wire_s = cal["wire_bytes_per_step"] * 8 / c["rate_bps"]
    off = next((r for r in payload["rows"] if r["impl"] == "torch-c10d" and r["params"].get("overlap") is False), None)
    here = off and (off.get("metrics") or {}).get("backward_compute_time")
    return (f"\n\nLink rate matched by a calibration run (torch-c10d on an unshaped link): backward compute "
            f"{cal['backward_compute_s'] * 1e3:.0f} ms, {cal['wire_bytes_per_step'] / 1e6:.1f} MB per host per step, "
            f"so {cal['rate_mbit']} Mbit/s (wire time {wire_s * 1e3:.0f} ms)"
            + (f"; in this run torch-c10d's backward with overlap off (nothing on the wire meanwhile, as in the "
               f"calibration) took {here * 1e3:.0f} ms, so the wire time is "
               f"{wire_s / here:.2f} x the backward here." if here else ".")
            + " Where these differ much the machine was busier in one run than in the other.")


def _ms_spread(row: dict) -> str:
    import numpy as np  # noqa: PLC0415

    if not row.get("times_s"):  # (a row of no timed iterations: unusable() keeps such files out)
        return "–"
    lo, hi = np.percentile(row["times_s"], [25, 75]) * 1e3
    return f"{row['median_s'] * 1e3:.1f} ({lo:.0f}–{hi:.0f})"


def native_metrics_section(payload: dict) -> str:
    rows = {r["label"]: r for r in payload["rows"] if r["params"].get("overlap") is not False}
    if "native" not in rows or "torch-c10d" not in rows:
        return ""
    # Until 2026-12-07 a run held native at its own defaults only; since then "native" is at the run's cap.
    caps = ("at the same bucket cap" if "bucket_cap_mb" in rows["native"].get("knobs", {})
            else "and its bucket cap follows its defaults")
    keys = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")
    body = [[k, f"{rows['native']['metrics'].get(k, float('nan')) * 1e3:.2f}",
             f"{rows['torch-c10d']['metrics'].get(k, float('nan')) * 1e3:.2f}"] for k in keys]
    return ("\n### PyTorch's own metrics beside portddp's\n\n"
            + table(["metric (ms)", "native DDP (_get_ddp_logging_data)", "portddp.torch c10d (events)"], body)
            + "\n\nSame definitions, measured differently: native DDP averages its own C++ timers over the "
              f"iterations it samples ({caps}), portddp reads host timestamps "
              "of the iterations above and takes medians.\n")


def _workload_text(payload: dict) -> str:
    """The model and per-rank batch a run measured, as its config says."""
    c = payload.get("config") or {}
    return f"model {c.get('model', '?')}, batch {c.get('batch', '?')} per rank"


def _samples_text(payload: dict) -> str:
    """How many timed steps each median is of, and what that means for reading small differences."""
    n = max((len(r.get("times_s") or []) for r in payload["rows"]), default=0)
    return (f"\nEach median is of {n} timed steps; differences within the interquartile ranges are noise "
            "(rerun with more --rounds to resolve them).\n")


def generic_section(payload: dict, extra: str | None = None, spread: bool = False) -> str:
    """A row per variant: its median (`spread`: and interquartile range) time, `extra`, overlap ratio."""
    body = []
    for r in payload["rows"]:
        row = [r["label"], _ms_spread(r) if spread else f"{r['median_s'] * 1e3:.1f}"]
        if extra == "per_sample":
            row.append(f"{r['median_s'] / r['params']['samples_per_step'] * 1e6:.0f}")
        if extra == "loss":
            row.append(f"{r['loss']:.4f}")
        row.append(f"{r['metrics']['overlap_ratio']:.2f}" if "overlap_ratio" in r["metrics"] else "–")
        body.append(row)
    headers = ["variant", "median ms / iteration" + (" (IQR)" if spread else "")] + {"per_sample": ["µs / sample"], "loss": ["last loss"]}.get(
        extra, []) + ["overlap ratio"]
    return table(headers, body) + "\n"


def bench_section(payload: dict) -> str:
    """experiments.bench: per model, every implementation's time, ratios (as the benchmark wrote
    them), overlap, CPU and memory."""
    headline = payload.get("headline", {})

    def num(x, fmt):
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    parts = []
    for group in dict.fromkeys(r["group"] for r in payload["rows"]):
        body = []
        for r in (r for r in payload["rows"] if r["group"] == group):
            m, auto = r["metrics"], r.get("auto") or {}
            cap = r["params"].get("bucket_cap_mb", m.get("bucket_cap_mb"))
            if auto:
                cap = f"auto → {auto.get('chosen_mb')}"
            body.append([r["label"], _ms_spread(r), num(r.get("vs_native"), ".3f"),
                         num(r.get("vs_limit", r.get("vs_best_fixed")), ".3f"), num(m.get("overlap_ratio"), ".2f"),
                         num(m.get("exposed_comm_time", math.nan) * 1e3, ".1f"),
                         *(num((r.get("cpu") or {}).get(k, math.nan) * 1e3, ".1f")
                           for k in ("total", "main", "comm", "xla", "other")), num(r.get("cpu_vs_limit"), ".2f"),
                         num(r.get("grad_mb"), ".0f"), num(r.get("peak_mb"), ".0f"),
                         num(cap, "") if cap is not None else "–"])
        parts.append(f"\n### {group}\n\n" + table(
            ["implementation", "ms / iteration", "vs native", "vs limit (auto: vs best fixed)", "overlap ratio",
             "exposed comm (ms)", "CPU ms / it", "main", "comm", "xla", "other", "CPU vs limit", "gradient MB",
             "peak RSS MB",
             "cap MB"], body) + "\n")
    line = " ".join(f"{k}={v:.3f}" for k, v in headline.items())
    return ("Every implementation side by side in one run (interleaved rounds). *vs limit*: to the same "
            "framework's step without communication. *native-again*: native DDP a second time in the same "
            "rounds, an A/A check -- its ratio to native is how far this run can tell two equal steps apart. "
            "*CPU ms / it*: CPU time per iteration per rank (mean over ranks), all threads, then the main "
            "thread, the comm threads (portddp's MPI comm thread, Gloo's), XLA's named pools and "
            "the rest (a comm thread that spins while it waits shows here, not in the time). "
            "*CPU vs limit*: the CPU per iteration over that of the same framework's limit -- steadier than the "
            "ratio of times on a shared machine, and blind to waiting. "
            "*gradient MB*: memory holding gradients after a step "
            "(every .grad storage plus bucket buffers). *peak RSS MB*: resident memory added while the variant "
            "was built and warmed up (approximate: memory freed by an earlier variant can be reused).\n"
            + "".join(parts) + _ratio_precision(payload.get("models", {}))
            + f"\nHeadline (the worst over the models): `{line}`\n")


RATIOS = (("torch_c10d_vs_native", "portddp.torch c10d vs native"), ("torch_best_vs_limit", "portddp.torch best vs limit"),
          ("jax_hooked_vs_limit", "portddp.jax hooked vs limit"), ("native_again_vs_native", "native again vs native (A/A)"))


def _ratio_precision(models: dict) -> str:
    """The headline ratios per model with their standard error within the run and their range
    over the rounds (experiments.bench writes both): how far another run could read them."""
    names = list(models)
    rows = []
    for key, title in RATIOS:
        cells = []
        for m in names:
            mine = models[m]
            if key not in mine:
                cells.append("–")
                continue
            se, spread = mine.get(f"{key}_se"), mine.get(f"{key}_rounds")
            cell = f"{mine[key]:.3f}"
            if isinstance(se, float) and not math.isnan(se):
                cell += f" ± {se:.3f}"
            if spread:
                cell += f" (rounds {spread[0]:.3f}–{spread[1]:.3f})"
            cells.append(cell)
        if any(c != "–" for c in cells):
            rows.append([title, *cells])
    if not rows:
        return ""
    return ("\n### Ratios and their precision\n\nEach ratio of medians ± its standard error within this run "
            "(the rounds redrawn with replacement), and its range from round to round: a ratio less than about "
            "two standard errors from a target may read on the other side of it in another run.\n\n"
            + table(["ratio", *names], rows) + "\n")


def equivalence_section(results: list[dict]) -> str:
    body = []
    for r in results:
        c = r["config"]
        worst = {name: max(v["deviation"].values()) for name, v in r["results"].items()}
        body.append([c["model"], c["dtype"], c["optimizer"], r["world"]["size"], r["reference"],
                     ", ".join(f"{n} {w:.1e}" for n, w in worst.items() if n != r["reference"]),
                     "yes" if r["ok"] else "NO"])
    return table(["model", "dtype", "optimizer", "ranks", "reference", "worst relative deviation", "within bound"],
                 body) + "\n"


def scaling_section(payloads: list[dict]) -> str:
    """One table per world size, each under its own heading (back to back, Markdown would run them
    into one table)."""
    parts = []
    for p in sorted(payloads, key=lambda p: (p["world"]["size"], _where_suffix(p))):
        n = p["world"]["size"]
        label = f"{n} rank{'s' if n != 1 else ''}" + (f" ({where(p)})" if p.get("cluster") else "")
        why = unusable(p)
        parts.append(f"\n### {label}\n\n" + (f"Not shown: {why}\n" if why else generic_section(p)))
    return "Median ms per iteration at each world size, the batch per rank fixed.\n" + "".join(parts)


def unusable(payload: dict) -> str | None:
    """Why a result cannot make its section (naming its file), or None: a row without timed iterations
    (an older run with --rounds 0 wrote NaN medians) or a run that holds no rows at all."""
    name = payload.get(READ_FROM, payload.get("path", "a result"))
    runs = payload.get("runs", [payload]) if "points" not in payload else []
    for run in runs:
        rows = run.get("rows") or []
        if not rows:
            return f"{name} holds no measured rows: rerun the experiment"
        empty = [r.get("label", "?") for r in rows
                 if not r.get("times_s") or not math.isfinite(r.get("median_s", math.nan))]
        if empty:
            return (f"{name} has no timed iterations for {', '.join(map(repr, empty))} (median NaN): rerun the "
                    f"experiment with --rounds and --steps-per-round of 1 or more")
    if "points" in payload and not payload["points"]:
        return f"{name} holds no predicted points: rerun experiments.simulate_validate"
    return None


def _section(title: str, payloads: list[dict], make, each: bool = False) -> tuple[str, str, Path | None]:
    """(title, text, plot) from make() -> (text, plot); where the payloads cannot make it, the
    section says why in one line naming the file instead: one bad result costs its own section,
    not the whole report. `each`: make() itself says which of the payloads it cannot show (the
    world-size section, a table per payload)."""
    why = None if each else next((w for p in payloads if (w := unusable(p))), None)
    if why is None:
        try:
            text, png = make()
            return title, text, png
        except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
            # (the traceback too: where a result is fine, this is a bug of the section's, not the file's)
            sys.stderr.write(f"portddp report: section {title!r} not shown:\n{traceback.format_exc()}")
            files = ", ".join(p.get(READ_FROM, "?") for p in payloads)
            why = (f"{files} lacks what this section needs ({type(e).__name__}: {e}): rerun the experiment that "
                   f"wrote it")
    return title, f"Not shown: {why}\n", None


def _no_results(results: Path, problems: list[str]) -> NoReturn:
    if problems:  # (files were there, none readable: say that, not "run the experiments first")
        raise SystemExit(f"no readable results under {results}:" + "".join(f"\n  skipped {p}" for p in problems)
                         + "\nrerun the experiments that wrote them (see README), or pass another --results")
    raise SystemExit(f"no results under {results}: run the experiments first (see README)")


def build(results: Path, out: Path, prog: str = "python -m comparisons.report") -> Path:
    found, equivalence, problems = load(results)
    if not (found or equivalence):  # (before making `out`: no empty report folder left behind)
        _no_results(results, problems)
    out.mkdir(parents=True, exist_ok=True)
    sections: list[tuple[str, str, Path | None]] = []
    if equivalence:
        sections.append(("Numerical equivalence", equivalence_section(equivalence), None))
    if "bench" in found:
        p = found["bench"][-1]
        sections.append(_section("Benchmark", [p], lambda: (bench_section(p), None)))
    # The newest overlap run on one machine and on each cluster shape (the cluster's first).
    overlaps = {}
    for p in found.get("overlap", []):
        overlaps[_where_suffix(p)] = p
    for key in sorted(overlaps, key=lambda k: (k == "", k)):
        p = overlaps[key]
        if unusable(p):  # (one line, under the overlap section's title; no empty Gantt section above it)
            sections.append(_section(f"Overlap on vs off ({where(p)})", [p], None))
            continue
        sections.append(_section(f"Where the time goes: one iteration per implementation ({where(p)})", [p],
                                 lambda p=p: ("", plot_gantt(p, out))))
        sections.append(_section(f"Overlap on vs off ({where(p)}; {_workload_text(p)})", [p], lambda p=p: (
            overlap_section(p) + (wire_section(p) if p.get("cluster") else "") + native_metrics_section(p), None)))
    if "bandwidth" in found:
        p = found["bandwidth"][-1]
        sections.append(_section(_bandwidth_title(p), [p], lambda: (bandwidth_section(p), plot_bandwidth(p, out))))
    if "simulate_validate" in found:
        p = found["simulate_validate"][-1]
        sections.append(_section("Prediction (portddp.simulate) against the emulated cluster", [p],
                                 lambda: (prediction_section(p), plot_prediction(p, out))))
        if not unusable(p):
            what_if = _section("What if: more ranks, faster links, other buckets (predicted)", [p],
                               lambda: what_if_section(p, results, out))
            if what_if[1]:  # (nothing where the source point's run is not beside the validation's JSON)
                sections.append(what_if)
    if "bucket_sweep" in found:
        p = found["bucket_sweep"][-1]
        sections.append(_section(f"Bucket size ({where(p)}; {_workload_text(p)})", [p], lambda: (
            generic_section(p, spread=True) + _samples_text(p), plot_buckets(p, out))))
    if "scaling" in found:
        usable = [p for p in found["scaling"] if not unusable(p)]
        sections.append(_section("World size", found["scaling"], lambda: (
            scaling_section(found["scaling"]), plot_scaling(usable, out) if usable else None), each=True))
    if "no_sync" in found:
        p = found["no_sync"][-1]
        sections.append(_section("Gradient accumulation (no_sync)", [p], lambda: (
            generic_section(p, "per_sample", spread=True) + _samples_text(p), None)))
    if "compression" in found:
        p = found["compression"][-1]
        sections.append(_section("Compression hooks", [p], lambda: (
            generic_section(p, "loss", spread=True) + _samples_text(p), None)))
    if not sections:
        _no_results(results, problems)
    any_payload = next((ps[-1] for ps in found.values() if "environment" in ps[-1]), None)
    env = any_payload["environment"] if any_payload else {}
    head = (f"# portddp report\n\nGenerated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC from "
            f"`{results}` by `{prog}`. Machine: {env.get('cpus', '?')} CPUs, {env.get('machine', '?')}; "
            f"Python {env.get('python', '?')}, PyTorch {env.get('torch', '?')}, portddp {portddp.__version__}.\n")
    commands = sorted({p.get("command", "?") + (f"    # written {p['written_utc']}" if p.get("written_utc") else "")
                       for ps in found.values() for p in ps})
    commands += sorted({f"mpirun -n {r['world']['size']} python -m comparisons.equivalence --model "
                        f"{r['config']['model']} --dtype {r['config']['dtype']} --optimizer {r['config']['optimizer']}"
                        f" --steps {r['config']['steps']}"
                        + (f" --out {r['config']['out']}" if r["config"].get("out", _EQUIVALENCE_OUT)
                           != _EQUIVALENCE_OUT else "") for r in equivalence})
    if commands:
        head += "\nCommands:\n\n" + "\n".join(f"    {c}" for c in commands) + "\n"
    if problems:
        head += "\nSkipped:\n\n" + "\n".join(f"- {p}" for p in problems) + "\n"
    md = [head]
    for title, text, png in sections:
        md.append(f"\n## {title}\n\n" + (f"![{title}]({png.name})\n\n" if png else "") + text)
    (out / "report.md").write_text("".join(md))
    (out / "report.html").write_text(to_html(head, sections))
    return out / "report.html"


def to_html(head: str, sections) -> str:
    """The report as one self-contained HTML page: its Markdown rendered by markdown-it (CommonMark and
    tables), the plots inlined."""
    from markdown_it import MarkdownIt  # noqa: PLC0415 -- (rich's Markdown parser: installed with rich)

    para = MarkdownIt("commonmark", {"html": False}).enable("table").render

    body = [para(head)]
    for title, text, png in sections:
        body.append(f"<h2>{html.escape(title)}</h2>")
        if png:
            data = base64.b64encode(png.read_bytes()).decode()
            body.append(f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}">')
        body.append(para(text))
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right}th{background:#f3f3f3}img{max-width:100%}pre{background:#f6f6f6;padding:.5em}")
    return f"<!doctype html><meta charset=utf-8><title>portddp report</title><style>{style}</style>" + "\n".join(body)


def main(argv=None, prog: str | None = None) -> int:
    """`python -m comparisons.report` (or `portddp report`, which passes its own name as `prog`)."""
    parser = argparse.ArgumentParser(prog=prog or "python -m comparisons.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results", help="directory with the result JSON")
    parser.add_argument("--out", default="reports/latest", help="where report.md, report.html and PNGs go")
    args = parser.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        parser.error(f"--results {results} is a file: pass the directory the experiments wrote their JSON into"
                     if results.exists() else f"no results under {results} (it does not exist): run the experiments "
                     "first (see README), or pass the directory they wrote their JSON into with --results")
    problem = out_dir_problem(args.out, "--out")
    if problem:
        parser.error(problem)
    path = build(results, Path(args.out), parser.prog)
    print(f"report: {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
