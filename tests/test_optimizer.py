import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.errors import InfeasibleError
from dflop.plan.evaluate import Estimate, PlanningProblem
from dflop.plan.search import Optimizer, optimize
from dflop.plan.space import DFLOP, MEGATRON, PYTORCH, Layers, SpaceBuilder
from dflop.schedule.batching import Batching
from dflop.plan.split import balanced_split
from dflop.timing.steps import CostedPlan
from dflop.sim.simulate import simulate_steps
from dflop.specs import ClusterSpec, TrainingSpec, presets
from dflop.workload import profile_mix


def problem_for(encoder, llm, gpus, batch, mix="llava-ov"):
    model = presets.model(encoder, llm)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
    training = TrainingSpec(global_batch=batch)
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
    for placement in ("colocated", "heterogeneous", "disaggregated"):
        plans = [p for options in builder.plans(DFLOP, placement) for p in options]
        for i in rng.choice(len(plans), size=min(12, len(plans)), replace=False):
            plan = plans[i]
            screen = opt.screener.screen(plan, Batching.BALANCED)
            e = opt.ev.extend(Estimate(plan, Batching.BALANCED, screen.bound), 2)
            assert e.mean >= screen.bound * (1 - 1e-9)
            if placement == "disaggregated":
                assert opt.split_bound(plan.encoder.gpus) <= screen.bound * (1 + 1e-9)


def test_chosen_plan_does_not_run_out_of_memory_in_the_simulator():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 16, 128)
    opt = Optimizer(problem, 128, first=2, most=2, budget=16)
    result = opt.search(DFLOP)
    plan = result.best.plan
    batches = [opt.pool[i] for i in range(2)]
    sim = simulate_steps(CostedPlan(plan, problem.system), batches,
                         lambda i, b: opt.ev.assignment(plan, i, Batching.BALANCED)[0])
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
    seen = {}
    for space in (DFLOP, MEGATRON, PYTORCH):
        for placement in ("colocated", "heterogeneous", "disaggregated"):
            for options in builder.plans(space, placement):
                assert [p.recompute for p in options] == ["none", "selective", "full"]
                for plan in options[:1]:
                    assert not plan.problems(problem.cluster, problem.model, 128), plan.describe()
                    assert plan.gpus == 16
                    seen.setdefault(space.name, set()).add(plan)
                    if space is MEGATRON:
                        assert plan.fp32_grads and plan.zero == 1  # DDP is dominated by the distributed optimizer
                        if not plan.colocated:  # the encoder's own stage on every replica, TP at most the LLM's
                            assert plan.encoder.dp == plan.llm.dp and plan.encoder.tp <= plan.llm.tp
                    if space is PYTORCH:
                        assert plan.colocated and plan.llm.pp == 1 and plan.zero in (0, 2, 3)
                    if plan.heterogeneous:  # the encoder's own TP tiling the LLM's, on every GPU
                        assert space is DFLOP and plan.encoder.tp * plan.encoder.dp == 16 and plan.zero <= 1
                        assert plan.encoder.tp % plan.llm.tp == 0 or plan.llm.tp % plan.encoder.tp == 0
                    if plan.pipeline_ranks == 1:
                        assert plan.schedule == "1F1B" and plan.virtual_stages == 1  # canonical
    assert any(p.hsdp for p in seen["pytorch"]) and any(not p.colocated for p in seen["megatron"])
    heterogeneous = {(p.llm.tp, p.encoder.tp) for p in seen["dflop"] if p.heterogeneous}
    assert {(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (4, 1)} <= heterogeneous
    # dflop's space holds every baseline plan, or one alike but for provably dominated memory options
    mine = {(p.encoder, p.llm, p.placement, p.microbatches, p.schedule, p.virtual_stages, p.zero, p.hsdp)
            for p in seen["dflop"]}
    for plan in seen["megatron"] | seen["pytorch"]:
        zero = 1 if plan.zero == 0 else plan.zero
        alike = [(plan.encoder, plan.llm, plan.placement, plan.microbatches, plan.schedule, plan.virtual_stages,
                  z, plan.hsdp) for z in (zero, 2)]
        assert any(a in mine for a in alike), plan.describe()


def test_megatron_s_space_splits_layers_any_way_its_pipeline_layout_can():
    """``--pipeline-model-parallel-layout`` gives every (virtual) stage its own layer count: the Megatron-style
    space holds splits balanced by cost that are neither even nor a lighter first and last stage."""
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 16, 128)
    builder = SpaceBuilder(problem, 128)
    uneven = []
    for options in builder.plans(MEGATRON, "colocated"):
        plan = options[0]
        stages, bin_samples = plan.llm.pp * plan.virtual_stages, 128 / plan.bins
        first_last = builder.llm_split(plan.llm.tp, stages, bin_samples, plan.llm.tp, Layers.FIRST_LAST)
        if plan.llm.layers_per_stage and plan.llm.layers_per_stage != first_last:
            assert plan.llm.layers_per_stage == builder.llm_split(plan.llm.tp, stages, bin_samples, plan.llm.tp,
                                                                  Layers.BALANCED)
            uneven.append(plan)
    assert uneven


