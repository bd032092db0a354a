"""Where each rank is, readable after it died: a few bytes in a memory-mapped file per rank.

When a rank is killed mid-step it can say nothing, and the launcher tears the
others down; the last (step, node) a rank wrote survives it, so the error can
name where the run stopped. Writing is a memory store, so every node can afford it.
"""

from __future__ import annotations

import mmap
from pathlib import Path

SIZE = 128


class ProgressFile:
    def __init__(self, folder: Path, rank: int) -> None:
        path = folder / f"rank-{rank}.progress"
        path.write_bytes(b" " * SIZE)
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), SIZE)

    def write(self, step: int, label: str) -> None:
        text = f"{step} {label}".encode()[:SIZE]
        self._map[:SIZE] = text.ljust(SIZE)

    def close(self) -> None:
        self._map.close()
        self._file.close()


def read_progress(folder: Path, rank: int) -> tuple[int, str] | None:
    """(step, node label) the rank last reached, if it wrote anything."""
    try:
        text = (folder / f"rank-{rank}.progress").read_bytes().decode(errors="replace").strip()
    except OSError:
        return None
    step, _, label = text.partition(" ")
    return (int(step), label) if step.isdigit() else None
