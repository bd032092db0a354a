import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.errors import PlanError, SpecError
from dflop.specs import (ClusterSpec, HardwareSpec, LLMSpec, ModulePlan, Plan, TrainingSpec,
                         from_mapping, llm_from_hf_config, load_spec, presets, save_spec, to_mapping)
from dflop.specs.plan import Module, Recompute, place
from dflop.specs.resolve import named_spec
from dflop.specs.run import RunConfig, load_run_config

# Published architecture numbers (public config.json files), DESIGN.md's list.
LLMS = {
    "qwen2.5-7b": (28, 3584, 28, 4, 18944, 152064),
    "qwen2.5-32b": (64, 5120, 40, 8, 27648, 152064),
    "qwen2.5-72b": (80, 8192, 64, 8, 29568, 152064),
    "llama-3-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama-3-70b": (80, 8192, 64, 8, 28672, 128256),
}


@pytest.mark.parametrize("name", sorted(LLMS))
def test_llm_presets_carry_the_published_numbers(name):
    spec = presets.llm(name)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab) == LLMS[name]


def test_encoder_presets_carry_the_published_numbers():
    siglip = presets.encoder("siglip-so400m")
    # 27 layers in the checkpoint; LLaVA-OneVision removes the last and runs 26.
    assert (siglip.layers, siglip.hidden, siglip.heads, siglip.mlp) == (26, 1152, 16, 4304)
    assert siglip.patches_per_tile == 729 and siglip.tiling.tile_tokens == 729
    small = presets.encoder("InternViT-300M")  # names are case-insensitive
    assert (small.layers, small.hidden, small.image_size, small.tiling.tile_tokens) == (24, 1024, 448, 256)
    big = presets.encoder("internvit-6b")
    assert (big.layers, big.hidden, big.heads, big.mlp, big.norm) == (45, 3200, 25, 12800, "rmsnorm")


def test_hardware_presets_are_data():
    h100 = presets.hardware("h100")
    assert h100.peak_flops == pytest.approx(989.4e12)
    assert presets.hardware("h200").memory_gib > presets.hardware("h100").memory_gib
    assert presets.hardware("a100-80gb").peak_flops == pytest.approx(312e12)
    assert presets.hardware("cpu").name == "cpu"
    # The efficiency curve is interpolated in log(flops) and saturates at its ends.
    assert h100.achieved(1e10) == pytest.approx(0.38)
    assert h100.achieved(1e20) == pytest.approx(0.62)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(SpecError, match=r"unknown LLM 'qwen7b' \(known: qwen2.5-7b"):
        presets.llm("qwen7b")


@pytest.mark.parametrize("name", presets.names("llms"))
def test_llm_spec_yaml_round_trip(tmp_path, name):
    spec = presets.llm(name)
    path = save_spec(spec, tmp_path / "llm.yaml")
    assert load_spec(LLMSpec, path) == spec


def test_hardware_round_trip_and_cluster_from_preset_name(tmp_path):
    cluster = from_mapping(ClusterSpec, {"hardware": "h100", "nodes": 2, "gpus_per_node": 8}, "c:", named_spec)
    path = save_spec(cluster, tmp_path / "cluster.yaml")
    assert load_spec(ClusterSpec, path) == cluster
    assert cluster.gpus == 16


plans = st.builds(
    Plan,
    encoder=st.builds(ModulePlan, tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 3), dp=st.integers(1, 8)),
    llm=st.builds(ModulePlan, tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 4), dp=st.integers(1, 8),
                  layers_per_stage=st.lists(st.integers(1, 20), max_size=4).map(tuple)),
    placement=st.sampled_from(["disaggregated", "colocated"]),
    microbatches=st.integers(1, 64),
    schedule=st.sampled_from(["1F1B", "GPipe", "Interleaved1F1B"]),
    virtual_stages=st.integers(1, 3),
    zero=st.sampled_from([0, 1, 3]),
)


@given(plans, st.fixed_dictionaries({}, optional={"zero": st.sampled_from([0, 1, 2, 3, 4]), "hsdp": st.booleans(),
                                                  "fp32_grads": st.booleans(),
                                                  "recompute": st.sampled_from(list(Recompute))}))
