"""The simulator against closed forms, invariants, and the other evaluators."""

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.program.actions import Kind
from dflop.timing.costing import bin_shapes, stage_times_timing
from dflop.timing.costs import graph_costs, longest_path
from dflop.timing.evaluate import evaluate, summarize
from dflop.timing.overlap import Overlap, with_overlap
from dflop.timing.perop import PerOp
from dflop.program.schedules import build
from dflop.program.lowering import lower
from dflop.program.stepgraph import Role, Stream
from dflop.timing.steps import CostedPlan
from dflop.program.template import build_template, program_for, waits_for
from dflop.sim import execute, simulate_pipeline
from dflop.sim.simulate import simulate_steps
from dflop.specs import ModulePlan, Plan, TrainingSpec
from dflop.specs.plan import Module, Recompute
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


def pipeline_graph(template, f, i, w, p2p, overlap=Overlap.SEQUENTIAL):
    graph = lower(template)
    timing = with_overlap(stage_times_timing(template, f, i, w, p2p), overlap)
    return graph, graph_costs(graph, timing), timing


def assert_valid_execution(graph, costs, start, end, contention):
    """Every node once for its duration, after all it waits for; one compute stream per worker in
    program order; one transfer at a time per link under contention."""
    template = graph.template
    computes = sorted((n.op, graph.workers[n.worker].replica) for n in graph.nodes if n.kind.is_compute)
    assert computes == sorted((op.index, x) for op in template.ops
                              for x in range(template.groups[op.group].replicas))
    for k, node in enumerate(graph.nodes):
        assert end[k] - start[k] == costs.duration[k]
        assert all(start[k] >= end[d] for d in graph.deps[k])
    for ids in graph.order:
        compute = [k for k in ids if graph.nodes[k].stream is Stream.COMPUTE]
        assert all(end[a] <= start[b] for a, b in zip(compute, compute[1:]))
    if contention:
        by_link = {}
        for k, link in enumerate(graph.link):
            if link >= 0:
                by_link.setdefault(link, []).append((start[k], end[k]))
        for spans in by_link.values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@given(pipelines(), st.booleans(), st.sampled_from(list(Overlap)))
def test_execution_invariants(case, contention, overlap):
    template, (f, i, w), p2p = case
    graph, costs, timing = pipeline_graph(template, f, i, w, p2p, overlap)
    ex = execute(graph, costs, contention=contention)
    assert_valid_execution(graph, costs, ex.start, ex.end, contention)
    busiest = max(sum(int(costs.duration[k]) for k in ids if graph.nodes[k].kind.is_compute) for ids in graph.order)
    _, end = longest_path(graph, costs)
    assert ex.makespan >= busiest
    assert ex.makespan >= int(end.max())  # at least the longest dependency chain
    if not contention:
        assert ex.makespan == int(end.max()) == evaluate(timing).step_ns


@given(pipelines(), st.sampled_from(list(Overlap)))
def test_the_executors_view_tells_every_node_as_often_as_it_waits_and_keeps_every_constraint(case, overlap):
    """``StepGraph.delivery``: a node is told once per thing it waits for (a send that follows its
    producer, once by it), no receive is told, and every dep of a node is still told to it or
    implied: a receive by its send, an earlier compute node of its worker by its previous one."""
    template, (f, i, w), p2p = case
    graph = pipeline_graph(template, f, i, w, p2p, overlap)[0]
    view, roles = graph.delivery, graph.roles
    told = [0] * len(graph)
    heard: list[set[int]] = [set() for _ in graph.nodes]
    followers = {~c for targets in view.delivers for c in targets if c < 0}  # their own lists go unread
    for k, targets in enumerate(view.delivers):
        if k in followers:
            continue
        source = k
        for c in targets:
            if c < 0:
                told[~c] += 1
                heard[~c].add(k)
                source = ~c
                continue
            told[c] += 1
            heard[c].add(source)
    anchored = [int(a >= 0) for a in graph.anchor] if graph.anchor else [0] * len(graph)
    for c, role in enumerate(roles):
        if role is Role.RECEIVE:
            assert told[c] == 0
            continue
        assert told[c] + anchored[c] == view.waits[c]
        for d in graph.deps[c]:
            if roles[d] is Role.RECEIVE:
                assert graph.deps[d][0] in heard[c]
            elif d not in heard[c]:  # implied: an earlier compute node of its worker, not the last
                assert roles[d] is roles[c] is Role.COMPUTE and graph.worker_of[d] == graph.worker_of[c]
                assert any(e in heard[c] and graph.position[d] < graph.position[e] for e in graph.deps[c]
                           if roles[e] is Role.COMPUTE and graph.worker_of[e] == graph.worker_of[c])


