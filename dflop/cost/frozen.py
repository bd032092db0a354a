"""A cost model for a recipe with a frozen encoder: the same prices, its stages forward only.

Frozen weights need no gradient, and pixels need none either, so a frozen encoder's forward
builds no autograd graph: it keeps no activations and has no backward (nor any recomputation
of one). Wrapping the cost model keeps that fact in one place for every caller that prices an
encoder stage (scheduler, screener, step costing, the heterogeneous phase)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dflop.cost.protocol import CostModel, StageCost, StageSpec, WorkShape
from dflop.specs.plan import Module, Recompute


@dataclass(frozen=True)
class FrozenEncoder:
    """``inner``'s costs, an encoder stage's forward alone."""

    inner: CostModel

    @property
    def model(self) -> Any:
        return self.inner.model

    @property
    def name(self) -> str:
        return f"{self.inner.name}, frozen encoder"

    def stage_cost(self, stage: StageSpec, shape: WorkShape) -> StageCost:
        if stage.module != Module.ENCODER:
            return self.inner.stage_cost(stage, shape)
        c = self.inner.stage_cost(StageSpec(stage.module, stage.layers, stage.tp, stage.first, stage.last,
                                            Recompute.NONE), shape)
        zero = 0.0 * c.fwd
        return StageCost(c.fwd, zero, zero, zero, c.flops, zero, untrained_flops=c.flops,
                         forward_transient_bytes=c.act_bytes / max(stage.layers, 1))

    def fsdp_unit(self, shards: int) -> Callable[[float], tuple[float, float]] | None:
        return self.inner.fsdp_unit(shards)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inner", priced_by(self.inner))  # wrapped once, however often asked

    def __getattr__(self, name: str) -> Any:  # what a particular model offers besides (profile, drift)
        if name == "inner" or name.startswith("__"):  # (not set yet: copying, unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)


def priced_by(cost: CostModel) -> CostModel:
    """The model that measured or derived ``cost``'s prices (what a profile check or a calibration
    looks at), under a recipe's wrapper."""
    return cost.inner if isinstance(cost, FrozenEncoder) else cost
