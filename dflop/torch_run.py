"""The job behind `dflop run --backend torch`: the chosen plan trained for real, next to its prediction.

It plans as `dflop run` does (dflop's space against the data-blind baselines,
with the cost model the config selects), schedules every step ahead, then
trains dflop's plan with dflop's schedules and the strongest baseline's plan
with its own batching rule on real processes, and puts each measured step time next
to the simulator's prediction for the very same steps. Plan, baseline and
schedules are written to the output folder first, so ``--resume`` continues a
checkpointed run with exactly the schedules it would have had.

The output folder holds one run. A new run first removes what an earlier one
left there (its record, plans, schedules, checkpoints, results and traces; no
other file), and once planned writes ``run.json``: everything a resume must
agree with (model, data, training, seed, steps, cluster, how the ranks run,
the plans, the dflop that made it). ``--resume`` refuses, naming the field
(or the option), whatever contradicts it, and any saved schedule or checkpoint
that is not this run's; it leaves an arm that finished (its
``<arm>.result.json`` holds its report) as it is and continues the other from
its own newest checkpoint; of a finished run it says so.

On one machine the backend starts its own processes; under ``torchrun`` every
rank runs this job, rank 0 plans and hands the plans and schedules to the
others, and only rank 0 reports.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflop import job
from dflop.backends.base import BackendResult, ScheduledBatch
from dflop.backends.torch_runtime import checkpoint
from dflop.backends.torch_runtime.backend import (TorchBackend, crowding, device_problem, die_with_agent,
                                                  under_torchrun)
from dflop.backends.torch_runtime.worker import TorchOptions
from dflop.config_check import check_plan, load_config
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder
from dflop.program.steps import StepRunner
from dflop.schedule.batching import Batching
from dflop.specs.execution import Device
from dflop.specs.loading import load_json, shown, to_mapping
from dflop.specs.plan import Plan
from dflop.specs.plan_file import PlanFile, PlannedCluster, load_plan, save_plan
from dflop.specs.run import DEFAULTS, RunConfig
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
    measured: dict[str, Any] | None = None
    """Its report, once it has run: saved as ``<name>.result.json``, where a resume finds it finished."""


RUN_FILE = "run.json"
ARM_NAMES = ("dflop", "baseline")
SCHEDULE = re.compile(r"step-\d{6}\.json")


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
    """An arm as an earlier run saved it, checked against the run's record and this run's config
    before anything starts: its plan is the one it started with, its schedules are the run's steps."""
    run = _read_run(folder)
    plan_file = _plan_path(name, folder)
    plan = load_plan(plan_file).plan
    _agree(folder, f"plans.{name}", run["plans"].get(name), plan, f"{plan_file} says")
    check_plan(plan, f"{plan_file}:", s.config, s.system.cluster)
    saved = folder / "schedules" / name
    files = sorted(saved.glob("step-*.json"))
    if not files:
        raise DflopError(f"{saved}: no saved schedules (step-*.json) to resume with")
    read = [_read_step(path, plan.bins, s.system.training.global_batch) for path in files]
    expected = [saved / f"step-{i:06d}.json" for i in range(run["steps"])]
    if missing := [path for path in expected if path not in files]:
        raise DflopError(f"{missing[0]}: missing: the run has {run['steps']} steps, each with its saved schedule")
    if extra := [path for path in files if path not in expected]:
        raise DflopError(f"{extra[0]}: not a step of this run (it has {run['steps']} steps)")
    result = folder / f"{name}.result.json"
    measured = load_json(result) if result.exists() else None
    if measured is not None and not (isinstance(measured, dict) and isinstance(measured.get("artifacts"), dict)):
        raise DflopError(f"{result}: not an arm's report (delete it to run the arm again)")
    return Arm(name, plan, [step for _, step in read], read[-1][0], measured=measured)


