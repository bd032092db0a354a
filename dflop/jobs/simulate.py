"""`dflop simulate`: one plan's steps scheduled and run on a backend (the simulator by default)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dflop.backends.base import Backend, BackendResult
from dflop.backends.sim import SimBackend
from dflop.errors import DflopError
from dflop.program.schedules import canonical, stages_per_rank
from dflop.timing.steps import CostedPlan
from dflop.schedule.batching import Batching
from dflop.specs.loading import at
from dflop.specs.plan import Plan
from dflop.trace.chrome import save_trace

from dflop.jobs.optimize import optimize
from dflop.jobs.setup import Log, Setup, check_plan, log_to_stderr
from dflop.jobs.steps import schedule_steps


def pick_plan(s: Setup, schedule: str | None, log: Log = log_to_stderr) -> Plan:
    """The plan to simulate: the config's (or the plan file's, which :func:`setup` put there), or the
    optimizer's choice."""
    if s.config.plan is not None:
        plan = s.config.plan
    else:
        log("dflop: no plan given; searching one ...")
        plan = optimize(s, baselines=False).best.plan
    if schedule is not None:  # with the stages per rank it needs (2 for a V), else the plan's
        name = canonical(schedule)
        where = f"--schedule {schedule}:"  # the plan was checked; what is wrong now is the override
        try:
            plan = replace(plan, schedule=name, virtual_stages=stages_per_rank(name, plan.virtual_stages))
        except DflopError as exc:
            raise type(exc)(f"{at(where)}: {exc}") from None
        check_plan(plan, where, s.config, s.system.cluster)
    return plan


def simulate(s: Setup, plan: Plan, *, steps: int, solver: str, out: Path, name: str,
             deadline: float | None = None, backend: Backend | None = None,
             batching: Batching = Batching.BALANCED) -> tuple[BackendResult, dict[str, Any]]:
    """Run ``steps`` steps of ``plan`` on ``backend`` (the simulator by default), scheduling ahead in
    the background for data-aware solvers (or cutting bins by a baseline's ``batching`` rule);
    writes ``<name>.trace.json``."""
    system = s.system
    plan.validate(system.cluster, system.model, system.training.global_batch)
    runner = CostedPlan(plan, system)
    scheduled, scheduler = schedule_steps(s, runner, steps=steps, solver=solver, deadline=deadline,
                                          batching=batching)
    result = (backend or SimBackend()).run(runner, scheduled, meta={"name": name, "solver": solver})
    trace = save_trace(result.trace, out / f"{name}.trace.json")
    return result, {"scheduler": scheduler, "trace": str(trace)}
