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
from dflop.cost.select import prediction_error, select_cost_model
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder
from dflop.plan.evaluate import BatchPool, Estimate, PlanningProblem
from dflop.plan.report import Baseline, OptimizeResult, implausible, score
from dflop.plan.search import Optimizer, Progress
from dflop.plan.space import BASELINES, DFLOP
from dflop.program.evaluate import evaluate
from dflop.program.schedules import canonical, stages_per_rank
from dflop.program.steps import StepRunner
from dflop.schedule.background import AsyncScheduler
from dflop.schedule.batching import Batching, assign, synchronised
from dflop.schedule.step import StepSchedule, plan_costs, schedule_batch
from dflop.specs.hardware import GIB
from dflop.specs.loading import at, to_mapping
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


def rule_assignment(plan: Plan, batch: SampleTable, batching: Batching) -> np.ndarray:
    """A baseline rule's bins of ``batch`` for ``plan``."""
    return assign(batching, batch, plan.llm.dp, plan.microbatches)


def confirm_with_simpy(s: Setup, batches_: int = 2) -> Callable[[Plan, Batching], float]:
    """Step time of a plan in SimPy (link contention on), on the optimizer's first batches."""
    pool = BatchPool(s.data, s.system.training.global_batch, s.config.seed)
    backend = SimBackend(memory=False)

    def confirm(plan: Plan, batching: Batching) -> float:
        steps = []
        for i in range(batches_):
            batch = pool[i]
            if batching is Batching.BALANCED:
                costs = plan_costs(batch, plan, s.system.model, s.system.cost)
                assignment = synchronised(plan, schedule_batch(batch, plan, costs=costs, solver="greedy").assignment,
                                          costs)
            else:
                assignment = rule_assignment(plan, batch, batching)
            steps.append(ScheduledBatch(batch, assignment))
        return backend.run(StepRunner(plan, s.system), steps).metrics.step_time_mean

    return confirm


def optimize(s: Setup, *, progress: Progress | None = None, baselines: bool = True,
             noise: float | None = None) -> OptimizeResult:
    """dflop's plan and the baselines'; speedups also at the cost model's prediction error (``noise``,
    by default the profiled model's held-out error or the analytical model's stated default)."""
    sigma = prediction_error(s.system.cost)[0] if noise is None else noise
    optimizer = Optimizer(s.problem(), s.system.training.global_batch, confirm=confirm_with_simpy(s),
                          progress=progress, noise=sigma if baselines else 0.0)
    return optimizer.run((DFLOP,), BASELINES if baselines else ())


def assess(s: Setup, plan: Plan) -> OptimizeResult:
    """A given plan, reported as the optimizer reports its choice; the baseline is the same plan on
    arrival-order batches (its twin with dflop's bins is the plan itself), so the speedup is what
    balancing alone buys."""
    plan.validate(s.system.cluster, s.system.model, s.system.training.global_batch)
    optimizer = Optimizer(s.problem(), s.system.training.global_batch)
    start = time.perf_counter()
    mine, blind = (optimizer.ev.extend(Estimate(plan, rule, 0.0), optimizer.first)
                   for rule in (Batching.BALANCED, Batching.ARRIVAL))
    return OptimizeResult(mine, [], [Baseline("same plan", Batching.ARRIVAL, blind, mine)], {},
                          time.perf_counter() - start, optimizer.ideal(), s.system.hardware)


def gpu_note(plan: Plan, cluster_gpus: int) -> str | None:
    """A plan that leaves GPUs of the cluster idle says so."""
    return f"the plan uses {plan.gpus} of {cluster_gpus} GPUs" if plan.gpus < cluster_gpus else None


def plan_summary(plan: Plan) -> dict[str, Any]:
    return {"describe": plan.describe(), **to_mapping(plan)}


def optimize_json(result: OptimizeResult, usable: float, source: str = "") -> dict[str, Any]:
    out = result.to_json()
    out["plan"] = {**plan_summary(result.best.plan), **out["plan"]}
    out["expected_step_time_s"] = out["plan"]["step_time_s"]
    out["per_gpu_memory_gib"] = out["plan"]["peak_memory_gib"]
    out["usable_memory_gib"] = usable / GIB
    if out["prediction_error"] is not None:
        out["prediction_error"]["source"] = source
    b = result.strongest
    if b is not None:
        out["baseline"] = {**plan_summary(b.best.plan), **out["baseline"]}
    return out


