"""The SimPy executor of task graphs.

One SimPy process per worker (a tensor-parallel GPU group) runs its ops in
program order on its compute stream; a finished op hands its outputs to the
links, which carry them while compute goes on (sends never block compute, as
with NCCL's asynchronous point-to-point), one transfer at a time per link when
``contention`` is on; gradient all-reduces are collectives that start once
every participant has finished its last op. All state lives in one
``simpy.Environment``; times are integer nanoseconds, so runs are exactly
reproducible and equal the reference longest path when nothing contends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from dflop.program.graph import TaskGraph


@dataclass
class Execution:
    start: np.ndarray
    end: np.ndarray
    transfers: list[tuple[int, int, int, int, int]]
    """(source op, destination op, link, start ns, end ns) of every transfer."""
    memory: list[list[tuple[int, float]]]
    """Per worker: (ns, bytes held) after every change."""
    peak: np.ndarray
    """Per worker: peak bytes."""
    oom: list[dict] = field(default_factory=list)
    """Workers that went beyond their memory: worker, ns, bytes, capacity."""

    @property
    def makespan(self) -> int:
        return int(self.end.max()) if len(self.end) else 0


def execute(graph: TaskGraph, *, contention: bool = True, track_memory: bool = True) -> Execution:
    env = simpy.Environment()
    n = len(graph)
    done = [env.event() for _ in range(n)]
    start = np.zeros(n, dtype=np.int64)
    end = np.zeros(n, dtype=np.int64)
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n)]
    arrival: list[list[int]] = [[0] * len(d) for d in graph.deps]
    for o, deps in enumerate(graph.deps):
        for pos, (d, ns, link) in enumerate(deps):
            out[d].append((o, pos, ns, link))
    link_free = [0] * graph.links
    transfers: list[tuple[int, int, int, int, int]] = []
    held = [w.static_bytes for w in graph.workers]
    peak = np.array(held, dtype=float)
    memory: list[list[tuple[int, float]]] = [[(0, h)] for h in held]
    oom: list[dict] = []

    def finish(o: int) -> None:
        now = env.now
        for c, pos, ns, link in out[o]:
            if ns == 0:
                arrival[c][pos] = now
                continue
            begin = max(now, link_free[link]) if contention and link >= 0 else now
            arrival[c][pos] = begin + ns
            if contention and link >= 0:
                link_free[link] = begin + ns
            transfers.append((o, c, link, begin, begin + ns))
        done[o].succeed()

    def wait_inputs(o: int):
        for d, _, _ in graph.deps[o]:
            if not done[d].processed:
                yield done[d]
        latest = max(arrival[o], default=env.now)
        if latest > env.now:
            yield env.timeout(latest - env.now)

    def change(w: int, delta: float) -> None:
        held[w] += delta
        if track_memory:
            memory[w].append((env.now, held[w]))
        if held[w] > peak[w]:
            peak[w] = held[w]
            if held[w] > graph.workers[w].capacity and not any(e["worker"] == w for e in oom):
                oom.append({"worker": w, "ns": env.now, "bytes": held[w],
                            "capacity": graph.workers[w].capacity})

    def worker(w: int):
        for o in graph.order[w]:
            yield from wait_inputs(o)
            start[o] = env.now
            if graph.alloc[o]:
                change(w, graph.alloc[o])
            if graph.duration[o]:
                yield env.timeout(graph.duration[o])
            end[o] = env.now
            if graph.free[o]:
                change(w, -graph.free[o])
            finish(o)

    def collective(o: int):
        yield from wait_inputs(o)
        start[o] = env.now
        if graph.duration[o]:
            yield env.timeout(graph.duration[o])
        end[o] = env.now
        finish(o)

    for w in range(len(graph.workers)):
        env.process(worker(w))
    for o in range(n):
        if graph.worker[o] < 0:
            env.process(collective(o))
    env.run()
    unfinished = [o for o in range(n) if not done[o].processed]
    if unfinished:
        raise RuntimeError(f"simulation stalled with {len(unfinished)} ops unfinished, first "
                           f"{graph.label[unfinished[0]]} on worker {graph.worker[unfinished[0]]}")
    return Execution(start, end, transfers, memory, peak, oom)
