"""`dflop export`: golden outputs, and round trips through parsers shaped like the targets' own.

Megatron-LM's flags are parsed by an argparse parser declaring them as
``megatron/training/arguments.py`` does (unknown flags fail); its layer-split
rules (even split, first/last stage, layout string) are re-applied to recover
each stage's layers. torchtitan's fragment is parsed with ``tomllib``.
Regenerate the goldens with ``python tests/test_export.py`` after a deliberate change.
"""

import argparse
import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, strategies as st

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.errors import DflopError
from dflop.jobs.export import export_plan
from dflop.specs import presets
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.loading import save_spec
from dflop.specs.plan import ModulePlan, Plan
from dflop.specs.run import load_run_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

GOLDEN = Path(__file__).parent / "golden" / "export"
MODEL = presets.model("siglip-so400m", "qwen2.5-7b")
LAYERS = MODEL.llm.layers

CASES = {
    "colocated_pp2_interleaved_tp2": (
        Plan(encoder=ModulePlan(tp=2, dp=8), llm=ModulePlan(tp=2, pp=2, dp=8), placement="colocated",
             microbatches=8, schedule="Interleaved1F1B", virtual_stages=2, zero=1, recompute="full"),
        TrainingSpec(global_batch=256, recompute="full")),
    "pure_dp_zero3": (
        Plan(encoder=ModulePlan(dp=32), llm=ModulePlan(dp=32), placement="colocated", microbatches=1, zero=3),
        TrainingSpec(global_batch=256, grad_bytes=4)),
    "disaggregated": (
        Plan(encoder=ModulePlan(dp=8), llm=ModulePlan(tp=4, pp=2, dp=3, layers_per_stage=(13, 15)),
             placement="disaggregated", microbatches=8, schedule="ZBH1", zero=1),
        TrainingSpec(global_batch=240)),
}


def export(name, target):
    plan, training = CASES[name]
    return export_plan(plan, MODEL, target, global_batch=training.global_batch, training=training)


@pytest.mark.parametrize("target, suffix", [("megatron", "sh"), ("torchtitan", "toml")])
@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_outputs(name, target, suffix):
    assert export(name, target).text == (GOLDEN / f"{name}.{suffix}").read_text()


# ---- Megatron-LM -------------------------------------------------------------------------------

def megatron_parser():
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for name in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "encoder-tensor-model-parallel-size",
                 "encoder-pipeline-model-parallel-size", "num-virtual-stages-per-pipeline-rank",
                 "decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers", "micro-batch-size",
                 "global-batch-size", "recompute-num-layers", "num-distributed-optimizer-instances"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--pipeline-model-parallel-layout", type=str)
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--data-parallel-sharding-strategy", choices=["no_shard", "optim", "optim_grads",
                                                                 "optim_grads_params"])
    for name in ("use-distributed-optimizer", "use-megatron-fsdp", "accumulate-allreduce-grads-in-fp32",
                 "grad-reduce-in-bf16"):
        p.add_argument(f"--{name}", action="store_true")
    return p


def parse_megatron(text):
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    return megatron_parser().parse_args(shlex.split(" ".join(line.rstrip(" \\") for line in lines)))


