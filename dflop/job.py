"""The jobs behind `dflop optimize`, `dflop simulate` and `dflop run`: the layers wired together.

Nothing here decides anything on its own; it loads the run config and data,
picks the cost model, and hands them to the optimizer, the scheduler and the
simulator, then writes the artifacts (traces, timelines, plan).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflop.backends.base import Backend, BackendResult, ScheduledBatch
from dflop.backends.sim import SimBackend
from dflop.config_check import check_plan, load_config
from dflop.cost.select import select_cost_model
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder
from dflop.plan.evaluate import BatchPool, Estimate, PlanningProblem
from dflop.plan.search import OptimizeResult, Optimizer, Progress
from dflop.plan.space import BASELINES, DFLOP
from dflop.program.evaluate import evaluate
from dflop.program.schedules import canonical, stages_per_rank
from dflop.program.steps import StepRunner
from dflop.schedule.background import AsyncScheduler
from dflop.schedule.step import StepSchedule, plan_costs, schedule_batch
from dflop.specs.hardware import GIB
from dflop.specs.loading import to_mapping
from dflop.specs.plan import Plan
from dflop.specs.plan_file import PlanFile, save_plan
from dflop.specs.run import RunConfig
from dflop.trace.chrome import save_trace
from dflop.workload.data_profile import DataProfile, batches
from dflop.workload.manifest import read_manifest
from dflop.workload.mixes import mix, synthesize
from dflop.workload.sample import SampleTable

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    sys.stderr.write(message + "\n")


@dataclass
class Setup:
    config: RunConfig
    system: System
    data: SampleTable
    data_source: str

    def problem(self) -> PlanningProblem:
        return PlanningProblem(self.system, self.data, self.config.seed)


def load_data(config: RunConfig) -> tuple[SampleTable, str]:
    d = config.data
    if d.dataset:
        return read_manifest(d.dataset, config.encoder).samples, f"dataset {d.dataset}"
    if d.profile:
        return DataProfile.load(d.profile).samples, f"data profile {d.profile}"
    return synthesize(mix(d.preset), d.samples, config.encoder, d.seed), f"preset {d.preset}"


def setup(config_path: str | Path | None = None, *, gpus: int | None = None, nodes: int | None = None,
          plan_file: PlanFile | None = None, backend: str = "sim", log: Log = _stderr) -> Setup:
    """The config's system and data; with a plan file, its plan and the cluster it was made for
    (``gpus`` and ``nodes`` override either)."""
    config = load_config(config_path, backend)
    cluster = config.cluster
    if plan_file is not None:
        config = replace(config, plan=plan_file.plan)
        if plan_file.cluster is not None:
            cluster = plan_file.cluster.cluster(cluster.hardware, plan_file.where)
            if gpus is None and nodes is None and cluster != config.cluster:
                log(f"dflop: {plan_file.path} was made for {plan_file.cluster.describe()}: using that cluster "
                    "(--gpus and --nodes choose another)")
    cluster = cluster.resized(gpus=gpus, nodes=nodes)
    if plan_file is not None:
        check_plan(plan_file.plan, f"{plan_file.path}:", config, cluster)
    data, source = load_data(config)
    cost, note = select_cost_model(config.model, cluster.hardware, config.training, config.profiles, log)
    log(f"dflop: {config.model.name} on {cluster.gpus} x {cluster.hardware.name}, {source}; {note}")
    return Setup(config, System(config.model, cluster, config.training, cost), data, source)


def confirm_with_simpy(s: Setup, batches_: int = 2) -> Callable[[Plan, bool], float]:
    """Step time of a plan in SimPy (link contention on), on the optimizer's first batches."""
    pool = BatchPool(s.data, s.system.training.global_batch, s.config.seed)
    backend = SimBackend(memory=False)

    def confirm(plan: Plan, data_aware: bool) -> float:
        solver = "greedy" if data_aware else "sequential"
        steps = []
        for i in range(batches_):
            batch = pool[i]
            costs = plan_costs(batch, plan, s.system.model, s.system.cost)
            steps.append(ScheduledBatch(batch, schedule_batch(batch, plan, costs=costs, solver=solver).assignment))
        return backend.run(StepRunner(plan, s.system), steps).metrics.step_time_mean

    return confirm


