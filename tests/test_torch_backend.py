"""The torch backend on real processes (gloo, one thread each): it trains exactly what one process
trains, runs the same step graphs as the simulator, fails loudly, and resumes where it stopped."""

import importlib.util
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dflop.backends import ScheduledBatch, get_backend
from dflop.backends.torch_runtime.backend import RankFailed, TorchBackend
from dflop.backends.torch_runtime.cpu_process import FORK_SERVER_IMPORTS, start_method
from dflop.backends.torch_runtime.model import whole_model_name
from dflop.backends.torch_runtime.reference import reference_training
from dflop.backends.torch_runtime.worker import Payload, TorchOptions, heaviest_step, rank_entry
from dflop.cost import System
from dflop.cost.select import select_cost_model
from dflop.errors import DflopError
from dflop.timing.steps import CostedPlan
from dflop.schedule.step import plan_costs, schedule_batch
from dflop.specs import ClusterSpec, ModulePlan, Plan, Strategy, TrainingSpec, presets
from dflop.workload.sample import SampleTable

pytestmark = pytest.mark.processes

MODEL = presets.model("tiny-vit", "tiny-llm")
PLANS = {  # 2, 3 and 4 processes; every kind of program; pipeline, data and tensor parallelism
    "colocated pp2 1F1B": Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), placement="colocated", microbatches=2),
    "disaggregated encoder + llm pp2": Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), microbatches=2),
    "colocated interleaved pp2 v2 x dp2": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2),
                                               placement="colocated", microbatches=2, schedule="Interleaved1F1B",
                                               virtual_stages=2),
    "colocated zero-bubble pp2 x tp2, selective recompute (run as full)": Plan(
        encoder=ModulePlan(tp=2), llm=ModulePlan(tp=2, pp=2), placement="colocated", microbatches=4, schedule="ZBH1",
        recompute="selective"),
    "dp2 ZeRO-0 (DDP)": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2,
                             zero=0),
    "dp2 ZeRO-2, selective recompute": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated",
                                            microbatches=2, zero=2, recompute="selective"),
    "dp2 ZeRO-3 (FSDP2), full recompute": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated",
                                               microbatches=2, zero=3, recompute="full"),
    "dp4 HSDP (2 nodes of 2)": Plan(encoder=ModulePlan(dp=4), llm=ModulePlan(dp=4), placement="colocated",
                                    microbatches=1, zero=3, hsdp=True),
    "heterogeneous encoder dp4, llm pp2 x dp2 (all-to-all)": Plan(
        encoder=ModulePlan(dp=4), llm=ModulePlan(pp=2, dp=2), placement="heterogeneous", microbatches=2),
    "heterogeneous encoder dp2 on the first 2 of 4 ranks, llm pp2 x dp2": Plan(
        encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2), placement="heterogeneous", microbatches=2),
    "heterogeneous encoder dp2, llm pp2 zero-bubble, ZeRO-0": Plan(
        encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2), placement="heterogeneous", microbatches=4, schedule="ZBH1",
        zero=0),
}
GPUS_PER_NODE = {"dp4 HSDP (2 nodes of 2)": 2}
"""Where a plan needs nodes smaller than 4 GPUs (HSDP shards within a node); 4 otherwise."""


