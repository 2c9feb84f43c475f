"""Types of the command line's numeric options, and of its free-text notes.

A value out of range, NaN or an infinity is refused by argparse before anything runs, in
the CLI's one line (`cli._Parser`): "preemptor: sim: argument --stop-grace-s: must be a
finite number >= 0, got 'nan'", exit code 2 (bad input), never a traceback nor a replay
that never ends.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from preemptor.core.requests import note_problem


def number(low: float | None = None, high: float | None = None, *, above: bool = False, integer: bool = False) -> Callable[[str], float]:
    """An argparse `type`: a finite number (an integer when `integer`) at least `low` (above
    it when `above`) and at most `high`."""
    kind = "an integer" if integer else "a finite number"
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if above else '>='} {low:g}")
    if high is not None:
        bounds.append(f"<= {high:g}")
    wanted = f"must be {kind}{' ' + ' and '.join(bounds) if bounds else ''}"

    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and (value <= low if above else value < low)) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}")
        return value

    return parse


seconds = number(0)  # a duration that may be 0
positive = number(0, above=True)
any_time = number()  # a point in time: any finite number
positive_int = number(1, integer=True)
fraction = number(0, 1)
port = number(0, 65535, integer=True)


def interval(text: str) -> tuple[float, float]:
    """MIN:MAX or one value, in seconds: both finite, 0 < MIN <= MAX."""
    lo, _, hi = text.partition(":")
    try:
        lo_s = float(lo)
        hi_s = float(hi) if hi else lo_s
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be MIN:MAX or one value in seconds, got {text!r}") from None
    if not (math.isfinite(lo_s) and math.isfinite(hi_s)) or not 0 < lo_s <= hi_s:
        raise argparse.ArgumentTypeError(f"must be finite seconds with 0 < MIN <= MAX, got {text!r}")
    return lo_s, hi_s


def note(text: str) -> str:
    """A note on a change (`drain`, `priority` and `lower --note`): one line of printable
    text, as short as the intake asks of a team's (`core.requests.note_problem`); kept in the
    jobs table and, for a priority, in the team's SNS notice."""
    problem = note_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


__all__ = ["any_time", "fraction", "interval", "note", "number", "port", "positive", "positive_int", "seconds"]