def optimize(s: Setup, *, progress: Progress | None = None, baselines: bool = True) -> OptimizeResult:
    optimizer = Optimizer(s.problem(), s.system.training.global_batch, confirm=confirm_with_simpy(s),
                          progress=progress)
    return optimizer.run((DFLOP,), BASELINES if baselines else ())


def assess(s: Setup, plan: Plan) -> OptimizeResult:
    """A given plan, reported as the optimizer reports its choice; the baseline is the same plan on
    arrival-order batches, so the speedup is what balancing alone buys."""
    plan.validate(s.system.cluster, s.system.model, s.system.training.global_batch)
    optimizer = Optimizer(s.problem(), s.system.training.global_batch)
    start = time.perf_counter()
    mine, blind = (optimizer.ev.extend(Estimate(plan, aware, 0.0), optimizer.first) for aware in (True, False))
    return OptimizeResult(mine, [], {"same plan, arrival order": blind}, {}, time.perf_counter() - start,
                          optimizer.ideal())


def gpu_note(plan: Plan, cluster_gpus: int) -> str | None:
    """A plan that leaves GPUs of the cluster idle says so."""
    return f"the plan uses {plan.gpus} of {cluster_gpus} GPUs" if plan.gpus < cluster_gpus else None


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {"describe": plan.describe(), **to_mapping(plan)}


def optimize_json(result: OptimizeResult, usable: float) -> dict[str, Any]:
    out = result.to_json()
    out["plan"] = {**plan_summary(result.best.plan), **out["plan"]}
    out["expected_step_time_s"] = out["plan"]["step_time_s"]
    out["per_gpu_memory_gib"] = out["plan"]["peak_memory_gib"]
    out["usable_memory_gib"] = usable / GIB
    out["baseline"] = {**plan_summary(result.baseline.plan), **out["baseline"]} if result.baselines else None
    return out


def assigner(s: Setup, runner: StepRunner, solver: str) -> Callable[[SampleTable], StepSchedule]:
    """The scheduler of a step: the configured solver, with candidate microbatch orders timed by
    the fast evaluator."""
    time_limit = s.config.scheduler.time_limit
    ilp_backend = s.config.scheduler.ilp_backend
    plan = runner.plan

    def assign(batch: SampleTable) -> StepSchedule:
        costs = plan_costs(batch, plan, s.system.model, s.system.cost)

        def timed(assignment: np.ndarray) -> float:
            return evaluate(runner.step(0, batch, assignment).timing).step_ns

        return schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=time_limit, backend=ilp_backend,
                              evaluate=None if solver in ("sequential", "random") else timed)

    return assign


def schedule_steps(s: Setup, runner: StepRunner, *, steps: int, solver: str,
                   deadline: float | None = None) -> tuple[list[ScheduledBatch], dict[str, Any]]:
    """The first ``steps`` global batches, each partitioned ahead in the background (the solver under
    a deadline, the LPT heuristic when it is late)."""
    assign = assigner(s, runner, solver)
    stream = batches(s.data, s.system.training.global_batch, seed=s.config.seed)
    fallback = assigner(s, runner, "lpt")
    limit = deadline or max(s.config.scheduler.time_limit * 2, 0.5)
    with AsyncScheduler(stream, lambda batch, _: assign(batch), fallback, deadline=limit) as scheduler:
        pairs = [scheduler.get(step) for step in range(steps)]
        late = scheduler.late
    scheduled = [sch for _, sch in pairs]
    partitions = [sch.partition for sch in scheduled if sch.partition is not None]
    info = {"solver": solver, "late_steps": late,
            "gap_mean": float(np.mean([p.gap for p in partitions])) if partitions else None,
            "statuses": sorted({p.status for p in partitions}),
            "orders": sorted({sch.order for sch in scheduled})}
    return [ScheduledBatch(b, sch.aligned(b)) for b, sch in pairs], info