def system_of(per_node=4):
    hardware = presets.hardware("cpu")
    training = TrainingSpec(global_batch=8)
    cost, _ = select_cost_model(MODEL, hardware, training)
    return System(MODEL, ClusterSpec(hardware=hardware, nodes=4 // per_node, gpus_per_node=per_node), training, cost)


@pytest.fixture(scope="module")
def system():
    return system_of()


@pytest.fixture(scope="module")
def small_samples():
    """Samples of every modality, small enough for a quick CPU test, laid out as the tiny encoder's
    rules would (64 tokens a tile, a newline a row of an image grid, 16 a video frame)."""
    rng = np.random.default_rng(3)
    rows = []
    for i in range(40):
        modality = i % 4  # text, image, multi_image, video
        tiles = [0, int(rng.integers(2, 4)), int(rng.integers(2, 4)), int(rng.integers(2, 5))][modality]
        image = [0, 64 * tiles + 2, 65 * tiles, 16 * tiles][modality]
        rows.append((f"t{i}", modality, tiles, int(rng.integers(8, 80)), image))
    return SampleTable.build(*zip(*rows))


def scheduled(system, plan, samples, steps, seed=0):
    """``steps`` global batches of 8, each split by dflop's scheduler (bins of unequal shapes)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        batch = samples.take(rng.choice(len(samples), 8, replace=False))
        costs = plan_costs(batch, plan, system.model, system.cost)
        out.append(ScheduledBatch(batch, schedule_batch(batch, plan, costs=costs, solver="lpt").assignment))
    return out


def max_difference(params, reference):
    return max(float((t - reference[whole_model_name(n, MODEL.llm.tie_embeddings)]).abs().max())
               for n, t in params.items())


def node_sequences(trace):
    """Per worker, the graph's node names in execution order (events carry their position ``seq``)."""
    events = sorted((e["pid"], e["args"]["step"], e["args"]["seq"], e["name"]) for e in trace["traceEvents"]
                    if e.get("ph") == "X" and "seq" in e.get("args", {}))
    out = {}
    for pid, _, _, name in events:
        out.setdefault(pid, []).append(name)
    return out


@pytest.mark.parametrize("name", list(PLANS))
def test_distributed_training_matches_the_single_process_reference(small_samples, name):
    """fp64, so reassociation noise (~1e-15) cannot hide a wrong gradient: the parameters after two
    AdamW steps equal the sequential run's to 1e-9, the heavier step's graph having run once before
    them as the warm-up (which changes no weight). The trace holds the simulator's nodes, in order
    (the REDUCE_GRAD and UNSHARD nodes of every ZeRO stage where the step graph puts them)."""
    plan = PLANS[name]
    system = system_of(GPUS_PER_NODE.get(name, 4))
    assert not plan.problems(system.cluster, MODEL, 8)
    steps = scheduled(system, plan, small_samples, 2)
    assert len({tuple(np.bincount(s.assignment, minlength=plan.bins)) for s in steps}) >= 1
    options = TorchOptions(dtype="float64", lr=1e-2, seed=7)
    result = TorchBackend(options=options, keep_parameters=True).run(CostedPlan(plan, system), steps)
    ref = reference_training(MODEL, [s.batch for s in steps], options)
    reference, losses = ref.parameters, ref.losses
    n_params = sum(1 for n in reference)
    assert len({whole_model_name(n, MODEL.llm.tie_embeddings) for n in result.extra["parameters"]}) == n_params
    assert max_difference(result.extra["parameters"], reference) < 1e-9
    assert result.extra["losses"] == pytest.approx(losses, rel=1e-12)
    assert result.extra["warmup"]["step"] in (0, 1) and result.extra["warmup"]["seconds"] > 0
    if plan.heterogeneous:  # every rank's encoder replica, not only the one merged above, is the reference's
        for rank, params in result.extra["rank_parameters"].items():  # (on the encoder's GPUs: the first ranks)
            encoder = {n: t for n, t in params.items() if n.startswith("encoder.")}
            assert bool(encoder) == (rank < plan.encoder.gpus)
            assert not encoder or max_difference(encoder, reference) < 1e-9
    simulated = get_backend("sim").run(CostedPlan(plan, system), steps)
    assert node_sequences(result.trace) == node_sequences(simulated.trace)
    assert result.metrics.steps == 2 and len(result.extra["predicted_step_time_s"]) == 2


FP32_UNIT_ROUNDOFF = 2.0 ** -24
GRADIENT_ROUNDING = 1e-4
"""What rounding may move a gradient element by, as a fraction of the step's largest element: fp32
sums of n <= 10^4 terms taken in another order differ by about sqrt(n) u = 6e-6 of their terms' scale
(Higham), so this leaves more than 10x for the kernels of any instruction set."""


def adam_sensitivity(step: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """How much Adam's update m^/(sqrt(v^) + eps) at ``step`` (from 1) moves, in units of delta/eps, when
    every gradient it has seen moves by at most delta: m^ by at most delta, sqrt(v^) by at most delta (a
    weighted 2-norm), and |m^| / sqrt(v^) <= R = sqrt(sum a_s^2 / b_s) (Cauchy-Schwarz over the bias-
    corrected weights a_s of m^ and b_s of v^); so 1 + R."""
    a = [(1 - beta1) * beta1 ** (step - s) / (1 - beta1 ** step) for s in range(1, step + 1)]
    b = [(1 - beta2) * beta2 ** (step - s) / (1 - beta2 ** step) for s in range(1, step + 1)]
    return 1 + sum(x * x / y for x, y in zip(a, b)) ** 0.5


def fp32_bound(reference, options: TorchOptions) -> float:
    """The most fp32 rounding can move a parameter between two runs that sum in different orders: per
    step, Adam's sensitivity times the gradient's rounding over eps, times lr; and each run rounds the
    stored parameter (half an ulp of the largest, per step). First order: the parameters differ by so
    little that the gradients they give differ far less than rounding already allows."""
    largest = max(float(t.abs().max()) for t in reference.parameters.values())
    return sum(options.lr * adam_sensitivity(t + 1) * GRADIENT_ROUNDING * g / options.adam_eps
               + 2 * FP32_UNIT_ROUNDOFF * largest for t, g in enumerate(reference.largest_gradient))


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["colocated pp2 1F1B", "dp2 ZeRO-2, selective recompute"])
def test_fp32_training_stays_within_what_rounding_can_do(system, small_samples, name):
    """fp32 gradients differ by rounding, which depends on the CPU's kernels (AVX-512, AVX2, none).
    With Adam's default eps (1e-8) that bounds nothing: an element whose gradient is within rounding of
    zero may step by +lr in one run and -lr in the other. With eps above the gradients' rounding, Adam is
    Lipschitz in them and rounding's share is derived (:func:`fp32_bound`); what is not rounding (a lost
    microbatch, a wrong scale, a bf16 slip, FSDP2's pre-multiplied sum, which gloo lacks) moves
    parameters by a good part of lr, well past the bound."""
    plan = PLANS[name]
    steps = scheduled(system, plan, small_samples, 2, seed=1)
    options = TorchOptions(lr=1e-3, adam_eps=1e-2)
    result = TorchBackend(options=options, keep_parameters=True, predict=False).run(CostedPlan(plan, system), steps)
    reference = reference_training(MODEL, [s.batch for s in steps], options)
    bound = fp32_bound(reference, options)
    assert max_difference(result.extra["parameters"], reference.parameters) < bound
    # and the bound catches what is not rounding: one sample a step lost moves parameters well past it
    lost = reference_training(MODEL, [s.batch.take(np.arange(len(s.batch) - 1)) for s in steps], options)
    assert max(float((lost.parameters[n] - t).abs().max()) for n, t in reference.parameters.items()) > 10 * bound


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_failing_rank_stops_every_rank_with_its_step_and_node(system, small_samples, how):
    plan = PLANS["colocated pp2 1F1B"]
    steps = scheduled(system, plan, small_samples, 3)
    options = TorchOptions(timeout_s=30, fail_at=(1, "0F1", how))
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        TorchBackend(options=options, predict=False).run(CostedPlan(plan, system), steps)
    assert time.monotonic() - start < 90  # bounded: no rank waits for the dead one forever
    message = str(err.value)
    assert "\n" not in message and "step 1" in message and "0F1" in message and "rank 0" in message
    if how == "raise":
        assert "RuntimeError: injected failure" in message
    else:
        assert "died" in message and "every other rank was stopped" in message


def test_a_resumed_run_ends_with_the_parameters_of_an_uninterrupted_one(system, small_samples, tmp_path):
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=1)
    steps = scheduled(system, plan, small_samples, 4, seed=2)  # ZeRO-1: each rank saves its optimizer shard
    base = TorchOptions(dtype="float64", lr=1e-2)
    whole = TorchBackend(options=base, keep_parameters=True, predict=False).run(CostedPlan(plan, system), steps)
    folder = str(tmp_path / "checkpoints")
    interrupted = TorchOptions(dtype="float64", lr=1e-2, checkpoint_every=2, checkpoint_dir=folder,
                               fail_at=(3, "0F1", "exit"))
    with pytest.raises(RankFailed, match="step 3"):
        TorchBackend(options=interrupted, predict=False).run(CostedPlan(plan, system), steps)
    resumed = TorchOptions(dtype="float64", lr=1e-2, checkpoint_every=2, checkpoint_dir=folder, resume=True)
    again = TorchBackend(options=resumed, keep_parameters=True, predict=False).run(CostedPlan(plan, system), steps)
    assert again.extra["first_step"] == 2 and again.metrics.steps == 2
    assert max(float((again.extra["parameters"][n] - t).abs().max())
               for n, t in whole.extra["parameters"].items()) < 1e-12
    assert again.extra["losses"] == pytest.approx(whole.extra["losses"][2:], rel=1e-12)


def test_ranks_fork_from_a_server_unless_its_socket_path_is_too_long_for_an_address():
    """A rank forked from a server that imported torch starts without importing it again; under a
    TMPDIR so deep that the server's socket path passes what a Unix address holds, they start afresh
    (the run would otherwise end in ``AF_UNIX path too long``)."""
    assert start_method("/tmp/pymp-abcdefgh") == "forkserver"
    assert start_method("/tmp/" + "d" * 70 + "/pymp-abcdefgh") == "forkserver"  # its listener: 107 characters
    assert start_method("/tmp/" + "d" * 71 + "/pymp-abcdefgh") == "spawn"  # 108


def test_the_fork_server_imports_the_modules_the_started_processes_run_under_their_own_names():
    """A server imports its list once and ignores a name it cannot import: the code a rank or a
    profiling twin runs must be there under the name its pickled entry point gives."""
    from dflop.profile.profiler import _twin

    for entry in (rank_entry, _twin):
        assert entry.__module__ in FORK_SERVER_IMPORTS
    for name in FORK_SERVER_IMPORTS[1:]:
        assert importlib.util.find_spec(name) is not None, name


def test_an_unknown_backend_lists_the_valid_ones():
    with pytest.raises(DflopError, match=r"unknown backend 'tpu' \(known: sim, torch\)"):
        get_backend("tpu")


def test_out_of_memory_names_the_rank_the_node_and_the_microbatch_shape(small_samples):
    import torch

    from dflop.backends.torch_runtime.parallel import RankLayout
    from dflop.backends.torch_runtime.runtime import Clock, RankStep, RankState
    from dflop.backends.torch_runtime.shapes import StepData
    from dflop.program.lowering import lower
    from dflop.program.template import build_template

    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(), placement="colocated", microbatches=2)
    batch = small_samples.take(np.arange(6))
    assignment = np.array([0, 1, 0, 1, 0, 1])
    graph = lower(build_template(plan))
    worker = RankState(0, RankLayout(3, 0, 0, ((3,),)), {}, None, None, torch.device("cpu"), 0, 64, 1024, Strategy(zero=1))
    run = RankStep(worker, graph, StepData(plan, batch, assignment), 5, Clock(torch.device("cpu")))
    n = graph.labels.index("0F1")
    err = run.failure(n, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    rows = assignment == 1
    shape = (f"llm stage 0, microbatch 1: 3 samples, {batch.tiles[rows].sum()} tiles, "
             f"{batch.llm_tokens[rows].sum()} tokens")
    assert str(err).startswith("rank 3 (w0) failed at step 5, node 0F1: OutOfMemoryError: out of memory (" + shape)
    assert ">> 0F1" in err.details and "\n" not in str(err)


def test_the_runtime_dispatches_every_node_kind_through_one_table_and_names_a_failing_node(small_samples):
    import torch

    from dflop.backends.torch_runtime.parallel import RankLayout
    from dflop.backends.torch_runtime.runtime import ActionFailed, Clock, RankStep, RankState
    from dflop.backends.torch_runtime.shapes import StepData
    from dflop.program.actions import Kind
    from dflop.program.lowering import lower
    from dflop.program.template import build_template

    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(), placement="colocated", microbatches=2)
    graph = lower(build_template(plan))
    worker = RankState(0, RankLayout(3, 0, 0, ((3,),)), {}, None, None, torch.device("cpu"), 0, 64, 1024, Strategy(zero=1))
    run = RankStep(worker, graph, StepData(plan, small_samples.take(np.arange(4)), np.array([0, 1, 0, 1])), 5,
                  Clock(torch.device("cpu")))
    assert set(run.handlers()) == set(Kind) - {Kind.OVERLAP_F_B}  # a pair runs as its two halves

    def fails(n, node):
        raise ValueError("bad shape")

    run.forward = fails  # the table is built from the bound handlers when the step runs
    with pytest.raises(ActionFailed, match=r"^rank 3 \(w0\) failed at step 5, node 0F0: ValueError: bad shape$"):
        run.run()
    assert run.times == []  # a node that failed is not timed


