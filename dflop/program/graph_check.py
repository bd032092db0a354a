"""Checking a lowered step graph before anything runs it.

The program checker proves the compute schedule complete and acyclic; this one
checks what a runtime really executes, communication included:

- *complete*: every (template op, replica) runs once on its worker; every send
  has exactly one matching receive on its peer (same tensor, opposite kind);
  every node a node depends on on the same worker comes earlier in its order,
  and so does the compute node an overlapping collective is anchored on;
  every collective has one member per participating worker;
- *deadlock-free under blocking point-to-point*: a dry run in which posting a
  receive never blocks, a send completes only once its peer has posted the
  matching receive (a rendezvous: the strictest semantics any backend has), a
  compute waits for its inputs, and a collective waits for all its members.
  A graph that passes runs on NCCL and gloo alike, with eager or lazy sends.
"""

from __future__ import annotations

from collections import Counter

from dflop.program.actions import Kind
from dflop.program.check import ProgramError
from dflop.program.rendezvous import Rendezvous
from dflop.program.stepgraph import StepGraph

_PAIRS = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B, Kind.BRIDGE_SEND_F: Kind.BRIDGE_RECV_F,
          Kind.BRIDGE_SEND_B: Kind.BRIDGE_RECV_B}


def _completeness(graph: StepGraph) -> list[str]:
    problems = []
    t, nodes = graph.template, graph.nodes
    placed = Counter(n for ids in graph.order for n in ids)
    for n, node in enumerate(nodes):
        if placed[n] != 1 or n not in graph.order[node.worker]:
            problems.append(f"w{node.worker} {node.label} appears {placed[n]} times in its worker's order")
    if problems:
        return problems
    runs = Counter((n.op, n.worker) for n in nodes if n.kind.is_compute)
    for op in t.ops:
        for w in graph.workers:
            if w.group == op.group and runs[(op.index, w.index)] != 1:
                problems.append(f"w{w.index} runs {op.action} {runs[(op.index, w.index)]} times (expected once)")
    sends = Counter()
    for n, node in enumerate(nodes):
        if not node.kind.is_recv:
            continue
        s = graph.inputs[n][0] if graph.inputs[n] else -1
        sender = nodes[s] if s >= 0 else None
        if (sender is None or _PAIRS.get(sender.kind) is not node.kind or sender.peer != node.worker
                or node.peer != sender.worker or sender.microbatch != node.microbatch):
            problems.append(f"w{node.worker} {node.label} has no matching send")
        else:
            sends[s] += 1
    for n, node in enumerate(nodes):
        if node.kind.is_send and sends[n] != 1:
            problems.append(f"w{node.worker} {node.label} is received {sends[n]} times (expected once)")
    position = graph.position
    for n, node in enumerate(nodes):
        for d in graph.deps[n]:
            if nodes[d].worker == node.worker and position[d] >= position[n]:
                problems.append(f"w{node.worker} runs {node.label} before {nodes[d].label}, which it needs")
    for n, a in enumerate(graph.anchor):
        if a >= 0 and (not nodes[a].kind.is_compute or nodes[a].worker != nodes[n].worker
                       or position[a] >= position[n]):
            problems.append(f"w{nodes[n].worker} {nodes[n].label} overlaps {nodes[a].label}, which is not an "
                            "earlier compute node of its worker")
    for c, members in enumerate(graph.collectives):
        if len({nodes[m].worker for m in members}) != len(members):
            problems.append(f"collective {c} has two members on one worker")
    return problems


def dry_run(graph: StepGraph) -> tuple[list[int], list[str]]:
    """Run with blocking sends; returns each worker's progress and, if stuck, what each waits for."""
    nodes = graph.nodes
    dry = Rendezvous.of(graph)
    waits = []
    for w in dry.run(hoist=False):
        n = graph.order[w][dry.cursor[w]]
        node = nodes[n]
        if node.kind.is_collective:
            why = "the other members"
        elif node.kind.is_send and all(dry.done[d] for d in graph.deps[n]):
            why = f"w{node.peer} to post {nodes[graph.matching[n]].label}"
        else:
            why = ", ".join(f"{nodes[d].label}@w{nodes[d].worker}" for d in graph.deps[n] if not dry.done[d])
        waits.append(f"w{w} waits at {node.label} for {why}")
    return dry.cursor, waits


def check_graph(graph: StepGraph) -> None:
    """Raise ProgramError naming the first problems; ``details`` shows the stuck order on a deadlock."""
    problems = _completeness(graph)
    if problems:
        raise ProgramError("step graph is incomplete: " + "; ".join(problems[:5])
                           + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    cursor, waits = dry_run(graph)
    if waits:
        raise ProgramError("step graph deadlocks with blocking sends: " + "; ".join(waits[:6]),
                           details=graph.table())
