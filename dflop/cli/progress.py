"""A progress bar on stderr for long searches (quiet when stderr is not a terminal)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from dflop.plan.search import Progress


@contextmanager
def progress_bar() -> Iterator[Progress]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda what, done, total: None
        return
    with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bar.add_task(f"searching {what} plans", total=total)
            bar.update(tasks[what], completed=done, total=total)

        yield update
