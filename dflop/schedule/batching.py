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
- ``DP_BALANCED``: Megatron-LM's ``dp_balanced`` sequence-packing scheduler
  (``DpBalancedScheduler.get_groups_and_subsamples`` in
  ``megatron/core/datasets/data_schedule.py``, NVIDIA/Megatron-LM commit
  a9381be5980c, PR #6684). It packs the global batch's samples in their order
  (Megatron's global ids: data-parallel rank by rank, each rank's samples in
  its loader's order; we take the batch's own order, as a loader that hands
  rank r the r-th slice gives it) until the next sample would pass the token
  budget (``max_seqlen_per_dp_cp_rank``); then, while the number of packs is
  not a multiple of the data-parallel size (times
  ``microbatch_group_size_per_vp_stage`` with virtual stages, by default the
  pipeline size), it moves the last sample of the last pack holding several
  into a pack of its own at the end; pack j feeds rank j mod replicas at
  micro-step j div replicas. What it balances is tokens (sequence lengths):
  data-aware, model-blind. Every rank runs the same number k of packs; k varies
  from batch to batch (Megatron returns it as the step's microbatch count).
  A plan's ``microbatches`` m is the most a rank may run: each batch gets the
  smallest budget, no shorter than its longest sample (Megatron's sequences
  never pass it), whose packs fit m per rank, so a batch is packed as tightly
  as the plan's microbatch count allows; a rank's k packs are its last k
  microbatches and the first m - k are empty. An empty microbatch costs
  nothing (no compute, no transfer), and leading ones leave every rank's
  order timed as k microbatches would be (trailing ones would hold back
  cooldown backwards in a fixed 1F1B order).
"""

from __future__ import annotations

from enum import Enum
from functools import lru_cache
from typing import Callable

import numpy as np

from dflop.errors import DflopError
from dflop.specs.plan import Plan
from dflop.workload.sample import SampleTable


class Batching(str, Enum):
    BALANCED = "balanced"
    """dflop's scheduler: bins balanced on predicted encoder and LLM costs."""
    ARRIVAL = "arrival"
    MODALITY = "modality-length"
    TOKENS = "token-budget"
    DP_BALANCED = "dp-balanced"
    """Megatron-LM's ``dp_balanced`` packing: token-budget packs dealt round-robin to the ranks."""

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
    """Longest first, each to the chunk with the least length so far (the lowest such chunk, as
    LLaVA's ``split_to_even_chunks`` finds it), a chunk leaving once full."""
    from dflop.schedule.kernels import modality_chunks_loop

    n = len(batch)
    lengths = np.maximum(batch.text_tokens, 1).astype(float)
    if n % bins:  # LLaVA's split_to_even_chunks falls back to striding
        return np.arange(n) % bins
    return modality_chunks_loop(lengths, np.argsort(-lengths, kind="stable"), bins, n // bins)


def token_chunks(batch: SampleTable, bins: int) -> np.ndarray:
    """Longest first, each to the first chunk with room under the budget, else to the lightest
    (leftmost first, as ``argmax`` of the fitting mask and ``argmin`` of the loads find them); then
    each chunk left empty takes the smallest sample of the fullest."""
    from dflop.schedule.kernels import token_chunks_loop

    tokens = batch.llm_tokens.astype(float)
    chunk = token_chunks_loop(tokens, np.argsort(-tokens, kind="stable"), tokens.sum() / bins, bins)
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


def packs_under(tokens: list[int], budget: int) -> list[list[int]]:
    """Megatron's packing before alignment, sample by sample: each into the current pack while the
    pack stays within ``budget`` tokens, else into a new one: what ``kernels.pack_ends`` finds by
    search, written out as the reference the tests hold it to."""
    packs: list[list[int]] = []
    total = 0
    for i, t in enumerate(tokens):
        if not packs or total + t > budget:
            packs.append([])
            total = 0
        packs[-1].append(i)
        total += t
    return packs


def _running(tokens) -> np.ndarray:
    """The samples' running token totals, from 0."""
    return np.concatenate(([0], np.cumsum(np.asarray(tokens, dtype=np.int64))))


def tightest_budget(tokens: list[int], packs: int) -> int:
    """The smallest budget, no shorter than the longest sample, under which Megatron's packing makes
    at most ``packs`` packs (their number never grows with the budget: each pack starts no earlier)."""
    return _tightest(_running(tokens), packs)


def _tightest(cum: np.ndarray, packs: int) -> int:
    """``tightest_budget`` of the samples whose running token totals are ``cum``. The search starts
    below the average pack plus the longest sample (each pack closed under that budget holds more
    than the average, so there are at most ``packs``)."""
    from dflop.schedule.kernels import tightest_budget_loop

    total, longest = int(cum[-1]), int(np.diff(cum).max())
    lo = max(longest, -(-total // packs))
    return int(tightest_budget_loop(cum, lo, min(total, -(-total // packs) + longest), packs))


@lru_cache(maxsize=64)
def _pack_ends(tokens: tuple[int, ...], packs: int) -> tuple[int, ...]:
    """Where Megatron's packs end under the tightest budget for ``packs``: once per batch and count,
    which the plans of many bin grids share."""
    from dflop.schedule.kernels import pack_ends

    cum = _running(tokens)
    return tuple(pack_ends(cum, _tightest(cum, packs), -1).tolist())


def dp_balanced(batch: SampleTable, replicas: int, microbatches: int, group: int = 1) -> np.ndarray:
    """Megatron-LM's ``dp_balanced`` bins (see the module's docstring): packs in order under the
    tightest budget that fits ``microbatches`` per rank, aligned to ``replicas x group``, pack j to
    rank j mod replicas at microbatch m - k + j div replicas (k packs per rank, leading ones empty).

    Megatron's alignment: while the number of packs is not a multiple of ``replicas x group``, the
    last sample of the last pack that holds several moves into a pack of its own at the end
    (Megatron asserts that this never reaches pack 0; here pack 0 may give too)."""
    multiple = replicas * group
    if len(batch) < multiple or microbatches < group:
        raise DflopError(f"dp-balanced packing needs at least {multiple} samples and {group} microbatches "
                         f"per rank (data parallelism {replicas} x virtual-stage group {group}); got "
                         f"{len(batch)} samples and {microbatches} microbatches")
    most = min(microbatches // group, len(batch) // multiple) * multiple  # packs that fit, samples that fill
    ends = list(_pack_ends(tuple(batch.llm_tokens.astype(np.int64).tolist()), most))
    starts = [0] + ends[:-1]
    sizes = [b - a for a, b in zip(starts, ends)]
    pack = np.repeat(np.arange(len(ends)), sizes)  # each sample's pack
    packs, last = len(ends) + (-len(ends) % multiple), len(ends) - 1
    for new in range(len(ends), packs):
        while sizes[last] == 1:
            last -= 1
        sizes[last] -= 1
        pack[starts[last] + sizes[last]] = new
    return (pack % replicas) * microbatches + microbatches - packs // replicas + pack // replicas


def vpp_group(plan: Plan) -> int:
    """Megatron's ``microbatch_group_size_per_vp_stage`` (its default: the pipeline size) for a plan
    with virtual stages whose microbatches come in whole groups; 1 otherwise."""
    group = plan.llm.pp if plan.virtual_stages > 1 else 1
    return group if plan.microbatches % group == 0 else 1


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
                               Batching.TOKENS: token_budget, Batching.DP_BALANCED: dp_balanced}
"""The data-blind (or cost-blind) rules of the baselines, by name."""
CHUNKS: dict[Batching, Callable[[SampleTable, int], np.ndarray]] = {
    Batching.ARRIVAL: arrival_chunks, Batching.MODALITY: modality_chunks, Batching.TOKENS: token_chunks}
"""Each rule's chunks (0 .. bins-1) before ``dispatch`` deals them to (replica, microbatch): they
depend on the number of bins alone, so a search over many bin grids cuts each batch once per count."""


def assign(rule: Batching, batch: SampleTable, replicas: int, microbatches: int, group: int = 1) -> np.ndarray:
    """Bins of ``batch`` under a baseline ``rule`` (BALANCED is the scheduler's, not here); ``group``
    is ``vpp_group`` of the plan, which only ``DP_BALANCED`` reads."""
    rule = Batching(rule)
    if rule is Batching.DP_BALANCED:
        return dp_balanced(batch, replicas, microbatches, group)
    return RULES[rule](batch, replicas, microbatches)
