"""From an execution to trace events (the format the torch backend writes too)."""

from __future__ import annotations

from dflop.program.graph import TaskGraph
from dflop.sim.engine import Execution
from dflop.trace.chrome import COMM, COMPUTE, TraceBuilder


def worker_records(graph: TaskGraph) -> list[dict]:
    return [{"name": w.name, "module": w.module, "rank": w.rank, "replica": w.replica,
             "gpus": list(w.gpus), "capacity_bytes": w.capacity, "static_bytes": w.static_bytes}
            for w in graph.workers]


def record(trace: TraceBuilder, graph: TaskGraph, ex: Execution, *, step: int, offset_ns: int,
           memory: bool = True) -> None:
    for o in range(len(graph)):
        start, end = int(ex.start[o]) + offset_ns, int(ex.end[o]) + offset_ns
        if graph.worker[o] >= 0:
            if end > start:
                trace.op(graph.worker[o], COMPUTE, graph.label[o], graph.kind[o], start, end,
                         {**graph.args[o], "step": step})
        elif end > start:
            for w in graph.participants[o]:
                trace.op(w, COMM, graph.label[o], "allreduce", start, end, {"step": step})
    for src, dst, link, start, end in ex.transfers:
        sender = graph.worker[src]
        if sender >= 0:
            kind = "bridge" if graph.args[src].get("module") != graph.args[dst].get("module") else "p2p"
            trace.op(sender, COMM, f"{graph.label[src]}>{graph.label[dst]}", kind,
                     start + offset_ns, end + offset_ns, {"to": graph.worker[dst], "link": link, "step": step})
    if memory:
        for w, changes in enumerate(ex.memory):
            for ns, held in changes:
                trace.counter(w, "memory", ns + offset_ns, held)
    for event in ex.oom:
        trace.oom.append({**event, "step": step, "ns": event["ns"] + offset_ns,
                          "rank": graph.workers[event["worker"]].name})
