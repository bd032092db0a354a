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

How the nodes are placed (torch.distributed.pipelining's ``_add_send_recv`` and
``_defer_recv_ops``, made safe for blocking sends) is the business of the
lowering passes (``lowering.py``); this module holds the IR they produce.

Each node's ``deps`` are the nodes that must finish before it starts: the
previous compute node of its worker (one compute stream), its data inputs, the
matching send for a receive, the previous collective of its worker (one
collective stream). A compute op's inputs include the ``UNSHARD`` before it.
``StepGraph.deps`` is the one place that says so: the reference longest path,
the SimPy executor, the checker and the rendezvous dry run all read it.

Overlap is one more edge: a ``REDUCE_GRAD``'s ``anchor`` is the compute node
whose backward fills its buckets; it starts ``lag`` (a cost) after the anchor
*starts*, beside it. A runtime launches it as the anchor produces gradients
(DDP's bucket hooks) and waits for it where it stands in the order: after the
anchor, before the worker's next compute op (last for ZeRO-0/1).

Costs are a separate set of arrays (``dflop.timing.costs``); the simulator runs (graph,
costs), the torch backend runs ``order[worker]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property

import numpy as np

from dflop.program.actions import Kind
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


class Role(IntEnum):
    """What an executor does with a node: a stream, with a P2P node's side of its transfer."""

    COMPUTE = 0
    SEND = 1
    RECEIVE = 2
    COLLECTIVE = 3


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
        if k.is_collective or k.is_encoder_phase:
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
class Delivery:
    """A step graph as an executor reads it that gives sends and receives no step of their own.

    A receive is folded into its send: it waits only for the send and its worker's previous
    compute node (``StepGraph.deps``), which also precedes whatever reads it, so a send delivers
    to what reads its receive. A compute node's data input made earlier on its own worker is left
    out: its end precedes the worker's previous compute node's start, which the node waits for
    anyway. A send that waits for one node alone follows it in that node's list, as ``~send`` and
    then what it delivers to, after the node's other consumers: that node's end starts the transfer.
    """

    delivers: list[list[int]]
    """Per node: what to tell when it ends."""
    waits: list[int]
    """Per node: how many of those tellings (and anchor starts) it waits for."""
    receives: np.ndarray
    sends: np.ndarray
    """Per receive: its send."""
    previous: np.ndarray
    """Per receive: its worker's previous compute node, or its send where there is none. A
    receive ends as the later of the two ends."""


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
    def delivery(self) -> Delivery:
        """``Delivery``: the graph as an executor that gives sends and receives no step of their
        own reads it (one pass over ``deps``: it is built once per lowered graph)."""
        roles, deps, worker_of = self.roles, self.deps, self.worker_of
        compute, send, receive = Role.COMPUTE, Role.SEND, Role.RECEIVE
        n = len(self.nodes)
        anchor = self.anchor or (-1,) * n
        before = [-1] * n  # per compute node: its worker's previous one
        for ids in self.order:
            last = -1
            for k in ids:
                if roles[k] is compute:
                    before[k], last = last, k
        waits = list(self.waits)
        delivers: list[list[int]] = [[] for _ in range(n)]
        follows: dict[int, list[int]] = {}  # per node: the sends that wait for it alone
        receives, sends, previous = [], [], []
        for c, role in enumerate(roles):
            mine = deps[c]
            if role is receive:  # what the fold takes for granted
                if roles[mine[0]] is not send or len(mine) > 2 or mine[1:] and roles[mine[1]] is not compute:
                    raise ValueError(f"{self.labels[c]}: a receive that waits for more than its send and "
                                     "its worker's previous compute node")
                receives.append(c)
                sends.append(mine[0])
                previous.append(mine[-1])
                continue
            if role is send and len(mine) == 1:
                follows.setdefault(mine[0], []).append(c)
                continue
            for d in mine:
                what = roles[d]
                if what is receive:
                    d = deps[d][0]  # its send tells c on arrival
                elif what is send:
                    raise ValueError(f"{self.labels[c]}: reads a send, not its receive")
                elif (what is compute and role is compute and before[c] != d and anchor[c] < 0
                        and worker_of[d] == worker_of[c]):
                    waits[c] -= 1  # d ended before c's previous compute node started
                    continue
                delivers[d].append(c)
        for k, followers in follows.items():
            for s in followers:
                delivers[k] += [~s, *delivers[s]]
        return Delivery(delivers, waits, np.array(receives, dtype=np.int64), np.array(sends, dtype=np.int64),
                        np.array(previous, dtype=np.int64))

    @cached_property
    def overlapping(self) -> list[list[int]]:
        """Per compute node: the nodes anchored on it (that start while it runs)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n, a in enumerate(self.anchor):
            if a >= 0:
                out[a].append(n)
        return out

    @cached_property
    def unanchored_compute(self) -> list[bool]:
        """Per node: a compute node that nothing is anchored on (what a simulator starts at once)."""
        compute = Role.COMPUTE
        return [role is compute and not anchored for role, anchored in zip(self.roles, self.overlapping)]

    @cached_property
    def link(self) -> list[int]:
        """Per send: its link (one per ordered pair of workers); -1 for other nodes."""
        ids: dict[tuple[int, int], int] = {}
        return [ids.setdefault((n.worker, n.peer), len(ids)) if n.kind.is_send else -1 for n in self.nodes]

    @cached_property
    def roles(self) -> list[Role]:
        """Per node: its ``Role`` (a simulator reads it once per node per step)."""
        p2p, collective = Stream.P2P, Stream.COLLECTIVE
        return [Role.COLLECTIVE if stream is collective else (Role.SEND if wire >= 0 else Role.RECEIVE)
                if stream is p2p else Role.COMPUTE for stream, wire in zip(self.streams, self.link)]

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

    @cached_property
    def compute_nodes(self) -> list[int]:
        compute = Role.COMPUTE
        return [n for n, role in enumerate(self.roles) if role is compute]

    @cached_property
    def roots(self) -> tuple[int, ...]:
        """The nodes that wait for nothing: where a step starts."""
        return tuple(n for n, waits in enumerate(self.waits) if not waits)

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
