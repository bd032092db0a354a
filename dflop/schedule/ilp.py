"""The integer program, on aggregated item classes, solved in a child process it cannot outlive.

Items whose costs agree (to a resolution chosen to leave at most
MAX_CLASSES classes) form a class; the model chooses how many members of each
class every bin gets (one integer per class and bin), minimising z >= every
bin's load in every dimension, with z bounded below by the problem's own
bound and bins ordered by their first-dimension load (symmetry). When the
classes are exact (every member of a class costs the same) the solver's bound
is a proof; otherwise the answer is mapped back to items. Either way the
better of it and the warm start is improved by the exchange search until the
deadline.

Why a child process: HiGHS checks its clock between phases, not inside them.
Its root heuristics (randomized rounding after the first LP, central rounding
towards the analytic centre) call ``tryRoundedPoint``, which fixes every
integer column in turn and propagates after each fix; on a model of thousands
of integer columns one such pass takes seconds, and no option switches it
off, so a limit passed to the solver alone is overrun. So the
solve runs in a forked child that the parent kills at the deadline, keeping
the warm start; the child also points its stdout at stderr, so no solver
message lands in a command's JSON. Where fork is not available the solve runs
in-process under the solver's own limit.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass

import mip
import numpy as np

from dflop.errors import DflopError
from dflop.schedule.exchange import exchange_search
from dflop.schedule.problem import PartitionProblem

MAX_CLASSES = 96
BACKENDS = {"cbc": mip.CBC, "highs": mip.HIGHS}
RESERVE = 0.05
"""Share of the time limit kept for mapping the answer back to items and improving it."""
GRACE = 0.02
"""Seconds the parent waits past the child's deadline before killing it."""


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
    """Every bin gets the number of members of each class the model chose (members of a class
    cost alike, so which ones matters little; the exchange search settles the rest)."""
    assignment = np.empty(problem.n, dtype=np.int64)
    by_class = np.argsort(classes.of, kind="stable")
    starts = np.concatenate([[0], np.cumsum(classes.count)])
    for c in range(len(classes.count)):
        assignment[by_class[starts[c]:starts[c + 1]]] = np.repeat(np.arange(problem.bins), counts[c])
    return assignment


@dataclass(frozen=True)
class IlpOutcome:
    assignment: np.ndarray | None
    """The best found (the warm start when the ILP found nothing better); None without either."""
    proven_bound: float | None
    solver_status: str


@dataclass(frozen=True)
class _Model:
    """What the child needs: the class model's numbers, no Python objects from the caller."""
    cost: np.ndarray
    count: np.ndarray
    resource: np.ndarray | None
    caps: np.ndarray | None
    bins: int
    floor: float
    start: np.ndarray | None
    backend: str
    seed: int
    node_limit: int | None


def _solve_model(m: _Model, deadline: float) -> tuple[np.ndarray | None, float | None, str]:
    """Build and solve; (counts, proven bound, solver status)."""
    n_classes, k = m.cost.shape[0], m.bins
    model = mip.Model(sense=mip.MINIMIZE, solver_name=BACKENDS[m.backend])
    model.verbose, model.threads, model.seed = 0, 1, m.seed
    model.max_mip_gap, model.max_mip_gap_abs = 1e-9, 1e-12  # close the gap: the bound is the point
    x = [[model.add_var(var_type=mip.INTEGER, lb=0, ub=int(m.count[c])) for b in range(k)] for c in range(n_classes)]
    z = model.add_var(lb=m.floor)
    model.objective = z
    for c in range(n_classes):
        model.add_constr(mip.LinExpr(variables=x[c], coeffs=[1.0] * k) == int(m.count[c]))
    ones = [1.0] * n_classes
    for b in range(k):
        column = [x[c][b] for c in range(n_classes)]
        model.add_constr(mip.LinExpr(variables=column, coeffs=ones) >= 1)
        for d in range(m.cost.shape[1]):
            model.add_constr(mip.LinExpr(variables=column + [z], coeffs=m.cost[:, d].tolist() + [-1.0]) <= 0)
        if m.resource is not None:
            for r, cap in enumerate(m.caps):
                model.add_constr(mip.LinExpr(variables=column, coeffs=m.resource[:, r].tolist()) <= float(cap))
        if b + 1 < k:  # symmetry: bins ordered by their first-dimension load
            following = [x[c][b + 1] for c in range(n_classes)]
            model.add_constr(mip.LinExpr(variables=column + following,
                                         coeffs=m.cost[:, 0].tolist() + (-m.cost[:, 0]).tolist()) >= 0)
    if m.start is not None:
        model.start = [(x[c][b], float(m.start[c, b])) for c in range(n_classes) for b in range(k) if m.start[c, b]]
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        return None, None, "no time left"
    limits = {"max_nodes": m.node_limit} if m.node_limit is not None else {}
    status = model.optimize(max_seconds=remaining, **limits)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE) or not model.num_solutions:
        return None, None, status.name.lower()
    counts = np.rint([[x[c][b].x for b in range(k)] for c in range(n_classes)]).astype(np.int64)
    return counts, float(model.objective_bound), status.name.lower()


