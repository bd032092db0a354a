"""The step graph: one step of one plan, lowered onto workers, holding no times.

This is the one IR both runtimes execute. A *worker* is one tensor-parallel
group (one pipeline rank of one module on one data-parallel replica); each
worker has an ordered list of nodes: the compute actions of its pipeline
program (F, B, I, W) and the communication that connects it to the others,
made explicit:

- ``SEND_*`` / ``RECV_*`` between the stages of a module (same replica);
- ``BRIDGE_SEND_*`` / ``BRIDGE_RECV_*`` between encoder and LLM replicas of a
  disaggregated plan, one pair per (encoder replica, LLM replica) that share
  samples in a microbatch (the routes come from the step schedule);
- data-parallel collectives over the replicas of a pipeline rank, by ZeRO
  stage (``collectives.py``): ``REDUCE_GRAD`` and FSDP's ``UNSHARD`` (never
  ``RESHARD``: gathered weights are freed inside the op that used them).

Sends and receives are placed as torch.distributed.pipelining places them: a
send right after the compute that produces its tensor, the matching receive
posted on the other rank when the sender's compute is placed (a lockstep pass,
``_add_send_recv``), then every receive deferred to just before the compute
that consumes it, except that a lower-numbered worker posts its receives from a
peer before it sends to that peer (``_defer_recv_ops``' rank-parity rule).
torch assumes sends that never block; so that blocking sends (a rendezvous, as
gloo's ``send``) cannot deadlock either, a dry run then moves up the few
receives that two workers would otherwise wait on each other for (1F1B's steady
state needs it: Megatron's ``send_backward_recv_forward`` pairs them the same
way).

Each node's ``deps`` are the nodes that must finish before it starts: the
previous compute node of its worker (one compute stream), its data inputs, the
matching send for a receive, the previous collective of its worker (one
collective stream). A compute op's inputs include the ``UNSHARD`` before it.

Overlap is one more edge: a ``REDUCE_GRAD``'s ``anchor`` is the compute node
whose backward fills its buckets; it starts ``lag`` (a cost) after the anchor
*starts*, beside it. A runtime launches it as the anchor produces gradients
(DDP's bucket hooks) and waits for it where it stands in the order: after the
anchor, before the worker's next compute op (last for ZeRO-0/1).

Costs are a separate set of arrays (``costs.py``); the simulator runs (graph,
costs), the torch backend runs ``order[worker]``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

from dflop.program.actions import Kind
from dflop.program.check import ProgramError
from dflop.program.collectives import group_collectives
from dflop.program.rendezvous import Rendezvous
from dflop.program.routing import BridgeRoutes
from dflop.program.template import Template
from dflop.specs.plan import Module, place


class Stream(IntEnum):
    """Which resource a node occupies while it runs."""

    COMPUTE = 0
    """The worker's compute stream: one compute node at a time, in program order."""
    P2P = 1
    """A link between two workers: sends occupy it for their transfer; receives mark arrival."""
    COLLECTIVE = 2
    """The worker's collective stream, shared with the other members of the collective."""


@dataclass(frozen=True, slots=True)
class Node:
    worker: int
    kind: Kind
    stage: int
    """Program stage (encoder stages first when disaggregated); -1 for step-level collectives."""
    microbatch: int
    """-1 for step-level collectives."""
    op: int
    """Template op: the compute itself, the producer of a send, the consumer of a receive; -1 otherwise."""
    peer: int = -1
    """The worker on the other end of a send or receive."""
    collective: int = -1
    """Collective group (index into ``StepGraph.collectives``)."""

    @property
    def stream(self) -> Stream:
        if self.kind.is_compute:
            return Stream.COMPUTE
        return Stream.COLLECTIVE if self.kind.is_collective else Stream.P2P

    @property
    def label(self) -> str:
        """The name both runtimes give this node in traces (torch's action text where it has one)."""
        k = self.kind
        if k.is_collective:
            if self.stage < 0:
                return k.value
            return f"{self.stage}{k.value}{self.microbatch}"
        if k in (Kind.BRIDGE_SEND_F, Kind.BRIDGE_SEND_B):
            return f"{self.stage}{k.value}{self.microbatch}>w{self.peer}"
        if k in (Kind.BRIDGE_RECV_F, Kind.BRIDGE_RECV_B):
            return f"{self.stage}{k.value}{self.microbatch}<w{self.peer}"
        return f"{self.stage}{k.value}{self.microbatch}"


