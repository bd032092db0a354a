"""A frozen encoder (``training.freeze_encoder``): forward only in every placement, which changes
every cost (time, memory, communication) and the step graph itself."""

import copy
import pickle
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, System
from dflop.cost.frozen import FrozenEncoder
from dflop.cost.flops import projector_params, vit_embedding_params, vit_layer_params
from dflop.cost.protocol import StageSpec, WorkShape
from dflop.errors import DflopError
from dflop.program.actions import Kind
from dflop.program.graph_check import check_graph
from dflop.schedule.step import plan_costs
from dflop.sim import execute
from dflop.specs import ModulePlan, Plan, TrainingSpec
from dflop.specs.loading import from_mapping
from dflop.specs.plan import Module
from dflop.timing.costs import longest_path
from dflop.timing.dpcomm import fsdp_op
from dflop.timing.evaluate import evaluate, peak_memory
from dflop.timing.steps import CostedPlan
from dflop.workload import profile_mix


def systems(model, cluster, recompute="full"):
    """(trained, frozen) systems alike but for the encoder."""
    out = []
    for frozen in (False, True):
        training = TrainingSpec(global_batch=64, recompute=recompute, freeze_encoder=frozen)
        out.append(System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training)))
    return out


@pytest.fixture(scope="module")
def both(model, cluster):
    return systems(model, cluster)


@pytest.fixture(scope="module")
def data(model):
    return profile_mix("llava-ov", 2000, model.encoder).samples


def step_of(plan, system, data, seed, n=48):
    rng = np.random.default_rng(seed)
    batch = data.take(rng.integers(0, len(data), n))
    return CostedPlan(plan, system).step(0, batch, rng.permutation(np.arange(n) % plan.bins))


plans = st.one_of(
    st.builds(lambda edp, epp, ltp, lpp, ldp, m, s, z: Plan(
        encoder=ModulePlan(pp=epp, dp=edp), llm=ModulePlan(tp=ltp, pp=lpp, dp=ldp), microbatches=m, schedule=s,
        zero=z), st.integers(1, 3), st.integers(1, 2), st.sampled_from([1, 2]), st.integers(1, 2),
        st.integers(1, 2), st.integers(1, 4), st.sampled_from(["1F1B", "ZBH1", "GPipe"]), st.sampled_from([0, 1, 3])),
    st.builds(lambda tp, pp, dp, r, z: Plan(
        encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp), placement="colocated",
        microbatches=pp * r, zero=z), st.sampled_from([1, 2]), st.integers(1, 3), st.integers(1, 3),
        st.integers(1, 2), st.sampled_from([0, 1, 3])),
    st.builds(lambda etp, pp, dp, r, s, z: Plan(
        encoder=ModulePlan(tp=etp, dp=2 * pp * dp // etp), llm=ModulePlan(tp=2, pp=pp, dp=dp),
        placement="heterogeneous", microbatches=pp * r, schedule=s, zero=z),
        st.sampled_from([1, 2]), st.integers(1, 3), st.integers(1, 2), st.integers(1, 2),
        st.sampled_from(["1F1B", "ZBH1"]), st.sampled_from([0, 1])))


@given(plans, st.integers(0, 10_000))
def test_three_evaluators_agree_and_the_encoder_has_no_backward(model, cluster, both, data, plan, seed):
    """A zero-bubble schedule may be slower frozen: an LLM first stage fed by a frozen encoder has no
    input gradient to compute, so its whole backward becomes the W its schedule defers (as torch runs
    such a stage), and the bubble its I filled stays empty."""
    trained, frozen = both
    assume(not plan.problems(cluster, model, 48))
    assume(plan.schedule == "1F1B" or plan.pipeline_ranks > 1)
    step = step_of(plan, frozen, data, seed)
    graph = step.graph
    check_graph(graph)
    fast = evaluate(step.timing)
    _, end = longest_path(graph, step.costs)
    assert fast.step_ns == int(end.max()) == execute(graph, step.costs, contention=False).makespan
    kinds = {node.kind for node in graph.nodes}
    assert not kinds & {Kind.ENCODE_B, Kind.ALL_TO_ALL_B, Kind.REDUCE_ENCODER_GRAD, Kind.BRIDGE_SEND_B,
                        Kind.BRIDGE_RECV_B}
    for node in graph.nodes:  # an encoder stage computes forwards, and reduces nothing
        worker = graph.workers[node.worker]
        if worker.module is Module.ENCODER:
            assert node.kind in (Kind.F, Kind.UNSHARD, Kind.SEND_F, Kind.RECV_F, Kind.BRIDGE_SEND_F)
    if plan.schedule != "ZBH1":  # less work in the same orders: never longer (a backward may have hidden)
        assert fast.step_ns <= evaluate(step_of(plan, trained, data, seed).timing).step_ns


@pytest.mark.parametrize("plan", [
    Plan(encoder=ModulePlan(dp=4), llm=ModulePlan(pp=2, dp=4), placement="colocated", microbatches=4, zero=0),
    Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(tp=2, dp=3), microbatches=4, zero=0),
    Plan(encoder=ModulePlan(dp=8), llm=ModulePlan(tp=2, pp=2, dp=2), placement="heterogeneous", microbatches=4,
         zero=0)], ids=["colocated", "disaggregated", "heterogeneous"])
