"""Typed configs on the command line: a dataclass is the config, its fields the flags.

    @dataclasses.dataclass
    class Config:
        steps: int = dataclasses.field(default=5, metadata={"help": "optimizer steps"})

    cfg = parse_config(Config, argv, description="...")     # --steps 10; --help shows the defaults
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

__all__ = ["parse_config"]


def parse_config(cls, argv=None, description: str | None = None, epilog: str | None = None):
    """An argparse CLI for a config dataclass: one --flag per field, its default
    and its `help` metadata shown by --help (`epilog` after them: what else the entry point does)."""
    parser = argparse.ArgumentParser(description=description, epilog=epilog,
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
    return cls(**values)
