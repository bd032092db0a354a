"""The callable through which long work reports how far it is, written once for every layer: the
optimizer, the profiler and the backends take one and know nothing of terminals (the CLI draws it)."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: ``done`` of ``total`` units of the work called ``what``."""

Channel = Callable[[str, str], Progress]
"""``channel(describe, unit)``: the progress of another kind of work on the same display (its name
from ``describe``, a format string with one ``{}`` for the ``what`` it is told, or none)."""
