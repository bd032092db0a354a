"""Bins for a trainer that pads: a microbatch costs its sample count times its longest sample.

A trainer that pads every microbatch to its longest sample (the Hugging Face Trainer with a padding
collator, LLaVA's recipes) computes ``count x longest`` tokens for it, whatever the shorter samples
hold, so bins balanced on token sums can still cost very different amounts there. Here the samples
are sorted longest first and cut into contiguous runs, one bin each, with as many samples per run
as the target allows:

- In that order a run's first sample is its longest, so a run from position ``i`` of ``c`` samples
  costs ``c x L[i]``; the greedy cut (each run as long as a target ``T`` allows) needs the fewest
  runs of any cut into runs under ``T`` (its k-th run ends no earlier than any other cut's k-th, by
  induction: a run starting no earlier reaches at least as far, its first sample being no longer).
- A binary search over whole-token targets finds the least ``T`` whose greedy cut needs at most the
  bins given; the most costly runs are then halved until there are exactly that many bins, which
  never raises a run's cost.

``group_by_length``-style microbatches are runs of the same sorted order with equal counts: one cut
under their own largest cost, so the answer is never above it (the guarantee the tests check).
Pure and deterministic: samples of equal length keep their input order.
"""

from __future__ import annotations

import heapq
from enum import Enum

import numpy as np

from dflop.errors import DflopError, member


class BinCost(str, Enum):
    """What one microbatch costs the trainer that runs it."""

    def __str__(self) -> str:
        return self.value

    PACKED = "packed"
    """The sum of its samples' costs: a padding-free (packed) microbatch computes only real tokens."""
    PADDED = "padded"
    """Its sample count times its longest sample: every sample is padded to the longest."""


def bin_cost(value: BinCost | str, where: str = "bin_cost") -> BinCost:
    return member(BinCost, value, where, "bin cost")


def padded_loads(lengths: np.ndarray, assignment: np.ndarray, bins: int) -> np.ndarray:
    """Per bin, its sample count times its longest sample (0 for an empty bin)."""
    lengths, assignment = np.asarray(lengths, dtype=np.int64), np.asarray(assignment, dtype=np.int64)
    counts = np.bincount(assignment, minlength=bins)
    longest = np.zeros(bins, dtype=np.int64)
    np.maximum.at(longest, assignment, lengths)
    return counts * longest


def _runs(sorted_lengths: np.ndarray, target: int) -> list[int]:
    """Start positions of the greedy cut under ``target`` (at least the longest sample)."""
    starts, i, n = [], 0, len(sorted_lengths)
    while i < n:
        starts.append(i)
        longest = int(sorted_lengths[i])
        i = n if longest == 0 else i + target // longest
    return starts


def _split(starts: list[int], sorted_lengths: np.ndarray, bins: int) -> list[int]:
    """The most costly runs of two or more samples halved until there are ``bins`` runs."""
    ends = starts[1:] + [len(sorted_lengths)]
    heap = [(-(e - s) * int(sorted_lengths[s]), s, e) for s, e in zip(starts, ends)]
    heapq.heapify(heap)
    single = []  # runs of one sample: nothing left to halve
    while len(heap) + len(single) < bins:
        _, s, e = heapq.heappop(heap)
        if e - s == 1:
            single.append(s)
            continue
        middle = s + (e - s + 1) // 2
        for a, b in ((s, middle), (middle, e)):
            heapq.heappush(heap, (-(b - a) * int(sorted_lengths[a]), a, b))
    return sorted([s for _, s, _ in heap] + single)


def padded_partition(lengths: np.ndarray, bins: int) -> np.ndarray:
    """The bin (0..bins-1) of every sample, no bin empty, the largest ``count x longest`` as small as
    contiguous runs of the longest-first order allow (see the module notes)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer) or (lengths < 0).any():
        raise DflopError("lengths: expected a flat list of whole token counts >= 0")
    n = len(lengths)
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or not 1 <= bins <= n:
        raise DflopError(f"bins: expected a whole number from 1 to the {n} samples, got {bins!r}")
    order = np.argsort(-lengths, kind="stable")
    ordered = lengths[order].astype(np.int64)
    longest = int(ordered[0])
    low = max(longest, -(-int(ordered.sum()) // bins))  # no cut does better than either
    high = max(low, -(-n // bins) * longest)  # equal-count chunks fit under this
    while low < high:
        middle = (low + high) // 2
        if len(_runs(ordered, middle)) <= bins:
            high = middle
        else:
            low = middle + 1
    starts = _split(_runs(ordered, low), ordered, bins)
    assignment = np.empty(n, dtype=np.int64)
    assignment[order] = np.searchsorted(starts, np.arange(n), side="right") - 1
    return assignment
