"""The partitioning problem every solver answers, and what a solution reports.

Items have cost vectors (one entry per module, in seconds on that module's
stage); K bins; optional per-bin caps on resources (LLM tokens, tiles) so
that no bin exceeds what fits in memory. The makespan is the largest summed
cost over bins and dimensions; the lower bound is the best the problem itself
proves (never a solver's hope).

Every entry point (library, `dflop schedule`, the sampler, the step scheduler)
builds a PartitionProblem, so its checks are the one numeric validation of
costs: finite, non-negative, and with totals a float can hold (a sum that
overflows would make every bound and gap meaningless).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Sequence

import numpy as np

from dflop.errors import DflopError, InfeasibleError

REL_EPS = 1e-9


class Status(StrEnum):
    """How much a partition's quality is known (the same words for every solver)."""

    OPTIMAL = "optimal"
    """The makespan equals a proven lower bound (the problem's own, or the ILP's)."""
    FEASIBLE = "feasible"
    """A search for better partitions ran (exchange search, ILP) and stopped without a proof:
    at its deadline, at a local optimum, or within the good-enough gap."""
    HEURISTIC = "heuristic"
    """One constructive pass (lpt, kk, sequential, random): nothing searched for better."""


def _check_numbers(values: np.ndarray, what: str, name) -> None:
    """Finite, non-negative entries whose column totals a float can hold; errors name the item."""
    bad = np.argwhere(~np.isfinite(values) | (values < 0))
    if len(bad):
        i, d = bad[0]
        raise DflopError(f"{what}: item {name(i)} has {what[:-1]} {float(values[i, d])!r} in dimension {d}; "
                         f"expected a finite number >= 0")
    with np.errstate(over="ignore"):
        totals = values.sum(axis=0)
    over = np.flatnonzero(~np.isfinite(totals))
    if len(over):
        d = over[0]
        i = int(np.argmax(values[:, d]))
        raise DflopError(f"{what}: the total of dimension {d} is beyond the float range (item {name(i)} alone "
                         f"has {values[i, d]:g}); rescale them (e.g. seconds instead of nanoseconds)")


@dataclass(frozen=True, eq=False)
class PartitionProblem:
    costs: np.ndarray
    """(items, dimensions), non-negative."""
    bins: int
    resources: np.ndarray | None = None
    """(items, resources) amounts counted against ``caps``."""
    caps: np.ndarray | None = None
    """(resources,) the most one bin may hold."""
    ids: Sequence[Any] | None = None

    def __post_init__(self) -> None:
        costs = np.asarray(self.costs, dtype=float)
        if costs.ndim == 1:
            costs = costs[:, None]
        object.__setattr__(self, "costs", costs)
        n = len(costs)
        if costs.ndim != 2 or costs.shape[1] < 1:
            raise DflopError("costs: expected one cost vector per item")
        if self.ids is not None and len(self.ids) != n:
            raise DflopError(f"ids: {len(self.ids)} ids for {n} items")
        _check_numbers(costs, "costs", self.name)
        if self.bins < 1:
            raise DflopError(f"bins: must be at least 1, got {self.bins}")
        if n < self.bins:
            raise DflopError(f"{n} items cannot fill {self.bins} bins (every bin needs at least one item)")
        if (self.resources is None) != (self.caps is None):
            raise DflopError("resources and caps go together")
        if self.resources is not None:
            res = np.asarray(self.resources, dtype=float).reshape(n, -1)
            caps = np.asarray(self.caps, dtype=float).reshape(-1)
            object.__setattr__(self, "resources", res)
            object.__setattr__(self, "caps", caps)
            if res.shape[1] != len(caps):
                raise DflopError(f"caps: {len(caps)} caps for {res.shape[1]} resources")
            _check_numbers(res, "resources", self.name)
            if not (np.isfinite(caps) & (caps > 0)).all():
                raise DflopError(f"caps: every cap must be a finite number above 0, got {caps.tolist()}")
            over = np.argwhere(res > caps[None, :])
            if len(over):
                i, r = over[0]
                raise InfeasibleError(f"item {self.name(i)} needs {res[i, r]:g} of resource {r}, more than "
                                      f"the per-bin cap {caps[r]:g}")
            totals = res.sum(axis=0)
            short = np.flatnonzero(totals > caps * self.bins)
            if len(short):
                r = short[0]
                raise InfeasibleError(f"resource {r}: the items need {totals[r]:g} in total, more than "
                                      f"{self.bins} bins x cap {caps[r]:g}")

    @property
    def n(self) -> int:
        return len(self.costs)

    @property
    def dims(self) -> int:
        return self.costs.shape[1]

    def name(self, i: int) -> str:
        """Item ``i`` as messages name it: its id as JSON writes it (or its index)."""
        if self.ids is None:
            return str(i)
        key = self.ids[i]
        return key if isinstance(key, str) else json.dumps(key) if isinstance(key, (bool, int, float)) else str(key)

    def loads(self, assignment: np.ndarray) -> np.ndarray:
        return np.stack([np.bincount(assignment, weights=self.costs[:, d], minlength=self.bins)
                         for d in range(self.dims)], axis=1)

    def makespan(self, assignment: np.ndarray) -> float:
        return float(self.loads(assignment).max())

    def feasible(self, assignment: np.ndarray) -> bool:
        if self.resources is None:
            return True
        held = np.stack([np.bincount(assignment, weights=self.resources[:, r], minlength=self.bins)
                         for r in range(len(self.caps))], axis=1)
        return bool((held <= self.caps[None, :] * (1 + REL_EPS)).all())

    def lower_bound(self) -> float:
        """max(total / K per dimension, the largest item, and per dimension the K-th plus
        (K+1)-th largest items: two of the K+1 largest must share a bin)."""
        c = self.costs
        bound = max(float((c.sum(axis=0) / self.bins).max()), float(c.max()))
        if self.n > self.bins:
            top = -np.sort(-c, axis=0)
            bound = max(bound, float((top[self.bins - 1] + top[self.bins]).max()))
        return bound

    def scaled(self, factor: float) -> "PartitionProblem":
        return PartitionProblem(self.costs * factor, self.bins, self.resources, self.caps, self.ids)


