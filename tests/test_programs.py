import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.errors import DflopError
from dflop.program.actions import Action, Kind, Program
from dflop.program.check import ProgramError, check_program, dependency_graph
from dflop.program.lowering import add_send_recv, defer_receives, place_actions, place_collectives
from dflop.program.schedules import build, canonical
from dflop.program.template import build_template
from dflop.specs import ModulePlan, Plan


def schedules():
    """(name, pp, m, v) of every registered schedule, over the shapes each supports."""
    plain = st.tuples(st.sampled_from(["GPipe", "1F1B", "ZBH1"]), st.integers(1, 8), st.integers(1, 16),
                      st.just(1))
    rounds = st.integers(1, 4)
    interleaved = st.tuples(st.sampled_from(["Interleaved1F1B", "InterleavedZeroBubble"]),
                            st.integers(1, 6), rounds, st.integers(1, 4)).map(
        lambda t: (t[0], t[1], t[1] * t[2], t[3]))
    looped = st.tuples(st.just("LoopedBFS"), st.integers(1, 6), st.integers(1, 12), st.integers(1, 4))
    zbv = st.tuples(st.just("ZBVZeroBubble"), st.integers(1, 6), st.integers(1, 16), st.just(2))
    dual = st.tuples(st.just("DualPipeV"), st.integers(1, 5), st.integers(0, 12), st.just(2)).map(
        lambda t: (t[0], t[1], 2 * t[1] + t[2], 2))
    return st.one_of(plain, interleaved, looped, zbv, dual)


def lowered(program):
    """The program with the sends and receives torch's lowering places (the passes up to
    ``hoist_for_rendezvous``, whose early receives a checker with blocking receives would not
    accept), in torch's text form (the halves of an overlapped pair as two actions)."""
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=program.num_ranks), placement="colocated",
                microbatches=program.microbatches, schedule=program.name,
                virtual_stages=program.stages // program.num_ranks)
    linked = defer_receives(add_send_recv(place_actions(build_template(plan, program))))
    graph = place_collectives(linked)
    ranks = tuple(tuple(Action.parse(graph.labels[n]) for n in ids) for ids in graph.order)
    return Program(program.name, program.stages, program.microbatches, program.stage_to_rank, ranks)


@given(schedules())
def test_every_schedule_is_complete_and_deadlock_free(spec):
    name, pp, m, v = spec
    program = build(name, pp, m, v)
    assert program.stages == pp * v and program.num_ranks == pp
    check_program(program)
    check_program(lowered(program))


@given(schedules())
def test_text_and_csv_round_trip(spec):
    program = build(*spec)
    assert all(Action.parse(str(a)) == a for row in program.ranks for a in row)
    again = Program.from_csv(program.to_csv(), name=program.name)
    assert again == program
    text = lowered(program)
    assert Program.from_csv(text.to_csv(), name=program.name) == text


def test_lowering_adds_matching_sends_and_receives():
    program = lowered(build("1F1B", 3, 4))
    kinds = [a.kind for row in program.ranks for a in row]
    # 2 boundaries x 4 microbatches, forward and backward.
    for kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
        assert kinds.count(kind) == 8
    first = program.ranks[1]
    assert first[first.index(Action(1, Kind.F, 0)) - 1] == Action(1, Kind.RECV_F, 0)


def test_one_f_one_b_keeps_few_microbatches_in_flight():
    program = build("1F1B", 4, 16)
    for rank, row in enumerate(program.ranks):
        inflight = peak = 0
        for a in row:
            inflight += 1 if a.kind is Kind.F else -1
            peak = max(peak, inflight)
        assert peak == 4 - rank


def test_missing_action_is_reported():
    program = build("GPipe", 2, 3)
    broken = Program(program.name, 2, 3, program.stage_to_rank,
                     (program.ranks[0], tuple(a for a in program.ranks[1] if str(a) != "1B2")))
    with pytest.raises(ProgramError, match=r"incomplete: stage 1 microbatch 2 has B x0"):
        check_program(broken)


def test_deadlock_is_reported_as_a_step_table():
    # Rank 1 runs microbatch 1 first; rank 0 runs 0B0 before 0F1: each waits for the other.
    ranks = (tuple(map(Action.parse, ["0F0", "0B0", "0F1", "0B1"])),
             tuple(map(Action.parse, ["1F1", "1B1", "1F0", "1B0"])))
    program = Program("custom", 2, 2, (0, 1), ranks)
    with pytest.raises(ProgramError) as err:
        check_program(program)
    message = str(err.value)
    assert "deadlocks" in message and "rank 0 waits at 0B0 for 1B0" in message
    assert "rank 1 waits at 1F1 for 0F1" in message and "\n" not in message
    table = err.value.details
    assert table.splitlines()[0].startswith("step") and "0F0" in table


def test_backward_before_forward_on_one_rank_is_a_cycle():
    program = Program("bad", 1, 1, (0,), ((Action.parse("0B0"), Action.parse("0F0")),))
    graph = dependency_graph(program)
    assert graph.has_edge(Action.parse("0F0"), Action.parse("0B0"))
    with pytest.raises(ProgramError, match="deadlocks"):
        check_program(program)


def test_schedule_names_are_case_insensitive_and_listed():
    assert canonical("interleaved1f1b") == "Interleaved1F1B"
    with pytest.raises(DflopError, match=r"unknown pipeline schedule 'PipeDream' \(known: GPipe, 1F1B"):
        build("PipeDream", 2, 2)
    with pytest.raises(DflopError, match="one stage per rank"):
        build("1F1B", 2, 4, 2)
    with pytest.raises(DflopError, match="multiple of the number of rounds"):
        build("Interleaved1F1B", 4, 9, 2)  # two rounds of 4 cannot hold 9
    with pytest.raises(DflopError, match="invalid action 'xF1'"):
        Action.parse("xF1")
