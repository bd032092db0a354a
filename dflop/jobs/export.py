"""A dflop plan as the launch arguments of the frameworks people train with.

``megatron``: Megatron-LM flags, as ``megatron/training/arguments.py`` names them
(every flag written exists at release core_v0.19.0; the encoder's own parallelism
flags were removed in core v0.14, so a disaggregated encoder is a stated gap, not a
flag that would stop the launch). ``torchtitan``, by :class:`TitanVersion`: for 0.3,
which has no TOML job files (a ``--module``/``--config`` registry function plus
command-line overrides), one ``--section.field value`` override per line for its
``ParallelismConfig`` and ``TrainingConfig``; the activation-checkpointing
subcommand (``activation-checkpoint:none|full|selective``; it must come last) is in
the header's launch line and a ``# subcommand:`` comment; for
0.2 and earlier, a TOML fragment with ``[parallelism]``, ``[training]`` and
``[activation_checkpoint]``. 0.3's overrides cannot give a list of lists, so its
layer split is said with the fields that steer torchtitan's generated split.
The tests hold every name against pinned copies of those releases' field lists.

Neither framework can express everything a plan says. What is lost is listed
(``Export.unsupported``) and written into the output as comments, next to the
piece of dflop that provides it: the per-step balanced bins come from
:class:`dflop.schedule.sampler.BalancedBatchSampler`, and the comment shows how
to hand it to the framework's data loader.

The plan's memory options map onto both: ``zero``, ``hsdp`` (shard within a node,
replicate across nodes: the cluster says how many GPUs a node holds),
``fp32_grads`` (or a recipe whose gradients are fp32 anyway) and ``recompute``.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from enum import Enum
from typing import Any

from dflop.errors import DflopError, PlanError, member
from dflop.timing.dpcomm import shard_degree
from dflop.program.schedules import canonical
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Plan

LOOPED = ("1F1B", "Interleaved1F1B")
"""Megatron-LM's pipeline schedules (1F1B, interleaved when a rank holds several stages)."""
TORCH_NAMES = {"ZBH1": "InterleavedZeroBubble"}
"""dflop schedule names that torch.distributed.pipelining spells differently."""
SINGLE_STAGE = ("GPipe", "1F1B")
"""torch.distributed.pipelining's schedules with one stage per rank; torchtitan gives the others two
unless told the layers per stage."""


class Target(str, Enum):
    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"

    def __str__(self) -> str:
        return self.value

    @property
    def title(self) -> str:
        return "Megatron-LM" if self is Target.MEGATRON else "torchtitan"


class TitanVersion(str, Enum):
    """torchtitan releases whose config surfaces differ: 0.2 (and earlier) read TOML job files, 0.3 a
    config registry function plus command-line overrides."""

    V0_2 = "0.2"
    V0_3 = "0.3"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Export:
    target: Target
    text: str
    unsupported: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"target": str(self.target), "text": self.text, "unsupported": list(self.unsupported)}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What both exporters read off a plan."""

    plan: Plan
    model: MLLMSpec
    global_batch: int
    replicas: int
    """HSDP: data-parallel groups that each hold a full (sharded) copy; 1 without HSDP."""
    recompute: str
    """none, full or selective."""
    fp32_grads: bool

    @property
    def dp(self) -> int:
        return self.plan.llm.dp

    @property
    def micro_batch(self) -> int:
        return max(1, self.global_batch // (self.dp * self.plan.microbatches))

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """LLM layers of each (virtual) stage, in stage order."""
        return self.plan.stage_layers(Module.LLM, self.model)


def settings(plan: Plan, model: MLLMSpec, *, global_batch: int, training: TrainingSpec | None = None,
             cluster: ClusterSpec | None = None) -> Settings:
    """Read a plan; refuse what no framework could run."""
    if global_batch < 1:
        raise DflopError(f"global batch: must be at least 1, got {global_batch}")
    layers = plan.stage_layers(Module.LLM, model)
    if len(layers) != plan.stages(Module.LLM) or sum(layers) != model.llm.layers:
        raise PlanError(f"plan [{plan.describe()}]: its LLM stages {list(layers)} do not split the "
                        f"{model.llm.layers} layers of {model.llm.name} into {plan.stages(Module.LLM)} stages")
    canonical(plan.schedule)  # an unknown schedule name is an error here, not a silent pass-through
    fp32 = plan.fp32_grads or (training is not None and training.grad_bytes >= 4)
    return Settings(plan=plan, model=model, global_batch=global_batch, replicas=_replicas(plan, cluster),
                    recompute=plan.recompute.value, fp32_grads=fp32)


def _replicas(plan: Plan, cluster: ClusterSpec | None) -> int:
    """HSDP's replicated groups: the data-parallel ranks over the ranks of one shard group (one
    node's, as the cost model and the torch backend shard)."""
    if not plan.hsdp:
        return 1
    if cluster is None:
        raise DflopError(f"plan [{plan.describe()}]: hsdp shards within a node; give the cluster (a run config) "
                         "to say how many GPUs a node holds")
    return plan.llm.dp // shard_degree(plan, cluster.gpus_per_node, plan.llm.dp, plan.llm.tp)


