"""The parallel plan: how the encoder and the LLM are spread over GPUs.

A plan checks itself against a cluster and a model and lists *every* problem
in one message, so a user fixes a plan in one go rather than one error a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from dflop.errors import PlanError
from dflop.specs.hardware import ClusterSpec
from dflop.specs.loading import check_numbers, require
from dflop.specs.models import MLLMSpec

class Module(str, Enum):
    """The two modules of a multimodal model. A str enum, so YAML, JSON and traces carry plain names."""

    ENCODER = "encoder"
    LLM = "llm"

    def __str__(self) -> str:
        return self.value


MODULES: tuple[Module, Module] = (Module.ENCODER, Module.LLM)


class Placement(str, Enum):
    """Where the encoder runs relative to the LLM."""

    DISAGGREGATED = "disaggregated"
    """Encoder and LLM on separate GPU sets (DFLOP)."""
    COLOCATED = "colocated"
    """The encoder runs inside the first LLM pipeline stage (Megatron-style LLaVA training)."""

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True)
class ModulePlan:
    """Tensor, pipeline and data parallelism of one module."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    layers_per_stage: tuple[int, ...] = ()
    """Layers of each (virtual) pipeline stage, first to last; empty means an even split."""

    def __post_init__(self) -> None:
        check_numbers(self)
        for name in ("tp", "pp", "dp"):
            require(getattr(self, name) >= 1, f"{name}: must be at least 1, got {getattr(self, name)}")
        require(all(n >= 1 for n in self.layers_per_stage),
                f"layers_per_stage: every stage needs at least one layer, got {list(self.layers_per_stage)}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp}"


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible, the remainder on the first stages."""
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i < extra else 0) for i in range(stages))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete parallel plan for an encoder + LLM model."""

    encoder: ModulePlan
    llm: ModulePlan
    placement: Placement = Placement.DISAGGREGATED
    microbatches: int
    """Microbatches per LLM data-parallel replica per step."""
    schedule: str = "1F1B"
    """Pipeline schedule, named as torch.distributed.pipelining names it."""
    virtual_stages: int = 1
    """Model chunks per LLM pipeline rank (Interleaved1F1B)."""
    zero: Literal[0, 1, 3] = 1
    """ZeRO stage over data parallelism: 0 none, 1 optimizer state sharded
    (Megatron's distributed optimizer), 3 everything sharded (FSDP)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        if not isinstance(self.placement, Placement):  # accept the plain name too
            names = [p.value for p in Placement]
            require(self.placement in names, f"placement: {self.placement!r} is not one of {', '.join(names)}")
            object.__setattr__(self, "placement", Placement(self.placement))
        require(self.microbatches >= 1, f"microbatches: must be at least 1, got {self.microbatches}")
        require(self.virtual_stages >= 1,
                f"virtual_stages: must be at least 1, got {self.virtual_stages}")

    @property
    def gpus(self) -> int:
        if self.colocated:
            return self.llm.gpus
        return self.encoder.gpus + self.llm.gpus

    @property
    def bins(self) -> int:
        """(LLM data-parallel replica x microbatch) bins the scheduler fills each step."""
        return self.llm.dp * self.microbatches

    @property
    def colocated(self) -> bool:
        return self.placement is Placement.COLOCATED

    def module(self, name: Module) -> ModulePlan:
        return self.encoder if name == Module.ENCODER else self.llm

    def stages(self, name: Module) -> int:
        """Pipeline stages of a module, counting virtual stages."""
        plan = self.module(name)
        return plan.pp * (self.virtual_stages if name == "llm" else 1)

    def stage_layers(self, name: Module, model: MLLMSpec) -> tuple[int, ...]:
        plan = self.module(name)
        layers = model.encoder.layers if name == Module.ENCODER else model.llm.layers
        return plan.layers_per_stage or even_split(layers, self.stages(name))

    def describe(self) -> str:
        enc = "in LLM stage 0" if self.colocated else self.encoder.describe()
        return (f"encoder {enc} | llm {self.llm.describe()} | {self.placement} | "
                f"m={self.microbatches} {self.schedule}"
                + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
                + f" zero{self.zero}")

    def problems(self, cluster: ClusterSpec, model: MLLMSpec,
                 global_batch: int | None = None) -> list[str]:
        """Everything that keeps this plan from running on ``cluster``; empty when it fits."""
        out: list[str] = []
        if self.gpus > cluster.gpus:
            out.append(f"the plan needs {self.gpus} GPUs but the cluster has {cluster.gpus}")
        specs = {Module.ENCODER: model.encoder, Module.LLM: model.llm}
        for name in MODULES:
            plan, spec = self.module(name), specs[name]
            if plan.tp > cluster.gpus_per_node or cluster.gpus_per_node % plan.tp:
                out.append(f"{name} tp {plan.tp} does not fit a {cluster.gpus_per_node}-GPU node "
                           "(tensor parallelism stays inside a node)")
            if spec.heads % plan.tp:
                out.append(f"{name} tp {plan.tp} does not divide the {spec.heads} attention heads "
                           f"of {spec.name}")
            kv_heads = getattr(spec, "kv_heads", spec.heads)
            if kv_heads % plan.tp and spec.heads % plan.tp == 0:
                out.append(f"{name} tp {plan.tp} does not divide the {kv_heads} key-value heads "
                           f"of {spec.name}")
            stages = self.stages(name)
            if stages > spec.layers:
                out.append(f"{name} needs {stages} pipeline stages but {spec.name} has "
                           f"{spec.layers} layers")
            if plan.layers_per_stage:
                if len(plan.layers_per_stage) != stages:
                    out.append(f"{name} layers_per_stage lists {len(plan.layers_per_stage)} stages, "
                               f"the plan has {stages}")
                elif sum(plan.layers_per_stage) != spec.layers:
                    out.append(f"{name} layers_per_stage sums to {sum(plan.layers_per_stage)}, "
                               f"{spec.name} has {spec.layers} layers")
        if self.colocated:
            enc, llm = self.encoder, self.llm
            if enc.pp != 1 or enc.tp != llm.tp or enc.dp != llm.dp:
                out.append("colocated placement runs the encoder inside the first LLM stage: "
                           f"the encoder needs pp 1, tp {llm.tp} and dp {llm.dp} "
                           f"(got {enc.describe()})")
        elif self.virtual_stages > 1:
            out.append("virtual stages (Interleaved1F1B) need colocated placement")
        if self.zero == 3 and self.llm.pp > 1:
            out.append("zero 3 (FSDP) is modelled without pipeline parallelism; use pp 1")
        if global_batch is not None and self.bins > global_batch:
            out.append(f"llm dp {self.llm.dp} x {self.microbatches} microbatches = {self.bins} "
                       f"bins, more than the {global_batch} samples of the global batch")
        if not out:
            out.extend(placement_problems(self, cluster))
        return out

    def validate(self, cluster: ClusterSpec, model: MLLMSpec,
                 global_batch: int | None = None) -> "Plan":
        problems = self.problems(cluster, model, global_batch)
        if problems:
            raise PlanError(f"plan [{self.describe()}] does not fit: " + "; ".join(problems))
        return self


@dataclass(frozen=True)
class GpuMap:
    """GPU ids of every TP group: ``groups[(module, pipeline_rank, replica)]``."""

    groups: dict[tuple[Module, int, int], tuple[int, ...]]

    def gpus(self, module: Module, rank: int, replica: int) -> tuple[int, ...]:
        return self.groups[(Module(module), rank, replica)]


def place(plan: Plan) -> GpuMap:
    """Assign GPUs in Megatron's tp-dp-pp order, the encoder's GPUs first.

    Tensor-parallel peers are neighbours (same node), data-parallel replicas
    next, pipeline stages furthest apart. With colocated placement the encoder
    shares the GPUs of LLM stage 0.
    """
    groups: dict[tuple[Module, int, int], tuple[int, ...]] = {}
    base = 0
    modules = [Module.LLM] if plan.colocated else [Module.ENCODER, Module.LLM]
    for name in modules:
        mp = plan.module(name)
        for stage in range(mp.pp):
            for replica in range(mp.dp):
                first = base + mp.tp * (replica + mp.dp * stage)
                groups[(name, stage, replica)] = tuple(range(first, first + mp.tp))
        base += mp.gpus
    if plan.colocated:
        for replica in range(plan.llm.dp):
            groups[(Module.ENCODER, 0, replica)] = groups[(Module.LLM, 0, replica)]
    return GpuMap(groups)


def placement_problems(plan: Plan, cluster: ClusterSpec) -> list[str]:
    out = []
    for (name, stage, replica), gpus in place(plan).groups.items():
        nodes = {cluster.node_of(g) for g in gpus}
        if len(nodes) > 1:
            out.append(f"{name} stage {stage} replica {replica} TP group spans nodes "
                       f"{sorted(nodes)} (GPUs {gpus[0]}-{gpus[-1]}); make the encoder's GPU count "
                       f"a multiple of the LLM's tp")
            break
    return out
