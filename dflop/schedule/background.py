"""Scheduling ahead of training, off the critical path.

A background thread takes global batches in order and solves step t+1, t+2,
... (at most ``lookahead`` ahead) while step t runs, each under a deadline
derived from the expected step time. ``get(t)`` hands out step t's schedule;
if the worker has not finished it by then, the heuristic answer is computed
on the spot and becomes step t's schedule (the worker's late answer is
dropped), so a slow solve never blocks a step. Whatever ``get`` returns is
checked to hold every sample of the batch exactly once and published to a
channel, from which every other rank reads the very same schedule. A worker
that crashes makes ``get`` raise, never hang.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

from dflop.errors import DflopError
from dflop.schedule.step import StepSchedule
from dflop.workload.sample import SampleTable

Solve = Callable[[SampleTable, float], StepSchedule]
"""(batch, seconds allowed) -> schedule."""
Fallback = Callable[[SampleTable], StepSchedule]


class SchedulerError(DflopError):
    """The background scheduler failed; the message says at which step and why."""


class Channel(Protocol):
    def publish(self, step: int, schedule: StepSchedule) -> None: ...

    def read(self, step: int, timeout: float) -> StepSchedule: ...


class MemoryChannel:
    """Schedules shared between threads of one process."""

    def __init__(self) -> None:
        self._items: dict[int, StepSchedule] = {}
        self._cond = threading.Condition()

    def publish(self, step: int, schedule: StepSchedule) -> None:
        with self._cond:
            self._items[step] = schedule
            self._cond.notify_all()

    def read(self, step: int, timeout: float) -> StepSchedule:
        with self._cond:
            if not self._cond.wait_for(lambda: step in self._items, timeout=timeout):
                raise SchedulerError(f"no schedule for step {step} after {timeout:g} s")
            return self._items[step]


class FileChannel:
    """Schedules as JSON files in a shared folder: written once (atomically), read by all ranks."""

    def __init__(self, folder: str | Path, poll: float = 0.01) -> None:
        self.folder = Path(folder)
        self.poll = poll
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DflopError(f"{self.folder}: cannot create the schedule folder ({exc.strerror})") from None

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step:08d}.json"

    def publish(self, step: int, schedule: StepSchedule) -> None:
        schedule.save(self.path(step))

    def read(self, step: int, timeout: float) -> StepSchedule:
        path = self.path(step)
        give_up = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > give_up:
                raise SchedulerError(f"{path}: no schedule for step {step} after {timeout:g} s")
            time.sleep(self.poll)
        return StepSchedule.from_json(json.loads(path.read_text()), str(path))


def check_schedule(batch: SampleTable, schedule: StepSchedule) -> None:
    """Every sample of the batch in exactly one bin, and nothing else."""
    if sorted(schedule.ids) != sorted(str(i) for i in batch.ids):
        raise SchedulerError("a schedule does not hold exactly the samples of its batch")
    bins = schedule.replicas * schedule.microbatches
    if len(schedule.assignment) != len(batch) or schedule.assignment.min() < 0 \
            or schedule.assignment.max() >= bins:
        raise SchedulerError("a schedule puts a sample in a bin that does not exist")


@dataclass
class _Slot:
    batch: SampleTable
    schedule: StepSchedule | None = None


class AsyncScheduler:
    """Background scheduling of a stream of global batches (use as a context manager)."""

    def __init__(self, batches: Iterator[SampleTable], solve: Solve, fallback: Fallback, *,
                 deadline: float, lookahead: int = 2, channel: Channel | None = None) -> None:
        if deadline <= 0 or lookahead < 1:
            raise DflopError("deadline must be positive and lookahead at least 1")
        self._batches, self._solve, self._fallback = batches, solve, fallback
        self.deadline, self.lookahead = deadline, lookahead
        self.channel = channel or MemoryChannel()
        self._slots: dict[int, _Slot] = {}
        self._next_get = 0
        self._error: BaseException | None = None
        self._error_step = -1
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="dflop-scheduler", daemon=True)
        self.late = 0
        """Steps whose schedule came from the fallback because the solve was late."""

    def __enter__(self) -> "AsyncScheduler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, 2 * self.deadline))

    def _work(self) -> None:
        step = 0
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or step - self._next_get < self.lookahead)
                    if self._stop:
                        return
                batch = next(self._batches, None)
                if batch is None:
                    return
                with self._cond:
                    self._slots[step] = _Slot(batch)
                    self._cond.notify_all()
                schedule = self._solve(batch, self.deadline)
                with self._cond:
                    slot = self._slots.get(step)
                    if slot is not None and slot.schedule is None:
                        slot.schedule = schedule
                    self._cond.notify_all()
                step += 1
        except BaseException as exc:  # surfaced by get(), never swallowed
            with self._cond:
                self._error, self._error_step = exc, step
                self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SchedulerError(f"the scheduler worker failed at step {self._error_step}: "
                                 f"{type(self._error).__name__}: {self._error}") from self._error
        finished = self._thread.ident is not None and not self._thread.is_alive()
        if finished and self._next_get not in self._slots:
            raise SchedulerError(f"no batch for step {self._next_get}: the batch stream ended")

    def get(self, step: int) -> tuple[SampleTable, StepSchedule]:
        """Step ``step``'s batch and schedule (steps are taken in order)."""
        if step != self._next_get:
            raise DflopError(f"steps are taken in order: expected step {self._next_get}, got {step}")
        give_up = time.monotonic() + self.deadline
        with self._cond:
            while True:
                self._raise_if_failed()
                slot = self._slots.get(step)
                if slot is not None and slot.schedule is not None:
                    break
                remaining = give_up - time.monotonic()
                if slot is not None and remaining <= 0:
                    slot.schedule = self._fallback(slot.batch)  # late: decide now, drop the worker's
                    self.late += 1
                    break
                self._cond.wait(timeout=max(remaining, 0.005) if slot is not None else 0.05)
            self._slots.pop(step)
            self._next_get += 1
            self._cond.notify_all()
        check_schedule(slot.batch, slot.schedule)
        self.channel.publish(step, slot.schedule)
        return slot.batch, slot.schedule