# ---- what neither target can say ---------------------------------------------------------------

def _common_gaps(s: Settings, target: Target) -> list[str]:
    plan, out = s.plan, []
    out.append(f"per-step balanced bins: {target.title} fills every microbatch with the same number of samples "
               "in arrival order; dflop's bins (LLM replica x microbatch) differ in size and are balanced on "
               "encoder and LLM work by dflop.schedule.sampler.BalancedBatchSampler (see the comment below)")
    if s.global_batch % (s.dp * plan.microbatches):
        out.append(f"global batch {s.global_batch} is not a multiple of llm dp {s.dp} x {plan.microbatches} "
                   f"microbatches: the micro-batch size is rounded down to {s.micro_batch}")
    return out


def _sampler_comment(s: Settings, dp_size: str, dp_rank: str, loader_hook: str) -> list[str]:
    """How to plug dflop's balancing into the target's data loader."""
    return [
        "dflop's balanced bins, in this framework's data loader:",
        "  from dflop.schedule.sampler import BalancedBatchSampler",
        "  from dflop.workload import DataProfile",
        "  sampler = BalancedBatchSampler(",
        "      DataProfile.load('data_profile.json'),  # `dflop profile data --dataset ... --out` of the train set",
        f"      global_batch={s.global_batch}, microbatches={s.plan.microbatches}, solver='lpt', seed=0,",
        f"      dp_size={dp_size}, dp_rank={dp_rank})",
        "  loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)",
        f"  {loader_hook}",
        "Each iteration yields one microbatch of this rank (a different number of samples each time):",
        "pack its samples into one sequence (variable-length attention) rather than padding them.",
    ]


def _comment(lines: list[str]) -> list[str]:
    return [("# " + line).rstrip() for line in lines]


def _gaps_comment(target: Target, gaps: list[str]) -> list[str]:
    bullets = [textwrap.fill(g, 96, initial_indent="  - ", subsequent_indent="    ") for g in gaps]
    return ["", f"What {target.title} cannot express:"] + "\n".join(bullets).splitlines() + [""]


# ---- Megatron-LM -------------------------------------------------------------------------------

def _megatron_split(s: Settings) -> list[str]:
    """Flags for the layer split and the virtual stages: an even split needs none (or the virtual
    stages per rank); uneven first and last stages have their own flags; anything else is a layout."""
    layers, pp = s.stage_layers, s.plan.llm.pp
    v = len(layers) // pp
    if len(set(layers)) == 1:
        return [f"--num-virtual-stages-per-pipeline-rank {v}"] if v > 1 else []
    middle = layers[1:-1]
    if v == 1 and len(set(middle)) <= 1:
        flags = []
        if not middle or layers[0] != middle[0]:
            flags.append(f"--decoder-first-pipeline-num-layers {layers[0]}")
        if middle and layers[-1] != middle[0]:
            flags.append(f"--decoder-last-pipeline-num-layers {layers[-1]}")
        return flags
    # Megatron's layout: stages in order, split by "|"; E the embedding, t a layer, L the loss.
    return ["--pipeline-model-parallel-layout 'E" + "|".join(f"t*{n}" for n in layers) + "L'"]


