"""Subset exchanges between two bins: the local search behind ``auto``, ``greedy`` and ``ilp``.

Each round takes the critical bin (the one holding the makespan M) and looks,
over every other bin, for the exchange of up to k of its items against up to
k of the partner's that leaves the larger of the two lightest, and makes the
best one. When the critical bin admits none, a round rebalances some other
pair instead (the first, heaviest bins first, whose larger bin an exchange
lowers): that can make room for the critical bin in the next round. The
search ends when no pair of bins admits such an exchange.

Single moves and swaps (k = 1) cannot fine-tune two dimensions at once: where
a perfect partition exists they stall short of it, and exchanges of up to
five items a side get much closer (``benchmarks/bench_scheduler.py`` reports
the gaps). Taking the best partner rather than the first that admits an
exchange needs fewer rounds; rebalancing other pairs frees a critical bin that
no exchange with it can lower.

Exchanges are found by a range query, not by trying every pair of subsets.
With x and y the two bins' loads, giving away subset S and taking subset T
leaves the larger of the two at ``max_d (x_d + y_d) / 2 + |sum(T)_d - sum(S)_d - t_d|``
with ``t = (y - x) / 2``; it beats a limit L only if ``sum(T) - sum(S)`` lies
in a box around t. Every bin's subset sums (sizes 0..k) are kept sorted on the
main dimension, so for each S a binary search yields the few T inside the
box's extent on that dimension, and only those are scored. Sizes grow (1, 2,
... items a side) only when smaller exchanges find nothing, and only while a
bin has at most SUBSETS subsets. Sums are cached per bin and recomputed for
the two bins an exchange touched.

Every accepted exchange lowers the bins' loads sorted in decreasing order
(lexicographically), so the search ends; it never breaks a cap and never
empties a bin.
"""

from __future__ import annotations

import time
from functools import cache
from itertools import combinations
from math import comb

import numpy as np

from dflop.schedule.problem import REL_EPS, PartitionProblem

MAX_ITEMS = 5
"""The most items one side of an exchange gives (fewer where a bin has many: see SUBSETS)."""
SUBSETS = 3000
"""A bin offers subsets of a size only while it has at most this many of sizes 0..size."""
CANDIDATES = 200_000
"""Candidate pairs scored per (bin, partner) query; the box is narrowed to stay under it."""


class _Subsets:
    """Sums (and resource needs) of a bin's subsets of sizes 0..size, sorted on dimension ``key``."""

    def __init__(self, search: "_Search", items: list[int], size: int) -> None:
        # Local positions -1 (padding) map to the appended index n: a row of zeros.
        table = np.append(np.asarray(items, dtype=np.int64), search.problem.n)[_positions(len(items), size)]
        sums = search.padded_costs[table].sum(axis=1)
        order = np.argsort(sums[:, search.key], kind="stable")
        self.members, self.sums = table[order], sums[order]
        self.sorted_key = self.sums[:, search.key]
        self.needs = search.padded_needs[self.members].sum(axis=1) if search.padded_needs is not None else None


@cache
def _positions(m: int, size: int) -> np.ndarray:
    """Rows of positions 0..m-1, one per subset of sizes 0..size, padded with -1 (read-only)."""
    width = max(size, 1)
    rows = [c + (-1,) * (width - k) for k in range(size + 1) for c in combinations(range(m), k)]
    table = np.array(rows, dtype=np.int64).reshape(-1, width)
    table.setflags(write=False)
    return table


@cache
def _size_for(m: int, wanted: int) -> int:
    """The largest subset size <= wanted that keeps an item in the bin and the subsets few."""
    size = 0
    for k in range(1, min(wanted, m - 1) + 1):
        if sum(comb(m, j) for j in range(k + 1)) > SUBSETS:
            break
        size = k
    return size


