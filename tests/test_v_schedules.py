"""V placement and DualPipeV's overlapped step: checker, template, simulator, memory.

The closed forms are the DualPipe README's table ("Pipeline Bubbles and Memory
Usage Comparison", deepseek-ai/DualPipe), with PP the number of stages (2p for
a V on p ranks), F, B and W the times of one stage's forward, full backward and
weight-gradient backward, and F&B the time of an overlapped pair.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.errors import DflopError
from dflop.plan.evaluate import inflight
from dflop.program.actions import Action, Kind, Program
from dflop.program.check import ProgramError, check_program
from dflop.timing.costing import stage_times_timing
from dflop.timing.overlap import with_overlap
from dflop.program.schedules import build, stages_per_rank
from dflop.program.template import build_template
from dflop.sim import simulate_pipeline
from dflop.specs import ModulePlan, Plan
from dflop.trace.metrics import metrics

US = 1e-6  # whole microseconds convert to exact nanoseconds


def idle(result) -> list[float]:
    """Per rank: step time minus busy time, seconds."""
    return [result.step_time - b for b in metrics(result.trace).busy_s]


def program(*rows: str) -> Program:
    """A program from CSV rows, ``(a;b)`` standing for ``(a;b)OVERLAP_F_B``."""
    return Program.from_csv("\n".join(rows).replace(")", ")OVERLAP_F_B"))


# ---- the checker ---------------------------------------------------------------------------------

def test_completeness_counts_the_sub_actions_of_an_overlapped_step():
    good = program("0F0,(0F1;0B0),0B1", "1F0,1B0,1F1,1B1")
    check_program(good)
    missing = program("0F0,(0F1;0W0),0B1", "1F0,1B0,1F1,1B1")
    with pytest.raises(ProgramError, match=r"stage 0 microbatch 0 has B x0, I x0, W x1"):
        check_program(missing)
    twice = program("0F0,(0F1;0B0),0F1,0B1", "1F0,1B0,1F1,1B1")
    with pytest.raises(ProgramError, match=r"0F1 appears 2 times"):
        check_program(twice)


def test_an_overlapped_step_starts_only_once_all_its_inputs_are_there():
    # Run apart, 0F1 then 0B0 would be fine; together, the step waits for 1B0, which rank 1 runs
    # only after 1F1, which needs 0F1 from inside the step.
    apart = program("0F0,0F1,0B0,0B1", "1F0,1F1,1B0,1B1")
    check_program(apart)
    together = program("0F0,(0F1;0B0),0B1", "1F0,1F1,1B0,1B1")
    with pytest.raises(ProgramError, match=r"rank 0 waits at \(0F1;0B0\)OVERLAP_F_B for 1B0; "
                                           r"rank 1 waits at 1F1 for 0F1"):
        check_program(together)


def test_a_sub_action_may_use_an_earlier_sibling_but_not_a_later_one():
    check_program(program("(0F0;0B0)"))
    with pytest.raises(ProgramError, match=r"rank 0 waits at \(0B0;0F0\)OVERLAP_F_B for 0F0"):
        check_program(program("(0B0;0F0)"))


def test_malformed_overlapped_steps_are_refused_in_one_line():
    for text, why in [("(0F1)OVERLAP_F_B", "needs two sub-actions"),
                      ("(0F1;1SEND_F1)OVERLAP_F_B", "needs two sub-actions of kind F, B, I or W"),
                      ("(0F1;1B0;2B0)OVERLAP_F_B", "needs two sub-actions"),
                      ("0F1;1B0", "invalid action")]:
        with pytest.raises(DflopError, match=why):
            Action.parse(text)


# ---- the template ----------------------------------------------------------------------------------

def v_plan(name: str, p: int, m: int) -> Plan:
    return Plan(encoder=ModulePlan(), llm=ModulePlan(pp=p), placement="colocated", microbatches=m,
                schedule=name, virtual_stages=2)


def test_template_lays_out_each_overlapped_step_as_a_marked_pair():
    template = build_template(v_plan("DualPipeV", 3, 8))
    assert [g.stages for g in template.groups] == [(0, 5), (1, 4), (2, 3)]
    pairs = [op for op in template.ops if op.overlap > op.index]
    overlaps = sum(1 for row in template.program.ranks for a in row if a.sub_actions)
    assert len(pairs) == overlaps > 0
    for first in pairs:
        second = template.ops[first.overlap]
        assert second.overlap == first.index and second.prev == first.index
        assert (first.action.kind, second.action.kind) == (Kind.F, Kind.B)
        assert first.action.stage + second.action.stage == 5  # one arm of the V forward, the other back


# ---- the simulator against the closed forms ----------------------------------------------------------

def dual_pipe_v(p, m, F, I, W, overlap):  # noqa: E741
    return simulate_pipeline([F] * (2 * p), [I] * (2 * p), bwd_weight=[W] * (2 * p), schedule="DualPipeV",
                             microbatches=m, overlap=overlap)


@given(p=st.integers(1, 6), extra=st.integers(0, 10), f=st.integers(1, 500), w=st.integers(1, 500))
def test_overlapped_dual_pipe_v_bubble_is_the_readme_closed_form(p, extra, f, w):
    # The form holds where the input-gradient half of a backward costs what a forward does.
    F, I, W = max(f, w) * US, max(f, w) * US, min(f, w) * US  # noqa: E741
    B = I + W
    result = dual_pipe_v(p, 2 * p + extra, F, I, W, "overlapped")
    assert max(idle(result)) == pytest.approx((p - 1) * (max(F, B) + B - 3 * W), abs=1e-12)


@given(p=st.integers(1, 6), extra=st.integers(0, 10), times=st.lists(st.integers(1, 500), min_size=3, max_size=3))
def test_sequential_dual_pipe_v_bubble_is_zb1p_form_plus_a_held_forward(p, extra, times):
    # Run back to back as torch runs it, the pair is one unit whose sends leave after both halves:
    # every rank idles the DualPipe README's ZB1P row with one stage's times, (p-1)(F+B-2W), plus
    # (p-1)F, the forward output held while the backward half runs (W <= I <= F <= I + W).
    W, I, F = sorted(times)  # noqa: E741
    F = min(F, I + W)
    W, I, F, B = W * US, I * US, F * US, (I + W) * US  # noqa: E741
    m = 2 * p + extra
    result = dual_pipe_v(p, m, F, I, W, "sequential")
    bubble = (p - 1) * (F + B - 2 * W) + (p - 1) * F
    assert idle(result) == pytest.approx([bubble] * p, abs=1e-12)
    assert result.step_time == pytest.approx(2 * m * (F + B) + bubble, rel=1e-12)


@given(p=st.integers(1, 6), extra=st.integers(0, 10), t=st.integers(1, 500))
def test_zbv_with_equal_times_idles_only_while_the_pipe_fills(p, extra, t):
    m = 2 * p - 1 + extra  # the form needs the 2p-1 microbatches torch generates at least
    result = simulate_pipeline([t * US] * (2 * p), [t * US] * (2 * p), bwd_weight=[t * US] * (2 * p),
                               schedule="zbvzerobubble", microbatches=m, virtual_stages=2)
    # The last rank's first forward waits for p-1 forwards; with F = I = W nothing else idles.
    assert idle(result) == pytest.approx([(p - 1) * t * US] * p, abs=1e-12)


@given(p=st.integers(1, 5), v=st.integers(1, 4), extra=st.integers(0, 8), unit=st.integers(1, 300))
def test_looped_bfs_has_interleaved_bubble_once_a_round_fills_the_pipe(p, v, extra, unit):
    m = p + extra
    f, b = v * unit * US, 2 * v * unit * US  # per full stage; each of the v chunks takes 1/v
    result = simulate_pipeline([f / v] * (p * v), [b / v] * (p * v), schedule="LoopedBFS",
                               microbatches=m, virtual_stages=v)
    assert result.step_time == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v, rel=1e-9)


def test_the_issue_example_v_schedules_cut_interleaved_bubble_to_a_third():
    p, m = 4, 8
    one = np.full(2 * p, 0.5)  # F = 1, I = 1, W = 1 per rank, two stages per rank
    interleaved = simulate_pipeline(one, 2 * one, schedule="Interleaved1F1B", microbatches=m, virtual_stages=2)
    zbv = simulate_pipeline(one, one, bwd_weight=one, schedule="ZBVZeroBubble", microbatches=m)
    dual = simulate_pipeline(one, one, bwd_weight=one, schedule="DualPipeV", microbatches=m, overlap="overlapped")
    busy = 2 * m * 1.5
    assert (interleaved.step_time - busy) / busy == pytest.approx(0.1875)  # 18.8%
    assert (zbv.step_time - busy) / busy == pytest.approx(0.0625)  # 6.2%
    assert max(idle(dual)) == pytest.approx(4.5 / 3)


@given(st.integers(1, 4), st.integers(0, 4), st.integers(0, 10_000))
def test_overlapping_never_slows_a_step_and_keeps_each_pair_at_max_f_b(p, extra, seed):
    rng = np.random.default_rng(seed)
    m = 2 * p + extra
    f, i, w = (rng.integers(1, 5000, size=(2 * p, m)) * US for _ in range(3))
    args = dict(bwd_weight=w, schedule="DualPipeV", p2p=float(rng.integers(0, 3000)) * US)
    sequential = simulate_pipeline(f, i, **args)
    overlapped = simulate_pipeline(f, i, overlap="overlapped", **args)
    assert overlapped.step_time <= sequential.step_time
    template = build_template(v_plan("DualPipeV", p, m))
    timing = stage_times_timing(template, f, i, w)
    paired = with_overlap(timing, "overlapped")
    for op in template.ops:
        if op.overlap > op.index:
            a, b = timing.duration[op.index][0], timing.duration[op.overlap][0]
            assert paired.duration[op.index][0] + paired.duration[op.overlap][0] == max(a, b)


def test_simulate_pipeline_refuses_bad_overlap_and_stage_counts():
    with pytest.raises(DflopError, match=r"^overlap: 'parallel' is not one of sequential, overlapped$"):
        simulate_pipeline([1.0] * 4, [1.0] * 4, schedule="DualPipeV", microbatches=4, overlap="parallel")
    with pytest.raises(DflopError, match="5 stages do not make whole ranks of 2 stages"):
        simulate_pipeline([1.0] * 5, [1.0] * 5, schedule="ZBVZeroBubble", microbatches=4)
    with pytest.raises(DflopError, match="runs exactly 2 stages per rank"):
        simulate_pipeline([1.0] * 4, [1.0] * 4, schedule="DualPipeV", microbatches=8, virtual_stages=1)


# ---- memory ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_memory_per_device_matches_the_readme_table_at_the_same_number_of_stages(pp):
    # DualPipeV: PP stages on PP/2 devices, parameters 2x (a rank holds two of the stages, each
    # stored once) and activations PP+1 per device; 1F1B and ZB1P: PP stages on PP devices,
    # parameters 1x and activations PP.
    assert stages_per_rank("DualPipeV") == 2 * stages_per_rank("1F1B") == 2 * stages_per_rank("ZBH1")
    assert max(inflight("DualPipeV", pp, 4 * pp, 2)) == pp + 1
    assert max(inflight("1F1B", pp, 4 * pp, 1)) == max(inflight("ZBH1", pp, 4 * pp, 1)) == pp
    assert max(inflight("ZBVZeroBubble", pp, 4 * pp, 2)) == pp  # ZB-V: 1F1B's activation memory


def test_a_v_rank_holds_activations_of_both_its_stages():
    program_ = build("ZBVZeroBubble", 3, 9)
    for rank in range(3):
        stages = {a.stage for a in program_.parts(rank) if a.kind is Kind.F}
        assert stages == {rank, 5 - rank}
    assert inflight("ZBVZeroBubble", 6, 9, 2) == (6, 6, 6)  # first arm fills, then the second
