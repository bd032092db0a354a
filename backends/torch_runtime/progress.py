"""Where each rank is, readable after it died: a few bytes in a memory-mapped file per rank.

When a rank is killed mid-step it can say nothing, and the launcher tears the
others down; the last (step, node) a rank wrote survives it, so the error can
name where the run stopped. Writing is a memory store, so every node can afford it.

The ranks of one node share the folder, which also holds each rank's pid and,
once it failed on a lost connection, the ranks it lost: a rank that loses its
link to a sibling that failed first can then name the rank that really died
(``lost_ranks``), not the sibling whose exit closed the link.
"""

from __future__ import annotations

import mmap
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from dflop.specs.progress import periodically

SIZE = 128
WARMUP = "warm-up"
"""What a rank's label starts with while it warms up (on a later step's graph: its step number then
says nothing of the steps it has run)."""


class ProgressFile:
    def __init__(self, folder: Path, rank: int) -> None:
        path = folder / f"rank-{rank}.progress"
        path.write_bytes(b" " * SIZE)
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), SIZE)
        self.folder, self.rank = folder, rank
        (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))
        (folder / f"rank-{rank}.lost").unlink(missing_ok=True)  # an earlier attempt's (torchrun restarts keep the folder)

    def write(self, step: int, label: str) -> None:
        text = f"{step} {label}".encode()[:SIZE]
        self._map[:SIZE] = text.ljust(SIZE)

    def record_lost(self, ranks: list[int]) -> None:
        """Before this rank exits on a lost connection: the ranks it lost (written whole, by a rename)."""
        part = self.folder / f"rank-{self.rank}.lost.part"
        part.write_text(" ".join(map(str, ranks)))
        part.replace(self.folder / f"rank-{self.rank}.lost")

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


WATCH_S = 0.5
"""How often the launcher reads its ranks' progress files to tell how many steps they have run."""


def steps_done(folder: Path, ranks: int) -> int | None:
    """How many steps all ``ranks`` have run, by their progress files: the step the rank furthest
    behind is in (steps are numbered from 0); None while one has written nothing yet or warms up
    (its warm-up runs a later step's graph)."""
    where = [read_progress(folder, rank) for rank in range(ranks)]
    if any(w is None or w[1].startswith(WARMUP) for w in where):
        return None
    return min(step for step, _ in where)


@contextmanager
def telling_steps(folder: Path, ranks: int, tell: Callable[[int], None] | None,
                  every: float = WATCH_S) -> Iterator[None]:
    """While the block runs (the ranks run their steps), ``tell`` the steps they have all run
    (``steps_done``) each time it grows, from a thread of its own: a launcher blocked until the
    ranks end hands their steps back only then."""
    if tell is None:
        yield
        return
    told = [-1]

    def watch() -> None:
        done = steps_done(folder, ranks)
        if done is not None and done > told[0]:
            tell(done)
            told[0] = done

    with periodically(every, watch, "dflop-steps"):
        yield


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_ints(path: Path) -> list[int] | None:
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return None


def lost_ranks(folder: Path, peers: list[int]) -> list[int]:
    """Which of ``peers`` (ranks whose link broke) are really gone, as far as this node can tell.

    A peer of this node that recorded what it lost stands for those ranks (followed
    through); one still running without a record is not lost (its link broke for
    another reason, and it will say so); one whose process is gone is lost; a peer
    of another node cannot be looked at and is kept. Never empty when ``peers`` is not.
    """
    out: list[int] = []
    seen: set[int] = set()
    todo = list(peers)
    while todo:
        peer = todo.pop(0)
        if peer in seen:
            continue
        seen.add(peer)
        record = _read_ints(folder / f"rank-{peer}.lost")
        pid = _read_ints(folder / f"rank-{peer}.pid")
        if record:
            todo += record
        elif not pid or not _alive(pid[0]):
            out.append(peer)
    return sorted(set(out)) or sorted(set(peers))
