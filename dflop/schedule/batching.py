"""How frameworks other than dflop cut a global batch into (data-parallel rank x microbatch) bins.

Each rule is a function ``(batch, replicas, microbatches) -> assignment``, where
``assignment[i]`` is sample i's bin ``r * microbatches + k`` (LLM replica r,
microbatch k), the form every evaluator and runtime takes. dflop's own rule,
``BALANCED``, is the scheduler (``dflop.schedule.step.schedule_batch``); it is
named here so that results can say which rule produced them.

- ``ARRIVAL``: equal sample counts in arrival order, Megatron's pretraining
  sampler: microbatch k takes the next ``replicas x per-rank`` samples, rank r
  its r-th slice.
- ``MODALITY``: LLaVA-NeXT's ``group_by_modality_length``, what LLaVA-OneVision
  trains with. Its ``LengthGroupedSampler`` (world size x gradient-accumulation
  steps as the "world") cuts a step's samples longest first into equal-count
  chunks, each sample to the chunk with the least *length* so far, where the
  length is the sample's *text* length (``modality_lengths``: words of the
  conversation; image tokens do not count), and chunk j feeds rank j mod
  replicas at micro-step j div replicas. Its modality split only decides which
  samples share a step (an epoch-level effect), which we keep out of the
  comparison by giving every rule the same global batches.
- ``TOKENS``: token-budget packing: samples sorted by LLM tokens, longest first,
  each into the first bin with room under a budget of the batch's tokens over
  the bins (whatever fits nowhere goes to the lightest bin; a bin left empty
  takes the smallest sample of the fullest), bins handed out as ``MODALITY``
  hands out chunks.
"""

from __future__ import annotations

import heapq
from enum import Enum
from typing import Callable

import numpy as np

from dflop.specs.plan import Plan
from dflop.workload.sample import SampleTable


class Batching(str, Enum):
    BALANCED = "balanced"
    """dflop's scheduler: bins balanced on predicted encoder and LLM costs."""
    ARRIVAL = "arrival"
    MODALITY = "modality-length"
    TOKENS = "token-budget"

    def __str__(self) -> str:
        return self.value


def dispatch(chunk: np.ndarray, replicas: int, microbatches: int) -> np.ndarray:
    """Bins of samples in ``chunk`` when chunks are dealt round-robin to ranks, one micro-step
    per round (chunk j feeds rank j mod replicas at micro-step j div replicas)."""
    j = np.arange(replicas * microbatches)
    return ((j % replicas) * microbatches + j // replicas)[chunk]


def arrival_chunks(batch: SampleTable, bins: int) -> np.ndarray:
    n = len(batch)
    return (np.arange(n) * bins) // n  # equal counts (within one), in order


def modality_chunks(batch: SampleTable, bins: int) -> np.ndarray:
    """Longest first, each to the chunk with the least length so far (the lowest such chunk: a
    heap of (length, chunk) picks what ``argmin`` picks), a chunk leaving once full."""
    n = len(batch)
    lengths = np.maximum(batch.text_tokens, 1).astype(float)
    if n % bins:  # LLaVA's split_to_even_chunks falls back to striding
        return np.arange(n) % bins
    per_chunk = n // bins
    chunk = np.empty(n, dtype=np.int64)
    heap = [(0.0, c) for c in range(bins)]
    counts = [0] * bins
    order = np.argsort(-lengths, kind="stable")
    for i, length in zip(order.tolist(), lengths[order].tolist()):
        total, c = heap[0]
        chunk[i] = c
        counts[c] += 1
        if counts[c] == per_chunk:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (total + length, c))
    return chunk


class _Tree:
    """Values over positions 0..n-1 in a binary tree whose nodes hold the larger (``larger``) or the
    smaller child, for the leftmost position whose value passes a test in log n steps."""

    def __init__(self, values: list[float], larger: bool) -> None:
        self.size = size = 1 << max(len(values) - 1, 0).bit_length()
        self.pick = max if larger else min
        self.tree = [-np.inf if larger else np.inf] * (2 * size)
        self.tree[size:size + len(values)] = values
        for node in range(size - 1, 0, -1):
            self.tree[node] = self.pick(self.tree[2 * node], self.tree[2 * node + 1])

    def add(self, position: int, amount: float) -> None:
        tree, pick = self.tree, self.pick
        node = self.size + position
        tree[node] += amount
        while node > 1:  # up to where the picked child's value is what it was
            node //= 2
            value = pick(tree[2 * node], tree[2 * node + 1])
            if tree[node] == value:
                break
            tree[node] = value

    def first_at_least(self, t: float) -> int:
        """Leftmost position with a value >= t (a tree of larger values), -1 where none."""
        tree, node = self.tree, 1
        if tree[1] < t:
            return -1
        while node < self.size:
            node = 2 * node if tree[2 * node] >= t else 2 * node + 1
        return node - self.size

    def first_least(self) -> int:
        """Leftmost position of the least value (a tree of smaller values), as ``argmin``."""
        tree, node = self.tree, 1
        while node < self.size:
            node = 2 * node if tree[2 * node] <= tree[2 * node + 1] else 2 * node + 1
        return node - self.size


