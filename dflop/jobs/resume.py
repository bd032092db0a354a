"""What a run saves so that ``--resume`` can continue it, and the checks a resume makes.

The output folder holds one run: each arm's plan (``<arm>.plan.yaml``) and schedules
(``schedules/<arm>/step-NNNNNN.json``), and ``run.json``: everything a resume must agree with
(model, data, training, seed, steps, cluster, how the ranks run, the plans, the dflop that made
it), and what planning found (``planning``: the report's fields that no arm measures). :func:`resume_run`
refuses, naming the field (or the option), whatever contradicts it, and any saved schedule that
is not this run's (the backend checks its checkpoints); it leaves an arm that finished (its
``<arm>.result.json`` holds its report) as it is, and of a finished run it says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dflop.backends.base import ScheduledBatch
from dflop.cost.protocol import CostModel
from dflop.cost.system import System
from dflop.errors import DflopError, ensure_writable_folder, remove_left_over
from dflop.schedule.batching import Batching
from dflop.specs.loading import first_difference, load_json, save_json, shown, to_mapping
from dflop.specs.plan import Plan
from dflop.specs.plan_file import PlanFile, PlannedCluster, load_plan, save_plan
from dflop.specs.run import DEFAULTS, RunConfig
from dflop.workload.sample import SampleTable

from dflop.jobs.setup import Log, Setup, check_plan, setup


@dataclass
class Arm:
    """One of the runs compared: a plan and its scheduled steps."""

    name: str
    plan: Plan
    steps: list[ScheduledBatch]
    solver: str
    """dflop's solver, or the baseline's batching rule."""
    batching: Batching = Batching.BALANCED
    measured: dict[str, Any] | None = None
    """Its report, once it has run: saved as ``<name>.result.json``, where a resume finds it finished."""


RUN_FILE = "run.json"
RESULT_FREE = ("timeout_s", "decode_workers", "warmup")
"""Execution settings a resume may change: no weight or loss depends on them (the warm-up changes
how the first steps are timed, not what they train)."""
ARM_NAMES = ("dflop", "baseline", "baseline_balanced")
"""dflop's plan with its bins, the strongest baseline with its rule, that baseline's plan with dflop's bins."""
SCHEDULE = re.compile(r"step-\d{6}\.json")


def clear(folder: Path, log: Log) -> None:
    """Remove what an earlier run left in ``folder`` (record, plans, schedules, results, traces,
    timeline) before a new run writes its own, so that a resume sees this run's alone; any other
    file stays (the backend clears what it keeps there: :meth:`Backend.prepare`)."""
    files = [folder / RUN_FILE, folder / "timeline.png"]
    for name in ARM_NAMES:
        files += [folder / f"{name}.{kind}"
                  for kind in ("plan.yaml", "result.json", "trace.json", "predicted.trace.json")]
        files += [p for p in (folder / "schedules" / name).glob("step-*.json") if SCHEDULE.fullmatch(p.name)]
    files = [f for f in files if f.is_file()]
    remove_left_over(files)
    if files:
        log(f"dflop: {folder}: removed what an earlier run left there ({len(files)} files)")


def save_arm(arm: Arm, out: Path, system: System) -> None:
    """The arm's plan and one file per step (what :func:`load_arm` reads back on a resume)."""
    save_plan(arm.plan, out / f"{arm.name}.plan.yaml", system.cluster)
    folder = ensure_writable_folder(out / "schedules" / arm.name, "schedule")
    for i, s in enumerate(arm.steps):
        save_json(folder / f"step-{i:06d}.json", {
            "solver": arm.solver, "batch": s.batch.columns(), "assignment": [int(a) for a in s.assignment]})


def _plan_path(name: str, folder: Path) -> Path:
    plan_file = folder / f"{name}.plan.yaml"
    if not plan_file.exists():
        raise DflopError(f"{folder}: nothing to resume ({plan_file.name} is missing; give the --out folder of "
                         "an earlier `dflop run --backend torch`)")
    return plan_file


def load_arm(name: str, folder: Path, s: Setup, run: dict[str, Any]) -> Arm:
    """An arm as an earlier run saved it, checked against the run's record and this run's config
    before anything starts: its plan is the one it started with, its schedules are the run's steps.
    ``run``: the run's record (:func:`read_run`)."""
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
    """(solver, scheduled batch) of one step file that :func:`save_arm` wrote: a global batch, each
    sample in a bin (a bin may be empty: Megatron's dp_balanced packing leaves some, and they run as
    nothing)."""
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
    return data["solver"], ScheduledBatch(batch, np.array(assignment, dtype=np.int64))


