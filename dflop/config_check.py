"""Checks of a run config against what the layers above the specs know (data presets, pipeline
schedules, whether a plan fits) and the file system (profile folders).

Specs cannot import those layers, so these names are checked here, once the config is loaded and
before any work, naming the file and the key: a wrong name fails at once, not at step 0 of a run.
"""

from __future__ import annotations

from pathlib import Path

from dflop.cost.store import FILENAME
from dflop.errors import DflopError, PlanError, SpecError
from dflop.program.schedules import shape_problem
from dflop.specs.hardware import ClusterSpec
from dflop.specs.loading import at, child
from dflop.specs.plan import Plan
from dflop.specs.run import DEFAULTS, RunConfig, load_run_config
from dflop.workload.mixes import mix_names


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
