"""The parallel plan: how the encoder and the LLM are spread over GPUs.

A plan checks itself against a cluster and a model and lists *every* problem
in one message, so a user fixes a plan in one go rather than one error a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from enum import Enum
from typing import Any, Literal

from dflop.errors import PlanError
from dflop.specs.hardware import ClusterSpec
from dflop.specs.loading import check_numbers, require
from dflop.specs.models import MLLMSpec
from dflop.specs.schedule_kinds import ONE_F_ONE_B, find


class Module(str, Enum):
    """The two modules of a multimodal model. A str enum, so YAML, JSON and traces carry plain names."""

    ENCODER = "encoder"
    LLM = "llm"

    def __str__(self) -> str:
        return self.value


MODULES: tuple[Module, Module] = (Module.ENCODER, Module.LLM)


class Recompute(str, Enum):
    """Activation recomputation (Megatron's --recompute-granularity, torchtitan's activation checkpointing)."""

    NONE = "none"
    """Keep every activation the backward needs."""
    SELECTIVE = "selective"
    """Recompute the cheap, memory-hungry elementwise parts (norms, the MLP's activation function):
    Megatron's selective recomputation, torchtitan's op-level selective AC."""
    FULL = "full"
    """Keep only each layer's input and rerun the layer's forward in the backward."""

    def __str__(self) -> str:
        return self.value


class Placement(str, Enum):
    """Where the encoder runs relative to the LLM."""

    DISAGGREGATED = "disaggregated"
    """Encoder and LLM on separate GPU sets (DFLOP)."""
    COLOCATED = "colocated"
    """The encoder runs inside the first LLM pipeline stage (Megatron-style LLaVA training)."""
    HETEROGENEOUS = "heterogeneous"
    """The encoder runs on the job's GPUs (every one, or the first tp x dp) with its own tp and dp, as
    a phase of its own: all of
    the step's encoder forwards before the LLM's pipeline, their backwards after it, an all-to-all
    carrying embeddings to LLM stage 0 and their gradients back (OrchMLLM's batch post-balancing,
    Megatron's colocated heterogeneous parallelism in MIMO)."""

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


MEMORY_OPTIONS = ("zero", "hsdp", "fp32_grads", "recompute")
"""The fields of a plan that change its memory, not its layout: ``Plan.with_options``."""


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
    """Model chunks per LLM pipeline rank (Interleaved1F1B, LoopedBFS; 2 for the V schedules)."""
    zero: Literal[0, 1, 2, 3] = 1
    """ZeRO stage over data parallelism. 0: replicated (DDP), one bucketed gradient all-reduce per
    step, overlapped with the last backward. 1: optimizer state sharded (Megatron's distributed
    optimizer): a reduce-scatter of the gradients and an all-gather of the updated weights per step.
    2: gradients sharded too: each microbatch's gradients reduce-scattered as its backward produces
    them (DeepSpeed ZeRO-2). 3: weights sharded too (FSDP): every forward and backward gathers each
    layer's weights just ahead of use and reduce-scatters its gradients."""
    hsdp: bool = False
    """With zero 3: shard within a node and replicate across nodes (hybrid sharding, HSDP): gathers
    and reduce-scatters stay on NVLink, plus an all-reduce of each shard's gradients across nodes."""
    fp32_grads: bool = False
    """Gradients accumulated and reduced in fp32 buffers (Megatron's main_grad; FSDP's reduce_dtype
    float32) instead of the recipe's gradient precision. With zero 1 this is Megatron's distributed
    optimizer: 6 + 12/d bytes per parameter."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation of every layer of both modules."""

    def __post_init__(self) -> None:
        check_numbers(self)
        for name, enum in (("placement", Placement), ("recompute", Recompute)):
            value = getattr(self, name)
            if not isinstance(value, enum):  # accept the plain name too
                names = [p.value for p in enum]
                require(value in names, f"{name}: {value!r} is not one of {', '.join(names)}")
                object.__setattr__(self, name, enum(value))
        require(self.microbatches >= 1, f"microbatches: must be at least 1, got {self.microbatches}")
        require(self.virtual_stages >= 1,
                f"virtual_stages: must be at least 1, got {self.virtual_stages}")
        self._check_memory_options()

    def _check_memory_options(self) -> None:
        require(self.zero in (0, 1, 2, 3), f"zero: must be 0, 1, 2 or 3, got {self.zero!r}")
        require(not self.hsdp or self.zero == 3, "hsdp: hybrid sharding needs zero 3")

    @property
    def gpus(self) -> int:
        if self.shares_gpus:
            return self.llm.gpus
        return self.encoder.gpus + self.llm.gpus

    @property
    def bins(self) -> int:
        """(LLM data-parallel replica x microbatch) bins the scheduler fills each step."""
        return self.llm.dp * self.microbatches

    @property
    def colocated(self) -> bool:
        return self.placement is Placement.COLOCATED

    @property
    def heterogeneous(self) -> bool:
        return self.placement is Placement.HETEROGENEOUS

    @property
    def shares_gpus(self) -> bool:
        """The encoder runs on the LLM's GPUs (colocated or heterogeneous): the job is the LLM's GPUs."""
        return self.placement is not Placement.DISAGGREGATED

    def with_options(self, **options: Any) -> "Plan":
        """This plan with other memory options (``zero``, ``hsdp``, ``fp32_grads``, ``recompute``),
        checked by the rules of those options alone: the rest of the plan is valid already, and the
        search makes one such plan per option of every candidate, by the hundred thousand."""
        unknown = set(options) - set(MEMORY_OPTIONS)
        if unknown:
            raise TypeError(f"not a memory option of a plan: {', '.join(sorted(unknown))}")
        plan = object.__new__(Plan)
        plan.__dict__.update(self.__dict__)
        if set(options) - {"recompute"}:
            plan.__dict__.pop("strategy", None)  # made again from the new options when asked
        for name, value in options.items():
            object.__setattr__(plan, name, value)
        object.__setattr__(plan, "recompute", Recompute(plan.recompute))
        plan._check_memory_options()
        return plan

    @cached_property
    def strategy(self) -> "Strategy":
        """What the plan's memory and placement options mean, each fact named once (kept: the
        planner asks for it on every candidate, many times)."""
        return Strategy(zero=self.zero, hsdp=self.hsdp, fp32_grads=self.fp32_grads, colocated=self.colocated,
                        llm_pp=self.llm.pp, encoder_phase=self.heterogeneous)

    def module(self, name: Module) -> ModulePlan:
        return self.encoder if name == Module.ENCODER else self.llm

    def stages(self, name: Module) -> int:
        """Pipeline stages of a module, counting virtual stages."""
        plan = self.module(name)
        return plan.pp * (self.virtual_stages if name == Module.LLM else 1)

    def stage_layers(self, name: Module, model: MLLMSpec) -> tuple[int, ...]:
        plan = self.module(name)
        layers = model.encoder.layers if name == Module.ENCODER else model.llm.layers
        return plan.layers_per_stage or even_split(layers, self.stages(name))

    @property
    def pipeline_ranks(self) -> int:
        """Ranks of the one pipeline the program runs (encoder stages first when disaggregated)."""
        return self.encoder.pp + self.llm.pp if self.placement is Placement.DISAGGREGATED else self.llm.pp

    def describe(self) -> str:
        enc = ("in LLM stage 0" if self.colocated else
               f"tp{self.encoder.tp} dp{self.encoder.dp} on {self._phase_gpus()}" if self.heterogeneous else
               self.encoder.describe())
        memory = f"zero{self.zero}" + (" hsdp" if self.hsdp else "") + (" fp32-grads" if self.fp32_grads else "")
        return (f"encoder {enc} | llm {self.llm.describe()} | {self.placement} | "
                f"m={self.microbatches} {self.schedule}"
                + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
                + f" {memory}" + (f" recompute-{self.recompute}" if self.recompute is not Recompute.NONE else ""))

    def _phase_gpus(self) -> str:
        held = self.encoder.tp * self.encoder.dp
        return "the LLM's GPUs" if held >= self.llm.gpus else f"the first {held} of the LLM's {self.llm.gpus} GPUs"

    def _schedule_problems(self) -> list[str]:
        """Canonical plans only: one pipeline rank runs every schedule as plain gradient accumulation,
        and an interleaved schedule with one stage per rank is its plain form. (Whether a schedule
        takes this many stages per rank is the schedule registry's to say when it builds the program.)"""
        out = []
        kind = find(self.schedule)  # None: unknown, which the registry says when it builds the program
        if self.pipeline_ranks == 1 and (kind is not ONE_F_ONE_B or self.virtual_stages > 1):
            out.append(f"one pipeline rank runs {self.schedule}"
                       + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else "")
                       + " as plain gradient accumulation: use 1F1B with one virtual stage")
        elif kind is not None and kind.interleaved and self.virtual_stages == 1:
            out.append(f"{self.schedule} with one virtual stage is not interleaved: use 1F1B or ZBH1")
        if not self.strategy.zero_fits_layout:
            out.append(f"zero {self.zero} is modelled as FSDP and DeepSpeed run it: one colocated stage (pp 1); "
                       "with pipelining use zero 0 or 1")
        return out

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
        elif self.heterogeneous:
            out.extend(self._heterogeneous_problems())
        elif self.virtual_stages > 1:
            out.append(f"{self.virtual_stages} stages per rank ({self.schedule}) need colocated or "
                       "heterogeneous placement")
        out.extend(self._schedule_problems())
        if global_batch is not None and self.bins > global_batch:
            out.append(f"llm dp {self.llm.dp} x {self.microbatches} microbatches = {self.bins} "
                       f"bins, more than the {global_batch} samples of the global batch")
        if not out:
            out.extend(placement_problems(self, cluster))
        return out

    def _heterogeneous_problems(self) -> list[str]:
        """The encoder's TP groups tile the LLM's (one TP group of either holds whole groups of the
        other), so that each LLM worker runs its encoder replicas' phase and no more; on every GPU of
        the job, or on the first ones (an LLM worker holds replicas on all its GPUs or on none)."""
        enc, llm = self.encoder, self.llm
        out = []
        if enc.pp != 1:
            out.append(f"heterogeneous placement runs the encoder unpipelined: pp 1 (got pp {enc.pp})")
        held = enc.tp * enc.dp
        if held > llm.gpus or held % llm.tp:
            out.append(f"heterogeneous placement runs the encoder on the job's first tp x dp GPUs, whole TP groups "
                       f"of the LLM: at most its {llm.gpus} GPUs and a multiple of its tp {llm.tp} (got tp {enc.tp} "
                       f"x dp {enc.dp} = {held})")
        if enc.tp % llm.tp and llm.tp % enc.tp:
            out.append(f"heterogeneous placement needs the encoder's tp {enc.tp} and the LLM's tp {llm.tp} to "
                       "divide one another (each TP group of one holds whole TP groups of the other)")
        if self.zero > 1:
            out.append(f"zero {self.zero} is not modelled for a heterogeneous encoder: use zero 0 or 1")
        return out

    def validate(self, cluster: ClusterSpec, model: MLLMSpec,
                 global_batch: int | None = None) -> "Plan":
        problems = self.problems(cluster, model, global_batch)
        if problems:
            raise PlanError(f"plan [{self.describe()}] does not fit: " + "; ".join(problems))
        return self


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """The facts a plan's ZeRO stage and placement decide, named once for the planner, the cost
    model, the step IR and the runtimes (in the manner of torchtitan's ``ParallelDims``)."""

    zero: int = 1
    hsdp: bool = False
    fp32_grads: bool = False
    colocated: bool = False
    llm_pp: int = 1
    encoder_phase: bool = False
    """Heterogeneous placement: the encoder runs as a phase of its own on the job's GPUs, beside no stage."""

    @property
    def shards_optimizer(self) -> bool:
        """ZeRO-1 and up: each data-parallel rank keeps the optimizer state of its shard only."""
        return self.zero >= 1

    @property
    def shards_gradients(self) -> bool:
        """ZeRO-2 and up: gradients are reduce-scattered as each backward makes them, not kept whole."""
        return self.zero >= 2

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3 (FSDP): weights are sharded too, gathered just ahead of each forward and backward."""
        return self.zero >= 3

    @property
    def runs_as_fsdp2(self) -> bool:
        """The torch backend wraps each stage in FSDP2's ``fully_shard`` (ZeRO-2/3): its hooks reduce and
        gather inside the ops, so the graph's collective nodes only mark where the plan expects them."""
        return self.shards_gradients

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3 frees the gathered weights after forward; ZeRO-2 keeps them for the backward."""
        return self.shards_parameters

    @property
    def optimizer_shards_itself(self) -> bool:
        """ZeRO-1: the optimizer shards its own state (ZeroRedundancyOptimizer, Megatron's distributed
        optimizer); under FSDP2 the sharded parameters carry it."""
        return self.shards_optimizer and not self.runs_as_fsdp2

    @property
    def reduces_once_per_step(self) -> bool:
        """ZeRO-0/1: one gradient reduction per step, after the last backward (the gradients are
        accumulated whole); it carries ZeRO-1's all-gather of the updated weights."""
        return not self.shards_gradients

    @property
    def reduces_every_backward(self) -> bool:
        """ZeRO-2: a reduce-scatter beside every backward and no gathers (the weights stay whole)."""
        return self.shards_gradients and not self.shards_parameters

    @property
    def single_stage(self) -> bool:
        """One colocated pipeline stage (pp 1): the whole model on every GPU."""
        return self.colocated and self.llm_pp == 1

    @property
    def zero_fits_layout(self) -> bool:
        """ZeRO-2/3 are modelled as FSDP and DeepSpeed run them: without pipelining, one colocated stage."""
        return not self.shards_gradients or self.single_stage

    def carries_encoder(self, module: Module, stages: tuple[int, ...]) -> bool:
        """Whether the pipeline rank holding ``stages`` of ``module`` also runs the encoder: with
        colocated placement the encoder lives inside LLM stage 0."""
        return self.colocated and module == Module.LLM and 0 in stages

    def mesh_owner(self, module: Module) -> Module:
        """The module whose GPUs, meshes and data-parallel groups ``module`` runs on: a colocated
        encoder runs on LLM stage 0's."""
        return Module.LLM if self.colocated else Module(module)

    def modules_of(self, module: Module, stages: tuple[int, ...]) -> tuple[Module, ...]:
        """The modules whose layers the pipeline rank holding ``stages`` of ``module`` runs."""
        return (Module(module), Module.ENCODER) if self.carries_encoder(module, stages) else (Module(module),)


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
    shares the GPUs of LLM stage 0; heterogeneous, encoder replica x holds the
    job's GPUs ``[x * tp, (x + 1) * tp)`` (with fewer replicas than fill the job,
    its first GPUs: the LLM's first stage's first).
    """
    groups: dict[tuple[Module, int, int], tuple[int, ...]] = {}
    base = 0
    modules = [Module.LLM] if plan.shares_gpus else [Module.ENCODER, Module.LLM]
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
    if plan.heterogeneous:
        tp = plan.encoder.tp
        for replica in range(plan.encoder.dp):
            groups[(Module.ENCODER, 0, replica)] = tuple(range(replica * tp, (replica + 1) * tp))
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