@given(pipelines(), st.integers(2, 5))
def test_scaling_durations_scales_the_step(case, k):
    template, (f, i, w), p2p = case
    one = execute(*pipeline_graph(template, f, i, w, p2p)[:2])
    many = execute(*pipeline_graph(template, f * k, i * k, w * k, p2p * k)[:2])
    assert many.makespan == k * one.makespan


@pytest.fixture(scope="module")
def builder_setup(model, cluster):
    training = TrainingSpec(global_batch=128, recompute="full")
    system = System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training))
    prof = profile_mix("llava-ov", 3000, model.encoder)
    return system, prof


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
    system, prof = builder_setup
    assume(not plan.problems(cluster, model, 128))
    rng = np.random.default_rng(seed)
    batch = prof.sample(64, rng)
    step = CostedPlan(plan, system).step(0, batch, rng.permutation(np.arange(64) % plan.bins))
    fast = evaluate(step.timing)
    start, end = longest_path(step.graph, step.costs)
    simpy = execute(step.graph, step.costs, contention=False)
    assert fast.step_ns == int(end.max()) == simpy.makespan
    assert_valid_execution(step.graph, step.costs, start, end, contention=False)
    crowded = execute(step.graph, step.costs, contention=True)
    assert crowded.makespan >= fast.step_ns
    assert_valid_execution(step.graph, step.costs, crowded.start, crowded.end, contention=True)


@given(plans, st.integers(0, 10_000), st.integers(1, 6), st.sampled_from(list(Overlap)))
def test_ranks_outnumbering_the_cores_share_them_as_time_slices(model, cluster, builder_setup, plan, seed, cores,
                                                                overlap):
    """Every compute op in progress advances at min(1, cores / ranks computing): it starts as soon as
    what it waits for has ended, and its work, integrated over its span at that rate, is its duration
    (to the nanosecond each change of rate rounds); a gradient reduction anchored to a backward starts
    once that backward has done its lag of work."""
    system, prof = builder_setup
    assume(not plan.problems(cluster, model, 128))
    rng = np.random.default_rng(seed)
    batch = prof.sample(64, rng)
    step = CostedPlan(plan, system).step(0, batch, rng.permutation(np.arange(64) % plan.bins))
    graph, costs = step.graph, graph_costs(step.graph, with_overlap(step.timing, overlap))
    alone = execute(graph, costs, contention=False)
    shared = execute(graph, costs, contention=False, cores=cores)
    ranks = [len(w.gpus) for w in graph.workers]
    start, end = shared.start.tolist(), shared.end.tolist()
    computes = [k for k, node in enumerate(graph.nodes) if node.kind.is_compute]
    moments = sorted({t for k in computes for t in (start[k], end[k])})
    rate = []
    for a, b in zip(moments, moments[1:]):
        computing = sum(ranks[graph.nodes[k].worker] for k in computes if start[k] <= a < end[k])
        rate.append((a, b, min(1.0, cores / computing) if computing else 1.0))

    def work(k, until):
        return sum((min(b, until) - a) * r for a, b, r in rate if start[k] <= a < min(end[k], until))

    for k in range(len(graph)):
        assert all(start[k] >= end[d] for d in graph.deps[k])
    for k in computes:
        assert start[k] == max([end[d] for d in graph.deps[k]], default=0)
        assert work(k, end[k]) == pytest.approx(int(costs.duration[k]), abs=len(moments))
    anchored = [(c, a) for c, a in enumerate(graph.anchor or ()) if a >= 0]
    for c, a in anchored:
        assert work(a, start[c]) >= int(costs.lag[c]) - len(moments)
    if cores >= sum(ranks):
        assert np.array_equal(shared.end, alone.end)
    busy = sum(int(costs.duration[k]) * ranks[graph.nodes[k].worker] for k in computes)
    assert shared.makespan >= max(alone.makespan, busy / cores - len(moments))