def test_recomputation_reruns_what_its_mode_drops_and_changes_no_gradient():
    """Counted in the backward of one LLM stage: no recomputation runs no forward op there; full
    reruns every forward op (the MLP's SiLU and the matrix products); selective reruns the SiLU but
    keeps the products; the gradients are the same bits in all three."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dflop.backends.torch_runtime.model import build_stage
    from dflop.backends.torch_runtime.recompute import block_runner
    from dflop.models.llm import pack
    from dflop.specs.plan import Module, Recompute

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    positions, cu = pack([7, 5])
    x0 = torch.randn(12, MODEL.llm.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seen, grads = {}, {}
    for mode in Recompute:
        stage = build_stage(MODEL, Module.LLM, 1, (1, MODEL.llm.layers - 2, 1), seed=3).double()
        stage.run_block = block_runner(mode, split_backward=False)
        x = x0.clone().requires_grad_()
        out = stage(x, None, positions, cu)  # a middle stage: hidden states through its blocks
        with Count() as count:
            out.square().sum().backward()
        seen[mode] = count.ops
        grads[mode] = [x.grad] + [p.grad for p in stage.blocks.parameters()]
    mm = {mode: ops.get("mm", 0) + ops.get("addmm", 0) for mode, ops in seen.items()}
    silu = {mode: ops.get("silu", 0) for mode, ops in seen.items()}
    layers = len(stage.blocks)
    assert silu == {Recompute.NONE: 0, Recompute.SELECTIVE: layers, Recompute.FULL: layers}
    assert mm[Recompute.SELECTIVE] == mm[Recompute.NONE] < mm[Recompute.FULL]
    for mode in (Recompute.SELECTIVE, Recompute.FULL):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads[Recompute.NONE]))


def test_fp32_gradient_buffers_in_a_16_bit_run_are_refused_naming_the_field(system, small_samples):
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=1, zero=1,
                fp32_grads=True)
    steps = scheduled(system, plan, small_samples, 1)
    with pytest.raises(DflopError, match="plan field fp32_grads") as err:
        TorchBackend(options=TorchOptions(dtype="bfloat16"), predict=False).run(CostedPlan(plan, system), steps)
    assert "\n" not in str(err.value)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=8))
def test_the_cost_model_s_targets_are_the_rows_the_backend_s_head_runs_on(samples):
    """``SampleTable.targets`` sizes the head's work and logits in the cost model; the backend's
    packing decides which rows the head actually runs on. They must count alike, per sample and
    for a packed bin."""
    import torch

    from dflop.backends.torch_runtime.model import pack_sequence

    image, text = [m for m, _ in samples], [n for _, n in samples]
    table = SampleTable.build([f"s{i}" for i in range(len(samples))], [0] * len(samples), [0] * len(samples),
                              text, image)
    ids = [torch.zeros(n, dtype=torch.long) for n in text]
    assert [len(pack_sequence([m], [t]).label_rows) for m, t in zip(image, ids)] == table.targets.tolist()
    assert len(pack_sequence(image, ids).label_rows) == table.targets.sum()


RESHARDED = {  # plans a pp2 checkpoint continues under: other ranks hold other parts of every tensor
    "dp2 ZeRO-1": Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=1),
    "tp2": Plan(encoder=ModulePlan(tp=2), llm=ModulePlan(tp=2), placement="colocated", microbatches=2),
}


@pytest.fixture(scope="module")
def pp2_checkpoint(system, small_samples, tmp_path_factory):
    """Three steps' batches and the checkpoints of a run of them under colocated pp2 (after step 2)."""
    plan = PLANS["colocated pp2 1F1B"]
    steps = scheduled(system, plan, small_samples, 3, seed=4)
    folder = tmp_path_factory.mktemp("pp2") / "checkpoints"
    options = TorchOptions(dtype="float64", lr=1e-2, checkpoint_every=2, checkpoint_dir=str(folder))
    TorchBackend(options=options, predict=False).run(CostedPlan(plan, system), steps)
    return [s.batch for s in steps], folder


