"""The baselines people run: their batching rules, their spaces inside dflop's, canonical plans, and a
baseline space that fits nothing listed with its reason."""

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.errors import InfeasibleError, PlanError, SpecError
from dflop.plan.evaluate import PlanningProblem
from dflop.plan.search import Optimizer, optimize
from dflop.plan.space import BASELINES, DFLOP
from dflop.schedule.batching import Batching, arrival, modality_length, synchronised, token_budget
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, from_mapping, presets, to_mapping
from dflop.workload.sample import SampleTable

batches = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(1, 3000), st.integers(0, 9000)),
                   min_size=8, max_size=96).map(lambda rows: SampleTable(
                       np.array([f"s{i}" for i in range(len(rows))], dtype=object),
                       np.array([r[0] for r in rows], dtype=np.int8), np.array([r[1] for r in rows]),
                       np.array([r[2] for r in rows]), np.array([r[3] for r in rows])))
grids = st.tuples(st.integers(1, 4), st.integers(1, 4))


@given(batches, grids)
def test_every_rule_fills_every_bin_with_every_sample_once(batch, grid):
    replicas, microbatches = grid
    bins = replicas * microbatches
    if len(batch) < bins:
        return
    for rule in (arrival, modality_length, token_budget):
        a = rule(batch, replicas, microbatches)
        assert a.shape == (len(batch),) and a.min() >= 0 and a.max() < bins
        assert (np.bincount(a, minlength=bins) > 0).all(), rule.__name__


@given(batches, grids)
def test_rules_do_what_their_frameworks_do(batch, grid):
    replicas, m = grid
    bins, n = replicas * m, len(batch)
    if n < bins:
        return
    counts = np.bincount(arrival(batch, replicas, m), minlength=bins)
    assert counts.max() - counts.min() <= 1  # equal counts
    first = arrival(batch, replicas, m)[: n // bins]  # microbatch 0 of rank 0 first, in arrival order
    assert (first == 0).all()
    if n % bins == 0:  # LLaVA: equal counts, text lengths balanced greedily (longest first)
        a = modality_length(batch, replicas, m)
        assert (np.bincount(a, minlength=bins) == n // bins).all()
        text = np.bincount(a, weights=batch.text_tokens, minlength=bins)
        assert text.max() - text.min() <= batch.text_tokens.max()
    tokens = batch.llm_tokens.astype(float)
    loads = np.bincount(token_budget(batch, replicas, m), weights=tokens, minlength=bins)
    assert loads.max() <= tokens.sum() / bins + tokens.max()  # the budget, plus at most one overflow


def test_modality_length_ignores_image_tokens():
    """LLaVA's modality lengths count the conversation's words only: two samples with the same text and
    very different images weigh the same."""
    batch = SampleTable(np.array(["a", "b", "c", "d"], dtype=object), np.array([1, 1, 1, 1], dtype=np.int8),
                        np.array([37, 1, 1, 1]), np.array([100, 100, 100, 100]), np.array([9000, 100, 100, 100]))
    a = modality_length(batch, 2, 1)
    tokens = np.bincount(a, weights=batch.llm_tokens)
    assert tokens.max() > 2 * tokens.min()  # blind to the heavy image
    packed = token_budget(batch, 2, 1)
    assert (packed == packed[0]).sum() == 1  # token packing sees it and gives it a bin of its own


def test_bins_of_like_load_share_a_microbatch_when_replicas_meet_before_every_op():
    """ZeRO-3 gathers before every forward and backward: microbatch k costs its heaviest bin on any
    replica, so dflop's bins are regrouped by load (other plans keep theirs)."""
    costs = np.array([[10.0], [1.0], [9.0], [2.0]])  # one sample per bin; bin b holds sample b
    fsdp = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=3)
    slots = synchronised(fsdp, np.arange(4), costs)
    assert sorted(slots[[0, 2]] % 2) == [0, 0] and sorted(slots[[1, 3]] % 2) == [1, 1]  # 10 with 9, 2 with 1
    assert sorted(slots[[0, 2]] // 2) == [0, 1]  # on different replicas
    ddp = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=1)
    assert (synchronised(ddp, np.arange(4), costs) == np.arange(4)).all()


def test_plans_are_canonical(model, cluster):
    one_stage = Plan(encoder=ModulePlan(tp=8, dp=4), llm=ModulePlan(tp=4, pp=1, dp=8), placement="colocated",
                     microbatches=16, schedule="ZBH1")
    with pytest.raises(PlanError, match="one pipeline rank runs ZBH1 as plain gradient accumulation"):
        one_stage.validate(cluster, model)
    assert any("zero 3 is modelled as FSDP" in p for p in Plan(
        encoder=ModulePlan(dp=4), llm=ModulePlan(tp=4, pp=2, dp=4), microbatches=4, zero=3).problems(cluster, model))
    with pytest.raises(SpecError, match="hsdp: hybrid sharding needs zero 3"):
        Plan(encoder=ModulePlan(), llm=ModulePlan(), microbatches=1, hsdp=True)


def test_new_plan_fields_round_trip_through_yaml():
    plan = Plan(encoder=ModulePlan(dp=8), llm=ModulePlan(dp=8), placement="colocated", microbatches=2, zero=3,
                hsdp=True, fp32_grads=True, recompute="selective")
    again = from_mapping(Plan, yaml.safe_load(yaml.safe_dump(to_mapping(plan))), "plan:")
    assert again == plan and again.recompute == "selective"
    with pytest.raises(SpecError, match="recompute: 'some' is not one of"):
        from_mapping(Plan, {**to_mapping(plan), "recompute": "some"}, "plan:")


def small_problem(encoder, llm, per_node, nodes, mix, per_gpu, seed):
    from dflop.workload import profile_mix

    model = presets.model(encoder, llm)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=nodes, gpus_per_node=per_node)
    batch = per_gpu * cluster.gpus
    training = TrainingSpec(global_batch=batch)
    data = profile_mix(mix, 1500, model.encoder, seed=seed).samples
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    return PlanningProblem(system, data, seed), batch


