"""The scheduler's vocabulary, checked the same way wherever it is given.

Solver names, time limits and counts (seeds, node limits, microbatches) reach
the scheduler from the command line, from a run config and from library calls;
each entry point calls these functions, so a name is looked up
(case-insensitively) and a number is checked in one place, with one message.
"""

from __future__ import annotations

import math
import numbers
from enum import StrEnum

from dflop.errors import SpecError, member


class Solver(StrEnum):
    AUTO = "auto"
    """The exchange search with restarts (complete search on small problems); then the ILP
    where its item classes are exact, so that it can prove optimality."""
    ILP = "ilp"
    """The integer program (CBC or HiGHS), warm-started by the exchange search."""
    GREEDY = "greedy"
    """LPT then one exchange search: deterministic."""
    LPT = "lpt"
    KK = "kk"
    SEQUENTIAL = "sequential"
    RANDOM = "random"


def solver(name: str, where: str = "solver") -> Solver:
    return member(Solver, name, where, "solver", SpecError)


def time_limit(seconds: float, where: str = "time limit") -> float:
    """``seconds`` if it is a finite number above zero (inf would never stop, nan never compares)."""
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise SpecError(f"{where}: expected a number of seconds, got {seconds!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise SpecError(f"{where}: must be a finite number of seconds above 0, got {seconds!r}")
    return float(seconds)


def whole_number(value: object, where: str, least: int = 0) -> int:
    """``value`` if it is a whole number >= ``least`` (not a bool, not 2.5)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise SpecError(f"{where}: expected a whole number >= {least}, got {value!r}")
    return int(value)
