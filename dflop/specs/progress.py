"""The callable through which long work reports how far it is, written once for every layer: the
optimizer, the profiler and the backends take one and know nothing of terminals (the CLI draws it)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: ``done`` of ``total`` units of the work called ``what``."""

Channel = Callable[[str, str], Progress]
"""``channel(describe, unit)``: the progress of another kind of work on the same display (its name
from ``describe``, a format string with one ``{}`` for the ``what`` it is told, or none)."""


@contextmanager
def periodically(every: float, call: Callable[[], None], name: str) -> Iterator[None]:
    """``call()`` every ``every`` seconds from a daemon thread (``name``) while the block runs: how
    progress moves while the work itself is blocked (one long unit, a launcher waiting on its ranks)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            call()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
