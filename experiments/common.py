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
import typing
from pathlib import Path

__all__ = ["parse_config", "median", "write_result", "environment"]


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
