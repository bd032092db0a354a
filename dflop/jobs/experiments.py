"""Simulated experiments: the adaptive cost correction against a hidden "true" cost model.

The true world differs from the cost model the scheduler uses: some buckets
of samples (say videos) run slower than predicted (``slowdown``), and every
sample is off by its own lognormal factor (``noise``, the model's per-sample
prediction error, ``dflop.cost.error.perturb``). We simulate that by running
the simulator on a batch whose samples have the true world's shapes, while
the scheduler only sees the original shapes. Three schedulers are compared on
the same batches: one that trusts its predictions, one that learns a
correction from the measured op times (switched on only when the policy finds
it worth it), and an oracle that knows the true costs. A correction by bucket
can learn a systematic error, not a per-sample one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from dflop.backends.base import BackendResult, ScheduledBatch, ObservedStep
from dflop.backends.observe import feed_correction
from dflop.backends.sim import SimBackend
from dflop.cost.correction import CorrectionPolicy, CostCorrection, bucket_of
from dflop.cost.error import perturb
from dflop.cost.system import System
from dflop.timing.steps import CostedPlan
from dflop.schedule.step import bin_batch, cost_dimensions, plan_costs
from dflop.specs.plan import Plan
from dflop.workload.sample import Modality, SampleTable


def inflate(batch: SampleTable, slowdown: dict[str, float]) -> SampleTable:
    """The batch as the true world costs it: samples of a slowed modality get larger shapes."""
    factor = np.ones(len(batch))
    for name, f in slowdown.items():
        factor[batch.modality == Modality(name).code] = f
    return SampleTable(batch.ids, batch.modality, np.rint(batch.tiles * factor).astype(np.int64),
                       np.rint(batch.text_tokens * factor).astype(np.int64),
                       np.rint(batch.image_tokens * factor).astype(np.int64))


@dataclass
class CorrectionStudy:
    predicted: list[float] = field(default_factory=list)
    corrected: list[float] = field(default_factory=list)
    oracle: list[float] = field(default_factory=list)
    enabled: list[bool] = field(default_factory=list)
    ratios: dict[str, list[float]] = field(default_factory=dict)

    def mean(self, mode: str, skip: int = 0) -> float:
        return float(np.mean(getattr(self, mode)[skip:]))


def correction_study(*, plan: Plan, system: System, batches: Iterator[SampleTable], steps: int,
                     slowdown: dict[str, float], noise: float = 0.0, solver: str = "auto", time_limit: float = 0.2,
                     measure_fraction: float = 0.002) -> CorrectionStudy:
    """Steps of the three schedulers; correcting costs ``measure_fraction`` of a step (timing every
    op); the second solve runs in the background scheduler, off the critical path."""
    runner = CostedPlan(plan, system)
    backend = SimBackend(contention=False, memory=False)
    model, cost = system.model, system.cost
    modules = cost_dimensions(plan)
    correction = CostCorrection()
    policy: CorrectionPolicy | None = None
    study = CorrectionStudy()

    def true(batch: SampleTable, step: int) -> SampleTable:
        return perturb(inflate(batch, slowdown), noise, (step, 11))

    def run(batch: SampleTable, step: int, costs: np.ndarray) -> tuple[float, list[ObservedStep]]:
        """One step in the true world, scheduled with ``costs``: (seconds, what was observed)."""
        schedule = bin_batch(batch, plan, system, costs=costs, solver=solver, time_limit=time_limit)
        seen: list[ObservedStep] = []
        result: BackendResult = backend.run(runner, [ScheduledBatch(true(batch, step), schedule.assignment)],
                                            observe=seen.append)
        return result.steps[0]["step_s"], seen

    def makespan(assignment: np.ndarray, costs: np.ndarray) -> float:
        loads = np.stack([np.bincount(assignment, weights=costs[:, d], minlength=plan.bins)
                          for d in range(costs.shape[1])], axis=1)
        return float(loads.max())

    for step in range(steps):
        batch = next(batches)
        predicted = plan_costs(batch, plan, model, cost)
        study.oracle.append(run(batch, step, plan_costs(true(batch, step), plan, model, cost))[0])
        study.predicted.append(run(batch, step, predicted)[0])
        corrected = correction.apply(predicted, bucket_of(batch), modules)
        if policy is None:
            policy = CorrectionPolicy(overhead_s=measure_fraction * study.predicted[-1])
        if policy.due(step):
            plain = bin_batch(batch, plan, system, costs=predicted, solver=solver, time_limit=time_limit)
            fixed = bin_batch(batch, plan, system, costs=corrected, solver=solver, time_limit=time_limit)
            policy.update(makespan(plain.assignment, corrected) - makespan(fixed.assignment, corrected))
        used = corrected if policy.enabled else predicted
        seconds, seen = run(batch, step, used)
        study.corrected.append(seconds)
        study.enabled.append(policy.enabled)
        feed_correction(correction, seen[0], batch, predicted)
    study.ratios = {m: correction.ratios(m).tolist() for m in dict.fromkeys(modules)}
    return study
