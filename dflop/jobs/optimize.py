"""`dflop optimize`: dflop's plan and the baselines' for a setup, or a given plan assessed the same way."""

from __future__ import annotations

import time
from typing import Callable

from dflop.backends.base import ScheduledBatch
from dflop.backends.sim import SimBackend
from dflop.cost.select import prediction_error
from dflop.plan.evaluate import BatchPool, Estimate
from dflop.plan.report import Baseline, OptimizeResult
from dflop.plan.search import Optimizer
from dflop.specs.progress import Progress
from dflop.plan.space import BASELINES, DFLOP
from dflop.timing.steps import CostedPlan
from dflop.schedule.batching import Batching
from dflop.specs.plan import Plan

from dflop.jobs.setup import Setup
from dflop.schedule.step import bin_batch


def confirm_with_simpy(s: Setup, batches_: int = 2) -> Callable[[Plan, Batching], float]:
    """Step time of a plan in SimPy (link contention on), on the optimizer's first batches."""
    pool = BatchPool(s.data, s.system.training.global_batch, s.config.seed)
    backend = SimBackend(memory=False)

    def confirm(plan: Plan, batching: Batching) -> float:
        steps = [ScheduledBatch(pool[i], bin_batch(pool[i], plan, s.system, batching,
                                                   variable=s.config.scheduler.variable_microbatches).assignment)
                 for i in range(batches_)]
        return backend.run(CostedPlan(plan, s.system), steps).metrics.step_time_mean

    return confirm


def optimize(s: Setup, *, progress: Progress | None = None, baselines: bool = True,
             noise: float | None = None, max_seconds: float | None = None, workers: int = 1) -> OptimizeResult:
    """dflop's plan and the baselines'; speedups also at the cost model's prediction error (``noise``,
    by default the profiled model's held-out error or the analytical model's stated default). After
    ``max_seconds`` the best plan found so far, with what was not searched; the searches spread over
    ``workers`` processes."""
    sigma = prediction_error(s.system.cost)[0] if noise is None else noise
    optimizer = Optimizer(s.problem(), s.system.training.global_batch, confirm=confirm_with_simpy(s),
                          progress=progress, noise=sigma if baselines else 0.0, max_seconds=max_seconds,
                          workers=workers)
    return optimizer.run((DFLOP,), BASELINES if baselines else ())


def assess(s: Setup, plan: Plan) -> OptimizeResult:
    """A given plan, reported as the optimizer reports its choice; the baseline is the same plan on
    arrival-order batches (its twin with dflop's bins is the plan itself), so the speedup is what
    balancing alone buys."""
    plan.validate(s.system.cluster, s.system.model, s.system.training.global_batch)
    optimizer = Optimizer(s.problem(), s.system.training.global_batch)
    start = time.perf_counter()
    mine, blind = (optimizer.ev.extend(Estimate(plan, rule, 0.0), optimizer.first)
                   for rule in (Batching.BALANCED, Batching.ARRIVAL))
    return OptimizeResult(mine, [], [Baseline("same plan", Batching.ARRIVAL, blind, mine)], {},
                          time.perf_counter() - start, optimizer.ideal(), s.system.hardware)