def test_a_plan_with_other_memory_options_is_the_plan_replace_builds(plan, options):
    _ = plan.strategy  # kept only where the options leave it as it was
    try:
        checked = replace(plan, **options)
    except SpecError as exc:
        with pytest.raises(SpecError, match=str(exc).split(":")[0]):
            plan.with_options(**options)
        return
    quick = plan.with_options(**options)
    assert quick == checked and hash(quick) == hash(checked) and quick.strategy == checked.strategy
    assert quick.recompute is checked.recompute and replace(plan) == plan  # the original unchanged


@given(plans)
def test_plan_yaml_round_trip(plan):
    import yaml

    text = yaml.safe_dump(to_mapping(plan))
    assert from_mapping(Plan, yaml.safe_load(text), "plan:") == plan


def test_plan_that_fits(model, cluster):
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=8), llm=ModulePlan(tp=4, pp=2, dp=3), microbatches=8)
    assert plan.validate(cluster, model, global_batch=256) is plan


def test_plan_lists_every_problem(model, cluster):
    plan = Plan(encoder=ModulePlan(tp=1, pp=1, dp=8), llm=ModulePlan(tp=8, pp=4, dp=1), microbatches=8)
    with pytest.raises(PlanError) as err:
        plan.validate(cluster, model)
    message = str(err.value)
    assert "needs 40 GPUs but the cluster has 32" in message
    assert "llm tp 8 does not divide the 28 attention heads of qwen2.5-7b" in message
    assert "\n" not in message


@pytest.mark.parametrize("llm,problem", [
    (ModulePlan(tp=16), "llm tp 16 does not fit a 8-GPU node"),
    (ModulePlan(tp=2, pp=29), "llm needs 29 pipeline stages but qwen2.5-7b has 28 layers"),
    (ModulePlan(pp=2, layers_per_stage=(10, 10)), "layers_per_stage sums to 20, qwen2.5-7b has 28"),
    (ModulePlan(pp=2, layers_per_stage=(28,)), "layers_per_stage lists 1 stages, the plan has 2"),
])
def test_plan_problems_are_specific(model, cluster, llm, problem):
    plan = Plan(encoder=ModulePlan(), llm=llm, microbatches=4)
    assert any(problem in p for p in plan.problems(cluster, model))


def test_plan_kv_heads_and_global_batch(model, cluster):
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(tp=2, dp=8), microbatches=64)
    assert any("= 512 bins, more than the 256 samples" in p for p in plan.problems(cluster, model, 256))
    gqa = LLMSpec(name="gqa", layers=4, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=100)
    from dflop.specs import MLLMSpec
    small = MLLMSpec(encoder=model.encoder, llm=gqa)
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(tp=4), microbatches=1)
    assert any("does not divide the 2 key-value heads" in p for p in plan.problems(cluster, small))


def test_colocated_plan_needs_matching_encoder(model, cluster):
    plan = Plan(encoder=ModulePlan(tp=1, dp=2), llm=ModulePlan(tp=2, pp=2, dp=2), microbatches=4,
                placement="colocated")
    assert any("colocated placement runs the encoder inside the first LLM stage" in p
               for p in plan.problems(cluster, model))


def test_tp_group_may_not_straddle_nodes(model, cluster):
    # 6 encoder GPUs first, then LLM TP groups of 4 would cover GPUs 6-9 across two nodes.
    plan = Plan(encoder=ModulePlan(dp=6), llm=ModulePlan(tp=4, pp=1, dp=2), microbatches=2)
    assert any("TP group spans nodes [0, 1]" in p for p in plan.problems(cluster, model))


def test_hf_config_import(tmp_path):
    config = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
              "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
              "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlavaQwen"], "text_config": config}))
    spec = llm_from_hf_config(path, name="mine")
    ref = presets.llm("qwen2.5-7b")
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.qkv_bias) == \
        (ref.layers, ref.hidden, ref.heads, ref.kv_heads, ref.ffn, ref.vocab, True)


def test_hf_config_errors_name_the_file_and_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(SpecError, match=r"config.json: missing key 'num_attention_heads'"):
        llm_from_hf_config(path)
    path.write_text("{ not json")
    with pytest.raises(SpecError, match=r"config.json:1: not valid JSON"):
        llm_from_hf_config(path)