@dataclass(frozen=True)
class Worker:
    """A tensor-parallel group of GPUs running one pipeline rank of one module replica."""

    index: int
    name: str
    module: Module
    """The module of its pipeline rank (a colocated LLM stage 0 also runs the encoder)."""
    pp_rank: int
    """Pipeline rank within its module."""
    replica: int
    group: int
    """Template group (pipeline rank of a module, all replicas)."""
    stages: tuple[int, ...]
    """Module-local stages it holds (several with virtual stages)."""
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class StepGraph:
    template: Template
    workers: tuple[Worker, ...]
    nodes: tuple[Node, ...]
    order: tuple[tuple[int, ...], ...]
    """Per worker: its node ids in execution order."""
    inputs: tuple[tuple[int, ...], ...]
    """Per node: what it reads. A compute node its local inputs and its receives; a send its
    producer; a receive its send."""
    collectives: tuple[tuple[int, ...], ...]
    """Per collective: its member nodes, one per participating worker (``group_collectives`` order)."""
    routes: BridgeRoutes | None
    anchor: tuple[int, ...] = ()
    """Per node: the compute node whose start it follows by its lag (a REDUCE_GRAD overlapping the
    backward that fills its buckets); -1 for none."""

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def deps(self) -> tuple[tuple[int, ...], ...]:
        """Per node: the nodes that must finish before it starts (its inputs, the worker's previous
        compute node unless it is the node's anchor, and for a collective the worker's previous
        collective)."""
        deps: list[tuple[int, ...]] = [()] * len(self.nodes)
        anchor = self.anchor or (-1,) * len(self.nodes)
        for ids in self.order:
            last_compute = last_collective = -1
            for n in ids:
                kind = self.nodes[n].kind
                mine = list(self.inputs[n])
                if kind.is_collective and last_collective >= 0:
                    mine.append(last_collective)
                if last_compute >= 0 and last_compute not in mine and last_compute != anchor[n]:
                    mine.append(last_compute)
                deps[n] = tuple(mine)
                if kind.is_compute:
                    last_compute = n
                elif kind.is_collective:
                    last_collective = n
        return tuple(deps)

    @cached_property
    def streams(self) -> list[Stream]:
        """Per node: the resource it occupies (a simulator reads it once per node per step)."""
        return [n.stream for n in self.nodes]

    @cached_property
    def waits(self) -> list[int]:
        """Per node: how many ends it waits for before it can start (its deps, and its anchor's start)."""
        anchor = self.anchor or (-1,) * len(self.nodes)
        return [len(d) + (a >= 0) for d, a in zip(self.deps, anchor)]

    @cached_property
    def worker_of(self) -> list[int]:
        return [n.worker for n in self.nodes]

    @cached_property
    def labels(self) -> list[str]:
        return [n.label for n in self.nodes]

    @cached_property
    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for n, deps in enumerate(self.deps):
            for d in deps:
                out[d].append(n)
        return out

    @cached_property
    def overlapping(self) -> list[list[int]]:
        """Per compute node: the nodes anchored on it (that start while it runs)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n, a in enumerate(self.anchor):
            if a >= 0:
                out[a].append(n)
        return out

    @cached_property
    def link(self) -> list[int]:
        """Per send: its link (one per ordered pair of workers); -1 for other nodes."""
        ids: dict[tuple[int, int], int] = {}
        return [ids.setdefault((n.worker, n.peer), len(ids)) if n.kind.is_send else -1 for n in self.nodes]

    @cached_property
    def links(self) -> int:
        return max(self.link, default=-1) + 1

    @cached_property
    def matching(self) -> list[int]:
        """Per send: its receive; per receive: its send; -1 for other nodes."""
        out = [-1] * len(self.nodes)
        for n, node in enumerate(self.nodes):
            if node.kind.is_recv:
                send = self.inputs[n][0]
                out[n], out[send] = send, n
        return out

    @cached_property
    def position(self) -> list[int]:
        """Per node: its index in its worker's order."""
        out = [0] * len(self.nodes)
        for ids in self.order:
            for i, n in enumerate(ids):
                out[n] = i
        return out

    def compute_nodes(self) -> list[int]:
        return [n for n, node in enumerate(self.nodes) if node.kind.is_compute]

    def table(self, limit: int = 40) -> str:
        """Worker-by-position table of labels (what ``_format_pipeline_order`` shows for torch)."""
        columns = [[self.labels[n] for n in ids] for ids in self.order]
        depth = max((len(c) for c in columns), default=0)
        width = max([len(x) for c in columns for x in c] + [6])
        lines = ["step  " + " ".join(f"{'w' + str(w):<{width}}" for w in range(len(columns)))]
        for i in range(min(depth, limit)):
            lines.append(f"{i:>4}  " + " ".join(f"{c[i] if i < len(c) else '':<{width}}" for c in columns))
        if depth > limit:
            lines.append(f" ...  ({depth - limit} more)")
        return "\n".join(lines)