def _megatron_zero(s: Settings) -> tuple[list[str], list[str]]:
    zero, flags, gaps = s.plan.zero, [], []
    if zero >= 1:
        flags.append("--use-distributed-optimizer")
    if zero >= 2:
        strategy = "optim_grads" if zero == 2 else "optim_grads_params"
        flags += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}"]
    if s.replicas > 1:
        if zero == 1:
            flags.append(f"--num-distributed-optimizer-instances {s.replicas}")
        else:
            gaps.append(f"HSDP ({s.replicas} replicas of zero {zero} shards): Megatron-FSDP's hybrid sharding "
                        "is not set by launch flags; the flags shard over all data-parallel ranks")
    flags.append("--accumulate-allreduce-grads-in-fp32" if s.fp32_grads else "--grad-reduce-in-bf16")
    return flags, gaps


def _megatron_recompute(s: Settings) -> list[str]:
    if s.recompute == "none":
        return []
    if s.recompute == "selective":
        return ["--recompute-granularity selective"]
    return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]


def _heterogeneous_gap(plan: Plan) -> str:
    return (f"heterogeneous placement: the encoder on the job's GPUs with its own tp {plan.encoder.tp} and dp "
            f"{plan.encoder.dp}, an all-to-all to the LLM's first stage: no flag of the target says it (Megatron "
            "runs it through MIMO's colocated module parallelism, in code)")


def _megatron_encoder(s: Settings) -> list[str]:
    """A disaggregated encoder is a gap: its flags left Megatron-LM in core v0.14, and a flag the
    release does not know stops the launch."""
    plan = s.plan
    if plan.colocated:
        return []
    enc, llm = plan.encoder, plan.llm
    if plan.heterogeneous:
        return [_heterogeneous_gap(plan)]
    return [f"disaggregated placement: the encoder's own {enc.gpus} GPUs ({enc.describe()}): Megatron-LM core "
            f"v0.14 and later have no encoder parallelism flags and run the encoder in the first LLM pipeline "
            f"stage, with llm tp {llm.tp} and dp {llm.dp} (core v0.13 and earlier took "
            f"--encoder-tensor-model-parallel-size {enc.tp} --encoder-pipeline-model-parallel-size {enc.pp}, "
            "the encoder's stages joining every LLM pipeline with the LLM's data parallelism)"]


def megatron(s: Settings) -> Export:
    plan = s.plan
    schedule = canonical(plan.schedule)
    zero_flags, zero_gaps = _megatron_zero(s)
    flags = [f"--tensor-model-parallel-size {plan.llm.tp}", f"--pipeline-model-parallel-size {plan.llm.pp}",
             *_megatron_split(s), f"--micro-batch-size {s.micro_batch}",
             f"--global-batch-size {s.micro_batch * s.dp * plan.microbatches}",
             *_megatron_recompute(s), *zero_flags]
    gaps = _common_gaps(s, Target.MEGATRON) + zero_gaps + _megatron_encoder(s)
    if plan.llm.pp > 1 and schedule not in LOOPED:
        gaps.append(f"pipeline schedule {schedule}: Megatron-LM runs 1F1B (interleaved with virtual stages)")
    if plan.llm.pp > 1 and len(s.stage_layers) > plan.llm.pp and plan.microbatches % plan.llm.pp:
        gaps.append(f"{plan.microbatches} microbatches: Megatron's interleaved schedule wants a multiple of "
                    f"pp {plan.llm.pp}")
    head = [f"Megatron-LM launch flags for the dflop plan [{plan.describe()}]",
            f"({plan.gpus} GPUs; add the model, data and optimizer flags of your run)"]
    body = [f"{flag} \\" for flag in flags]
    body[-1] = body[-1][:-2]
    tail = _gaps_comment(Target.MEGATRON, gaps) + _sampler_comment(
        s, "mpu.get_data_parallel_world_size()", "mpu.get_data_parallel_rank()",
        "# return it from build_pretraining_data_loader (megatron/training/datasets/data_samplers.py)")
    return Export(Target.MEGATRON, "\n".join(_comment(head) + body + _comment(tail)) + "\n", tuple(gaps))


# ---- torchtitan --------------------------------------------------------------------------------

