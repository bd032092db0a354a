"""Per-GPU memory of one pipeline stage: model state plus activations in flight.

Model state per parameter follows the training spec's byte counts (16 bytes
for mixed-precision Adam by default), divided by tensor parallelism, and the
optimizer state (ZeRO-1) or everything (ZeRO-3 / FSDP) further divided by
data parallelism. ZeRO-3 also holds two layers' full weights while gathering.
Activations are the bytes each in-flight microbatch keeps until its backward,
times the number the pipeline schedule keeps in flight on that stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflop.cost import flops as F
from dflop.cost.protocol import StageSpec
from dflop.specs.hardware import TrainingSpec
from dflop.specs.models import MLLMSpec


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
    if stage.module == "encoder":
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


def state_bytes(params: float, tp: int, dp: int, zero: int, training: TrainingSpec,
                largest_layer_params: float = 0.0) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes per GPU."""
    per_gpu = params / tp
    weights = per_gpu * training.weight_bytes
    grads = per_gpu * training.grad_bytes
    optimizer = per_gpu * training.optimizer_bytes
    if zero >= 1:
        optimizer /= dp
    if zero >= 3:
        weights = weights / dp + 2 * largest_layer_params / tp * training.weight_bytes
        grads /= dp
    return weights, grads, optimizer


def stage_memory(model: MLLMSpec, stage: StageSpec, *, dp: int, zero: int, training: TrainingSpec,
                 act_bytes_per_microbatch: float, inflight: int) -> StageMemory:
    params = stage_params(model, stage)
    layer = (F.vit_layer_params(model.encoder) if stage.module == "encoder"
             else F.llm_layer_params(model.llm))
    weights, grads, optimizer = state_bytes(params, stage.tp, dp, zero, training, layer)
    return StageMemory(params, weights, grads, optimizer, act_bytes_per_microbatch * inflight)
