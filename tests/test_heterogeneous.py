"""Heterogeneous placement: the encoder on every GPU with its own tp and dp, a phase around the LLM's pipeline."""

import json

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, dflop_here
from dflop.cost import AnalyticalCostModel, System
from dflop.errors import DflopError
from dflop.jobs.report import gpu_note
from dflop.cost.protocol import StageSpec, WorkShape
from dflop.program.actions import Kind
from dflop.program.graph_check import check_graph
from dflop.program.routing import encoder_ranks
from dflop.schedule.step import cost_dimensions, plan_costs
from dflop.sim import execute
from dflop.specs import ModulePlan, Plan, TrainingSpec
from dflop.specs.plan import Module, place
from dflop.timing.costs import longest_path
from dflop.timing.encoder_phase import phase_state
from dflop.timing.evaluate import evaluate, peak_memory
from dflop.timing.steps import CostedPlan
from dflop.workload import profile_mix


def hetero(etp, edp, ltp, lpp, ldp, m=4, **kw):
    return Plan(encoder=ModulePlan(tp=etp, dp=edp), llm=ModulePlan(tp=ltp, pp=lpp, dp=ldp),
                placement="heterogeneous", microbatches=m, **kw)


@pytest.fixture(scope="module")
def system_and_data(model, cluster):
    training = TrainingSpec(global_batch=64, recompute="full")
    return (System(model, cluster, training, AnalyticalCostModel(model, cluster.hardware, training)),
            profile_mix("llava-ov", 2000, model.encoder).samples)


def step_of(plan, system, data, seed, n=48):
    rng = np.random.default_rng(seed)
    batch = data.take(rng.integers(0, len(data), n))
    return CostedPlan(plan, system).step(0, batch, rng.permutation(np.arange(n) % plan.bins))


def test_the_plan_says_what_does_not_fit(model, cluster):
    assert hetero(1, 16, 2, 2, 4).problems(cluster, model) == []
    assert hetero(1, 16, 2, 2, 4).gpus == 16
    assert hetero(1, 4, 2, 2, 4).problems(cluster, model) == []  # the first 4 GPUs: LLM stage 0's first two workers
    assert "a multiple of its tp 2 (got tp 1 x dp 3 = 3)" in " ".join(hetero(1, 3, 2, 2, 4).problems(cluster, model))
    problems = " ".join(Plan(encoder=ModulePlan(tp=3, pp=2, dp=6), llm=ModulePlan(tp=2, pp=2, dp=4),
                             placement="heterogeneous", microbatches=4, zero=2).problems(cluster, model))
    for fragment in ("runs the encoder unpipelined: pp 1 (got pp 2)",
                     "at most its 16 GPUs and a multiple of its tp 2 (got tp 3 x dp 6 = 18)",
                     "encoder's tp 3 and the LLM's tp 2 to divide one another",
                     "zero 2 is not modelled for a heterogeneous encoder"):
        assert fragment in problems


def test_encoder_replicas_hold_the_jobs_gpus_in_order():
    gpus = place(hetero(4, 4, 2, 2, 4))
    assert [gpus.gpus(Module.ENCODER, 0, j) for j in range(4)] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11),
                                                                  (12, 13, 14, 15)]
    assert gpus.gpus(Module.LLM, 1, 0) == (8, 9)


@given(st.lists(st.integers(0, 60), min_size=1, max_size=80), st.integers(1, 9))
def test_every_image_is_encoded_once_and_the_replicas_balanced(tiles, dp):
    """LPT's guarantee: no replica holds more than the mean load plus one sample's tiles."""
    tiles = np.array(tiles)
    rank = encoder_ranks(tiles, dp)
    assert rank.shape == tiles.shape and ((0 <= rank) & (rank < dp)).all()
    load = np.bincount(rank, weights=tiles, minlength=dp)
    assert load.sum() == tiles.sum()
    assert load.max() <= tiles.sum() / dp + tiles.max() + 1e-9


