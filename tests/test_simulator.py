"""The simulator against closed forms, invariants, and the other evaluators."""

import json

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel
from dflop.program.costing import StepBuilder, stage_times_timing
from dflop.program.evaluate import evaluate, summarize
from dflop.program.graph import expand, longest_path
from dflop.program.overlap import Overlap, with_overlap
from dflop.program.schedules import build
from dflop.program.template import build_template
from dflop.sim import execute, simulate_pipeline
from dflop.specs import ModulePlan, Plan, TrainingSpec
from dflop.workload import profile_mix

US = 1e-6  # times drawn as whole microseconds convert to exact nanoseconds


@given(p=st.integers(1, 8), m=st.integers(1, 24), f=st.integers(1, 5000), b=st.integers(1, 5000),
       schedule=st.sampled_from(["GPipe", "1F1B"]))
def test_gpipe_and_1f1b_closed_form(p, m, f, b, schedule):
    result = simulate_pipeline([f * US] * p, [b * US] * p, schedule=schedule, microbatches=m)
    assert result.step_time == pytest.approx((m + p - 1) * (f + b) * US, rel=1e-12)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@given(p=st.integers(2, 6), v=st.integers(2, 4), rounds=st.integers(1, 4), unit=st.integers(1, 500))
def test_interleaved_matches_published_bubble(p, v, rounds, unit):
    m = p * rounds
    f, b = unit * US, 2 * unit * US  # per full stage; each of the v chunks takes 1/v of it
    result = simulate_pipeline([f / v] * (p * v), [b / v] * (p * v), schedule="Interleaved1F1B",
                               microbatches=m, virtual_stages=v)
    # Narayanan et al. 2021: the bubble shrinks by v, to (p-1)/v of a (f+b).
    assert result.step_time == pytest.approx((m + (p - 1) / v) * (f + b), rel=1e-9)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


@given(p=st.integers(2, 8), extra=st.integers(0, 16), unit=st.integers(1, 500))
def test_zero_bubble_h1_beats_1f1b_as_published(p, extra, unit):
    m = p + extra
    t = unit * US
    zb = simulate_pipeline([t] * p, [t] * p, bwd_weight=[t] * p, schedule="ZBH1", microbatches=m)
    one = simulate_pipeline([t] * p, [2 * t] * p, schedule="1F1B", microbatches=m)
    # Qi et al. 2024, ZB-H1: bubble (p-1)(T_F + T_B - T_W) instead of 1F1B's (p-1)(T_F + T_B + T_W).
    assert zb.step_time == pytest.approx((3 * m + (p - 1)) * t, rel=1e-12)
    assert one.step_time == pytest.approx(3 * (m + p - 1) * t, rel=1e-12)
    assert zb.bubble_fraction < one.bubble_fraction


def random_pipeline(draw):
    name = draw(st.sampled_from(["GPipe", "1F1B", "ZBH1", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble",
                                 "DualPipeV"]))
    p = draw(st.integers(1, 5))
    v = {"Interleaved1F1B": draw(st.integers(2, 3)), "LoopedBFS": draw(st.integers(1, 3)), "ZBVZeroBubble": 2,
         "DualPipeV": 2}.get(name, 1)
    m = p * draw(st.integers(1, 3)) if name == "Interleaved1F1B" else draw(st.integers(1, 8))
    m = max(m, 2 * p) if name == "DualPipeV" else m
    program = build(name, p, m, v)
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=p), placement="colocated", microbatches=m,
                schedule=program.name, virtual_stages=v)
    shape = (p * v, m)
    times = [np.array(draw(st.lists(st.integers(0, 10_000), min_size=p * v * m, max_size=p * v * m)))
             .reshape(shape) * US for _ in range(3)]
    p2p = draw(st.integers(0, 3000)) * US
    return build_template(plan, program), times, p2p


@st.composite
def pipelines(draw):
    return random_pipeline(draw)


@given(pipelines(), st.booleans(), st.sampled_from(list(Overlap)))
def test_execution_invariants(case, contention, overlap):
    template, (f, i, w), p2p = case
    timing = with_overlap(stage_times_timing(template, f, i, w, p2p), overlap)
    graph = expand(timing)
    ex = execute(graph, contention=contention)
    compute = [o for o in range(len(graph)) if graph.worker[o] >= 0]
    assert sorted(compute) == sorted(o for ops in graph.order for o in ops)  # every op once
    for ops in graph.order:  # one compute stream per worker: no overlap, program order kept
        for a, b in zip(ops, ops[1:]):
            assert ex.end[a] <= ex.start[b]
    for o in range(len(graph)):  # nothing starts before its inputs arrived
        assert ex.end[o] - ex.start[o] == graph.duration[o]
        for d, comm, _ in graph.deps[o]:
            assert ex.start[o] >= ex.end[d] + comm
    busiest = max(sum(graph.duration[o] for o in ops) for ops in graph.order)
    start, end = longest_path(graph)
    assert ex.makespan >= busiest
    assert ex.makespan >= int(end.max())  # at least the longest dependency chain
    if not contention:
        assert ex.makespan == int(end.max()) == evaluate(timing).step_ns


