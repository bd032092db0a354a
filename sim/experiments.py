"""Simulated experiments: the adaptive cost correction against a hidden "true" cost model.

The true world differs from the cost model the scheduler uses: some buckets
of samples (say videos) run slower than predicted. We simulate that by
running the simulator on a batch whose affected samples have proportionally
larger shapes, while the scheduler only sees the original shapes. Three
schedulers are compared on the same batches: one that trusts its predictions,
one that learns a correction from the measured op times (switched on only
when the policy finds it worth it), and an oracle that knows the true costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from dflop.cost.correction import CorrectionPolicy, CostCorrection, bucket_of, by_bucket
from dflop.cost.protocol import CostModel
from dflop.program.costing import StepBuilder, encoder_chunks
from dflop.program.graph import expand
from dflop.program.template import build_template
from dflop.schedule.step import plan_costs, schedule_batch
from dflop.sim.engine import execute
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
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


def _observe(correction: CostCorrection, plan: Plan, batch: SampleTable, assignment: np.ndarray,
             costs: np.ndarray, builder: StepBuilder, ex) -> None:
    """Feed the measured time of every encoder-chunk and LLM-bin op to the correction."""
    buckets = bucket_of(batch)
    t = builder.t
    m = plan.microbatches
    llm_group = t.groups[-1]  # an LLM rank: the ops of bin (r, k) measure the LLM dimension
    llm_dim = costs.shape[1] - 1
    measured: dict[tuple[str, int, int], float] = {}
    offsets, n = [], 0
    for op in t.ops:
        offsets.append(n)
        n += t.groups[op.group].replicas
    chunk = None if t.colocated else encoder_chunks(batch, assignment, plan.llm.dp, m, plan.encoder.dp)
    enc_group = None if t.colocated else t.groups[t.encoder_stages - 1]
    for i, op in enumerate(t.ops):
        g = t.groups[op.group]
        if g is not llm_group and g is not enc_group:
            continue
        module = "llm" if g is llm_group else "encoder"
        for x in range(g.replicas):
            o = offsets[i] + x
            key = (module, x, op.action.microbatch)
            measured[key] = measured.get(key, 0.0) + (ex.end[o] - ex.start[o]) / 1e9
    for (module, x, k), seconds in measured.items():
        if module == "llm":
            members = np.flatnonzero(assignment == x * m + k)
            correction.observe("llm", by_bucket(costs[:, llm_dim], buckets, members), seconds)
        else:
            members = np.flatnonzero((chunk == x) & (assignment % m == k))
            enc = costs[:, 0] * plan.encoder.dp / plan.llm.dp  # undo the column scaling
            correction.observe("encoder", by_bucket(enc, buckets, members), seconds)


def correction_study(*, plan: Plan, model: MLLMSpec, cluster: ClusterSpec, training: TrainingSpec,
                     cost: CostModel, batches: Iterator[SampleTable], steps: int,
                     slowdown: dict[str, float], solver: str = "auto", time_limit: float = 0.2,
                     measure_fraction: float = 0.002) -> CorrectionStudy:
    """Steps of the three schedulers; correcting costs ``measure_fraction`` of a step (timing every
    op); the second solve runs in the background scheduler, off the critical path."""
    template = build_template(plan)
    builder = StepBuilder(template, model=model, cluster=cluster, training=training, cost=cost)
    modules = ("llm",) if plan.placement == "colocated" and plan.llm.pp == 1 else (
        ("llm", "llm") if plan.placement == "colocated" else ("encoder", "llm"))
    correction = CostCorrection()
    policy: CorrectionPolicy | None = None
    study = CorrectionStudy()

    def run(batch: SampleTable, costs: np.ndarray) -> tuple[np.ndarray, float, object]:
        schedule = schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=time_limit)
        truth = inflate(batch, slowdown)
        ex = execute(expand(builder.timing(truth, schedule.assignment)), contention=False, track_memory=False)
        return schedule.assignment, ex.makespan / 1e9, ex

    def makespan(assignment: np.ndarray, costs: np.ndarray) -> float:
        loads = np.stack([np.bincount(assignment, weights=costs[:, d], minlength=plan.bins)
                          for d in range(costs.shape[1])], axis=1)
        return float(loads.max())

    for step in range(steps):
        batch = next(batches)
        predicted = plan_costs(batch, plan, model, cost)
        study.oracle.append(run(batch, plan_costs(inflate(batch, slowdown), plan, model, cost))[1])
        study.predicted.append(run(batch, predicted)[1])
        corrected = correction.apply(predicted, bucket_of(batch), modules)
        if policy is None:
            policy = CorrectionPolicy(overhead_s=measure_fraction * study.predicted[-1])
        if policy.due(step):
            plain = schedule_batch(batch, plan, costs=predicted, solver=solver, time_limit=time_limit)
            fixed = schedule_batch(batch, plan, costs=corrected, solver=solver, time_limit=time_limit)
            policy.update(makespan(plain.assignment, corrected) - makespan(fixed.assignment, corrected))
        used = corrected if policy.enabled else predicted
        assignment, seconds, ex = run(batch, used)
        study.corrected.append(seconds)
        study.enabled.append(policy.enabled)
        _observe(correction, plan, batch, assignment, predicted, builder, ex)
    study.ratios = {m: correction.ratios(m).tolist() for m in dict.fromkeys(modules)}
    return study
