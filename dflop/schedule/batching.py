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


def _dispatch(chunks: int, replicas: int, microbatches: int) -> np.ndarray:
    """Bin of chunk j when chunks are dealt round-robin to ranks, one micro-step per round."""
    j = np.arange(chunks)
    return (j % replicas) * microbatches + j // replicas


def arrival(batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    n, bins = len(batch), replicas * microbatches
    chunk = (np.arange(n) * bins) // n  # equal counts (within one), in order
    return _dispatch(bins, replicas, microbatches)[chunk]


def modality_length(batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    n, bins = len(batch), replicas * microbatches
    lengths = np.maximum(batch.text_tokens, 1).astype(float)
    if n % bins:  # LLaVA's split_to_even_chunks falls back to striding
        chunk = np.arange(n) % bins
    else:
        per_chunk = n // bins
        chunk = np.empty(n, dtype=np.int64)
        totals, counts = np.zeros(bins), np.zeros(bins, dtype=np.int64)
        for i in np.argsort(-lengths, kind="stable"):
            c = int(np.argmin(totals))
            chunk[i] = c
            totals[c] += lengths[i]
            counts[c] += 1
            if counts[c] == per_chunk:
                totals[c] = np.inf
    return _dispatch(bins, replicas, microbatches)[chunk]


def token_budget(batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    bins = replicas * microbatches
    tokens = batch.llm_tokens.astype(float)
    budget = tokens.sum() / bins
    room = np.full(bins, budget)
    load = np.zeros(bins)
    chunk = np.empty(len(batch), dtype=np.int64)
    for i in np.argsort(-tokens, kind="stable"):
        fits = room >= tokens[i]
        c = int(np.argmax(fits)) if fits.any() else int(np.argmin(load))
        chunk[i] = c
        room[c] -= tokens[i]
        load[c] += tokens[i]
    for empty in np.flatnonzero(np.bincount(chunk, minlength=bins) == 0):  # a bin left empty by an
        crowded = int(np.argmax(np.bincount(chunk, minlength=bins)))   # overflow takes a sample
        members = np.flatnonzero(chunk == crowded)
        chunk[members[np.argmin(tokens[members])]] = empty
    return _dispatch(bins, replicas, microbatches)[chunk]


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


def assign(rule: Batching, batch: SampleTable, replicas: int, microbatches: int) -> np.ndarray:
    """Bins of ``batch`` under a baseline ``rule`` (BALANCED is the scheduler's, not here)."""
    return RULES[Batching(rule)](batch, replicas, microbatches)
