"""The facts of every pipeline schedule live in one table (dflop.specs.schedule_kinds): the program
registry builds exactly its schedules and reads its facts, and a plan is checked against the same
facts, not against patterns in the names."""

import pytest

from dflop.errors import DflopError, PlanError
from dflop.program.placement import StagePlacement
from dflop.program.schedules import SCHEDULES, build, schedule_kind
from dflop.specs import ModulePlan, Placement, Plan, presets
from dflop.specs.hardware import ClusterSpec
from dflop.specs.schedule_kinds import SCHEDULE_FACTS, schedule_facts

CLUSTER = ClusterSpec(hardware=presets.hardware("h100"), nodes=1, gpus_per_node=8)
MODEL = presets.model("siglip-so400m", "qwen2.5-7b")


def test_the_registry_builds_exactly_the_tables_schedules_with_their_facts():
    assert list(SCHEDULES) == list(SCHEDULE_FACTS)
    for key, facts in SCHEDULE_FACTS.items():
        kind = schedule_kind(facts.name.upper())
        assert kind.facts is facts and kind.name == facts.name
        v = facts.stages_per_rank or 2
        program = build(facts.name, 4, 8, v)
        assert program.stages == 4 * v
        assert kind.placement is (StagePlacement.V if facts.v_shape else StagePlacement.LOOP)
        assert any(a.kind.name == "W" for rank in program.ranks for a in rank) == facts.splits_backward, key


def test_an_unknown_schedule_lists_the_tables_names():
    with pytest.raises(DflopError, match=r"^unknown pipeline schedule 'Zigzag' \(known: GPipe, 1F1B, "
                                         r"Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBH1, "
                                         r"ZBVZeroBubble, DualPipeV\)$"):
        schedule_facts("Zigzag")


@pytest.mark.parametrize("name", [f.name for f in SCHEDULE_FACTS.values()])
def test_a_plan_with_one_virtual_stage_is_refused_exactly_for_the_interleaved_schedules(name):
    """Checked against the fact, whatever the name's case: ``interleaved1f1b`` as well."""
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=2), llm=ModulePlan(tp=2, pp=2, dp=1), microbatches=4,
                schedule=name.lower(), virtual_stages=1, placement=Placement.DISAGGREGATED)
    problems = plan.problems(CLUSTER, MODEL)
    refused = any("with one virtual stage is not interleaved" in p for p in problems)
    assert refused == schedule_facts(name).interleaved
    if refused:
        with pytest.raises(PlanError, match=f"{name.lower()} with one virtual stage is not interleaved: "
                                            "use 1F1B or ZBH1"):
            plan.validate(CLUSTER, MODEL)
