"""A job's inputs: the run config (checked against what the layers above the specs know), the
system it runs on and the data it schedules.

Specs cannot import the layers that know data presets, pipeline schedules, whether a plan fits
or what a profile folder holds, so those names are checked here, once the config is loaded and
before any work, naming the file and the key: a wrong name fails at once, not at step 0 of a run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from dflop.cost.protocol import CostModel
from dflop.cost.select import select_cost_model
from dflop.cost.store import FILENAME
from dflop.cost.system import System
from dflop.errors import DflopError, PlanError, SpecError
from dflop.plan.evaluate import PlanningProblem
from dflop.program.schedules import shape_problem
from dflop.specs.execution import ExecutionSpec
from dflop.specs.hardware import ClusterSpec
from dflop.specs.loading import at, child
from dflop.specs.plan import Plan
from dflop.specs.plan_file import PlanFile
from dflop.specs.run import DEFAULTS, RunConfig, load_run_config
from dflop.workload.chat import ChatCounter, load_chat
from dflop.workload.data_profile import DataProfile
from dflop.workload.manifest import read_manifest
from dflop.workload.mixes import mix, mix_names, synthesize
from dflop.workload.sample import SampleTable

Log = Callable[[str], None]
"""Where a job writes its progress lines (the CLI: stderr; tests and notebooks: their own)."""


def log_to_stderr(message: str) -> None:
    """The default :data:`Log`: one line on stderr, so that stdout keeps the JSON alone."""
    sys.stderr.write(message + "\n")


def load_config(path: str | Path | None = None, backend: str = "sim") -> RunConfig:
    """The run config in ``path`` (or the backend's embedded one), checked by :func:`check_run_config`."""
    config = load_run_config(path, backend)
    check_run_config(config, str(path or DEFAULTS[backend]))
    return config


def check_run_config(config: RunConfig, source: str) -> None:
    """Raise ``<source>: <key>: <problem>`` for the first unknown name, misfit plan or missing folder."""
    preset = config.data.preset
    if preset.strip().lower() not in mix_names():
        raise SpecError(f"{source}: data.preset: unknown data preset '{preset}' "
                        f"(known: {', '.join(mix_names())})")
    if config.plan is not None:
        check_plan(config.plan, f"{source}: plan", config)
    for i, folder in enumerate(config.profiles):
        where = f"{source}: profiles[{i}]: {folder}"
        if not Path(folder).is_dir():
            raise SpecError(f"{where}: no such folder")
        if not (Path(folder) / FILENAME).exists():
            raise SpecError(f"{where}: holds no profile store ({FILENAME}; `dflop profile model` writes one)")


def check_plan(plan: Plan, where: str, config: RunConfig, cluster: ClusterSpec | None = None,
               global_batch: int | None = None) -> None:
    """The plan names a known pipeline schedule that runs its pipeline ranks, microbatches and
    stages per rank, and fits the model, the cluster and the global batch (the config's unless
    given); ``where`` locates the plan (``"p.yaml:"``)."""
    try:
        if problem := shape_problem(plan.schedule, plan.pipeline_ranks, plan.microbatches, plan.virtual_stages):
            raise DflopError(problem)
    except DflopError as exc:
        raise SpecError(f"{at(child(where, 'schedule'))}: {exc}") from None
    try:
        plan.validate(cluster or config.cluster, config.model, global_batch or config.training.global_batch)
    except PlanError as exc:
        raise PlanError(f"{at(where)}: {exc}") from None


@dataclass
class Setup:
    config: RunConfig
    system: System
    data: SampleTable
    data_source: str

    def problem(self) -> PlanningProblem:
        return PlanningProblem(self.system, self.data, self.config.seed, self.config.scheduler.variable_microbatches)


def load_data(config: RunConfig) -> tuple[SampleTable, str]:
    d = config.data
    if config.real_samples:  # counted as the torch backend feeds them: rendered by the chat template
        tokens = ChatCounter(load_chat(config.checkpoint), tiling=config.encoder.tiling)
        return read_manifest(d.dataset, config.encoder, tokenizer=tokens).samples, f"dataset {d.dataset}, {tokens.name}"
    if d.dataset:
        return read_manifest(d.dataset, config.encoder).samples, f"dataset {d.dataset}"
    if d.profile:
        profile = DataProfile.load(d.profile)
        profile.check_rule(config.encoder, f"data profile {d.profile}")
        return profile.samples, f"data profile {d.profile}"
    return synthesize(mix(d.preset), d.samples, config.encoder, d.seed), f"preset {d.preset}"


def setup(config_path: str | Path | None = None, *, gpus: int | None = None, nodes: int | None = None,
          plan_file: PlanFile | None = None, backend: str = "sim", log: Log = log_to_stderr,
          execution: ExecutionSpec | None = None, machine: Callable[[CostModel], str] | None = None) -> Setup:
    """The config's system and data; with a plan file, its plan and the cluster it was made for
    (``gpus`` and ``nodes`` override either); ``execution`` in place of the config's (the command
    line's options applied to it). ``machine``: the line, if any, saying that the cost model's profile
    was measured on another machine; it is said first, before anything else setup says, since every
    time the job reports hangs on it."""
    said: list[str] = []
    try:
        s = _setup(config_path, gpus, nodes, plan_file, backend, said.append, execution)
        if machine is not None and (line := machine(s.system.cost)):
            said.insert(0, line)
    finally:
        for line in said:
            log(line)
    return s


def _setup(config_path: str | Path | None, gpus: int | None, nodes: int | None, plan_file: PlanFile | None,
           backend: str, log: Log, execution: ExecutionSpec | None) -> Setup:
    config = load_config(config_path, backend)
    if execution is not None:
        config = replace(config, execution=execution)
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