def test_yaml_errors_name_file_key_and_line(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("encoder: siglip-so400m\nllm: qwen2.5-7b\ncluster: {hardware: h100, nodes: two, "
                   "gpus_per_node: 8}\ntraining: {global_batch: 8}\n")
    with pytest.raises(SpecError, match=r"run.yaml: cluster.nodes: expected an integer, got str 'two'"):
        load_run_config(bad)
    bad.write_text("encoder: siglip-so400m\nllm: qwen2.5-7b\ncluster: {hardware: h100, nodes: 1, "
                   "gpus_per_node: 8}\ntraining: {global_batch: 8, batch: 3}\n")
    with pytest.raises(SpecError, match=r"run.yaml: training: unknown key 'batch' \(valid keys: global_batch"):
        load_run_config(bad)
    bad.write_text("encoder: [unclosed\n")
    with pytest.raises(SpecError, match=r"run.yaml:2: not valid YAML"):
        load_run_config(bad)
    bad.write_text("encoder: siglip\nllm: qwen2.5-7b\ncluster: {hardware: h100, nodes: 1, "
                   "gpus_per_node: 8}\ntraining: {global_batch: 8}\n")
    with pytest.raises(SpecError, match=r"run.yaml: encoder: unknown encoder 'siglip'"):
        load_run_config(bad)


def test_validation_names_the_field():
    with pytest.raises(SpecError, match=r"heads: 5 does not divide hidden size 64"):
        LLMSpec(name="x", layers=1, hidden=64, heads=5, kv_heads=5, ffn=8, vocab=8)
    with pytest.raises(SpecError, match="efficiency: fractions must not decrease"):
        HardwareSpec(name="x", peak_flops=1e12, memory_gib=1, hbm_bandwidth=1e9, intra_node_bandwidth=1e9,
                     inter_node_bandwidth=1e9, efficiency=((1e9, 0.5), (1e10, 0.4)))
    with pytest.raises(SpecError, match="rises too steeply"):
        HardwareSpec(name="x", peak_flops=1e12, memory_gib=1, hbm_bandwidth=1e9, intra_node_bandwidth=1e9,
                     inter_node_bandwidth=1e9, efficiency=((1e9, 0.01), (1e10, 0.9)))
    with pytest.raises(SpecError, match="global_batch: must be at least 1"):
        TrainingSpec(global_batch=0)


def test_embedded_default_run_config():
    config = load_run_config()
    assert isinstance(config, RunConfig)
    assert config.model.name == "siglip-so400m+qwen2.5-7b"
    assert config.cluster.gpus == 32 and config.cluster.hardware.name.startswith("H100")
    assert config.data.preset == "llava-ov"


@given(plans, st.sampled_from([0, 1, 2, 3]))
def test_strategy_facts_agree_with_the_stages_and_the_gpu_map(plan, zero):
    """Each ZeRO stage shards what the one below shards and more, exactly one gradient-reduction
    pattern holds, and the rank said to carry the encoder is the one whose GPUs ``place`` gives it."""
    s = replace(plan, zero=zero).strategy
    assert s.shards_optimizer >= s.shards_gradients >= s.shards_parameters
    assert s.shards_optimizer == (zero >= 1) and s.shards_parameters == (zero == 3)
    assert [s.reduces_once_per_step, s.reduces_every_backward, s.shards_parameters].count(True) == 1
    assert s.runs_as_fsdp2 == s.shards_gradients and s.reshards_after_forward == s.shards_parameters
    gpus = place(plan)
    for rank in range(plan.llm.pp):
        shares = any(gpus.groups.get((Module.ENCODER, 0, r)) == gpus.gpus(Module.LLM, rank, r)
                     for r in range(plan.llm.dp))
        assert s.carries_encoder(Module.LLM, (rank,)) == shares
        assert s.modules_of(Module.LLM, (rank,)) == ((Module.LLM, Module.ENCODER) if shares else (Module.LLM,))
    assert not s.carries_encoder(Module.ENCODER, (0,))
    assert s.mesh_owner(Module.ENCODER) == (Module.LLM if plan.colocated else Module.ENCODER)
