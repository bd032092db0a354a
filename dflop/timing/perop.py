"""Per-op numbers of a step, one value per replica of the op's group, kept as one padded table.

Groups of one plan have different replica counts (the encoder's and the LLM's data
parallelism), so a step's per-op values are rows of different lengths. They are stored as
rows of one ``(ops, ..., widest group)`` table, because the fast evaluator and the
summaries work on whole levels and groups of ops at once; ``values[i]`` is op i's row cut to
its group's replicas, as every other reader expects.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


class PerOp(Sequence):
    __slots__ = ("table", "width")

    def __init__(self, table: np.ndarray, width: Sequence[int]) -> None:
        self.table = table
        """``(ops, ..., replicas)``; past an op's width, zeros."""
        self.width = list(width)
        """Replicas of each op's group."""

    @classmethod
    def zeros(cls, width: Sequence[int], dtype=float, inner: tuple[int, ...] = ()) -> "PerOp":
        return cls(np.zeros((len(width), *inner, max(width, default=0)), dtype=dtype), width)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        return self.table[i, ..., :self.width[i]]

    def __setitem__(self, i: int, value: np.ndarray) -> None:
        self.table[i, ..., :self.width[i]] = value

    def __len__(self) -> int:
        return len(self.width)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self.width)))

    def copy(self) -> "PerOp":
        return PerOp(self.table.copy(), self.width)
