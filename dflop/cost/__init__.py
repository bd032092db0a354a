"""Cost models: how long a pipeline stage takes on a microbatch, and what it holds in memory."""

from dflop.cost.analytical import AnalyticalCostModel
from dflop.cost.memory import StageMemory, stage_memory, stage_params, state_bytes
from dflop.cost.protocol import CostModel, StageCost, StageSpec, WorkShape
from dflop.cost.system import System

__all__ = ["AnalyticalCostModel", "StageMemory", "stage_memory", "stage_params", "state_bytes",
           "CostModel", "StageCost", "StageSpec", "WorkShape", "System"]