def build_workers(template: Template) -> tuple[Worker, ...]:
    gpus = place(template.plan)
    workers = []
    for g in template.groups:
        for x in range(g.replicas):
            gp = gpus.gpus(Module(g.module), g.rank, x)
            span = f"{gp[0]}" if len(gp) == 1 else f"{gp[0]}-{gp[-1]}"
            workers.append(Worker(len(workers), f"{g.module} pp{g.rank} dp{x} [GPU {span}]", Module(g.module),
                                  g.rank, x, g.index, g.stages, gp))
    return tuple(workers)


@dataclass(frozen=True)
class _Edge:
    """A tensor crossing from (producer op, worker) to (consumer op, worker)."""

    src: int
    dst: int
    consumer: int
    send: Kind
    recv: Kind


def _remote_edges(t: Template, base: list[int], routes: BridgeRoutes | None) -> tuple[dict, dict]:
    """Outgoing and incoming cross-worker edges of every (template op, worker)."""
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


def lower(template: Template, routes: BridgeRoutes | None = None) -> StepGraph:
    """The step graph of ``template`` with the given bridge routes (needed when disaggregated)."""
    t = template
    workers = build_workers(t)
    base = [0] * len(t.groups)
    for w in reversed(workers):
        base[w.group] = w.index - w.replica
    out, incoming = _remote_edges(t, base, routes)
    nodes: list[Node] = []
    lists: list[list[int]] = [[] for _ in workers]
    send_of: dict[int, int] = {}  # receive -> its send
    compute_of: dict[tuple[int, int], int] = {}  # (template op, worker) -> node

    def new(node: Node) -> int:
        nodes.append(node)
        lists[node.worker].append(len(nodes) - 1)
        return len(nodes) - 1

    queues = [deque(o.index for o in t.ops if o.group == w.group) for w in workers]
    arrived: dict[tuple[int, int], int] = {}
    remaining = sum(len(q) for q in queues)
    while remaining:  # torch's _add_send_recv: one compute action per worker and round
        progress = False
        for w, q in enumerate(queues):
            if not q:
                continue
            unit = [q[0]] if t.ops[q[0]].overlap < 0 else [q[0], t.ops[q[0]].overlap]  # an overlapped pair
            if any(arrived.get((i, w), 0) < incoming.get((i, w), 0) for i in unit):
                continue
            for i in unit:
                q.popleft()
                a = t.ops[i].action
                compute_of[(i, w)] = new(Node(w, a.kind, a.stage, a.microbatch, i))
            for i in unit:  # a pair sends its outputs after both halves, as torch lowers it
                a = t.ops[i].action
                for e in out.get((i, w), ()):
                    send = new(Node(w, e.send, a.stage, a.microbatch, i, peer=e.dst))
                    stage = t.ops[e.consumer].action.stage
                    send_of[new(Node(e.dst, e.recv, stage, a.microbatch, e.consumer, peer=w))] = send
                    arrived[(e.consumer, e.dst)] = arrived.get((e.consumer, e.dst), 0) + 1
            remaining -= len(unit)
            progress = True
        if not progress:
            stuck = [f"w{w} at {t.ops[q[0]].action}" for w, q in enumerate(queues) if q]
            raise ProgramError("cannot place sends and receives (the program deadlocks): " + ", ".join(stuck[:6]))
    order = [_defer_receives(w, ids, nodes, t) for w, ids in enumerate(lists)]
    collectives, anchor, unshard = _place_collectives(t, workers, nodes, order, compute_of)
    inputs = _data_inputs(t, nodes, send_of, compute_of)
    for compute, u in unshard.items():
        inputs[compute].append(u)
    _hoist_for_rendezvous(nodes, order, inputs, send_of, collectives)
    return StepGraph(t, workers, tuple(nodes), tuple(tuple(o) for o in order), tuple(map(tuple, inputs)),
                     collectives, routes, tuple(anchor))