def _child(connection, m: _Model, deadline: float) -> None:
    os.dup2(2, 1)  # solver messages go to stderr, never into the parent's stdout
    try:
        connection.send(_solve_model(m, deadline))
    except Exception as exc:  # reported to the parent, which keeps its warm start
        connection.send((None, None, f"failed: {type(exc).__name__}: {exc}"))


def _run(m: _Model, deadline: float) -> tuple[np.ndarray | None, float | None, str]:
    """``_solve_model`` in a forked child, killed if it has not answered by ``deadline`` + GRACE."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return _solve_model(m, deadline)
    if m.backend == "highs":
        import mip.highs  # noqa: F401  load the library once here, not in every child
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, m, deadline), daemon=True)
    child.start()
    send.close()
    try:
        if receive.poll(max(deadline - time.perf_counter(), 0.0) + GRACE):
            return receive.recv()
        return None, None, "killed at the time limit"
    except EOFError:
        return None, None, f"the solver process died (exit code {child.exitcode})"
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()


def solve(problem: PartitionProblem, warm: np.ndarray | None, *, time_limit: float, backend: str = "cbc",
          seed: int = 0, node_limit: int | None = None) -> IlpOutcome:
    """Improve on ``warm`` within ``time_limit`` seconds of wall time, model building included;
    never returns worse than ``warm``.

    With ``node_limit`` the search also stops after that many branch-and-bound nodes, which
    (unlike wall time) makes the answer repeatable. Costs enter the model divided by the
    largest one and rounded to 12 digits, so a scaled problem builds the very same model."""
    start = time.perf_counter()
    if backend not in BACKENDS:
        raise DflopError(f"unknown ILP backend '{backend}' (known: {', '.join(BACKENDS)})")
    classes = make_classes(problem)
    unit = float(classes.cost.max()) or 1.0
    cost = np.round(classes.cost / unit, 12)
    start_counts = None
    if warm is not None:
        start_counts = np.zeros((len(classes.count), problem.bins), dtype=np.int64)
        np.add.at(start_counts, (classes.of, warm), 1)
        start_counts = start_counts[:, np.argsort(-(cost[:, 0] @ start_counts), kind="stable")]
        if classes.resource is not None and ((classes.resource.T @ start_counts) > problem.caps[:, None]).any():
            start_counts = None  # classes hold their largest member's needs: the start may not fit
    model = _Model(cost, classes.count, classes.resource, problem.caps, problem.bins,
                   np.round(problem.lower_bound() / unit, 12), start_counts, backend, seed, node_limit)
    deadline = start + time_limit
    counts, bound, status = _run(model, deadline - RESERVE * time_limit)
    best = warm
    if counts is not None and (counts.sum(axis=1) == classes.count).all() and (counts.sum(axis=0) >= 1).all():
        candidate = _to_items(problem, classes, counts)
        if problem.feasible(candidate) and (best is None or problem.makespan(candidate) < problem.makespan(best)):
            best = candidate
    if best is not None:
        best = exchange_search(problem, best, deadline=deadline)
    proven = bound * unit if classes.exact and bound is not None else None
    return IlpOutcome(best, proven, status)
