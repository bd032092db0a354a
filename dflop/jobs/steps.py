"""A run's steps, each global batch cut into bins (:func:`dflop.schedule.step.bin_batch`) ahead of
training, in the background."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from dflop.backends.base import ScheduledBatch
from dflop.timing.evaluate import evaluate
from dflop.timing.steps import CostedPlan
from dflop.schedule.background import AsyncScheduler
from dflop.schedule.batching import Batching
from dflop.schedule.step import StepSchedule, bin_batch
from dflop.workload.data_profile import batches
from dflop.workload.sample import SampleTable

from dflop.jobs.setup import Setup


def assigner(s: Setup, runner: CostedPlan, solver: str,
             batching: Batching = Batching.BALANCED) -> Callable[[SampleTable], StepSchedule]:
    """The scheduler of a step: the configured solver, with candidate microbatch orders timed by
    the fast evaluator; or a baseline's batching rule."""
    def assign_(batch: SampleTable) -> StepSchedule:
        def timed(assignment: np.ndarray) -> float:
            return evaluate(runner.step(0, batch, assignment).timing).step_ns

        return bin_batch(batch, runner.plan, s.system, batching, solver=solver,
                         time_limit=s.config.scheduler.time_limit, backend=s.config.scheduler.ilp_backend,
                         evaluate=None if solver in ("sequential", "random") else timed,
                         variable=s.config.scheduler.variable_microbatches)

    return assign_


def global_batches(s: Setup) -> Iterator[SampleTable]:
    """The run's global batches, step after step: every arm's, drawn from the data by the run's seed."""
    return batches(s.data, s.system.training.global_batch, seed=s.config.seed)


def schedule_steps(s: Setup, runner: CostedPlan, *, steps: int, solver: str, deadline: float | None = None,
                   batching: Batching = Batching.BALANCED) -> tuple[list[ScheduledBatch], dict[str, Any]]:
    """The first ``steps`` global batches, each partitioned ahead in the background (the solver under
    a deadline, the LPT heuristic when it is late), or cut by a baseline's rule."""
    assign_ = assigner(s, runner, solver, batching)
    stream = global_batches(s)
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
            "orders": sorted({sch.order for sch in scheduled}),
            "fewer_microbatches": [{"step": i, "per_rank": list(sch.per_rank())} for i, sch in enumerate(scheduled)
                                   if min(sch.per_rank()) < sch.microbatches]}
    return [ScheduledBatch(b, sch.aligned(b)) for b, sch in pairs], info
