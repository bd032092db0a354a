import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.cost import AnalyticalCostModel, StageSpec, WorkShape, stage_params, state_bytes
from dflop.cost import flops as F
from dflop.specs import TrainingSpec, presets
from dflop.specs.plan import Recompute


def test_qwen_layer_flops_by_hand(model):
    llm = model.llm  # hidden 3584, 28 heads of 128, 4 KV heads (kv dim 512), SwiGLU 18944
    q_kv = 3584 * (3584 + 2 * 512)      # Q, K, V projections
    out = 3584 * 3584                   # output projection
    mlp = 3 * 3584 * 18944              # gate, up, down
    assert F.llm_layer_flops(llm, 1, 0).gemm == 2 * (q_kv + out + mlp) == 466_092_032
    # Causal attention over one 4096-token sample: QK^T and AV, 2*L^2*h each, half of it masked.
    assert F.llm_layer_flops(llm, 4096, 4096**2).attention == 2 * 4096**2 * 3584
    # Two samples of 2048 tokens cost a quarter as much attention as one of 4096.
    assert F.llm_layer_flops(llm, 4096, 2 * 2048**2).attention == 2 * 4096**2 * 3584 / 2


def test_siglip_tile_flops_by_hand(model):
    enc = model.encoder  # 729 tokens per tile, hidden 1152, MLP 4304
    gemm = 2 * 729 * (4 * 1152**2 + 2 * 1152 * 4304)
    attention = 4 * 1152 * 729**2
    layer = F.vit_layer_flops(enc, 1)
    assert (layer.gemm, layer.attention) == (gemm, attention) == (22_197_805_056, 2_448_880_128)


def test_parameter_counts_match_published_totals():
    assert F.llm_params(presets.llm("qwen2.5-7b")) == 7_615_616_512
    assert F.llm_params(presets.llm("llama-3-8b")) == 8_030_261_248


def test_state_bytes_match_zero_paper(training):
    # ZeRO (Rajbhandari et al. 2020), Fig. 1: 7.5B parameters, 64-way data parallel,
    # mixed-precision Adam: 120 GB baseline, 31.4 GB with optimizer-state partitioning.
    psi = 7.5e9
    assert sum(state_bytes(psi, tp=1, dp=64, zero=0, training=training)) == pytest.approx(120e9)
    assert sum(state_bytes(psi, tp=1, dp=64, zero=1, training=training)) == pytest.approx(31.40625e9)


def test_stage_params_cover_the_model(model):
    llm = model.llm
    stages = [StageSpec("llm", 14, first=True), StageSpec("llm", 14, last=True)]
    assert sum(stage_params(model, s) for s in stages) == F.llm_params(llm)
    whole = StageSpec("llm", 28, first=True, last=True)
    assert stage_params(model, whole) == F.llm_params(llm)


@pytest.fixture(scope="module")
def cost(model, h100):
    return AnalyticalCostModel(model, h100, TrainingSpec(global_batch=8))


shapes = st.tuples(st.integers(1, 30000), st.integers(1, 30000), st.integers(0, 40))


def shape_of(tokens, longest, tiles):
    longest = min(longest, tokens)
    return WorkShape(samples=1, tiles=tiles, tokens=tokens, sum_sq=longest**2)


@given(a=shapes, b=shapes, tp=st.sampled_from([1, 2, 4, 8]), layers=st.integers(1, 40))
def test_time_grows_with_work_and_is_subadditive(cost, a, b, tp, layers):
    for module in ("llm", "encoder"):
        stage = StageSpec(module, layers, tp=tp, first=True, last=True)
        ca, cb = cost.stage_cost(stage, shape_of(*a)), cost.stage_cost(stage, shape_of(*b))
        both = cost.stage_cost(stage, WorkShape(2, a[2] + b[2], a[0] + b[0],
                                                min(a[1], a[0])**2 + min(b[1], b[0])**2))
        for field in ("fwd", "bwd_input", "bwd_weight"):
            x, y, z = getattr(ca, field), getattr(cb, field), getattr(both, field)
            assert z >= max(x, y) * (1 - 1e-12)         # more work never takes less time
            assert z <= (x + y) * (1 + 1e-12)           # one microbatch never costs more than two
        assert both.act_bytes >= max(ca.act_bytes, cb.act_bytes)


@given(a=shapes, layers=st.integers(1, 20), k=st.integers(2, 4))
def test_layers_scale_time_exactly(cost, a, layers, k):
    one = cost.stage_cost(StageSpec("llm", layers), shape_of(*a))
    many = cost.stage_cost(StageSpec("llm", layers * k), shape_of(*a))
    assert many.fwd == pytest.approx(k * one.fwd, rel=1e-12)
    assert many.act_bytes == pytest.approx(k * one.act_bytes, rel=1e-12)