def test_the_encoder_holds_its_weights_alone_and_every_cost_falls(model, cluster, both, data, plan):
    """ZeRO-0: a GPU holding the encoder (or its share) holds 2 bytes of weights per parameter and
    none of the 14 of its gradients and optimizer state; its activations, its backward and its
    gradient reduction are gone, so the step, its peak and the scheduler's costs all fall."""
    trained, frozen = both
    encoder = (model.encoder.layers * vit_layer_params(model.encoder) + vit_embedding_params(model.encoder)
               + projector_params(model))
    t, f = step_of(plan, trained, data, 5), step_of(plan, frozen, data, 5)
    per_gpu = {"colocated": encoder / plan.llm.tp, "disaggregated": encoder / plan.encoder.tp,
               "heterogeneous": encoder / plan.encoder.tp}[plan.placement.value]
    freed = t.timing.static_bytes - f.timing.static_bytes
    held = [i for i, g in enumerate(t.timing.template.groups)
            if plan.heterogeneous or g.module is Module.ENCODER or (plan.colocated and g.rank == 0)]
    assert freed[held] == pytest.approx(per_gpu * (2 + 12), rel=1e-9)
    assert (np.delete(freed, held) == 0).all()
    assert evaluate(f.timing).step_ns < evaluate(t.timing).step_ns
    frozen_peak, trained_peak = peak_memory(f.timing), peak_memory(t.timing)
    assert all((a <= b).all() for a, b in zip(frozen_peak, trained_peak))
    assert all((frozen_peak[i] < trained_peak[i]).all() for i in held)
    assert all((frozen_peak[i] > f.timing.static_bytes[i]).all() for i in held)  # a forward holds a layer or more
    if plan.placement.value == "disaggregated":  # model FLOPs: the encoder's forward alone, a third
        for g, ops in enumerate(t.timing.template.group_ops):
            mine, theirs = f.timing.flops.table[f.timing.template.group_ops[g]].sum(), t.timing.flops.table[ops].sum()
            encoder = t.timing.template.groups[g].module is Module.ENCODER
            assert mine == pytest.approx(theirs / 3 if encoder else theirs, rel=1e-9)
    reductions = [c for c in f.graph.collectives if f.graph.nodes[c[0]].kind is Kind.REDUCE_GRAD]
    assert all(f.graph.workers[f.graph.nodes[c[0]].worker].module is Module.LLM for c in reductions)
    if not plan.heterogeneous:  # the scheduler balances forward-only encoder work
        assert (plan_costs(f.batch, plan, model, frozen.cost) <= plan_costs(t.batch, plan, model, trained.cost)).all()
        assert (plan_costs(f.batch, plan, model, frozen.cost) < plan_costs(t.batch, plan, model, trained.cost)).any()


def test_a_frozen_stage_runs_its_forward_and_keeps_nothing(model, both):
    trained, frozen = both
    spec = StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True, recompute="full")
    shape = WorkShape(4, 20)
    t, f = trained.cost.stage_cost(spec, shape), frozen.cost.stage_cost(spec, shape)
    no_recompute = trained.cost.stage_cost(replace(spec, recompute="none"), shape)
    assert float(f.fwd) == float(no_recompute.fwd) and float(f.flops) == float(t.flops)
    assert float(f.bwd) == float(f.act_bytes) == float(f.recompute_flops) == float(f.transient_bytes) == 0.0
    assert 0 < float(f.forward_transient_bytes) < float(no_recompute.act_bytes)  # one layer's at a time
    assert copy.deepcopy(frozen.cost) == frozen.cost == pickle.loads(pickle.dumps(frozen.cost))
    assert FrozenEncoder(frozen.cost) == frozen.cost  # wrapped once
    llm = StageSpec(Module.LLM, 4, 1, first=True)
    assert frozen.cost.stage_cost(llm, WorkShape(4, 20, 4000, 4e6)) == trained.cost.stage_cost(llm, WorkShape(
        4, 20, 4000, 4e6))


def test_the_recipe_names_it_and_a_wrong_value_is_a_one_line_error():
    assert from_mapping(TrainingSpec, {"global_batch": 8, "freeze_encoder": True}, "training:").freeze_encoder
    assert not from_mapping(TrainingSpec, {"global_batch": 8}, "training:").freeze_encoder
    with pytest.raises(DflopError, match="freeze_encoder") as err:
        from_mapping(TrainingSpec, {"global_batch": 8, "freeze_encoder": "yes"}, "training:")
    assert "\n" not in str(err.value)


def test_fsdp_gathers_a_frozen_encoder_for_its_forward_alone(model, cluster, both):
    """ZeRO-3 colocated: the forward gathers the encoder's units; a backward, which never runs
    through a frozen encoder, prices no gather of them (and no reduce-scatter)."""
    trained, frozen = both
    plan = Plan(encoder=ModulePlan(dp=8), llm=ModulePlan(dp=8), placement="colocated", microbatches=2, zero=3)
    units = CostedPlan(plan, frozen).builder.comm[0].units
    assert units.frozen == {Module.ENCODER} and units.reduce[Module.ENCODER] == 0.0
    compute = {Module.ENCODER: np.zeros(8), Module.LLM: np.full(8, 0.5)}
    without = replace(units, layers={**units.layers, Module.ENCODER: 0})
    assert fsdp_op(Kind.B, units, compute, 1.0)[1] == pytest.approx(fsdp_op(Kind.B, without, compute, 1.0)[1])
    assert (fsdp_op(Kind.F, units, compute, 1.0)[1] > fsdp_op(Kind.F, without, compute, 1.0)[1]).all()
    assert CostedPlan(plan, trained).builder.comm[0].units.frozen == frozenset()
