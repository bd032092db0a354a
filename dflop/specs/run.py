"""The run configuration: everything `dflop run`, `optimize` and `simulate` need.

Without ``--config`` the embedded default (``default_run.yaml``) is used: a
LLaVA-OneVision-style SigLIP + Qwen2.5-7B model on a simulated 4x8 H100
cluster with the ``llava-ov`` data mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml

from dflop.specs.execution import ExecutionSpec
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.limits import MAX_SAMPLES, MAX_SECONDS, MAX_STEPS
from dflop.specs.loading import check_numbers, from_mapping, limit, load_yaml, require
from dflop.specs.models import EncoderSpec, LLMSpec, MLLMSpec
from dflop.specs.plan import Plan


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where samples come from: a synthetic preset, a saved data profile, or a manifest."""

    preset: str = "llava-ov"
    profile: str = ""
    """Path of a data profile written by `dflop profile data` (takes precedence over preset)."""
    dataset: str = ""
    """Path of a LLaVA-format manifest (takes precedence over profile and preset)."""
    samples: int = field(default=20000, metadata=limit(1, MAX_SAMPLES))
    """Samples drawn from a preset (the pool global batches are drawn from)."""
    seed: int = field(default=0, metadata=limit(0))

    def __post_init__(self) -> None:
        check_numbers(self)


@dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    solver: str = "auto"
    """Microbatch partitioner: auto, ilp, lpt, kk, sequential or random."""
    time_limit: float = field(default=0.5, metadata=limit(high=MAX_SECONDS))
    """Seconds the ILP may spend on one global batch."""
    ilp_backend: Literal["cbc", "highs"] = "cbc"

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.time_limit > 0, f"time_limit: must be positive, got {self.time_limit}")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    encoder: EncoderSpec
    llm: LLMSpec
    cluster: ClusterSpec
    training: TrainingSpec
    data: DataSpec = field(default_factory=DataSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    steps: int = field(default=8, metadata=limit(1, MAX_STEPS))
    """Training steps to simulate or run."""
    seed: int = field(default=0, metadata=limit(0))
    plan: Plan | None = None
    """A fixed plan; when absent the optimizer chooses one."""
    profiles: tuple[str, ...] = ()
    """Profile store folders (written by `dflop profile model`), used besides the shipped profiles."""
    execution: ExecutionSpec = field(default_factory=ExecutionSpec)
    """How the torch backend runs the plan (device, precision, optimizer, checkpoints)."""

    def __post_init__(self) -> None:
        check_numbers(self)

    @property
    def model(self) -> MLLMSpec:
        return MLLMSpec(encoder=self.encoder, llm=self.llm)


DEFAULTS = {"sim": "default_run.yaml", "torch": "default_torch_run.yaml"}
"""The embedded config of each backend: a simulated H100 cluster; tiny real models on local CPUs."""


def load_run_config(path: str | Path | None = None, backend: str = "sim") -> RunConfig:
    """The run config in ``path``, or the embedded default of ``backend``."""
    if path is None:
        name = DEFAULTS[backend]
        text = resources.files("dflop.specs").joinpath(name).read_text()
        return from_mapping(RunConfig, yaml.safe_load(text), f"{name}:")
    return from_mapping(RunConfig, load_yaml(path), f"{path}:")