def megatron_stage_layers(args, layers):
    """Each stage's layers, as Megatron splits them (stages in order, virtual ones included)."""
    pp = args.pipeline_model_parallel_size
    if args.pipeline_model_parallel_layout:
        unrolled = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), args.pipeline_model_parallel_layout)
        assert unrolled.startswith("E") and unrolled.endswith("L")
        return tuple(stage.count("t") for stage in unrolled.split("|"))
    stages = pp * (args.num_virtual_stages_per_pipeline_rank or 1)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is None and last is None:
        assert layers % stages == 0
        return (layers // stages,) * stages
    middle_stages = stages - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    assert rest % middle_stages == 0
    middle = (rest // middle_stages,) * middle_stages
    return ((first,) if first is not None else ()) + middle + ((last,) if last is not None else ())


plans = st.builds(
    lambda tp, pp, dp, v, m, zero, uneven: (tp, pp, dp, v, m, zero, uneven),
    st.sampled_from([1, 2, 4]), st.integers(1, 4), st.integers(1, 8), st.integers(1, 2), st.integers(1, 8),
    st.sampled_from([0, 1, 3]), st.lists(st.integers(-2, 2), min_size=8, max_size=8))


def make_plan(tp, pp, dp, v, m, zero, uneven):
    assume(not (zero == 3 and pp > 1) and not (v > 1 and pp == 1))
    stages = pp * v
    base = [LAYERS // stages + (1 if i < LAYERS % stages else 0) for i in range(stages)]
    shifts = uneven[:stages]
    layers = [max(1, n + d) for n, d in zip(base, shifts)]
    layers[-1] += LAYERS - sum(layers)
    assume(layers[-1] >= 1)
    return Plan(encoder=ModulePlan(tp=tp, dp=dp), llm=ModulePlan(tp=tp, pp=pp, dp=dp, layers_per_stage=tuple(layers)),
                placement="colocated", microbatches=m, schedule="Interleaved1F1B" if v > 1 else "1F1B",
                virtual_stages=v, zero=zero)


@given(plans, st.integers(1, 512))
def test_megatron_flags_round_trip(spec, global_batch):
    plan = make_plan(*spec)
    assume(global_batch >= plan.bins)
    args = parse_megatron(export_plan(plan, MODEL, "megatron", global_batch=global_batch).text)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (plan.llm.tp, plan.llm.pp)
    assert megatron_stage_layers(args, LAYERS) == plan.llm.layers_per_stage
    assert args.global_batch_size == args.micro_batch_size * plan.llm.dp * plan.microbatches
    assert args.global_batch_size <= global_batch < args.global_batch_size + plan.llm.dp * plan.microbatches
    assert args.use_distributed_optimizer == (plan.zero >= 1)
    assert (args.data_parallel_sharding_strategy == "optim_grads_params") == (plan.zero == 3)


def test_megatron_encoder_flags_and_gaps():
    e = export("disaggregated", "megatron")
    args = parse_megatron(e.text)
    assert (args.encoder_tensor_model_parallel_size, args.encoder_pipeline_model_parallel_size) == (1, 1)
    assert args.decoder_first_pipeline_num_layers == 13 and args.decoder_last_pipeline_num_layers is None
    assert any("encoder dp 8 differs from llm dp 3" in g for g in e.unsupported)
    assert any("ZBH1" in g for g in e.unsupported)
    assert not any("disaggregated" in g for g in export("colocated_pp2_interleaved_tp2", "megatron").unsupported)


def test_recompute_and_gradient_precision():
    full = parse_megatron(export("colocated_pp2_interleaved_tp2", "megatron").text)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert full.grad_reduce_in_bf16 and not full.accumulate_allreduce_grads_in_fp32
    none = parse_megatron(export("pure_dp_zero3", "megatron").text)  # its recipe's gradients are fp32 already
    assert none.recompute_granularity is None and none.accumulate_allreduce_grads_in_fp32
    plan = dataclasses.replace(CASES["colocated_pp2_interleaved_tp2"][0], recompute="selective", fp32_grads=True)
    selective = parse_megatron(export_plan(plan, MODEL, "megatron", global_batch=256).text)
    assert selective.recompute_granularity == "selective" and selective.accumulate_allreduce_grads_in_fp32
    titan = tomllib.loads(export_plan(plan, MODEL, "torchtitan", global_batch=256).text)
    assert titan["activation_checkpoint"]["mode"] == "selective"


# ---- torchtitan --------------------------------------------------------------------------------

@given(plans, st.integers(1, 512))
def test_torchtitan_toml_round_trip(spec, global_batch):
    plan = make_plan(*spec)
    assume(global_batch >= plan.bins)
    doc = tomllib.loads(export_plan(plan, MODEL, "torchtitan", global_batch=global_batch).text)
    par, training = doc["parallelism"], doc["training"]
    assert par["tensor_parallel_degree"] == plan.llm.tp and par["pipeline_parallel_degree"] == plan.llm.pp
    if plan.zero == 0 and plan.llm.tp == plan.llm.pp == 1:  # DDP
        assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (plan.llm.dp, 1)
    else:  # FSDP over every data-parallel rank
        assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, plan.llm.dp)
    assert training["global_batch_size"] == training["local_batch_size"] * plan.llm.dp
    if plan.llm.pp > 1:
        assert training["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == plan.microbatches
        parts = par["module_fqns_per_model_part"]
        assert [sum(n.startswith("layers.") for n in p) for p in parts] == list(plan.llm.layers_per_stage)
        flat = [n for p in parts for n in p]
        assert flat == ["tok_embeddings"] + [f"layers.{i}" for i in range(LAYERS)] + ["norm", "output"]
    assert doc["activation_checkpoint"]["mode"] == "none"


def test_torchtitan_states_what_it_loses():
    e = export("disaggregated", "torchtitan")
    doc = tomllib.loads(e.text)
    assert doc["parallelism"]["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    assert any("disaggregated placement" in g for g in e.unsupported)
    assert any("balanced bins" in g for g in e.unsupported)
    assert "BalancedBatchSampler(" in e.text and "dp_rank=dp_rank" in e.text
    for gap in e.unsupported:  # every loss is written into the fragment, too
        assert gap.split(":")[0] in e.text


def test_hsdp_shards_within_a_node_of_the_cluster():
    plan = dataclasses.replace(CASES["pure_dp_zero3"][0], hsdp=True)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=4, gpus_per_node=8)
    doc = tomllib.loads(export_plan(plan, MODEL, "torchtitan", global_batch=256, cluster=cluster).text)
    assert (doc["parallelism"]["data_parallel_replicate_degree"],
            doc["parallelism"]["data_parallel_shard_degree"]) == (4, 8)
    with pytest.raises(DflopError, match="hsdp shards within a node; give the cluster"):
        export_plan(plan, MODEL, "torchtitan", global_batch=256)


def test_bad_layer_split_is_an_error():
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(pp=2, dp=2, layers_per_stage=(10, 10)),
                placement="colocated", microbatches=2)
    with pytest.raises(DflopError, match=r"LLM stages \[10, 10\] do not split the 28 layers"):
        export_plan(plan, MODEL, "megatron", global_batch=64)


# ---- the command -------------------------------------------------------------------------------

@pytest.mark.processes
def test_export_command(tmp_path):
    plan, _ = CASES["colocated_pp2_interleaved_tp2"]
    path = save_spec(plan, tmp_path / "plan.yaml")
    out = dflop_json("export", path, "--to", "torchtitan", "--global-batch", 128)
    assert out["target"] == "torchtitan" and isinstance(out["unsupported"], list)
    assert tomllib.loads(out["text"])["training"]["global_batch_size"] == 128
    text = dflop("export", path, "--to", "megatron")
    config_batch = load_run_config().training.global_batch
    assert text.returncode == 0 and parse_megatron(text.stdout).global_batch_size == config_batch
    assert_one_line_error(dflop("export", tmp_path / "missing.yaml", "--to", "megatron"), "missing.yaml")
    (tmp_path / "bad.yaml").write_text("encoder: {tp: 1}\nllm: {tp: 0}\nmicrobatches: 1\n")
    assert_one_line_error(dflop("export", tmp_path / "bad.yaml", "--to", "megatron"), "tp")


if __name__ == "__main__":  # rewrite the goldens
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        for target, suffix in (("megatron", "sh"), ("torchtitan", "toml")):
            (GOLDEN / f"{case}.{suffix}").write_text(export(case, target).text)
    sys.exit(0)
