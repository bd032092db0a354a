"""Communication and memory of every data-parallel mode: the formulas by hand, and the three
evaluators (fast, reference longest path, SimPy) agreeing on plans of every mode."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System, state_bytes
from dflop.cost.comm import collective_link
from dflop.cost.overlap import bucket_lag, bucket_slowdown, overlapped, unit_chain
from dflop.program.actions import Kind
from dflop.program.collectives import CollectiveSpec
from dflop.timing.costs import longest_path
from dflop.timing.dpcomm import GroupComm, Units, fsdp_op, reduction
from dflop.timing.evaluate import evaluate, summarize
from dflop.program.graph_check import check_graph
from dflop.timing.steps import CostedPlan
from dflop.sim import execute
from dflop.sim.simulate import simulate_steps
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec
from dflop.workload import profile_mix
from test_fsdp_units import UnitsMeasured

S = 1e9  # ns per second


def test_compute_beside_communication_by_hand():
    assert overlapped(10.0, 4.0, 0.1) == pytest.approx(10.4)  # the 4 s beside the transfer run 10% slower
    assert overlapped(2.0, 5.0, 0.1) == pytest.approx(5.0)    # a longer transfer is exposed
    assert overlapped(3.0, 0.0, 0.5) == pytest.approx(3.0)


def test_bucketed_reduction_exposes_only_its_tail():
    # 8 s of backward fill 4 buckets; a 4 s reduction ends max(8/4 + 4, 8 + 4/4) = 9 s after it starts.
    assert bucket_lag(8.0, 4.0, 4) == pytest.approx(5.0)
    assert bucket_lag(8.0, 4.0, 4) + 4.0 == pytest.approx(9.0)
    # A 20 s reduction is communication-bound: it starts with the first bucket, 2 s in.
    assert bucket_lag(8.0, 20.0, 4) == pytest.approx(2.0)
    assert bucket_slowdown(8.0, 4.0, 5.0, 0.1) == pytest.approx(0.3)   # 3 s beside it, 10% slower
    assert bucket_slowdown(8.0, 20.0, 2.0, 0.1) == pytest.approx(0.6)


def test_reduce_grad_overlaps_and_slows_its_anchor():
    spec = CollectiveSpec(Kind.REDUCE_GRAD, 0, 0, last=True)
    comm = GroupComm(reduce=3.0, gather=1.0, buckets=4, units=None)
    duration = [np.array([8 * S, 6 * S], dtype=np.int64)]
    timed = reduction(spec, comm, duration, slowdown=0.1)
    assert timed.duration == 4 * S  # reduce-scatter + the weights' all-gather (last reduction)
    assert timed.lag.tolist() == [5 * S, 3 * S]  # max(b/4, b - 4 * 3/4) per replica
    assert duration[0].tolist() == [int(8.3 * S), int(6.3 * S)]  # 3 s of each beside it, 10% slower


def test_fsdp_forward_and_backward_by_hand():
    units = Units({"encoder": 2, "llm": 3}, {"encoder": 1.0, "llm": 2.0, "root": 5.0},
                  {"encoder": 0.5, "llm": 1.0, "root": 0.25})
    # Forward over e e l l l at 2 s per encoder unit and 1 s per LLM unit, each beside the next gather:
    # max(2, 1) + max(2, 2) + max(1, 2) + max(1, 2) + 1 = 9; the root's and first gather exposed before.
    exposed, seconds, comm = fsdp_op(Kind.F, units, {"encoder": np.array([4.0]), "llm": np.array([3.0])}, 0.0)
    assert exposed == pytest.approx(6.0) and seconds[0] == pytest.approx(9.0) and comm[0] == pytest.approx(7.0)
    # Backward over l l l e e at 3 s a unit, beside the next gather and the previous unit's reduce-scatter:
    # 5 units of 3 s (never communication-bound), then the last unit's and the root's reductions exposed.
    exposed, seconds, comm = fsdp_op(Kind.B, units, {"encoder": np.array([6.0]), "llm": np.array([9.0])}, 0.0)
    assert exposed == pytest.approx(2.0) and seconds[0] == pytest.approx(15.75) and comm[0] == pytest.approx(9.5)
    # Per-layer synchronisation: a gather longer than a unit's compute sets that unit's time.
    slow = Units({"encoder": 1, "llm": 2}, {"encoder": 1.0, "llm": 4.0, "root": 0.0}, {"encoder": 0, "llm": 0, "root": 0})
    _, seconds, _ = fsdp_op(Kind.F, slow, {"encoder": np.array([1.0]), "llm": np.array([2.0])}, 0.1)
    assert seconds[0] == pytest.approx(4.0 + 4.0 + 1.0)  # max(1.1, 4) + max(1.1, 4) + 1


def test_unit_chain_counts_each_neighbourhood():
    total, comm = unit_chain(["e", "e", "l"], {"e": 1.0, "l": 2.0}, {"e": 0.5, "l": 3.0}, {"e": 0.0, "l": 0.0}, 0.0)
    assert total == pytest.approx(1.0 + 3.0 + 2.0) and comm == pytest.approx(3.5)


def test_memory_per_parameter_as_the_frameworks_document(training):
    p, d = 1e9, 8
    per = lambda *a, **k: sum(state_bytes(p, 1, d, *a, training, **k)) / p  # noqa: E731
    assert per(0) == pytest.approx(16)                                   # ZeRO paper: 2 + 2 + 12
    assert per(0, fp32_grads=True) == pytest.approx(18)                  # Megatron DDP, fp32 main grads
    assert per(1, fp32_grads=True) == pytest.approx(6 + 12 / d)          # Megatron's distributed optimizer
    assert per(1) == pytest.approx(4 + 12 / d)
    bucket = training.bucket_params / p * 2                               # one bucket of bf16 gradients
    assert per(2) == pytest.approx(2 + 14 / d + bucket)
    layer, root = 2e8, 1e8
    held = sum(state_bytes(p, 1, d, 3, training, layer, root_params=root)) / p
    assert held == pytest.approx(16 / d + (root + 2 * layer) * 2 / p + layer * 2 / p)


def test_collectives_use_the_links_their_gpus_really_have(h100):
    cluster = ClusterSpec(hardware=h100, nodes=2, gpus_per_node=8)
    assert collective_link(cluster, range(8)) == (h100.intra_node_bandwidth, h100.intra_node_latency)
    # One ring per NIC: 8 GPUs per node move 8 NICs' worth between nodes, capped by NVLink.
    assert collective_link(cluster, range(16))[0] == pytest.approx(min(450e9, 8 * 50e9))
    assert collective_link(cluster, [0, 8]) == (h100.inter_node_bandwidth, h100.inter_node_latency)
    assert collective_link(cluster, [0, 1, 8])[0] == pytest.approx(h100.inter_node_bandwidth)


@pytest.fixture(scope="module")
def system_and_data(model, cluster):
    training = TrainingSpec(global_batch=64)
    return (System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training)),
            profile_mix("llava-ov", 2000, model.encoder).samples)


def colocated(tp, dp, m, **options):
    return Plan(encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, dp=dp), placement="colocated",
                microbatches=m, **options)


memory_options = st.fixed_dictionaries({
    "zero": st.sampled_from([0, 1, 2, 3]), "fp32_grads": st.booleans(),
    "recompute": st.sampled_from(["none", "selective", "full"])})
any_plan = st.one_of(
    st.builds(lambda tp, dp, m, o, hsdp: colocated(tp, dp, m, hsdp=hsdp and o["zero"] == 3, **o),
              st.sampled_from([1, 2, 4]), st.integers(2, 8), st.integers(1, 4), memory_options, st.booleans()),
    st.builds(lambda etp, edp, ltp, lpp, ldp, m, s, o: Plan(
        encoder=ModulePlan(tp=etp, dp=edp), llm=ModulePlan(tp=ltp, pp=lpp, dp=ldp), microbatches=m, schedule=s,
        **{**o, "zero": min(o["zero"], 1)}),
        st.sampled_from([1, 2]), st.integers(1, 4), st.sampled_from([2, 4]), st.integers(1, 3), st.integers(1, 2),
        st.integers(1, 5), st.sampled_from(["1F1B", "ZBH1"]), memory_options),
    st.builds(lambda tp, pp, dp, r, s, o: Plan(  # V schedules: DualPipeV's overlapped pairs beside the reduction
        encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp), placement="colocated",
        microbatches=2 * pp * r, schedule=s, virtual_stages=2, **{**o, "zero": min(o["zero"], 1)}),
        st.sampled_from([1, 2]), st.integers(2, 3), st.integers(2, 3), st.integers(1, 2),
        st.sampled_from(["ZBVZeroBubble", "DualPipeV"]), memory_options))


@given(any_plan, st.integers(0, 10_000), st.booleans())
def test_three_evaluators_agree_on_every_data_parallel_mode(model, cluster, system_and_data, plan, seed, measured):
    system, data = system_and_data
    assume(not plan.problems(cluster, model, 64))
    if measured:  # FSDP2's units priced as measured: inside the ops
        system = replace(system, cost=UnitsMeasured(model, cluster.hardware, system.training))
    rng = np.random.default_rng(seed)
    batch = data.take(rng.integers(0, len(data), 64))
    step = CostedPlan(plan, system).step(0, batch, rng.permutation(np.arange(64) % plan.bins))
    check_graph(step.graph)
    fast = evaluate(step.timing)
    _, end = longest_path(step.graph, step.costs)
    assert fast.step_ns == int(end.max()) == execute(step.graph, step.costs, contention=False).makespan
    kinds = [n.kind for n in step.graph.nodes]
    replicated = sum(g.replicas for g in step.graph.template.groups if g.replicas > 1)
    computes = sum(1 for n in step.graph.nodes if n.kind.is_compute)
    if plan.zero <= 1:
        assert kinds.count(Kind.REDUCE_GRAD) == replicated and Kind.UNSHARD not in kinds
    elif plan.zero == 2:  # one reduce-scatter per backward (one stage, one op per microbatch)
        assert kinds.count(Kind.REDUCE_GRAD) == (plan.microbatches * plan.llm.dp if plan.llm.dp > 1 else 0)
    else:  # a gather before every forward and backward, on every replica
        assert kinds.count(Kind.UNSHARD) == (computes if plan.llm.dp > 1 else 0)


def test_overlapped_communication_shows_in_the_trace(model, cluster, system_and_data):
    system, data = system_and_data
    batch = data.take(np.arange(64))
    for plan, expect in ((colocated(2, 4, 1, zero=0), "reduce_grad"), (colocated(2, 4, 2, zero=3), "overlapped")):
        runner = CostedPlan(plan, system)
        sim = simulate_steps(runner, [batch], lambda i, b: np.arange(len(b)) % plan.bins)
        events = [e for e in sim.trace["traceEvents"] if e.get("ph") == "X"]
        comm = [e for e in events if e["cat"] == expect]
        assert comm and all(e["tid"] == 1 for e in comm)
        last_compute = max(e["ts"] + e["dur"] for e in events if e["tid"] == 0)
        if expect == "reduce_grad":  # the bucketed reduction starts while the backward still runs
            assert all(e["ts"] < last_compute for e in comm)
        else:
            assert any(e["cat"] == "unshard" for e in events)


def test_hfu_counts_recomputation(model, cluster, system_and_data):
    system, data = system_and_data
    batch = data.take(np.arange(64))
    ratios = {}
    for recompute in ("none", "full"):
        plan = colocated(2, 4, 2, recompute=recompute)
        runner = CostedPlan(plan, system)
        timing = runner.step(0, batch, np.arange(64) % plan.bins).timing
        mfu, hfu = summarize(timing, evaluate(timing)).utilisation(cluster.hardware.peak_flops)
        ratios[recompute] = hfu / mfu
        traced = simulate_steps(runner, [batch], lambda i, b: np.arange(len(b)) % plan.bins, contention=False)
        assert traced.metrics.hfu / traced.metrics.mfu == pytest.approx(ratios[recompute])  # the trace agrees
    assert ratios["none"] == pytest.approx(1.0)
    assert 1.25 < ratios["full"] < 4 / 3  # one more forward of every layer (not the head) in 3 passes


def test_peak_memory_holds_the_transients(model, cluster, system_and_data):
    system, data = system_and_data
    batch = data.take(np.arange(64))
    plan = colocated(1, 8, 1, zero=1)
    step = CostedPlan(plan, system).step(0, batch, np.arange(64) % plan.bins)
    summary = summarize(step.timing, evaluate(step.timing))
    simulated = execute(step.graph, step.costs)
    assert summary.peak_memory.max() == pytest.approx(simulated.peak.max())
    with_logits = step.timing.static_bytes[0] + step.timing.alloc[0] + step.timing.transient[1]
    assert summary.peak_memory.max() == pytest.approx(with_logits.max())  # F holds, B adds the logits' gradient
