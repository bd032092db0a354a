"""Fast partitioning heuristics and the data-blind baselines.

``lpt`` is longest-processing-time first on cost vectors: items in decreasing
order of their largest cost, each to the bin whose largest load is smallest
(a heap; ties go to the bin with fewer items, so no bin stays empty). Keys are
absolute, not normalised per dimension: the makespan is the largest absolute
load, and balancing a small dimension as carefully as a large one only costs
balance where it matters.

``kk`` is Karmarkar-Karp's largest differencing method generalised to K bins
and D dimensions: every item starts as a K-way partial partition; the two
partial partitions with the largest spread are merged, the heaviest subset of
one with the lightest of the other; repeat until one remains.

``sequential`` is what data-blind frameworks do (arrival order, equal sample
counts per bin); ``random`` is the same after a seeded shuffle.
"""

from __future__ import annotations

import heapq

import numpy as np

from dflop.errors import InfeasibleError
from dflop.schedule.problem import REL_EPS, PartitionProblem


def _room(problem: PartitionProblem, held: np.ndarray, item: int) -> np.ndarray:
    """Bins that can take ``item`` without exceeding a cap."""
    if problem.resources is None:
        return np.ones(problem.bins, dtype=bool)
    return ((held + problem.resources[item][None, :]) <= problem.caps[None, :] * (1 + 1e-9)).all(axis=1)


def _no_room(problem: PartitionProblem, item: int) -> InfeasibleError:
    return InfeasibleError(f"item {problem.name(item)} fits in no bin within the caps "
                           f"({problem.bins} bins); use more bins or larger caps")


def compiled_caps(problem: PartitionProblem) -> tuple[np.ndarray, np.ndarray]:
    """(resources, caps with a rounding's slack) as the compiled loops take them: contiguous (one
    compiled version), and with no resource at all where the problem has no caps."""
    if problem.resources is None:
        return np.zeros((problem.n, 0)), np.zeros(0)
    return np.ascontiguousarray(problem.resources), problem.caps * (1 + REL_EPS)


def lpt(problem: PartitionProblem) -> np.ndarray:
    from dflop.schedule.kernels import lpt_loop

    order = np.argsort(-problem.costs.max(axis=1), kind="stable")
    resources, caps = compiled_caps(problem)
    # per position in the order, of each resource, the least any item from there on needs
    least = np.ascontiguousarray(np.minimum.accumulate(resources[order][::-1], axis=0)[::-1])
    assignment = lpt_loop(np.ascontiguousarray(problem.costs), order, problem.bins, resources, caps, least)
    if assignment[0] < 0:
        raise _no_room(problem, int(-1 - assignment[0]))
    return assignment


def kk(problem: PartitionProblem) -> np.ndarray:
    costs = problem.costs
    key = costs.max(axis=1)
    k = problem.bins
    heap: list[tuple[float, int, np.ndarray, list[list[int]]]] = []
    for i in range(problem.n):
        sums = np.zeros((k, problem.dims))
        sums[0] = costs[i]
        members: list[list[int]] = [[i]] + [[] for _ in range(k - 1)]
        heapq.heappush(heap, (-float(key[i]), i, sums, members))
    tie = problem.n
    while len(heap) > 1:
        _, _, a_sums, a_members = heapq.heappop(heap)
        _, _, b_sums, b_members = heapq.heappop(heap)
        a_order = np.argsort(-a_sums.max(axis=1), kind="stable")
        b_order = np.argsort(b_sums.max(axis=1), kind="stable")
        sums = a_sums[a_order] + b_sums[b_order]
        members = [a_members[i] + b_members[j] for i, j in zip(a_order, b_order)]
        totals = sums.max(axis=1)
        heapq.heappush(heap, (-float(totals.max() - totals.min()), tie, sums, members))
        tie += 1
    assignment = np.empty(problem.n, dtype=np.int64)
    for b, items in enumerate(heap[0][3]):
        assignment[items] = b
    return repair(problem, assignment)


def sequential(problem: PartitionProblem) -> np.ndarray:
    """Arrival order, equal counts: bin b holds items [b*n/K, (b+1)*n/K)."""
    assignment = (np.arange(problem.n) * problem.bins) // problem.n
    if not problem.feasible(assignment):
        raise InfeasibleError("the data-blind split (arrival order, equal counts) exceeds a per-bin cap")
    return assignment


def random_split(problem: PartitionProblem, seed: int = 0) -> np.ndarray:
    order = np.random.default_rng(seed).permutation(problem.n)
    assignment = np.empty(problem.n, dtype=np.int64)
    assignment[order] = (np.arange(problem.n) * problem.bins) // problem.n
    if not problem.feasible(assignment):
        raise InfeasibleError("the random equal-count split exceeds a per-bin cap")
    return assignment


def repair(problem: PartitionProblem, assignment: np.ndarray) -> np.ndarray:
    """Refill empty bins and move items out of bins over a cap: the cheapest item that fits in
    another bin, to the one it leaves lightest."""
    assignment = assignment.copy()
    k = problem.bins
    count = np.bincount(assignment, minlength=k)
    for b in np.flatnonzero(count == 0):
        donor = int(np.argmax(count))
        items = np.flatnonzero(assignment == donor)
        item = items[np.argmin(problem.costs[items].max(axis=1))]
        assignment[item] = b
        count[donor] -= 1
        count[b] += 1
    if problem.resources is None or problem.feasible(assignment):
        return assignment
    held = np.zeros((k, len(problem.caps)))
    np.add.at(held, assignment, problem.resources)
    costs = problem.costs
    loads = np.zeros((k, problem.dims))
    np.add.at(loads, assignment, costs)
    for b in range(k):
        while (held[b] > problem.caps * (1 + 1e-9)).any():
            items = np.flatnonzero(assignment == b)
            if len(items) == 1:
                raise _no_room(problem, int(items[0]))
            for item in items[np.argsort(costs[items].max(axis=1), kind="stable")]:  # cheapest that fits
                room = _room(problem, held, item)
                room[b] = False
                if room.any():
                    break
            else:
                raise _no_room(problem, int(items[0]))
            target = int(np.argmin(np.where(room, (loads + costs[item]).max(axis=1), np.inf)))
            assignment[item] = target
            held[b] -= problem.resources[item]
            held[target] += problem.resources[item]
            loads[b] -= costs[item]
            loads[target] += costs[item]
    return assignment


def lpt_groups(problem: PartitionProblem, group: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """:func:`lpt` of every group of items (item i in group ``group[i]``, which has ``bins[g]``
    bins), each group's items into its own bins (numbered from 0), placed as ``lpt`` places them,
    all in one compiled pass: thousands of small groups (the replicas of a wide data-parallel plan)."""
    from dflop.schedule.kernels import lpt_groups_loop

    counts = np.bincount(group, minlength=len(bins))
    order = np.lexsort((np.arange(problem.n), -problem.costs.max(axis=1), group))  # by group, heaviest first
    resources, caps = compiled_caps(problem)
    out = lpt_groups_loop(np.ascontiguousarray(problem.costs), order, np.cumsum(counts) - counts, counts,
                          np.asarray(bins, dtype=np.int64), resources, caps)
    if problem.n and out[0] < 0:
        raise _no_room(problem, int(-1 - out[0]))
    return out