class _Search:
    def __init__(self, problem: PartitionProblem, assignment: np.ndarray) -> None:
        self.problem = problem
        self.assignment = assignment.copy()
        self.key = int(np.argmax(problem.costs.sum(axis=0)))
        # A row of zeros at index n makes the "no item" padding of subset tables sum to nothing.
        self.padded_costs = np.vstack([problem.costs, np.zeros((1, problem.dims))])
        self.padded_needs = None
        if problem.resources is not None:
            self.padded_needs = np.vstack([problem.resources, np.zeros((1, problem.resources.shape[1]))])
            self.caps = problem.caps * (1 + REL_EPS)
        self.members: list[list[int]] = [[] for _ in range(problem.bins)]
        for item, b in enumerate(assignment.tolist()):
            self.members[b].append(item)
        self.loads = problem.loads(self.assignment)
        self.held = (None if problem.resources is None else
                     np.stack([self.padded_needs[m].sum(axis=0) for m in self.members]))
        self._subsets: dict[tuple[int, int], _Subsets] = {}

    def subsets(self, b: int, size: int) -> _Subsets:
        size = _size_for(len(self.members[b]), size)
        if (b, size) not in self._subsets:
            self._subsets[(b, size)] = _Subsets(self, self.members[b], size)
        return self._subsets[(b, size)]

    def best_with(self, u: int, v: int, size: int, limit: float):
        """(larger load after, u's subset row, v's subset row) of the best exchange between bins
        u and v that leaves both below ``limit``, or None."""
        a, b = self.subsets(u, size), self.subsets(v, size)
        x, y = self.loads[u], self.loads[v]
        half, t = (x + y) / 2, (y - x) / 2
        reach = limit - half
        if (reach <= 0).any():
            return None
        k, radius = self.key, reach[self.key]
        while True:
            lo = np.searchsorted(b.sorted_key, a.sums[:, k] + t[k] - radius, "left")
            hi = np.searchsorted(b.sorted_key, a.sums[:, k] + t[k] + radius, "right")
            counts = hi - lo
            total = int(counts.sum())
            if total <= CANDIDATES:
                break
            radius *= 0.5 * CANDIDATES / total
        if total == 0:
            return None
        rows = np.repeat(np.arange(len(counts)), counts)
        cols = np.arange(total) + np.repeat(lo - np.cumsum(counts) + counts, counts)
        worst = (half + np.abs(b.sums[cols] - a.sums[rows] - t)).max(axis=1)
        if a.needs is not None:
            moved = b.needs[cols] - a.needs[rows]
            fits = (self.held[u] + moved <= self.caps).all(axis=1) & (self.held[v] - moved <= self.caps).all(axis=1)
            worst[~fits] = np.inf
        best = int(np.argmin(worst))
        if worst[best] >= limit:
            return None
        return float(worst[best]), a.members[rows[best]], b.members[cols[best]]

    def apply(self, u: int, v: int, out: np.ndarray, into: np.ndarray) -> None:
        """Move ``out`` (rows of u's subset table) to v and ``into`` to u."""
        n = self.problem.n  # the padding index
        for item, src, dst in [(i, u, v) for i in out if i < n] + [(i, v, u) for i in into if i < n]:
            self.members[src].remove(int(item))
            self.members[dst].append(int(item))
            self.assignment[item] = dst
        for b in (u, v):
            self.loads[b] = self.padded_costs[self.members[b]].sum(axis=0)
            if self.held is not None:
                self.held[b] = self.padded_needs[self.members[b]].sum(axis=0)
            for key in [key for key in self._subsets if key[0] == b]:
                del self._subsets[key]

    def sizes(self, bins: list[int]):
        """Exchange sizes worth trying: 1, 2, ... while one of ``bins`` offers larger subsets."""
        for size in range(1, MAX_ITEMS + 1):
            if size > 1 and all(_size_for(len(self.members[b]), size) < size for b in bins):
                return
            yield size

    def round_any(self, deadline: float | None) -> bool:
        """One exchange between any two bins that lowers the larger of the two (heaviest bins
        first): when the critical bin is stuck, rebalancing others can make room for it."""
        bin_max = self.loads.max(axis=1)
        order = [int(b) for b in np.argsort(-bin_max, kind="stable")]
        for size in self.sizes(order):
            for i, u in enumerate(order):
                for v in order[:i:-1]:
                    found = self.best_with(u, v, size, bin_max[u] * (1 - REL_EPS))
                    if found is not None:
                        self.apply(u, v, found[1], found[2])
                        return True
                if deadline is not None and time.perf_counter() > deadline:
                    return False
        return False

    def round(self, deadline: float | None) -> bool:
        """The best exchange between the critical bin and any other; False when none lowers it."""
        bin_max = self.loads.max(axis=1)
        crit = int(np.argmax(bin_max))
        limit = bin_max[crit] * (1 - REL_EPS)
        partners = [int(p) for p in np.argsort(bin_max, kind="stable") if p != crit]
        for size in self.sizes([crit]):
            best = None
            for partner in partners:
                found = self.best_with(crit, partner, size, best[0] if best else limit)
                if found is not None:
                    best = (found[0], partner, found[1], found[2])
                if deadline is not None and time.perf_counter() > deadline:
                    break
            if best is not None:
                self.apply(crit, best[1], best[2], best[3])
                return True
        return False


def exchange_search(problem: PartitionProblem, assignment: np.ndarray, *, deadline: float | None = None,
                    target: float = 0.0) -> np.ndarray:
    """``assignment`` improved until no exchange of up to MAX_ITEMS items a side lowers the
    larger bin of any pair, the makespan is down to ``target``, or ``deadline`` (perf_counter)
    has passed."""
    if problem.bins == 1:
        return assignment.copy()
    search = _Search(problem, assignment)
    while search.loads.max() > target:
        if deadline is not None and time.perf_counter() > deadline:
            break
        if not (search.round(deadline) or search.round_any(deadline)):
            break
    return search.assignment
