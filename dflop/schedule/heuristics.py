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
from dflop.schedule.problem import PartitionProblem


def _room(problem: PartitionProblem, held: np.ndarray, item: int) -> np.ndarray:
    """Bins that can take ``item`` without exceeding a cap."""
    if problem.resources is None:
        return np.ones(problem.bins, dtype=bool)
    return ((held + problem.resources[item][None, :]) <= problem.caps[None, :] * (1 + 1e-9)).all(axis=1)


def _no_room(problem: PartitionProblem, item: int) -> InfeasibleError:
    return InfeasibleError(f"item {problem.name(item)} fits in no bin within the caps "
                           f"({problem.bins} bins); use more bins or larger caps")


def lpt(problem: PartitionProblem) -> np.ndarray:
    k, dims = problem.bins, range(problem.dims)
    costs = problem.costs.tolist()
    loads = [[0.0] * problem.dims for _ in range(k)]
    key, count = [0.0] * k, [0] * k
    heap = [(0.0, 0, b) for b in range(k)]
    capped = problem.resources is not None
    if capped:
        caps = problem.caps * (1 + 1e-9)
        held = np.zeros((k, len(caps)))
        room = [list(caps) for _ in range(k)]  # caps - held, as floats for the fast path
        needs = problem.resources.tolist()
        key_np, count_np = np.zeros(k), np.zeros(k)
    assignment = [0] * problem.n
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for item in np.argsort(-problem.costs.max(axis=1), kind="stable").tolist():
        top = heap[0]
        while top[0] != key[top[2]] or top[1] != count[top[2]]:  # lazy deletion of stale entries
            pop(heap)
            top = heap[0]
        b, on_top = top[2], True
        if capped and any(r > left for r, left in zip(needs[item], room[b])):
            fits = (held + problem.resources[item] <= caps).all(axis=1)
            if not fits.any():
                raise _no_room(problem, item)
            order = np.lexsort((count_np, key_np))  # lightest bin with room, fewer items first
            b, on_top = int(order[fits[order]][0]), False
        row, cost = loads[b], costs[item]
        for d in dims:
            row[d] += cost[d]
        assignment[item] = b
        key[b] = max(row)
        count[b] += 1
        (replace if on_top else push)(heap, (key[b], count[b], b))
        if capped:
            held[b] += problem.resources[item]
            room[b] = [left - r for left, r in zip(room[b], needs[item])]
            key_np[b], count_np[b] = key[b], count[b]
    return np.array(assignment, dtype=np.int64)


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
