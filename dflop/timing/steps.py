"""One plan on one system, step after step: the single path from a schedule to a costed step graph.

Every consumer (the optimizer's fast evaluator, the SimPy backend, the torch
backend's prediction, the correction study) asks a ``CostedPlan`` for the
same three things per step: the cost model's numbers (``timing``), the
cost-free step graph both runtimes execute (``graph``), and the graph's costs
(``costs``). What differs between them is only how the step is executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflop.cost.system import System
from dflop.timing.costing import TimingBuilder, StepTiming
from dflop.timing.costs import StepCosts, graph_costs
from dflop.program.lowering import lower_step
from dflop.program.stepgraph import StepGraph
from dflop.program.template import Template, build_template
from dflop.specs.plan import Plan
from dflop.workload.sample import SampleTable


@dataclass
class Step:
    """One global batch of one plan, partitioned into bins, costed and (lazily) lowered."""

    index: int
    batch: SampleTable
    assignment: np.ndarray
    """Bin ``r * microbatches + k`` of every sample of the batch (LLM replica r, microbatch k)."""
    timing: StepTiming
    runner: "CostedPlan" = field(repr=False)
    _graph: StepGraph | None = field(default=None, repr=False)
    _costs: StepCosts | None = field(default=None, repr=False)

    @property
    def graph(self) -> StepGraph:
        if self._graph is None:
            self._graph = self.runner.lower(self.batch, self.assignment)
        return self._graph

    @property
    def costs(self) -> StepCosts:
        if self._costs is None:
            self._costs = graph_costs(self.graph, self.timing)
        return self._costs


class CostedPlan:
    """The template, layer split, links and model state of one plan are built once here."""

    def __init__(self, plan: Plan, system: System, template: Template | None = None) -> None:
        self.plan, self.system = plan, system
        self.template = template or build_template(plan, frozen_encoder=system.training.freeze_encoder)
        if self.template.frozen_encoder != system.training.freeze_encoder:
            raise ValueError("the template's frozen encoder is not the recipe's (build_template(frozen_encoder=))")
        self.builder = TimingBuilder(self.template, system)

    def step(self, index: int, batch: SampleTable, assignment: np.ndarray) -> Step:
        assignment = np.asarray(assignment, dtype=np.int64)
        return Step(index, batch, assignment, self.builder.timing(batch, assignment), self)

    def lower(self, batch: SampleTable, assignment: np.ndarray) -> StepGraph:
        return lower_step(self.template, batch, assignment)
