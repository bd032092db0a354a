"""From what a backend saw to what the adaptive correction learns.

Every compute node of an encoder rank or an LLM rank measures one (module,
replica, microbatch) bin; summing a bin's nodes (forward, backward, all its
stages on that rank) gives the time the scheduler predicted for the bin's
samples. The simulator and the torch runtime report the same ``ObservedStep``, so
the correction learns the same way from either.
"""

from __future__ import annotations

import numpy as np

from dflop.backends.base import ObservedStep
from dflop.cost.correction import CostCorrection, bucket_of, by_bucket
from dflop.program.routing import encoder_replicas
from dflop.specs.plan import Module
from dflop.workload.sample import SampleTable


def measured_bins(times: ObservedStep) -> dict[tuple[Module, int, int], float]:
    """Seconds per (module, replica, microbatch) on the last encoder rank and the last LLM rank."""
    graph = times.step.graph
    t = graph.template
    last = {Module(t.groups[-1].module): t.groups[-1].index}
    if not t.colocated:
        last[Module.ENCODER] = t.groups[t.encoder_stages - 1].index
    out: dict[tuple[Module, int, int], float] = {}
    for k, node in enumerate(graph.nodes):
        w = graph.workers[node.worker]
        if node.kind.is_compute and not node.kind.is_encoder_phase and last.get(w.module) == w.group:
            key = (w.module, w.replica, node.microbatch)
            out[key] = out.get(key, 0.0) + float(times.end[k] - times.start[k]) / 1e9
    return out


def feed_correction(correction: CostCorrection, times: ObservedStep, batch: SampleTable, costs: np.ndarray) -> None:
    """Give ``correction`` every measured bin with the per-sample predictions ``costs`` (samples x
    dimensions, as the scheduler used them: the encoder's column scaled by LLM dp / encoder dp) of
    ``batch``, the samples as the scheduler saw them (same rows as the step's)."""
    step = times.step
    plan, assignment = step.runner.plan, step.assignment
    m, buckets = plan.microbatches, bucket_of(batch)
    chunk = None if plan.colocated else encoder_replicas(batch.tiles, assignment, m, plan.encoder.dp)
    for (module, x, k), seconds in measured_bins(times).items():
        if module is Module.LLM:
            members = np.flatnonzero(assignment == x * m + k)
            correction.observe(Module.LLM, by_bucket(costs[:, -1], buckets, members), seconds)
        else:
            members = np.flatnonzero((chunk == x) & (assignment % m == k))
            enc = costs[:, 0] * plan.encoder.dp / plan.llm.dp  # undo the column scaling
            correction.observe(Module.ENCODER, by_bucket(enc, buckets, members), seconds)
