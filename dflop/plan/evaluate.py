"""Evaluating candidate plans on global batches sampled from the data.

Every candidate is timed on the *same* sampled batches (common random
numbers), so differences between candidates are not noise from different
batches. Each batch is cut into bins by a batching rule (dflop's scheduler, or
a baseline's rule from ``dflop.schedule.batching``), costed by the cost model
and timed by the fast evaluator, communication included. With a prediction
error ``noise`` the bins are made from the batch as predicted and timed on the
batch as the world costs it (``dflop.cost.error.perturb``). Two cheap checks
come first:

- memory: model state plus the activations of the microbatches the schedule
  keeps in flight, for the largest bin the scheduler may produce (its caps),
  against the GPU's usable memory;
- a lower bound: a stage never finishes before its share of the whole batch,
  since op time is subadditive (one microbatch never costs more than two
  halves): busiest-stage time of the batch as one microbatch / data
  parallelism.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Hashable, TypeVar

import numpy as np

from dflop.cost.error import perturb
from dflop.cost.protocol import CostModel, StageSpec, WorkShape
from dflop.cost.system import System
from dflop.errors import InfeasibleError
from dflop.program.actions import Kind
from dflop.timing.evaluate import evaluate, summarize
from dflop.timing.steps import CostedPlan
from dflop.program.template import plan_groups
from dflop.schedule.batching import CHUNKS, Batching, assign, dispatch, vpp_group
from dflop.schedule.heuristics import lpt, repair
from dflop.schedule.improve import improve
from dflop.schedule.problem import Partition, PartitionProblem, finish
from dflop.schedule.step import bin_batch, plan_costs
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Plan
from dflop.workload.sample import SampleTable

QUICK_GAP = 1e-3
PARTITIONS_KEPT = 256
"""Partitions an evaluator keeps (the oldest go first): enough for the plans one search times
alike, a bounded memory on batches of tens of thousands of samples."""
RUNNERS_KEPT = 65
"""Costed plans an evaluator keeps: a search times one plan's neighbours together."""
T = TypeVar("T")


def _kept(cache: dict[Hashable, T], key: Hashable, make: Callable[[], T], limit: int = PARTITIONS_KEPT) -> T:
    """``cache[key]``, made on a miss; a full cache drops its oldest entry first (memory stays bounded)."""
    if key not in cache:
        if len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[key] = make()
    return cache[key]
CAP_SLACK = 1.3
"""A data-aware bin may hold this many times the average bin's tokens and tiles (of the heaviest
batch in the pool)."""


@dataclass(frozen=True)
class PlanningProblem:
    """What to plan for: the system (model, GPUs, recipe, cost model) and the data."""

    system: System
    data: SampleTable
    seed: int = 0
    variable_microbatches: bool = True
    """dflop's bins may give a rank fewer microbatches (``SchedulerSpec.variable_microbatches``)."""

    @property
    def model(self) -> MLLMSpec:
        return self.system.model

    @property
    def cluster(self) -> ClusterSpec:
        return self.system.cluster

    @property
    def training(self) -> TrainingSpec:
        return self.system.training

    @property
    def cost(self) -> CostModel:
        return self.system.cost


class BatchPool:
    """Seeded global batches; batch i is the same whichever candidate asks and in whatever order."""

    def __init__(self, data: SampleTable, global_batch: int, seed: int) -> None:
        self.data, self.size, self.seed = data, global_batch, seed
        self._cache: dict[int, SampleTable] = {}

    def __getitem__(self, i: int) -> SampleTable:
        if i not in self._cache:
            rng = np.random.default_rng((self.seed, i))
            rows = rng.integers(0, len(self.data), size=self.size)
            self._cache[i] = self.data.take(rows).with_ids([f"b{i}:{k}" for k in range(self.size)])
        return self._cache[i]