def test_speedup_is_against_the_strongest_baseline_and_decomposes():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 64)
    result = optimize(problem, 64, first=2, most=2, noise=0.2)
    names = {(b.space, b.batching) for b in result.baselines}
    assert names == {(s, r) for s in ("megatron", "pytorch") for r in (Batching.ARRIVAL, Batching.MODALITY,
                                                                        Batching.TOKENS)} | {
        ("megatron", Batching.DP_BALANCED)}  # Megatron-LM's own packing, in its space only
    strongest = result.strongest
    assert strongest.best.mean == min(b.best.mean for b in result.found)
    assert result.speedup == pytest.approx(strongest.best.mean / result.best.mean)
    d = result.decomposition
    assert d["layout_gain"] * d["plan_gain"] * d["balance_gain"] == pytest.approx(result.speedup)
    assert (d["layout_gain"] == 1.0) == (not result.best.plan.heterogeneous)
    # dflop's space contains the baselines': its choice is never slower than any of them, or their plans
    # with dflop's bins
    assert all(result.best.mean <= e.mean for b in result.found for e in (b.best, b.balanced) if e is not None)
    assert result.ideal_s <= result.best.mean
    error = result.speedup_at_error()
    assert error["sigma"] == 0.2 and error["speedup"] > 0
    assert error["layout_gain"] * error["plan_gain"] * error["balance_gain"] == pytest.approx(error["speedup"])
    json = result.to_json()
    assert len(json["baselines"]) == 7 and all({"space", "batching", "plan", "step_time_s", "mfu"} <= set(b)
                                                for b in json["baselines"])
    assert [b["space"] for b in json["baselines"] if b["batching"] == "dp-balanced"] == ["megatron"]
    assert 0 < json["plan"]["mfu"] <= json["plan"]["hfu"] < 1


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


def test_quick_starts_from_a_given_feasible_assignment_when_lpt_finds_no_room():
    """A baseline's plan with dflop's bins is kept to the largest bins its own rule made; LPT
    can paint itself into a corner under such tight caps, so the search starts from the rule's
    bins (which fit by construction) and only improves on them."""
    from dflop.plan.evaluate import quick
    from dflop.schedule.problem import PartitionProblem
    sizes = np.array([[3.0], [3.0], [2.0], [2.0], [2.0]])
    problem = PartitionProblem(sizes, 2, sizes, np.array([6.0]), tuple(range(5)))
    with pytest.raises(InfeasibleError):
        quick(problem)
    start = np.array([0, 0, 1, 1, 1])
    got = quick(problem, start)
    assert sorted(np.bincount(got.assignment, weights=sizes[:, 0]).tolist()) == [6.0, 6.0]
    assert got.makespan == 6.0


def test_a_prediction_above_the_hardware_s_plausible_mfu_is_flagged():
    from dflop.plan.report import implausible

    h100 = presets.hardware("h100")
    assert implausible("dflop", h100.plausible_mfu, h100) == []
    [warning] = implausible("dflop", h100.plausible_mfu + 0.01, h100)
    assert f"exceeds the plausible {h100.plausible_mfu:.0%}" in warning and "not calibrated" in warning


def test_a_deadline_gives_the_best_plan_found_so_far_and_names_what_was_not_searched():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 64)
    result = optimize(problem, 64, first=2, most=2, noise=0.2, max_seconds=1e-9)
    best = result.best
    assert best.plan.validate(problem.cluster, problem.model, 64) == best.plan
    assert not best.infeasible and best.peak_memory <= problem.cluster.hardware.usable_memory_bytes
    assert best.n == 2 and best.mean > 0
    line = result.not_searched
    assert "\n" not in line and line.startswith("deadline of 1e-09 s reached; not searched: ")
    for part in ("dflop balanced colocated plans", "dflop balanced disaggregated plans", "refining dflop",
                 "baseline megatron / arrival", "baseline pytorch / token-budget",
                 "the timing at the prediction error"):
        assert part in line
    assert all(b.best is None and b.reason == "not searched: the deadline passed" for b in result.baselines)
    assert result.to_json()["not_searched"] == line


def test_a_deadline_not_reached_leaves_every_answer_as_without_one():
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 32)
    figures = []
    for deadline in ({}, {"max_seconds": 1e6}):
        r = optimize(problem, 32, first=2, most=3, budget=8, noise=0.2, **deadline)
        assert r.not_searched == ""
        judged = [(e.plan, e.batching, e.within, e.steps, r.at_error[id(e)]) for e in r.judged()]
        figures.append((judged, [(b.name, b.reason) for b in r.baselines], r.speedup, r.decomposition))
    assert figures[0] == figures[1]