def _defer_receives(w: int, ids: list[int], nodes: list[Node], t: Template) -> list[int]:
    """torch's _defer_recv_ops: each receive just before its consumer (before both halves of an
    overlapped pair), or before a send to its peer when this worker is the lower-numbered one."""
    result: list[int] = []
    deferred: dict[int, None] = {}  # insertion-ordered set of receives
    for n in ids:
        node = nodes[n]
        if node.kind.is_recv:
            deferred[n] = None
            continue
        if node.kind.is_send and w < node.peer:
            for r in [r for r in deferred if nodes[r].peer == node.peer]:
                result.append(r)
                del deferred[r]
        if node.kind.is_compute:
            consumers = {node.op, t.ops[node.op].overlap}
            for r in [r for r in deferred if nodes[r].op in consumers]:
                result.append(r)
                del deferred[r]
        result.append(n)
    if deferred:
        raise ProgramError(f"worker {w}: receives {[nodes[r].label for r in deferred]} have no consumer")
    return result


def _place_collectives(t: Template, workers: tuple[Worker, ...], nodes: list[Node], order: list[list[int]],
                       compute_of: dict[tuple[int, int], int]) -> tuple[tuple[tuple[int, ...], ...], list[int],
                                                                         dict[int, int]]:
    """The data-parallel collectives of ``group_collectives``, one node per worker of the group:
    an UNSHARD right before the compute it feeds, a REDUCE_GRAD after its anchor (before the
    worker's next compute op, or last). Returns the members of each collective, every node's
    anchor, and the UNSHARD of each compute node that has one."""
    members: list[tuple[int, ...]] = []
    placed: list[tuple[int, int, bool]] = []  # (worker, node, before) to insert next to a compute
    once = t.plan.strategy.reduces_once_per_step
    for c, spec in enumerate(group_collectives(t)):
        a = t.ops[spec.op].action
        stage, microbatch = (-1, -1) if spec.kind is Kind.REDUCE_GRAD and spec.last and once \
            else (a.stage, a.microbatch)
        group = []
        for w in workers:
            if w.group == spec.group:
                nodes.append(Node(w.index, spec.kind, stage, microbatch, spec.op, collective=c))
                group.append(len(nodes) - 1)
                placed.append((w.index, len(nodes) - 1, spec.kind is Kind.UNSHARD))
        members.append(tuple(group))
    anchor = [-1] * len(nodes)
    unshard: dict[int, int] = {}
    for w, n, before in placed:
        compute = compute_of[(nodes[n].op, w)]
        ids = order[w]
        at = ids.index(compute)
        if before:
            unshard[compute] = n
        else:
            anchor[n] = compute
            at += 1
            while at < len(ids) and not nodes[ids[at]].kind.is_compute:
                at += 1
        ids.insert(at, n)
    return tuple(members), anchor, unshard


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


def _hoist_for_rendezvous(nodes: list[Node], order: list[list[int]], inputs: list[list[int]],
                          send_of: dict[int, int], collectives: tuple[tuple[int, ...], ...]) -> None:
    """Post receives earlier where blocking sends would otherwise wait on each other.

    torch's placement assumes sends that never block their sender (NCCL's isend). With a send that
    completes only once its peer has posted the receive (gloo's blocking send, or any rendezvous
    protocol) two workers can each sit in a send whose receive the other posts later. A dry run
    finds every such standstill and releases the send of the lowest waiting worker by moving its
    receive up to where its peer stands. Where torch's placement is already safe nothing moves."""
    dry = Rendezvous([n.kind for n in nodes], [n.worker for n in nodes], order, inputs,
                     {send: recv for recv, send in send_of.items()}, collectives)
    stuck = dry.run(hoist=True)
    if stuck:  # only data waits left: the program itself would deadlock
        raise ProgramError("the step graph deadlocks: " + ", ".join(
            f"w{w} at {nodes[order[w][dry.cursor[w]]].label}" for w in stuck[:6]))