def assigner(s: Setup, runner: StepRunner, solver: str,
             batching: Batching = Batching.BALANCED) -> Callable[[SampleTable], StepSchedule]:
    """The scheduler of a step: the configured solver, with candidate microbatch orders timed by
    the fast evaluator; or a baseline's batching rule."""
    time_limit = s.config.scheduler.time_limit
    ilp_backend = s.config.scheduler.ilp_backend
    plan = runner.plan

    def assign_(batch: SampleTable) -> StepSchedule:
        if batching is not Batching.BALANCED:
            ids = tuple(str(i) for i in batch.ids)
            return StepSchedule(ids, rule_assignment(plan, batch, batching), plan.llm.dp, plan.microbatches,
                                order=str(batching))
        costs = plan_costs(batch, plan, s.system.model, s.system.cost)

        def timed(assignment: np.ndarray) -> float:
            return evaluate(runner.step(0, batch, assignment).timing).step_ns

        schedule = schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=time_limit,
                                  backend=ilp_backend, evaluate=None if solver in ("sequential", "random") else timed)
        return replace(schedule, assignment=synchronised(plan, schedule.assignment, costs))

    return assign_


def schedule_steps(s: Setup, runner: StepRunner, *, steps: int, solver: str, deadline: float | None = None,
                   batching: Batching = Batching.BALANCED) -> tuple[list[ScheduledBatch], dict[str, Any]]:
    """The first ``steps`` global batches, each partitioned ahead in the background (the solver under
    a deadline, the LPT heuristic when it is late), or cut by a baseline's rule."""
    assign = assigner(s, runner, solver, batching)
    stream = batches(s.data, s.system.training.global_batch, seed=s.config.seed)
    fallback = assigner(s, runner, "lpt", batching)
    limit = deadline or max(s.config.scheduler.time_limit * 2, 0.5)
    with AsyncScheduler(stream, lambda batch, _: assign(batch), fallback, deadline=limit) as scheduler:
        pairs = [scheduler.get(step) for step in range(steps)]
        late = scheduler.late
    scheduled = [sch for _, sch in pairs]
    partitions = [sch.partition for sch in scheduled if sch.partition is not None]
    info = {"solver": solver if batching is Batching.BALANCED else str(batching), "late_steps": late,
            "gap_mean": float(np.mean([p.gap for p in partitions])) if partitions else None,
            "statuses": sorted({p.status for p in partitions}),
            "orders": sorted({sch.order for sch in scheduled})}
    return [ScheduledBatch(b, sch.aligned(b)) for b, sch in pairs], info


def simulate(s: Setup, plan: Plan, *, steps: int, solver: str, out: Path, name: str,
             deadline: float | None = None, backend: Backend | None = None,
             batching: Batching = Batching.BALANCED) -> tuple[BackendResult, dict[str, Any]]:
    """Run ``steps`` steps of ``plan`` on ``backend`` (the simulator by default), scheduling ahead in
    the background for data-aware solvers (or cutting bins by a baseline's ``batching`` rule);
    writes ``<name>.trace.json``."""
    system = s.system
    plan.validate(system.cluster, system.model, system.training.global_batch)
    runner = StepRunner(plan, system)
    scheduled, scheduler = schedule_steps(s, runner, steps=steps, solver=solver, deadline=deadline,
                                          batching=batching)
    result = (backend or SimBackend()).run(runner, scheduled, meta={"name": name, "solver": solver})
    trace = save_trace(result.trace, out / f"{name}.trace.json")
    return result, {"scheduler": scheduler, "trace": str(trace)}


def step_fields(sim: BackendResult, global_batch: int) -> dict[str, Any]:
    m = sim.metrics
    return {"step_time_s": {"mean": m.step_time_mean, "p50": m.step_time_p50},
            "throughput_samples_per_s": global_batch / m.step_time_mean,
            "bubble_fraction": m.bubble_fraction, "idle_fraction": m.idle_fraction,
            "idle_by_module": m.idle_by_module, "utilisation": m.utilisation, "mfu": m.mfu, "hfu": m.hfu,
            "peak_memory_gib": max(m.peak_memory_gib, default=0.0),
            "oom_events": len(m.oom)}