@dataclass
class Estimate:
    plan: Plan
    batching: Batching
    lower_bound: float
    steps: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    imbalance: list[float] = field(default_factory=list)
    """Largest bin load over the mean bin load (1 = perfectly balanced)."""
    mfu: list[float] = field(default_factory=list)
    hfu: list[float] = field(default_factory=list)
    """Hardware FLOPs utilisation: recomputed FLOPs count as work."""
    peak_memory: float = 0.0
    within: Batching | None = None
    """dflop's bins kept within the largest bins this baseline rule makes (not the evaluator's own
    caps): a baseline's plan given dflop's bins, sized as it was sized."""
    simulated: float | None = None
    """Step time in the SimPy simulator (with link contention), when confirmed."""
    at_error: float | None = None
    """Step time on all ``most`` batches when the world's costs differ from the predictions the
    bins were made from (the optimizer's ``noise``), when timed."""
    infeasible: bool = False
    """Some batch could not be split within the bin caps the memory check assumed."""

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def mean(self) -> float:
        return float(np.mean(self.steps)) if self.steps else float("inf")

    @property
    def ci(self) -> float:
        """Half-width of the 95% confidence interval of the mean."""
        if self.n < 2:
            return float("inf")
        return 1.96 * float(np.std(self.steps, ddof=1)) / np.sqrt(self.n)

    def summary(self) -> dict:
        return {"plan": self.plan.describe(), "batching": str(self.batching), "step_time_s": self.mean,
                "ci95_s": float(self.ci), "batches": self.n,
                "bubble_fraction": float(np.mean(self.bubble)), "idle_fraction": float(np.mean(self.idle)),
                "imbalance": float(np.mean(self.imbalance)), "mfu": float(np.mean(self.mfu)),
                "hfu": float(np.mean(self.hfu)), "peak_memory_gib": self.peak_memory / 2**30,
                "simulated_step_time_s": self.simulated}


def quick(problem: PartitionProblem, start: np.ndarray | None = None) -> Partition:
    """The scheduler's heuristic path with bounded effort: LPT (or ``start``, when LPT finds no
    room under the caps), then local search with the 64 lightest partners until within 0.1% of
    the bound or K rounds. Deterministic; ranks plans as the full scheduler would, at a fraction
    of its cost on batches of thousands of samples."""
    began = time.perf_counter()
    target = problem.lower_bound() * (1 + QUICK_GAP)
    try:
        first = lpt(problem)
    except InfeasibleError:
        if start is None:
            raise
        first = repair(problem, np.asarray(start, dtype=np.int64))  # a rule may leave bins empty
    assignment = improve(problem, first, target=target, max_rounds=problem.bins)
    return finish(problem, assignment, "quick", time.perf_counter() - began, searched=True)


def bins_key(plan: Plan) -> tuple:
    """What a plan's bins of a batch depend on: the bin grid, the per-sample costs' stages
    (``plan_costs``: layers, TP and replicas of each module, placement), and whether the replicas'
    microbatches are kept in step (``synchronised``: sharded parameters)."""
    return (plan.placement, plan.llm.tp, plan.llm.dp, plan.llm.pp, plan.llm.layers_per_stage, plan.virtual_stages,
            plan.encoder.tp, plan.encoder.dp, plan.encoder.pp, plan.encoder.layers_per_stage, plan.microbatches,
            plan.strategy.shards_parameters)


