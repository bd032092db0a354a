"""The system a plan runs on: the four things every costed step needs together."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def hardware(self) -> HardwareSpec:
        return self.cluster.hardware
