"""FSDP2's units priced from measurements: the records and their fit, the units of a pipeline rank,
and what a sharded plan's ops take with them (inside the op, after its compute)."""

import numpy as np
import pytest

from dflop.cost import AnalyticalCostModel, System
from dflop.cost.profiled import UnitFit, fit, fsdp_unit_fits, off_their_neighbours
from dflop.cost.select import select_cost_model
from dflop.cost.store import FSDP_UNIT, shipped_records
from dflop.timing.costing import group_state
from dflop.timing.dpcomm import group_comm, rank_units
from dflop.timing.evaluate import evaluate
from dflop.timing.steps import CostedPlan
from dflop.sim import execute
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import profile_mix

TINY = presets.model("tiny-vit", "tiny-llm")
CPU = ClusterSpec(hardware=presets.hardware("cpu"), nodes=1, gpus_per_node=4)
TRAINING = TrainingSpec(global_batch=16)
GATHER_MS, REDUCE_MS = 1.0, 2.0


class UnitsMeasured(AnalyticalCostModel):
    """The analytical model, with every unit's FSDP2 collectives measured at fixed times."""

    def __init__(self, *args, cost: tuple[float, float] = (GATHER_MS, REDUCE_MS)) -> None:
        super().__init__(*args)
        self.unit = UnitFit((cost[0], 0.0), (cost[1], 0.0))

    def fsdp_unit(self, shards: int) -> UnitFit:
        return self.unit


def unit_record(params: int, gather: float, reduce: float, shards: int = 2) -> dict:
    return {"device": "cpu", "module": "llm", "model": "tiny-llm", "dtype": "float32", "tp": 1,
            "phase": FSDP_UNIT, "shape": {"params": params, "shards": shards}, "fwd_ms": gather, "bwd_ms": reduce,
            "memory_bytes": 0.0}


def test_unit_records_fit_a_line_per_shard_count_and_stay_out_of_the_compute_fits():
    records = [unit_record(p, 0.5 + 1e-5 * p, 1.0 + 2e-5 * p) for p in (10_000, 100_000, 200_000)]
    records.append(unit_record(100_000, 9.0, 9.0, shards=4))
    fits = fsdp_unit_fits(records)
    gather, reduce = fits[2](150_000)
    assert gather == pytest.approx(2.0e-3) and reduce == pytest.approx(4.0e-3)
    assert fits[4](1) == pytest.approx((9e-3, 9e-3))  # one size: its median, whatever the unit
    assert fit(records) == {} and off_their_neighbours(records) == []


def test_the_shipped_profile_prices_units_sharded_over_two_processes():
    cost, _ = select_cost_model(TINY, CPU.hardware, TRAINING)
    assert cost.fsdp_unit(4) is None  # never measured over four: modelled from bytes
    gather, reduce = cost.fsdp_unit(2)(200_000)
    assert 0.2e-3 < gather < 20e-3 and 0.2e-3 < reduce < 20e-3
    units = [r for r in shipped_records() if r["phase"] == FSDP_UNIT]
    assert {r["module"] for r in units} == {"encoder", "llm"} and {r["shape"]["shards"] for r in units} == {2}


@pytest.mark.parametrize("plan", [
    Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=2),
    Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), placement="colocated", microbatches=4),
    Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), placement="disaggregated", microbatches=4),
    Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), placement="colocated", microbatches=4,
         schedule="Interleaved1F1B", virtual_stages=2),
])
def test_a_ranks_units_hold_its_parameters(plan):
    runner = CostedPlan(plan, System(TINY, CPU, TRAINING, AnalyticalCostModel(TINY, CPU.hardware, TRAINING)))
    layers = {m: plan.stage_layers(m, TINY) for m in ("encoder", "llm")}
    for g in runner.builder.t.groups:
        units = rank_units(plan, TINY, g.module, g.stages)
        params, _ = group_state(plan, TINY, TRAINING, layers, g.module, g.stages, g.tp, CPU.gpus_per_node)
        assert sum(p for _, p in units) == pytest.approx(params) and min(p for _, p in units) >= 0
        kinds = [kind for kind, _ in units]
        encoder_too = g.module == "llm" and plan.colocated and 0 in g.stages
        blocks = {g.module: sum(layers[g.module][s] for s in g.stages)} | (
            {"encoder": TINY.encoder.layers} if encoder_too else {})
        assert {k: kinds.count(k) for k in ("encoder", "llm") if k in kinds} == blocks
        assert kinds.count("root") == len(g.stages) + encoder_too


@pytest.mark.parametrize("zero,per_microbatch", [
    (2, lambda n: n * (GATHER_MS + REDUCE_MS)),      # every backward: the units' reduce-scatters and re-gathers
    (3, lambda n: n * (2 * GATHER_MS + REDUCE_MS) - 2 * GATHER_MS),  # a gather each way and a reduce-scatter back,
    # but the two roots (the encoder's and the LLM's rest) stay gathered from their forward to their backward
])
def test_measured_units_lengthen_every_op_by_what_was_measured(zero, per_microbatch):
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=3, zero=zero)
    batch = profile_mix("llava-ov", 200, TINY.encoder).samples.take(np.arange(16))
    assignment = np.arange(16) % plan.bins
    args = (TINY, CPU.hardware, TRAINING)

    def step(cost):
        s = CostedPlan(plan, System(TINY, CPU, TRAINING, cost)).step(0, batch, assignment)
        fast = evaluate(s.timing).step_ns
        assert fast == execute(s.graph, s.costs, contention=False).makespan  # the evaluators agree
        return fast

    free = step(UnitsMeasured(*args, cost=(0.0, 0.0)))
    units = 8  # each block, the LLM's rest and the encoder's
    assert step(UnitsMeasured(*args)) - free == pytest.approx(plan.microbatches * per_microbatch(units) * 1e6, abs=10)
    assert step(AnalyticalCostModel(*args)) != step(UnitsMeasured(*args))


def test_a_tensor_parallel_ranks_blocks_are_priced_as_shards_and_its_roots_whole():
    plan = Plan(encoder=ModulePlan(tp=2, dp=2), llm=ModulePlan(tp=2, dp=2), placement="colocated", microbatches=2,
                zero=2)
    cost = UnitsMeasured(TINY, CPU.hardware, TRAINING)
    cost.unit = UnitFit((0.0, 1e-5), (0.0, 0.0))  # 1e-5 ms a parameter gathered, nothing else
    units = rank_units(plan, TINY, "llm", (0,))
    comm = group_comm(plan, TINY, TRAINING, CPU, sum(p for _, p in units), 2, [0, 2], "llm", (0,), cost)
    blocks = sum(p for kind, p in units if kind != "root")
    roots = sum(p for kind, p in units if kind == "root")  # embeddings, head, projector: replicated over TP
    assert comm.inline and comm.reduce == pytest.approx((blocks / 2 + roots) * 1e-8)
