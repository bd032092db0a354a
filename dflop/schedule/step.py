"""Scheduling one global batch for a plan: costs, partition, slots, order.

Each sample's cost on a module is its *marginal* time on that module's
busiest pipeline stage at the expected microbatch size, t(avg + sample) -
t(avg), from the cost model: summing these predicts a bin's time far better
than each sample's time alone would (a lone sample runs at small-kernel
efficiency). The encoder's cost is scaled by (LLM replicas / encoder
replicas), since encoder microbatch k is the union of a column of LLM bins
spread over the encoder replicas. With colocated placement the first LLM stage
also runs the encoder, so its two dimensions are stage 0 and the busiest other
stage. With heterogeneous placement the bins balance the LLM alone: each
sample's encoder replica is a second assignment of its own
(``routing.encoder_ranks``), balanced over the whole step.

Two candidates are built for a data-aware solver. The fixed count (the
paper's): replicas x microbatches bins, none empty, the largest as small as
possible. It has to cut the batch into that many bins however few samples
there are, so one heavy sample (a long video) sets its replica's pace while
that replica still runs m - 1 more microbatches. The per-replica one
(:func:`per_replica_bins`): the samples balanced over the replicas by their
totals, then each replica's split into at most m bins, run in its last
microbatches; a replica may run fewer (its leading microbatches empty, which
costs nothing). The faster is kept: timed by the evaluator when one is given,
else by :func:`pipeline_estimate` (not for a disaggregated plan, whose encoder
it cannot see); a tie keeps the fixed count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflop.cost.protocol import CostModel, StageSpec, WorkShape
from dflop.cost.system import System
from dflop.errors import DflopError
from dflop.schedule.batching import Batching, assign, synchronised, vpp_group
from dflop.schedule.heuristics import lpt_groups
from dflop.schedule.problem import REL_EPS, Partition, PartitionProblem, Status
from dflop.schedule.slots import pick, slot_bins, tail_slots
from dflop.schedule.solve import partition
from dflop.specs import scheduling
from dflop.specs.loading import save_json
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Plan
from dflop.workload.sample import SampleTable

DATA_BLIND = ("sequential", "random")


@dataclass(frozen=True, eq=False)
class StepSchedule:
    """One global batch split into (LLM replica x microbatch) bins."""

    ids: tuple[str, ...]
    """Sample ids of the batch, in batch order."""
    assignment: np.ndarray
    """Bin ``r * microbatches + k`` of every sample (replica r's microbatch k)."""
    replicas: int
    microbatches: int
    partition: Partition | None = None
    """The plan's bins as the solver left them (a per-replica schedule's empty ones load nothing):
    the heaviest, the problem's lower bound, the gap between them."""
    order: str = "as-solved"

    def bins(self) -> list[list[list[str]]]:
        """``bins[r][k]`` -> sample ids."""
        out: list[list[list[str]]] = [[[] for _ in range(self.microbatches)] for _ in range(self.replicas)]
        for sample, b in zip(self.ids, self.assignment):
            out[b // self.microbatches][b % self.microbatches].append(sample)
        return out

    def to_json(self) -> dict[str, Any]:
        report = {}
        if self.partition is not None:
            p = self.partition
            report = {"makespan": p.makespan, "lower_bound": p.lower_bound, "gap": p.gap,
                      "status": p.status, "solver": p.solver, "seconds": p.seconds}
        return {"replicas": self.replicas, "microbatches": self.microbatches, "order": self.order,
                "per_rank": list(self.per_rank()), "bins": self.bins(), **report}

    def per_rank(self) -> tuple[int, ...]:
        """Microbatches each replica runs (its non-empty bins)."""
        counts = np.bincount(self.assignment, minlength=self.replicas * self.microbatches)
        return tuple(int(n) for n in (counts.reshape(self.replicas, self.microbatches) > 0).sum(axis=1))

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "schedule") -> "StepSchedule":
        try:
            replicas, m, bins = int(data["replicas"]), int(data["microbatches"]), data["bins"]
            ids, assignment = [], []
            for r, row in enumerate(bins):
                for k, members in enumerate(row):
                    for sample in members:
                        ids.append(str(sample))
                        assignment.append(r * m + k)
        except (KeyError, TypeError, ValueError) as exc:
            raise DflopError(f"{where}: not a step schedule ({exc})") from None
        return cls(tuple(ids), np.array(assignment, dtype=np.int64), replicas, m, order=data.get("order", ""))

    def save(self, path: str | Path) -> Path:
        return save_json(path, self.to_json())  # readers never see half a schedule

    def aligned(self, batch: SampleTable) -> np.ndarray:
        """The assignment in ``batch``'s row order (for schedules read back from JSON)."""
        where = {sample: b for sample, b in zip(self.ids, self.assignment)}
        try:
            return np.array([where[str(i)] for i in batch.ids], dtype=np.int64)
        except KeyError as exc:
            raise DflopError(f"schedule has no bin for sample {exc}") from None


def _heaviest(cost: CostModel, specs: list[StageSpec], avg: WorkShape, sample: WorkShape) -> np.ndarray:
    """Marginal fwd+bwd seconds of each sample on the stage that is busiest at ``avg``."""
    best, best_time = None, -1.0
    for spec in specs:
        at_avg = cost.stage_cost(spec, avg)
        t = float(at_avg.fwd + at_avg.bwd)
        if t > best_time:
            best, best_time = spec, t
    with_sample = cost.stage_cost(best, avg + sample)
    return np.maximum(np.asarray(with_sample.fwd + with_sample.bwd, dtype=float) - best_time, 0.0)


def cost_dimensions(plan: Plan) -> tuple[Module, ...]:
    """The module each column of :func:`plan_costs` mostly measures (colocated, the first column is
    LLM stage 0 with the encoder inside it)."""
    if plan.colocated:
        return (Module.LLM,) if plan.llm.pp == 1 else (Module.LLM, Module.LLM)
    if plan.heterogeneous:
        return (Module.LLM,)
    return (Module.ENCODER, Module.LLM)


def plan_costs(batch: SampleTable, plan: Plan, model: MLLMSpec, cost: CostModel) -> np.ndarray:
    """(samples, dimensions) predicted seconds per sample on each balanced dimension
    (:func:`cost_dimensions`)."""
    tiles = batch.tiles.astype(float)
    llm_layers = plan.stage_layers(Module.LLM, model)
    llm_specs = [StageSpec.of(Module.LLM, llm_layers, i, plan.llm.tp) for i in range(len(llm_layers))]
    per_sample = WorkShape.per_sample(batch)
    avg = per_sample.total(plan.bins)
    if plan.heterogeneous:  # the encoder's work is balanced apart, over its own replicas
        return _heaviest(cost, llm_specs, avg, per_sample)[:, None]
    if plan.colocated:
        enc = StageSpec(Module.ENCODER, model.encoder.layers, plan.llm.tp, first=True, last=True)
        first = _heaviest(cost, [llm_specs[0]], avg, per_sample) + \
            _heaviest(cost, [enc], WorkShape(avg.samples, avg.tiles), WorkShape(per_sample.samples, tiles))
        if len(llm_specs) == 1:
            return first[:, None]
        return np.stack([first, _heaviest(cost, llm_specs[1:], avg, per_sample)], axis=1)
    enc_layers = plan.stage_layers(Module.ENCODER, model)
    enc_specs = [StageSpec.of(Module.ENCODER, enc_layers, i, plan.encoder.tp) for i in range(len(enc_layers))]
    chunks = plan.encoder.dp * plan.microbatches
    enc_avg = WorkShape(len(batch) / chunks, tiles.sum() / chunks)
    enc = _heaviest(cost, enc_specs, enc_avg, WorkShape(np.ones(len(batch)), tiles)) * plan.llm.dp / plan.encoder.dp
    return np.stack([enc, _heaviest(cost, llm_specs, avg, per_sample)], axis=1)


def pipeline_estimate(loads: np.ndarray, stages: int) -> float:
    """Step seconds a slotting of bins predicts without simulating (``loads``: replicas x microbatches
    x cost dimensions, zeros for empty bins): each replica's pipeline runs its microbatches back to
    back on its busiest stage and fills and drains once with its largest, sum + (stages - 1) x max
    in each dimension (1F1B on equal stages); the step waits for the slowest replica. It does not see
    the order of a disaggregated encoder's microbatches (column k of every replica), which the
    per-replica candidate makes heavier towards the end: a disaggregated plan's candidate is judged
    by an evaluator alone."""
    return float((loads.sum(axis=1) + (stages - 1) * loads.max(axis=1)).max())


@dataclass(frozen=True, eq=False)
class ReplicaBins:
    """The per-replica candidate's bins, before slotting."""

    partition: Partition
    """The items balanced over the replicas."""
    bin_of: np.ndarray
    """Bin of every item; each replica's bins are consecutive, in replica order."""
    replica_of: np.ndarray
    """Replica of every bin."""
    loads: np.ndarray
    """(bins, dimensions) summed costs."""


def per_replica_bins(problem: PartitionProblem, replicas: int, microbatches: int,
                     solve: Callable[[PartitionProblem, float], Partition], at_once: bool = False) -> ReplicaBins:
    """The per-replica candidate's bins of ``problem`` (whose bins are the plan's): the items
    balanced over the replicas by their totals (each replica within ``microbatches`` bins' caps),
    then each replica's items split into min(``microbatches``, its items) bins under the per-bin
    caps: a replica of at most that many items runs each alone, with nothing to balance, and only
    the others are solved (at thousands of replicas, most hold a few samples). ``solve(problem,
    share)`` solves with ``share`` of the candidate's time: half for the replicas, half for the
    splits; ``at_once``, the splits are LPT's, every replica's together (``lpt_groups``: the
    optimizer's thousands of them). Raises :class:`DflopError` where a split fails (a replica's
    items fit no split under the caps)."""
    caps = None if problem.caps is None else problem.caps * microbatches
    over = solve(PartitionProblem(problem.costs, replicas, problem.resources, caps, problem.ids), 0.5)
    counts = np.bincount(over.assignment, minlength=replicas)
    k = np.minimum(counts, microbatches)  # bins of each replica, numbered replica by replica
    first = np.cumsum(k) - k
    starts = np.cumsum(counts) - counts
    by_replica = np.argsort(over.assignment, kind="stable")  # each replica's items, in item order
    rank = np.empty(problem.n, dtype=np.int64)
    rank[by_replica] = np.arange(problem.n) - np.repeat(starts, counts)
    bin_of = first[over.assignment] + rank  # each alone; the larger replicas' splits below
    big = np.flatnonzero(counts > microbatches)
    if at_once and len(big):
        mine = np.flatnonzero(counts[over.assignment] > microbatches)
        local = lpt_groups(PartitionProblem(problem.costs[mine], microbatches * len(big),
                                            None if problem.resources is None else problem.resources[mine],
                                            problem.caps), np.searchsorted(big, over.assignment[mine]),
                           np.full(len(big), microbatches))
        bin_of[mine] = first[over.assignment[mine]] + local
    else:
        for r in big:
            mine = by_replica[starts[r]:starts[r] + counts[r]]
            part = solve(PartitionProblem(problem.costs[mine], microbatches,
                                          None if problem.resources is None else problem.resources[mine], problem.caps,
                                          None if problem.ids is None else [problem.ids[i] for i in mine]),
                         0.5 / len(big))
            bin_of[mine] = first[r] + part.assignment
    bins = int(k.sum())
    loads = np.stack([np.bincount(bin_of, weights=problem.costs[:, d], minlength=bins)
                      for d in range(problem.dims)], axis=1)
    return ReplicaBins(over, bin_of, np.repeat(np.arange(replicas), k), loads)


def in_bins(problem: PartitionProblem, assignment: np.ndarray, solved: Partition) -> Partition:
    """A per-replica schedule as a partition of the plan's bins (``finish`` refuses empty ones): its
    heaviest bin against the bins' lower bound, searched as the replicas were."""
    loads = problem.loads(assignment)
    makespan, bound = float(loads.max()), problem.lower_bound()
    status = Status.OPTIMAL if makespan <= bound * (1 + REL_EPS) else \
        Status.HEURISTIC if solved.status is Status.HEURISTIC else Status.FEASIBLE
    return Partition(assignment, makespan, bound, status, solved.solver, solved.seconds, loads)


def varies(plan: Plan, solver: str) -> bool:
    """Whether the per-replica candidate applies: data-aware bins, several replicas and microbatches,
    and replicas that meet only at the step's end (with ZeRO-3 they meet before every op, so a
    replica with fewer microbatches would only wait for the others; see ``synchronised``). Every
    placement runs leading empty microbatches as nothing (a heterogeneous plan's encoder phase
    chunks each rank's encoder work by the plan's count whatever the LLM's bins)."""
    return (solver not in DATA_BLIND and plan.llm.dp > 1 and plan.microbatches > 1
            and not plan.strategy.shards_parameters)


def schedule_batch(batch: SampleTable, plan: Plan, *, costs: np.ndarray, solver: str = "auto",
                   time_limit: float = 0.5, caps: np.ndarray | None = None, seed: int = 0,
                   backend: str = "cbc", order: str = "light-ends",
                   evaluate: Callable[[np.ndarray], float] | None = None,
                   partitioner: Callable[[PartitionProblem], Partition] | None = None,
                   variable: bool = True) -> StepSchedule:
    """Partition ``batch`` into the plan's bins with ``solver`` (with ``variable``, the per-replica
    candidate too, where it applies).

    Data-blind solvers keep what data-blind frameworks do: bins in arrival order
    straight onto (replica, microbatch) slots. Data-aware ones slot and order the
    bins (see :mod:`dflop.schedule.slots`); ``evaluate`` times candidate orders,
    and the per-replica candidate against the fixed count (see the module's docstring;
    its solves share half of ``time_limit``, so a step takes at most 1.5 times it).
    ``caps`` bound (LLM tokens, tiles) per bin. ``partitioner`` replaces the solver (the
    optimizer's inner loop uses a cheaper one).
    """
    solver = scheduling.solver(solver).value
    resources = None
    if caps is not None:
        resources = np.stack([batch.llm_tokens, batch.tiles], axis=1).astype(float)
    problem = PartitionProblem(costs, plan.bins, resources, caps, batch.ids)

    def solve(p: PartitionProblem, limit: float = time_limit, how: str = solver) -> Partition:
        return partitioner(p) if partitioner is not None else partition(p, how, time_limit=limit, seed=seed,
                                                                          backend=backend)

    result = solve(problem)
    ids = tuple(str(i) for i in batch.ids)
    dp, m = plan.llm.dp, plan.microbatches
    if solver in DATA_BLIND:
        return StepSchedule(ids, result.assignment, dp, m, result, "arrival")
    timed = _once(evaluate)

    def via(bin_of: np.ndarray) -> Callable[[np.ndarray], float] | None:
        return None if timed is None else lambda slot: timed(slot[bin_of])

    slot, used = slot_bins(result.loads, dp, m, encoder_dim=0 if plan.placement == "disaggregated" else None,
                           order=order, evaluate=via(result.assignment))
    fixed = StepSchedule(ids, slot[result.assignment], dp, m, result, used)
    if not (variable and varies(plan, solver)) or (timed is None and not plan.shares_gpus):
        return fixed  # (the estimate cannot see a disaggregated encoder's columns: only an evaluator judges)
    try:
        # its many small problems by the exchange search alone: an ILP's set-up alone would pass the share
        quick = solver if solver in ("greedy", "lpt", "kk") else "greedy"
        split = per_replica_bins(problem, dp, m, lambda p, share: solve(p, time_limit * share / 2, quick),
                                 at_once=partitioner is not None)
    except DflopError:  # no split of some replica fits the caps: the fixed count stands
        return fixed
    slot, used = pick(lambda how: tail_slots(split.loads, split.replica_of, m, how), order, via(split.bin_of))
    assignment = slot[split.bin_of]
    variable = StepSchedule(ids, assignment, dp, m, in_bins(problem, assignment, split.partition), used)

    def score(s: StepSchedule) -> float:
        return timed(s.assignment) if timed is not None else \
            pipeline_estimate(problem.loads(s.assignment).reshape(dp, m, -1), plan.llm.pp)

    return variable if score(variable) < score(fixed) else fixed


def _once(evaluate: Callable[[np.ndarray], float] | None) -> Callable[[np.ndarray], float] | None:
    """``evaluate`` timing each assignment once: the candidates' fastest orders meet without being
    simulated again."""
    if evaluate is None:
        return None
    seen: dict[bytes, float] = {}

    def timed(assignment: np.ndarray) -> float:
        key = np.ascontiguousarray(assignment, dtype=np.int64).tobytes()
        if key not in seen:
            seen[key] = evaluate(assignment)
        return seen[key]

    return timed


def bin_batch(batch: SampleTable, plan: Plan, system: System, batching: Batching = Batching.BALANCED, *,
              costs: np.ndarray | None = None, solver: str = "greedy", time_limit: float = 0.5,
              backend: str = "cbc", caps: np.ndarray | None = None,
              partitioner: Callable[[PartitionProblem], Partition] | None = None,
              evaluate: Callable[[np.ndarray], float] | None = None, variable: bool = True) -> StepSchedule:
    """The bins of one global batch for ``plan``: dflop's (``solver``, or ``partitioner``, on the
    per-sample ``costs``, by default the cost model's, candidate orders timed by ``evaluate``, the
    data-parallel ranks' microbatches kept in step; with ``variable``, a rank may run fewer), or a
    baseline's ``batching`` rule. Every caller
    cuts its batches here, so that what the optimizer confirms, what a run schedules, what a torch
    run trains and what a study compares are the same bins."""
    if batching is not Batching.BALANCED:
        ids = tuple(str(i) for i in batch.ids)
        return StepSchedule(ids, assign(batching, batch, plan.llm.dp, plan.microbatches, vpp_group(plan)),
                            plan.llm.dp, plan.microbatches, order=str(batching))
    if costs is None:
        costs = plan_costs(batch, plan, system.model, system.cost)
    schedule = schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=time_limit, backend=backend,
                              caps=caps, partitioner=partitioner, evaluate=evaluate, variable=variable)
    return replace(schedule, assignment=synchronised(plan, schedule.assignment, costs))
