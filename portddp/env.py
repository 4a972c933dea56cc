"""portddp's environment variables, read and checked in one place.

    stall_s = env.number("PORTDDP_STALL_S", 240, unit="seconds", zero_means="the stall inspector off")
    wait = env.choice("PORTDDP_MPI_WAIT", "sleep", ("spin", "sleep"))
    if env.flag("PORTDDP_CHECK_STEPS", True): ...

A value that is not one the variable takes -- not a number, out of range, a misspelt choice --
is refused naming the variable, what it takes and its default, on the rank that reads it (the
others are then stopped as for any rank's failure). Unset or empty means the default.
"""

from __future__ import annotations

import math
import os

__all__ = ["choice", "flag", "number"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _raw(name: str) -> str | None:
    raw = os.environ.get(name)
    return None if raw is None or not raw.strip() else raw.strip()


def number(name: str, default: float, *, unit: str, least: float | None = None, zero_means: str | None = None,
           integer: bool = False, infinite: bool = False) -> float:
    """`name` as a number of `unit` (a float; an int with `integer`): > 0 (>= `least` if given), or
    0 where `zero_means` says what 0 does; finite unless `infinite`. `default` when unset."""
    raw = _raw(name)
    if raw is None:
        return int(default) if integer else float(default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    big_enough = value >= least if least is not None else value > 0
    if ((big_enough or (value == 0 and zero_means is not None)) and (infinite or math.isfinite(value))
            and (not integer or value == int(value))):
        return int(value) if integer else value
    allowed = (f"a{' whole' if integer else ''} number of {unit} " + (f">= {least:g}" if least is not None else "> 0")
               + (f", or 0 ({zero_means})" if zero_means else ""))
    raise ValueError(f"{name}={raw!r}: set it to {allowed}, e.g. {name}={default:g}, or unset it (default {default:g})")


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """`name` as one of `choices` (case-insensitive); `default` when unset."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in choices:
        return raw.lower()
    raise ValueError(f"{name}={raw!r}: set it to one of {', '.join(choices)}, or unset it (default {default or 'unset'})")


def flag(name: str, default: bool) -> bool:
    """`name` as on (1, true, yes, on) or off (0, false, no, off); `default` when unset."""
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE + _FALSE:
        return raw.lower() in _TRUE
    raise ValueError(f"{name}={raw!r}: set it to 1 (or true, yes, on) or 0 (or false, no, off), or unset it "
                     f"(default {int(default)})")
