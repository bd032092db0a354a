"""The SimPy simulator of pipeline programs (installed as dflop.sim)."""

from dflop.sim.engine import Execution, execute
from dflop.sim.pipeline import PipelineResult, simulate_pipeline

__all__ = ["Execution", "execute", "PipelineResult", "simulate_pipeline"]
