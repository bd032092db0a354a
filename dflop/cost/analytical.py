"""The analytical cost model: FLOP counts, peak FLOP/s and an efficiency curve.

Time of one unit of work (one layer on one GPU) = FLOPs / (peak x efficiency),
the efficiency read from the hardware spec's curve at that unit's FLOPs, so
small microbatches run at a lower fraction of peak than large ones. Tensor
parallelism divides the FLOPs and adds, per layer, two all-reduces (or
reduce-scatter + all-gather with sequence parallelism) of the layer's
activations in forward and two in backward, over NVLink.

Backward: weight gradients cost one forward's matmuls (W); input gradients
cost another forward's matmuls plus 2.5x the attention (flash-attention's
backward recomputes the scores), plus the tensor-parallel communication (B).

Recomputation (the stage spec's): *full* keeps each layer's input only and
adds one forward to B, holding one layer's activations for a moment while it
recomputes them; *selective* drops the norms' outputs and the MLP activation's
output (a third of a layer's activations) and redoes them in B, which costs
memory traffic, not FLOPs (three passes over those bytes at HBM bandwidth).
The last LLM stage holds the fp32 logits until the backward and, for a moment,
their gradient; like the backend, it computes them only at the positions that
predict a text token (image tokens are inputs, never targets).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflop.cost import flops as F
from dflop.cost.comm import ring_allreduce_time
from dflop.cost.protocol import StageCost, StageSpec, WorkShape
from dflop.specs.hardware import HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module, Recompute

ATTENTION_BACKWARD_FACTOR = 2.5
UNCALIBRATED_ERROR = 0.2
"""Per-sample relative cost error assumed for this model (not calibrated on any GPU): a stated
assumption, the size of per-sample error the profiled CPU models show on their worst shapes."""
ELEMENTWISE_PASSES = 3
"""Memory passes of recomputing an elementwise op: read its input(s), write its output."""


@dataclass(frozen=True)
class AnalyticalCostModel:
    model: MLLMSpec
    hardware: HardwareSpec
    training: TrainingSpec

    @property
    def name(self) -> str:
        return f"analytical ({self.hardware.name})"

    def _seconds(self, flops: np.ndarray) -> np.ndarray:
        return self.hardware.compute_time(flops)

    def _tp_comm(self, elements: np.ndarray, tp: int) -> np.ndarray:
        """Two collectives over a layer's activations, once per direction."""
        hw = self.hardware
        nbytes = elements * self.training.activation_bytes
        return 2.0 * ring_allreduce_time(nbytes, tp, hw.intra_node_bandwidth, hw.intra_node_latency)

    def tp_comm(self, stage: StageSpec, shape: WorkShape) -> np.ndarray:
        """Seconds of tensor-parallel communication in one direction (forward or backward) of a stage."""
        if stage.module == Module.ENCODER:
            elements = np.asarray(shape.tiles, dtype=float) * self.model.encoder.patches_per_tile * \
                self.model.encoder.hidden
        else:
            elements = np.asarray(shape.tokens, dtype=float) * self.model.llm.hidden
        return stage.layers * self._tp_comm(elements, stage.tp)

    def _layers(self, stage: StageSpec, layer: F.LayerFlops, hidden_elements: np.ndarray,
                act_elements: np.ndarray, selective_elements: np.ndarray) -> StageCost:
        tp, n = stage.tp, stage.layers
        gemm, attention = layer.gemm / tp, layer.attention / tp
        seconds_per_flop = np.where(gemm + attention > 0,
                                    self._seconds(gemm + attention) / np.maximum(gemm + attention, 1.0),
                                    0.0)
        t_gemm, t_attn = gemm * seconds_per_flop, attention * seconds_per_flop
        comm = self._tp_comm(hidden_elements, tp)
        fwd = t_gemm + t_attn + comm
        bwd_input = t_gemm + ATTENTION_BACKWARD_FACTOR * t_attn + comm
        b = self.training.activation_bytes
        transient, redo_flops = 0.0 * fwd, 0.0 * fwd
        if stage.recompute is Recompute.FULL:
            bwd_input = bwd_input + fwd
            act, transient, redo_flops = n * hidden_elements * b / tp, act_elements * b / tp, n * (gemm + attention)
        elif stage.recompute is Recompute.SELECTIVE:
            redone = selective_elements * b / tp
            bwd_input = bwd_input + ELEMENTWISE_PASSES * redone / self.hardware.hbm_bandwidth
            act, transient = n * (act_elements * b / tp - redone), redone
        else:
            act = n * act_elements * b / tp
        return StageCost(n * fwd, n * bwd_input, n * t_gemm, act, n * (gemm + attention), transient, redo_flops)

    def _extra(self, flops: np.ndarray, tp: int, act_bytes: np.ndarray, transient: Any = 0.0) -> StageCost:
        """A fixed part (embedding side or output side) done once per microbatch."""
        t = self._seconds(flops / tp)
        return StageCost(t, t, t, act_bytes, flops / tp, transient)

    def fsdp_unit(self, shards: int) -> None:
        """Never measured: a sharded plan's collectives are modelled from their bytes (``dpcomm``)."""
        return None

    def stage_cost(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        if stage.module == Module.ENCODER:
            return self._encoder(stage, shape)
        return self._llm(stage, shape)

    def _llm(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        llm, b, tp = self.model.llm, self.training.activation_bytes, stage.tp
        tokens = np.asarray(shape.tokens, dtype=float)
        layer = F.llm_layer_flops(llm, tokens, np.asarray(shape.sum_sq, dtype=float))
        cost = self._layers(stage, layer, tokens * llm.hidden, F.llm_layer_activation_elements(llm, tokens),
                            F.llm_layer_selective_elements(llm, tokens))
        if stage.last:
            # Head input (bf16) and fp32 logits for the loss, of the positions that predict text,
            # vocabulary split over TP; the logits' gradient (fp32, same size) exists for a moment
            # at the start of the backward.
            rows = np.asarray(shape.head_rows, dtype=float)
            logits = rows * llm.vocab * 4.0 / tp
            act = rows * llm.hidden * b / tp + logits
            cost = cost + self._extra(F.llm_head_flops(llm, rows), tp, act, logits)
        return cost

    def _encoder(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        enc, b, tp = self.model.encoder, self.training.activation_bytes, stage.tp
        tiles = np.asarray(shape.tiles, dtype=float)
        layer = F.vit_layer_flops(enc, tiles, np.asarray(shape.samples, dtype=float))
        cost = self._layers(stage, layer, tiles * enc.patches_per_tile * enc.hidden,
                            F.vit_layer_activation_elements(enc, tiles), F.vit_layer_selective_elements(enc, tiles))
        if stage.first:
            pixels = tiles * enc.patches_per_tile * 3 * enc.patch_size**2 * b / tp
            cost = cost + self._extra(F.vit_embedding_flops(enc, tiles), tp, pixels)
        if stage.last:
            act = F.projector_activation_elements(self.model, tiles) * b / tp
            cost = cost + self._extra(F.projector_flops(self.model, tiles), tp, act)
        return cost
