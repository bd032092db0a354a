"""From K balanced bins to (replica, microbatch) slots, and the microbatch order.

The partitioner balances bins; which bin becomes which replica's which
microbatch still matters. Encoder microbatch k is the union of the bins in
column k, so columns are filled to balance their encoder load; each replica's
total over its microbatches decides when it finishes, so within a column the
bins go to the replicas with the least total so far. Finally the order in
which microbatches enter the pipeline: the first one's forward is the
warm-up's critical path and the last one's backward the cool-down's, so light
microbatches belong at both ends ("light-ends"). When an evaluator is given,
the candidate orders are timed and the fastest is kept.

A replica may also run fewer bins than the plan's microbatches
(:func:`tail_slots`): its bins take its last slots and the leading ones stay
empty. An empty microbatch costs nothing, and leading ones leave the replica's
pipeline timed as a plan of that many microbatches would be; trailing ones
would hold back 1F1B's cool-down, which runs in a fixed order.
"""

from __future__ import annotations

import heapq
from typing import Callable

import numpy as np

ORDERS = ("as-solved", "light-ends", "ascending", "descending")


def _deal(keys: np.ndarray, groups: int, size: int) -> list[list[int]]:
    """Items (largest key first) dealt into ``groups`` groups of ``size``, each to the lightest
    group that still has room."""
    out: list[list[int]] = [[] for _ in range(groups)]
    heap = [(0.0, g) for g in range(groups)]
    for item in np.argsort(-keys, kind="stable").tolist():
        total, g = heapq.heappop(heap)
        out[g].append(item)
        if len(out[g]) < size:
            heapq.heappush(heap, (total + float(keys[item]), g))
    return out


def _order(column_loads: np.ndarray, how: str) -> np.ndarray:
    m = len(column_loads)
    if how == "as-solved":
        return np.arange(m)
    by_load = np.argsort(column_loads, kind="stable")
    if how == "ascending":
        return by_load
    if how == "descending":
        return by_load[::-1]
    order = np.empty(m, dtype=np.int64)  # light-ends: lightest first, next lightest last, heavy inside
    left, right = 0, m - 1
    for i, k in enumerate(by_load):
        if i % 2 == 0:
            order[left] = k
            left += 1
        else:
            order[right] = k
            right -= 1
    return order


def slot_bins(loads: np.ndarray, replicas: int, microbatches: int, *, encoder_dim: int | None,
              order: str = "light-ends",
              evaluate: Callable[[np.ndarray], float] | None = None) -> tuple[np.ndarray, str]:
    """Slot (``r * microbatches + k``) of every bin, and the order used.

    ``evaluate(slot_of_bin)`` returns a step time for a candidate; with it every
    order in ORDERS is tried and the fastest is kept.
    """
    k_bins = replicas * microbatches
    if len(loads) != k_bins:
        raise ValueError(f"{len(loads)} bins for {replicas} replicas x {microbatches} microbatches")
    main_dim = int(np.argmax(loads.sum(axis=0)))
    columns = _deal(loads[:, encoder_dim if encoder_dim is not None else main_dim], microbatches, replicas)
    replica_of = np.empty(k_bins, dtype=np.int64)
    totals = np.zeros(replicas)
    for col in columns:  # within a column, the heaviest bin to the replica with the least so far
        by_total = np.argsort(totals, kind="stable")
        heavy_first = sorted(col, key=lambda b: -loads[b, main_dim])
        for b, r in zip(heavy_first, by_total):
            replica_of[b] = r
            totals[r] += loads[b, main_dim]
    column_loads = np.array([loads[col].sum(axis=0).max() if col else 0.0 for col in columns])

    def slots_for(how: str) -> np.ndarray:
        position = np.empty(microbatches, dtype=np.int64)
        position[_order(column_loads, how)] = np.arange(microbatches)
        slot = np.empty(k_bins, dtype=np.int64)
        for k, col in enumerate(columns):
            for b in col:
                slot[b] = replica_of[b] * microbatches + position[k]
        return slot

    return pick(slots_for, order, evaluate)


def tail_slots(loads: np.ndarray, replica_of: np.ndarray, microbatches: int, how: str) -> np.ndarray:
    """Slot of every bin when replica ``replica_of[b]`` runs its own bins (at most ``microbatches``)
    in its last slots, ordered ``how`` among themselves by their heaviest dimension (as ``_order``
    orders a column's; every replica at once: thousands of them)."""
    n, per_replica = len(loads), np.bincount(replica_of)
    k = per_replica[replica_of]  # each bin's replica's bin count
    key = loads.max(axis=1) if how != "as-solved" else np.zeros(n)
    by_load = np.lexsort((np.arange(n), key, replica_of))  # by replica, then load, ties in bin order
    first = np.cumsum(per_replica) - per_replica
    i = np.empty(n, dtype=np.int64)  # each bin's rank by load among its replica's
    i[by_load] = np.arange(n) - first[replica_of[by_load]]
    position = {"as-solved": i, "ascending": i, "descending": k - 1 - i}.get(
        how, np.where(i % 2 == 0, i // 2, k - 1 - i // 2))  # light-ends: lightest first, next lightest last
    return replica_of * microbatches + microbatches - k + position


def pick(slots_for: Callable[[str], np.ndarray], order: str,
         evaluate: Callable[[np.ndarray], float] | None) -> tuple[np.ndarray, str]:
    """``slots_for(order)`` (the slot of every bin), or with ``evaluate`` the fastest of every order
    in ORDERS (the first listed on a tie), and the order's name."""
    if evaluate is None:
        return slots_for(order), order
    best = min((evaluate(slots_for(how)), i, how) for i, how in enumerate(ORDERS))[2]
    return slots_for(best), best
