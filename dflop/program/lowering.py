"""Lowering a step template onto workers: a chain of small pure passes, as torch.distributed.pipelining lowers.

``lower(template, routes)`` composes, each pass a function from the previous form to the next:

1. ``place_actions``: the workers (one per pipeline rank and replica) and, per worker, its
   compute units in program order (an overlapped pair is one unit);
2. ``add_send_recv``: the nodes, in torch's lockstep ``_add_send_recv`` (one unit per worker
   and round, a send right after the compute that produces its tensor, the matching receive
   posted on the peer in the same round), bridge transfers on the step's routes;
3. ``defer_receives``: torch's ``_defer_recv_ops``, every receive just before its consumer,
   except that a lower-numbered worker posts its receives from a peer before it sends to it;
4. ``place_collectives``: the data-parallel collectives of ``group_collectives`` (an UNSHARD
   right before the compute it feeds, a REDUCE_GRAD after its anchor) and every node's data
   inputs: the first full ``StepGraph``;
5. ``hoist_for_rendezvous``: receives moved up where blocking sends would wait on each other.

Every pass returns a new value and leaves its argument alone, so a test can stop the chain
anywhere and look (or replace one pass) without the others noticing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from dflop.program.actions import Kind
from dflop.program.check import ProgramError
from dflop.program.collectives import group_collectives
from dflop.program.rendezvous import Rendezvous
from dflop.program.routing import BridgeRoutes, step_routes
from dflop.program.stepgraph import Node, StepGraph, Worker, build_workers
from dflop.program.template import Template
from dflop.workload.sample import SampleTable


@dataclass(frozen=True)
class Placed:
    """After ``place_actions``: who runs what, no communication yet."""

    template: Template
    routes: BridgeRoutes | None
    workers: tuple[Worker, ...]
    units: tuple[tuple[tuple[int, ...], ...], ...]
    """Per worker: its compute units in program order, each one template op or an overlapped pair."""
    base: tuple[int, ...]
    """Per template group: the worker of its replica 0 (replica x runs on ``base + x``)."""


@dataclass(frozen=True)
class Linked:
    """After ``add_send_recv`` (and ``defer_receives``): compute and point-to-point nodes in order."""

    template: Template
    routes: BridgeRoutes | None
    workers: tuple[Worker, ...]
    nodes: tuple[Node, ...]
    order: tuple[tuple[int, ...], ...]
    """Per worker: its node ids in execution order."""
    send_of: dict[int, int]
    """Receive -> its send."""
    compute_of: dict[tuple[int, int], int]
    """(template op, worker) -> its compute node."""


@dataclass(frozen=True)
class _Edge:
    """A tensor crossing from (producer op, worker) to (consumer op, worker)."""

    src: int
    dst: int
    consumer: int
    send: Kind
    recv: Kind


def lower(template: Template, routes: BridgeRoutes | None = None) -> StepGraph:
    """The step graph of ``template`` with the given bridge routes (needed when disaggregated)."""
    linked = defer_receives(add_send_recv(place_actions(template, routes)))
    return hoist_for_rendezvous(place_collectives(linked))


def lower_step(template: Template, batch: SampleTable, assignment: np.ndarray) -> StepGraph:
    """The cost-free step graph of one scheduled batch (``assignment``: every sample's bin): what
    every torch rank lowers for itself and a costed step lowers lazily."""
    return lower(template, step_routes(template.plan, batch, assignment))


def place_actions(template: Template, routes: BridgeRoutes | None = None) -> Placed:
    """Pass 1: the workers, and each worker's units (its group's template ops) in program order."""
    t = template
    workers = build_workers(t)
    base = [0] * len(t.groups)
    for w in reversed(workers):
        base[w.group] = w.index - w.replica
    units = []
    for w in workers:
        ops = [o for o in t.ops if o.group == w.group]
        mine: list[tuple[int, ...]] = []
        for o in ops:
            if o.overlap < 0:
                mine.append((o.index,))
            elif o.overlap > o.index:
                mine.append((o.index, o.overlap))
        units.append(tuple(mine))
    return Placed(t, routes, workers, tuple(units), tuple(base))


def _remote_edges(p: Placed) -> tuple[dict, dict]:
    """Outgoing and incoming cross-worker edges of every (template op, worker)."""
    t, base, routes = p.template, p.base, p.routes
    out: dict[tuple[int, int], list[_Edge]] = {}
    incoming: dict[tuple[int, int], int] = {}

    def add(producer: int, src: int, consumer: int, dst: int, send: Kind, recv: Kind) -> None:
        out.setdefault((producer, src), []).append(_Edge(src, dst, consumer, send, recv))
        incoming[(consumer, dst)] = incoming.get((consumer, dst), 0) + 1

    for op in t.ops:
        g = t.groups[op.group]
        forward = op.action.kind is Kind.F
        for d in op.deps:
            dg = t.ops[d].group
            if dg != op.group:
                send, recv = (Kind.SEND_F, Kind.RECV_F) if forward else (Kind.SEND_B, Kind.RECV_B)
                for x in range(g.replicas):
                    add(d, base[dg] + x, op.index, base[op.group] + x, send, recv)
        if op.bridge >= 0:
            if routes is None:
                raise ProgramError("a disaggregated step needs bridge routes (which encoder replica feeds "
                                   "which LLM replica)")
            bg, k = t.ops[op.bridge].group, op.action.microbatch
            for j, r in routes.pairs[k]:
                if forward:  # encoder replica j -> LLM replica r
                    add(op.bridge, base[bg] + j, op.index, base[op.group] + r, Kind.BRIDGE_SEND_F,
                        Kind.BRIDGE_RECV_F)
                else:  # gradients of those features: LLM replica r -> encoder replica j
                    add(op.bridge, base[bg] + r, op.index, base[op.group] + j, Kind.BRIDGE_SEND_B,
                        Kind.BRIDGE_RECV_B)
    for edges in out.values():
        edges.sort(key=lambda e: (e.consumer, e.dst))
    return out, incoming


def add_send_recv(placed: Placed) -> Linked:
    """Pass 2, torch's ``_add_send_recv``: round by round, every worker whose next unit has all its
    tensors places it, then a send per tensor it produces for another worker (a pair sends after
    both halves, as torch lowers it) and, on the peer, the matching receive."""
    t = placed.template
    out, incoming = _remote_edges(placed)
    nodes: list[Node] = []
    lists: list[list[int]] = [[] for _ in placed.workers]
    send_of: dict[int, int] = {}
    compute_of: dict[tuple[int, int], int] = {}

    def new(node: Node) -> int:
        nodes.append(node)
        lists[node.worker].append(len(nodes) - 1)
        return len(nodes) - 1

    queues = [deque(units) for units in placed.units]
    arrived: dict[tuple[int, int], int] = {}
    remaining = sum(len(q) for q in queues)
    while remaining:
        progress = False
        for w, q in enumerate(queues):
            if not q or any(arrived.get((i, w), 0) < incoming.get((i, w), 0) for i in q[0]):
                continue
            unit = q.popleft()
            for i in unit:
                a = t.ops[i].action
                compute_of[(i, w)] = new(Node(w, a.kind, a.stage, a.microbatch, i))
            for i in unit:
                a = t.ops[i].action
                for e in out.get((i, w), ()):
                    send = new(Node(w, e.send, a.stage, a.microbatch, i, peer=e.dst))
                    stage = t.ops[e.consumer].action.stage
                    send_of[new(Node(e.dst, e.recv, stage, a.microbatch, e.consumer, peer=w))] = send
                    arrived[(e.consumer, e.dst)] = arrived.get((e.consumer, e.dst), 0) + 1
            remaining -= 1
            progress = True
        if not progress:
            stuck = [f"w{w} at {t.ops[q[0][0]].action}" for w, q in enumerate(queues) if q]
            raise ProgramError("cannot place sends and receives (the program deadlocks): " + ", ".join(stuck[:6]))
    return Linked(t, placed.routes, placed.workers, tuple(nodes), tuple(map(tuple, lists)), send_of, compute_of)


def defer_receives(linked: Linked) -> Linked:
    """Pass 3, torch's ``_defer_recv_ops``: each receive just before its consumer (before both halves
    of an overlapped pair), or before a send to its peer when this worker is the lower-numbered one."""
    nodes, t = linked.nodes, linked.template
    order = []
    for w, ids in enumerate(linked.order):
        result: list[int] = []
        deferred: dict[int, None] = {}  # insertion-ordered set of receives
        for n in ids:
            node = nodes[n]
            if node.kind.is_recv:
                deferred[n] = None
                continue
            if node.kind.is_send and w < node.peer:
                due = [r for r in deferred if nodes[r].peer == node.peer]
            elif node.kind.is_compute:
                consumers = {node.op, t.ops[node.op].overlap}
                due = [r for r in deferred if nodes[r].op in consumers]
            else:
                due = []
            for r in due:
                result.append(r)
                del deferred[r]
            result.append(n)
        if deferred:
            raise ProgramError(f"worker {w}: receives {[nodes[r].label for r in deferred]} have no consumer")
        order.append(tuple(result))
    return replace(linked, order=tuple(order))


def place_collectives(linked: Linked) -> StepGraph:
    """Pass 4: the data-parallel collectives of ``group_collectives``, one node per worker of the
    group, an UNSHARD right before the compute it feeds (and one of its inputs), a REDUCE_GRAD after
    its anchor (before the worker's next compute op, or last); then every node's data inputs."""
    t, workers, compute_of = linked.template, linked.workers, linked.compute_of
    nodes = list(linked.nodes)
    order = [list(ids) for ids in linked.order]
    members: list[tuple[int, ...]] = []
    placed: list[tuple[int, int, bool]] = []  # (worker, node, before) to insert next to a compute
    once = t.plan.strategy.reduces_once_per_step
    for c, spec in enumerate(group_collectives(t)):
        a = t.ops[spec.op].action
        stage, microbatch = (-1, -1) if (spec.kind is Kind.REDUCE_GRAD and spec.last and once) or spec.group < 0 \
            else (a.stage, a.microbatch)
        group = []
        for w in workers:
            if spec.group < 0 or w.group == spec.group:
                nodes.append(Node(w.index, spec.kind, stage, microbatch, spec.op_of(w.group), collective=c))
                group.append(len(nodes) - 1)
                placed.append((w.index, len(nodes) - 1, spec.kind.precedes_its_op))
        members.append(tuple(group))
    anchor = [-1] * len(nodes)
    unshard: dict[int, list[int]] = {}  # compute -> the collectives before it, each one of its inputs
    for w, n, before in placed:
        compute = compute_of[(nodes[n].op, w)]
        ids = order[w]
        at = ids.index(compute)
        if before:
            unshard.setdefault(compute, []).append(n)
            while nodes[n].stage < 0 and at > 0 and nodes[ids[at - 1]].kind.is_recv \
                    and nodes[ids[at - 1]].op == nodes[n].op:
                at -= 1  # a collective of the whole job: before the receives of its op, which wait on it
        else:
            anchor[n] = compute
            at += 1
            while at < len(ids) and not nodes[ids[at]].kind.is_compute:
                at += 1
        ids.insert(at, n)
    inputs = _data_inputs(t, nodes, linked.send_of, compute_of)
    for compute, before in unshard.items():
        inputs[compute].extend(before)
    return StepGraph(t, workers, tuple(nodes), tuple(map(tuple, order)), tuple(map(tuple, inputs)),
                     tuple(members), linked.routes, tuple(anchor))


def _data_inputs(t: Template, nodes: list[Node], send_of: dict[int, int],
                 compute_of: dict[tuple[int, int], int]) -> list[list[int]]:
    """Per node, what it reads: a compute its local inputs and receives, a send its producer, a
    receive its send (first: ``StepGraph.matching`` relies on it)."""
    receives: dict[tuple[int, int], list[int]] = {}
    for n, node in enumerate(nodes):
        if node.kind.is_recv:
            receives.setdefault((node.op, node.worker), []).append(n)
    inputs: list[list[int]] = []
    for n, node in enumerate(nodes):
        if node.kind.is_compute:
            op = t.ops[node.op]
            local = [compute_of[(d, node.worker)] for d in op.deps if t.ops[d].group == op.group]
            inputs.append(local + receives.get((node.op, node.worker), []))
        elif node.kind.is_send:
            inputs.append([compute_of[(node.op, node.worker)]])
        elif node.kind.is_recv:
            inputs.append([send_of[n]])
        else:
            inputs.append([])
    return inputs


def hoist_for_rendezvous(graph: StepGraph) -> StepGraph:
    """Pass 5: post receives earlier where blocking sends would otherwise wait on each other.

    torch's placement assumes sends that never block their sender (NCCL's isend). With a send that
    completes only once its peer has posted the receive (gloo's blocking send, or any rendezvous
    protocol) two workers can each sit in a send whose receive the other posts later. A dry run
    finds every such standstill and releases the send of the lowest waiting worker by moving its
    receive up to where its peer stands. Where torch's placement is already safe nothing moves.
    Moving a receive up changes no compute, send or collective's dependencies, so the dry run
    may read the graph's before it moves anything."""
    dry = Rendezvous.of(graph)
    stuck = dry.run(hoist=True)
    if stuck:  # only data waits left: the program itself would deadlock
        raise ProgramError("the step graph deadlocks: " + ", ".join(
            f"w{w} at {graph.labels[dry.order[w][dry.cursor[w]]]}" for w in stuck[:6]))
    order = tuple(map(tuple, dry.order))
    return graph if order == graph.order else replace(graph, order=order)
