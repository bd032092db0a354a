"""The SimPy executor of step graphs.

Each worker (a tensor-parallel GPU group) runs its compute nodes in order on
its compute stream; a send occupies its link for its transfer (one transfer at
a time per link when ``contention`` is on) while compute goes on, as NCCL's
asynchronous point-to-point does; a receive completes when its data has
arrived; a collective starts once every member could start it, and a node with
an anchor (a gradient reduction overlapping the backward that fills it) no
earlier than its lag after the anchor starts. Where the workers' ranks
outnumber the CPU cores they share (``cores``: CPU ranks launched on one
machine), compute nodes in progress share the cores as the OS time-slices
processes (``dflop.sim.sharing``). All state lives in one
``simpy.Environment``; times are integer nanoseconds, so runs are exactly
reproducible and equal the reference longest path when nothing contends.

The simulation is event-driven without processes: a compute node or a
collective is one SimPy event, scheduled when it can start and firing when it
ends; its callback hands the end time to the nodes that wait for it. Sends and
receives need no events of their own: when a send's producer finishes, the
transfer is booked on its link and the arrival time passed on at once, straight
to what reads its receive (``StepGraph.delivery``); a receive's times follow
after the run from its send's and its worker's previous compute node's. Only
SimPy's public API is used (``timeout``, an event's ``callbacks`` and
``value``, ``now``, ``run``), so SimPy may change its internals freely; a
compute node's end is known when its event is scheduled, so its callback reads
that instead of the clock. Per-worker processes waiting on ``AllOf`` of their
predecessors would cost several SimPy events per node instead of one per
compute node. (With shared cores a node's end is known only as it comes:
``ProcessorSharing`` schedules the soonest end again whenever the ops in progress
change, and a node ready later than it is known to be waits on an event of its own.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from dflop.sim.sharing import ProcessorSharing
from dflop.timing.costs import StepCosts
from dflop.program.stepgraph import Role, StepGraph


@dataclass
class Execution:
    start: np.ndarray
    end: np.ndarray
    memory: list[list[tuple[int, float]]]
    """Per worker: (ns, bytes held) after every change."""
    peak: np.ndarray
    """Per worker: peak bytes."""
    oom: list[dict] = field(default_factory=list)
    """Workers that went beyond their memory: worker, ns, bytes, capacity; the first in time first."""
    events: int = 0
    """SimPy events the run scheduled (for benchmarks against a bare SimPy loop)."""

    @property
    def makespan(self) -> int:
        return int(self.end.max()) if len(self.end) else 0


def execute(graph: StepGraph, costs: StepCosts, *, contention: bool = True, track_memory: bool = True,
            cores: int | None = None) -> Execution:
    """``cores``: the CPU cores every worker's ranks share (None: each rank computes on its own
    device)."""
    env = simpy.Environment()
    n = len(graph)
    end = [-1] * n  # -1 until the node has finished (or, for one that runs, is due)
    start: dict[int, int] = {}  # where it is not its end less its duration (shared cores, a collective)
    link = graph.link
    kind = graph.roles
    compute, send = Role.COMPUTE, Role.SEND  # locals: read once per node
    duration = costs.duration.tolist()
    grow_bytes = costs.alloc + costs.transient  # held from a compute node's start to its end, and after
    shrink_bytes = costs.free + costs.transient
    grow = grow_bytes.tolist() if grow_bytes.any() else [0] * n
    shrink = shrink_bytes.tolist() if shrink_bytes.any() else [0] * n
    lag = costs.lag  # read for anchored nodes only (.item(): the Python number tolist would give)
    overlapping, delivery = graph.overlapping, graph.delivery
    delivers = delivery.delivers
    missing = list(delivery.waits)
    ready_at = [0] * n
    collective_missing = [len(c) for c in graph.collectives]
    link_free = [0] * graph.links
    held = costs.static_bytes.tolist()
    peak = [float(h) for h in held]  # a list while running: numpy's scalar indexing costs more per change
    memory: list[list[tuple[int, float]]] = [[(0, h)] for h in held]
    oom: list[dict] = []
    capacity = costs.capacity
    worker_of = graph.worker_of
    timeout = env.timeout
    ranks = [len(w.gpus) for w in graph.workers]
    sharing = None
    if cores is not None and cores < sum(ranks):
        sharing = ProcessorSharing(env, cores, lambda k, now: finished(None, k, now, now),
                                   lambda c, now: known(c, now, now))
    wakes = 0
    plain = graph.unanchored_compute if sharing is None else [False] * n  # ``finished`` starts these itself

    def change(w: int, delta: float, at: int) -> None:
        now_held = held[w] = held[w] + delta
        if track_memory:
            memory[w].append((at, now_held))
        if now_held > peak[w]:
            peak[w] = now_held
            if now_held > capacity and not any(e["worker"] == w for e in oom):
                oom.append({"worker": w, "ns": at, "bytes": now_held, "capacity": capacity})

    def known(c: int, at: int, now: int) -> None:
        """One more thing node c waits for is known to be over by ``at``."""
        if at > ready_at[c]:
            ready_at[c] = at
        missing[c] -= 1
        if not missing[c]:
            begin(c, now)

    def finished(event: simpy.Event | None, k: int = 0, at: int = 0, now: int = 0) -> None:
        """Node k ends at ``at`` (>= now): pass it on to what waits for it (``Delivery``). SimPy
        calls it with a compute node's end event, everything else with no event and the node.

        It runs once per compute node and its loop once per edge, so the hot cases are inlined
        (its event's handler, ``known``, and ``begin`` of a compute node nothing is anchored on
        and of a send that follows its producer): the loop is most of a step's time."""
        if event is not None:
            k = event.value
            now = at = end[k]  # == env.now: the event was due then
        else:
            end[k] = at
        if shrink[k]:  # (a compute node's: no other node books memory)
            change(worker_of[k], -shrink[k], at)
        for c in delivers[k]:
            if c < 0:  # a send of what k made (``book``, inlined): what follows reads it on arrival
                c = ~c
                sent = end[k]
                if contention:
                    wire = link[c]
                    if link_free[wire] > sent:
                        sent = link_free[wire]
                    link_free[wire] = sent + duration[c]
                end[c] = at = sent + duration[c]
                continue
            if at > ready_at[c]:
                ready_at[c] = at
            left = missing[c] = missing[c] - 1
            if left:
                continue
            if plain[c]:
                ready = ready_at[c]  # >= at >= now
                if grow[c]:  # the worker is idle until then, so booking early changes no peak
                    change(worker_of[c], grow[c], ready)
                end[c] = due = ready + duration[c]
                timeout(due - now, c).callbacks.append(finished)
            else:
                begin(c, now)

    def begin(k: int, now: int) -> None:
        """Everything k waits for is known to end by ``ready_at[k]``: a compute node or a
        collective (``finished`` starts the rest)."""
        nonlocal wakes
        what = kind[k]
        if what is compute:
            at = ready_at[k]
            if at <= now:
                at = now
            elif sharing is not None:  # its share of the cores depends on what computes then
                wakes += 1
                timeout(at - now, k).callbacks.append(lambda event: run(event.value, env.now, env.now))
                return
            run(k, at, now)
        elif what is send:  # one that waits for more than its producer
            finished(None, k, book(k, ready_at[k]), now)
        else:
            c = graph.nodes[k].collective
            collective_missing[c] -= 1
            if not collective_missing[c]:
                members = graph.collectives[c]
                at = max(now, max(ready_at[m] for m in members))
                for m in members:
                    start[m] = at
                timeout(at - now + duration[k], c).callbacks.append(collective_done)

    def book(k: int, ready: int) -> int:
        """Send k's transfer, from ``ready`` or once its link is free: its arrival."""
        sent = ready
        if contention:
            wire = link[k]
            if link_free[wire] > sent:
                sent = link_free[wire]
            link_free[wire] = sent + duration[k]
        return sent + duration[k]

    def run(k: int, at: int, now: int) -> None:
        if grow[k]:  # the worker is idle until then, so booking early changes no peak
            change(worker_of[k], grow[k], at)
        if sharing is not None:  # at == now: it ends (and reaches its lags) as its share of the cores works
            start[k] = at
            sharing.join(k, duration[k], ranks[worker_of[k]], [(c, lag[c].item()) for c in overlapping[k]])
            return
        end[k] = at + duration[k]  # when its event fires (read there instead of the clock)
        timeout(at - now + duration[k], k).callbacks.append(finished)
        for c in overlapping[k]:
            known(c, at + lag[c].item(), now)

    def collective_done(event: simpy.Event) -> None:
        now = env.now
        for m in graph.collectives[event.value]:
            finished(None, m, now, now)

    for k in graph.roots:
        begin(k, 0)
    env.run()
    ends = np.fromiter(end, np.int64, n)
    starts = ends - costs.duration
    if start:
        starts[np.fromiter(start, np.int64, len(start))] = np.fromiter(start.values(), np.int64, len(start))
    # a receive ends as the later of its deps (a stall still leaves -1 at the node that did not end)
    ends[delivery.receives] = starts[delivery.receives] = np.maximum(ends[delivery.sends], ends[delivery.previous])
    unfinished = np.flatnonzero(ends < 0)
    if len(unfinished):
        first = int(unfinished[0])
        raise RuntimeError(f"simulation stalled with {len(unfinished)} nodes unfinished, first "
                           f"{graph.labels[first]} on worker {worker_of[first]}")
    # one event per compute node (or per change of the cores' shares) and one per collective
    events = len(graph.collectives) + (len(graph.compute_nodes) if sharing is None else sharing.events + wakes)
    oom.sort(key=lambda e: (e["ns"], e["worker"]))  # booked as the events come, not in time order
    # the handlers refer to each other: undone here, the cycle (and every list it holds) would wait
    # for the garbage collector
    finished = begin = run = collective_done = known = None  # noqa: F841
    return Execution(starts, ends, memory, np.array(peak, dtype=float), oom, events)
