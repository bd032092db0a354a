"""What every execution backend does, and the registry that finds one by name.

A backend runs a plan on a workload for N steps with the scheduler's
schedules (one ``ScheduledBatch`` per step) and returns the trace and the
metrics computed from it by the one metrics function. The simulator and the
torch runtime both execute the same step graphs (``CostedPlan.lower``) and
write their traces through the same recorder, which is what the conformance
suite checks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TypeVar

import numpy as np

from dflop.errors import DflopError
from dflop.specs.plan import Plan
from dflop.specs.run import RunConfig
from dflop.timing.steps import Step, CostedPlan
from dflop.trace.metrics import TraceMetrics
from dflop.workload.sample import SampleTable


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's global batch and the bin of every sample (``r * microbatches + k``)."""

    batch: SampleTable
    assignment: np.ndarray


@dataclass
class ObservedStep:
    """What happened to one step's graph: start and end of every node, in ns from the step's start."""

    step: Step
    start: np.ndarray
    end: np.ndarray


T = TypeVar("T")

Observer = Callable[[ObservedStep], None]
"""Called after every step (the adaptive correction learns from these)."""


@dataclass
class BackendResult:
    trace: dict[str, Any]
    metrics: TraceMetrics
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Per step: step_s, compute_s, and what the backend adds (loss, out-of-memory events)."""
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """What `dflop run` (``dflop.jobs.run``) asks of a backend besides :meth:`run`: every backend
    answers the same calls, so the job is one for all of them; the simulator answers them trivially."""

    name: str
    defaults: str
    """The embedded run config it runs without ``--config`` (a key of ``dflop.specs.run.DEFAULTS``)."""
    resumable: bool
    """Whether it checkpoints, so that ``--resume`` can continue one of its runs."""
    calibrates: bool
    """Whether its steps run on this machine's processors, so that a run calibrates a profiled cost
    model to them before it reports predictions (``execution.calibrate``)."""

    def run(self, runner: CostedPlan, steps: Sequence[ScheduledBatch], *, observe: Observer | None = None,
            meta: dict[str, Any] | None = None, steps_run: Callable[[int], None] | None = None) -> BackendResult:
        """Execute ``steps`` of ``runner``'s plan, one after the other. ``extra["predicted_step_time_s"]``:
        the simulator's prediction of each step (on the simulator, its own step times). ``observe``
        hears every step with its node times; ``steps_run``, where the backend knows it before it
        hands the steps back (the torch backend's launcher), how many steps have run, as it grows."""

    def session(self, config: RunConfig, folder: Path, *, where: str, resume: bool) -> AbstractContextManager[None]:
        """Around one whole run into ``folder`` (``where`` names the config in errors): what the
        backend sets up before any planning, on every process that runs the job."""

    def is_reporting_rank(self) -> bool:
        """Whether this process plans, saves and reports (the others only execute what it shares)."""

    def share(self, value: T) -> T:
        """The reporting rank's ``value``, on every process (``value`` is ignored on the others)."""

    def refuse(self, plan: Plan) -> None:
        """Raise a DflopError naming what in ``plan`` this backend cannot run (before anything is removed
        or measured: a plan file's plan is asked before the run clears its folder)."""

    def prepare(self, plans: dict[str, Plan], steps: int, log: Callable[[str], None]) -> None:
        """On the reporting rank, once the arms still to run (name: plan) are known and before any of
        them runs ``steps`` steps: refuse what cannot run, ``log`` what will be off."""


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
