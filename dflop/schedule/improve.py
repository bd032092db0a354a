"""Exact local improvement: moves and swaps that lower the makespan, on the true costs.

Each round takes the critical bin (the one holding the makespan) and looks for
the single move of one of its items, or swap with an item of another bin,
that leaves both bins below the current makespan, taking the one that leaves
the pair most balanced. A round that finds none ends the search. Every
accepted step lowers (makespan, number of bins at the makespan)
lexicographically, so the search terminates; it never breaks a cap and never
empties a bin. Candidate partners are the lightest bins first (where moves
succeed), the rest only when those fail. Members are kept per bin, so a round
costs what the critical bin and its partners hold, not the whole batch.
"""

from __future__ import annotations

import time

import numpy as np

from dflop.schedule.problem import REL_EPS, PartitionProblem

PARTNERS = (8, 64)
"""Partner windows tried in turn (the lightest bins first); then every other bin, unless
``every_partner`` is off."""


class _State:
    def __init__(self, problem: PartitionProblem, assignment: np.ndarray) -> None:
        self.p = problem
        self.assignment = assignment
        self.loads = problem.loads(assignment)
        self.members: list[list[int]] = [[] for _ in range(problem.bins)]
        for item, b in enumerate(assignment.tolist()):
            self.members[b].append(item)
        self._arrays: dict[int, np.ndarray] = {}
        self.capped = problem.resources is not None
        if self.capped:
            self.caps = problem.caps * (1 + REL_EPS)
            self.held = np.stack([np.bincount(assignment, weights=problem.resources[:, r], minlength=problem.bins)
                                  for r in range(len(problem.caps))], axis=1)
            self.largest = problem.resources.max(axis=0)

    def items(self, b: int) -> np.ndarray:
        if b not in self._arrays:
            self._arrays[b] = np.array(self.members[b], dtype=np.int64)
        return self._arrays[b]

    def tight(self, bins: np.ndarray) -> bool:
        """Whether any of these bins is close enough to a cap for a move to break it."""
        return self.capped and bool(((self.caps - self.held[bins]) < self.largest).any())

    def move(self, item: int, src: int, dst: int) -> None:
        self.assignment[item] = dst
        self.loads[src] -= self.p.costs[item]
        self.loads[dst] += self.p.costs[item]
        self.members[src].remove(item)
        self.members[dst].append(item)
        self._arrays.pop(src, None)
        self._arrays.pop(dst, None)
        if self.capped:
            self.held[src] -= self.p.resources[item]
            self.held[dst] += self.p.resources[item]


def _best_move(s: _State, crit: int, partners: np.ndarray, limit: float):
    items = s.items(crit)
    if len(items) < 2:
        return None
    c = s.p.costs[items]
    crit_after = (s.loads[crit][None, :] - c).max(axis=1)
    partner_after = (s.loads[partners][None, :, :] + c[:, None, :]).max(axis=2)
    worst = np.maximum(crit_after[:, None], partner_after)
    if s.tight(partners):
        fits = ((s.held[partners][None, :, :] + s.p.resources[items][:, None, :]) <= s.caps).all(axis=2)
        worst[~fits] = np.inf
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    return (items[i], None, partners[j]) if worst[i, j] < limit else None


def _best_swap(s: _State, crit: int, partners: np.ndarray, limit: float):
    items = s.items(crit)
    groups = [s.items(b) for b in partners]
    others = np.concatenate(groups)
    if not len(others):
        return None
    other_bins = np.repeat(partners, [len(g) for g in groups])
    delta = s.p.costs[items][:, None, :] - s.p.costs[others][None, :, :]
    crit_after = (s.loads[crit][None, None, :] - delta).max(axis=2)
    partner_after = (s.loads[other_bins][None, :, :] + delta).max(axis=2)
    worst = np.maximum(crit_after, partner_after)
    if s.tight(np.append(partners, crit)):
        moved = s.p.resources[items][:, None, :] - s.p.resources[others][None, :, :]
        fits = ((s.held[crit] - moved <= s.caps).all(axis=2)
                & (s.held[other_bins][None, :, :] + moved <= s.caps).all(axis=2))
        worst[~fits] = np.inf
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    return (items[i], others[j], other_bins[j]) if worst[i, j] < limit else None


def _lightest(values: np.ndarray, k: int) -> np.ndarray:
    """The first k of ``np.argsort(values, kind="stable")`` (the k least by value, then index),
    without sorting them all: the partner windows only ever read that far."""
    if k >= len(values):
        return np.argsort(values, kind="stable")
    kth = np.partition(values, k - 1)[k - 1]
    below = np.flatnonzero(values < kth)
    pick = np.sort(np.concatenate([below, np.flatnonzero(values == kth)[:k - len(below)]]))
    return pick[np.argsort(values[pick], kind="stable")]


def improve(problem: PartitionProblem, assignment: np.ndarray, deadline: float | None = None,
            target: float = 0.0, max_rounds: int = 100_000, every_partner: bool = True) -> np.ndarray:
    """Locally optimal (no improving move or swap) version of ``assignment``; stops early at
    ``deadline`` or once the makespan is down to ``target``. Without ``every_partner`` only the
    lightest bins are tried as partners (cheaper; not a local optimum over all bins)."""
    if problem.bins == 1:
        return assignment.copy()
    s = _State(problem, assignment.copy())
    for _ in range(max_rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break
        bin_max = s.loads.max(axis=1)
        makespan = bin_max.max()
        if makespan <= target:
            break
        limit = makespan * (1 - REL_EPS)
        order = np.argsort(bin_max, kind="stable") if every_partner else _lightest(bin_max, PARTNERS[-1] + 1)
        step = None
        for crit in np.flatnonzero(bin_max >= limit):
            rest = order[order != crit]
            windows = [rest[a:b] for a, b in zip((0,) + PARTNERS, PARTNERS)]
            if every_partner:
                windows.append(rest[PARTNERS[-1]:])
            for partners in windows:
                if len(partners):
                    step = _best_move(s, crit, partners, limit) or _best_swap(s, crit, partners, limit)
                if step is not None:
                    break
            if step is not None:
                break
        if step is None:
            break
        out_item, in_item, partner = step
        s.move(int(out_item), int(crit), int(partner))
        if in_item is not None:
            s.move(int(in_item), int(partner), int(crit))
    return s.assignment
