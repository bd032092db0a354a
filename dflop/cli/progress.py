"""Progress of long work on stderr: rich bars on a terminal, one line every few seconds otherwise.

Work reports through a plain callable ``progress(what, done, total)`` (the optimizer, the
profiler and the backends take one and know nothing of terminals). :func:`progress_bar`
hands out such a callable; ``channel`` gives another one, for a different kind of work,
on the same display: ``dflop run`` searches plans and then runs steps.

Off a terminal (a log file, CI, a pipe) nothing is redrawn: a line like
``dflop: profiling tiny-llm: 12/42 shapes, 0:35 elapsed`` is written at most once per
period, and a last line when the work is done (with the number of parts, when it had several),
so a log shows that the work moves and when it ended without thousands of lines.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, TextIO

from dflop.specs.progress import periodically

Describe = Callable[[str], str]

PERIOD_S = 5.0


def elapsed(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


@dataclass
class LineDisplay:
    """One line per period at most, and a last one when the work has finished.

    Lines come on updates and, between them, on ``tick`` (a heartbeat thread calls it), so
    that one long unit of work does not look like a hang. The gap between lines grows with
    the time elapsed (a tenth of it, at least one period): a six-hour profile logs about a
    hundred lines, not thousands."""

    write: Callable[[str], Any]
    clock: Callable[[], float] = time.monotonic
    period: float = PERIOD_S
    started: float = field(init=False)
    last_line: float = field(init=False)
    latest: tuple[str, int, int, str] | None = field(init=False, default=None)
    tasks: set[str] = field(init=False, default_factory=set)
    lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.started = self.last_line = self.clock()

    def update(self, task: str, done: int, total: int, unit: str) -> None:
        with self.lock:
            self.latest = (task, done, total, unit)
            self.tasks.add(task)
        self.tick()

    def tick(self) -> None:
        with self.lock:
            now = self.clock()
            if self.latest is not None and now - self.last_line >= max(self.period, 0.1 * (now - self.started)):
                self._line(now)

    def close(self, finished: bool) -> None:
        """The last line; after work of several parts (the searches of ``dflop run``, then its steps)
        it says that all of it is done, not only the last part."""
        with self.lock:
            if not finished or self.latest is None:
                return
            if len(self.tasks) == 1:
                self._line(self.clock())
                return
            task, done, total, unit = self.latest
            self.write(f"dflop: done: {len(self.tasks)} parts in {elapsed(self.clock() - self.started)}, "
                       f"the last {task} ({done}/{total} {unit})\n")

    def _line(self, now: float) -> None:
        task, done, total, unit = self.latest
        self.write(f"dflop: {task}: {done}/{total} {unit}, {elapsed(now - self.started)} elapsed\n")
        self.last_line = now


def heartbeat(display: LineDisplay, every: float) -> ContextManager[None]:
    """Call ``display.tick()`` every ``every`` seconds from a daemon thread while the block runs."""
    return periodically(every, display.tick, "dflop-progress")


class BarDisplay:
    """rich progress bars, one per task, removed when the work is done."""

    def __init__(self, console: Any) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bars, TextColumn, TimeElapsedColumn

        self.bars = Bars(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), console=console, transient=True)
        self.tasks: dict[str, Any] = {}
        self.bars.start()

    def update(self, task: str, done: int, total: int, unit: str) -> None:
        if task not in self.tasks:
            self.tasks[task] = self.bars.add_task(task, total=total, unit=unit)
        self.bars.update(self.tasks[task], completed=done, total=total)

    def close(self, finished: bool) -> None:
        self.bars.stop()


class ProgressBoard:
    """A ``progress(what, done, total)`` callable for one kind of work; ``channel`` makes others."""

    def __init__(self, display: LineDisplay | BarDisplay, describe: str | Describe, unit: str) -> None:
        self.display = display
        self.describe = describe.format if isinstance(describe, str) else describe
        self.unit = unit

    def __call__(self, what: str, done: int, total: int) -> None:
        self.display.update(self.describe(what), done, total, self.unit)

    def channel(self, describe: str | Describe, unit: str) -> "ProgressBoard":
        """Progress of another kind of work (``"running {}"``, ``"steps"``) on the same display."""
        return ProgressBoard(self.display, describe, unit)


@contextmanager
def progress_bar(describe: str | Describe = "searching {} plans", unit: str = "plans", *,
                 stream: TextIO | None = None, terminal: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 period: float = PERIOD_S, beat: bool = True) -> Iterator[ProgressBoard]:
    """Report progress on ``stream`` (stderr): bars on a terminal, periodic lines elsewhere.

    ``describe`` turns the ``what`` a worker reports into the task's name (a format string
    with one ``{}``, or a function). The last line is written only when the work succeeds:
    an error is reported by its own line. ``beat``: lines also between updates (a thread)."""
    stream = stream or sys.stderr
    if terminal is None:
        from rich.console import Console

        terminal = Console(file=stream).is_terminal
    if terminal:
        from rich.console import Console

        display: LineDisplay | BarDisplay = BarDisplay(Console(file=stream))
        beating = nullcontext()
    else:
        display = LineDisplay(stream.write, clock, period)
        beating = heartbeat(display, period / 5) if beat else nullcontext()
    finished = False
    try:
        with beating:
            yield ProgressBoard(display, describe, unit)
        finished = True
    finally:
        display.close(finished)