@lru_cache(maxsize=1024)
def inflight_by_stage(schedule: str, stages: int, microbatches: int,
                      virtual: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the (stage, microbatch) activations it holds per stage it holds (in stage order)
    at every moment that may be its memory peak: after each forward, those that no other moment
    matches or exceeds on every stage. An activation is held from its forward until its B or W; an
    overlapped F&B step counts its forward before its backward frees anything, as both are live
    together. With one stage per rank this is the one peak count."""
    from dflop.program.schedules import build

    program = build(schedule, stages // virtual, microbatches, virtual)
    out = []
    for rank in range(program.num_ranks):
        index = {s: k for k, s in enumerate(program.stages_of(rank))}
        held, moments = [0] * len(index), set()
        for a in program.parts(rank):
            if a.kind is Kind.F:
                held[index[a.stage]] += 1
                moments.add(tuple(held))
            elif a.kind in (Kind.B, Kind.W):
                held[index[a.stage]] -= 1
        kept: list[tuple[int, ...]] = []  # a moment exceeded on every stage has a smaller sum
        for m in sorted(moments, key=sum, reverse=True):
            if not any(all(x >= y for x, y in zip(k, m)) for k in kept):
                kept.append(m)
        out.append(tuple(kept))
    return tuple(out)


def inflight(schedule: str, stages: int, microbatches: int, virtual: int) -> tuple[int, ...]:
    """Most (stage, microbatch) activations each rank holds at once, over all the stages it holds
    (both arms of a V)."""
    return tuple(max(sum(m) for m in rank) for rank in inflight_by_stage(schedule, stages, microbatches, virtual))


class Evaluator:
    def __init__(self, problem: PlanningProblem, pool: BatchPool, cap_batches: int = 12, noise: float = 0.0) -> None:
        self.p, self.pool, self.noise = problem, pool, noise
        data = problem.data
        self.cap_batches = cap_batches
        batches = [pool[i] for i in range(cap_batches)]
        self.heaviest_tokens = max(float(b.llm_tokens.sum()) for b in batches)
        self.heaviest_tiles = max(float(b.tiles.sum()) for b in batches)
        self.mean_tokens = float(data.llm_tokens.mean())
        self.mean_tiles = float(data.tiles.mean())
        self.mean_targets = float(data.targets.mean())
        self.max_tokens = float(data.llm_tokens.max())
        self.max_tiles = float(data.tiles.max())
        self._runners: dict[Plan, CostedPlan] = {}
        self._blind: dict[tuple, tuple[float, float]] = {}
        self._rules: dict[tuple, np.ndarray] = {}
        self._whole: dict[tuple, np.ndarray] = {}
        self._partitions: dict[tuple, Partition] = {}
        self._bins: dict[tuple, tuple[np.ndarray, float]] = {}

    def with_noise(self, noise: float) -> "Evaluator":
        """The same evaluator (batches, bins and every cache shared) timing a world whose costs
        differ from the predictions by ``noise``."""
        twin = copy.copy(self)
        twin.noise = noise
        return twin

    # ---- caps and memory ----------------------------------------------------------------------

    def caps(self, plan: Plan) -> np.ndarray:
        """(LLM tokens, tiles) a data-aware bin may hold; at least 1, so data without any tiles
        (text only) still has a cap the partitioner accepts."""
        return np.array([max(self.max_tokens, CAP_SLACK * self.heaviest_tokens / plan.bins, 1.0),
                         max(self.max_tiles, CAP_SLACK * self.heaviest_tiles / plan.bins, 1.0)])

    def worst_bins(self, plan: Plan, batching: Batching) -> tuple[float, float]:
        """(LLM tokens, tiles) of the largest bin the plan may get on the batches it is judged on:
        the caps for dflop's scheduler, the largest bin a baseline's rule makes (the same for
        every grid of as many bins: dealing chunks to bins only renames them)."""
        if batching is Batching.BALANCED:
            cap = self.caps(plan)
            return float(cap[0]), float(cap[1])
        key = (batching, plan.bins) if batching in CHUNKS else (batching, *self._grid(plan))
        if key not in self._blind:
            tokens = tiles = 0.0
            for i in range(self.cap_batches):
                b = self.pool[i]
                a = self.rule_bins(batching, i, plan)
                tokens = max(tokens, float(np.bincount(a, weights=b.llm_tokens, minlength=plan.bins).max()))
                tiles = max(tiles, float(np.bincount(a, weights=b.tiles, minlength=plan.bins).max()))
            self._blind[key] = (tokens, tiles)
        return self._blind[key]

    def chunks(self, batching: Batching, i: int, bins: int) -> np.ndarray:
        """A baseline rule's chunks of pool batch i, cut once per number of bins."""
        key = (batching, i, bins)
        if key not in self._rules:
            self._rules[key] = CHUNKS[batching](self.pool[i], bins)
        return self._rules[key]

    @staticmethod
    def _grid(plan: Plan) -> tuple[int, int, int]:
        return plan.llm.dp, plan.microbatches, vpp_group(plan)

    def rule_bins(self, batching: Batching, i: int, plan: Plan) -> np.ndarray:
        """Bins of pool batch i under a baseline rule, as ``bin_batch`` makes them (the rule's
        chunks dealt to the plan's bin grid; a rule without chunks, once per grid)."""
        if batching in CHUNKS:
            return dispatch(self.chunks(batching, i, plan.bins), plan.llm.dp, plan.microbatches)
        key = (batching, i, *self._grid(plan))
        if key not in self._rules:
            self._rules[key] = assign(batching, self.pool[i], *self._grid(plan))
        return self._rules[key]

    # ---- lower bound ----------------------------------------------------------------------------

    def _whole_batch(self, spec: StageSpec, n: int) -> np.ndarray:
        """fwd+bwd seconds of ``spec`` on each of the first n batches taken as one microbatch."""
        key = (spec, n)
        if key not in self._whole:
            shapes = [self.pool[i] for i in range(n)]
            tokens = np.array([b.llm_tokens.sum() for b in shapes], dtype=float)
            sq = np.array([(b.llm_tokens.astype(float) ** 2).sum() for b in shapes])
            tiles = np.array([b.tiles.sum() for b in shapes], dtype=float)
            targets = np.array([b.targets.sum() for b in shapes], dtype=float)
            c = self.p.cost.stage_cost(spec, WorkShape(self.pool.size, tiles, tokens, sq, targets))
            self._whole[key] = np.broadcast_to(np.asarray(c.fwd + c.bwd, dtype=float), (n,))
        return self._whole[key]

    def lower_bound(self, plan: Plan, n: int) -> float:
        """Mean over the first n batches of the busiest pipeline rank's share of the whole batch
        taken as one microbatch, over the stages its schedule places on it."""
        model, rc = self.p.model, plan.recompute
        ranks = []
        for g in plan_groups(plan):
            layers = plan.stage_layers(g.module, model)
            work = sum(self._whole_batch(StageSpec.of(g.module.value, layers, s, g.tp, rc), n) for s in g.stages)
            if plan.strategy.carries_encoder(g.module, g.stages):
                work = work + self._whole_batch(StageSpec(Module.ENCODER, model.encoder.layers, g.tp, first=True,
                                                          last=True, recompute=rc), n)
            ranks.append(work / g.replicas)
        ranks = np.stack(ranks)
        bound = np.max(ranks, axis=0)
        if plan.heterogeneous:  # each rank runs its LLM work and its encoder phase one after the other: on
            # average over the ranks at least the mean LLM share plus an encoder replica's mean share, on the
            # share of the job's GPUs that hold replicas
            encoder = self._whole_batch(StageSpec(Module.ENCODER, model.encoder.layers, plan.encoder.tp, first=True,
                                                  last=True, recompute=rc), n)
            held = plan.encoder.gpus / plan.llm.gpus
            bound = np.maximum(bound, np.mean(ranks, axis=0) + encoder / plan.encoder.dp * held)
        return float(np.mean(bound))

    # ---- evaluation -----------------------------------------------------------------------------

    def runner(self, plan: Plan) -> CostedPlan:
        return _kept(self._runners, plan, lambda: CostedPlan(plan, self.p.system), RUNNERS_KEPT)

    def assignment(self, plan: Plan, i: int, batching: Batching,
                   within: Batching | None = None) -> tuple[np.ndarray, float]:
        """Bins of pool batch i, as the scheduler (or a baseline's rule) makes them, and how uneven
        they are in predicted cost (largest bin over the mean of those holding samples); once per bin
        grid and what the per-sample costs read (``bins_key``), which plans alike but for their memory
        options, recomputation or schedule share, and so do the evaluator and its noisy twin."""
        return _kept(self._bins, (i, batching, within, *bins_key(plan)),
                     lambda: self._assignment(plan, i, batching, within))

    def _assignment(self, plan: Plan, i: int, batching: Batching,
                    within: Batching | None) -> tuple[np.ndarray, float]:
        batch = self.pool[i]
        costs = plan_costs(batch, plan, self.p.model, self.p.cost)
        if batching is Batching.BALANCED:
            if within is None:
                caps, start = self.caps(plan), None
            else:  # within a baseline's largest bins: from its own bins when LPT finds no room
                caps, start = np.array(self.worst_bins(plan, within)), self.rule_bins(within, i, plan)
            partitioner = self._partitioner(i, start, plan.bins)
            assignment = bin_batch(batch, plan, self.p.system, costs=costs, caps=caps, partitioner=partitioner,
                                   variable=self.p.variable_microbatches).assignment
        else:
            assignment = self.rule_bins(batching, i, plan)
        loads = np.stack([np.bincount(assignment, weights=costs[:, d], minlength=plan.bins)
                          for d in range(costs.shape[1])], axis=1)
        worst = loads.max(axis=1)[np.bincount(assignment, minlength=plan.bins) > 0]  # (a rank may leave some empty)
        return assignment, float(worst.max() / max(worst.mean(), 1e-30))

    def _partitioner(self, i: int, start: np.ndarray | None, bins: int) -> Callable[[PartitionProblem], Partition]:
        """``quick`` on pool batch i, solved once per problem (costs, resources, caps, bins) and
        start: plans that differ only in what the per-sample costs do not see (memory options,
        recomputation, schedule) share one partition, and so do the evaluator and its noisy twin.
        The scheduler also asks for the batch split over the replicas and for each replica's split
        (:func:`dflop.schedule.step.per_replica_bins`): ``start``, the whole batch in the plan's
        ``bins``, starts only the problem of the whole batch in that many bins."""
        def digest(a: np.ndarray | None) -> bytes:
            return b"" if a is None else hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()

        def solve(problem: PartitionProblem) -> Partition:
            first = start if start is not None and (problem.n, problem.bins) == (len(start), bins) else None
            key = (i, problem.bins, *map(digest, (problem.costs, problem.resources, problem.caps, first)))
            return _kept(self._partitions, key, lambda: quick(problem, first))

        return solve

    def world(self, i: int) -> SampleTable:
        """Pool batch i as the world costs it (with the evaluator's prediction error)."""
        return perturb(self.pool[i], self.noise, (self.pool.seed, i, 7))

    def extend(self, estimate: Estimate, upto: int) -> Estimate:
        """Time the plan on batches estimate.n .. upto-1."""
        runner = self.runner(estimate.plan)
        peak = self.p.cluster.hardware.peak_flops
        for i in range(estimate.n, upto):
            try:
                assignment, imbalance = self.assignment(estimate.plan, i, estimate.batching, estimate.within)
            except InfeasibleError:
                estimate.infeasible = True
                return estimate
            timing = runner.step(i, self.world(i), assignment).timing
            summary = summarize(timing, evaluate(timing))
            mfu, hfu = summary.utilisation(peak)
            estimate.steps.append(summary.step_s)
            estimate.bubble.append(summary.bubble_fraction)
            estimate.idle.append(summary.idle_fraction)
            estimate.imbalance.append(imbalance)
            estimate.mfu.append(mfu)
            estimate.hfu.append(hfu)
            estimate.peak_memory = max(estimate.peak_memory, float(summary.peak_memory.max()))
        return estimate