@settings(max_examples=6)
@given(per_node=st.sampled_from([2, 4]), nodes=st.integers(1, 2), per_gpu=st.sampled_from([2, 4]),
       mix=st.sampled_from(["llava-ov", "image-heavy", "video-heavy"]), seed=st.integers(0, 50))
def test_dflop_is_never_slower_than_the_best_plan_of_any_baseline_space_with_its_bins(per_node, nodes, per_gpu,
                                                                                         mix, seed):
    problem, batch = small_problem("internvit-300m", "qwen2.5-7b", per_node, nodes, mix, per_gpu, seed)
    opt = Optimizer(problem, batch, first=1, most=1, exhaustive=True)
    try:
        mine = opt.search(DFLOP, Batching.BALANCED).best.mean
    except InfeasibleError:
        mine = float("inf")
    for space in BASELINES:
        try:
            theirs = opt.search(space, Batching.BALANCED).best.mean
        except InfeasibleError:
            continue
        assert mine <= theirs * (1 + 1e-12), space.name


def test_a_baseline_that_fits_nothing_is_listed_with_its_reason():
    problem, batch = small_problem("internvit-6b", "qwen2.5-72b", 8, 1, "llava-ov", 2, 0)
    with pytest.raises(InfeasibleError):  # nothing fits 8 GPUs, dflop's plans included
        optimize(problem, batch, first=1, most=1)
    opt = Optimizer(problem, batch, first=1, most=1)
    listed, _ = opt.baselines(BASELINES, (Batching.ARRIVAL,))
    assert [(b.space, b.batching) for b in listed] == [("megatron", "arrival"), ("pytorch", "arrival")]
    assert all(b.best is None and "no " in b.reason and "plan" in b.reason for b in listed)
