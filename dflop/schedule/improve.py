"""Exact local improvement: moves and swaps that lower the makespan, on the true costs.

Each round takes the critical bin (the one holding the makespan) and looks for
the single move of one of its items, or swap with an item of another bin,
that leaves both bins below the current makespan, taking the one that leaves
the pair most balanced. A round that finds none ends the search. Every
accepted step lowers (makespan, number of bins at the makespan)
lexicographically, so the search terminates; it never breaks a cap and never
empties a bin. Partners are the lightest bins, the 8 lightest first (where moves
succeed), then the next 56: a round costs what the critical bin and its partners
hold, not the whole batch, so thousands of bins stay cheap (not a local optimum
over every pair of bins). The loop is compiled (:mod:`dflop.schedule.kernels`).
"""

from __future__ import annotations

import numpy as np

from dflop.schedule.heuristics import compiled_caps
from dflop.schedule.problem import REL_EPS, PartitionProblem

PARTNERS = (8, 64)
"""Ends of the partner windows tried in turn, lightest bins first."""


def improve(problem: PartitionProblem, assignment: np.ndarray, target: float = 0.0,
            max_rounds: int = 100_000) -> np.ndarray:
    """``assignment`` after improving steps until none is left among the partners, the makespan
    is down to ``target``, or ``max_rounds``."""
    if problem.bins == 1:
        return assignment.copy()
    from dflop.schedule.kernels import improve_loop

    resources, caps = compiled_caps(problem)
    return improve_loop(np.ascontiguousarray(problem.costs), resources, caps, np.array(assignment, dtype=np.int64),
                        problem.bins, float(target), int(max_rounds), np.array(PARTNERS, dtype=np.int64), REL_EPS)
