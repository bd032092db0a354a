"""One entry point for every partitioner: ``partition(problem, solver=...)``.

- ``auto``: the search (below) until the deadline or within GOOD_ENOUGH of
  the lower bound; then, if time is left and the ILP's classes are exact
  (there it can prove optimality), the ILP warm-started from it. Never past
  the limit by more than the time to hand the answer back.
- ``ilp``: the search for WARM_SHARE of the limit, then the ILP with the rest.
- ``greedy``: LPT and one exchange search (no restarts): deterministic.
- ``lpt``, ``kk``, ``sequential``, ``random``: one constructive pass.

The search is the exchange search (:mod:`dflop.schedule.exchange`) from LPT,
on problems of at most 32 items then the complete search
(:mod:`dflop.schedule.complete`), which looks for a partition within
GOOD_ENOUGH of the lower bound and for better ones, and proves the answer
optimal when it finds none; unless proved, the exchange search again from
perturbed LPT orders, keeping the best, until RESTARTS restarts in a row gain
nothing. The search comes first because on two-dimensional instances the ILP,
warm-started from the search's answer, rarely improves on it within a limit
(``benchmarks/bench_scheduler.py`` compares the two); what the ILP adds is a
proof of optimality where its classes are exact.

Under per-bin caps a constructive heuristic may find no split that fits
where another does: the data-aware ones (LPT, KK) make way for each other, and
a failure escapes only when every one failed (and, for ``auto`` and ``ilp``,
the ILP found nothing either). The data-blind baselines keep their failures:
falling back to LPT would make them data-aware.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from dflop.errors import DflopError, InfeasibleError
from dflop.schedule import complete, heuristics, ilp
from dflop.schedule.exchange import exchange_search
from dflop.schedule.problem import REL_EPS, Partition, PartitionProblem, finish
from dflop.specs import scheduling
from dflop.specs.scheduling import Solver

SOLVERS = tuple(s.value for s in Solver)
GOOD_ENOUGH = 1e-4
"""auto and greedy stop searching once within this gap of the lower bound."""
WARM_SHARE = 0.5
"""Share of the limit ``ilp`` gives the exchange search for its warm start."""
RESTARTS = 3
"""The search stops restarting after this many restarts in a row that found nothing better."""
TIGHTEN = 4
"""On small problems, how many times the complete search looks for a partition better than the best."""
PERTURBATION = 0.2
"""Restarts run LPT on costs scaled by uniform factors in [1 - PERTURBATION, 1]."""

Construct = Callable[[PartitionProblem], np.ndarray]
DATA_AWARE: dict[str, Construct] = {"lpt": heuristics.lpt, "kk": heuristics.kk}


def _construct(problem: PartitionProblem, first: str) -> tuple[str, np.ndarray]:
    """(name, assignment) of the first data-aware heuristic, ``first`` first, that fits the caps."""
    errors = []
    for name in [first] + [n for n in DATA_AWARE if n != first]:
        try:
            return name, DATA_AWARE[name](problem)
        except InfeasibleError as exc:
            errors.append(exc)
    raise errors[0]


def _search(problem: PartitionProblem, first: np.ndarray, deadline: float, target: float,
            seed: int) -> tuple[np.ndarray, float | None]:
    """(best assignment, proven lower bound or None): the exchange search from ``first``; on
    small problems the complete search; unless that proved its answer, the exchange search
    again from perturbed LPT orders, keeping the best, until ``target``, ``deadline``, or
    RESTARTS restarts in a row that gain nothing."""
    best, proven = _tighten(problem, exchange_search(problem, first, deadline=deadline, target=target),
                            deadline, target)
    if proven is not None and problem.makespan(best) <= proven * (1 + REL_EPS):
        return best, proven
    rng = np.random.default_rng(seed)
    idle = 0
    while idle < RESTARTS and problem.makespan(best) > target and time.perf_counter() < deadline:
        scale = rng.uniform(1 - PERTURBATION, 1.0, size=problem.costs.shape)
        noisy = PartitionProblem(problem.costs * scale, problem.bins, problem.resources, problem.caps)
        try:
            start = heuristics.lpt(noisy)
        except InfeasibleError:
            break
        candidate = exchange_search(problem, start, deadline=deadline, target=target)
        idle += 1
        if problem.makespan(candidate) < problem.makespan(best):
            best, idle = candidate, 0
    return best, proven


def _tighten(problem: PartitionProblem, best: np.ndarray, deadline: float,
             target: float) -> tuple[np.ndarray, float | None]:
    """On small problems, the complete search for a partition within ``target``, then (up to
    TIGHTEN times) for one better than the best; one that ends without proves the best optimal."""
    if problem.n > complete.MAX_ITEMS:
        return best, None
    proven = None
    for attempt in range(TIGHTEN + 1):
        makespan = problem.makespan(best)
        if makespan <= target or time.perf_counter() >= deadline:
            break
        limit = target if attempt == 0 else makespan * (1 - REL_EPS)
        found, decided = complete.within(problem, limit, deadline)
        if found is not None and problem.makespan(found) < makespan:
            best = found
        elif not decided:
            break
        elif attempt == 0:
            proven = limit  # nothing within the target: the optimum is above it
        else:
            return best, makespan  # nothing better than the best: it is optimal
    return best, proven


def _search_then_ilp(problem: PartitionProblem, name: Solver, start: float, deadline: float, seed: int,
                     backend: str, node_limit: int | None) -> tuple[np.ndarray, str, float | None]:
    """auto (the search until the deadline, then the ILP where its classes are exact) and ilp
    (the search for WARM_SHARE of the limit, then the ILP): (assignment, label, proven bound)."""
    try:
        _, first = _construct(problem, "lpt")
    except InfeasibleError as exc:
        return _ilp_only(problem, deadline, seed, backend, node_limit, exc)
    target = problem.lower_bound() * (1 + GOOD_ENOUGH)
    until = deadline if name == Solver.AUTO else start + WARM_SHARE * (deadline - start)
    best, proven = _search(problem, first, until, target, seed)
    makespan = problem.makespan(best)
    proved = makespan <= max(problem.lower_bound(), proven or 0.0) * (1 + REL_EPS)
    helps = name == Solver.ILP or (makespan > target and ilp.make_classes(problem).exact)
    if proved or not helps or time.perf_counter() >= deadline:
        return best, f"{name.value}:{'exchange' if name == Solver.AUTO else backend}", proven
    outcome = ilp.solve(problem, best, time_limit=deadline - time.perf_counter(), backend=backend, seed=seed,
                        node_limit=node_limit)
    bounds = [b for b in (proven, outcome.proven_bound) if b is not None]
    return outcome.assignment, f"{name.value}:{backend}", max(bounds) if bounds else None


def _ilp_only(problem: PartitionProblem, deadline: float, seed: int, backend: str, node_limit: int | None,
              failure: InfeasibleError) -> tuple[np.ndarray, str, float | None]:
    """The ILP without a warm start, every heuristic having failed the caps (``failure``)."""
    outcome = ilp.solve(problem, None, time_limit=max(deadline - time.perf_counter(), 0.01), backend=backend,
                        seed=seed, node_limit=node_limit)
    if outcome.assignment is None:
        raise failure
    return outcome.assignment, f"ilp:{backend}", outcome.proven_bound


def partition(problem: PartitionProblem, solver: str = "auto", *, time_limit: float = 1.0, seed: int = 0,
              backend: str = "cbc", node_limit: int | None = None) -> Partition:
    """Partition with ``solver`` within ``time_limit`` seconds (``node_limit`` bounds the ILP's
    search by work instead, for repeatable answers)."""
    name, limit = scheduling.solver(solver), scheduling.time_limit(time_limit)
    backend = backend.strip().lower() if isinstance(backend, str) else backend
    if backend not in ilp.BACKENDS:
        raise DflopError(f"unknown ILP backend {backend!r} (valid: {', '.join(ilp.BACKENDS)})")
    node_limit = None if node_limit is None else scheduling.whole_number(node_limit, "node limit", 1)
    seed = scheduling.whole_number(seed, "seed")
    start = time.perf_counter()
    deadline = start + limit
    proven, searched = None, True
    if name in (Solver.LPT, Solver.KK):
        used, assignment = _construct(problem, name.value)
        label, searched = name.value if used == name.value else f"{name.value}:{used}", False
    elif name in (Solver.SEQUENTIAL, Solver.RANDOM):
        assignment = (heuristics.sequential(problem) if name == Solver.SEQUENTIAL
                      else heuristics.random_split(problem, seed))
        label, searched = name.value, False
    elif name == Solver.GREEDY:
        _, first = _construct(problem, "lpt")
        assignment = exchange_search(problem, first, deadline=deadline,
                                     target=problem.lower_bound() * (1 + GOOD_ENOUGH))
        label = name.value
    else:
        assignment, label, proven = _search_then_ilp(problem, name, start, deadline, seed, backend, node_limit)
    return finish(problem, assignment, label, time.perf_counter() - start, proven_bound=proven, searched=searched)
