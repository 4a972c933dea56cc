"""Shared plumbing for experiment entry points: typed configs on the command
line, rank-0 output, medians and JSON results."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import typing
from pathlib import Path

__all__ = ["parse_config", "median", "write_result", "environment", "Memory"]


def parse_config(cls, argv=None, description: str | None = None):
    """An argparse CLI for a config dataclass: one --flag per field, its default
    and its `help` metadata shown by --help."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        helptext = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(flag, nargs="+", type=typing.get_args(kind)[0], default=f.default, help=helptext)
        else:
            parser.add_argument(flag, type=kind, default=f.default, help=helptext)
    args = parser.parse_args(argv)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    return cls(**values)


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def environment() -> dict:
    import numpy  # noqa: PLC0415
    import torch  # noqa: PLC0415

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
    }


def write_result(path: str | os.PathLike, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)
    return path


METRICS = ("backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time",
           "overlap_ratio", "exposed_comm_time")
"""DESIGN.md's per-iteration metrics, in the order tables show them."""


def ratios(results: dict, reference: str, suffix: str) -> dict[str, float]:
    """{"<impl>_<suffix>": median(impl) / median(reference)} for every other implementation."""
    if reference not in results:
        return {}
    base = results[reference]["median_s"]
    return {f"{impl}_{suffix}": res["median_s"] / base for impl, res in results.items() if impl != reference}


def print_results(results: dict, title: str, extra: dict[str, str]) -> None:
    """A rich table: one row per implementation, its median time and DESIGN.md metrics,
    plus `extra` columns ({header: key in the result dict})."""
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=title)
    headers = ["implementation", "iteration", "bwd compute", "bwd comm", "overlap", "overlap ratio", "exposed comm"]
    for col in headers + list(extra):
        table.add_column(col, justify="right")
    for impl, res in results.items():
        m = res.get("metrics", {})

        def ms(key, m=m):
            return f"{m[key] * 1e3:.2f}" if key in m else "-"

        cells = [impl, f"{res['median_s'] * 1e3:.2f}", ms(METRICS[0]), ms(METRICS[1]), ms(METRICS[2]),
                 f"{m['overlap_ratio']:.2f}" if "overlap_ratio" in m else "-", ms(METRICS[4])]
        for key in extra.values():
            value = res.get(key, "-")
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        table.add_row(*cells)
    Console(width=170).print(table)


class Memory:
    """Resident memory of this process (Linux /proc), for "how much did this add at its peak".

        mem = Memory()
        mem.start()              # settle, then reset the kernel's high-water mark
        ... build and run something ...
        mem.peak_mb()            # peak RSS since start() minus RSS at start(), in MB

    The peak is the kernel's high-water mark (VmHWM), reset by writing 5 to
    /proc/self/clear_refs: exact, not sampled. But the allocator is left as it
    is (changing its thresholds would change the timings too), so memory freed
    earlier and kept by malloc can be reused unseen: read it as approximate.
    Elsewhere than Linux every reading is None."""

    def __init__(self):
        self.ok = os.path.exists("/proc/self/clear_refs")
        self._base = 0

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def rss_mb(self) -> float | None:
        return self._status("VmRSS:") / 2**20 if self.ok else None

    def start(self) -> None:
        if self.ok:
            import gc  # noqa: PLC0415

            gc.collect()
            # Wait (up to 2 s) for the resident size to settle: XLA frees its buffers asynchronously.
            last, t0 = -1, time.monotonic()
            while (now := self._status("VmRSS:")) != last and time.monotonic() - t0 < 2:
                last = now
                time.sleep(0.05)
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.ok = False
                return
            self._base = self._status("VmRSS:")

    def peak_mb(self) -> float | None:
        return (self._status("VmHWM:") - self._base) / 2**20 if self.ok else None
