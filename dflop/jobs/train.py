"""The job behind `dflop run --backend torch`: the chosen plan trained for real, next to its prediction.

It plans as `dflop run` does (dflop's space against the data-blind baselines,
with the cost model the config selects), schedules every step ahead, then
trains dflop's plan with dflop's schedules and the strongest baseline's plan
with its own batching rule on real processes, and puts each measured step time next
to the simulator's prediction for the very same steps. Plan, baseline and
schedules are written to the output folder first (:mod:`dflop.jobs.resume`), so
``--resume`` continues a checkpointed run with exactly the schedules it would have had.

The output folder holds one run. A new run first removes what an earlier one
left there (its record, plans, schedules, checkpoints, results and traces; no
other file), and once planned writes ``run.json``.

On one machine the backend starts its own processes; under ``torchrun`` every
rank runs this job, rank 0 plans and hands the plans and schedules to the
others, and only rank 0 reports.
"""

from __future__ import annotations

import datetime
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflop.backends.base import BackendResult
from dflop.backends.torch_runtime import checkpoint
from dflop.backends.torch_runtime.backend import (TorchBackend, crowding, device_problem, die_with_agent,
                                                  under_torchrun)
from dflop.backends.torch_runtime.worker import TorchOptions
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder
from dflop.program.steps import StepRunner
from dflop.schedule.batching import Batching
from dflop.specs.execution import Device
from dflop.specs.loading import save_json
from dflop.specs.plan_file import PlanFile
from dflop.specs.run import DEFAULTS, RunConfig

from dflop.jobs.optimize import optimize
from dflop.jobs.report import gpu_note, plan_summary, step_fields
from dflop.jobs.resume import ARM_NAMES, RUN_FILE, SCHEDULE, Arm, plain, resume_run, run_record, save_arm
from dflop.jobs.setup import Log, Setup, load_config, log_to_stderr, setup
from dflop.jobs.steps import schedule_steps


def _clear(folder: Path, log: Log) -> None:
    """Remove what an earlier run left in ``folder`` (record, plans, schedules, checkpoints, results,
    traces, timeline) before a new run writes its own, so that a resume sees this run's alone;
    any other file stays."""
    files = [folder / RUN_FILE, folder / "timeline.png"]
    dirs = []
    for name in ARM_NAMES:
        files += [folder / f"{name}.{kind}"
                  for kind in ("plan.yaml", "result.json", "trace.json", "predicted.trace.json")]
        files += [p for p in (folder / "schedules" / name).glob("step-*.json") if SCHEDULE.fullmatch(p.name)]
        dirs += [p for p in (folder / "checkpoints" / name).glob("step-*") if checkpoint.STEP.fullmatch(p.name)]
    files = [f for f in files if f.is_file()]
    dirs = [d for d in dirs if d.is_dir()]
    try:
        for f in files:
            f.unlink()
        for d in dirs:
            shutil.rmtree(d)
    except OSError as exc:
        raise DflopError(f"{exc.filename}: cannot remove what an earlier run left ({exc.strerror})") from None
    if files or dirs:
        log(f"dflop: {folder}: removed what an earlier run left there (files: {len(files)}, checkpoints: {len(dirs)})")


def plan_arms(s: Setup, steps: int, out: Path, progress: Any, log: Log) -> list[Arm]:
    """dflop's plan with its schedules, against the strongest baseline's plan with its own batching
    rule; with a plan in the config, that plan with dflop's schedules against arrival order. Each
    arm's plan and schedules are saved, then the run's record (``run.json``: a resume needs it)."""
    if s.config.plan is not None:
        plan = s.config.plan.validate(s.system.cluster, s.system.model, s.system.training.global_batch)
        arms = [Arm("dflop", plan, [], s.config.scheduler.solver),
                Arm("baseline", plan, [], str(Batching.ARRIVAL), Batching.ARRIVAL)]
    else:
        log("dflop: searching plans ...")
        result = optimize(s, progress=progress)
        arms = [Arm("dflop", result.best.plan, [], s.config.scheduler.solver, result.best.batching)]
        if result.strongest is not None:
            base = result.strongest.best
            arms.append(Arm("baseline", base.plan, [], str(base.batching), base.batching))
    for arm in arms:
        arm.steps, _ = schedule_steps(s, StepRunner(arm.plan, s.system), steps=steps,
                                          solver=s.config.scheduler.solver, batching=arm.batching)
        save_arm(arm, out, s.system)
    save_json(out / RUN_FILE, {**run_record(s, steps), "plans": {arm.name: plain(arm.plan) for arm in arms}})
    log("dflop: " + "; ".join(f"{a.name} [{a.plan.describe()}] ({a.solver})" for a in arms))
    note = gpu_note(arms[0].plan, s.system.cluster.gpus)
    if note:
        log(f"dflop: {note}")
    return arms


def _options(config: RunConfig, out: Path, resume: bool, name: str) -> TorchOptions:
    """How an arm's ranks run; resuming, from the arm's own newest checkpoint."""
    spec = config.execution
    return TorchOptions(**{f.name: getattr(spec, f.name) for f in fields(spec)}, seed=config.seed,
                        checkpoint_dir=str(out / "checkpoints" / name) if spec.checkpoint_every else "",
                        resume=resume)


def _init_torchrun(config: RunConfig) -> int:
    import torch.distributed as dist

    die_with_agent()
    if not dist.is_initialized():
        dist.init_process_group("gloo" if config.execution.device is Device.CPU else "nccl",
                                timeout=datetime.timedelta(seconds=config.execution.timeout_s))
    return dist.get_rank()


