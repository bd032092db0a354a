"""The cost-model protocol every cost model implements (analytical, profiled, corrected).

A cost model answers one question: how long does one pipeline stage of one
module take, forward and backward, on one microbatch of a given shape, and
how many activation bytes does it keep until its backward. Everything above
(scheduler, simulator, optimizer) asks only this question, so any model that
answers it can drive them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Recompute
from dflop.workload.sample import SampleTable

Array = Any


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage of one module on one tensor-parallel group."""

    module: Module
    layers: int
    tp: int = 1
    first: bool = False
    """Holds the input side: patch embedding (encoder) or token embedding (LLM)."""
    last: bool = False
    """Holds the output side: projector (encoder) or final norm, LM head and loss (LLM)."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation of its layers (the plan's)."""

    @classmethod
    def of(cls, module: Module, layers: tuple[int, ...], stage: int, tp: int,
           recompute: Recompute = Recompute.NONE) -> "StageSpec":
        """Stage ``stage`` of a module split into ``layers`` per stage."""
        return cls(module, layers[stage], tp, first=stage == 0, last=stage == len(layers) - 1,
                   recompute=Recompute(recompute))


@dataclass(frozen=True)
class WorkShape:
    """The shape of one microbatch (fields may be numpy arrays: many microbatches at once)."""

    samples: Array = 0
    tiles: Array = 0
    """Vision tiles (encoder sequences)."""
    tokens: Array = 0
    """LLM tokens, packed."""
    sum_sq: Array = 0
    """Sum over samples of squared LLM lengths (attention grows with each sample's own length)."""
    targets: Array | None = None
    """LLM positions that predict a text token (``SampleTable.targets``): the rows the LM head and
    the loss run on. None: every LLM token, the upper bound for a shape built without the split."""

    @property
    def head_rows(self) -> Array:
        return self.tokens if self.targets is None else self.targets

    @classmethod
    def per_sample(cls, batch: SampleTable) -> "WorkShape":
        """The shape of each sample of ``batch`` on its own (arrays, one entry per sample)."""
        t = batch.llm_tokens.astype(float)
        return cls(np.ones_like(t), batch.tiles.astype(float), t, t * t, batch.targets.astype(float))

    def total(self, parts: float = 1.0) -> "WorkShape":
        """Every entry together in one microbatch, or shared evenly among ``parts`` of them."""
        targets = None if self.targets is None else np.sum(self.targets) / parts
        return WorkShape(np.sum(self.samples) / parts, np.sum(self.tiles) / parts, np.sum(self.tokens) / parts,
                         np.sum(self.sum_sq) / parts, targets)

    def __add__(self, other: "WorkShape") -> "WorkShape":
        targets = None if self.targets is None and other.targets is None else np.add(self.head_rows, other.head_rows)
        return WorkShape(np.add(self.samples, other.samples), np.add(self.tiles, other.tiles),
                         np.add(self.tokens, other.tokens), np.add(self.sum_sq, other.sum_sq), targets)


@dataclass(frozen=True)
class StageCost:
    """Seconds and bytes of one stage on one microbatch (fields broadcast like the shape)."""

    fwd: Array
    bwd_input: Array
    """Backward through the inputs (B in zero-bubble schedules)."""
    bwd_weight: Array
    """Weight gradients (W in zero-bubble schedules)."""
    act_bytes: Array
    """Activation bytes kept from forward until backward."""
    flops: Array
    """Forward FLOPs (for utilisation figures)."""
    transient_bytes: Array = 0.0
    """Bytes held for a moment on top of the kept activations during the backward: the logits'
    gradient of the loss, one layer's recomputed activations."""
    recompute_flops: Array = 0.0
    """FLOPs the backward spends recomputing the forward (hardware FLOPs beyond the model's)."""
    untrained_flops: Array = 0.0
    """Of ``flops``, those with no backward (a frozen encoder's): every other forward FLOP's backward
    runs twice as many."""
    forward_transient_bytes: Array = 0.0
    """Bytes held for a moment during the forward beyond the kept activations: a forward without
    autograd (a frozen encoder) holds one layer's at a time, and keeps none."""

    @property
    def backward_flops(self) -> Array:
        return 2.0 * (self.flops - self.untrained_flops)

    @property
    def bwd(self) -> Array:
        return self.bwd_input + self.bwd_weight

    def __add__(self, other: "StageCost") -> "StageCost":
        """Two parts of one stage: times, kept bytes and FLOPs add up; the transient peaks do not,
        since the parts' backwards run one after the other."""
        return StageCost(self.fwd + other.fwd, self.bwd_input + other.bwd_input,
                         self.bwd_weight + other.bwd_weight, self.act_bytes + other.act_bytes,
                         self.flops + other.flops, np.maximum(self.transient_bytes, other.transient_bytes),
                         self.recompute_flops + other.recompute_flops,
                         self.untrained_flops + other.untrained_flops,
                         np.maximum(self.forward_transient_bytes, other.forward_transient_bytes))

    def backward_in_weight_step(self, where: Array = True) -> "StageCost":
        """The stage with nothing to send upstream (its inputs need no gradient) where ``where``
        holds: its input-gradient step (I) is empty and its weight step (W) runs the whole
        backward, as torch.distributed.pipelining runs a first stage."""
        return replace(self, bwd_input=np.where(where, 0.0, self.bwd_input),
                       bwd_weight=np.where(where, self.bwd, self.bwd_weight))

    def scaled(self, factor: Array) -> "StageCost":
        """Time scaled by ``factor`` (bytes and FLOPs unchanged)."""
        return StageCost(self.fwd * factor, self.bwd_input * factor, self.bwd_weight * factor,
                         self.act_bytes, self.flops, self.transient_bytes, self.recompute_flops, self.untrained_flops,
                         self.forward_transient_bytes)


@runtime_checkable
class CostModel(Protocol):
    model: MLLMSpec

    @property
    def name(self) -> str:
        """Which model this is, for reports ("analytical h100", "profiled cpu", ...)."""

    def stage_cost(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        """Cost of ``stage`` on microbatch(es) of ``shape``."""

    def fsdp_unit(self, shards: int) -> Callable[[float], tuple[float, float]] | None:
        """(all-gather, reduce-scatter) seconds FSDP2 adds to a unit of so many parameters sharded
        over ``shards`` ranks, where measured (None: the collectives are modelled from bytes)."""
