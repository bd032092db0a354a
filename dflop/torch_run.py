"""The job behind `dflop run --backend torch`: the chosen plan trained for real, next to its prediction.

It plans as `dflop run` does (dflop's space against the data-blind baselines,
with the cost model the config selects), schedules every step ahead, then
trains dflop's plan with dflop's schedules and the strongest baseline's plan
with its own batching rule on real processes, and puts each measured step time next
to the simulator's prediction for the very same steps. Plan, baseline and
schedules are written to the output folder first, so ``--resume`` continues a
checkpointed run with exactly the schedules it would have had.

On one machine the backend starts its own processes; under ``torchrun`` every
rank runs this job, rank 0 plans and hands the plans and schedules to the
others, and only rank 0 reports.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflop import job
from dflop.backends.base import BackendResult, ScheduledBatch
from dflop.backends.torch_runtime.backend import TorchBackend, under_torchrun
from dflop.backends.torch_runtime.worker import TorchOptions
from dflop.config_check import check_plan, load_config
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder
from dflop.program.steps import StepRunner
from dflop.schedule.batching import Batching
from dflop.specs.execution import Device
from dflop.specs.loading import load_json
from dflop.specs.plan import Plan
from dflop.specs.plan_file import PlanFile, load_plan, save_plan
from dflop.specs.run import RunConfig
from dflop.workload.sample import SampleTable


@dataclass
class Arm:
    """One of the two runs compared: a plan and its scheduled steps."""

    name: str
    plan: Plan
    steps: list[ScheduledBatch]
    solver: str
    """dflop's solver, or the baseline's batching rule."""
    batching: Batching = Batching.BALANCED


def _save_arm(arm: Arm, out: Path, system: System) -> None:
    save_plan(arm.plan, out / f"{arm.name}.plan.yaml", system.cluster)
    folder = ensure_writable_folder(out / "schedules" / arm.name, "schedule")
    for i, s in enumerate(arm.steps):
        (folder / f"step-{i:06d}.json").write_text(json.dumps({
            "solver": arm.solver, "batch": s.batch.columns(), "assignment": [int(a) for a in s.assignment]}))


def _plan_path(name: str, folder: Path) -> Path:
    plan_file = folder / f"{name}.plan.yaml"
    if not plan_file.exists():
        raise DflopError(f"{folder}: nothing to resume ({plan_file.name} is missing; give the --out folder of "
                         "an earlier `dflop run --backend torch`)")
    return plan_file


def _load_arm(name: str, folder: Path, s: job.Setup) -> Arm:
    """An arm as an earlier run saved it, checked against this run's config before anything starts."""
    plan_file = _plan_path(name, folder)
    plan = load_plan(plan_file).plan
    check_plan(plan, f"{plan_file}:", s.config, s.system.cluster)
    files = sorted((folder / "schedules" / name).glob("step-*.json"))
    if not files:
        raise DflopError(f"{folder / 'schedules' / name}: no saved schedules (step-*.json) to resume with")
    read = [_read_step(path, plan.bins) for path in files]
    return Arm(name, plan, [step for _, step in read], read[-1][0])


def _read_step(path: Path, bins: int) -> tuple[str, ScheduledBatch]:
    """(solver, scheduled batch) of one step file that :func:`_save_arm` wrote."""
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("solver"), str) or "batch" not in data:
        raise DflopError(f"{path}: not a saved schedule (expected 'solver', 'batch' and 'assignment')")
    batch = SampleTable.from_columns(data["batch"], str(path))
    assignment = data.get("assignment")
    if not isinstance(assignment, list) or len(assignment) != len(batch) \
            or not all(type(a) is int and 0 <= a < bins for a in assignment):
        raise DflopError(f"{path}: 'assignment': expected a bin from 0 to {bins - 1} for each of the "
                         f"{len(batch)} samples")
    return data["solver"], ScheduledBatch(batch, np.array(assignment, dtype=np.int64))


def plan_arms(s: job.Setup, steps: int, out: Path, progress: Any, log: job.Log) -> list[Arm]:
    """dflop's plan with its schedules, against the strongest baseline's plan with its own batching
    rule; with a plan in the config, that plan with dflop's schedules against arrival order."""
    if s.config.plan is not None:
        plan = s.config.plan.validate(s.system.cluster, s.system.model, s.system.training.global_batch)
        arms = [Arm("dflop", plan, [], s.config.scheduler.solver),
                Arm("baseline", plan, [], str(Batching.ARRIVAL), Batching.ARRIVAL)]
    else:
        log("dflop: searching plans ...")
        result = job.optimize(s, progress=progress)
        arms = [Arm("dflop", result.best.plan, [], s.config.scheduler.solver, result.best.batching)]
        if result.strongest is not None:
            base = result.strongest.best
            arms.append(Arm("baseline", base.plan, [], str(base.batching), base.batching))
    for arm in arms:
        arm.steps, _ = job.schedule_steps(s, StepRunner(arm.plan, s.system), steps=steps,
                                          solver=s.config.scheduler.solver, batching=arm.batching)
        _save_arm(arm, out, s.system)
    log("dflop: " + "; ".join(f"{a.name} [{a.plan.describe()}] ({a.solver})" for a in arms))
    note = job.gpu_note(arms[0].plan, s.system.cluster.gpus)
    if note:
        log(f"dflop: {note}")
    return arms


