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
