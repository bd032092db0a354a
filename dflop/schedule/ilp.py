"""The ILP partitioner (python-mip, CBC or HiGHS) with cost-class aggregation.

One boolean per (sample, bin) grows as N x K and stalls on large batches.
Here samples with (nearly) equal cost vectors form a class and the model
chooses how many samples of each class go to each bin: integer x[c, b] with
sum_b x[c, b] = |c|, bin loads sum_c cost[c] x[c, b] <= z, minimise z. Bins
are interchangeable, so their loads on the first dimension are ordered
(symmetry breaking); the model is warm-started from the best heuristic and
stopped at the deadline with its best incumbent. Classes use the mean cost of
their members; mapping counts back to samples and an exact local improvement
step repair what that rounding costs. The solver's bound is a proven lower
bound only when classes are exact (members identical), and only then is it
reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mip
import numpy as np

from dflop.errors import DflopError
from dflop.schedule.improve import improve
from dflop.schedule.problem import PartitionProblem

MAX_CLASSES = 96
BACKENDS = {"cbc": mip.CBC, "highs": mip.HIGHS}


@dataclass(frozen=True)
class Classes:
    of: np.ndarray
    """Class of every item."""
    cost: np.ndarray
    """(classes, D) mean cost."""
    resource: np.ndarray | None
    """(classes, R) largest resource need of a member (conservative for caps)."""
    count: np.ndarray
    exact: bool


def make_classes(problem: PartitionProblem, max_classes: int = MAX_CLASSES) -> Classes:
    """Group items whose costs agree to a resolution chosen to leave at most ``max_classes``."""
    c = problem.costs
    keys = c if problem.resources is None else np.hstack([c, problem.resources])
    span = np.where(keys.max(axis=0) > 0, keys.max(axis=0), 1.0)
    _, of = np.unique(keys, axis=0, return_inverse=True)
    of = of.reshape(-1)
    exact = True
    resolution = 1.0 / 256
    while of.max() + 1 > max_classes:
        exact = False
        _, of = np.unique(np.floor(keys / (span * resolution)), axis=0, return_inverse=True)
        of = of.reshape(-1)
        resolution *= 1.5
    n = int(of.max()) + 1
    count = np.bincount(of, minlength=n)
    cost = np.zeros((n, problem.dims))
    np.add.at(cost, of, c)
    cost /= count[:, None]
    resource = None
    if problem.resources is not None:
        resource = np.zeros((n, problem.resources.shape[1]))
        np.maximum.at(resource, of, problem.resources)
    return Classes(of, cost, resource, count, exact)


def _to_items(problem: PartitionProblem, classes: Classes, counts: np.ndarray) -> np.ndarray:
    """Give every bin the number of members of each class the model chose, big members first
    to the bins lightest so far."""
    assignment = np.empty(problem.n, dtype=np.int64)
    loads = np.zeros((problem.bins, problem.dims))
    by_size = np.argsort(-problem.costs.max(axis=1), kind="stable")
    remaining = counts.copy()
    for item in by_size:
        c = classes.of[item]
        open_bins = np.flatnonzero(remaining[c] > 0)
        b = open_bins[np.argmin(loads[open_bins].max(axis=1))]
        assignment[item] = b
        remaining[c, b] -= 1
        loads[b] += problem.costs[item]
    return assignment


@dataclass(frozen=True)
class IlpOutcome:
    assignment: np.ndarray
    proven_bound: float | None
    solver_status: str


def solve(problem: PartitionProblem, warm: np.ndarray, *, time_limit: float, backend: str = "cbc",
          seed: int = 0, node_limit: int | None = None) -> IlpOutcome:
    """Improve on ``warm`` within ``time_limit`` seconds; never returns worse than ``warm``.

    With ``node_limit`` the search also stops after that many branch-and-bound nodes, which
    (unlike wall time) makes the answer repeatable. Costs enter the model divided by the
    largest one and rounded to 12 digits, so a scaled problem builds the very same model."""
    start = time.perf_counter()
    if backend not in BACKENDS:
        raise DflopError(f"unknown ILP backend '{backend}' (known: {', '.join(BACKENDS)})")
    classes = make_classes(problem)
    k, n_classes = problem.bins, len(classes.count)
    unit = float(classes.cost.max()) or 1.0
    cost = np.round(classes.cost / unit, 12)
    model = mip.Model(sense=mip.MINIMIZE, solver_name=BACKENDS[backend])
    model.verbose = 0
    model.threads = 1
    model.seed = seed
    x = [[model.add_var(var_type=mip.INTEGER, lb=0, ub=int(classes.count[c])) for b in range(k)]
         for c in range(n_classes)]
    z = model.add_var(lb=0.0)
    model.objective = z
    for c in range(n_classes):
        model += mip.xsum(x[c]) == int(classes.count[c])
    for b in range(k):
        model += mip.xsum(x[c][b] for c in range(n_classes)) >= 1
        for d in range(problem.dims):
            model += mip.xsum(float(cost[c, d]) * x[c][b] for c in range(n_classes)) <= z
        if classes.resource is not None:
            for r, cap in enumerate(problem.caps):
                model += mip.xsum(float(classes.resource[c, r]) * x[c][b] for c in range(n_classes)) <= float(cap)
        if b + 1 < k:  # symmetry: bins ordered by their first-dimension load
            model += (mip.xsum(float(cost[c, 0]) * x[c][b] for c in range(n_classes))
                      >= mip.xsum(float(cost[c, 0]) * x[c][b + 1] for c in range(n_classes)))
    warm_counts = np.zeros((n_classes, k), dtype=np.int64)
    np.add.at(warm_counts, (classes.of, warm), 1)
    rank = np.argsort(-(cost[:, 0] @ warm_counts), kind="stable")
    warm_counts = warm_counts[:, rank]
    if classes.resource is None or ((classes.resource.T @ warm_counts) <= problem.caps[:, None]).all():
        model.start = [(x[c][b], float(warm_counts[c, b])) for c in range(n_classes) for b in range(k)
                       if warm_counts[c, b]]
    remaining = time_limit - (time.perf_counter() - start)
    limits = {"max_nodes": node_limit} if node_limit is not None else {}
    status = (model.optimize(max_seconds=max(remaining, 0.01), **limits) if remaining > 0
              else mip.OptimizationStatus.OTHER)
    best = warm
    if status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) and model.num_solutions:
        counts = np.rint([[x[c][b].x for b in range(k)] for c in range(n_classes)]).astype(np.int64)
        if (counts.sum(axis=1) == classes.count).all() and (counts.sum(axis=0) >= 1).all():
            candidate = _to_items(problem, classes, counts)
            deadline = start + time_limit
            candidate = improve(problem, candidate, deadline=max(deadline, time.perf_counter() + 0.05))
            if problem.feasible(candidate) and problem.makespan(candidate) < problem.makespan(best):
                best = candidate
    proven = None
    if classes.exact and status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        proven = float(model.objective_bound) * unit
    return IlpOutcome(best, proven, status.name.lower())


def solve_reference(problem: PartitionProblem, *, time_limit: float, backend: str = "cbc") -> np.ndarray | None:
    """The textbook model, one boolean per (item, bin): the baseline the benchmark compares to.
    Returns None when no solution was found in time."""
    k = problem.bins
    model = mip.Model(sense=mip.MINIMIZE, solver_name=BACKENDS[backend])
    model.verbose = 0
    model.threads = 1
    x = [[model.add_var(var_type=mip.BINARY) for _ in range(k)] for _ in range(problem.n)]
    z = model.add_var(lb=0.0)
    model.objective = z
    for i in range(problem.n):
        model += mip.xsum(x[i]) == 1
    for b in range(k):
        for d in range(problem.dims):
            model += mip.xsum(float(problem.costs[i, d]) * x[i][b] for i in range(problem.n)) <= z
    status = model.optimize(max_seconds=time_limit)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        return None
    return np.array([int(np.argmax([v.x for v in row])) for row in x], dtype=np.int64)
