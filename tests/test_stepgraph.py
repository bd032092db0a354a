"""The step graph: lowered as torch lowers pipelines, complete, and deadlock-free under blocking sends."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.program.actions import Kind
from dflop.program.check import ProgramError
from dflop.program.graph_check import check_graph, dry_run
from dflop.program.schedules import build
from dflop.program.lowering import lower
from dflop.timing.steps import CostedPlan
from dflop.program.template import build_template
from dflop.specs import ModulePlan, Plan, TrainingSpec
from dflop.workload import profile_mix
from test_programs import schedules


def single_pipeline(name, pp, m, v):
    program = build(name, pp, m, v)
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=pp), placement="colocated", microbatches=m,
                schedule=program.name, virtual_stages=v)
    return program, lower(build_template(plan, program))


def without_receives(graph, order):
    return [[graph.labels[n] for n in ids if not graph.nodes[n].kind.is_recv] for ids in order]


@given(schedules())
def test_one_pipeline_is_lowered_as_torch_lowers_it_made_safe_for_blocking_sends(spec):
    """torch's _add_send_recv + _defer_recv_ops, except that a receive is posted earlier where two
    blocking sends would wait on each other; where torch's placement is safe, exactly torch's."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _defer_recv_ops

    program, graph = single_pipeline(*spec)
    check_graph(graph)
    compute = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(program.ranks)}
    owner = program.stage_to_rank
    theirs = _defer_recv_ops(_add_send_recv(compute, lambda s: owner[s], program.stages), lambda s: owner[s])
    node_of = {(graph.nodes[n].worker, label): n for n, label in enumerate(graph.labels)}
    parts = lambda a: a.sub_actions or (a,)  # noqa: E731 - an overlapped pair is two nodes here
    torch_graph = replace(graph, order=tuple(tuple(node_of[(r, str(p))] for a in theirs[r] for p in parts(a))
                                             for r in sorted(theirs)))
    assert without_receives(graph, graph.order) == without_receives(graph, torch_graph.order)
    _, waits = dry_run(torch_graph)
    if not waits:
        assert graph.order == torch_graph.order
    for ours, torch_ids in zip(graph.order, torch_graph.order):  # receives only move earlier
        for n in ours:
            if graph.nodes[n].kind.is_recv:
                before = lambda ids: sum(1 for k in ids[:ids.index(n)] if not graph.nodes[k].kind.is_recv)  # noqa
                assert before(ours) <= before(torch_ids)


def test_torch_placement_of_1f1b_would_deadlock_with_blocking_sends():
    """Why the hoisting exists: w0 sends microbatch 1 before it posts the receive of microbatch 0's
    gradient, and w1 sends that gradient before it posts the receive of microbatch 1."""
    _, graph = single_pipeline("1F1B", 2, 2, 1)
    labels = graph.labels
    w1 = list(graph.order[1])
    assert [labels[n] for n in w1][2:5] == ["1B0", "1RECV_F1", "1SEND_B0"]  # posted before the send
    w1.remove(labels.index("1RECV_F1"))  # where torch puts it: just before its consumer
    w1.insert(w1.index(labels.index("1F1")), labels.index("1RECV_F1"))
    torch_like = replace(graph, order=(graph.order[0], tuple(w1)))
    _, waits = dry_run(torch_like)
    assert waits == ["w0 waits at 0SEND_F1 for w1 to post 1RECV_F1", "w1 waits at 1SEND_B0 for w0 to post 0RECV_B0"]
    with pytest.raises(ProgramError, match="deadlocks with blocking sends: w0 waits at 0SEND_F1") as err:
        check_graph(torch_like)
    assert "\n" not in str(err.value) and "1SEND_B0" in err.value.details


@pytest.fixture(scope="module")
def system_and_data(model, cluster):
    training = TrainingSpec(global_batch=128, recompute="full")
    return (System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training)),
            profile_mix("llava-ov", 2000, model.encoder).samples)


plans = st.one_of(
    st.builds(lambda etp, edp, epp, ltp, lpp, ldp, m, s: Plan(
        encoder=ModulePlan(tp=etp, pp=epp, dp=edp), llm=ModulePlan(tp=ltp, pp=lpp, dp=ldp),
        microbatches=m, schedule=s),
        st.sampled_from([1, 2]), st.integers(1, 4), st.integers(1, 2), st.sampled_from([1, 2, 4]),
        st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.sampled_from(["1F1B", "ZBH1", "GPipe"])),
    st.builds(lambda tp, pp, dp, r, v: Plan(
        encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp), placement="colocated",
        microbatches=pp * r, schedule="Interleaved1F1B" if v > 1 else "1F1B", virtual_stages=v),
        st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 2)))


@given(plans, st.integers(0, 10_000))
def test_every_plan_lowers_to_a_complete_deadlock_free_graph(model, cluster, system_and_data, plan, seed):
    system, data = system_and_data
    assume(not plan.problems(cluster, model, 128))
    rng = np.random.default_rng(seed)
    batch = data.take(rng.integers(0, len(data), 48))
    step = CostedPlan(plan, system).step(0, batch, rng.permutation(np.arange(48) % plan.bins))
    graph = step.graph
    check_graph(graph)
    kinds = [n.kind for n in graph.nodes]
    assert kinds.count(Kind.REDUCE_GRAD) == sum(g.replicas for g in graph.template.groups if g.replicas > 1)
    if not plan.colocated:  # every LLM replica hears from the encoder replicas holding its images
        sends = {(graph.workers[n.worker].replica, graph.workers[n.peer].replica, n.microbatch)
                 for n in graph.nodes if n.kind is Kind.BRIDGE_SEND_F}
        assert sends == {(j, r, k) for k, pairs in enumerate(graph.routes.pairs) for j, r in pairs}


def test_a_missing_receive_is_reported():
    _, graph = single_pipeline("GPipe", 2, 1, 1)
    labels = graph.labels
    order = [tuple(n for n in ids if labels[n] != "1RECV_F0") for ids in graph.order]
    with pytest.raises(ProgramError, match=r"incomplete: w1 1RECV_F0 appears 0 times in its worker's order"):
        check_graph(replace(graph, order=tuple(order)))