@dataclass(frozen=True, eq=False)
class Partition:
    assignment: np.ndarray
    """Bin of every item."""
    makespan: float
    lower_bound: float
    status: Status
    solver: str
    seconds: float
    loads: np.ndarray

    @property
    def gap(self) -> float:
        return (self.makespan - self.lower_bound) / self.lower_bound if self.lower_bound > 0 else 0.0

    def bins(self, ids: Sequence[Any] | None = None) -> list[list[Any]]:
        groups: list[list[Any]] = [[] for _ in range(len(self.loads))]
        for i, b in enumerate(self.assignment):
            groups[b].append(ids[i] if ids is not None else i)
        return groups


def finish(problem: PartitionProblem, assignment: np.ndarray, solver: str, seconds: float,
           proven_bound: float | None = None, searched: bool = False) -> Partition:
    """Wrap an assignment as a Partition with an honest status (``searched``: a search for better
    partitions ran, see :class:`Status`)."""
    assignment = np.asarray(assignment, dtype=np.int64)
    check_assignment(problem, assignment)
    loads = problem.loads(assignment)
    makespan = float(loads.max())
    bound = problem.lower_bound()
    if proven_bound is not None:  # a proof within the solver's tolerance is a proof
        bound = max(bound, makespan if proven_bound >= makespan * (1 - REL_EPS) else proven_bound)
    if makespan <= bound * (1 + REL_EPS):
        status = Status.OPTIMAL
    else:
        status = Status.FEASIBLE if searched else Status.HEURISTIC
    return Partition(assignment, makespan, bound, status, solver, seconds, loads)


def check_assignment(problem: PartitionProblem, assignment: np.ndarray) -> None:
    """Every item in exactly one valid bin, no empty bin, caps respected."""
    if assignment.shape != (problem.n,):
        raise AssertionError(f"assignment has shape {assignment.shape}, expected ({problem.n},)")
    if len(assignment) and (assignment.min() < 0 or assignment.max() >= problem.bins):
        raise AssertionError("assignment names a bin that does not exist")
    counts = np.bincount(assignment, minlength=problem.bins)
    if (counts == 0).any():
        raise AssertionError(f"bin {int(np.flatnonzero(counts == 0)[0])} is empty")
    if not problem.feasible(assignment):
        raise AssertionError("a bin exceeds its cap")
