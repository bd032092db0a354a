"""The simulator as a backend: SimPy executes each step graph on the cost model's costs."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from dflop.backends.base import BackendResult, Observer, ScheduledBatch, ObservedStep, T
from dflop.specs.plan import Plan
from dflop.specs.run import RunConfig
from dflop.timing.steps import CostedPlan
from dflop.sim.simulate import simulate_steps


@dataclass
class SimBackend:
    name = "sim"
    defaults = "sim"
    resumable = False
    calibrates = False
    contention: bool = True
    """Links carry one transfer at a time."""
    memory: bool = True
    """Record memory counters in the trace."""
    cores: int | None = None
    """The CPU cores the ranks share, where they outnumber them (CPU ranks on one machine: they
    take turns); None: every rank computes on a device of its own."""

    def run(self, runner: CostedPlan, steps: Sequence[ScheduledBatch], *, observe: Observer | None = None,
            meta: dict[str, Any] | None = None, steps_run: Callable[[int], None] | None = None) -> BackendResult:
        # (``steps_run`` goes unused: ``observe`` hears every step as it is simulated)
        def seen(step, ex) -> None:  # noqa: ANN001 - (Step, Execution)
            if observe is not None:
                observe(ObservedStep(step, ex.start, ex.end))

        sim = simulate_steps(runner, [s.batch for s in steps], lambda i, _: steps[i].assignment,
                             contention=self.contention, memory=self.memory, observe=seen, meta=meta,
                             cores=self.cores)
        return BackendResult(sim.trace, sim.metrics, sim.steps,
                             {"predicted_step_time_s": [s["step_s"] for s in sim.steps]})

    # One process, nothing to set up, share or refuse.

    def session(self, config: RunConfig, folder: Path, *, where: str, resume: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def is_reporting_rank(self) -> bool:
        return True

    def share(self, value: T) -> T:
        return value

    def refuse(self, plan: Plan) -> None:
        return None

    def prepare(self, plans: dict[str, Plan], steps: int, log: Callable[[str], None]) -> None:
        return None