def simulate(s: Setup, plan: Plan, *, steps: int, solver: str, out: Path, name: str,
             deadline: float | None = None, backend: Backend | None = None) -> tuple[BackendResult, dict[str, Any]]:
    """Run ``steps`` steps of ``plan`` on ``backend`` (the simulator by default), scheduling ahead in
    the background for data-aware solvers; writes ``<name>.trace.json``."""
    system = s.system
    plan.validate(system.cluster, system.model, system.training.global_batch)
    runner = StepRunner(plan, system)
    scheduled, scheduler = schedule_steps(s, runner, steps=steps, solver=solver, deadline=deadline)
    result = (backend or SimBackend()).run(runner, scheduled, meta={"name": name, "solver": solver})
    trace = save_trace(result.trace, out / f"{name}.trace.json")
    return result, {"scheduler": scheduler, "trace": str(trace)}


def step_fields(sim: BackendResult, global_batch: int) -> dict[str, Any]:
    m = sim.metrics
    return {"step_time_s": {"mean": m.step_time_mean, "p50": m.step_time_p50},
            "throughput_samples_per_s": global_batch / m.step_time_mean,
            "bubble_fraction": m.bubble_fraction, "idle_fraction": m.idle_fraction,
            "utilisation": m.utilisation, "mfu": m.mfu, "peak_memory_gib": max(m.peak_memory_gib, default=0.0),
            "oom_events": len(m.oom)}


def run(s: Setup, *, steps: int, out: Path, progress: Progress | None = None, log: Log = _stderr) -> dict[str, Any]:
    """Optimize, then simulate the plan with the data-aware scheduler and the best baseline with
    data-blind microbatches on the same batches; compare."""
    from dflop.viz.timeline import plot_timeline

    ensure_writable_folder(out, "output")
    if s.config.plan is None:
        log("dflop: searching plans ...")
        result = optimize(s, progress=progress)
    else:
        result = assess(s, s.config.plan)
    if not result.baselines:
        raise DflopError("no data-blind baseline plan fits this cluster to compare against")
    plan, base = result.best.plan, result.baseline
    log(f"dflop: plan [{plan.describe()}]; baseline [{base.plan.describe()}]"
        + (" with arrival-order batches" if base.plan == plan else ""))
    note = gpu_note(plan, s.system.cluster.gpus)
    if note:
        log(f"dflop: {note}")
    solver = s.config.scheduler.solver
    mine, mine_info = simulate(s, plan, steps=steps, solver=solver, out=out, name="dflop",
                               deadline=0.5 * result.best.mean)
    theirs, theirs_info = simulate(s, base.plan, steps=steps, solver="sequential", out=out, name="baseline")
    timeline = plot_timeline(theirs.trace, out / "timeline.png", compare=mine.trace,
                             labels=("data-blind baseline", "dflop"))
    plan_file = save_plan(plan, out / "plan.yaml", s.system.cluster)
    batch = s.system.training.global_batch
    ours, baseline = step_fields(mine, batch), step_fields(theirs, batch)
    return {
        "plan": plan_summary(plan), **ours,
        "baseline": {"plan": plan_summary(base.plan), **baseline},
        "speedup": baseline["step_time_s"]["mean"] / ours["step_time_s"]["mean"],
        "expected": {"step_time_s": result.best.mean, "baseline_step_time_s": base.mean,
                     "speedup": result.speedup, "ideal_step_time_s": result.ideal_s},
        "steps": steps, "global_batch": batch, "gpus": s.system.cluster.gpus, "plan_gpus": plan.gpus,
        "model": s.system.model.name,
        "data": s.data_source, "cost_model": s.system.cost.name, "scheduler": mine_info["scheduler"],
        "search": {"seconds": result.seconds, "pruning": {k: v.as_dict() for k, v in result.stats.items()},
                   "why": result.why},
        "artifacts": {"trace": mine_info["trace"], "baseline_trace": theirs_info["trace"],
                      "timeline": str(timeline), "plan": str(plan_file)},
    }


def pick_plan(s: Setup, schedule: str | None, log: Log = _stderr) -> Plan:
    """The plan to simulate: the config's (or the plan file's, which :func:`setup` put there), or the
    optimizer's choice."""
    if s.config.plan is not None:
        plan = s.config.plan
    else:
        log("dflop: no plan given; searching one ...")
        plan = optimize(s, baselines=False).best.plan
    if schedule is not None:  # with the stages per rank it needs (2 for a V), else the plan's
        name = canonical(schedule)
        plan = replace(plan, schedule=name, virtual_stages=stages_per_rank(name, plan.virtual_stages))
    return plan
