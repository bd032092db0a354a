"""What every rank derives from the step schedule alone: which samples each bin holds and in
which order, hence the shape of every tensor it sends or receives.

No rank asks another for shapes: they all hold the same schedule (the global
batch's shapes and every sample's bin), and the same routing rule decides which
encoder replica encodes which sample. So a receive is posted with the exact
shape of what is coming, microbatches of every size included, with no padding
and no metadata round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from dflop.program.routing import encoder_ranks, encoder_replicas
from dflop.specs.plan import Module, Plan
from dflop.workload.chat import Encoded
from dflop.workload.pixels import ImageRef, VideoRef
from dflop.workload.sample import SampleTable


@dataclass
class StepData:
    plan: Plan
    batch: SampleTable
    assignment: np.ndarray
    text: dict[str, Encoded] | None = None
    """Real samples: each sample's token ids and targets, by id (None: synthetic inputs)."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def m(self) -> int:
        return self.plan.microbatches

    @cached_property
    def encoder_replica(self) -> np.ndarray:
        if self.plan.colocated:
            return self.assignment // self.m
        return encoder_replicas(self.batch.tiles, self.assignment, self.m, self.plan.encoder.dp)

    def llm_rows(self, r: int, k: int) -> np.ndarray:
        """Samples of LLM replica r's microbatch k, in batch order."""
        return np.flatnonzero(self.assignment == r * self.m + k)

    def encoder_rows(self, j: int, k: int) -> np.ndarray:
        """Samples with tiles that encoder replica j encodes in microbatch k: its contiguous chunk, in
        (LLM replica, batch) order."""
        key = ("enc", j, k)
        if key not in self._cache:
            rows = np.flatnonzero((self.encoder_replica == j) & (self.assignment % self.m == k)
                                  & (self.batch.tiles > 0))
            self._cache[key] = rows[np.lexsort((rows, self.assignment[rows] // self.m))]
        return self._cache[key]

    def pixel_rows(self, module: Module, replica: int, colocated: bool) -> np.ndarray:
        """Samples whose pixels the first stage of ``module``'s replica ``replica`` feeds in the whole
        step (every microbatch): the encoder's, or a colocated encoder's inside LLM stage 0 (its samples
        with tiles); none for another LLM's. What ``RankStep.prepare`` makes pixels of, found
        without the step graph, so that they can be decoded before it is lowered."""
        if module is Module.ENCODER:
            return np.concatenate([self.encoder_rows(replica, k) for k in range(self.m)])
        if not colocated:
            return np.zeros(0, dtype=np.int64)
        rows = np.concatenate([self.llm_rows(replica, k) for k in range(self.m)])
        return rows[self.batch.tiles[rows] > 0]

    @cached_property
    def phase_replica(self) -> np.ndarray:
        """Heterogeneous placement: the encoder replica of every sample (``routing.encoder_ranks``)."""
        return encoder_ranks(self.batch.tiles, self.plan.encoder.dp)

    def phase_rows(self, j: int) -> np.ndarray:
        """Samples with tiles that encoder replica j encodes in a heterogeneous encoder phase, in batch order."""
        return np.flatnonzero((self.phase_replica == j) & (self.batch.tiles > 0))

    def phase_chunks(self, j: int) -> list[np.ndarray]:
        """``phase_rows(j)`` in the phase's chunks (as many as microbatches, the empty ones left out)."""
        return [c for c in np.array_split(self.phase_rows(j), self.m) if len(c)]

    def bridge_rows(self, j: int, r: int, k: int) -> np.ndarray:
        """Samples with images that encoder replica j sends to LLM replica r in microbatch k."""
        rows = self.encoder_rows(j, k)
        return rows[(self.assignment[rows] // self.m == r) & (self.batch.image_tokens[rows] > 0)]

    def tiles(self, rows: np.ndarray) -> list[int]:
        return [int(x) for x in self.batch.tiles[rows]]

    def image_tokens(self, rows: np.ndarray) -> list[int]:
        return [int(x) for x in self.batch.image_tokens[rows]]

    def text_tokens(self, rows: np.ndarray) -> list[int]:
        return [int(x) for x in self.batch.text_tokens[rows]]

    def real(self, rows: np.ndarray) -> list[Encoded] | None:
        return None if self.text is None else [self.text[str(i)] for i in self.batch.ids[rows]]

    def target_masks(self, rows: np.ndarray) -> list[np.ndarray] | None:
        """Real samples: a bool per text token, True for a target."""
        return None if self.text is None else [e.targets[e.text] for e in self.real(rows)]

    def layouts(self, rows: np.ndarray) -> list[np.ndarray] | None:
        """Real samples: a bool per position, True where an image token goes (None: images first)."""
        return None if self.text is None else [~e.text for e in self.real(rows)]

    def images(self, rows: np.ndarray) -> list[tuple[ImageRef | VideoRef, ...]] | None:
        """Real samples: each one's images or video, whose tiles the encoder lays out as the checkpoint does."""
        return None if self.text is None else [e.images for e in self.real(rows)]

    @cached_property
    def targets(self) -> int:
        return target_tokens(self.batch, self.text)


def target_tokens(batch: SampleTable, text: dict[str, Encoded] | None = None) -> int:
    """Target tokens of a global batch. The loss is summed and divided by this, so every token
    weighs the same whatever bin it landed in. Real samples: the predicted targets (a sample's
    first token has nothing before it to be predicted from)."""
    if text is None:
        return int(batch.targets.sum())
    return sum(text[str(i)].predicted for i in batch.ids)