def run(config_path: Path | None, *, steps: int | None, out: Path, resume: Path | None, progress: Any = None,
        plan_file: PlanFile | None = None, gpus: int | None = None, nodes: int | None = None,
        log: Log = log_to_stderr) -> dict[str, Any] | None:
    """Train and compare; the JSON of `dflop run --backend torch` (None on ranks other than 0). A plan
    file (or, resuming, the run's own) brings its plan and the cluster it was made for."""
    config = load_config(config_path, backend="torch")
    if problem := device_problem(config.execution.device):
        raise DflopError(f"{config_path or DEFAULTS['torch']}: execution.device: {problem}")
    rank = _init_torchrun(config) if under_torchrun() else 0
    folder = resume or out
    with _interruptible(folder):
        bundle: list[Any] = [None]
        if rank == 0:
            ensure_writable_folder(folder, "output")
            if resume is not None:
                s, arms = resume_run(config, config_path, resume, steps=steps, plan_file=plan_file, gpus=gpus,
                                  nodes=nodes, log=log)
            else:
                s = setup(config_path, gpus=gpus, nodes=nodes, plan_file=plan_file, backend="torch", log=log)
                _clear(folder, log)  # once the run's inputs are known good: a refused run removes nothing
                arms = plan_arms(s, steps or s.config.steps, folder, progress, log)
            if note := crowding(max(arm.plan.gpus for arm in arms if arm.measured is None), s.config.execution.device):
                log(f"dflop: warning: {note}")
            bundle = [(s.system, s.config, arms, s.data_source)]
        if under_torchrun():
            import torch.distributed as dist

            dist.broadcast_object_list(bundle, src=0)
        system, config, arms, source = bundle[0]
        for arm in arms:
            if arm.measured is not None:  # finished before this resume
                continue
            backend = TorchBackend(options=_options(config, folder, resume is not None, arm.name))
            result = backend.run(StepRunner(arm.plan, system), arm.steps, meta={"name": arm.name})
            if rank == 0:
                arm.measured = _measured(result, system.training.global_batch, arm.name, folder)
                save_json(folder / f"{arm.name}.result.json", arm.measured)
        if rank != 0:
            return None
        return report(system, config, arms, folder, source)


@contextmanager
def _interruptible(folder: Path) -> Iterator[None]:
    """SIGTERM stops the run as Ctrl-C does, and either ends it as a KeyboardInterrupt whose message
    says where the run can be resumed from (every rank has been stopped by then: the launcher's
    agent stops them on the signal). Under torchrun its agent owns the signals: a rank keeps the
    default SIGTERM, which ends it at once even inside a collective, where a Python handler waits."""
    main = threading.current_thread() is threading.main_thread() and not under_torchrun()
    before = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        yield
    except KeyboardInterrupt as exc:
        raise KeyboardInterrupt(_interrupted(folder, str(exc) or "SIGINT")) from None
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _interrupted(folder: Path, by: str) -> str:
    """The line an interrupted run ends with: what stopped it and how to go on."""
    if not (folder / RUN_FILE).exists():
        return f"the torch run was stopped by {by} before it started training"
    saved = sorted(folder.glob("checkpoints/*/step-*/" + checkpoint.META))
    kept = f"its checkpoints are in {folder / 'checkpoints'}" if saved else "it saved no checkpoint"
    return f"the torch run was stopped by {by}, every process with it; {kept}; `--resume {folder}` continues it"


def _measured(result: BackendResult, global_batch: int, name: str, out: Path) -> dict[str, Any]:
    from dflop.trace.chrome import save_trace

    predicted = result.extra["predicted_step_time_s"]
    measured = [s["step_s"] for s in result.steps]
    graph = [s["graph_s"] for s in result.steps]
    fields = step_fields(result, global_batch)
    fields["predicted_step_time_s"] = {"mean": float(np.mean(predicted)), "each": predicted}
    fields["graph_time_s"] = {"mean": float(np.mean(graph)), "each": graph}
    fields["optimizer_time_s"] = {"mean": float(np.mean([s["optimizer_s"] for s in result.steps]))}
    fields["prediction_error"] = prediction_error(predicted, graph)
    fields["losses"] = result.extra["losses"]
    fields["step_time_s"]["each"] = measured
    fields["steps"] = len(result.steps)
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


def report(system: System, config: RunConfig, arms: list[Arm], out: Path, source: str) -> dict[str, Any]:
    """The JSON of the run from each arm's report (``Arm.measured``), with the timeline of dflop's
    arm, measured against predicted."""
    from dflop.trace.chrome import load_trace
    from dflop.viz.timeline import plot_timeline

    batch = system.training.global_batch
    mine = arms[0].measured
    data = {"backend": "torch", "device": str(config.execution.device), "plan": plan_summary(arms[0].plan),
            "batching": str(arms[0].batching), **mine, "global_batch": batch,
            "gpus": arms[0].plan.gpus, "model": system.model.name, "data": source, "cost_model": system.cost.name}
    timeline = plot_timeline(load_trace(out / "dflop.trace.json"), out / "timeline.png",
                             compare=load_trace(out / "dflop.predicted.trace.json"),
                             labels=("measured (torch)", "predicted (simulator)"))
    data["artifacts"] = {**mine["artifacts"], "timeline": str(timeline)}
    if len(arms) > 1:
        theirs = arms[1].measured
        data["baseline"] = {"plan": plan_summary(arms[1].plan), "batching": arms[1].solver, **theirs}
        data["speedup"] = theirs["step_time_s"]["mean"] / data["step_time_s"]["mean"]
        data["predicted_speedup"] = theirs["predicted_step_time_s"]["mean"] / data["predicted_step_time_s"]["mean"]
    if config.execution.checkpoint_every:
        data["artifacts"]["checkpoints"] = str(out / "checkpoints" / "dflop")
    return data