def _options(config: RunConfig, out: Path, resume: bool, name: str) -> TorchOptions:
    spec = config.execution
    return TorchOptions(device=spec.device, dtype=spec.dtype, lr=spec.lr, weight_decay=spec.weight_decay,
                        timeout_s=spec.timeout_s, checkpoint_every=spec.checkpoint_every, seed=config.seed,
                        checkpoint_dir=str(out / "checkpoints" / name) if spec.checkpoint_every else "",
                        resume=resume)


def _init_torchrun(config: RunConfig) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo" if config.execution.device is Device.CPU else "nccl",
                                timeout=datetime.timedelta(seconds=config.execution.timeout_s))
    return dist.get_rank()


def run(config_path: Path | None, *, steps: int | None, out: Path, resume: Path | None, progress: Any = None,
        plan_file: PlanFile | None = None, gpus: int | None = None, nodes: int | None = None,
        log: job.Log = job._stderr) -> dict[str, Any] | None:
    """Train and compare; the JSON of `dflop run --backend torch` (None on ranks other than 0). A plan
    file (or, resuming, the run's own) brings its plan and the cluster it was made for."""
    config = load_config(config_path, backend="torch")
    rank = _init_torchrun(config) if under_torchrun() else 0
    bundle: list[Any] = [None]
    if rank == 0:
        folder = resume or out
        ensure_writable_folder(folder, "output")
        if resume is not None:
            plan_file = load_plan(_plan_path("dflop", resume))
        s = job.setup(config_path, gpus=gpus, nodes=nodes, plan_file=plan_file, backend="torch", log=log)
        if resume is not None:
            arms = [_load_arm(n, resume, s) for n in ("dflop", "baseline") if (resume / f"{n}.plan.yaml").exists()]
        else:
            arms = plan_arms(s, steps or s.config.steps, folder, progress, log)
        bundle = [(s.system, s.config, arms, folder, s.data_source)]
    if under_torchrun():
        import torch.distributed as dist

        dist.broadcast_object_list(bundle, src=0)
    system, config, arms, folder, source = bundle[0]
    results = {}
    for arm in arms:
        backend = TorchBackend(options=_options(config, folder, resume is not None and arm.name == "dflop", arm.name))
        results[arm.name] = backend.run(StepRunner(arm.plan, system), arm.steps, meta={"name": arm.name})
    if rank != 0:
        return None
    return report(system, config, arms, results, folder, source)


def _measured(result: BackendResult, global_batch: int, name: str, out: Path) -> dict[str, Any]:
    from dflop.trace.chrome import save_trace

    predicted = result.extra["predicted_step_time_s"]
    measured = [s["step_s"] for s in result.steps]
    graph = [s["graph_s"] for s in result.steps]
    fields = job.step_fields(result, global_batch)
    fields["predicted_step_time_s"] = {"mean": float(np.mean(predicted)), "each": predicted}
    fields["graph_time_s"] = {"mean": float(np.mean(graph)), "each": graph}
    fields["optimizer_time_s"] = {"mean": float(np.mean([s["optimizer_s"] for s in result.steps]))}
    fields["prediction_error"] = prediction_error(predicted, graph)
    fields["losses"] = result.extra["losses"]
    fields["step_time_s"]["each"] = measured
    fields["artifacts"] = {"trace": str(save_trace(result.trace, out / f"{name}.trace.json")),
                           "predicted_trace": str(save_trace(result.extra["predicted_trace"],
                                                             out / f"{name}.predicted.trace.json"))}
    return fields


def prediction_error(predicted: list[float], measured: list[float]) -> float:
    """Relative error of the predicted step graph time against the measured one, over the steps
    after the first (which pays one-time costs: allocation, gloo connections, lazy init). The
    optimizer step is not in the step graph, so it is measured and reported apart."""
    later = slice(1, None) if len(measured) > 1 else slice(None)
    return float(np.mean(predicted[later]) / np.mean(measured[later]) - 1)


def report(system: System, config: RunConfig, arms: list[Arm], results: dict[str, BackendResult], out: Path,
           source: str) -> dict[str, Any]:
    from dflop.viz.timeline import plot_timeline

    batch = system.training.global_batch
    mine = results["dflop"]
    data = {"backend": "torch", "device": str(config.execution.device), "plan": job.plan_summary(arms[0].plan),
            "batching": str(arms[0].batching), **_measured(mine, batch, "dflop", out), "steps": len(mine.steps), "global_batch": batch,
            "gpus": arms[0].plan.gpus, "model": system.model.name, "data": source, "cost_model": system.cost.name}
    timeline = plot_timeline(mine.trace, out / "timeline.png", compare=mine.extra["predicted_trace"],
                             labels=("measured (torch)", "predicted (simulator)"))
    data["artifacts"]["timeline"] = str(timeline)
    if "baseline" in results:
        theirs = _measured(results["baseline"], batch, "baseline", out)
        data["baseline"] = {"plan": job.plan_summary(arms[1].plan), "batching": arms[1].solver, **theirs}
        data["speedup"] = theirs["step_time_s"]["mean"] / data["step_time_s"]["mean"]
        data["predicted_speedup"] = theirs["predicted_step_time_s"]["mean"] / data["predicted_step_time_s"]["mean"]
    if config.execution.checkpoint_every:
        data["artifacts"]["checkpoints"] = str(out / "checkpoints" / "dflop")
    return data