def _simulate_arms(s: Setup, result: OptimizeResult, steps: int,
                   out: Path) -> tuple[dict[str, BackendResult], dict[str, dict[str, Any]]]:
    """dflop's plan with its bins, the strongest baseline with its own rule and, as the
    decomposition's middle point, that baseline's plan with dflop's bins (unless that is dflop's
    plan itself), each on the same batches."""
    best, strongest = result.best, result.strongest
    runs = {"dflop": (best.plan, best.batching), "baseline": (strongest.best.plan, strongest.best.batching)}
    if strongest.balanced is not None and strongest.balanced is not best:
        runs["baseline_balanced"] = (strongest.best.plan, Batching.BALANCED)
    sims, infos = {}, {}
    for name, (plan, batching) in runs.items():
        sims[name], infos[name] = simulate(s, plan, steps=steps, solver=s.config.scheduler.solver, out=out,
                                           name=name, deadline=0.5 * best.mean, batching=batching)
    if strongest.balanced is best:
        sims["baseline_balanced"] = sims["dflop"]
    return sims, infos


def run(s: Setup, *, steps: int, out: Path, progress: Progress | None = None, log: Log = _stderr,
        noise: float | None = None) -> dict[str, Any]:
    """Optimize (with a plan in the config: that plan, against itself on arrival-order batches), then
    simulate dflop's plan with its bins, the strongest baseline with its own batching rule and that
    baseline's plan with dflop's bins, on the same batches; compare."""
    from dflop.viz.timeline import plot_timeline

    ensure_writable_folder(out, "output")
    if s.config.plan is None:
        log("dflop: searching plans ...")
        result = optimize(s, progress=progress, noise=noise)
    else:
        result = assess(s, s.config.plan)
    strongest = result.strongest
    if strongest is None:
        raise DflopError("no baseline plan fits this cluster to compare against: "
                         + "; ".join(f"{b.name}: {b.reason}" for b in result.baselines))
    best, base = result.best, strongest.best
    log(f"dflop: plan [{best.plan.describe()}] ({best.batching}); strongest baseline {strongest.name} "
        f"[{base.plan.describe()}]")
    note = gpu_note(best.plan, s.system.cluster.gpus)
    if note:
        log(f"dflop: {note}")
    sims, infos = _simulate_arms(s, result, steps, out)
    timeline = plot_timeline(sims["baseline"].trace, out / "timeline.png", compare=sims["dflop"].trace,
                             labels=(f"strongest baseline ({strongest.name})", "dflop"))
    plan_file = save_plan(best.plan, out / "plan.yaml", s.system.cluster)
    batch = s.system.training.global_batch
    fields = {name: step_fields(sim, batch) for name, sim in sims.items()}
    time_of = {name: f["step_time_s"]["mean"] for name, f in fields.items()}
    expected = optimize_json(result, s.system.hardware.usable_memory_bytes, prediction_error(s.system.cost)[1])
    return {
        "plan": plan_summary(best.plan), "batching": str(best.batching), **fields["dflop"],
        "baseline": {"space": strongest.space, "batching": str(strongest.batching), "plan": plan_summary(base.plan),
                     **fields["baseline"]},
        "baselines": expected["baselines"],
        "speedup": time_of["baseline"] / time_of["dflop"],
        "decomposition": ({"plan_gain": time_of["baseline_balanced"] / time_of["dflop"],
                           "balance_gain": time_of["baseline"] / time_of["baseline_balanced"]}
                          if "baseline_balanced" in time_of else None),
        "expected": {"step_time_s": score(best), "baseline_step_time_s": score(base), "speedup": result.speedup,
                     "decomposition": result.decomposition, "ideal_step_time_s": result.ideal_s},
        "prediction_error": expected["prediction_error"],
        "warnings": expected["warnings"] + implausible("dflop (simulated)", fields["dflop"]["mfu"], s.system.hardware),
        "steps": steps, "global_batch": batch, "gpus": s.system.cluster.gpus, "hardware": s.system.hardware.name,
        "plan_gpus": best.plan.gpus,
        "model": s.system.model.name,
        "data": s.data_source, "cost_model": s.system.cost.name, "scheduler": infos["dflop"]["scheduler"],
        "search": {"seconds": result.seconds, "pruning": expected["pruning"], "why": result.why},
        "artifacts": {"trace": infos["dflop"]["trace"], "baseline_trace": infos["baseline"]["trace"],
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
        where = f"--schedule {schedule}:"  # the plan was checked; what is wrong now is the override
        try:
            plan = replace(plan, schedule=name, virtual_stages=stages_per_rank(name, plan.virtual_stages))
        except DflopError as exc:
            raise type(exc)(f"{at(where)}: {exc}") from None
        check_plan(plan, where, s.config, s.system.cluster)
    return plan
