"""Samples: what one training example costs in shapes, not in content.

``Sample`` is the readable form; ``SampleTable`` is the columnar form every
planner and scheduler uses, because a global batch of thousands of samples is
sampled, partitioned and costed thousands of times during a search.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from dflop.errors import DflopError
from dflop.specs.limits import MAX_SIZE


class Modality(str, Enum):
    TEXT = "text"
    IMAGE = "image"
    MULTI_IMAGE = "multi_image"
    VIDEO = "video"

    @property
    def code(self) -> int:
        return MODALITIES.index(self)


MODALITIES: tuple[Modality, ...] = tuple(Modality)


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sample's shapes: tiles for the encoder, tokens for the LLM."""

    id: str
    modality: Modality
    tiles: int
    """Vision tiles fed to the encoder (each one encoder sequence)."""
    text_tokens: int
    image_tokens: int
    """LLM tokens produced from the tiles (after pooling, plus newline tokens)."""

    @property
    def llm_tokens(self) -> int:
        return self.text_tokens + self.image_tokens


def unique_ids(ids: Sequence[object]) -> tuple[list[str], int]:
    """Every id made unique, in order: the first of a kind keeps its id, a repeat of ``x``
    becomes ``x#2``, ``x#3``, ... (skipping any id the input has). Returns the ids and how many
    were renamed. Schedules name samples by id, so two rows with one id would be scheduled as one.
    """
    raw = [str(i) for i in ids]
    taken = set(raw)
    if len(taken) == len(raw):
        return raw, 0
    out: list[str] = []
    used: set[str] = set()
    next_k: dict[str, int] = {}
    for sample_id in raw:
        if sample_id in used:
            k = next_k.get(sample_id, 2)
            while f"{sample_id}#{k}" in taken or f"{sample_id}#{k}" in used:
                k += 1
            next_k[sample_id] = k + 1
            sample_id = f"{sample_id}#{k}"
        used.add(sample_id)
        out.append(sample_id)
    return out, len(raw) - len(taken)


@dataclass(frozen=True, eq=False)
class SampleTable:
    """Samples as columns (numpy arrays of equal length)."""

    ids: np.ndarray
    modality: np.ndarray
    """Modality codes, indices into MODALITIES."""
    tiles: np.ndarray
    text_tokens: np.ndarray
    image_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name in ("modality", "tiles", "text_tokens", "image_tokens"):
            column = getattr(self, name)
            if len(column) != n:
                raise DflopError(f"sample table: column '{name}' has {len(column)} rows, ids has {n}")
            if n and column.min() < 0:
                raise DflopError(f"sample table: column '{name}' has a negative value")

    @classmethod
    def build(cls, ids: Sequence[str] | np.ndarray, modality: Iterable[int], tiles: Iterable[int],
              text_tokens: Iterable[int], image_tokens: Iterable[int]) -> "SampleTable":
        return cls(
            ids=np.asarray(ids, dtype=object),
            modality=np.asarray(list(modality) if not isinstance(modality, np.ndarray) else modality,
                                dtype=np.int8),
            tiles=np.asarray(tiles, dtype=np.int64),
            text_tokens=np.asarray(text_tokens, dtype=np.int64),
            image_tokens=np.asarray(image_tokens, dtype=np.int64),
        )

    @classmethod
    def from_samples(cls, samples: Iterable[Sample]) -> "SampleTable":
        rows = list(samples)
        return cls.build([s.id for s in rows], [s.modality.code for s in rows],
                         [s.tiles for s in rows], [s.text_tokens for s in rows],
                         [s.image_tokens for s in rows])

    @classmethod
    def concat(cls, tables: Sequence["SampleTable"]) -> "SampleTable":
        return cls(*(np.concatenate([getattr(t, f) for t in tables])
                     for f in ("ids", "modality", "tiles", "text_tokens", "image_tokens")))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def llm_tokens(self) -> np.ndarray:
        return self.text_tokens + self.image_tokens

    @property
    def targets(self) -> np.ndarray:
        """Positions per sample whose next token is text of the same sample: every text token, but a
        sample's first when it has no image to predict it from. Only these go through the LM head
        and the loss, so they, not all LLM tokens, size the head's work and its logits."""
        return np.where(self.image_tokens > 0, self.text_tokens, np.maximum(self.text_tokens - 1, 0))

    def take(self, rows: np.ndarray | Sequence[int]) -> "SampleTable":
        idx = np.asarray(rows, dtype=np.int64)
        return SampleTable(self.ids[idx], self.modality[idx], self.tiles[idx],
                           self.text_tokens[idx], self.image_tokens[idx])

    def with_ids(self, ids: Sequence[str] | np.ndarray) -> "SampleTable":
        return SampleTable(np.asarray(ids, dtype=object), self.modality, self.tiles,
                           self.text_tokens, self.image_tokens)

    def sample(self, row: int) -> Sample:
        return Sample(str(self.ids[row]), MODALITIES[int(self.modality[row])], int(self.tiles[row]),
                      int(self.text_tokens[row]), int(self.image_tokens[row]))

    def __iter__(self) -> Iterator[Sample]:
        return (self.sample(i) for i in range(len(self)))

    def columns(self) -> dict[str, list]:
        """JSON-ready columns."""
        return {
            "id": [str(i) for i in self.ids],
            "modality": [MODALITIES[int(c)].value for c in self.modality],
            "tiles": self.tiles.tolist(),
            "text_tokens": self.text_tokens.tolist(),
            "image_tokens": self.image_tokens.tolist(),
        }

    @classmethod
    def from_columns(cls, columns: Any, where: str) -> "SampleTable":
        """The inverse of :meth:`columns`; whatever is wrong with them names ``where``."""
        if not isinstance(columns, dict):
            raise DflopError(f"{where}: samples: expected a mapping of columns, got {type(columns).__name__}")
        try:
            codes = [Modality(m).code for m in columns["modality"]]
            table = cls.build(columns["id"], codes, columns["tiles"], columns["text_tokens"],
                              columns["image_tokens"])
        except KeyError as exc:
            raise DflopError(f"{where}: samples: missing column {exc}") from None
        except (ValueError, TypeError, OverflowError, DflopError) as exc:
            raise DflopError(f"{where}: samples: {str(exc).removeprefix('sample table: ')}") from None
        for name, column in zip(("id", "modality", "tiles", "text_tokens", "image_tokens"),
                                (table.ids, table.modality, table.tiles, table.text_tokens, table.image_tokens)):
            if column.ndim != 1:
                raise DflopError(f"{where}: samples: column '{name}' must be a flat list")
            if name in ("tiles", "text_tokens", "image_tokens") and len(column) and column.max() > MAX_SIZE:
                raise DflopError(f"{where}: samples: column '{name}': must be at most {MAX_SIZE} per sample, "
                                 f"got {column.max()}")
        return table
