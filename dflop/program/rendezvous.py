"""A dry run of per-worker orders under blocking point-to-point: the strictest semantics a backend has.

Posting a receive never blocks; a send completes only once its peer has posted
the matching receive (a rendezvous); a node waits until everything it reads is
done (a receive is done when its send completed); a collective waits for all
its members. Workers are woken only when what they wait for changes, so a run
costs about one visit per node even on thousand-worker graphs.

The lowering uses it to *repair* an order (``hoist=True``: when everything
stands still and some worker waits in a send, that send's receive is moved up
to where its peer stands, which is always legal since posting early changes no
data dependency); the checker uses it to *judge* one (``hoist=False``: report
what each stuck worker waits for).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from dflop.program.actions import Kind
from dflop.program.stepgraph import StepGraph


@dataclass
class Rendezvous:
    kinds: Sequence[Kind]
    worker: Sequence[int]
    """Per node: its worker."""
    order: list[list[int]]
    """Per worker: node ids in order (hoisting edits it in place)."""
    deps: Sequence[Sequence[int]]
    """Per node: what it waits for (``StepGraph.deps``)."""
    recv_of: dict[int, int]
    """Send -> its receive."""
    collectives: Sequence[Sequence[int]]
    done: list[bool] = field(init=False)
    posted: list[bool] = field(init=False)
    cursor: list[int] = field(init=False)

    @classmethod
    def of(cls, graph: StepGraph) -> "Rendezvous":
        """A dry run of ``graph``'s order (on a copy: hoisting edits ``order``, never the graph)."""
        nodes = graph.nodes
        recv_of = {s: r for s, r in enumerate(graph.matching) if r >= 0 and nodes[s].kind.is_send}
        return cls([n.kind for n in nodes], graph.worker_of, [list(ids) for ids in graph.order], graph.deps,
                   recv_of, graph.collectives)

    def __post_init__(self) -> None:
        n = len(self.kinds)
        self.done, self.posted = [False] * n, [False] * n
        self.cursor = [0] * len(self.order)
        self._member_of = {m: c for c, members in enumerate(self.collectives) for m in members}
        self._arrived = [0] * len(self.collectives)
        self._at_collective = [False] * n
        self._waiters: dict[int, list[int]] = {}  # node -> workers to wake when it is done or posted
        self._in_send: list[int] = []  # heap of workers that stopped at a send
        self._ready = list(range(len(self.order)))
        self._left = sum(len(ids) for ids in self.order)  # cursor moves still to come

    def _wait(self, w: int, on: int) -> bool:
        self._waiters.setdefault(on, []).append(w)
        return False

    def _wake(self, node: int) -> None:
        self._ready.extend(self._waiters.pop(node, ()))

    def _advance(self, w: int) -> bool:
        n = self.order[w][self.cursor[w]]
        kind = self.kinds[n]
        if kind.is_recv:
            self.posted[n] = True
            self._wake(n)
        elif kind.is_collective:
            c = self._member_of[n]
            if not self._at_collective[n]:  # a worker may be woken twice while it waits here
                self._at_collective[n] = True
                self._arrived[c] += 1
            if self._arrived[c] < len(self.collectives[c]):
                return False  # the last member to arrive moves everyone on
            for m in self.collectives[c]:
                self.done[m] = True
                self.cursor[self.worker[m]] += 1
                self._left -= 1
                if self.worker[m] != w:
                    self._ready.append(self.worker[m])
            return True
        else:
            for d in self.deps[n]:
                if not self.done[d]:
                    return self._wait(w, d)
            if kind.is_send:
                r = self.recv_of[n]
                if not self.posted[r]:
                    heapq.heappush(self._in_send, w)
                    return self._wait(w, r)
                self.done[r] = True
                self._wake(r)
            self.done[n] = True
            self._wake(n)
        self.cursor[w] += 1
        self._left -= 1
        return True

    def run(self, hoist: bool) -> list[int]:
        """Run to the end or to a standstill; returns the workers that are stuck (empty when done)."""
        while True:
            while self._ready:
                w = self._ready.pop()
                while self.cursor[w] < len(self.order[w]) and self._advance(w):
                    pass
            if not self._left:
                return []
            if not hoist or not self._hoist():
                return [w for w, ids in enumerate(self.order) if self.cursor[w] < len(ids)]

    def _hoist(self) -> bool:
        """Release the lowest worker waiting in a send by moving its receive up to its peer's cursor."""
        while self._in_send:
            w = heapq.heappop(self._in_send)
            n = self.order[w][self.cursor[w]] if self.cursor[w] < len(self.order[w]) else -1
            if n < 0 or not self.kinds[n].is_send or self.posted[self.recv_of[n]]:
                continue  # moved on since it stopped there
            r = self.recv_of[n]
            peer = self.worker[r]
            ids = self.order[peer]
            ids.remove(r)
            ids.insert(self.cursor[peer], r)
            self._ready.append(peer)
            return True
        return False