def test_the_simulator_backend_predicts_each_step_with_the_cores_shared(model, cluster, builder_setup):
    from dflop.backends import ScheduledBatch
    from dflop.backends.sim import SimBackend

    system, prof = builder_setup
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(tp=2, dp=2), placement="colocated", microbatches=2)
    rng = np.random.default_rng(0)
    steps = [ScheduledBatch(b, rng.permutation(np.arange(64) % plan.bins)) for b in (prof.sample(64, rng),) * 2]
    runner = CostedPlan(plan, system)
    alone, shared = (SimBackend(memory=False, cores=cores).run(runner, steps) for cores in (None, 3))
    graphs = [runner.step(i, s.batch, s.assignment) for i, s in enumerate(steps)]
    assert [s["step_s"] for s in shared.steps] == [execute(g.graph, g.costs, cores=3).makespan / 1e9 for g in graphs]
    assert all(a["step_s"] < b["step_s"] for a, b in zip(alone.steps, shared.steps))
    assert shared.trace["otherData"]["shared_cores"] == 3 and "shared_cores" not in alone.trace["otherData"]


@given(plans)
def test_waves_hold_every_op_once_after_all_it_waits_for_and_one_op_of_a_group_each(model, cluster, plan):
    """What lets the fast evaluator time a wave at once: nothing in a wave waits for anything in it
    or later, and a group's ops (and so its collectives) come in program order, one per wave."""
    assume(not plan.problems(cluster, model, 128))
    t = build_template(plan, program_for(plan)[0])
    wave_of = {}
    for w, wave in enumerate(t.waves):
        groups = [t.ops[i].group for i in wave.ops]
        assert len(set(groups)) == len(groups)
        wave_of.update({int(i): w for i in wave.ops})
    assert sorted(wave_of) == list(range(len(t.ops)))
    for op in t.ops:
        prev, data, bridge = waits_for(op, t.ops)
        assert all(wave_of[d] < wave_of[op.index] for d in (prev, bridge, *data) if d >= 0)
        assert t.wave_position[op.index][0] == wave_of[op.index]


def test_per_op_rows_are_their_groups_replicas_of_one_padded_table():
    values = PerOp(np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]]), [2, 1, 3])
    assert [row.tolist() for row in values] == [[1, 2], [3], [4, 5, 6]] and len(values) == 3
    values[1] = np.array([7])
    copy = values.copy()
    copy[0] = np.array([8, 9])
    assert values.table.tolist() == [[1, 2, 0], [7, 0, 0], [4, 5, 6]] and copy[0].tolist() == [8, 9]


# One replica each: a gradient reduction would slow the backward it overlaps, which differs
# between a schedule and its unsplit twin.
split_plans = st.one_of(
    st.builds(lambda epp, lpp, m: Plan(encoder=ModulePlan(pp=epp), llm=ModulePlan(tp=2, pp=lpp), microbatches=m,
                                       schedule="ZBH1"),
              st.integers(1, 2), st.integers(1, 3), st.integers(1, 6)),
    st.builds(lambda pp, r, name: Plan(
        encoder=ModulePlan(tp=2), llm=ModulePlan(tp=2, pp=pp), placement="colocated",
        microbatches=pp * r, schedule=name, virtual_stages=1 if name == "ZBH1" else 2),
        st.integers(1, 3), st.integers(1, 3), st.sampled_from(["ZBH1", "InterleavedZeroBubble", "ZBVZeroBubble"])),
).flatmap(lambda plan: st.sampled_from([replace(plan, recompute=r) for r in Recompute]))


