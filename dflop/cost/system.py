"""The system a plan runs on: the four things every costed step needs together."""

from __future__ import annotations

from dataclasses import dataclass

from dflop.cost.frozen import FrozenEncoder, priced_by
from dflop.cost.protocol import CostModel
from dflop.specs.hardware import ClusterSpec, HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec


@dataclass(frozen=True)
class System:
    """A model on a cluster, trained with a recipe, its work priced by a cost model.

    Plans, step graphs and schedules are judged against one of these; bundling them
    keeps every caller from passing (and mismatching) four arguments."""

    model: MLLMSpec
    cluster: ClusterSpec
    training: TrainingSpec
    cost: CostModel

    def __post_init__(self) -> None:
        """The recipe decides what the encoder costs: a frozen one's stages price forward only."""
        base = priced_by(self.cost)  # (a system replaced with another recipe re-prices its model's)
        object.__setattr__(self, "cost", FrozenEncoder(base) if self.training.freeze_encoder else base)

    @property
    def hardware(self) -> HardwareSpec:
        return self.cluster.hardware
