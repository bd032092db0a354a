"""The fast evaluator: step time as a longest path, vectorised over data-parallel replicas.

Each op starts when its predecessor on the same worker and all its data
dependencies (plus their transfer times) have finished; walking the template's
waves (``Template.waves``: ops that wait only for earlier waves) with one
(ops, replicas) array per wave gives every replica of a wave's ops its times at
once, in far fewer numpy calls than there are ops. A group's data-parallel
collectives run on one stream shared by its replicas, so each is a scalar: an UNSHARD starts once the stream is free and
every replica finished its previous op, and its op waits for it; a REDUCE_GRAD
starts once the stream is free and ``lag`` after its anchor started on every
replica. A collective of the whole job (a heterogeneous encoder's all-to-alls and
reduction) runs on every group's stream at once, once all its members can.
Without link contention this is exactly what the SimPy simulator
computes (tests hold them equal, nanosecond for nanosecond); the optimizer
uses it in its inner loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflop.timing.costing import StepTiming
from dflop.timing.perop import PerOp


@dataclass
class StepTimes:
    start: PerOp
    end: PerOp
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
    duration = timing.duration.table
    comm = np.concatenate([np.zeros_like(timing.dep_comm.table[:, :1]), timing.dep_comm.table], axis=1)
    start = np.zeros((n + 1, duration.shape[1]), dtype=np.int64)  # row n: "no op", ended at 0
    end = np.zeros_like(start)
    before: dict[int, list[tuple[int, int]]] = {}  # per wave: (row, collective) of the ops with one
    after: dict[int, list[tuple[int, int]]] = {}
    for c, timed in enumerate(timing.collectives):
        for op in timed.ops or (timed.op,):
            w, row = t.wave_position[op]
            (before if timed.kind.precedes_its_op else after).setdefault(w, []).append((row, c))
    width = timing.duration.width
    base = np.cumsum([0] + [g.replicas for g in t.groups])  # each group's first worker
    stream = [0] * len(t.groups)  # when each group's collective stream is next free
    c_start, c_end = [-1] * len(timing.collectives), [0] * len(timing.collectives)
    for w, wave in enumerate(t.waves):
        ops = wave.ops
        ready = (end[wave.waits] + comm[ops]).max(axis=1)  # the predecessor's end, each input's arrival
        for row, released in wave.bridged:
            edges = timing.bridge[ops[row]]
            if edges is not None and len(edges[0]):
                src, dst, ns = edges
                np.maximum.at(ready[row], dst, end[released][src] + ns)
        for row, c in before.get(w, ()):
            timed = timing.collectives[c]
            if c_start[c] < 0:  # a collective of the whole job starts once, when its last member can
                members = timed.ops or (int(ops[row]),)
                groups = [t.ops[i].group for i in members]
                prevs = [t.ops[i].prev for i in members]
                c_start[c] = max([stream[g] for g in groups]
                                 + [int(end[p, :width[i]].max()) for p, i in zip(prevs, members) if p >= 0])
                c_end[c] = c_start[c] + timed.duration
                for g in groups:
                    stream[g] = c_end[c]
            np.maximum(ready[row], c_end[c], out=ready[row])
        start[ops] = ready
        end[ops] = ready + duration[ops]
        for row, c in after.get(w, ()):
            i = int(ops[row])
            g = t.ops[i].group
            timed = timing.collectives[c]
            lag = timed.lag[base[g]:base[g] + width[i]] if timed.group < 0 else timed.lag
            at = max(stream[g], int((ready[row, :width[i]] + lag).max()))
            c_start[c] = max(c_start[c], at)  # members of one collective share a wave (``TemplateOp.after``)
            c_end[c] = c_start[c] + timed.duration
        for row, c in after.get(w, ()):
            stream[t.ops[int(ops[row])].group] = c_end[c]
    compute = int(end[:n].max()) if n else 0
    return StepTimes(PerOp(start[:n], width), PerOp(end[:n], width), c_start, c_end, compute,
                     max([compute] + c_end))


def peak_memory(timing: StepTiming) -> list[np.ndarray]:
    """Per group and replica: model state plus the most activation bytes held at once.

    Memory follows program order alone (allocate when a forward starts, release
    when its backward ends, hold an op's transient bytes while it runs), so the
    peak needs no timing."""
    t = timing.template
    peaks = []
    for g, ops in zip(t.groups, t.group_ops):
        alloc = timing.alloc.table[ops, :g.replicas]
        free = timing.free.table[ops, :g.replicas]
        transient = timing.transient.table[ops, :g.replicas]
        held_while_running = np.cumsum(alloc, axis=0) - np.cumsum(free, axis=0) + free + transient
        peaks.append(timing.static_bytes[g.index] + held_while_running.max(axis=0))
    return peaks


def summarize(timing: StepTiming, times: StepTimes) -> StepSummary:
    t = timing.template
    gpus_busy = model_flops = hw_flops = 0.0
    gpus = 0
    busy_max = np.zeros(len(t.groups))
    for g, ops in zip(t.groups, t.group_ops):
        busy = timing.duration.table[ops, :g.replicas].sum(axis=0)
        busy_max[g.index] = busy.max() / 1e9
        gpus_busy += float(busy.sum()) * g.tp
        gpus += g.replicas * g.tp
        model_flops += g.tp * float(timing.flops.table[ops].sum())
        hw_flops += g.tp * float(timing.hw_flops.table[ops].sum())
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
