"""The fast evaluator: step time as a longest path, vectorised over data-parallel replicas.

Each op starts when its predecessor on the same worker and all its data
dependencies (plus their transfer times) have finished; walking the template
ops in topological order with one numpy array per op gives every replica's
times at once. A group's data-parallel collectives run on one stream shared by
its replicas, so each is a scalar: an UNSHARD starts once the stream is free and
every replica finished its previous op, and its op waits for it; a REDUCE_GRAD
starts once the stream is free and ``lag`` after its anchor started on every
replica. Without link contention this is exactly what the SimPy simulator
computes (tests hold them equal, nanosecond for nanosecond); the optimizer
uses it in its inner loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.program.actions import Kind
from dflop.program.template import waits_for
from dflop.timing.costing import StepTiming


@dataclass
class StepTimes:
    start: list[np.ndarray]
    end: list[np.ndarray]
    collective_start: list[int]
    """Per data-parallel collective (``StepTiming.collectives`` order), ns."""
    collective_end: list[int]
    compute_ns: int
    """End of the last compute op."""
    step_ns: int
    """End of the step (the last compute op or collective)."""


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
    gpus: int
    model_flops: float
    """Model FLOPs of the step, all GPUs together (MFU's numerator)."""
    hw_flops: float
    """FLOPs executed, recomputation included (HFU's numerator)."""

    @property
    def fits(self) -> bool:
        return bool((self.peak_memory <= self.memory_capacity).all())

    def utilisation(self, peak_flops: float) -> tuple[float, float]:
        """(MFU, HFU): model and executed FLOPs over what the GPUs could do in the step."""
        capacity = self.gpus * peak_flops * self.step_s
        return (self.model_flops / capacity, self.hw_flops / capacity) if capacity > 0 else (0.0, 0.0)


def evaluate(timing: StepTiming) -> StepTimes:
    t = timing.template
    n = len(t.ops)
    start: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    end: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    before: dict[int, int] = {}
    after: dict[int, list[int]] = {}
    for c, timed in enumerate(timing.collectives):
        if timed.kind is Kind.UNSHARD:
            before[timed.op] = c
        else:
            after.setdefault(timed.op, []).append(c)
    stream = [0] * len(t.groups)  # when each group's collective stream is next free
    c_start, c_end = [0] * len(timing.collectives), [0] * len(timing.collectives)
    for i in t.order:
        op = t.ops[i]
        replicas = t.groups[op.group].replicas
        prev, data, bridge = waits_for(op, t.ops)
        ready = end[prev].copy() if prev >= 0 else np.zeros(replicas, dtype=np.int64)
        for d, comm in zip(data, timing.dep_comm[i]):
            np.maximum(ready, end[d] + comm, out=ready)
        edges = timing.bridge[i]
        if edges is not None and len(edges[0]):
            src, dst, ns = edges
            arrival = np.zeros(replicas, dtype=np.int64)
            np.maximum.at(arrival, dst, end[bridge][src] + ns)
            np.maximum(ready, arrival, out=ready)
        if i in before:
            c = before[i]
            c_start[c] = max(stream[op.group], int(end[prev].max()) if prev >= 0 else 0)
            c_end[c] = stream[op.group] = c_start[c] + timing.collectives[c].duration
            np.maximum(ready, c_end[c], out=ready)
        start[i] = ready
        end[i] = ready + timing.duration[i]
        for c in after.get(i, ()):
            c_start[c] = max(stream[op.group], int((ready + timing.collectives[c].lag).max()))
            c_end[c] = stream[op.group] = c_start[c] + timing.collectives[c].duration
    compute = int(max(e.max() for e in end))
    return StepTimes(start, end, c_start, c_end, compute, max([compute] + c_end))


def peak_memory(timing: StepTiming) -> np.ndarray:
    """Per group and replica: model state plus the most activation bytes held at once.

    Memory follows program order alone (allocate when a forward starts, release
    when its backward ends, hold an op's transient bytes while it runs), so the
    peak needs no timing."""
    t = timing.template
    peaks = []
    for g in t.groups:
        ops = [op.index for op in t.ops if op.group == g.index]
        alloc = np.stack([timing.alloc[i] for i in ops])
        free = np.stack([timing.free[i] for i in ops])
        transient = np.stack([timing.transient[i] for i in ops])
        held_while_running = np.cumsum(alloc, axis=0) - np.cumsum(free, axis=0) + free + transient
        peaks.append(timing.static_bytes[g.index] + held_while_running.max(axis=0))
    return peaks  # type: ignore[return-value]


def summarize(timing: StepTiming, times: StepTimes) -> StepSummary:
    t = timing.template
    gpus_busy = model_flops = hw_flops = 0.0
    gpus = 0
    busy_max = np.zeros(len(t.groups))
    for g in t.groups:
        ops = [op.index for op in t.ops if op.group == g.index]
        busy = np.sum([timing.duration[i] for i in ops], axis=0)
        busy_max[g.index] = busy.max() / 1e9
        gpus_busy += float(busy.sum()) * g.tp
        gpus += g.replicas * g.tp
        model_flops += g.tp * sum(float(timing.flops[i].sum()) for i in ops)
        hw_flops += g.tp * sum(float(timing.hw_flops[i].sum()) for i in ops)
    peaks = peak_memory(timing)
    return StepSummary(
        step_s=times.step_ns / 1e9,
        compute_s=times.compute_ns / 1e9,
        bubble_fraction=1.0 - gpus_busy / (gpus * times.compute_ns) if times.compute_ns else 0.0,
        idle_fraction=1.0 - gpus_busy / (gpus * times.step_ns) if times.step_ns else 0.0,
        busy_s=busy_max,
        peak_memory=np.array([p.max() for p in peaks]),
        memory_capacity=timing.capacity,
        gpus=gpus,
        model_flops=model_flops,
        hw_flops=hw_flops,
    )
