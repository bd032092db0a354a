"""The costs of one step graph: arrays indexed by node, kept apart from the graph.

The graph says what runs where and in which order; these arrays say how long
each node takes (a compute node's time, a send's transfer on its link, a
collective's time), how long after its anchor's start an overlapping node
starts (``lag``), how much memory it allocates, holds and frees, and what it
computes (FLOPs, samples, tokens), all taken from the step's ``StepTiming``
(the cost model's numbers per template op and replica). A runtime that
measures instead of predicting uses the same graph without these.

``longest_path`` is the plain reference evaluator of (graph, costs): no
vectorisation, no cleverness; the fast evaluator and the SimPy executor are
tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.timing.costing import StepTiming
from dflop.program.stepgraph import StepGraph


@dataclass(frozen=True)
class StepCosts:
    duration: np.ndarray
    """Per node, integer ns: compute time; a send's transfer; a collective's time; 0 for receives."""
    alloc: np.ndarray
    """Per node: bytes allocated when it starts (activations of a forward)."""
    free: np.ndarray
    """Per node: bytes released when it ends (the backward that consumes them)."""
    flops: np.ndarray
    """Per node: model FLOPs of a compute node (for MFU)."""
    info: tuple[dict, ...]
    """Per node: what a compute node works on (samples, tokens, tiles), for traces."""
    static_bytes: np.ndarray
    """Per worker: weights, gradients and optimizer state per GPU."""
    capacity: float
    """Usable memory per GPU."""
    lag: np.ndarray
    """Per node, ns: how long after its anchor starts a node with an anchor starts."""
    transient: np.ndarray
    """Per node: bytes held only while it runs (on top of ``alloc``)."""
    hw_flops: np.ndarray
    """Per node: FLOPs executed, recomputation included (for HFU)."""
    overlap: np.ndarray
    """Per compute node, ns: communication running beside it inside the node (FSDP's per-layer
    gathers and reductions), drawn on the communication thread."""


def graph_costs(graph: StepGraph, timing: StepTiming) -> StepCosts:
    t, nodes, workers = graph.template, graph.nodes, graph.workers
    n = len(nodes)
    duration, lag, overlap = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    alloc, free, flops, hw_flops, transient = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    info: list[dict] = [{}] * n
    bridge: dict[int, dict[tuple[int, int], int]] = {}
    for i, edges in enumerate(timing.bridge):
        if edges is not None:
            bridge[i] = {(int(s), int(d)): int(ns) for s, d, ns in zip(*edges)}
    for k, node in enumerate(nodes):
        x = workers[node.worker].replica
        if node.kind.is_compute:
            i = node.op
            duration[k], overlap[k] = timing.duration[i][x], timing.overlap[i][x]
            alloc[k], free[k], flops[k] = timing.alloc[i][x], timing.free[i][x], timing.flops[i][x]
            transient[k], hw_flops[k] = timing.transient[i][x], timing.hw_flops[i][x]
            info[k] = {name: float(v[x]) for name, v in timing.info[i].items()}
        elif node.kind.is_send:
            recv = nodes[graph.matching[k]]
            consumer = recv.op
            if consumer in bridge and t.ops[consumer].bridge == node.op:
                duration[k] = bridge[consumer][(x, workers[recv.worker].replica)]
            else:
                slot = t.ops[consumer].deps.index(node.op)
                duration[k] = timing.dep_comm[consumer][slot][workers[recv.worker].replica]
        elif node.kind.is_collective:
            timed = timing.collectives[node.collective]
            duration[k], lag[k] = timed.duration, timed.lag[node.worker if timed.group < 0 else x]
    static = np.array([timing.static_bytes[w.group] for w in workers], dtype=float)
    return StepCosts(duration, alloc, free, flops, tuple(info), static, timing.capacity, lag, transient, hw_flops,
                     overlap)


def longest_path(graph: StepGraph, costs: StepCosts) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every node, in ns: a node starts when all it depends on has finished and, if
    it has an anchor, ``lag`` after its anchor started; a collective's members start together, when
    the last of them could."""
    n = len(graph)
    unit = list(range(n))  # a collective's members share one unit: its first member
    for members in graph.collectives:
        for m in members:
            unit[m] = members[0]
    anchor = graph.anchor or (-1,) * n
    waiting = [0] * n
    successors: list[list[int]] = [[] for _ in range(n)]
    for k, deps in enumerate(graph.deps):
        for d in deps + ((anchor[k],) if anchor[k] >= 0 else ()):
            successors[unit[d]].append(unit[k])
            waiting[unit[k]] += 1
    ready = [u for u in range(n) if unit[u] == u and waiting[u] == 0]
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    members = {c[0]: c for c in graph.collectives}
    done = 0
    while ready:
        u = ready.pop()
        group = members.get(u, (u,))
        begin = max([int(end[d]) for m in group for d in graph.deps[m]]
                    + [int(start[anchor[m]] + costs.lag[m]) for m in group if anchor[m] >= 0], default=0)
        for m in group:
            start[m], end[m] = begin, begin + int(costs.duration[m])
        done += len(group)
        for s in successors[u]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if done != n:
        raise RuntimeError("the step graph has a cycle")
    return start, end
