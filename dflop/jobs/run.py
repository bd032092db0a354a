"""`dflop run` on any backend of the registry: dflop's plan against the strongest baseline, each
executed on the same batches, with the decomposition of the speedup into plan and balance.

It plans once (:func:`plan_arms`: dflop's space against the data-blind baselines, with the cost
model the config selects; with a plan in the config, that plan against itself on arrival order),
cuts every arm's steps ahead with the one binning function (:func:`dflop.jobs.steps.schedule_steps`),
saves the arms and the run's record (:mod:`dflop.jobs.resume`: what ``--resume`` needs), executes
each arm on the backend, and reports every arm next to the simulator's prediction of its very steps.

The output folder holds one run. A new run first removes what an earlier one left there (its
record, plans, schedules, results and traces; no other file). What a backend needs around the
whole run (torchrun's process group, rank 0 planning for every rank, signals) is its
:meth:`~dflop.backends.base.Backend.session`; only its reporting rank plans, saves and reports.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflop.backends.base import Backend, BackendResult, ObservedStep
from dflop.cost.calibration import Calibration
from dflop.cost.protocol import CostModel
from dflop.cost.select import prediction_error
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder
from dflop.plan.report import implausible, score
from dflop.specs.progress import Channel, Progress
from dflop.schedule.batching import Batching
from dflop.specs.loading import save_json
from dflop.specs.plan_file import PlanFile, save_plan
from dflop.specs.run import DEFAULTS
from dflop.timing.steps import CostedPlan

from dflop.jobs.init_from import check_start, with_init_from
from dflop.jobs.optimize import assess, optimize
from dflop.jobs.report import gpu_note, optimize_json, plan_summary, step_fields
from dflop.jobs.resume import RUN_FILE, Arm, clear, plain, resume_run, run_record, save_arm
from dflop.jobs.setup import Log, Setup, load_config, log_to_stderr, setup
from dflop.jobs.steps import schedule_steps

TRAINING_FIELDS = ("losses", "graph_time_s", "optimizer_time_s", "device", "inputs", "trained", "skipped", "warmup")
"""What an arm reports only where its backend trains (the torch backend): the losses, the measured
step split into step graph and optimizer step, the device, what it trained on (``inputs``: real
samples or synthetic), per step its loss and the ids of the samples it trained (``trained``), and
the samples it skipped because their media failed to decode (``skipped``: step, sample_id, why),
and the step its ranks ran once, untimed, before the first (``warmup``: step, seconds; None without).
Every other field every backend reports."""
CALIBRATION_FIELDS = ("calibration", "uncalibrated_predicted_step_time_s", "uncalibrated_prediction_error")
"""What a run reports only where it calibrated (a backend on this machine's processors, ``execution.calibrate``):
what the check found (the run), and the prediction on the profile as recorded and its error (each arm)."""


def plan_arms(s: Setup, steps: int, out: Path, log: Log, progress: Progress | None = None,
              noise: float | None = None, start: dict[str, Any] | None = None) -> tuple[list[Arm], dict[str, Any]]:
    """The arms, and what planning found (the report's fields no arm measures). Optimize (with a
    plan in the config: assess that plan, its baseline the same plan on arrival order); the arms are
    dflop's plan with its bins, the strongest baseline with its own rule and, as the decomposition's
    middle point, that baseline's plan with dflop's bins (unless that is dflop's plan itself). Each
    arm's steps are cut ahead, the arms saved, then the run's record (``run.json``). ``start``: the
    checkpoint the run starts from (:func:`dflop.jobs.init_from.check_start`), reported as ``init_from``."""
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
    solver = s.config.scheduler.solver
    arms = [Arm("dflop", best.plan, [], solver, best.batching),
            Arm("baseline", base.plan, [], str(base.batching), base.batching)]
    if strongest.balanced is not None and strongest.balanced is not best:
        arms.append(Arm("baseline_balanced", base.plan, [], solver, Batching.BALANCED))
    infos = {}
    for arm in arms:
        arm.plan.validate(s.system.cluster, s.system.model, s.system.training.global_batch)
        arm.steps, infos[arm.name] = schedule_steps(s, CostedPlan(arm.plan, s.system), steps=steps, solver=solver,
                                                    deadline=0.5 * best.mean, batching=arm.batching)
        save_arm(arm, out, s.system)
    log(f"dflop: plan [{best.plan.describe()}] ({best.batching}); strongest baseline {strongest.name} "
        f"[{base.plan.describe()}]")
    if note := gpu_note(best.plan, s.system.cluster.gpus):
        log(f"dflop: {note}")
    expected = optimize_json(result, s.system.hardware.usable_memory_bytes, prediction_error(s.system.cost)[1])
    planning = {
        "baseline": {"space": strongest.space, "batching": str(strongest.batching)},
        "baselines": expected["baselines"],
        "decomposed": strongest.balanced is not None,
        "expected": {"step_time_s": score(best), "baseline_step_time_s": score(base), "speedup": result.speedup,
                     "decomposition": result.decomposition, "ideal_step_time_s": result.ideal_s},
        "prediction_error": expected["prediction_error"], "warnings": expected["warnings"],
        "search": {"seconds": result.seconds, "pruning": expected["pruning"], "why": result.why},
        "scheduler": infos["dflop"], "plan": str(save_plan(best.plan, out / "plan.yaml", s.system.cluster)),
        "init_from": start}
    save_json(out / RUN_FILE, {**run_record(s, steps), "plans": {arm.name: plain(arm.plan) for arm in arms},
                               "planning": plain(planning)})
    return arms, planning


def run(backend: Backend, config_path: Path | None, *, steps: int | None, out: Path, resume: Path | None = None,
        progress: Progress | None = None, channel: Channel | None = None, plan_file: PlanFile | None = None,
        gpus: int | None = None, nodes: int | None = None, noise: float | None = None, log: Log = log_to_stderr,
        calibrate: bool | None = None, init_from: Path | None = None, warmup: bool | None = None
        ) -> dict[str, Any] | None:
    """Plan (or, resuming, read the run in ``resume``), execute every arm on ``backend`` and compare;
    the JSON of `dflop run` (None on a process that does not report). A plan file (or, resuming,
    the run's own) brings its plan and the cluster it was made for. On a backend that runs on this
    machine, a profiled cost model measured elsewhere is said so first, and (``calibrate``, by default
    ``execution.calibrate``) calibrated before the first step (:func:`calibrate_arms`). ``init_from``
    (by default ``execution.init_from``): every arm starts from that checkpoint (:mod:`dflop.jobs.init_from`);
    ``warmup``, when given, in place of ``execution.warmup``.
    ``progress`` hears the search; ``channel`` makes the progress of the calibration and of each arm's steps,
    so that a display moves on from the search when the search is over (the steps as the backend
    observes them, or, where it hands them back when the arm ends, as it says they have run)."""
    if resume is not None and not backend.resumable:
        raise DflopError(f"--resume {resume}: the {backend.name} backend keeps no checkpoints to continue from "
                         "(--resume continues a run of a backend that does: --backend torch)")
    where = str(config_path or DEFAULTS[backend.defaults])
    config = with_init_from(load_config(config_path, backend.defaults), init_from, backend, where)
    if warmup is not None:
        config = replace(config, execution=replace(config.execution, warmup=warmup))
    calibrate = backend.calibrates and (config.execution.calibrate if calibrate is None else calibrate)
    folder = resume or out
    machine = _machine_warning(backend, calibrate)
    with backend.session(config, folder, where=where, resume=resume is not None):
        bundle, calibration = None, None
        if backend.is_reporting_rank():
            ensure_writable_folder(folder, "output")
            if resume is not None:
                s, arms, planning = resume_run(config, config_path, resume, steps=steps, plan_file=plan_file,
                                               gpus=gpus, nodes=nodes, backend=backend.defaults, log=log,
                                               machine=machine)
            else:
                s = setup(config_path, gpus=gpus, nodes=nodes, plan_file=plan_file, backend=backend.defaults, log=log,
                          execution=config.execution, machine=machine)
                start = check_start(s, steps or s.config.steps, folder)
                if s.config.plan is not None:
                    backend.refuse(s.config.plan)
                clear(folder, log)  # once the run's inputs are known good: a refused run removes nothing
                arms, planning = plan_arms(s, steps or s.config.steps, folder, log, progress, noise, start)
            todo = [arm for arm in arms if arm.measured is None]
            backend.prepare({arm.name: arm.plan for arm in todo}, len(arms[0].steps), log)
            planned = s.system
            predicting, calibration = (calibrate_arms(s.system, todo, log, channel and channel(
                "calibrating to this machine", "shapes")) if calibrate and todo else (planned, None))
            bundle = (predicting, arms, planning, s.data_source)
        system, arms, planning, source = backend.share(bundle)
        running = channel("running {}", "steps") if channel is not None and backend.is_reporting_rank() else None
        for arm in arms:
            if arm.measured is not None:  # finished before this resume
                continue
            observe = steps_run = None
            if running is not None:
                steps_run = _count(running, arm.name, len(arm.steps))
                observe = partial(_observed, steps_run)
            result = backend.run(CostedPlan(arm.plan, system), arm.steps, observe=observe,
                                 meta={"name": arm.name, "solver": arm.solver}, steps_run=steps_run)
            if backend.is_reporting_rank():
                arm.measured = _measured(result, system.training.global_batch, arm.name, folder)
                if calibration is not None:
                    _uncalibrated(arm, result, planned)
                save_json(folder / f"{arm.name}.result.json", arm.measured)
        if not backend.is_reporting_rank():
            return None
        data = report(backend, system, arms, planning, folder, source)
        if calibration is not None:
            data["calibration"] = calibration.to_json()
        return data


def _observed(tell: Callable[[int], None], observed: ObservedStep) -> None:
    tell(observed.step.index + 1)


def _count(progress: Progress, name: str, steps: int) -> Callable[[int], None]:
    """Arm ``name``'s progress, told the steps run so far: from 0, and never back (a backend that
    counts the steps while they run hands them back, observed one by one, when they have all run)."""
    most = [0]
    progress(name, 0, steps)

    def tell(done: int) -> None:
        if done > most[0]:
            most[0] = done
            progress(name, done, steps)

    return tell


def _machine_warning(backend: Backend, calibrate: bool) -> Callable[[CostModel], str] | None:
    """On a backend that runs on this machine, ``setup``'s line for a profile measured elsewhere."""
    from dflop.jobs.calibrate import machine_warning

    if not backend.calibrates:
        return None
    return machine_warning("calibrating to this machine before the first step" if calibrate else
                           "its times are used as recorded (execution.calibrate is off)")


def calibrate_arms(system: System, arms: list[Arm], log: Log, progress: Progress | None = None
                   ) -> tuple[System, Calibration | None]:
    """The system whose cost model prices the run's reported predictions, and what calibrating it found:
    a few of the profile's shapes measured here around the arms' microbatch sizes, at their plans' TP
    degrees (:mod:`dflop.jobs.calibrate`). The arms were planned on the profile as recorded: the
    microbatch sizes to measure at come from the plans, and a profile rescaled part by part from a
    few shapes can order plans worse than the profile itself (:mod:`dflop.profile.drift`), while the
    plan chosen is the one to compare against its baseline; only predictions are scaled."""
    from dflop.jobs.calibrate import calibrate_for

    cost, calibration = calibrate_for(system.cost, [(arm.plan, arm.steps) for arm in arms], log, progress)
    return replace(system, cost=cost), calibration


def _uncalibrated(arm: Arm, result: BackendResult, planned: System) -> None:
    """The prediction of ``arm``'s steps on the profile as recorded, next to the calibrated one."""
    from dflop.backends.base import get_backend

    steps = list(arm.steps)[result.extra.get("first_step", 0):]
    sim = get_backend("sim", memory=False, cores=result.extra.get("shared_cores"))
    predicted = [s["step_s"] for s in sim.run(CostedPlan(arm.plan, planned), steps).steps]
    graph = arm.measured.get("graph_time_s", arm.measured["step_time_s"])["each"]
    arm.measured["uncalibrated_predicted_step_time_s"] = {"mean": float(np.mean(predicted)), "each": predicted}
    arm.measured["uncalibrated_prediction_error"] = measured_prediction_error(predicted, graph)


def measured_prediction_error(predicted: list[float], measured: list[float]) -> float:
    """Relative error of the predicted step graph time against the measured one, over the steps
    after the first (which pays one-time costs: allocation, gloo connections, lazy init). The
    optimizer step is not in the step graph, so it is measured and reported apart."""
    later = slice(1, None) if len(measured) > 1 else slice(None)
    return float(np.mean(predicted[later]) / np.mean(measured[later]) - 1)


def _measured(result: BackendResult, global_batch: int, name: str, out: Path) -> dict[str, Any]:
    """One arm's report: its step metrics, each step's time next to the simulator's prediction of
    it, and its trace (with the prediction's, where the backend is not the simulator itself)."""
    from dflop.trace.chrome import save_trace

    predicted = list(result.extra["predicted_step_time_s"])
    trace = str(save_trace(result.trace, out / f"{name}.trace.json"))
    fields = step_fields(result, global_batch)
    fields["step_time_s"]["each"] = [s["step_s"] for s in result.steps]
    fields["predicted_step_time_s"] = {"mean": float(np.mean(predicted)), "each": predicted}
    graph = [s.get("graph_s", s["step_s"]) for s in result.steps]
    fields["measured_prediction_error"] = measured_prediction_error(predicted, graph)
    fields["shared_cores"] = result.extra.get("shared_cores")  # predicted with the ranks taking turns on these
    if "graph_s" in result.steps[0]:
        fields["graph_time_s"] = {"mean": float(np.mean(graph)), "each": graph}
        fields["optimizer_time_s"] = {"mean": float(np.mean([s["optimizer_s"] for s in result.steps]))}
    for key in TRAINING_FIELDS:
        if key in result.extra:
            fields[key] = result.extra[key]
    fields["steps"] = len(result.steps)
    fields["artifacts"] = {"trace": trace, "predicted_trace": str(save_trace(
        result.extra["predicted_trace"], out / f"{name}.predicted.trace.json")) if "predicted_trace" in result.extra
        else trace}
    return fields


def skipped_samples(arms: dict[str, Arm]) -> list[str]:
    """A warning per arm that trained without some samples: their media failed to decode (the
    ranks skipped them, all alike)."""
    out = []
    for name, arm in arms.items():
        if gone := (arm.measured or {}).get("skipped"):
            first = gone[0]
            out.append(f"{name}: {len(gone)} sample(s) skipped, their media failed to decode (step {first['step']}: "
                       f"{first['why']})")
    return out


def report(backend: Backend, system: System, arms: list[Arm], planning: dict[str, Any], out: Path,
           source: str) -> dict[str, Any]:
    """The JSON of the run from each arm's report (``Arm.measured``) and what planning found, with
    the timeline of the strongest baseline's arm above dflop's."""
    from dflop.trace.chrome import load_trace
    from dflop.viz.timeline import plot_timeline

    by_name = {arm.name: arm for arm in arms}
    mine, theirs = by_name["dflop"].measured, by_name["baseline"].measured
    middle = by_name.get("baseline_balanced", by_name["dflop"] if planning["decomposed"] else None)
    time_of = {name: arm.measured["step_time_s"]["mean"] for name, arm in by_name.items()}
    base = planning["baseline"]
    timeline = plot_timeline(load_trace(out / "baseline.trace.json"), out / "timeline.png",
                             compare=load_trace(out / "dflop.trace.json"),
                             labels=(f"strongest baseline ({base['space']} / {base['batching']})", "dflop"))
    data = {
        "backend": backend.name, "plan": plan_summary(by_name["dflop"].plan), "batching": str(by_name["dflop"].batching),
        **mine,
        "baseline": {**base, "plan": plan_summary(by_name["baseline"].plan), **theirs},
        "baselines": planning["baselines"],
        "speedup": time_of["baseline"] / time_of["dflop"],
        "predicted_speedup": theirs["predicted_step_time_s"]["mean"] / mine["predicted_step_time_s"]["mean"],
        "decomposition": None if middle is None else {
            "plan_gain": middle.measured["step_time_s"]["mean"] / time_of["dflop"],
            "balance_gain": time_of["baseline"] / middle.measured["step_time_s"]["mean"]},
        "expected": planning["expected"], "prediction_error": planning["prediction_error"],
        "warnings": planning["warnings"] + implausible(f"dflop ({backend.name})", mine["mfu"], system.hardware)
        + skipped_samples(by_name),
        "global_batch": system.training.global_batch, "gpus": system.cluster.gpus,
        "hardware": system.hardware.name, "plan_gpus": by_name["dflop"].plan.gpus, "model": system.model.name,
        "data": source, "cost_model": system.cost.name, "scheduler": planning["scheduler"], "search": planning["search"],
        "init_from": planning.get("init_from"),  # (a run.json from before init_from has none)
    }
    data["artifacts"] = {**mine["artifacts"], "baseline_trace": theirs["artifacts"]["trace"],
                         "timeline": str(timeline), "plan": planning["plan"]}
    if any((out / "checkpoints" / "dflop").glob("step-*")):
        data["artifacts"]["checkpoints"] = str(out / "checkpoints" / "dflop")
    return data
