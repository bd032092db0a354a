"""One entry point for every partitioner: ``partition(problem, solver=...)``.

``auto`` runs the heuristics first (LPT and KK, each improved by exact local
search), keeps the better, and hands it to the ILP as a warm start only if
the lower bound says there is something left to win and time is left; the
answer is never worse than the heuristic's and never later than the limit.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from dflop.errors import DflopError
from dflop.schedule import heuristics, ilp
from dflop.schedule.improve import improve
from dflop.schedule.problem import Partition, PartitionProblem, finish

SOLVERS = ("auto", "ilp", "greedy", "lpt", "kk", "sequential", "random")
"""greedy: LPT then exact local search until within GOOD_ENOUGH of the bound; deterministic and
fast (what auto tries before the ILP)."""
GOOD_ENOUGH = 1e-4
"""auto stops before the ILP when the heuristic is within this gap of the lower bound."""


def _heuristic(problem: PartitionProblem, deadline: float) -> np.ndarray:
    """LPT improved by local search; KK too when that is not yet good enough."""
    target = problem.lower_bound() * (1 + GOOD_ENOUGH)
    best = improve(problem, heuristics.lpt(problem), deadline=deadline, target=target)
    if problem.makespan(best) > target and time.perf_counter() < deadline:
        candidate = improve(problem, heuristics.kk(problem), deadline=deadline, target=target)
        if problem.makespan(candidate) < problem.makespan(best):
            best = candidate
    return best


def partition(problem: PartitionProblem, solver: str = "auto", *, time_limit: float = 1.0, seed: int = 0,
              backend: str = "cbc", node_limit: int | None = None) -> Partition:
    """Partition with ``solver`` within ``time_limit`` seconds (``node_limit`` bounds the ILP's
    search by work instead, for repeatable answers)."""
    name = solver.strip().lower()
    if name not in SOLVERS:
        raise DflopError(f"unknown solver '{solver}' (known: {', '.join(SOLVERS)})")
    if time_limit <= 0:
        raise DflopError(f"time limit: must be positive, got {time_limit}")
    start = time.perf_counter()
    deadline = start + time_limit
    simple: dict[str, Callable[[PartitionProblem], np.ndarray]] = {
        "lpt": heuristics.lpt, "kk": heuristics.kk, "sequential": heuristics.sequential,
        "random": lambda p: heuristics.random_split(p, seed)}
    if name in simple:
        assignment = simple[name](problem)
        return finish(problem, assignment, name, time.perf_counter() - start)
    if name == "greedy":
        target = problem.lower_bound() * (1 + GOOD_ENOUGH)
        assignment = improve(problem, heuristics.lpt(problem), target=target)
        return finish(problem, assignment, name, time.perf_counter() - start, searched=True)
    warm = _heuristic(problem, deadline)
    bound = problem.lower_bound()
    if name == "auto" and (problem.makespan(warm) <= bound * (1 + GOOD_ENOUGH) or time.perf_counter() > deadline):
        return finish(problem, warm, "auto:heuristic", time.perf_counter() - start, searched=True)
    outcome = ilp.solve(problem, warm, time_limit=max(deadline - time.perf_counter(), 0.01),
                        backend=backend, seed=seed, node_limit=node_limit)
    label = f"{name}:{backend}" if name == "ilp" else f"auto:{backend}"
    return finish(problem, outcome.assignment, label, time.perf_counter() - start,
                  proven_bound=outcome.proven_bound, searched=True)
