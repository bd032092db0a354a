import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.errors import InfeasibleError
from dflop.plan.evaluate import Estimate, PlanningProblem
from dflop.plan.search import Optimizer, optimize
from dflop.plan.space import DFLOP, MEGATRON, PYTORCH, SpaceBuilder
from dflop.plan.split import balanced_split
from dflop.program.steps import StepRunner
from dflop.sim.simulate import simulate_steps
from dflop.specs import ClusterSpec, TrainingSpec, presets
from dflop.workload import profile_mix


def problem_for(encoder, llm, gpus, batch, mix="llava-ov"):
    model = presets.model(encoder, llm)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
    training = TrainingSpec(global_batch=batch, recompute="full")
    data = profile_mix(mix, 5000, model.encoder, seed=1).samples
    return PlanningProblem(System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training)),
                           data)


@pytest.mark.parametrize("encoder,llm", [("siglip-so400m", "qwen2.5-7b"), ("siglip-so400m", "llama-3-8b"),
                                         ("internvit-300m", "qwen2.5-7b")])
def test_optimizer_choice_is_the_exhaustive_best(encoder, llm):
    problem = problem_for(encoder, llm, 8, 64)
    fast = Optimizer(problem, 64, first=3, most=3).search(DFLOP)
    full = Optimizer(problem, 64, first=3, most=3, exhaustive=True).search(DFLOP)
    assert fast.best.plan == full.best.plan
    assert fast.best.mean == pytest.approx(full.best.mean)
    # and exhaustively, nothing evaluated beats the choice
    assert all(e.mean >= full.best.mean for e in full.ranked)


def test_bounds_never_exceed_evaluated_times():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 64)
    opt = Optimizer(problem, 64, first=2, most=2, exhaustive=True)
    builder = SpaceBuilder(problem, 64)
    rng = np.random.default_rng(0)
    for placement in ("colocated", "disaggregated"):
        plans = list(builder.plans(DFLOP, placement))
        for i in rng.choice(len(plans), size=min(12, len(plans)), replace=False):
            plan = plans[i]
            screen = opt.screener.screen(plan, True)
            e = opt.ev.extend(Estimate(plan, True, screen.bound), 2)
            assert e.mean >= screen.bound * (1 - 1e-9)
            if placement == "disaggregated":
                assert opt.split_bound(plan.encoder.gpus) <= screen.bound * (1 + 1e-9)


def test_chosen_plan_does_not_run_out_of_memory_in_the_simulator():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 16, 128)
    opt = Optimizer(problem, 128, first=2, most=2, budget=16)
    result = opt.search(DFLOP)
    plan = result.best.plan
    batches = [opt.pool[i] for i in range(2)]
    sim = simulate_steps(StepRunner(plan, problem.system), batches, lambda i, b: opt.ev.assignment(plan, b, True)[0])
    assert sim.metrics.oom == []
    assert max(sim.metrics.peak_memory_gib) * 2**30 <= problem.cluster.hardware.usable_memory_bytes


def test_too_small_cluster_names_the_smallest_shortfall():
    problem = problem_for("siglip-so400m", "qwen2.5-72b", 1, 8)
    with pytest.raises(InfeasibleError, match=r"no dflop plan fits 1 x H100.*needs [0-9.]+ GiB on its llm "
                                              r"pipeline rank 0 but [0-9.]+ GiB are usable \([0-9.]+ GiB short\)"):
        optimize(problem, 8, baselines=())


def test_spaces_respect_topology_and_their_restrictions():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 16, 128)
    builder = SpaceBuilder(problem, 128)
    for space in (DFLOP, MEGATRON, PYTORCH):
        for placement in ("colocated", "disaggregated"):
            for plan in builder.plans(space, placement):
                assert not plan.problems(problem.cluster, problem.model, 128), plan.describe()
                assert plan.gpus == 16
                if space is not DFLOP:
                    assert plan.placement == "colocated" and not plan.llm.layers_per_stage
                if space is PYTORCH:
                    assert (plan.llm.tp, plan.llm.pp, plan.zero) == (1, 1, 3)


def test_speedup_is_against_the_best_baseline():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 64)
    result = optimize(problem, 64, first=2, most=2)
    assert set(result.baselines) == {"megatron", "pytorch"}
    assert result.baseline.mean == min(e.mean for e in result.baselines.values())
    assert result.speedup == pytest.approx(result.baseline.mean / result.best.mean)
    assert result.speedup > 1.0
    assert result.ideal_s <= result.best.mean
    assert result.why and "faster than the best data-blind baseline" in result.why[0]


def test_text_only_data_plans_without_tiles():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 64, mix="text-only")
    assert problem.data.tiles.sum() == 0
    result = optimize(problem, 64, first=2, most=2, budget=4)
    assert result.best.mean < float("inf") and result.speedup >= 1.0


@settings(max_examples=80)
@given(layers=st.integers(1, 12), per_layer=st.floats(0.1, 5), extras=st.lists(st.floats(0, 20), min_size=1,
                                                                               max_size=6))
def test_balanced_split_is_optimal(layers, per_layer, extras):
    import itertools

    if len(extras) > layers:
        return
    split = balanced_split(layers, per_layer, extras)
    assert sum(split) == layers and min(split) >= 1

    def cost(s):
        return max(n * per_layer + e for n, e in zip(s, extras))

    best = min(cost(c) for c in itertools.product(range(1, layers + 1), repeat=len(extras)) if sum(c) == layers)
    assert cost(split) <= best * (1 + 1e-9)