@given(pipelines(), st.integers(2, 5))
def test_scaling_durations_scales_the_step(case, k):
    template, (f, i, w), p2p = case
    one = execute(expand(stage_times_timing(template, f, i, w, p2p)))
    many = execute(expand(stage_times_timing(template, f * k, i * k, w * k, p2p * k)))
    assert many.makespan == k * one.makespan


@pytest.fixture(scope="module")
def builder_setup(model, cluster):
    training = TrainingSpec(global_batch=128, recompute="full")
    cost = AnalyticalCostModel(model, cluster.hardware, training)
    prof = profile_mix("llava-ov", 3000, model.encoder)
    return training, cost, prof


plans = st.one_of(
    st.builds(lambda etp, edp, epp, ltp, lpp, ldp, m, s: Plan(
        encoder=ModulePlan(tp=etp, pp=epp, dp=edp), llm=ModulePlan(tp=ltp, pp=lpp, dp=ldp),
        microbatches=m, schedule=s),
        st.sampled_from([1, 2]), st.integers(1, 4), st.integers(1, 2), st.sampled_from([2, 4]),
        st.integers(1, 3), st.integers(1, 2), st.integers(1, 6), st.sampled_from(["1F1B", "ZBH1", "GPipe"])),
    st.builds(lambda tp, pp, dp, r, v: Plan(
        encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp), placement="colocated",
        microbatches=pp * r, schedule="Interleaved1F1B" if v > 1 else "1F1B", virtual_stages=v),
        st.sampled_from([2, 4]), st.integers(1, 3), st.integers(1, 2), st.integers(1, 3), st.integers(1, 2)))


@given(plans, st.integers(0, 10_000))
def test_three_evaluators_agree_on_full_plans(model, cluster, builder_setup, plan, seed):
    training, cost, prof = builder_setup
    assume(not plan.problems(cluster, model, 128))
    builder = StepBuilder(build_template(plan), model=model, cluster=cluster, training=training, cost=cost)
    rng = np.random.default_rng(seed)
    batch = prof.sample(64, rng)
    assignment = rng.permutation(np.arange(64) % plan.bins)
    timing = builder.timing(batch, assignment)
    fast = evaluate(timing)
    graph = expand(timing)
    _, end = longest_path(graph)
    simpy = execute(graph, contention=False)
    assert fast.step_ns == int(end.max()) == simpy.makespan
    assert execute(graph, contention=True).makespan >= fast.step_ns


def test_disaggregated_default_model_simulates_with_bridge_and_allreduce(model, cluster, builder_setup):
    from dflop.sim.simulate import simulate_steps

    training, cost, prof = builder_setup
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=8), llm=ModulePlan(tp=4, pp=2, dp=3), microbatches=4)
    builder = StepBuilder(build_template(plan), model=model, cluster=cluster, training=training, cost=cost)
    rng = np.random.default_rng(0)
    batches = [prof.sample(96, rng) for _ in range(2)]
    sim = simulate_steps(builder, batches, lambda i, b: np.arange(len(b)) % plan.bins)
    cats = {e.get("cat") for e in sim.trace["traceEvents"]}
    assert {"F", "B", "p2p", "bridge", "allreduce"} <= cats
    modules = {w["module"] for w in sim.trace["otherData"]["workers"]}
    assert modules == {"encoder", "llm"} and len(sim.trace["otherData"]["workers"]) == 8 + 6
    assert sim.metrics.steps == 2 and 0 < sim.metrics.bubble_fraction < 1
    # Same inputs, same trace.
    again = simulate_steps(builder, batches, lambda i, b: np.arange(len(b)) % plan.bins)
    assert json.dumps(again.trace) == json.dumps(sim.trace)


def test_out_of_memory_is_reported_with_rank_step_and_bytes(model, cluster, builder_setup):
    from dflop.sim.simulate import simulate_steps

    training, cost, prof = builder_setup
    no_recompute = TrainingSpec(global_batch=128)
    plan = Plan(encoder=ModulePlan(tp=1, dp=2), llm=ModulePlan(tp=1, pp=1, dp=2), microbatches=1, zero=0)
    builder = StepBuilder(build_template(plan), model=model, cluster=cluster, training=no_recompute,
                          cost=AnalyticalCostModel(model, cluster.hardware, no_recompute))
    batch = prof.sample(64, np.random.default_rng(1))
    sim = simulate_steps(builder, [batch], lambda i, b: np.arange(len(b)) % plan.bins)
    oom = sim.trace["otherData"]["oom"]
    assert oom and {"rank", "step", "bytes", "capacity"} <= set(oom[0])
    assert oom[0]["bytes"] > oom[0]["capacity"] and oom[0]["step"] == 0
    timing = builder.timing(batch, np.arange(64) % plan.bins)  # the fast path agrees, without timing
    assert not summarize(timing, evaluate(timing)).fits