def _titan_data_parallel(s: Settings) -> tuple[dict[str, Any], list[str]]:
    plan, zero, gaps = s.plan, s.plan.zero, []
    fields: dict[str, Any] = {}
    if zero == 0 and plan.llm.tp == plan.llm.pp == 1:
        fields.update(data_parallel_replicate_degree=s.dp, data_parallel_shard_degree=1)
        return fields, gaps
    fields.update(data_parallel_replicate_degree=s.replicas, data_parallel_shard_degree=s.dp // s.replicas)
    if zero == 0:
        gaps.append("zero 0 (plain data parallelism) with tp or pp: torchtitan's DDP is 1-D only; "
                    "exported as FSDP")
    elif zero in (1, 2):
        fields["fsdp_reshard_after_forward"] = "never"
        if zero == 1:
            gaps.append("zero 1 (optimizer state sharded, weights and gradients whole): torchtitan shards with "
                        "FSDP2; exported as FSDP keeping weights gathered between forward and backward (zero 2)")
    return fields, gaps


def _titan_parts(layers: tuple[int, ...]) -> list[list[str]]:
    """Each stage's modules, as torchtitan 0.2's llama3 and qwen3 models name them."""
    parts, first, last = [], 0, len(layers) - 1
    for k, n in enumerate(layers):
        parts.append((["tok_embeddings"] if k == 0 else []) + [f"layers.{i}" for i in range(first, first + n)]
                     + (["norm", "output"] if k == last else []))
        first += n
    return parts


def _titan_split(layers: tuple[int, ...], pp: int, schedule: str) -> dict[str, int] | None:
    """torchtitan 0.3's fields whose generated split is ``layers``; None if none give it.

    Its split (``torchtitan/distributed/pipeline_parallel.py``): the layers plus the first and last
    stages' ``*_less_layers`` shared evenly over the stages, the remainder one each to the first
    stages; the stage count from ``pipeline_parallel_layers_per_stage`` (rounding up), else one or
    two per rank by schedule."""
    stages, middle = len(layers), list(layers[1:-1])
    if (stages == pp) != (schedule in SINGLE_STAGE):  # torchtitan refuses other stage counts per rank
        return None
    for base in sorted({*middle, *(m - 1 for m in middle)} or {max(layers)}, reverse=True):
        for extra in range(stages):
            effective = [base + (k < extra) for k in range(stages)]
            if base < 1 or effective[1:-1] != middle:
                continue
            fields = {"pipeline_parallel_first_stage_less_layers": effective[0] - layers[0],
                      "pipeline_parallel_last_stage_less_layers": effective[-1] - layers[-1]}
            if stages == pp * (1 if schedule in SINGLE_STAGE else 2):
                return fields
            total = sum(effective)
            per_stage = -(-total // stages)
            if -(-total // per_stage) == stages:
                return {**fields, "pipeline_parallel_layers_per_stage": per_stage}
    return None


def _titan_pipeline(s: Settings, version: TitanVersion) -> tuple[dict[str, Any], list[str]]:
    if s.plan.llm.pp == 1:
        return {}, []
    schedule = TORCH_NAMES.get(canonical(s.plan.schedule), canonical(s.plan.schedule))
    fields = {"pipeline_parallel_schedule": schedule, "pipeline_parallel_microbatch_size": s.micro_batch}
    if version is TitanVersion.V0_2:
        return {**fields, "module_fqns_per_model_part": _titan_parts(s.stage_layers)}, []
    split = _titan_split(s.stage_layers, s.plan.llm.pp, schedule)
    if split is None:
        return fields, [f"LLM stages {list(s.stage_layers)} under {schedule}: torchtitan 0.3's generated split "
                        "cannot give them (one stage per rank for GPipe and 1F1B, two or more for the others), and "
                        "module_fqns_per_model_part is no command-line override: set it in your config registry "
                        "function (--torchtitan-version 0.2 lists the module names)"]
    return {**fields, **split}, []


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _titan_toml(s: Settings, sections: dict[str, dict[str, Any]]) -> list[str]:
    head = [f"torchtitan job config fragment for the dflop plan [{s.plan.describe()}]",
            f"({s.plan.llm.gpus} GPUs for the LLM; merge into your train config's TOML)"]
    if "module_fqns_per_model_part" in sections["parallelism"]:
        head.append("module_fqns_per_model_part uses the module names of torchtitan's llama3 and qwen3 models")
    lines = _comment(head)
    for name, fields in {**sections, "activation_checkpoint": {"mode": s.recompute}}.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
    return lines + [""]


def _titan_overrides(s: Settings, sections: dict[str, dict[str, Any]]) -> list[str]:
    """One override per line, nothing else uncommented; the activation-checkpointing subcommand is no
    override (tyro reads it after every flag, and without it torchtitan checkpoints selectively), so
    the launch line in the header ends with it and a ``# subcommand:`` line names it."""
    command = f"activation-checkpoint:{s.recompute}"
    head = [f"torchtitan 0.3 command-line overrides for the dflop plan [{s.plan.describe()}]",
            f"({s.plan.llm.gpus} GPUs for the LLM; launch: torchrun ... -m torchtitan.train --module MODEL "
            f"--config CONFIG $(grep -v '^#' THIS_FILE) {command})",
            f"subcommand: {command}  (last on the command line; without it torchtitan 0.3 checkpoints selectively)"]
    return _comment(head) + [f"--{name}.{k} {_word(v, f'{name}.{k}')}" for name, fields in sections.items()
                             for k, v in fields.items()]


def _word(value: Any, field: str) -> str:
    """``value`` as one shell word: the launch line splits the file on whitespace and keeps quotes."""
    text = str(value)
    if not text or any(c.isspace() for c in text):
        raise DflopError(f"{field}: {text!r} cannot be one word of a torchtitan command line")
    return text


def torchtitan(s: Settings, version: TitanVersion = TitanVersion.V0_3) -> Export:
    plan = s.plan
    dp_fields, gaps = _titan_data_parallel(s)
    pp_fields, pp_gaps = _titan_pipeline(s, version)
    parallelism = {**dp_fields, "tensor_parallel_degree": plan.llm.tp, "pipeline_parallel_degree": plan.llm.pp,
                   **pp_fields}
    local = s.micro_batch * plan.microbatches
    training = {"local_batch_size": local, "global_batch_size": local * s.dp}
    gaps = _common_gaps(s, Target.TORCHTITAN) + gaps + pp_gaps
    if not s.fp32_grads:
        gaps.append("bf16 gradient reduction: torchtitan reduces gradients in float32")
    if plan.colocated:
        gaps.append("the vision encoder: torchtitan's parallelism covers the language model; dflop runs the "
                    f"encoder inside the first LLM stage with tp {plan.llm.tp}")
    elif plan.heterogeneous:
        gaps.append(_heterogeneous_gap(plan))
    else:
        gaps.append(f"disaggregated placement: the encoder's own {plan.encoder.gpus} GPUs "
                    f"({plan.encoder.describe()}) feeding the LLM's; torchtitan runs one model on one mesh")
    sections = {"parallelism": parallelism, "training": training}
    if version is TitanVersion.V0_2:
        lines = _titan_toml(s, sections)
        hook = "# return it from your TrainSpec's build_dataloader_fn(dp_world_size, dp_rank, ...)"
    else:
        lines = _titan_overrides(s, sections)
        hook = "# return it from the build() of your trainer config's dataloader (called with dp_world_size, dp_rank)"
    tail = _gaps_comment(Target.TORCHTITAN, gaps) + _sampler_comment(s, "dp_world_size", "dp_rank", hook)
    return Export(Target.TORCHTITAN, "\n".join(lines + _comment(tail)) + "\n", tuple(gaps))


def export_plan(plan: Plan, model: MLLMSpec, target: str | Target, *, global_batch: int,
                training: TrainingSpec | None = None, cluster: ClusterSpec | None = None,
                torchtitan_version: str | TitanVersion = TitanVersion.V0_3) -> Export:
    """The plan as ``target``'s launch arguments, with what the target cannot express (``cluster``:
    where HSDP's shard groups end; ``torchtitan_version``: which config surface to write for torchtitan)."""
    key = member(Target, target, "--to", "target")
    version = member(TitanVersion, torchtitan_version, "--torchtitan-version", "torchtitan version")
    s = settings(plan, model, global_batch=global_batch, training=training, cluster=cluster)
    return megatron(s) if key is Target.MEGATRON else torchtitan(s, version)
