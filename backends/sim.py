"""The simulator as a backend: SimPy executes each step graph on the cost model's costs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from dflop.backends.base import BackendResult, Observer, ScheduledBatch, StepTimes
from dflop.program.steps import StepRunner
from dflop.sim.simulate import simulate_steps


@dataclass
class SimBackend:
    name = "sim"
    contention: bool = True
    """Links carry one transfer at a time."""
    memory: bool = True
    """Record memory counters in the trace."""

    def run(self, runner: StepRunner, steps: Sequence[ScheduledBatch], *, observe: Observer | None = None,
            meta: dict[str, Any] | None = None) -> BackendResult:
        def seen(step, ex) -> None:  # noqa: ANN001 - (Step, Execution)
            if observe is not None:
                observe(StepTimes(step, ex.start, ex.end))

        sim = simulate_steps(runner, [s.batch for s in steps], lambda i, _: steps[i].assignment,
                             contention=self.contention, memory=self.memory, observe=seen, meta=meta)
        return BackendResult(sim.trace, sim.metrics, sim.steps)
