"""Typed configs on the command line: a dataclass is the config, its fields the flags.

    @dataclasses.dataclass
    class Config:
        steps: int = dataclasses.field(default=5, metadata={"help": "optimizer steps"})

    cfg = parse_config(Config, argv, description="...")     # --steps 10; --help shows the defaults

A field's metadata may also bound it: {"least": 1} (at least), {"above": 0} (more than); a value
out of bounds is refused in one line before anything runs (tuples: every element).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

__all__ = ["parse_config"]


def parse_config(cls, argv=None, description: str | None = None, epilog: str | None = None, prog: str | None = None):
    """An argparse CLI for a config dataclass: one --flag per field, its default
    and its `help` metadata shown by --help (`epilog` after them: what else the entry point does)."""
    if prog is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m experiments.overlap`, not overlap.py
        prog = f"python -m {spec.name}" if spec is not None and spec.name else None
    parser = argparse.ArgumentParser(prog=prog,
                                     description=description, epilog=epilog,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    for f in dataclasses.fields(cls):  # a field's `least` / `above` metadata: its smallest sensible value
        least, above = f.metadata.get("least"), f.metadata.get("above")
        for value in values[f.name] if isinstance(values[f.name], tuple) else (values[f.name],):
            flag = "--" + f.name.replace("_", "-")
            if least is not None and not value >= least:  # (NaN too)
                parser.error(f"{flag} {value}: pass {least} or more ({f.metadata.get('help', '')})")
            if above is not None and not value > above:
                parser.error(f"{flag} {value}: pass more than {above} ({f.metadata.get('help', '')})")
    return cls(**values)
