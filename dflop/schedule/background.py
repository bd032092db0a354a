"""Scheduling ahead of training, off the critical path.

A background thread solves the steps ahead of the consumer (at most
``lookahead`` past the step it will ask for next), each solve allowed
``deadline`` seconds. ``get(t)`` hands out step t's schedule, and step t's
deadline runs from that call (the step is due), whatever the worker is doing:
the solver's schedule if it is there by then, otherwise the fallback's (a fast
heuristic, computed on the spot). A late answer for a step already served is
discarded when it comes.

A solve that raises, or returns a schedule that does not hold exactly its
batch's samples, is recorded in ``failures`` and its step gets the fallback's
schedule at once: one bad solve costs one step its balance, never a step, and
never a step solved before it. Batches are taken from the stream by whoever
needs one first (the worker or ``get``), so a solve that never returns holds
up no step: the steps after it are served by the fallback, each by its
deadline. Whatever ``get`` returns is checked to hold every sample of the
batch exactly once. A batch stream that ends or fails, or a fallback
that fails, makes ``get`` raise for that step, never hang.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import numpy as np

from dflop.errors import DflopError
from dflop.schedule.step import StepSchedule
from dflop.specs import scheduling
from dflop.workload.sample import SampleTable

Solve = Callable[[SampleTable, float], StepSchedule]
"""(batch, seconds allowed) -> schedule."""
Fallback = Callable[[SampleTable], StepSchedule]


class SchedulerError(DflopError):
    """The background scheduler failed; the message says at which step and why."""


def check_schedule(batch: SampleTable, schedule: StepSchedule) -> None:
    """Every sample of the batch in exactly one bin, and nothing else."""
    if sorted(schedule.ids) != sorted(str(i) for i in batch.ids):
        raise SchedulerError("a schedule does not hold exactly the samples of its batch")
    check_bins(schedule.assignment, len(batch), schedule.replicas * schedule.microbatches)


def check_bins(assignment: np.ndarray, samples: int, bins: int) -> None:
    """An assignment of ``samples`` samples, each to one of the bins 0..bins-1."""
    if len(assignment) != samples:
        raise SchedulerError(f"a schedule places {len(assignment)} samples, its batch has {samples}")
    outside = np.flatnonzero((assignment < 0) | (assignment >= bins))
    if len(outside):
        raise SchedulerError(f"a schedule puts a sample in a bin that does not exist (sample {outside[0]} "
                             f"in bin {assignment[outside[0]]}, bins 0..{bins - 1})")


class _Feed:
    """The batch stream, taken in order by whichever thread needs a step's batch first."""

    def __init__(self, batches: Iterator[SampleTable]) -> None:
        self._batches, self._lock = batches, threading.Lock()
        self._taken: dict[int, SampleTable] = {}
        self._count = 0
        self._end: str | None = None
        """Why the stream gives no more batches, once it does not."""

    def batch(self, step: int) -> SampleTable | None:
        with self._lock:
            while self._count <= step and self._end is None:
                try:
                    self._taken[self._count] = next(self._batches)
                    self._count += 1
                except StopIteration:
                    self._end = "the batch stream ended"
                except Exception as exc:  # reported for the step that needed it
                    self._end = f"the batch stream failed: {type(exc).__name__}: {exc}"
            return self._taken.get(step)

    def exhausted(self, step: int) -> bool:
        return step >= self._count and self._end is not None

    def why_not(self, step: int) -> str:
        return f"no batch for step {step}: {self._end}"

    def drop(self, step: int) -> None:
        with self._lock:
            self._taken.pop(step, None)


class AsyncScheduler:
    """Background scheduling of a stream of global batches (use as a context manager)."""

    def __init__(self, batches: Iterator[SampleTable], solve: Solve, fallback: Fallback, *,
                 deadline: float, lookahead: int = 2) -> None:
        self.deadline = scheduling.time_limit(deadline, "deadline")
        self.lookahead = scheduling.whole_number(lookahead, "lookahead", 1)
        self._feed, self._solve, self._fallback = _Feed(batches), solve, fallback
        self._solved: dict[int, StepSchedule] = {}
        self._failed: set[int] = set()
        self._next_get = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="dflop-scheduler", daemon=True)
        self.late = 0
        """Steps served by the fallback because their solve was not done by their deadline."""
        self.failures: list[str] = []
        """One line per solve that raised or returned a wrong schedule (its step got the fallback)."""
        self.discarded = 0
        """Solves that finished after their step had been served."""

    def __enter__(self) -> "AsyncScheduler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker; a solve that never returns is left behind (the thread is a daemon)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout=max(1.0, 2 * self.deadline))

    def _work(self) -> None:
        step = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or step - self._next_get < self.lookahead)
                if self._stop:
                    return
                step = max(step, self._next_get)  # steps already served need no solve
            batch = self._feed.batch(step)
            if batch is None:
                if self._feed.exhausted(step):
                    return
                step += 1  # served (and dropped) while this thread looked away
                continue
            try:
                schedule = self._solve(batch, self.deadline)
                check_schedule(batch, schedule)
            except Exception as exc:  # this step gets the fallback; the worker goes on
                with self._cond:
                    self.failures.append(f"step {step}: {type(exc).__name__}: {exc}")
                    self._failed.add(step)
                    self._cond.notify_all()
            else:
                with self._cond:
                    if step >= self._next_get:
                        self._solved[step] = schedule
                    else:
                        self.discarded += 1
                    self._cond.notify_all()
            step += 1

    def get(self, step: int) -> tuple[SampleTable, StepSchedule]:
        """Step ``step``'s batch and schedule (steps are taken in order), by ``deadline`` seconds
        from this call plus the fallback's time."""
        if step != self._next_get:
            raise DflopError(f"steps are taken in order: expected step {self._next_get}, got {step}")
        due = time.monotonic() + self.deadline
        batch = self._feed.batch(step)
        if batch is None:
            raise SchedulerError(self._feed.why_not(step))
        with self._cond:
            while step not in self._solved and step not in self._failed and time.monotonic() < due:
                self._cond.wait(timeout=max(due - time.monotonic(), 0.0))
            schedule = self._solved.pop(step, None)
            if schedule is None and step not in self._failed:
                self.late += 1
            self._failed.discard(step)
            self._next_get += 1
            self._cond.notify_all()
        self._feed.drop(step)
        if schedule is None:
            schedule = self._fallback_for(step, batch)
        return batch, schedule

    def _fallback_for(self, step: int, batch: SampleTable) -> StepSchedule:
        try:
            schedule = self._fallback(batch)
            check_schedule(batch, schedule)
        except Exception as exc:
            raise SchedulerError(f"step {step}: the fallback scheduler failed: {type(exc).__name__}: {exc}") from exc
        return schedule