tp_pairs = st.sampled_from([(1, 1), (1, 2), (2, 2), (4, 2), (2, 4), (8, 4), (1, 4)])


@given(tp_pairs, st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.sampled_from(["1F1B", "ZBH1",
                                                                                          "Interleaved1F1B"]),
       st.sampled_from([0, 1]), st.sampled_from([1, 2, 3]), st.integers(0, 10_000))
def test_three_evaluators_agree_and_every_rank_runs_the_phase(model, cluster, system_and_data, tps, pp, dp, r,
                                                              schedule, zero, share, seed):
    """``share``: the encoder on the job's GPUs, or on its first half or third."""
    (etp, ltp), system, data = tps, *system_and_data
    v = 2 if schedule == "Interleaved1F1B" else 1
    assume(schedule == "1F1B" or pp > 1)
    assume(ltp * pp * dp % (etp * share) == 0)
    plan = hetero(etp, ltp * pp * dp // (etp * share), ltp, pp, dp, m=pp * r, schedule=schedule, virtual_stages=v,
                  zero=zero)
    assume(not plan.problems(cluster, model, 48))
    step = step_of(plan, system, data, seed)
    graph = step.graph
    check_graph(graph)
    fast = evaluate(step.timing)
    _, end = longest_path(graph, step.costs)
    assert fast.step_ns == int(end.max()) == execute(graph, step.costs, contention=False).makespan
    for ids in graph.order:
        compute = [graph.nodes[n].kind for n in ids if graph.nodes[n].kind.is_compute]
        assert compute[0] is Kind.ENCODE and compute[-1] is Kind.ENCODE_B
        assert [k for k in compute if k.is_encoder_phase] == [Kind.ENCODE, Kind.ENCODE_B]
    workers = len(graph.workers)
    for kind in (Kind.ALL_TO_ALL_F, Kind.ALL_TO_ALL_B) + ((Kind.REDUCE_ENCODER_GRAD,) if plan.encoder.dp > 1 else ()):
        (members,) = [c for c in graph.collectives if graph.nodes[c[0]].kind is kind]
        assert sorted(graph.nodes[n].worker for n in members) == list(range(workers))


def test_a_rank_waits_for_the_slowest_encoder_replica_on_its_gpus(model, cluster, system_and_data):
    """Encoder tp 1 on LLM tp 2: two replicas per rank; the rank's ENCODE lasts as long as the longer."""
    system, data = system_and_data
    plan = hetero(1, 8, 2, 1, 4)
    step = step_of(plan, system, data, 3)
    rank = encoder_ranks(step.batch.tiles, 8)
    tiles = np.bincount(rank, weights=step.batch.tiles.astype(float), minlength=8)
    samples = np.bincount(rank, weights=(step.batch.tiles > 0).astype(float), minlength=8)
    spec = StageSpec(Module.ENCODER, model.encoder.layers, 1, first=True, last=True, recompute=plan.recompute)
    fwd = 4 * np.asarray(system.cost.stage_cost(spec, WorkShape(samples / 4, tiles / 4)).fwd)  # 4 chunks
    encode = step.timing.template.group_ops[0][0]
    expected = np.rint(np.maximum(fwd[0::2], fwd[1::2]) * 1e9).astype(np.int64)
    assert (step.timing.duration[encode] == expected).all()
    assert step.timing.duration[encode].min() > 0


def test_text_only_steps_exchange_nothing(model, cluster, system_and_data):
    system, data = system_and_data
    text = data.take(np.flatnonzero(data.tiles == 0)[:48])
    plan = hetero(2, 4, 2, 2, 2)
    step = CostedPlan(plan, system).step(0, text, np.arange(48) % plan.bins)
    exchange = [c.duration for c in step.timing.collectives if c.kind in (Kind.ALL_TO_ALL_F, Kind.ALL_TO_ALL_B)]
    assert exchange == [0, 0]
    images = step_of(plan, system, data, 1)
    assert all(c.duration > 0 for c in images.timing.collectives if c.kind is Kind.ALL_TO_ALL_F)


