"""The bins of every step: one global batch cut for a plan (dflop's solver or a baseline's rule),
and a run's steps scheduled ahead in the background."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from dflop.backends.base import ScheduledBatch
from dflop.cost.system import System
from dflop.program.evaluate import evaluate
from dflop.program.steps import StepRunner
from dflop.schedule.background import AsyncScheduler
from dflop.schedule.batching import Batching, assign, synchronised
from dflop.schedule.step import StepSchedule, plan_costs, schedule_batch
from dflop.specs.plan import Plan
from dflop.workload.data_profile import batches
from dflop.workload.sample import SampleTable

from dflop.jobs.setup import Setup


def rule_assignment(plan: Plan, batch: SampleTable, batching: Batching) -> np.ndarray:
    """A baseline rule's bins of ``batch`` for ``plan``."""
    return assign(batching, batch, plan.llm.dp, plan.microbatches)


def bin_batch(batch: SampleTable, plan: Plan, system: System, batching: Batching = Batching.BALANCED, *,
              solver: str = "greedy", time_limit: float = 0.5, backend: str = "cbc",
              evaluate: Callable[[np.ndarray], float] | None = None) -> StepSchedule:
    """The bins of one global batch for ``plan``: dflop's (``solver`` on the cost model's per-sample
    costs, candidate orders timed by ``evaluate``, the data-parallel ranks' microbatches kept in
    step), or a baseline's ``batching`` rule. Every job cuts its batches here, so that what the
    optimizer confirms, what a run schedules and what a torch run trains are the same bins."""
    if batching is not Batching.BALANCED:
        ids = tuple(str(i) for i in batch.ids)
        return StepSchedule(ids, rule_assignment(plan, batch, batching), plan.llm.dp, plan.microbatches,
                            order=str(batching))
    costs = plan_costs(batch, plan, system.model, system.cost)
    schedule = schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=time_limit, backend=backend,
                              evaluate=evaluate)
    return replace(schedule, assignment=synchronised(plan, schedule.assignment, costs))


def assigner(s: Setup, runner: StepRunner, solver: str,
             batching: Batching = Batching.BALANCED) -> Callable[[SampleTable], StepSchedule]:
    """The scheduler of a step: the configured solver, with candidate microbatch orders timed by
    the fast evaluator; or a baseline's batching rule."""
    def assign_(batch: SampleTable) -> StepSchedule:
        def timed(assignment: np.ndarray) -> float:
            return evaluate(runner.step(0, batch, assignment).timing).step_ns

        return bin_batch(batch, runner.plan, s.system, batching, solver=solver,
                         time_limit=s.config.scheduler.time_limit, backend=s.config.scheduler.ilp_backend,
                         evaluate=None if solver in ("sequential", "random") else timed)

    return assign_


def schedule_steps(s: Setup, runner: StepRunner, *, steps: int, solver: str, deadline: float | None = None,
                   batching: Batching = Batching.BALANCED) -> tuple[list[ScheduledBatch], dict[str, Any]]:
    """The first ``steps`` global batches, each partitioned ahead in the background (the solver under
    a deadline, the LPT heuristic when it is late), or cut by a baseline's rule."""
    assign_ = assigner(s, runner, solver, batching)
    stream = batches(s.data, s.system.training.global_batch, seed=s.config.seed)
    fallback = assigner(s, runner, "lpt", batching)
    limit = deadline or max(s.config.scheduler.time_limit * 2, 0.5)
    with AsyncScheduler(stream, lambda batch, _: assign_(batch), fallback, deadline=limit) as scheduler:
        pairs = [scheduler.get(step) for step in range(steps)]
        late = scheduler.late
    scheduled = [sch for _, sch in pairs]
    partitions = [sch.partition for sch in scheduled if sch.partition is not None]
    info = {"solver": solver if batching is Batching.BALANCED else str(batching), "late_steps": late,
            "gap_mean": float(np.mean([p.gap for p in partitions])) if partitions else None,
            "statuses": sorted({p.status for p in partitions}),
            "orders": sorted({sch.order for sch in scheduled})}
    return [ScheduledBatch(b, sch.aligned(b)) for b, sch in pairs], info
