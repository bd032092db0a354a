"""Simulating a plan step after step on real batches, with the cost model passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from dflop.program.costing import StepBuilder, StepTiming
from dflop.program.graph import expand
from dflop.sim.engine import Execution, execute
from dflop.sim.record import record, worker_records
from dflop.trace.chrome import TraceBuilder
from dflop.trace.metrics import TraceMetrics, metrics
from dflop.workload.sample import SampleTable

Assign = Callable[[int, SampleTable], np.ndarray]
"""(step, batch) -> the bin of every sample of the batch."""
Observer = Callable[[int, SampleTable, np.ndarray, StepTiming, Execution], None]


@dataclass
class Simulation:
    trace: dict[str, Any]
    metrics: TraceMetrics
    steps: list[dict[str, Any]] = field(default_factory=list)


def simulate_steps(builder: StepBuilder, batches: Iterable[SampleTable], assign: Assign, *,
                   contention: bool = True, memory: bool = True, observe: Observer | None = None,
                   meta: dict[str, Any] | None = None) -> Simulation:
    """Run every batch as one step: partition it with ``assign``, cost it with the builder's
    cost model, execute it in SimPy; steps run back to back (the optimizer step is a barrier)."""
    trace = TraceBuilder(meta={"peak_flops": builder.cluster.hardware.peak_flops,
                               "plan": builder.plan.describe(), "cost_model": builder.cost.name,
                               **(meta or {})})
    offset = 0
    steps = []
    for index, batch in enumerate(batches):
        assignment = assign(index, batch)
        timing = builder.timing(batch, assignment)
        graph = expand(timing)
        if index == 0:
            trace.set_workers(worker_records(graph))
        ex = execute(graph, contention=contention, track_memory=memory)
        record(trace, graph, ex, step=index, offset_ns=offset, memory=memory)
        compute_end = int(max(ex.end[o] for o in range(len(graph)) if graph.worker[o] >= 0))
        trace.step(index, offset, offset + compute_end, offset + ex.makespan, samples=len(batch))
        steps.append({"step": index, "step_s": ex.makespan / 1e9, "compute_s": compute_end / 1e9,
                      "oom": len(ex.oom)})
        if observe is not None:
            observe(index, batch, assignment, timing, ex)
        offset += ex.makespan
    doc = trace.document()
    return Simulation(doc, metrics(doc), steps)
