"""Per-GPU memory of one pipeline stage: model state plus activations in flight.

Model state per parameter follows the training spec's byte counts (16 bytes
for mixed-precision Adam by default: 2 weights + 2 gradients + 12 optimizer),
divided by tensor parallelism, then by data parallelism as the ZeRO stage
shards it:

- ZeRO-0: nothing sharded (16 bytes; 18 with fp32 gradient buffers);
- ZeRO-1: optimizer state sharded: 4 + 12/d (Megatron's distributed optimizer
  with fp32 gradient buffers: 6 + 12/d);
- ZeRO-2: gradients sharded too, plus one bucket of unsharded gradients;
- ZeRO-3: weights sharded too, plus what FSDP holds unsharded while it works:
  the root's parameters (embeddings, head, projector), two layers' weights
  (the one computing and the one prefetched) and one layer's gradients.

Activations are the bytes each in-flight microbatch keeps until its backward,
times the number the pipeline schedule keeps in flight on that stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflop.cost import flops as F
from dflop.cost.protocol import StageSpec
from dflop.specs.hardware import TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Strategy


@dataclass(frozen=True)
class StageMemory:
    params: float
    """Parameters held by this stage's TP group (before sharding)."""
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations


def stage_params(model: MLLMSpec, stage: StageSpec) -> int:
    """Parameters of a stage (whole TP group)."""
    if stage.module == Module.ENCODER:
        n = stage.layers * F.vit_layer_params(model.encoder)
        if stage.first:
            n += F.vit_embedding_params(model.encoder)
        if stage.last:
            n += F.projector_params(model)
        return n
    llm = model.llm
    n = stage.layers * F.llm_layer_params(llm)
    if stage.first:
        n += F.llm_embedding_params(llm)
    if stage.last:
        shared = llm.tie_embeddings and stage.first
        n += llm.hidden if shared else F.llm_head_params(llm)
    return n


def frozen_params(model: MLLMSpec, training: TrainingSpec, strategy: Strategy, module: str,
                  layers: tuple[int, ...], stages: tuple[int, ...]) -> float:
    """Parameters of the pipeline rank holding ``stages`` of ``module`` (split into ``layers`` per
    stage) that do not train: a frozen encoder's, whole on its own stages or inside a colocated LLM's
    first."""
    if not training.freeze_encoder:
        return 0.0
    if module == Module.ENCODER:
        return float(sum(stage_params(model, StageSpec.of(module, layers, s, 1)) for s in stages))
    if strategy.carries_encoder(module, stages):
        return float(stage_params(model, StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True)))
    return 0.0


FP32_GRAD_BYTES = 4


def grad_bytes(training: TrainingSpec, fp32_grads: bool) -> int:
    """Bytes of one gradient as accumulated and reduced."""
    return FP32_GRAD_BYTES if fp32_grads else training.grad_bytes


def state_bytes(params: float, tp: int, dp: int, zero: int, training: TrainingSpec,
                largest_layer_params: float = 0.0, *, fp32_grads: bool = False,
                root_params: float = 0.0, frozen: float = 0.0) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per GPU; ``dp`` is the sharding degree (the shard group of
    hybrid sharding); ``root_params`` stay unsharded through a ZeRO-3 step; ``frozen`` of the
    ``params`` hold weights alone (a frozen encoder)."""
    per_gpu = params / tp
    gb = grad_bytes(training, fp32_grads)
    weights = per_gpu * training.weight_bytes
    grads = (params - frozen) / tp * gb
    optimizer = (params - frozen) / tp * training.optimizer_bytes
    strategy = Strategy(zero=zero)
    if strategy.shards_optimizer:
        optimizer /= dp
    if strategy.reduces_every_backward:  # the gradients of one bucket stay whole until reduced
        grads = grads / dp + min(training.bucket_params, params - frozen) / tp * gb
    if strategy.shards_parameters:
        weights = weights / dp + (root_params + 2 * largest_layer_params) / tp * training.weight_bytes
        grads = grads / dp + (largest_layer_params / tp * gb if params > frozen else 0.0)
    return weights, grads, optimizer


def layer_params(model: MLLMSpec, module: Module) -> int:
    return F.vit_layer_params(model.encoder) if module == Module.ENCODER else F.llm_layer_params(model.llm)


def stage_memory(model: MLLMSpec, stage: StageSpec, *, dp: int, zero: int, training: TrainingSpec,
                 act_bytes_per_microbatch: float, inflight: int) -> StageMemory:
    params = stage_params(model, stage)
    layer = layer_params(model, stage.module)
    weights, grads, optimizer = state_bytes(params, stage.tp, dp, zero, training, layer,
                                            root_params=params - stage.layers * layer)
    return StageMemory(params, weights, grads, optimizer, act_bytes_per_microbatch * inflight)
