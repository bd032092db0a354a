"""The scheduler in the simulator: data-aware bins beat data-blind ones; correction learns."""

import numpy as np
import pytest

from dflop.cost import AnalyticalCostModel, System
from dflop.jobs.experiments import correction_study, inflate
from dflop.timing.evaluate import evaluate
from dflop.timing.steps import CostedPlan
from dflop.schedule.slots import ORDERS, slot_bins
from dflop.schedule.step import StepSchedule, plan_costs, schedule_batch
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import batches, profile_mix

MODEL = presets.model("siglip-so400m", "qwen2.5-7b")
CLUSTER = ClusterSpec(hardware=presets.hardware("h100"), nodes=2, gpus_per_node=8)
TRAINING = TrainingSpec(global_batch=128, recompute="full")
COST = AnalyticalCostModel(MODEL, CLUSTER.hardware, TRAINING)
SYSTEM = System(MODEL, CLUSTER, TRAINING, COST)
PLANS = [
    Plan(encoder=ModulePlan(tp=1, pp=1, dp=4), llm=ModulePlan(tp=4, pp=1, dp=3), microbatches=8, recompute="full"),
    Plan(encoder=ModulePlan(tp=2, dp=4), llm=ModulePlan(tp=2, pp=2, dp=4), microbatches=8, placement="colocated",
         recompute="full"),
]


@pytest.mark.parametrize("mix", ["llava-ov", "image-heavy", "video-heavy"])
@pytest.mark.parametrize("plan", PLANS, ids=["disaggregated", "colocated"])
def test_data_aware_bins_cut_the_step_time(mix, plan):
    data = profile_mix(mix, 4000, MODEL.encoder, seed=2).samples
    runner = CostedPlan(plan, SYSTEM)
    stream = batches(data, 128, seed=5)
    blind, aware = [], []
    for _ in range(3):
        batch = next(stream)
        costs = plan_costs(batch, plan, MODEL, COST)
        for solver, out in (("sequential", blind), ("auto", aware)):
            schedule = schedule_batch(batch, plan, costs=costs, solver=solver, time_limit=0.2)
            out.append(evaluate(runner.step(0, batch, schedule.assignment).timing).step_ns)
    assert np.mean(aware) < 0.97 * np.mean(blind)


def test_slots_are_a_permutation_and_the_evaluator_picks_the_fastest_order():
    rng = np.random.default_rng(0)
    loads = rng.uniform(1, 2, size=(12, 2))
    timed = {}

    def evaluate_order(slot):
        value = float(slot @ np.arange(12))  # any deterministic function of the slots
        timed[tuple(slot)] = value
        return value

    slot, used = slot_bins(loads, 3, 4, encoder_dim=0, evaluate=evaluate_order)
    assert sorted(slot) == list(range(12)) and used in ORDERS
    assert len(timed) == len(ORDERS) and evaluate_order(slot) == min(timed.values())


def test_schedule_json_round_trip():
    data = profile_mix("llava-ov", 200, MODEL.encoder).samples
    batch = data.take(np.arange(64))
    plan = PLANS[0]
    schedule = schedule_batch(batch, plan, costs=plan_costs(batch, plan, MODEL, COST), solver="lpt")
    again = StepSchedule.from_json(schedule.to_json())
    assert again.bins() == schedule.bins()
    assert (again.aligned(batch) == schedule.assignment).all()


def test_inflating_a_modality_slows_only_those_samples():
    data = profile_mix("llava-ov", 300, MODEL.encoder).samples
    slow = inflate(data, {"video": 1.5})
    video = data.modality == 3
    assert (slow.tiles[video] >= data.tiles[video]).all() and (slow.tiles[~video] == data.tiles[~video]).all()


def test_correction_approaches_the_oracle():
    data = profile_mix("llava-ov", 6000, MODEL.encoder, seed=0).samples
    plan = PLANS[0]
    # A deterministic partitioner: the ILP under a time limit returns whatever it reached in that
    # time, so the bins, the observations and the learned ratios would follow the machine's speed.
    study = correction_study(plan=plan, system=SYSTEM, batches=batches(data, 128, seed=3), steps=12,
                             slowdown={"video": 1.3}, solver="kk")
    skip = 6  # after the warm-up and the first decision
    predicted, corrected, oracle = (study.mean(m, skip) for m in ("predicted", "corrected", "oracle"))
    assert predicted > oracle * 1.003                      # trusting the predictions costs time
    assert corrected - oracle < 0.5 * (predicted - oracle)  # correcting recovers most of it
    assert any(study.enabled) and not study.enabled[0]
    video = study.ratios["llm"][-3:]
    assert min(video) > 1.05 > max(study.ratios["llm"][:3])  # it found the slow bucket