def rescheduled(system, plan, batches):
    return [ScheduledBatch(b, schedule_batch(b, plan, costs=plan_costs(b, plan, system.model, system.cost),
                                             solver="lpt").assignment) for b in batches]


@pytest.mark.parametrize("name", list(RESHARDED))
def test_a_checkpoint_continues_under_another_plan(system, pp2_checkpoint, name):
    """DCP reshards a pp2 checkpoint onto the new plan's ranks: loaded (a run with no step left), their
    parameters are the checkpoint's, exactly; the step after it (optimizer states resharded too)
    ends where the single-process reference of all three steps ends."""
    from dflop.backends.torch_runtime.hf_export import read_parameters

    batches, folder = pp2_checkpoint
    plan = RESHARDED[name]
    saved = folder / "step-000002"
    loaded = TorchBackend(options=TorchOptions(dtype="float64", resume_from=str(saved)), keep_parameters=True,
                          predict=False).run(CostedPlan(plan, system), rescheduled(system, plan, batches[:2]))
    whole = read_parameters(saved)
    assert {whole_model_name(n, MODEL.llm.tie_embeddings) for n in loaded.extra["parameters"]} == set(whole)
    assert all(torch.equal(t, whole[whole_model_name(n, MODEL.llm.tie_embeddings)])
               for n, t in loaded.extra["parameters"].items())
    options = TorchOptions(dtype="float64", lr=1e-2, checkpoint_every=2, checkpoint_dir=str(folder), resume=True)
    resumed = TorchBackend(options=options, keep_parameters=True, predict=False).run(
        CostedPlan(plan, system), rescheduled(system, plan, batches))
    reference = reference_training(MODEL, batches, TorchOptions(dtype="float64", lr=1e-2))
    assert resumed.extra["first_step"] == 2 and resumed.extra["losses"] == pytest.approx(reference.losses[2:], rel=1e-12)
    assert max_difference(resumed.extra["parameters"], reference.parameters) < 1e-9


