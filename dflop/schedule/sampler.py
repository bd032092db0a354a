"""A balanced batch sampler for any training loop that takes a PyTorch batch sampler.

``DataLoader(dataset, batch_sampler=BalancedBatchSampler(...))`` gives each
data-parallel rank the sample indices of its microbatches, balanced across
ranks and microbatches by dflop's partitioner, without changing anything
else in the training code. Pure Python (no torch import). Every rank builds
the same sampler with the same seed and computes the same partition, so only
deterministic solvers are allowed here (``lpt``, ``kk``, ``sequential``,
``random``); to share an ILP's time-limited answer across ranks use
:class:`dflop.schedule.background.AsyncScheduler` with a channel instead.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from dflop.errors import DflopError
from dflop.schedule.problem import PartitionProblem
from dflop.schedule.solve import partition
from dflop.workload.data_profile import DataProfile
from dflop.workload.sample import Sample, SampleTable

DETERMINISTIC = ("lpt", "kk", "sequential", "random")
Costs = Callable[[SampleTable], np.ndarray]


def default_costs(samples: SampleTable) -> np.ndarray:
    """Without a plan: encoder work ~ tiles, LLM work ~ tokens, each dimension scaled to its mean
    (so both weigh alike); the LLM's attention term grows with each sample's squared length."""
    tiles = samples.tiles.astype(float)
    tokens = samples.llm_tokens.astype(float)
    llm = tokens + tokens * tokens / max(float(tokens.mean()), 1.0) / 8.0
    cols = [c / c.mean() for c in (tiles, llm) if c.sum() > 0]
    return np.stack(cols, axis=1) if cols else np.ones((len(samples), 1))


class BalancedBatchSampler:
    """Yields, for one data-parallel rank, the dataset indices of each of its microbatches.

    ``shapes`` is a data profile (one row per dataset index), a SampleTable, or a
    function from a dataset index to a Sample. Each global batch is
    ``global_batch`` indices of a seeded per-epoch permutation, split into
    ``dp_size x microbatches`` balanced bins; rank ``dp_rank`` gets row
    ``dp_rank`` of them, one microbatch per iteration.
    """

    def __init__(self, shapes: DataProfile | SampleTable | Callable[[int], Sample], *, global_batch: int,
                 dp_size: int, dp_rank: int, microbatches: int, dataset_size: int | None = None,
                 costs: Costs | None = None, solver: str = "lpt", seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        self.table = self._table(shapes, dataset_size)
        if solver not in DETERMINISTIC:
            raise DflopError(f"solver '{solver}' is not deterministic across ranks; use one of "
                             f"{', '.join(DETERMINISTIC)} (or AsyncScheduler with a channel)")
        if not 0 <= dp_rank < dp_size:
            raise DflopError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
        if global_batch < dp_size * microbatches:
            raise DflopError(f"global_batch {global_batch} is smaller than dp_size x microbatches "
                             f"({dp_size * microbatches} bins)")
        if len(self.table) < global_batch:
            raise DflopError(f"the dataset has {len(self.table)} samples, fewer than one global batch")
        self.global_batch, self.dp_size, self.dp_rank = global_batch, dp_size, dp_rank
        self.microbatches, self.costs, self.solver = microbatches, costs or default_costs, solver
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0

    @staticmethod
    def _table(shapes: DataProfile | SampleTable | Callable[[int], Sample], size: int | None) -> SampleTable:
        if isinstance(shapes, DataProfile):
            return shapes.samples
        if isinstance(shapes, SampleTable):
            return shapes
        if size is None:
            raise DflopError("dataset_size is needed when shapes is a function")
        return SampleTable.from_samples(shapes(i) for i in range(size))

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler.set_epoch: a new permutation every epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        batches = len(self.table) // self.global_batch
        if not self.drop_last and len(self.table) % self.global_batch >= self.dp_size * self.microbatches:
            batches += 1
        return batches * self.microbatches

    def global_batches(self) -> Iterator[np.ndarray]:
        """Dataset indices of each global batch of this epoch."""
        n = len(self.table)
        order = (np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle
                 else np.arange(n))
        for start in range(0, n, self.global_batch):
            chunk = order[start:start + self.global_batch]
            if len(chunk) < self.global_batch and (self.drop_last or len(chunk) < self.dp_size * self.microbatches):
                return
            yield chunk

    def bins(self, indices: np.ndarray) -> list[list[list[int]]]:
        """``bins[rank][microbatch]`` -> dataset indices, for one global batch."""
        batch = self.table.take(indices)
        problem = PartitionProblem(self.costs(batch), self.dp_size * self.microbatches)
        result = partition(problem, self.solver, seed=self.seed)
        loads = result.loads.max(axis=1)
        # Bins dealt to ranks heaviest first, round-robin, so every rank's total is alike.
        ranked = np.argsort(-loads, kind="stable")
        out: list[list[list[int]]] = [[] for _ in range(self.dp_size)]
        for position, b in enumerate(ranked):
            out[position % self.dp_size].append(indices[result.assignment == b].tolist())
        return out

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.global_batches():
            yield from self.bins(indices)[self.dp_rank]