@given(split_plans, st.integers(0, 10_000))
def test_a_stage_whose_inputs_need_no_gradient_runs_its_whole_backward_in_w(model, cluster, builder_setup, plan,
                                                                            seed):
    """As torch.distributed.pipelining runs a first stage (and the torch backend with it): nothing
    goes upstream, so I is empty and W is the whole backward; everywhere else I + W is the B the
    unsplit schedule runs on the same bins."""
    system, prof = builder_setup
    assume(not plan.problems(cluster, model, 128))
    pool = prof.sample(2000, np.random.default_rng(seed))
    # 16 text-only samples first, then 48 with images, in whole bins: bin 0 gets no image (the
    # bridge brings a disaggregated LLM nothing there), the others do.
    batch = pool.take(np.concatenate([np.flatnonzero(pool.tiles == 0)[:16], np.flatnonzero(pool.tiles > 0)[:48]]))
    assignment = np.arange(64) * plan.bins // 64
    timing = CostedPlan(plan, system).step(0, batch, assignment).timing
    twin = "1F1B" if plan.virtual_stages == 1 else "Interleaved1F1B"  # the same stages, backward unsplit
    unsplit = CostedPlan(replace(plan, schedule=twin), system).step(0, batch, assignment).timing

    def by_op(t, kind, field="duration"):
        return {(t.template.groups[op.group].module, op.stage, op.action.microbatch): getattr(t, field)[op.index]
                for op in t.template.ops if op.action.kind is kind}

    i, w, b = by_op(timing, Kind.I), by_op(timing, Kind.W), by_op(unsplit, Kind.B)
    i_flops, w_flops = by_op(timing, Kind.I, "hw_flops"), by_op(timing, Kind.W, "hw_flops")
    assert all(np.allclose(i_flops[key] + w_flops[key], value)  # recomputation included
               for key, value in by_op(unsplit, Kind.B, "hw_flops").items())
    tiles = bin_shapes(batch, assignment, plan.llm.dp, plan.microbatches).tiles
    assert i.keys() == w.keys() == b.keys()
    for (module, stage, k), seconds in i.items():
        if stage > 0:
            none = np.zeros_like(seconds, dtype=bool)
        elif module is Module.ENCODER or plan.colocated:
            none = np.ones_like(seconds, dtype=bool)
        else:
            none = tiles[:, k] == 0
        whole = b[(module, stage, k)]
        assert (seconds[none] == 0).all() and (seconds[~none & (whole > 0)] > 0).all()  # a bin may be empty
        assert np.abs(seconds + w[(module, stage, k)] - whole).max() <= 1  # ns rounding


def test_disaggregated_default_model_simulates_with_bridge_and_allreduce(model, cluster, builder_setup):
    system, prof = builder_setup
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=8), llm=ModulePlan(tp=4, pp=2, dp=3), microbatches=4)
    runner = CostedPlan(plan, system)
    rng = np.random.default_rng(0)
    batches = [prof.sample(96, rng) for _ in range(2)]
    sim = simulate_steps(runner, batches, lambda i, b: np.arange(len(b)) % plan.bins)
    cats = {e.get("cat") for e in sim.trace["traceEvents"]}
    assert {"F", "B", "p2p", "bridge", "recv", "reduce_grad"} <= cats
    modules = {w["module"] for w in sim.trace["otherData"]["workers"]}
    assert modules == {"encoder", "llm"} and len(sim.trace["otherData"]["workers"]) == 8 + 6
    assert sim.metrics.steps == 2 and 0 < sim.metrics.bubble_fraction < 1
    # Same inputs, same trace.
    again = simulate_steps(runner, batches, lambda i, b: np.arange(len(b)) % plan.bins)
    assert json.dumps(again.trace) == json.dumps(sim.trace)


def test_out_of_memory_is_reported_with_rank_step_and_bytes(model, cluster, builder_setup):
    _, prof = builder_setup
    no_recompute = TrainingSpec(global_batch=128)
    plan = Plan(encoder=ModulePlan(tp=1, dp=2), llm=ModulePlan(tp=1, pp=1, dp=2), microbatches=1, zero=0)
    runner = CostedPlan(plan, System(model, cluster, no_recompute,
                                     AnalyticalCostModel(model, cluster.hardware, no_recompute)))
    batch = prof.sample(64, np.random.default_rng(1))
    sim = simulate_steps(runner, [batch], lambda i, b: np.arange(len(b)) % plan.bins)
    oom = sim.trace["otherData"]["oom"]
    assert oom and {"rank", "step", "bytes", "capacity"} <= set(oom[0])
    assert oom[0]["bytes"] > oom[0]["capacity"] and oom[0]["step"] == 0
    timing = runner.step(0, batch, np.arange(64) % plan.bins).timing  # the fast path agrees, without timing
    assert not summarize(timing, evaluate(timing)).fits