def token_chunks(batch: SampleTable, bins: int) -> np.ndarray:
    """Longest first, each to the first chunk with room under the budget, else to the lightest
    (both found in trees, leftmost first, as ``argmax`` of the fitting mask and ``argmin`` of the
    loads find them); then each chunk left empty takes the smallest sample of the fullest."""
    tokens = batch.llm_tokens.astype(float)
    budget = tokens.sum() / bins
    room, loads, lightest = _Tree([float(budget)] * bins, larger=True), [0.0] * bins, None
    chunk = np.empty(len(batch), dtype=np.int64)
    order = np.argsort(-tokens, kind="stable")
    for i, t in zip(order.tolist(), tokens[order].tolist()):
        c = room.first_at_least(t)
        if c < 0:
            lightest = lightest or _Tree(loads, larger=False)  # kept from the first overflow on
            c = lightest.first_least()
        chunk[i] = c
        room.add(c, -t)
        loads[c] += t
        if lightest is not None:
            lightest.add(c, t)
    counts = np.bincount(chunk, minlength=bins)
    empties = np.flatnonzero(counts == 0)
    if len(empties):  # members of every chunk, in sample order
        members = [list(m) for m in np.split(np.argsort(chunk, kind="stable"), np.cumsum(counts)[:-1])]
    for empty in empties:
        crowded = int(np.argmax(counts))
        them = members[crowded]
        moved = them.pop(int(np.argmin(tokens[them])))
        members[empty].append(moved)
        chunk[moved] = empty
        counts[crowded] -= 1
        counts[empty] += 1
    return chunk


def arrival(batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    return dispatch(arrival_chunks(batch, replicas * microbatches), replicas, microbatches)


def modality_length(batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    return dispatch(modality_chunks(batch, replicas * microbatches), replicas, microbatches)


def token_budget(batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    return dispatch(token_chunks(batch, replicas * microbatches), replicas, microbatches)


def synchronised(plan: Plan, assignment: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """dflop's bins re-slotted for a plan whose replicas meet before every op (ZeRO-3: each
    forward and backward starts with a gather over the replicas): microbatch k then costs its
    heaviest bin on any replica, so bins of like load share a microbatch index (the heaviest
    ``replicas`` bins are microbatch 0, and so on), each to the replica with the least so far.
    Other plans' bins are returned as they are."""
    replicas, m = plan.llm.dp, plan.microbatches
    if not plan.strategy.shards_parameters or replicas < 2:
        return assignment
    bins = replicas * m
    load = np.stack([np.bincount(assignment, weights=costs[:, d], minlength=bins)
                     for d in range(costs.shape[1])], axis=1).max(axis=1)
    slot = np.empty(bins, dtype=np.int64)
    totals = np.zeros(replicas)
    heaviest = np.argsort(-load, kind="stable")
    for k in range(m):
        group = heaviest[k * replicas:(k + 1) * replicas]
        for b, r in zip(group, np.argsort(totals, kind="stable")):
            slot[b] = r * m + k
            totals[r] += load[b]
    return slot[assignment]


Rule = Callable[[SampleTable, int, int], np.ndarray]
RULES: dict[Batching, Rule] = {Batching.ARRIVAL: arrival, Batching.MODALITY: modality_length,
                               Batching.TOKENS: token_budget}
"""The data-blind (or cost-blind) rules of the baselines, by name."""
CHUNKS: dict[Batching, Callable[[SampleTable, int], np.ndarray]] = {
    Batching.ARRIVAL: arrival_chunks, Batching.MODALITY: modality_chunks, Batching.TOKENS: token_chunks}
"""Each rule's chunks (0 .. bins-1) before ``dispatch`` deals them to (replica, microbatch): they
depend on the number of bins alone, so a search over many bin grids cuts each batch once per count."""


def assign(rule: Batching, batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    """Bins of ``batch`` under a baseline ``rule`` (BALANCED is the scheduler's, not here)."""
    return RULES[Batching(rule)](batch, replicas, microbatches)
