"""The expanded task graph: one op per (template op, replica), one worker per GPU group.

This is the form the SimPy simulator executes and that a backend would run;
``longest_path`` is the plain reference evaluator of it (no vectorisation,
no cleverness), against which both faster paths are tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dflop.program.costing import StepTiming


@dataclass(frozen=True)
class Worker:
    """A tensor-parallel group of GPUs that runs one pipeline rank of one replica."""

    name: str
    module: str
    rank: int
    replica: int
    gpus: tuple[int, ...]
    capacity: float
    static_bytes: float


@dataclass
class TaskGraph:
    workers: list[Worker]
    worker: list[int]
    """Worker of each op; -1 for collectives."""
    label: list[str]
    kind: list[str]
    duration: list[int]
    deps: list[list[tuple[int, int, int]]]
    """Per op: (op it waits for, transfer ns, link id or -1)."""
    alloc: list[float]
    free: list[float]
    participants: list[tuple[int, ...]]
    """Per collective: its workers (empty for compute ops)."""
    args: list[dict]
    order: list[list[int]]
    """Per worker: its ops in program order."""
    topo: list[int]
    links: int
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.worker)

    @cached_property
    def consumers(self) -> list[list[tuple[int, int, int]]]:
        """Per op: (op that waits for it, transfer ns, link)."""
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(len(self))]
        for o, deps in enumerate(self.deps):
            for d, ns, link in deps:
                out[d].append((o, ns, link))
        return out

    @cached_property
    def input_counts(self) -> list[int]:
        """Per op: how many ops it waits for."""
        return [len(d) for d in self.deps]

    @cached_property
    def first_ops(self) -> list[bool]:
        """Per op: whether its worker can run it first (collectives have no worker to wait for)."""
        first = [w < 0 for w in self.worker]
        for ops in self.order:
            if ops:
                first[ops[0]] = True
        return first

    @cached_property
    def successor(self) -> list[int]:
        """Per op: the next op of the same worker (-1 for the last)."""
        nxt = [-1] * len(self)
        for ops in self.order:
            for a, b in zip(ops, ops[1:]):
                nxt[a] = b
        return nxt


def expand(timing: StepTiming) -> TaskGraph:
    t = timing.template
    offsets, n = [], 0
    for op in t.ops:
        offsets.append(n)
        n += t.groups[op.group].replicas
    wbase, nw = [], 0
    workers: list[Worker] = []
    for g in t.groups:
        wbase.append(nw)
        for x in range(g.replicas):
            gp = timing.gpus[g.index][x]
            span = f"{gp[0]}" if len(gp) == 1 else f"{gp[0]}-{gp[-1]}"
            workers.append(Worker(f"{g.module} pp{g.rank} dp{x} [GPU {span}]", g.module, g.rank, x, gp,
                                  timing.capacity, float(timing.static_bytes[g.index])))
        nw += g.replicas
    links: dict[tuple[int, int], int] = {}

    def link(a: int, b: int) -> int:
        return links.setdefault((a, b), len(links))

    worker, label, kind, duration, deps, alloc, free, args = [], [], [], [], [], [], [], []
    participants: list[tuple[int, ...]] = []
    for i, op in enumerate(t.ops):
        g = t.groups[op.group]
        for x in range(g.replicas):
            w = wbase[g.index] + x
            worker.append(w)
            label.append(str(op.action))
            kind.append(op.action.kind.value)
            duration.append(int(timing.duration[i][x]))
            alloc.append(float(timing.alloc[i][x]))
            free.append(float(timing.free[i][x]))
            participants.append(())
            own = [(offsets[d] + x, int(c[x]), link(wbase[t.ops[d].group] + x, w) if c[x] else -1)
                   for d, c in zip(op.deps, timing.dep_comm[i])]
            deps.append(own)
            info = {k: float(v[x]) for k, v in timing.info[i].items()}
            args.append({"module": g.module, "stage": op.stage, "microbatch": op.action.microbatch,
                         "flops": float(timing.flops[i][x]), **info})
        if timing.bridge[i] is not None:
            src_group = t.groups[t.ops[op.bridge].group]
            for s, d, ns in zip(*timing.bridge[i]):
                a, b = wbase[src_group.index] + int(s), wbase[g.index] + int(d)
                deps[offsets[i] + int(d)].append((offsets[op.bridge] + int(s), int(ns), link(a, b)))
    order = [[] for _ in workers]
    for i, op in enumerate(t.ops):
        g = t.groups[op.group]
        for x in range(g.replicas):
            order[wbase[g.index] + x].append(offsets[i] + x)
    topo = [offsets[i] + x for i in t.order for x in range(t.groups[t.ops[i].group].replicas)]
    for g in t.groups:
        last = t.last_op[g.index]
        members = tuple(wbase[g.index] + x for x in range(g.replicas))
        topo.append(len(worker))
        worker.append(-1)
        label.append(f"allreduce {g.module} pp{g.rank}")
        kind.append("allreduce")
        duration.append(int(timing.allreduce[g.index]))
        deps.append([(offsets[last] + x, 0, -1) for x in range(g.replicas)])
        alloc.append(0.0)
        free.append(0.0)
        participants.append(members)
        args.append({"module": g.module, "stage": g.rank})
    return TaskGraph(workers, worker, label, kind, duration, deps, alloc, free, participants, args,
                     order, topo, len(links))


def longest_path(graph: TaskGraph) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every op, in ns: each op starts when its worker is free and its inputs arrived."""
    n = len(graph)
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    prev = [-1] * n
    for a, b in enumerate(graph.successor):
        if b >= 0:
            prev[b] = a
    for o in graph.topo:
        ready = int(end[prev[o]]) if prev[o] >= 0 else 0
        for d, comm, _ in graph.deps[o]:
            ready = max(ready, int(end[d]) + comm)
        start[o] = ready
        end[o] = ready + graph.duration[o]
    return start, end
