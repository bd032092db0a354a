"""The SimPy executor of task graphs.

Each worker (a tensor-parallel GPU group) runs its ops in program order on its
compute stream; a finished op hands its outputs to the links, which carry
them while compute goes on (sends never block compute, as with NCCL's
asynchronous point-to-point), one transfer at a time per link when
``contention`` is on; gradient all-reduces are collectives that start once
every participant has finished its last op. All state lives in one
``simpy.Environment``; times are integer nanoseconds, so runs are exactly
reproducible and equal the reference longest path when nothing contends.

The simulation is event-driven without processes: every op is one SimPy event,
scheduled when the op can start (worker free, all inputs sent) to fire when it
ends, whose callback books the op's outgoing transfers on their links (in a
fixed order), counts down its consumers' missing inputs and starts whatever
became ready. No generator is resumed per op, which keeps the executor close
to SimPy's own event rate.
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
    events: int = 0
    """SimPy events the run scheduled (for benchmarks against a bare SimPy loop)."""

    @property
    def makespan(self) -> int:
        return int(self.end.max()) if len(self.end) else 0


def execute(graph: TaskGraph, *, contention: bool = True, track_memory: bool = True) -> Execution:
    env = simpy.Environment()
    n = len(graph)
    start = [0] * n
    end = [-1] * n  # -1 until the op has finished
    out, successor = graph.consumers, graph.successor
    missing = list(graph.input_counts)
    ready_at = [0] * n
    idle = list(graph.first_ops)  # per op: its worker is free for it
    link_free = [0] * graph.links
    transfers: list[tuple[int, int, int, int, int]] = []
    held = [w.static_bytes for w in graph.workers]
    peak = np.array(held, dtype=float)
    memory: list[list[tuple[int, float]]] = [[(0, h)] for h in held]
    oom: list[dict] = []
    worker_of, free, alloc, duration = graph.worker, graph.free, graph.alloc, graph.duration
    timeout = env.timeout

    def change(w: int, delta: float, at: int) -> None:
        held[w] += delta
        if track_memory:
            memory[w].append((at, held[w]))
        if held[w] > peak[w]:
            peak[w] = held[w]
            if held[w] > graph.workers[w].capacity and not any(e["worker"] == w for e in oom):
                oom.append({"worker": w, "ns": at, "bytes": held[w], "capacity": graph.workers[w].capacity})

    def try_start(o: int, now: int) -> None:
        """Start ``o``: its worker is free and every input has been sent, so it starts when the last
        one arrives and ends ``duration`` later; one event, at its end. (Its worker is idle until
        then, so recording the allocation ahead of time changes no peak.)"""
        idle[o] = False
        begins = ready_at[o] if ready_at[o] > now else now
        start[o] = begins
        if alloc[o]:
            change(worker_of[o], alloc[o], begins)
        timeout(begins - now + duration[o], o).callbacks.append(finish)

    def finish(event: simpy.Event) -> None:
        o, now = event._value, env._now  # SimPy's fields: its properties cost a call per op
        end[o] = now
        if free[o]:
            change(worker_of[o], -free[o], now)
        for c, ns, link in out[o]:
            arrive = now
            if ns:
                sent = now
                if contention and link >= 0:
                    if link_free[link] > now:
                        sent = link_free[link]
                    link_free[link] = sent + ns
                arrive = sent + ns
                transfers.append((o, c, link, sent, arrive))
            if arrive > ready_at[c]:
                ready_at[c] = arrive
            missing[c] -= 1
            if not missing[c] and idle[c]:
                try_start(c, now)
        nxt = successor[o]
        if nxt >= 0:
            idle[nxt] = True
            if not missing[nxt]:
                try_start(nxt, now)

    for o in range(n):
        if not missing[o] and idle[o]:
            try_start(o, 0)
    env.run()
    unfinished = [o for o in range(n) if end[o] < 0]
    if unfinished:
        raise RuntimeError(f"simulation stalled with {len(unfinished)} ops unfinished, first "
                           f"{graph.label[unfinished[0]]} on worker {graph.worker[unfinished[0]]}")
    return Execution(np.array(start, dtype=np.int64), np.array(end, dtype=np.int64), transfers, memory, peak,
                     oom, next(env._eid))