def test_the_phase_holds_no_activations_through_the_pipeline(model, cluster, system_and_data):
    """ENCODE and ENCODE_B hold one chunk (a microbatch's share) while they run and no activations
    between them, only the stage-0 ranks' embeddings and their gradients; ENCODE_B runs each chunk's
    forward again before its backward."""
    system, data = system_and_data
    plan = hetero(2, 8, 2, 2, 4)
    step = step_of(plan, system, data, 5)
    t = step.timing
    peaks = peak_memory(t)
    rank = encoder_ranks(step.batch.tiles, 8)
    tiles = np.bincount(rank, weights=step.batch.tiles.astype(float), minlength=8)
    samples = np.bincount(rank, weights=(step.batch.tiles > 0).astype(float), minlength=8)
    spec = StageSpec(Module.ENCODER, model.encoder.layers, 2, first=True, last=True, recompute=plan.recompute)
    m = plan.microbatches
    c = system.cost.stage_cost(spec, WorkShape(samples / m, tiles / m))
    chunk = np.asarray(c.act_bytes) + np.asarray(c.transient_bytes)
    again = np.rint(m * (np.asarray(c.fwd) + np.asarray(c.bwd)) * 1e9).astype(np.int64)
    image_bytes = step.batch.image_tokens * model.llm.hidden * system.training.activation_bytes
    received = np.bincount(step.assignment // m, weights=image_bytes, minlength=4)
    for g, ops in enumerate(t.template.group_ops):
        encode, back = ops[0], ops[-1]
        held = 2 * received if g == 0 else np.zeros(4)  # stage 0: the embeddings and their gradients
        assert np.allclose(t.alloc.table[encode, :4], held) and np.allclose(t.free.table[back, :4], held)
        assert np.allclose(t.transient.table[encode, :4], chunk[g * 4:(g + 1) * 4])  # encoder tp = LLM tp
        assert (t.duration[back] >= again[g * 4:(g + 1) * 4]).all()  # and slower beside the encoder's reduction
        assert (peaks[g] >= t.static_bytes[g] + held + chunk[g * 4:(g + 1) * 4]).all()


def test_the_bins_balance_the_llm_alone(model, cluster, system_and_data):
    system, data = system_and_data
    plan = hetero(1, 8, 2, 2, 2)
    costs = plan_costs(data.take(np.arange(64)), plan, model, system.cost)
    assert costs.shape == (64, 1) and cost_dimensions(plan) == (Module.LLM,)
    colocated = Plan(encoder=ModulePlan(tp=2, dp=2), llm=ModulePlan(tp=2, pp=2, dp=2), placement="colocated",
                     microbatches=4)
    both = plan_costs(data.take(np.arange(64)), colocated, model, system.cost)
    images = data.take(np.arange(64)).tiles > 0
    assert (costs[images, 0] < both[images, 0]).all()  # stage 0's column carries no encoder


def test_simulate_runs_a_heterogeneous_plan_file(tmp_path):
    from test_cli_commands import small_config

    plan = tmp_path / "het.yaml"
    plan.write_text("encoder: {tp: 1, dp: 8}\nllm: {tp: 2, pp: 2, dp: 2}\nplacement: heterogeneous\n"
                    "microbatches: 4\nrecompute: full\n")  # the LLM's activations need it on 8 GPUs
    ran = dflop_here("simulate", "--config", small_config(tmp_path), "--plan", plan, "--steps", 2,
                     "--out", tmp_path / "sim", "--json")
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["plan"]["placement"] == "heterogeneous" and out["steps"] == 2 and out["oom_events"] == 0
    trace = json.loads((tmp_path / "sim" / "simulate.trace.json").read_text())
    encode = [e for e in trace["traceEvents"] if e.get("name") == "ENCODE" and e.get("ph") == "X"]
    assert len(encode) == 2 * 4 and {e["args"]["module"] for e in encode} == {"encoder"}
    assert all(w["encoder_phase"] for w in trace["otherData"]["workers"])
    plan.write_text("encoder: {tp: 1, pp: 2, dp: 8}\nllm: {tp: 2, pp: 2, dp: 2}\nplacement: heterogeneous\n"
                    "microbatches: 4\n")
    assert_one_line_error(dflop_here("simulate", "--config", small_config(tmp_path), "--plan", plan,
                                     "--out", tmp_path / "s2"), "runs the encoder unpipelined")


def test_the_torch_backend_refuses_a_heterogeneous_plan_it_cannot_run_before_it_removes_anything(tmp_path):
    plan = tmp_path / "het.yaml"
    plan.write_text("encoder: {tp: 2, dp: 1}\nllm: {tp: 1, pp: 1, dp: 2}\nplacement: heterogeneous\nmicrobatches: 2\n")
    out = tmp_path / "run"
    out.mkdir()
    earlier = out / "dflop.result.json"
    earlier.write_text("{}")  # what an earlier run left
    ran = dflop_here("run", "--backend", "torch", "--plan", plan, "--out", out, "--no-calibrate")
    assert_one_line_error(ran, "plan field placement: the torch backend runs a heterogeneous encoder phase with tp 1 "
                               "for the encoder and the LLM and ZeRO 0 or 1 (got encoder tp 2, llm tp 1, zero 1)")
    assert earlier.read_text() == "{}"


def test_an_encoder_on_the_first_gpus_leaves_the_others_out_of_its_work_and_memory(model, cluster, system_and_data):
    """Encoder tp 1 dp 4 on 16 GPUs of LLM tp 2 pp 2 dp 4: its replicas hold GPUs 0-3, LLM stage 0's
    first two workers; every other worker encodes nothing and holds none of its state, yet takes
    part in the all-to-all that brings stage 0 its embeddings."""
    system, data = system_and_data
    plan, whole = hetero(1, 4, 2, 2, 4), hetero(1, 16, 2, 2, 4)
    step = step_of(plan, system, data, 2)
    encode = [int(ops[0]) for ops in step.timing.template.group_ops]
    assert (step.timing.duration[encode[0]][:2] > 0).all() and (step.timing.duration[encode[0]][2:4] == 0).all()
    assert (step.timing.duration[encode[1]][:4] == 0).all()
    llm_only = step_of(whole, system, data, 2).timing.static_bytes - phase_state(whole, model, system.training)
    assert step.timing.static_bytes == pytest.approx(llm_only + [phase_state(plan, model, system.training), 0.0])
    (members,) = [c for c in step.graph.collectives if step.graph.nodes[c[0]].kind is Kind.ALL_TO_ALL_F]
    assert len(members) == len(step.graph.workers)
    assert "tp1 dp4 on the first 4 of the LLM's 16 GPUs" in plan.describe()
    assert gpu_note(plan, 16) == "its encoder runs on the first 4 of the job's 16 GPUs" and gpu_note(whole, 16) is None


def test_the_torch_backend_refuses_an_encoder_subset_that_splits_a_data_parallel_group_under_zero_1():
    """Its ZeRO-1 shards the encoder's optimizer state over the LLM's data-parallel group, whose ranks
    must then all hold a replica or none."""
    from dflop.backends.torch_runtime.backend import refuse_unsupported
    from dflop.backends.torch_runtime.worker import TorchOptions

    with pytest.raises(DflopError, match=r"whole LLM stages \(a multiple of 2; got tp 1 x dp 1\)"):
        refuse_unsupported(hetero(1, 1, 1, 2, 2), TorchOptions())
    refuse_unsupported(hetero(1, 1, 1, 2, 2, zero=0), TorchOptions())
    refuse_unsupported(hetero(1, 2, 1, 2, 2), TorchOptions())
