"""The fast evaluator: step time as a longest path, vectorised over data-parallel replicas.

Each op starts when its predecessor on the same worker and all its data
dependencies (plus their transfer times) have finished; walking the template
ops in topological order with one numpy array per op gives every replica's
times at once. Without link contention this is exactly what the SimPy
simulator computes (tests hold them equal, nanosecond for nanosecond); the
optimizer uses it in its inner loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.program.costing import StepTiming


@dataclass
class StepTimes:
    start: list[np.ndarray]
    end: list[np.ndarray]
    allreduce_start: np.ndarray
    allreduce_end: np.ndarray
    compute_ns: int
    """End of the last compute op."""
    step_ns: int
    """End of the step (the last gradient all-reduce)."""


@dataclass(frozen=True)
class StepSummary:
    step_s: float
    compute_s: float
    bubble_fraction: float
    """Idle share of GPU time up to the end of the last compute op (pipeline bubbles and
    waiting for other replicas or modules)."""
    idle_fraction: float
    """Idle share of GPU time over the whole step (bubbles, waits and the all-reduce tail)."""
    busy_s: np.ndarray
    """Per group: the busiest replica's compute time."""
    peak_memory: np.ndarray
    """Per group: the largest replica's peak bytes per GPU."""
    memory_capacity: float

    @property
    def fits(self) -> bool:
        return bool((self.peak_memory <= self.memory_capacity).all())


def evaluate(timing: StepTiming) -> StepTimes:
    t = timing.template
    n = len(t.ops)
    start: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    end: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    for i in t.order:
        op = t.ops[i]
        replicas = t.groups[op.group].replicas
        ready = end[op.prev].copy() if op.prev >= 0 else np.zeros(replicas, dtype=np.int64)
        for d, comm in zip(op.deps, timing.dep_comm[i]):
            np.maximum(ready, end[t.ops[d].released_by] + comm, out=ready)
        edges = timing.bridge[i]
        if edges is not None and len(edges[0]):
            src, dst, ns = edges
            arrival = np.zeros(replicas, dtype=np.int64)
            np.maximum.at(arrival, dst, end[t.ops[op.bridge].released_by][src] + ns)
            np.maximum(ready, arrival, out=ready)
        start[i] = ready
        end[i] = ready + timing.duration[i]
    last_end = np.array([end[j].max() for j in t.last_op], dtype=np.int64)
    ar_end = last_end + timing.allreduce
    compute = int(max(e.max() for e in end))
    return StepTimes(start, end, last_end, ar_end, compute, int(max(compute, ar_end.max())))


def peak_memory(timing: StepTiming) -> np.ndarray:
    """Per group and replica: model state plus the most activation bytes held at once.

    Memory follows program order alone (allocate when a forward starts, release
    when its backward ends), so the peak needs no timing."""
    t = timing.template
    peaks = []
    for g in t.groups:
        ops = [op.index for op in t.ops if op.group == g.index]
        alloc = np.stack([timing.alloc[i] for i in ops])
        free = np.stack([timing.free[i] for i in ops])
        held_at_start = np.cumsum(alloc, axis=0) - np.cumsum(free, axis=0) + free
        peaks.append(timing.static_bytes[g.index] + held_at_start.max(axis=0))
    return peaks  # type: ignore[return-value]


def summarize(timing: StepTiming, times: StepTimes) -> StepSummary:
    t = timing.template
    gpus_busy = 0.0
    gpus = 0
    busy_max = np.zeros(len(t.groups))
    for g in t.groups:
        ops = [op.index for op in t.ops if op.group == g.index]
        busy = np.sum([timing.duration[i] for i in ops], axis=0)
        busy_max[g.index] = busy.max() / 1e9
        gpus_busy += float(busy.sum()) * g.tp
        gpus += g.replicas * g.tp
    peaks = peak_memory(timing)
    return StepSummary(
        step_s=times.step_ns / 1e9,
        compute_s=times.compute_ns / 1e9,
        bubble_fraction=1.0 - gpus_busy / (gpus * times.compute_ns) if times.compute_ns else 0.0,
        idle_fraction=1.0 - gpus_busy / (gpus * times.step_ns) if times.step_ns else 0.0,
        busy_s=busy_max,
        peak_memory=np.array([p.max() for p in peaks]),
        memory_capacity=timing.capacity,
    )