@given(a=shapes, tp=st.sampled_from([2, 4, 8]))
def test_tensor_parallelism_divides_work_and_memory(cost, a, tp):
    stage1, stage_tp = StageSpec("llm", 4), StageSpec("llm", 4, tp=tp)
    one, split = cost.stage_cost(stage1, shape_of(*a)), cost.stage_cost(stage_tp, shape_of(*a))
    assert split.flops == pytest.approx(one.flops / tp)
    assert split.act_bytes == pytest.approx(one.act_bytes / tp)


def test_vectorised_shapes_match_scalar(cost):
    tokens = np.array([100.0, 5000.0, 20000.0])
    batch = cost.stage_cost(StageSpec("llm", 3, tp=2), WorkShape(1, 0, tokens, tokens**2))
    for i, t in enumerate(tokens):
        one = cost.stage_cost(StageSpec("llm", 3, tp=2), WorkShape(1, 0, t, t * t))
        assert batch.fwd[i] == pytest.approx(float(one.fwd))


def test_empty_microbatch_costs_nothing(cost):
    c = cost.stage_cost(StageSpec("encoder", 27, tp=4, first=True, last=True), WorkShape())
    assert float(c.fwd) == 0 and float(c.bwd) == 0 and float(c.act_bytes) == 0


def test_recompute_trades_memory_for_time(model, h100):
    cost = AnalyticalCostModel(model, h100, TrainingSpec(global_batch=8))
    shape = WorkShape(1, 0, 8000, 8000**2)
    plain, selective, full = (cost.stage_cost(StageSpec("llm", 7, recompute=r), shape) for r in Recompute)
    assert full.bwd_input == pytest.approx(plain.bwd_input + plain.fwd)
    assert full.act_bytes < plain.act_bytes / 4
    assert full.recompute_flops == pytest.approx(plain.flops) and plain.recompute_flops == 0
    # Selective drops the norms' outputs and SwiGLU's product, a third of a Qwen layer's activations,
    # and redoes them at memory speed: slower than none, much faster than full.
    llm = model.llm
    kept = 6 * llm.hidden + 2 * llm.kv_dim + 3 * llm.ffn
    dropped = 2 * llm.hidden + llm.ffn
    assert selective.act_bytes == pytest.approx(plain.act_bytes * (kept - dropped) / kept)
    assert plain.bwd_input < selective.bwd_input < full.bwd_input
    redo = 3 * 8000 * dropped * 2 / h100.hbm_bandwidth  # three passes over the dropped bf16 elements
    assert selective.bwd_input - plain.bwd_input == pytest.approx(7 * redo)
    # While a layer is recomputed its activations exist for a moment: full holds one layer's worth.
    assert full.transient_bytes == pytest.approx(plain.act_bytes / 7)
    assert selective.transient_bytes == pytest.approx(8000 * dropped * 2)


def test_logits_gradient_is_a_transient_peak_of_the_last_stage(model, h100):
    cost = AnalyticalCostModel(model, h100, TrainingSpec(global_batch=8))
    tokens, tp = 4096, 2
    last = cost.stage_cost(StageSpec("llm", 2, tp=tp, last=True), WorkShape(1, 0, tokens, tokens**2))
    inner = cost.stage_cost(StageSpec("llm", 2, tp=tp), WorkShape(1, 0, tokens, tokens**2))
    logits = tokens * model.llm.vocab * 4 / tp  # fp32, vocabulary split over TP
    assert last.transient_bytes == pytest.approx(logits) and inner.transient_bytes == 0
    # Two parts of one stage run their backwards one after the other: transients do not add up.
    assert (last + last).transient_bytes == pytest.approx(logits)


@given(tokens=st.integers(1, 30000), share=st.floats(0, 1), tp=st.sampled_from([1, 2, 4]))
def test_the_head_and_its_logits_are_sized_by_the_positions_that_predict_text(cost, model, tokens, share, tp):
    """The backend computes logits only where the next token is text of the same sample (image
    tokens are inputs, never targets); a shape without the split prices every token."""
    llm, targets = model.llm, round(tokens * share)
    shape = WorkShape(1, 0, tokens, tokens**2, targets)
    last, inner = (cost.stage_cost(StageSpec("llm", 2, tp=tp, last=last), shape) for last in (True, False))
    assert last.flops - inner.flops == pytest.approx(2 * targets * llm.hidden * llm.vocab / tp)
    assert last.transient_bytes == pytest.approx(targets * llm.vocab * 4 / tp)
    unsplit = cost.stage_cost(StageSpec("llm", 2, tp=tp, last=True), WorkShape(1, 0, tokens, tokens**2))
    assert unsplit.flops - inner.flops == pytest.approx(2 * tokens * llm.hidden * llm.vocab / tp)
