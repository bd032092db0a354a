"""Ranks that outnumber the CPU cores they run on, time-sliced as the operating system does it.

CPU ranks launched on one machine are processes of one thread each; where more of them are
runnable than there are cores, the scheduler gives each the same share of the cores
(processor sharing: Linux's CFS is built to approach it). A rank waiting on a receive, a
collective or a pipeline bubble is not runnable, so it leaves its share to the others. Every
compute op in progress therefore advances at ``min(1, cores / ranks computing)`` of its own
speed, a tensor-parallel op counting each of its ranks. The simulator's event queue holds one
pending completion at a time: the op that ends first at the current rate; each op that starts
or ends changes the rate and replaces it.
"""

from __future__ import annotations

import math
from typing import Callable

import simpy


class ProcessorSharing:
    def __init__(self, env: simpy.Environment, cores: int, done: Callable[[int, int], None]) -> None:
        self.env, self.cores, self.done = env, cores, done
        self.left: dict[int, float] = {}
        """Per op in progress: nanoseconds of work left at full speed."""
        self.ranks: dict[int, int] = {}
        self.computing = 0
        """Ranks of the ops in progress."""
        self.since = 0
        self.due = 0
        """The number of the one completion event that counts (those before it are stale)."""
        self.events = 0

    @property
    def rate(self) -> float:
        return min(1.0, self.cores / self.computing) if self.computing else 1.0

    def join(self, op: int, work_ns: int, ranks: int) -> None:
        """``op`` starts now with ``work_ns`` of work on ``ranks`` ranks."""
        self._advance()
        self.left[op], self.ranks[op] = float(work_ns), ranks
        self.computing += ranks
        self._next()

    def _advance(self) -> None:
        now = self.env.now
        if self.left and now > self.since:
            done = (now - self.since) * self.rate
            for op in self.left:
                self.left[op] -= done
        self.since = now

    def _next(self) -> None:
        if not self.left:
            return
        self.due += 1
        self.events += 1
        soonest = min(self.left.values())
        wait = max(0, math.ceil(soonest / self.rate - 1e-6))
        self.env.timeout(wait, self.due).callbacks.append(self._ended)

    def _ended(self, event: simpy.Event) -> None:
        if event.value != self.due:  # the rate changed since it was scheduled
            return
        self._advance()
        ended = [op for op, left in self.left.items() if left <= 0.5]  # whole nanoseconds: rounding
        for op in ended:
            del self.left[op]
            self.computing -= self.ranks.pop(op)
        self._next()
        for op in ended:
            self.done(op, self.env.now)
