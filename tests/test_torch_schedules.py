"""dflop's schedules against torch.distributed.pipelining's own generators.

torch builds every rank's compute order in the schedule's constructor, from the
stage objects' ``group_size``, ``group_rank`` and ``num_stages`` alone; stand-in
stages with those fields (and no process group) are enough to read
``pipeline_order``, the reference these tests compare with, action for action.
"""

import logging
from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from dflop.errors import DflopError
from dflop.program.actions import Action, Program
from dflop.program.check import check_program
from dflop.program.placement import StagePlacement
from dflop.program.schedules import build, canonical, placement, stages_per_rank
from test_programs import lowered

logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)

TORCH = {"LoopedBFS": torch_schedules.ScheduleLoopedBFS,
         "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
         "DualPipeV": torch_schedules.ScheduleDualPipeV,
         "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
         "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble}


def torch_schedule(name: str, pp: int, m: int, v: int):
    stages = [SimpleNamespace(stage_index=i * pp, num_stages=pp * v, group_size=pp, group_rank=0, submod=None,
                              is_first=i == 0, is_last=False, stage_index_to_group_rank=None) for i in range(v)]
    return TORCH[name](stages, m)


def torch_order(name: str, pp: int, m: int, v: int) -> list[list[str]]:
    """torch's per-rank compute order as text, padding (None) left out."""
    schedule = torch_schedule(name, pp, m, v)
    return [[str(a) for a in schedule.pipeline_order[r] if a is not None] for r in range(pp)]


def dflop_order(program: Program) -> list[list[str]]:
    return [[str(a) for a in row] for row in program.ranks]


GRID = [(pp, m) for pp in range(1, 7) for m in range(1, 21)]


@pytest.mark.parametrize("name,v", [("LoopedBFS", 1), ("LoopedBFS", 2), ("LoopedBFS", 3),
                                    ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_orders_match_torch_wherever_torch_accepts(name, v):
    compared = 0
    for pp, m in GRID:
        try:
            expected = torch_order(name, pp, m, v)
        except ValueError as err:  # outside torch's constraints: dflop refuses too, in one line
            with pytest.raises(DflopError) as ours:
                build(name, pp, m, v)
            assert "\n" not in str(ours.value) and "microbatches" in str(err)
            continue
        program = build(name, pp, m, v)
        assert dflop_order(program) == expected, (name, pp, m, v)
        assert program.stages == pp * v and program.num_ranks == pp
        check_program(program)
        check_program(lowered(program))
        compared += 1
    assert compared >= 78  # DualPipeV, the most constrained: m >= 2p


@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble"])
def test_existing_looped_schedules_still_match_torch(name):
    for pp, rounds, v in [(2, 1, 2), (3, 2, 2), (4, 2, 2), (4, 1, 3), (2, 3, 4)]:
        assert dflop_order(build(name, pp, pp * rounds, v)) == torch_order(name, pp, pp * rounds, v)


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize("v", [1, 3])
def test_v_schedules_need_exactly_two_stages_per_rank_like_torch(name, v):
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        torch_order(name, 4, 16, v)
    with pytest.raises(DflopError, match=rf"^{name} runs exactly 2 stages per rank \(V placement\), "
                                         rf"got virtual_stages={v}$"):
        build(name, 4, 16, v)


def test_dual_pipe_v_needs_as_many_microbatches_as_stages():
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        torch_order("DualPipeV", 4, 7, 2)
    with pytest.raises(DflopError, match=r"^DualPipeV needs at least as many microbatches as stages "
                                         r"\(2 x 4 = 8\), got 7$"):
        build("DualPipeV", 4, 7)


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_v_placement_matches_torch_and_is_the_default(name):
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    assert placement(name) is StagePlacement.V and stages_per_rank(name) == 2
    for pp in range(1, 7):
        program = build(name, pp, 4 * pp)  # two stages per rank without being told
        reference = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        assert program.stage_to_rank == tuple(reference[s] for s in range(2 * pp))
        assert all(program.stages_of(r) == (r, 2 * pp - 1 - r) for r in range(pp))


def test_names_resolve_case_insensitively_like_get_schedule_class():
    for name in ("LoopedBFS", "ZBVZeroBubble", "DualPipeV", "Interleaved1F1B", "GPipe", "1F1B"):
        for spelled in (name.lower(), name.upper(), f" {name} "):
            assert canonical(spelled) == name
            assert torch_schedules.get_schedule_class(spelled.strip()).__name__ in (f"Schedule{name}", name)
    assert placement("loopedbfs") is StagePlacement.LOOP and stages_per_rank("LoopedBFS", 3) == 3
    with pytest.raises(DflopError, match=r"unknown pipeline schedule 'DualPipe' \(known: .*ZBVZeroBubble, "
                                         r"DualPipeV\)"):
        build("DualPipe", 4, 8)


def test_overlapped_step_text_matches_torch_and_round_trips_through_csv(tmp_path):
    program = build("DualPipeV", 3, 8)
    overlaps = [a for row in program.ranks for a in row if a.sub_actions]
    text = str(overlaps[0])
    assert text == str(torch_schedules._Action.from_str(text)) == "(0F5;5B2)OVERLAP_F_B"
    assert Action.parse(text) == overlaps[0] and overlaps[0].parts == (Action.parse("0F5"), Action.parse("5B2"))
    again = Program.from_csv(program.to_csv(), name=program.name)
    assert again == program
    text = lowered(program)
    assert Program.from_csv(text.to_csv(), name=program.name) == text
    (tmp_path / "dualpipev.csv").write_text(program.to_csv())
    schedule = torch_schedule("DualPipeV", 3, 8, 2)
    schedule._load_csv(str(tmp_path / "dualpipev.csv"), format="compute_only")  # torch reads our CSV back
    assert [[str(a) for a in schedule.pipeline_order[r]] for r in range(3)] == dflop_order(program)
