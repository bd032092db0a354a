"""Exact local improvement: moves and swaps that lower the makespan, on the true costs.

Each round takes the critical bin (the one holding the makespan) and looks for
the single move of one of its items, or swap with an item of another bin,
that leaves both bins below the current makespan, taking the one that leaves
the pair most balanced. A round that finds none ends the search. Every
accepted step lowers (makespan, number of bins at the makespan)
lexicographically, so the search terminates; it never breaks a cap and never
empties a bin. Candidate partners are the lightest bins first (where moves
succeed), the rest only when those fail.
"""

from __future__ import annotations

import time

import numpy as np

from dflop.schedule.problem import REL_EPS, PartitionProblem

PARTNERS = 8


def _pair_caps_ok(problem: PartitionProblem, held: np.ndarray, crit: int, partners: np.ndarray,
                  out_items: np.ndarray, in_items: np.ndarray | None) -> np.ndarray:
    """Feasibility of moving ``out_items`` (crit -> partner) [and ``in_items`` back]."""
    if problem.resources is None:
        shape = (len(out_items), len(partners)) if in_items is None else (len(out_items), len(in_items))
        return np.ones(shape, dtype=bool)
    caps = problem.caps * (1 + REL_EPS)
    r_out = problem.resources[out_items]
    if in_items is None:
        to_partner = held[partners][None, :, :] + r_out[:, None, :]
        return (to_partner <= caps).all(axis=2)
    r_in = problem.resources[in_items]
    delta = r_out[:, None, :] - r_in[None, :, :]
    crit_ok = (held[crit][None, None, :] - delta <= caps).all(axis=2)
    partner_of_in = partners  # per in-item partner bin
    partner_ok = (held[partner_of_in][None, :, :] + delta <= caps).all(axis=2)
    return crit_ok & partner_ok


def _best_move(problem, loads, held, assignment, crit, partners, limit):
    items = np.flatnonzero(assignment == crit)
    if len(items) < 2:
        return None
    c = problem.costs[items]
    crit_after = (loads[crit][None, :] - c).max(axis=1)                       # (items,)
    partner_after = (loads[partners][None, :, :] + c[:, None, :]).max(axis=2)  # (items, partners)
    worst = np.maximum(crit_after[:, None], partner_after)
    worst[~_pair_caps_ok(problem, held, crit, partners, items, None)] = np.inf
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    if worst[i, j] < limit:
        return items[i], None, partners[j], worst[i, j]
    return None


def _best_swap(problem, loads, held, assignment, crit, partners, limit):
    items = np.flatnonzero(assignment == crit)
    others = np.flatnonzero(np.isin(assignment, partners))
    if not len(others):
        return None
    c_out, c_in = problem.costs[items], problem.costs[others]
    delta = c_out[:, None, :] - c_in[None, :, :]                               # (out, in, D)
    crit_after = (loads[crit][None, None, :] - delta).max(axis=2)
    other_bins = assignment[others]
    partner_after = (loads[other_bins][None, :, :] + delta).max(axis=2)
    worst = np.maximum(crit_after, partner_after)
    worst[~_pair_caps_ok(problem, held, crit, other_bins, items, others)] = np.inf
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    if worst[i, j] < limit:
        return items[i], others[j], other_bins[j], worst[i, j]
    return None


def improve(problem: PartitionProblem, assignment: np.ndarray, deadline: float | None = None,
            target: float = 0.0, max_rounds: int = 100_000) -> np.ndarray:
    """Locally optimal (no improving move or swap) version of ``assignment``; stops early at
    ``deadline`` or once the makespan is down to ``target``."""
    assignment = assignment.copy()
    k = problem.bins
    if k == 1:
        return assignment
    loads = problem.loads(assignment)
    held = np.zeros((k, 0 if problem.resources is None else len(problem.caps)))
    if problem.resources is not None:
        np.add.at(held, assignment, problem.resources)
    for _ in range(max_rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break
        bin_max = loads.max(axis=1)
        makespan = bin_max.max()
        if makespan <= target:
            break
        limit = makespan * (1 - REL_EPS)
        step = None
        for crit in np.flatnonzero(bin_max >= limit):
            order = np.argsort(bin_max, kind="stable")
            order = order[order != crit]
            for partners in (order[:PARTNERS], order[PARTNERS:]):
                if not len(partners):
                    continue
                step = (_best_move(problem, loads, held, assignment, crit, partners, limit)
                        or _best_swap(problem, loads, held, assignment, crit, partners, limit))
                if step is not None:
                    break
            if step is not None:
                break
        if step is None:
            break
        out_item, in_item, partner, _ = step
        moved = [(out_item, crit, partner)] + ([(in_item, partner, crit)] if in_item is not None else [])
        for item, src, dst in moved:
            assignment[item] = dst
            loads[src] -= problem.costs[item]
            loads[dst] += problem.costs[item]
            if problem.resources is not None:
                held[src] -= problem.resources[item]
                held[dst] += problem.resources[item]
    return assignment
