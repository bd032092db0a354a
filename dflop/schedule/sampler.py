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

import hashlib
import threading
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from dflop.errors import DflopError
from dflop.schedule import padded
from dflop.schedule.background import SchedulerError, check_bins
from dflop.schedule.padded import BinCost
from dflop.schedule.problem import PartitionProblem
from dflop.schedule.solve import partition
from dflop.specs import scheduling
from dflop.workload.data_profile import DataProfile
from dflop.workload.sample import Sample, SampleTable

DETERMINISTIC = ("lpt", "kk", "sequential", "random")
Costs = Callable[[SampleTable], np.ndarray]
DEADLINE_S = 60.0
"""Seconds one partition may take: these one-pass solvers split even a million samples in seconds."""
T = TypeVar("T")


def _within(seconds: float, solve: Callable[[], T], what: str) -> T:
    """``solve()``, run on a daemon thread so that one that never returns is given up after
    ``seconds`` (and left behind); what it raises is raised here."""
    done, out = threading.Event(), {}

    def run() -> None:
        try:
            out["value"] = solve()
        except BaseException as exc:  # handed to the caller
            out["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="dflop-sampler-solve", daemon=True).start()
    if not done.wait(seconds):
        raise SchedulerError(f"{what}: no partition after the deadline of {seconds:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


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

    The last ``len % global_batch`` indices of an epoch's permutation are the
    tail. With ``drop_last`` (the default) the tail is dropped: every other
    sample comes once per epoch. Without it the tail is a last, shorter global
    batch of ``microbatches' = min(microbatches, tail // dp_size)`` (at least 1)
    microbatches per rank, so every sample comes exactly once per epoch; only
    when the tail has fewer samples than ranks do some ranks get an empty
    microbatch (a list with no index) for it.

    ``bin_cost`` says what a microbatch costs the trainer: ``packed`` (the
    default), the sum of its samples' ``costs``; ``padded``, its sample count
    times its longest sample in LLM tokens (a trainer that pads every
    microbatch to its longest), split by
    :func:`dflop.schedule.padded.padded_partition` (``costs`` and ``solver``
    then play no part).

    ``costs`` maps a global batch to one cost (or cost vector) per sample. Each
    partition may take ``deadline`` seconds; a solver still running then, or one
    whose answer leaves a sample out of the bins, raises a SchedulerError rather
    than falling back on LPT: every rank partitions on its own, and a fallback
    taken by one rank only (its solve a little slower) would give the ranks
    different bins, some samples trained twice and others never.
    """

    def __init__(self, shapes: DataProfile | SampleTable | Callable[[int], Sample], *, global_batch: int,
                 dp_size: int, dp_rank: int, microbatches: int, dataset_size: int | None = None,
                 costs: Costs | None = None, solver: str = "lpt", seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, deadline: float = DEADLINE_S,
                 bin_cost: BinCost | str = BinCost.PACKED) -> None:
        self.global_batch = scheduling.whole_number(global_batch, "global_batch", 1)
        self.dp_size = scheduling.whole_number(dp_size, "dp_size", 1)
        self.microbatches = scheduling.whole_number(microbatches, "microbatches", 1)
        self.dp_rank = scheduling.whole_number(dp_rank, "dp_rank", 0)
        if self.dp_rank >= self.dp_size:
            raise DflopError(f"dp_rank {dp_rank} is outside 0..{self.dp_size - 1}")
        self.seed = scheduling.whole_number(seed, "seed", 0)
        self.solver = scheduling.solver(solver).value
        self.deadline = scheduling.time_limit(deadline, "deadline")
        self.bin_cost = padded.bin_cost(bin_cost)
        if self.solver not in DETERMINISTIC:
            raise DflopError(f"solver '{solver}' is not deterministic across ranks; use one of "
                             f"{', '.join(DETERMINISTIC)} (or AsyncScheduler with a channel)")
        if self.global_batch < self.dp_size * self.microbatches:
            raise DflopError(f"global_batch {global_batch} is smaller than dp_size x microbatches "
                             f"({self.dp_size * self.microbatches} bins)")
        size = None if dataset_size is None else scheduling.whole_number(dataset_size, "dataset_size")
        self.table = self._table(shapes, size)
        if len(self.table) == 0:
            raise DflopError("the dataset is empty")
        if drop_last and len(self.table) < self.global_batch:
            raise DflopError(f"the dataset has {len(self.table)} samples, fewer than one global batch "
                             f"({self.global_batch}), and drop_last would drop them all")
        self.costs, self.shuffle, self.drop_last = costs or default_costs, shuffle, drop_last
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
        self.epoch = scheduling.whole_number(epoch, "epoch", 0)

    def _tail(self) -> int:
        return 0 if self.drop_last else len(self.table) % self.global_batch

    def _microbatches(self, samples: int) -> int:
        """Microbatches per rank for a global batch of ``samples``."""
        return max(1, min(self.microbatches, samples // self.dp_size))

    def __len__(self) -> int:
        tail = self._tail()
        return len(self.table) // self.global_batch * self.microbatches + (self._microbatches(tail) if tail else 0)

    def global_batches(self) -> Iterator[np.ndarray]:
        """Dataset indices of each global batch of this epoch (the tail last, unless dropped)."""
        n = len(self.table)
        order = (np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle
                 else np.arange(n))
        end = n - n % self.global_batch + self._tail()
        for start in range(0, end, self.global_batch):
            yield order[start:min(start + self.global_batch, end)]

    def bins(self, indices: np.ndarray) -> list[list[list[int]]]:
        """``bins[rank][microbatch]`` -> dataset indices, for one global batch."""
        per_rank = self._microbatches(len(indices))
        slots = self.dp_size * per_rank
        bins = min(slots, len(indices))
        assignment, loads = self._assign(self.table.take(indices), bins)
        # Bins dealt to ranks heaviest first, round-robin, so every rank's total is alike; a tail
        # with fewer samples than ranks leaves the last ranks an empty microbatch.
        ranked = np.argsort(-loads, kind="stable")
        out: list[list[list[int]]] = [[] for _ in range(self.dp_size)]
        for position in range(slots):
            members = indices[assignment == ranked[position]].tolist() if position < bins else []
            out[position % self.dp_size].append(members)
        return out

    def _assign(self, batch: SampleTable, bins: int) -> tuple[np.ndarray, np.ndarray]:
        """(bin of every sample of ``batch``, cost of every bin) under this sampler's bin cost."""
        if self.bin_cost is BinCost.PADDED:
            assignment = padded.padded_partition(batch.llm_tokens, bins)
            return assignment, padded.padded_loads(batch.llm_tokens, assignment, bins)
        problem = PartitionProblem(self._costs(batch), bins)
        result = _within(self.deadline, lambda: partition(problem, self.solver, seed=self.seed),
                         f"solver '{self.solver}'")
        try:
            check_bins(result.assignment, len(batch), bins)
        except SchedulerError as exc:
            raise SchedulerError(f"solver '{self.solver}': {exc}") from None
        return result.assignment, result.loads.max(axis=1)

    def _costs(self, batch: SampleTable) -> np.ndarray:
        try:
            costs = np.asarray(self.costs(batch), dtype=float)
        except (TypeError, ValueError) as exc:
            raise DflopError(f"costs: returned something that is not numbers ({exc})") from None
        if costs.ndim not in (1, 2) or len(costs) != len(batch):
            raise DflopError(f"costs: returned an array of shape {costs.shape} for a global batch of "
                             f"{len(batch)} samples; expected one cost or cost vector per sample")
        return costs

    def state(self) -> dict[str, Any]:
        """What fixes the microbatches of every rank (the rank itself is not in it), and the epoch.

        A run resumed mid-epoch skips the microbatches it already trained, which is right only when
        the resumed sampler yields the same ones: all of this but the epoch must be unchanged. The
        data enters as its sample count and a hash of its shapes; a ``costs`` function cannot be
        compared and is not in it."""
        t = self.table
        shapes = hashlib.sha256()
        for column in (t.modality, t.tiles, t.text_tokens, t.image_tokens):
            shapes.update(np.ascontiguousarray(column, dtype="<i8").tobytes())
        return {"dp_size": self.dp_size, "microbatches": self.microbatches, "global_batch": self.global_batch,
                "samples": len(t), "shapes": shapes.hexdigest()[:16], "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "bin_cost": self.bin_cost.value,
                "solver": self.solver, "epoch": self.epoch}

    def differences(self, saved: object) -> dict[str, tuple[Any, Any]]:
        """What differs between ``saved`` (an earlier :meth:`state`) and this sampler, epoch aside:
        key -> (saved value, this sampler's); a key that ``saved`` lacks differs (saved as None)."""
        saved = saved if isinstance(saved, dict) else {}
        return {key: (saved.get(key), value) for key, value in self.state().items()
                if key != "epoch" and saved.get(key) != value}

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self.global_batches():
            yield from self.bins(indices)[self.dp_rank]
