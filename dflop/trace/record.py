"""The one recorder: what happened to a step graph's nodes, as trace events.

Both runtimes call it with the same graph and their own times (simulated or
measured), so the two traces of a step hold the same events with the same
names and arguments: compute nodes on a worker's compute thread, sends,
receives and collectives on its communication thread, and, when the costs say a
compute node has communication running inside it (FSDP's per-layer gathers and
reductions), that communication as an ``overlapped`` event beside it (a
prediction, so it has no ``seq``: only the simulator writes it). ``seq`` is the node's
position in its worker's order, which is how traces from two runtimes are
lined up.
"""

from __future__ import annotations

from typing import Any, Sequence

from dflop.program.actions import Kind
from dflop.timing.costs import StepCosts
from dflop.program.stepgraph import StepGraph
from dflop.specs.plan import Module
from dflop.trace.chrome import COMM, COMPUTE, TraceBuilder

RECV = "recv"
"""Category of receive events: they mark arrivals; the transfer itself is drawn by the send."""
OVERLAPPED = "overlapped"
"""Category of communication inside a compute node (drawn from its start for its summed length)."""


def worker_records(graph: StepGraph, costs: StepCosts | None = None,
                   capacity: float | None = None) -> list[dict[str, Any]]:
    out = []
    for w in graph.workers:
        record = {"name": w.name, "module": str(w.module), "rank": w.pp_rank, "replica": w.replica,
                  "gpus": list(w.gpus)}
        if graph.template.plan.heterogeneous:
            record["encoder_phase"] = True  # it takes part in the phase (ENCODE, the all-to-alls), if only
            # to receive: its GPUs may hold no encoder replica
        if costs is not None:
            record["capacity_bytes"] = costs.capacity
            record["static_bytes"] = float(costs.static_bytes[w.index])
        elif capacity is not None:
            record["capacity_bytes"] = capacity
        out.append(record)
    return out


def _category(graph: StepGraph, k: int) -> str:
    kind = graph.nodes[k].kind
    if kind.is_encoder_phase:  # drawn and counted as the encoder's forward and backward
        return (Kind.F if kind is Kind.ENCODE else Kind.B).value
    if kind.is_compute:
        return kind.value
    if kind.is_collective:
        return kind.value.lower()
    if kind.is_recv:
        return RECV
    return "bridge" if kind.value.startswith("BRIDGE") else "p2p"


def node_args(graph: StepGraph, k: int, costs: StepCosts | None = None) -> dict[str, Any]:
    """Arguments of node k's event: where it sits, and what it computes when costs are known."""
    node = graph.nodes[k]
    args: dict[str, Any] = {"seq": graph.position[k]}
    if node.stage >= 0:
        module, stage = graph.template.module_stage(node.stage)
        args.update(module=str(module), stage=stage)
    elif node.kind.is_encoder_phase:
        args.update(module=str(Module.ENCODER), stage=0)
    if node.microbatch >= 0:
        args["microbatch"] = node.microbatch
    if node.peer >= 0:
        args["peer"] = node.peer
    if costs is not None and node.kind.is_compute:
        args.update(flops=float(costs.flops[k]), hw_flops=float(costs.hw_flops[k]), **costs.info[k])
    return args


def record_step(trace: TraceBuilder, graph: StepGraph, start: Sequence[int], end: Sequence[int], *,
                step: int, offset_ns: int, costs: StepCosts | None = None,
                memory: list[list[tuple[int, float]]] | None = None) -> None:
    """Every node of the step as one complete event; memory as counter events when given."""
    for k, node in enumerate(graph.nodes):
        tid = COMPUTE if node.kind.is_compute else COMM
        args = {**node_args(graph, k, costs), "step": step}
        trace.op(node.worker, tid, graph.labels[k], _category(graph, k), int(start[k]) + offset_ns,
                 int(end[k]) + offset_ns, args)
        if costs is not None and costs.overlap[k] > 0:
            span = min(int(costs.overlap[k]), int(end[k] - start[k]))
            trace.op(node.worker, COMM, f"{graph.labels[k]}:comm", OVERLAPPED, int(start[k]) + offset_ns,
                     int(start[k]) + span + offset_ns, {"of": graph.labels[k], "step": step})
    for w, changes in enumerate(memory or ()):
        for ns, held in changes:
            trace.counter(w, "memory", ns + offset_ns, held)


def record_graph_step(trace: TraceBuilder, graph: StepGraph, start: Sequence[int], end: Sequence[int], *,
                      step: int, offset_ns: int, step_ns: int | None = None, costs: StepCosts | None = None,
                      memory: list[list[tuple[int, float]]] | None = None, **extra: Any) -> int:
    """One executed step into the trace, whichever runtime ran it: the workers (once, from the first
    step recorded), every node (``record_step``) and the step's span, whose compute part ends with
    its last compute node and whole span with ``step_ns`` (by default its last node; a runtime that
    does more after the graph, as an optimizer step, says how long). ``extra`` goes with the step
    entry. Returns the compute part's end, ns from the step's start."""
    if not trace.workers:
        trace.set_workers(worker_records(graph, costs))
    record_step(trace, graph, start, end, step=step, offset_ns=offset_ns, costs=costs, memory=memory)
    compute_end = int(max(end[k] for k in graph.compute_nodes))
    span = int(max(end, default=0)) if step_ns is None else step_ns
    trace.step(step, offset_ns, offset_ns + compute_end, offset_ns + span, **extra)
    return compute_end
