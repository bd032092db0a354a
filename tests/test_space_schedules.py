"""The planner's space and screen with every schedule: loop placement (1F1B, ZBH1, Interleaved1F1B,
InterleavedZeroBubble, LoopedBFS) and V placement (ZBVZeroBubble, DualPipeV)."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.errors import DflopError
from dflop.plan.evaluate import Estimate, PlanningProblem
from dflop.plan.search import Optimizer
from dflop.plan.space import DFLOP, MEGATRON, MICROBATCH_OPTIONS, PYTORCH, SpaceBuilder
from dflop.program.schedules import build, schedule_kind
from dflop.program.template import build_template, plan_groups
from dflop.schedule.batching import Batching
from dflop.specs import ClusterSpec, ModulePlan, Plan, TrainingSpec, presets
from dflop.workload import profile_mix

V_SCHEDULES = {"ZBVZeroBubble", "DualPipeV"}
NEW = V_SCHEDULES | {"LoopedBFS"}


def problem(llm: str, hardware, nodes: int, per_node: int, batch: int, mix: str) -> PlanningProblem:
    model = presets.model("siglip-so400m", llm)
    hardware = presets.hardware(hardware) if isinstance(hardware, str) else hardware
    cluster = ClusterSpec(hardware=hardware, nodes=nodes, gpus_per_node=per_node)
    training = TrainingSpec(global_batch=batch)
    data = profile_mix(mix, 3000, model.encoder, seed=1).samples
    return PlanningProblem(System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training)),
                           data)


def colocated(pp: int, m: int, schedule: str, v: int, dp: int = 1, **memory) -> Plan:
    return Plan(encoder=ModulePlan(dp=dp), llm=ModulePlan(pp=pp, dp=dp), placement="colocated", microbatches=m,
                schedule=schedule, virtual_stages=v, **memory)


def plans_of(builder: SpaceBuilder, space, placement: str) -> list[Plan]:
    return [p for options in builder.plans(space, placement) for p in options]


def test_dflop_space_runs_each_schedule_exactly_where_its_generator_does():
    batch = 128
    builder = SpaceBuilder(problem("qwen2.5-7b", "h100", 1, 8, batch, "llava-ov"), batch)
    mine = plans_of(builder, DFLOP, "colocated")
    assert {p.schedule for p in mine} == {k.name for k in DFLOP.schedules} >= NEW
    offered: dict[tuple[str, int, int], set[int]] = {}
    for plan in mine:
        if plan.llm.pp > 1:
            assert plan.virtual_stages == (schedule_kind(plan.schedule).stages_per_rank or 2), plan.describe()
            offered.setdefault((plan.schedule, plan.llm.pp, plan.llm.dp), set()).add(plan.microbatches)
    for (schedule, pp, dp), ms in offered.items():
        v = schedule_kind(schedule).stages_per_rank or 2
        runs = set()
        for m in (m for m in MICROBATCH_OPTIONS if dp * m <= batch):
            try:
                build(schedule, pp, m, v)
                runs.add(m)
            except DflopError:
                pass
        assert ms == runs, (schedule, pp, dp)
    # the rules differ per schedule: DualPipeV needs a microbatch per stage, ZB-V and interleaved do not
    assert min(m for (s, pp, _), ms in offered.items() if s == "DualPipeV" for m in ms if pp == 4) == 8
    assert min(m for (s, pp, _), ms in offered.items() if s == "ZBVZeroBubble" for m in ms if pp == 4) == 1
    assert min(m for (s, pp, _), ms in offered.items() if s == "Interleaved1F1B" for m in ms if pp == 4) == 1
    # several stages per rank need colocated placement
    assert {p.schedule for p in plans_of(builder, DFLOP, "disaggregated")} == {"1F1B", "ZBH1"}


def test_baselines_run_what_their_frameworks_run():
    batch = 128
    builder = SpaceBuilder(problem("qwen2.5-7b", "h100", 1, 8, batch, "llava-ov"), batch)
    megatron = [p for placement in ("colocated", "disaggregated") for p in plans_of(builder, MEGATRON, placement)]
    assert {p.schedule for p in megatron} == {"1F1B", "Interleaved1F1B"}
    assert all(p.microbatches % p.llm.pp == 0 for p in megatron if p.virtual_stages > 1)  # Megatron-LM's rule
    assert {p.schedule for p in plans_of(builder, PYTORCH, "colocated")} == {"1F1B"}
    assert not NEW & {k.name for k in MEGATRON.schedules + PYTORCH.schedules}


def test_new_schedules_get_the_memory_options_of_1f1b():
    """``variants`` and ``prove_dominated`` reason about memory options only: no schedule loses or
    gains one."""
    batch = 128
    builder = SpaceBuilder(problem("qwen2.5-7b", "h100", 1, 8, batch, "llava-ov"), batch)
    options: dict[tuple, set] = {}
    for plan in plans_of(builder, DFLOP, "colocated"):
        key = (plan.schedule, plan.llm.tp, plan.llm.pp)
        options.setdefault(key, set()).add((plan.zero, plan.hsdp, plan.fp32_grads, plan.recompute))
    for (schedule, tp, pp), memory in options.items():
        if pp > 1:
            assert memory == options[("1F1B", tp, pp)], (schedule, tp, pp)


@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("ZBH1", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 3),
                                        ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_plan_groups_are_the_template_s_groups(schedule, v):
    for pp in (2, 3, 4):
        plan = colocated(pp, 2 * pp, schedule, v)
        assert plan_groups(plan) == build_template(plan).groups
        if v == 1:
            plan = replace(plan, placement="disaggregated", encoder=ModulePlan(pp=2))
            assert plan_groups(plan) == build_template(plan).groups


SCREENERS = {mix: Optimizer(problem("qwen2.5-7b", "h100", 1, 4, 32, mix), 32, first=2, most=2)
             for mix in ("llava-ov", "text-only")}  # text only: the LLM stages, not the encoder, are the busiest


@st.composite
def small_plans(draw):
    schedule = draw(st.sampled_from(["1F1B", "ZBH1", "Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS",
                                     "ZBVZeroBubble", "DualPipeV"]))
    v = schedule_kind(schedule).stages_per_rank or 2
    pp = draw(st.sampled_from([2, 4]))
    m = draw(st.sampled_from([m for m in (1, 2, 4, 8) if not (schedule == "DualPipeV" and m < 2 * pp)]))
    cuts = sorted(draw(st.sets(st.integers(1, 27), min_size=pp * v - 1, max_size=pp * v - 1)))
    split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, 28]))  # any split of the 28 layers
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    plan = colocated(pp, m, schedule, v, dp=4 // pp, recompute=recompute)
    return replace(plan, llm=replace(plan.llm, layers_per_stage=split))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=small_plans(), mix=st.sampled_from(sorted(SCREENERS)))
def test_the_screen_bounds_every_schedule_from_the_right_side(plan, mix):
    """The bound never exceeds the evaluated step (it prunes) and the memory never falls short of
    the evaluated peak (it screens out), whichever ranks hold which stages."""
    opt = SCREENERS[mix]
    screen = opt.screener.screen(plan, Batching.BALANCED)
    e = opt.ev.extend(Estimate(plan, Batching.BALANCED, screen.bound), 2)
    assert not e.infeasible
    assert e.mean >= screen.bound * (1 - 1e-9)
    assert e.peak_memory <= screen.memory * (1 + 1e-9)


def test_a_v_plan_holding_first_and_last_stage_on_rank_0_that_does_not_fit_is_screened_out():
    """DualPipeV on 4 ranks: rank 0 holds the first stage (encoder and embedding) and the last (head),
    and up to 2p+1 stage activations; the same plan with 1F1B fits, DualPipeV's does not."""
    p = problem("qwen2.5-7b", "h100", 4, 1, 64, "llava-ov")
    opt = Optimizer(p, 64, first=2, most=2)
    one = colocated(4, 16, "1F1B", 1, zero=1, recompute="full")
    v = replace(one, schedule="DualPipeV", virtual_stages=2)
    assert v in plans_of(SpaceBuilder(p, 64), DFLOP, "colocated")
    fits, too_big = (opt.screener.screen(plan, Batching.BALANCED) for plan in (one, v))
    assert fits.memory <= opt.usable < too_big.memory
    assert too_big.memory_rank == "llm pipeline rank 0"
    timed = [opt.ev.extend(Estimate(plan, Batching.BALANCED, 0.0), 2) for plan in (one, v)]
    assert timed[0].peak_memory <= opt.usable < timed[1].peak_memory  # the screen is right to drop it
    state = [build_template(plan) for plan in (one, v)]
    assert state[1].groups[0].stages == (0, 7) and state[0].groups[0].stages == (0,)


def test_the_search_picks_zb_v_where_it_is_the_fastest_plan():
    """Four single-GPU nodes (no tensor parallelism; FSDP's gathers cross nodes), a 32-layer LLM
    and memory to spare on H200 (at a tuned framework's efficiency, not the curve measured with dflop's
    own torch model): a 4-stage pipeline wins, and ZB-V's bubble, about half ZBH1's and a third of
    interleaved's, makes it the fastest; without the V schedules the best is slower."""
    tuned = ((1e8, 0.09), (1e9, 0.20), (1e10, 0.40), (1e11, 0.54), (1e12, 0.62), (1e13, 0.64))
    p = problem("llama-3-8b", replace(presets.hardware("h200"), efficiency=tuned, calibrated_from=""), 4, 1, 32,
                "text-only")
    opt = Optimizer(p, 32, first=2, most=2)
    best = opt.search(DFLOP).best
    assert best.plan.schedule == "ZBVZeroBubble" and best.plan.llm.pp == 4
    without = replace(DFLOP, schedules=tuple(k for k in DFLOP.schedules if k.name not in V_SCHEDULES))
    other = opt.search(without).best
    assert other.plan.schedule not in V_SCHEDULES
    assert best.mean < other.mean
