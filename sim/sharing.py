"""Ranks that outnumber the CPU cores they run on, time-sliced as the operating system does it.

CPU ranks launched on one machine are processes of one thread each; where more of them are
runnable than there are cores, the scheduler gives each the same share of the cores
(processor sharing: Linux's CFS is built to approach it). A rank waiting on a receive, a
collective or a pipeline bubble is not runnable, so it leaves its share to the others. Every
compute op in progress therefore advances at ``min(1, cores / ranks computing)`` of its own
speed, a tensor-parallel op counting each of its ranks. A mark on an op (the point of its
work where a gradient reduction anchored to it may start) advances with it. Of the
completion events scheduled, only the last counts: each op that starts or ends changes the
rate, and the soonest end is scheduled again.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import simpy

Reached = Callable[[int, int], None]
"""(node, ns): an op has done its work, or reached a mark."""


class ProcessorSharing:
    def __init__(self, env: simpy.Environment, cores: int, done: Reached, marked: Reached) -> None:
        if cores < 1:
            raise ValueError(f"cores: at least 1, got {cores}")
        self.env, self.cores, self.done, self.marked = env, cores, done, marked
        self.left: dict[int, float] = {}
        """Per op in progress (its node) and per mark (``~node``): nanoseconds of work left at full speed."""
        self.ranks: dict[int, int] = {}
        self.computing = 0
        """Ranks of the ops in progress."""
        self.since = 0
        self.due = 0
        """The number of the one completion event that counts (those before it are stale)."""
        self.settling = False
        self.events = 0

    @property
    def rate(self) -> float:
        return min(1.0, self.cores / self.computing) if self.computing else 1.0

    def join(self, op: int, work_ns: int, ranks: int, marks: Sequence[tuple[int, int]] = ()) -> None:
        """``op`` starts now with ``work_ns`` of work on ``ranks`` ranks; each (node, ns) of ``marks``
        is reached once ``op`` has done ns of its work."""
        self._advance()
        self.left[op], self.ranks[op] = float(work_ns), ranks
        self.computing += ranks
        for node, ns in marks:
            self.left[~node] = float(ns)
        if not self.settling:
            self._next()

    def _advance(self) -> None:
        now = self.env.now
        if self.left and now > self.since:
            done = (now - self.since) * self.rate
            for key in self.left:
                self.left[key] -= done
        self.since = now

    def _next(self) -> None:
        if not self.left:
            return
        self.due += 1
        self.events += 1
        soonest = min(self.left.values())
        wait = 0 if soonest <= 0.5 else math.ceil(soonest / self.rate - 1e-6)  # whole nanoseconds
        self.env.timeout(wait, self.due).callbacks.append(self._ended)

    def _ended(self, event: simpy.Event) -> None:
        if event.value != self.due:  # the rate changed since it was scheduled
            return
        self._advance()
        ended = [key for key, left in self.left.items() if left <= 0.5]
        for key in ended:
            del self.left[key]
            if key >= 0:
                self.computing -= self.ranks.pop(key)
        self.settling = True  # the ops these start join at this instant: one event for all of them
        for key in ended:
            if key >= 0:
                self.done(key, self.env.now)
            else:
                self.marked(~key, self.env.now)
        self.settling = False
        self._next()
