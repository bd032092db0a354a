"""``simulate_pipeline``: one pipeline from per-stage, per-microbatch times."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.errors import DflopError
from dflop.timing.costing import stage_times_timing
from dflop.timing.costs import graph_costs
from dflop.timing.overlap import Overlap, with_overlap
from dflop.program.schedules import build, splits_backward, stages_per_rank
from dflop.program.lowering import lower
from dflop.program.template import build_template
from dflop.sim.engine import execute
from dflop.specs.plan import ModulePlan, Placement, Plan
from dflop.trace.chrome import TraceBuilder
from dflop.trace.metrics import metrics
from dflop.trace.record import record_graph_step, worker_records


@dataclass(frozen=True)
class PipelineResult:
    step_time: float
    """Seconds."""
    bubble_fraction: float
    trace: dict[str, Any]


def _grid(values: Any, stages: int, m: int, name: str) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if a.ndim == 0:
        a = np.full((stages, m), float(a))
    elif a.ndim == 1:
        a = np.repeat(a[:, None], m, axis=1)
    if a.shape != (stages, m):
        raise ValueError(f"{name}: expected shape ({stages}, {m}) (stages x microbatches), got {a.shape}")
    if (a < 0).any():
        raise ValueError(f"{name}: times must not be negative")
    return a


def simulate_pipeline(fwd: Any, bwd: Any, *, schedule: str = "1F1B", microbatches: int | None = None,
                      p2p: float = 0.0, bwd_weight: Any = None, virtual_stages: int | None = None,
                      contention: bool = False, overlap: Overlap | str = Overlap.SEQUENTIAL) -> PipelineResult:
    """Simulate one pipeline.

    ``fwd`` and ``bwd`` are seconds per (stage, microbatch), as arrays of shape
    (stages, microbatches), or per stage, or one number (then ``microbatches``
    says how many); stages count virtual stages (``virtual_stages`` per rank;
    ZBVZeroBubble and DualPipeV always have 2, placed in a V). For schedules that
    split the backward (ZBH1, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)
    ``bwd`` is the input-gradient part and ``bwd_weight`` the weight-gradient part
    (default: ``bwd`` split in half); a full backward costs both.
    ``p2p`` is the seconds of one transfer between adjacent stages on different
    ranks. ``overlap`` costs DualPipeV's overlapped forward-and-backward steps:
    ``"sequential"`` (F + B) or ``"overlapped"`` (max(F, B)); see
    :mod:`dflop.timing.overlap`.
    """
    fwd_a = np.asarray(fwd, dtype=float)
    m = microbatches or (fwd_a.shape[1] if fwd_a.ndim == 2 else None)
    if m is None:
        raise ValueError("give microbatches, or fwd as a (stages, microbatches) array")
    if virtual_stages is None:
        virtual_stages = stages_per_rank(schedule)
    stages = fwd_a.shape[0] if fwd_a.ndim >= 1 else virtual_stages
    if stages % virtual_stages:
        raise DflopError(f"fwd: {stages} stages do not make whole ranks of {virtual_stages} stages")
    pp = stages // virtual_stages
    f = _grid(fwd, stages, m, "fwd")
    b = _grid(bwd, stages, m, "bwd")
    if splits_backward(schedule):
        w = _grid(bwd_weight, stages, m, "bwd_weight") if bwd_weight is not None else b / 2
        i = b if bwd_weight is not None else b / 2
    else:
        w = _grid(bwd_weight, stages, m, "bwd_weight") if bwd_weight is not None else np.zeros_like(b)
        i = b
    program = build(schedule, pp, m, virtual_stages)
    plan = Plan(encoder=ModulePlan(tp=1, dp=1), llm=ModulePlan(tp=1, pp=pp, dp=1), placement=Placement.COLOCATED,
                microbatches=m, schedule=program.name, virtual_stages=virtual_stages)
    template = build_template(plan, program)
    graph = lower(template)
    costs = graph_costs(graph, with_overlap(stage_times_timing(template, f, i, w, p2p), overlap))
    ex = execute(graph, costs, contention=contention, track_memory=False)
    trace = TraceBuilder(workers=worker_records(graph))
    record_graph_step(trace, graph, ex.start, ex.end, step=0, offset_ns=0, step_ns=ex.makespan, costs=costs)
    doc = trace.document()
    return PipelineResult(ex.makespan / 1e9, metrics(doc).bubble_fraction, doc)
