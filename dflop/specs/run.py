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

from dflop.specs import scheduling
from dflop.specs.execution import ExecutionSpec
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.limits import MAX_SAMPLES, MAX_SECONDS, MAX_STEPS
from dflop.errors import SpecError
from dflop.specs.loading import at, check_numbers, child, from_mapping, limit, load_json, load_yaml, shown
from dflop.specs.models import EncoderSpec, LLMSpec, MLLMSpec
from dflop.specs.plan import Plan
from dflop.specs.resolve import named_spec


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where samples come from: a synthetic preset, a saved data profile, or a manifest."""

    preset: str = "llava-ov"
    profile: str = ""
    """Path of a data profile written by `dflop profile data` (takes precedence over preset)."""
    dataset: str = ""
    """Path of a manifest or dataset list, read as `dflop profile data --dataset` reads it (takes
    precedence over profile and preset)."""
    samples: int = field(default=20000, metadata=limit(1, MAX_SAMPLES))
    """Samples drawn from a preset (the pool global batches are drawn from)."""
    seed: int = field(default=0, metadata=limit(0))
    synthetic: bool = False
    """Train the torch backend on synthetic inputs (token ids and pixels drawn from each sample's id,
    shaped by the data) even where a checkpoint's tokenizer and a dataset would give real ones: for
    planning studies and fidelity, which need no data. Without a checkpoint and a dataset the
    inputs are synthetic anyway."""

    def __post_init__(self) -> None:
        check_numbers(self)


@dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    solver: str = "auto"
    """Microbatch partitioner: auto, ilp, greedy, lpt, kk, sequential or random (any case)."""
    time_limit: float = field(default=0.5, metadata=limit(high=MAX_SECONDS))
    """Seconds the partitioner may spend on one global batch (finite, above 0)."""
    ilp_backend: Literal["cbc", "highs"] = "cbc"
    variable_microbatches: bool = True
    """dflop's bins may give a data-parallel rank fewer microbatches than the plan's (its leading ones
    empty) where that is faster; false fills every microbatch, for a trainer that cannot skip one."""

    def __post_init__(self) -> None:
        check_numbers(self)
        object.__setattr__(self, "solver", scheduling.solver(self.solver, "solver").value)
        scheduling.time_limit(self.time_limit, "time_limit")


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
    checkpoint: str = ""
    """A Hugging Face checkpoint folder whose weights the torch backend starts from; a config's
    ``model: {checkpoint: DIR}`` sets it, and encoder and llm from the folder's config.json."""

    def __post_init__(self) -> None:
        check_numbers(self)

    @property
    def model(self) -> MLLMSpec:
        return MLLMSpec(encoder=self.encoder, llm=self.llm)

    @property
    def real_samples(self) -> bool:
        """Whether the torch backend trains on the dataset's own conversations, rendered and tokenized
        by the checkpoint (and the data profiled with that same rendering)."""
        return bool(self.checkpoint and self.data.dataset and not self.data.synthetic)


def _relative_to(folder: Path, data: object) -> object:
    """The config with its relative file paths (data set, data profile, profile folders,
    config.json models, the checkpoint a run starts from) made relative to ``folder``, the config's
    own folder."""
    if not isinstance(data, dict):
        return data

    def resolve(value: object) -> object:
        return str(folder / value) if isinstance(value, str) and value and not Path(value).is_absolute() else value

    out = dict(data)
    if isinstance(out.get("model"), dict) and isinstance(out["model"].get("checkpoint"), str):
        out["model"] = {**out["model"], "checkpoint": resolve(out["model"]["checkpoint"])}
    for key in ("encoder", "llm"):
        if isinstance(out.get(key), str) and out[key].endswith(".json"):
            out[key] = resolve(out[key])
    if isinstance(out.get("data"), dict):
        out["data"] = {k: resolve(v) if k in ("dataset", "profile") else v for k, v in out["data"].items()}
    if isinstance(out.get("profiles"), list):
        out["profiles"] = [resolve(v) for v in out["profiles"]]
    if isinstance(out.get("execution"), dict) and "init_from" in out["execution"]:
        out["execution"] = {**out["execution"], "init_from": resolve(out["execution"]["init_from"])}
    return out


def _model_checkpoint(data: object, where: str) -> object:
    """``model: {checkpoint: DIR}`` as the config's encoder and llm (the folder's config.json) and its
    ``checkpoint``. A plain LLM's folder needs ``encoder:`` beside it: dflop plans a vision encoder
    with every LLM (MLLMSpec), and that encoder's weights start from the seed."""
    if not isinstance(data, dict) or "model" not in data:
        return data
    model, key = data["model"], child(where, "model")
    if not isinstance(model, dict) or set(model) != {"checkpoint"} or not isinstance(model["checkpoint"], str):
        raise SpecError(f"{at(key)}: expected a mapping with one key, checkpoint (a Hugging Face folder), "
                        f"got {shown(model)}")
    config = Path(model["checkpoint"]) / "config.json"
    content = load_json(config)
    vision = isinstance(content, dict) and "vision_config" in content
    for name in ("llm", "checkpoint") + (("encoder",) if vision else ()):
        if name in data:
            raise SpecError(f"{at(child(where, name))}: give {name} or model.checkpoint, not both")
    if not vision and "encoder" not in data:
        raise SpecError(f"{at(key)}: {config} is a plain LLM (no vision_config): name the encoder dflop plans "
                        "with it (encoder: PRESET; its weights start from the seed)")
    out = {k: v for k, v in data.items() if k != "model"}
    out.update(llm=str(config), checkpoint=model["checkpoint"], **({"encoder": str(config)} if vision else {}))
    return out


DEFAULTS = {"sim": "default_run.yaml", "torch": "default_torch_run.yaml"}
"""The embedded config of each backend: a simulated H100 cluster; tiny real models on local CPUs."""


def load_run_config(path: str | Path | None = None, backend: str = "sim") -> RunConfig:
    """The run config in ``path``, or the embedded default of ``backend``. Relative paths in a
    config resolve against its folder, so a config and its data move together."""
    if path is None:
        name = DEFAULTS[backend]
        text = resources.files("dflop.specs").joinpath(name).read_text()
        return from_mapping(RunConfig, yaml.safe_load(text), f"{name}:", named_spec)
    data = _model_checkpoint(_relative_to(Path(path).parent, load_yaml(path)), f"{path}:")
    return from_mapping(RunConfig, data, f"{path}:", named_spec)
