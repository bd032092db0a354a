"""Simulating a plan step after step on real batches, with the cost model passed in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from dflop.timing.steps import Step, CostedPlan
from dflop.sim.engine import Execution, execute
from dflop.trace.chrome import TraceBuilder
from dflop.trace.metrics import TraceMetrics, metrics
from dflop.trace.record import record_graph_step
from dflop.workload.sample import SampleTable

Assign = Callable[[int, SampleTable], np.ndarray]
"""(step, batch) -> the bin of every sample of the batch."""
Observer = Callable[[Step, Execution], None]


@dataclass
class Simulation:
    trace: dict[str, Any]
    metrics: TraceMetrics
    steps: list[dict[str, Any]] = field(default_factory=list)


def trace_meta(runner: CostedPlan, **extra: Any) -> dict[str, Any]:
    return {"peak_flops": runner.system.hardware.peak_flops, "plan": runner.plan.describe(),
            "cost_model": runner.system.cost.name, **extra}


def simulate_steps(runner: CostedPlan, batches: Iterable[SampleTable], assign: Assign, *,
                   contention: bool = True, memory: bool = True, observe: Observer | None = None,
                   meta: dict[str, Any] | None = None, cores: int | None = None) -> Simulation:
    """Run every batch as one step: partition it with ``assign``, cost it with the runner's
    cost model, execute its step graph in SimPy; steps run back to back (the optimizer step is a
    barrier). ``cores``: the CPU cores the ranks share (:func:`dflop.sim.engine.execute`)."""
    trace = TraceBuilder(meta=trace_meta(runner, **(meta or {}), **({"shared_cores": cores} if cores else {})))
    offset = 0
    steps = []
    for index, batch in enumerate(batches):
        step = runner.step(index, batch, assign(index, batch))
        graph, costs = step.graph, step.costs
        ex = execute(graph, costs, contention=contention, track_memory=memory, cores=cores)
        compute_end = record_graph_step(trace, graph, ex.start, ex.end, step=index, offset_ns=offset,
                                        step_ns=ex.makespan, costs=costs, memory=ex.memory if memory else None,
                                        samples=len(batch))
        for event in ex.oom:
            trace.oom.append({**event, "step": index, "ns": event["ns"] + offset,
                              "rank": graph.workers[event["worker"]].name})
        steps.append({"step": index, "step_s": ex.makespan / 1e9, "compute_s": compute_end / 1e9,
                      "oom": len(ex.oom)})
        if observe is not None:
            observe(step, ex)
        offset += ex.makespan
    doc = trace.document()
    return Simulation(doc, metrics(doc), steps)