def plain(value: Any) -> Any:
    """A spec (or a mapping of them) as its JSON reads back, to compare with a record."""
    return json.loads(json.dumps(to_mapping(value)))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflop")
    except PackageNotFoundError:
        return "unknown"


def run_record(s: Setup, steps: int) -> dict[str, Any]:
    """What a resume must agree with besides the plans, keyed as the config names it: the model
    (and the Hugging Face checkpoint it started from, if any: ``dflop export checkpoint`` writes
    its trained weights back in that checkpoint's names), the data, the training (global batch),
    the seed, the steps, the cluster, how the ranks run (device, precision, optimizer, checkpoints:
    all of execution but what changes no result), and the dflop that made the run."""
    c, e = s.config, s.config.execution
    data = to_mapping(c.data)
    for key in ("dataset", "profile"):  # the same file, however the config named it
        data[key] = str(Path(data[key]).resolve()) if data[key] else ""
    start = {"checkpoint": str(Path(c.checkpoint).resolve())} if c.checkpoint else {}  # what export writes back to
    return plain({"dflop_version": _version(), "encoder": c.encoder, "llm": c.llm, "data": data,
                   "training": c.training, "seed": c.seed, "steps": steps,
                   "cluster": PlannedCluster.of(s.system.cluster),
                   "execution": {f.name: getattr(e, f.name) for f in fields(e) if f.name not in RESULT_FREE},
                   **start})


def _agree(folder: Path, field: str, recorded: Any, current: Any, says: str) -> None:
    """Refuse, naming the field, a value that contradicts the run's record."""
    if found := first_difference(recorded, plain(current), field):
        path, old, new = found
        raise DflopError(f"{folder / RUN_FILE}: {path}: the run was made with {shown(old)}, but {says} "
                         f"{shown(new)} (resume with what the run was made with)")


def read_run(folder: Path) -> dict[str, Any]:
    _plan_path("dflop", folder)
    path = folder / RUN_FILE
    if not path.exists():
        raise DflopError(f"{folder}: nothing to resume ({RUN_FILE} is missing: the run stopped before it was "
                         "planned, or an older dflop made it; start it again)")
    run = load_json(path)
    if not isinstance(run, dict) or type(run.get("steps")) is not int or run["steps"] < 1 \
            or not isinstance(run.get("plans"), dict) \
            or not {"dflop", "baseline"} <= set(run["plans"]) <= set(ARM_NAMES):
        raise DflopError(f"{path}: not the record of a run (expected 'steps' and the 'plans' of "
                         f"{', '.join(ARM_NAMES[:-1])} and maybe {ARM_NAMES[-1]})")
    if not isinstance(run.get("planning"), dict):
        raise DflopError(f"{path}: 'planning': missing (an older dflop made the run; start it again)")
    return run


def resume_run(config: RunConfig, config_path: Path | None, folder: Path, *, steps: int | None,
               plan_file: PlanFile | None, gpus: int | None, nodes: int | None, backend: str,
               log: Log, machine: Callable[[CostModel], str] | None = None) -> tuple[Setup, list[Arm], dict[str, Any]]:
    """The run in ``folder``, checked against its record: the config (its ``execution`` as ``config``
    holds it, the command line's options applied), ``--plan``, ``--steps``, ``--gpus`` and ``--nodes``
    (when given) agree with it, and it is not finished; with what its planning found (``planning``).
    ``backend``: whose embedded config a run without one ran; ``machine``: as ``setup``'s."""
    run = read_run(folder)
    if all((folder / f"{name}.result.json").exists() for name in run["plans"]):
        raise DflopError(f"{folder}: this run is finished ({run['steps']} of {run['steps']} steps); nothing to resume")
    config_name = f"the config {config_path}" if config_path else f"the default config ({DEFAULTS[backend]})"
    if plan_file is not None:
        _agree(folder, "plans.dflop", run["plans"]["dflop"], plan_file.plan, f"--plan {plan_file.path} says")
    if config.plan is not None:
        _agree(folder, "plans.dflop", run["plans"]["dflop"], config.plan, f"{config_name} (its plan:) says")
    own = load_plan(_plan_path("dflop", folder))
    s = setup(config_path, gpus=gpus, nodes=nodes, plan_file=own, backend=backend, log=log,
              execution=config.execution, machine=machine)
    says = {"dflop_version": "this dflop is", "steps": "--steps says" if steps else f"{config_name} says",
            "cluster": "--gpus/--nodes say" if gpus or nodes else f"{own.path} says"}
    for key, value in run_record(s, steps or s.config.steps).items():
        _agree(folder, key, run.get(key), value, says.get(key, f"{config_name} says"))
    arms = [load_arm(name, folder, s, run) for name in ARM_NAMES if name in run["plans"]]
    return s, arms, run["planning"]
