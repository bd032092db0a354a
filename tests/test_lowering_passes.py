"""Each lowering pass on its own: what it adds, checked against torch's own passes where torch has one."""

from dataclasses import replace

import pytest
from hypothesis import given, settings

from dflop.program.actions import Kind
from dflop.program.graph_check import check_graph, dry_run
from dflop.program.lowering import (add_send_recv, defer_receives, hoist_for_rendezvous, lower, place_actions,
                                    place_collectives)
from dflop.program.schedules import build
from dflop.program.template import build_template
from dflop.specs import ModulePlan, Plan
from test_programs import schedules


def single(name, pp, m, v):
    program = build(name, pp, m, v)
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=pp), placement="colocated", microbatches=m,
                schedule=program.name, virtual_stages=v)
    return program, build_template(plan, program)


def torch_lowering(program, defer):
    """torch's _add_send_recv (then _defer_recv_ops), per rank, as text, an overlapped pair as its halves."""
    from torch.distributed.pipelining.schedules import _Action, _add_send_recv, _defer_recv_ops

    compute = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(program.ranks)}
    owner = program.stage_to_rank
    lowered = _add_send_recv(compute, lambda s: owner[s], program.stages)
    if defer:
        lowered = _defer_recv_ops(lowered, lambda s: owner[s])
    return [[str(p) for a in lowered[r] for p in (a.sub_actions or (a,))] for r in sorted(lowered)]


def labels(linked):
    return [[linked.nodes[n].label for n in ids] for ids in linked.order]


@given(schedules())
def test_place_actions_gives_every_worker_its_groups_ops_in_program_order_pairs_together(spec):
    program, template = single(*spec)
    placed = place_actions(template)
    for w, units in zip(placed.workers, placed.units):
        assert [i for u in units for i in u] == [o.index for o in template.ops if o.group == w.group]
        for u in units:
            assert len(u) == 1 or (len(u) == 2 and template.ops[u[0]].overlap == u[1])
    assert sum(len(u) for u in placed.units) == sum(len(row) for row in program.ranks)


@given(schedules())
@settings(max_examples=60)
def test_add_send_recv_places_communication_as_torch_does(spec):
    program, template = single(*spec)
    linked = add_send_recv(place_actions(template))
    assert labels(linked) == torch_lowering(program, defer=False)
    for recv, send in linked.send_of.items():  # a receive is always posted on the sender's peer
        assert linked.nodes[recv].worker == linked.nodes[send].peer


@given(schedules())
@settings(max_examples=60)
def test_defer_receives_moves_receives_as_torch_does(spec):
    program, template = single(*spec)
    linked = add_send_recv(place_actions(template))
    deferred = defer_receives(linked)
    assert labels(deferred) == torch_lowering(program, defer=True)
    assert [sorted(ids) for ids in deferred.order] == [sorted(ids) for ids in linked.order]  # only reordered


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_place_collectives_puts_gathers_before_and_reductions_after_the_compute_they_serve(zero):
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=zero)
    linked = defer_receives(add_send_recv(place_actions(build_template(plan))))
    graph = place_collectives(linked)
    nodes = graph.nodes
    assert graph.nodes[:len(linked.nodes)] == linked.nodes
    unshards = [n for n, node in enumerate(nodes) if node.kind is Kind.UNSHARD]
    anchored = [n for n, a in enumerate(graph.anchor) if a >= 0]
    assert bool(unshards) == (zero == 3) and bool(anchored) == (zero < 3)
    assert len(graph.collectives) == len(unshards + anchored) // 2
    for n in unshards:
        ids = graph.order[nodes[n].worker]
        after = ids[ids.index(n) + 1]
        assert nodes[after].kind.is_compute and nodes[after].op == nodes[n].op and n in graph.inputs[after]
    for n, a in enumerate(graph.anchor):
        if a >= 0:
            ids = graph.order[nodes[n].worker]
            between = ids[ids.index(a) + 1:ids.index(n)]
            assert nodes[a].kind.is_compute and not any(nodes[k].kind.is_compute for k in between)
    for members in graph.collectives:
        workers = [nodes[m].worker for m in members]
        assert len(set(workers)) == len(workers) == 2  # one per replica of the pipeline rank
    check_graph(hoist_for_rendezvous(graph))


def test_hoist_for_rendezvous_releases_1f1b_from_waiting_on_blocking_sends():
    """torch's placement of 1F1B on two ranks has w0 send microbatch 1 before posting the receive of
    microbatch 0's gradient and w1 send that gradient before posting microbatch 1's receive."""
    _, template = single("1F1B", 2, 2, 1)
    before = place_collectives(defer_receives(add_send_recv(place_actions(template))))
    _, waits = dry_run(before)
    assert waits == ["w0 waits at 0SEND_F1 for w1 to post 1RECV_F1", "w1 waits at 1SEND_B0 for w0 to post 0RECV_B0"]
    after = hoist_for_rendezvous(before)
    assert dry_run(after)[1] == []
    assert after == replace(before, order=after.order) and after.order != before.order
    moved = [[n for n in ids if not after.nodes[n].kind.is_recv] for ids in after.order]
    assert moved == [[n for n in ids if not before.nodes[n].kind.is_recv] for ids in before.order]
    assert lower(template) == after