def _read_step(path: Path, bins: int, global_batch: int) -> tuple[str, ScheduledBatch]:
    """(solver, scheduled batch) of one step file that :func:`_save_arm` wrote: a global batch, each
    sample in a bin, no bin empty (every scheduler fills each; a rank with nothing to run cannot step)."""
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("solver"), str) or "batch" not in data:
        raise DflopError(f"{path}: not a saved schedule (expected 'solver', 'batch' and 'assignment')")
    batch = SampleTable.from_columns(data["batch"], str(path))
    if len(batch) != global_batch:
        raise DflopError(f"{path}: 'batch': {len(batch)} samples, but the run's global batch is {global_batch}")
    assignment = data.get("assignment")
    if not isinstance(assignment, list) or len(assignment) != len(batch) \
            or not all(type(a) is int and 0 <= a < bins for a in assignment):
        raise DflopError(f"{path}: 'assignment': expected a bin from 0 to {bins - 1} for each of the "
                         f"{len(batch)} samples")
    empty = np.flatnonzero(np.bincount(np.array(assignment, dtype=np.int64), minlength=bins) == 0)
    if len(empty):
        raise DflopError(f"{path}: 'assignment': bin {int(empty[0])} of {bins} has no sample (each needs one)")
    return data["solver"], ScheduledBatch(batch, np.array(assignment, dtype=np.int64))


def _plain(value: Any) -> Any:
    """A spec (or a mapping of them) as its JSON reads back, to compare with a record."""
    return json.loads(json.dumps(to_mapping(value)))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflop")
    except PackageNotFoundError:
        return "unknown"


def _record(s: job.Setup, steps: int) -> dict[str, Any]:
    """What a resume must agree with besides the plans, keyed as the config names it: the model,
    the data, the training (global batch), the seed, the steps, the cluster, how the ranks run
    (device, precision, optimizer, checkpoints: all of execution but the timeout, which changes
    no result), and the dflop that made the run."""
    c, e = s.config, s.config.execution
    data = to_mapping(c.data)
    for key in ("dataset", "profile"):  # the same file, however the config named it
        data[key] = str(Path(data[key]).resolve()) if data[key] else ""
    return _plain({"dflop_version": _version(), "encoder": c.encoder, "llm": c.llm, "data": data,
                   "training": c.training, "seed": c.seed, "steps": steps,
                   "cluster": PlannedCluster.of(s.system.cluster),
                   "execution": {f.name: getattr(e, f.name) for f in fields(e) if f.name != "timeout_s"}})


def _difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first field (dotted path) where two records differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            if found := _difference(old.get(key), new.get(key), f"{path}.{key}"):
                return found
        return None
    return None if old == new else (path, old, new)


def _agree(folder: Path, field: str, recorded: Any, current: Any, says: str) -> None:
    """Refuse, naming the field, a value that contradicts the run's record."""
    if found := _difference(recorded, _plain(current), field):
        path, old, new = found
        raise DflopError(f"{folder / RUN_FILE}: {path}: the run was made with {shown(old)}, but {says} "
                         f"{shown(new)} (resume with what the run was made with)")


def _read_run(folder: Path) -> dict[str, Any]:
    _plan_path("dflop", folder)
    path = folder / RUN_FILE
    if not path.exists():
        raise DflopError(f"{folder}: nothing to resume ({RUN_FILE} is missing: the run stopped before it was "
                         "planned, or an older dflop made it; start it again)")
    run = load_json(path)
    if not isinstance(run, dict) or type(run.get("steps")) is not int or run["steps"] < 1 \
            or not isinstance(run.get("plans"), dict) \
            or "dflop" not in run["plans"] or not set(run["plans"]) <= set(ARM_NAMES):
        raise DflopError(f"{path}: not the record of a torch run (expected 'steps' and the 'plans' of "
                         f"{' and '.join(ARM_NAMES)})")
    return run


