"""Complete search for small problems: a partition with every bin at most a limit, or proof of none.

With a handful of items per bin, a near-perfect partition is a needle: the
exchange search can stall short of it, and a general ILP solver need not find
it within a short limit either. Bin completion finds it: the heaviest item left
opens the next bin, which is completed by each subset of the others whose
sums keep the bin within the limit and leave the rest no more than the
remaining bins can hold (at least
``total - (bins left - 1) * limit`` in every dimension). Subsets come from a
meet-in-the-middle range query over the subset sums of two halves, so a limit
near the lower bound leaves only a handful to try. Exponential in general:
used for at most MAX_ITEMS items, and it gives up (no answer either way) at
the deadline or past NODES bins or CANDIDATES pairs, so its work is bounded
and, short of the deadline, repeatable.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from dflop.schedule.problem import REL_EPS, PartitionProblem

MAX_ITEMS = 32
CANDIDATES = 1 << 18
"""Candidate pairs of half-subsets one query may score before the search gives up."""
NODES = 300
"""Bins the search may try to complete before it gives up (keeps it off the deadline)."""


class _GiveUp(Exception):
    """Out of time, candidates or nodes: no answer either way."""


def _half_sums(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sums and bit masks of every subset of ``values``' rows."""
    sums, masks = np.zeros((1, values.shape[1])), np.zeros(1, dtype=np.int64)
    for i, row in enumerate(values):
        sums = np.vstack([sums, sums + row])
        masks = np.concatenate([masks, masks | (1 << i)])
    return sums, masks


def _subsets_within(values: np.ndarray, low: np.ndarray, high: np.ndarray) -> Iterator[np.ndarray]:
    """Positions of every subset of ``values``' rows whose sums lie in [low, high], fullest first."""
    half, key = len(values) // 2, int(np.argmax(values.sum(axis=0)))  # sorted on the widest dimension
    a_sums, a_masks = _half_sums(values[:half])
    b_sums, b_masks = _half_sums(values[half:])
    order = np.argsort(b_sums[:, key], kind="stable")
    b_sums, b_masks = b_sums[order], b_masks[order]
    lo = np.searchsorted(b_sums[:, key], low[key] - a_sums[:, key], "left")
    hi = np.searchsorted(b_sums[:, key], high[key] - a_sums[:, key], "right")
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if total > CANDIDATES:
        raise _GiveUp
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.arange(total) + np.repeat(lo - np.cumsum(counts) + counts, counts)
    sums = a_sums[rows] + b_sums[cols]
    keep = ((sums >= low) & (sums <= high)).all(axis=1)
    masks = a_masks[rows[keep]] | (b_masks[cols[keep]] << half)
    positions = np.arange(len(values))
    for mask in masks[np.argsort(-sums[keep].sum(axis=1), kind="stable")]:
        yield positions[(mask >> positions) & 1 == 1]


class _Completion:
    def __init__(self, values: np.ndarray, caps: np.ndarray, deadline: float) -> None:
        self.values, self.caps, self.deadline, self.nodes = values, caps, deadline, 0

    def split(self, items: np.ndarray, bins: int) -> list[np.ndarray] | None:
        """``items`` (heaviest first) in ``bins`` groups within the caps, or None if none exists."""
        if len(items) < bins:
            return None
        if bins == 1:
            return [items] if (self.values[items].sum(axis=0) <= self.caps).all() else None
        self.nodes += 1
        if self.nodes > NODES or time.perf_counter() > self.deadline:
            raise _GiveUp
        first, rest = items[0], items[1:]
        need = self.values[items].sum(axis=0) - (bins - 1) * self.caps
        own = self.values[first]
        for chosen in _subsets_within(self.values[rest], need - own, self.caps - own):
            if len(rest) - len(chosen) < bins - 1:
                continue
            found = self.split(np.delete(rest, chosen), bins - 1)
            if found is not None:
                return [np.append(first, rest[chosen])] + found
        return None


def within(problem: PartitionProblem, limit: float, deadline: float) -> tuple[np.ndarray | None, bool]:
    """(an assignment with every bin at most ``limit``, or None; whether the answer is
    decided: None with True proves that no such partition exists)."""
    if problem.n > MAX_ITEMS:
        return None, False
    values, caps = problem.costs, np.full(problem.dims, float(limit))
    if problem.resources is not None:
        values = np.hstack([values, problem.resources])
        caps = np.concatenate([caps, problem.caps * (1 + REL_EPS)])
    items = np.argsort(-problem.costs.max(axis=1), kind="stable")
    try:
        groups = _Completion(values, caps, deadline).split(items, problem.bins)
    except _GiveUp:
        return None, False
    if groups is None:
        return None, True
    assignment = np.empty(problem.n, dtype=np.int64)
    for b, group in enumerate(groups):
        assignment[group] = b
    return assignment, True