def test_a_baseline_rule_cuts_chunks_by_the_number_of_bins_alone():
    """The optimizer cuts each batch once per rule and bin count (``Evaluator.chunks``) and deals the
    chunks to each grid: the same bins as the rule on that grid."""
    from dflop.schedule.batching import CHUNKS, assign, dispatch

    batch = profile_mix("llava-ov", 2000, presets.model("siglip-so400m", "qwen2.5-7b").encoder,
                        seed=3).sample(96, np.random.default_rng(3), "x")
    for rule, cut in CHUNKS.items():
        for replicas, m in ((1, 96), (2, 48), (4, 24), (12, 8), (96, 1), (3, 5), (7, 2)):
            chunk = cut(batch, replicas * m)
            assert np.array_equal(dispatch(chunk, replicas, m), assign(rule, batch, replicas, m))
            assert 0 <= chunk.min() and chunk.max() < replicas * m


def test_the_layout_gain_is_over_the_best_plan_without_an_encoder_phase(model, cluster):
    """speedup = layout gain x plan gain x balance gain, when dflop's choice runs a heterogeneous encoder."""
    from dflop.plan.report import Baseline, OptimizeResult
    from dflop.specs import ModulePlan, Plan

    def estimate(plan, batching, steps):
        return Estimate(plan, batching, 0.0, steps=list(steps))

    llm = ModulePlan(tp=2, dp=4)
    phase = Plan(encoder=ModulePlan(tp=1, dp=8), llm=llm, placement="heterogeneous", microbatches=4)
    colocated = Plan(encoder=ModulePlan(tp=2, dp=4), llm=llm, placement="colocated", microbatches=4)
    best, without = estimate(phase, Batching.BALANCED, [1.0, 1.2]), estimate(colocated, Batching.BALANCED, [1.2, 1.3])
    baseline = Baseline("megatron", Batching.TOKENS, estimate(colocated, Batching.TOKENS, [1.5, 1.6]),
                        estimate(colocated, Batching.BALANCED, [1.3, 1.4]))
    result = OptimizeResult(best, [without], [baseline], {}, 0.0, 0.5, cluster.hardware, homogeneous=without)
    d = result.decomposition
    assert d["layout_gain"] == pytest.approx(1.25 / 1.1) and d["plan_gain"] == pytest.approx(1.35 / 1.25)
    assert d["layout_gain"] * d["plan_gain"] * d["balance_gain"] == pytest.approx(result.speedup)
    assert without in result.judged() and result.to_json()["decomposition"]["layout_gain"] == d["layout_gain"]


def _answer(r):
    """Everything a search answers: the judged estimates (at the error too), every baseline, the stats."""
    judged = [(e.plan, e.batching, e.within, e.steps, e.peak_memory, r.at_error[id(e)]) for e in r.judged()]
    return (judged, [(e.plan, e.steps) for e in r.alternatives], [(b.name, b.reason) for b in r.baselines],
            r.speedup, r.decomposition, r.stats, r.not_searched)


@pytest.mark.processes
def test_searches_spread_over_workers_give_the_answer_of_one_process(monkeypatch):
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 16, 128)
    alone = optimize(problem, 128, first=2, most=3, budget=8, noise=0.2)
    search = Optimizer.search

    def saying(self, space, batching=Batching.BALANCED):  # a worker's warning reaches the caller, once
        warnings.warn("a search's warning", UserWarning)
        return search(self, space, batching)

    monkeypatch.setattr(Optimizer, "search", saying)
    heard = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spread = optimize(problem, 128, first=2, most=3, budget=8, noise=0.2, workers=3,
                          progress=lambda *a: heard.append(a))
    assert _answer(spread) == _answer(alone)
    assert [str(w.message) for w in caught] == ["a search's warning"]
    assert heard[-1] == ("every space's", 8, 8)  # dflop's searches and the seven baselines


@pytest.mark.processes
def test_a_search_that_fails_in_a_worker_fails_the_call_as_in_one_process():
    problem = problem_for("internvit-6b", "qwen2.5-72b", 8, 8)
    with pytest.raises(InfeasibleError, match="no dflop plan fits 8 x H100") as alone:
        optimize(problem, 8, first=1, most=1)
    with pytest.raises(InfeasibleError) as spread:
        optimize(problem, 8, first=1, most=1, workers=2)
    assert str(spread.value) == str(alone.value)


def _best_in_a_pool_worker(workers):
    problem = problem_for("siglip-so400m", "qwen2.5-7b", 8, 16)
    return optimize(problem, 16, first=1, most=1, budget=4, workers=workers).best.steps


@pytest.mark.processes
def test_searches_asked_to_spread_inside_a_pool_s_worker_run_there_alone():
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:  # daemonic: it may start no process
        assert pool.apply(_best_in_a_pool_worker, (2,)) == _best_in_a_pool_worker(1)