def _resume(config: RunConfig, config_path: Path | None, folder: Path, *, steps: int | None,
            plan_file: PlanFile | None, gpus: int | None, nodes: int | None,
            log: job.Log) -> tuple[job.Setup, list[Arm]]:
    """The run in ``folder``, checked against its record: the config, ``--plan``, ``--steps``, ``--gpus``
    and ``--nodes`` (when given) agree with it, and it is not finished."""
    run = _read_run(folder)
    if all((folder / f"{name}.result.json").exists() for name in run["plans"]):
        raise DflopError(f"{folder}: this run is finished ({run['steps']} of {run['steps']} steps); nothing to resume")
    config_name = f"the config {config_path}" if config_path else f"the default config ({DEFAULTS['torch']})"
    if plan_file is not None:
        _agree(folder, "plans.dflop", run["plans"]["dflop"], plan_file.plan, f"--plan {plan_file.path} says")
    if config.plan is not None:
        _agree(folder, "plans.dflop", run["plans"]["dflop"], config.plan, f"{config_name} (its plan:) says")
    own = load_plan(_plan_path("dflop", folder))
    s = job.setup(config_path, gpus=gpus, nodes=nodes, plan_file=own, backend="torch", log=log)
    says = {"dflop_version": "this dflop is", "steps": "--steps says" if steps else f"{config_name} says",
            "cluster": "--gpus/--nodes say" if gpus or nodes else f"{own.path} says"}
    for key, value in _record(s, steps or s.config.steps).items():
        _agree(folder, key, run.get(key), value, says.get(key, f"{config_name} says"))
    arms = [_load_arm(name, folder, s) for name in ARM_NAMES if name in run["plans"]]
    for arm in arms:  # every checkpoint checked before the first arm trains
        if arm.measured is None:
            checkpoint.resume_point(folder / "checkpoints" / arm.name, run["steps"],
                                    checkpoint.identity(s.config.seed, arm.plan))
    return s, arms


def _clear(folder: Path, log: job.Log) -> None:
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


def _write_json(path: Path, data: Any) -> None:
    """Whole or not at all: an interrupted write leaves the previous file (or none)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def plan_arms(s: job.Setup, steps: int, out: Path, progress: Any, log: job.Log) -> list[Arm]:
    """dflop's plan with its schedules, against the strongest baseline's plan with its own batching
    rule; with a plan in the config, that plan with dflop's schedules against arrival order. Each
    arm's plan and schedules are saved, then the run's record (``run.json``: a resume needs it)."""
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
    _write_json(out / RUN_FILE, {**_record(s, steps), "plans": {arm.name: _plain(arm.plan) for arm in arms}})
    log("dflop: " + "; ".join(f"{a.name} [{a.plan.describe()}] ({a.solver})" for a in arms))
    note = job.gpu_note(arms[0].plan, s.system.cluster.gpus)
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
        log: job.Log = job._stderr) -> dict[str, Any] | None:
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
                s, arms = _resume(config, config_path, resume, steps=steps, plan_file=plan_file, gpus=gpus,
                                  nodes=nodes, log=log)
            else:
                s = job.setup(config_path, gpus=gpus, nodes=nodes, plan_file=plan_file, backend="torch", log=log)
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
                _write_json(folder / f"{arm.name}.result.json", arm.measured)
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
    fields = job.step_fields(result, global_batch)
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
    data = {"backend": "torch", "device": str(config.execution.device), "plan": job.plan_summary(arms[0].plan),
            "batching": str(arms[0].batching), **mine, "global_batch": batch,
            "gpus": arms[0].plan.gpus, "model": system.model.name, "data": source, "cost_model": system.cost.name}
    timeline = plot_timeline(load_trace(out / "dflop.trace.json"), out / "timeline.png",
                             compare=load_trace(out / "dflop.predicted.trace.json"),
                             labels=("measured (torch)", "predicted (simulator)"))
    data["artifacts"] = {**mine["artifacts"], "timeline": str(timeline)}
    if len(arms) > 1:
        theirs = arms[1].measured
        data["baseline"] = {"plan": job.plan_summary(arms[1].plan), "batching": arms[1].solver, **theirs}
        data["speedup"] = theirs["step_time_s"]["mean"] / data["step_time_s"]["mean"]
        data["predicted_speedup"] = theirs["predicted_step_time_s"]["mean"] / data["predicted_step_time_s"]["mean"]
    if config.execution.checkpoint_every:
        data["artifacts"]["checkpoints"] = str(out / "checkpoints" / "dflop")
    return data
