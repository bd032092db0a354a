"""Which encoder replica encodes which sample, and so which bridge transfers a step needs.

The step schedule fixes the LLM side (sample -> LLM replica and microbatch);
encoder microbatch k is the union of the LLM bins of microbatch k, cut into
``encoder_dp`` contiguous chunks of about equal tiles, in LLM-replica order.
Contiguity keeps the bridge sparse: each encoder replica feeds few LLM
replicas, and each LLM replica hears from few encoder replicas. Both runtimes
derive the same routes from the same schedule, so no rank needs to ask another
who sends what.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from dflop.specs.plan import Plan
from dflop.workload.sample import SampleTable


def encoder_replicas(tiles: np.ndarray, assignment: np.ndarray, microbatches: int, encoder_dp: int) -> np.ndarray:
    """Encoder replica of every sample (``assignment[i]`` is sample i's bin ``r * microbatches + k``)."""
    k_of = assignment % microbatches
    order = np.lexsort((np.arange(len(assignment)), assignment // microbatches, k_of))
    sorted_tiles = np.asarray(tiles, dtype=float)[order]
    k_sorted = k_of[order]
    totals = np.bincount(k_sorted, weights=sorted_tiles, minlength=microbatches)
    cum = np.cumsum(sorted_tiles) - sorted_tiles  # tiles before each sample, over all microbatches
    starts = np.concatenate([[0.0], np.cumsum(totals)[:-1]])
    before = cum - starts[k_sorted]
    denom = np.where(totals[k_sorted] > 0, totals[k_sorted], 1.0)
    chunk = np.minimum(encoder_dp - 1, np.floor(encoder_dp * (before + sorted_tiles / 2) / denom)).astype(np.int64)
    out = np.empty(len(assignment), dtype=np.int64)
    out[order] = chunk
    return out


@dataclass(frozen=True)
class BridgeRoutes:
    """Per microbatch: the (encoder replica, LLM replica) pairs that exchange image features."""

    pairs: tuple[tuple[tuple[int, int], ...], ...]


def step_routes(plan: Plan, batch: SampleTable, assignment: np.ndarray) -> BridgeRoutes | None:
    """The bridge routes of one step of ``plan`` (None when the encoder shares the LLM's GPUs: no bridge)."""
    if plan.shares_gpus:
        return None
    assignment = np.asarray(assignment, dtype=np.int64)
    chunk = encoder_replicas(batch.tiles, assignment, plan.microbatches, plan.encoder.dp)
    return bridge_routes(assignment, chunk, batch.image_tokens, plan.microbatches)


def bridge_routes(assignment: np.ndarray, encoder_replica: np.ndarray, image_tokens: np.ndarray,
                  microbatches: int) -> BridgeRoutes:
    """Pairs that carry at least one image token, sorted, for every microbatch."""
    has_image = np.asarray(image_tokens) > 0
    pairs = []
    for k in range(microbatches):
        mask = has_image & (assignment % microbatches == k)
        found = {(int(j), int(r)) for j, r in zip(encoder_replica[mask], assignment[mask] // microbatches)}
        pairs.append(tuple(sorted(found)))
    return BridgeRoutes(tuple(pairs))


def encoder_ranks(tiles: np.ndarray, encoder_dp: int) -> np.ndarray:
    """Encoder replica of every sample of a heterogeneous plan's step, whatever its LLM bin: largest
    first, each to the replica with the fewest tiles so far (ties: the lowest index), so that the
    replicas' encoder work is balanced over the whole step. Both runtimes derive it alike."""
    tiles = np.asarray(tiles, dtype=float)
    out = np.zeros(len(tiles), dtype=np.int64)
    heap = [(0.0, j) for j in range(encoder_dp)]
    for i in np.argsort(-tiles, kind="stable").tolist():
        if tiles[i] <= 0:
            break  # the rest have no image: any replica, none encodes anything for them
        load, j = heap[0]
        out[i] = j
        heapq.heapreplace(heap, (load + tiles[i], j))
    return out
