"""What every execution backend does, and the registry that finds one by name.

A backend runs a plan on a workload for N steps with the scheduler's
schedules (one ``ScheduledBatch`` per step) and returns the trace and the
metrics computed from it by the one metrics function. The simulator and the
torch runtime both execute the same step graphs (``StepRunner.lower``) and
write their traces through the same recorder, which is what the conformance
suite checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from dflop.errors import DflopError
from dflop.program.steps import Step, StepRunner
from dflop.trace.metrics import TraceMetrics
from dflop.workload.sample import SampleTable


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's global batch and the bin of every sample (``r * microbatches + k``)."""

    batch: SampleTable
    assignment: np.ndarray


@dataclass
class StepTimes:
    """What happened to one step's graph: start and end of every node, in ns from the step's start."""

    step: Step
    start: np.ndarray
    end: np.ndarray


Observer = Callable[[StepTimes], None]
"""Called after every step (the adaptive correction learns from these)."""


@dataclass
class BackendResult:
    trace: dict[str, Any]
    metrics: TraceMetrics
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Per step: step_s, compute_s, and what the backend adds (loss, out-of-memory events)."""
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    name: str

    def run(self, runner: StepRunner, steps: Sequence[ScheduledBatch], *, observe: Observer | None = None,
            meta: dict[str, Any] | None = None) -> BackendResult:
        """Execute ``steps`` of ``runner``'s plan, one after the other."""


def _sim(**options: Any) -> Backend:
    from dflop.backends.sim import SimBackend

    return SimBackend(**options)


def _torch(**options: Any) -> Backend:
    from dflop.backends.torch_runtime.backend import TorchBackend

    return TorchBackend(**options)


BACKENDS: dict[str, Callable[..., Backend]] = {"sim": _sim, "torch": _torch}


def get_backend(name: str, **options: Any) -> Backend:
    """The backend called ``name`` (case-insensitive), built with ``options``."""
    key = name.strip().lower()
    if key not in BACKENDS:
        raise DflopError(f"unknown backend '{name}' (known: {', '.join(BACKENDS)})")
    return BACKENDS[key](**options)