@pytest.mark.parametrize("change, message", [
    ({"seed": 1}, r"step-000002/meta\.json: 'seed': this checkpoint was saved with 0, the run has 1$"),
    ({"norm_eps": 1e-5}, r"step-000002/meta\.json: 'model\.llm\.norm_eps': this checkpoint was saved with 1e-06, "
                         r"the run has 1e-05$"),
])
def test_a_checkpoint_of_another_seed_or_model_is_refused_before_any_rank_starts(system, pp2_checkpoint, change,
                                                                                  message):
    """Same shapes, so only the checkpoint's record can tell (a model of other numbers would load)."""
    from dataclasses import replace

    batches, folder = pp2_checkpoint
    model = replace(MODEL, llm=replace(MODEL.llm, norm_eps=change.get("norm_eps", MODEL.llm.norm_eps)))
    other = System(model, system.cluster, system.training, system.cost)
    plan = RESHARDED["dp2 ZeRO-1"]
    options = TorchOptions(dtype="float64", seed=change.get("seed", 0), checkpoint_every=2,
                           checkpoint_dir=str(folder), resume=True)
    with pytest.raises(DflopError, match=message):
        TorchBackend(options=options, predict=False).run(CostedPlan(plan, other), rescheduled(system, plan, batches))


def test_empty_microbatches_run_as_nothing_and_train_as_the_reference(system, small_samples):
    """Megatron's dp_balanced packing leaves a rank's first microbatches empty when it has fewer packs
    than the plan's count: a stage runs an empty microbatch (no token, no tile) as nothing, passes
    nothing on, and the training is the reference's, in fp64."""
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2, dp=2), placement="colocated", microbatches=3)
    batch = small_samples.take(np.arange(8))
    assignment = np.array([1, 1, 2, 2, 4, 5, 5, 5])  # replica 0: bin 0 empty; replica 1: bin 3 empty
    options = TorchOptions(dtype="float64", lr=1e-2, seed=7)
    result = TorchBackend(options=options, keep_parameters=True).run(CostedPlan(plan, system),
                                                                    [ScheduledBatch(batch, assignment)])
    reference = reference_training(MODEL, [batch], options)
    assert max_difference(result.extra["parameters"], reference.parameters) < 1e-9
    assert result.extra["losses"] == pytest.approx(reference.losses, rel=1e-12)


def test_the_warm_up_runs_the_step_whose_largest_microbatch_holds_the_most_activations(small_samples):
    """Not the step of the most samples: a rank's memory peaks with its largest microbatch, whose
    activations grow with its tokens (the LLM's, and the encoder's tiles), each times hidden size and
    layers."""
    images = small_samples.take(np.flatnonzero(np.isin(small_samples.modality, (1, 2)))[:8])
    video = small_samples.take(np.argsort(-small_samples.tiles * (small_samples.modality == 3))[:2])
    spread = ScheduledBatch(images, np.arange(8))  # 8 images, one a microbatch
    packed = ScheduledBatch(video, np.zeros(2, dtype=int))  # the 2 longest videos in one microbatch
    assert images.tiles.sum() > video.tiles.sum() > images.tiles.max()  # more in all, less in one microbatch
    steps = [spread, packed, spread]
    payload = Payload(PLANS["dp2 ZeRO-0 (DDP)"], MODEL, [s.batch for s in steps], [s.assignment for s in steps],
                      TorchOptions(), 4)
    assert heaviest_step(payload, range(3)) == 1
    assert heaviest_step(payload, range(2, 3)) == 2  # a resumed run warms up on the steps it runs
