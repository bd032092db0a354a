"""`dflop export`: golden outputs, and round trips through parsers shaped like the targets' own.

Megatron-LM's flags are parsed by an argparse parser declaring exactly the flags of a pinned
release (``data/megatron_core_v0_19_0_flags.json``, taken from that release's
``megatron/training/arguments.py``; an unknown flag, a value of the wrong kind or a value after a
store_true flag fails); its layer-split rules (even split, first/last stage, layout string) are
re-applied to recover each stage's layers. torchtitan 0.3's overrides are held against the field
names and types of its config dataclasses (``data/torchtitan_0_3_0_fields.json``, from the 0.3.0
release), and its generated layer split is re-applied; the 0.2 TOML form is parsed with ``tomllib``.
A field renamed in dflop or missing from the pinned release fails these checks.
Regenerate the goldens with ``python tests/test_export.py`` after a deliberate change.
"""

import argparse
import dataclasses
import json
import re
import shlex
import sys
import tomllib
from collections import namedtuple
from pathlib import Path
from types import UnionType
from typing import Literal, get_args, get_origin

import pytest
from hypothesis import assume, given, strategies as st

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.errors import DflopError
from dflop.jobs.export import TitanVersion, export_plan
from dflop.specs import presets
from dflop.specs.hardware import ClusterSpec, TrainingSpec
from dflop.specs.loading import save_spec
from dflop.specs.plan import ModulePlan, Plan
from dflop.specs.run import load_run_config


GOLDEN = Path(__file__).parent / "golden" / "export"
DATA = Path(__file__).parent / "data"
MEGATRON_FLAGS = json.loads((DATA / "megatron_core_v0_19_0_flags.json").read_text())["flags"]
TITAN = json.loads((DATA / "torchtitan_0_3_0_fields.json").read_text())
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


FORMS = [("megatron", "0.3", "sh"), ("torchtitan", "0.2", "toml"), ("torchtitan", "0.3", "txt")]
"""(target, torchtitan version, golden suffix): Megatron-LM flags, torchtitan 0.2 TOML, torchtitan 0.3 overrides."""


def export(name, target, version="0.3"):
    plan, training = CASES[name]
    return export_plan(plan, MODEL, target, global_batch=training.global_batch, training=training,
                       torchtitan_version=version)


@pytest.mark.parametrize("target, version, suffix", FORMS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_outputs(name, target, version, suffix):
    assert export(name, target, version).text == (GOLDEN / f"{name}.{suffix}").read_text()


# ---- Megatron-LM -------------------------------------------------------------------------------

def megatron_parser():
    """The pinned release's flags, each with its value kind (store_true flags take none)."""
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, spec in MEGATRON_FLAGS.items():
        if spec.get("action") == "store_true":
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type={"int": int, "str": str}[spec["type"]], choices=spec.get("choices"))
    return p


def parse_megatron(text):
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    args, unknown = megatron_parser().parse_known_args(shlex.split(" ".join(line.rstrip(" \\") for line in lines)))
    assert not unknown, f"not flags of Megatron-LM core_v0.19.0 (or a value after a store_true flag): {unknown}"
    return args


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


def test_megatron_disaggregated_encoder_is_a_gap_not_a_flag():
    """The encoder's parallelism flags left Megatron-LM in core v0.14: written as flags they would stop
    the launch, so they are named in the gap instead."""
    e = export("disaggregated", "megatron")
    args = parse_megatron(e.text)  # only flags of the pinned release
    assert args.decoder_first_pipeline_num_layers == 13 and args.decoder_last_pipeline_num_layers is None
    assert "--encoder-" not in "".join(line for line in e.text.splitlines() if not line.startswith("#"))
    (gap,) = [g for g in e.unsupported if g.startswith("disaggregated placement")]
    assert "--encoder-tensor-model-parallel-size 1 --encoder-pipeline-model-parallel-size 1" in gap
    assert "llm tp 4 and dp 3" in gap
    assert any("ZBH1" in g for g in e.unsupported)
    assert not any("disaggregated" in g for g in export("colocated_pp2_interleaved_tp2", "megatron").unsupported)


@pytest.mark.parametrize("name", sorted(CASES))
def test_megatron_flags_exist_at_the_pinned_release(name):
    """Every flag written, with or without a value as the release declares it."""
    text = export(name, "megatron").text
    tokens = shlex.split(" ".join(line.rstrip(" \\") for line in text.splitlines() if not line.startswith("#")))
    for k, token in enumerate(tokens):
        if token.startswith("--"):
            assert token in MEGATRON_FLAGS, token
            takes_value = MEGATRON_FLAGS[token].get("action") != "store_true"
            assert takes_value == (k + 1 < len(tokens) and not tokens[k + 1].startswith("--")), token
    parse_megatron(text)


def test_recompute_and_gradient_precision():
    full = parse_megatron(export("colocated_pp2_interleaved_tp2", "megatron").text)
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert full.grad_reduce_in_bf16 and not full.accumulate_allreduce_grads_in_fp32
    none = parse_megatron(export("pure_dp_zero3", "megatron").text)  # its recipe's gradients are fp32 already
    assert none.recompute_granularity is None and none.accumulate_allreduce_grads_in_fp32
    plan = dataclasses.replace(CASES["colocated_pp2_interleaved_tp2"][0], recompute="selective", fp32_grads=True)
    selective = parse_megatron(export_plan(plan, MODEL, "megatron", global_batch=256).text)
    assert selective.recompute_granularity == "selective" and selective.accumulate_allreduce_grads_in_fp32
    titan = tomllib.loads(export_plan(plan, MODEL, "torchtitan", global_batch=256, torchtitan_version="0.2").text)
    assert titan["activation_checkpoint"]["mode"] == "selective"
    assert parse_titan(export_plan(plan, MODEL, "torchtitan", global_batch=256).text).checkpoint == "selective"


# ---- torchtitan --------------------------------------------------------------------------------

@given(plans, st.integers(1, 512))
def test_torchtitan_toml_round_trip(spec, global_batch):
    plan = make_plan(*spec)
    assume(global_batch >= plan.bins)
    text = export_plan(plan, MODEL, "torchtitan", global_batch=global_batch, torchtitan_version="0.2").text
    doc = tomllib.loads(text)
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


# ---- torchtitan 0.3: overrides held against the pinned config dataclasses ---------------------------

Titan = namedtuple("Titan", "fields checkpoint")
"""Parsed overrides: {section: {field: value}}, and the activation-checkpointing subcommand."""


def titan_type(spelled):
    """A pinned annotation (a Python type expression over these names) as a type."""
    return eval(spelled, {"__builtins__": {}}, {"int": int, "bool": bool, "str": str, "float": float, "None": None,
                                                "Literal": Literal, "list": list})


def titan_value(kind, text):
    """``text`` as tyro reads a command-line value for a field of type ``kind`` (torchtitan's rule for
    list[str]: one comma-separated value); ValueError where it cannot be one override's value."""
    options = get_args(kind) if get_origin(kind) is UnionType else (kind,)
    for option in sorted(options, key=lambda o: o is str):  # str takes anything: try it last
        if option is None and text == "None":
            return None
        if option is int and re.fullmatch(r"-?\d+", text):
            return int(text)
        if option is float and re.fullmatch(r"-?\d+(\.\d*)?([eE]-?\d+)?", text):
            return float(text)
        if get_origin(option) is Literal and text in get_args(option):
            return text
        if get_origin(option) is list and get_args(option) == (str,):
            return text.split(",")
        if option is str:
            return text
    raise ValueError(f"{text!r} is no value of {kind} (bool fields are flags without a value; a list of lists "
                     "cannot be one override)")


def parse_titan(text):
    """One ``--section.field value`` per uncommented line (the contract), each a field of torchtitan
    0.3.0's config with a value of its type; the activation-checkpointing subcommand (tyro reads it
    after every flag) from the ``# subcommand:`` comment, and the header's launch line ends with it."""
    overrides = [line for line in text.splitlines() if line and not line.startswith("#")]
    choice = re.search(r"^# subcommand: activation-checkpoint:(\S+)", text, re.M)
    assert choice and choice[1] in TITAN["activation_checkpoint"], text[:400]
    assert f"$(grep -v '^#' THIS_FILE) activation-checkpoint:{choice[1]})" in text
    fields = {}
    for line in overrides:
        flag, value = shlex.split(line)
        section, _, name = flag.removeprefix("--").partition(".")
        pinned = TITAN["sections"].get(section, {})
        assert flag.startswith("--") and name in pinned, f"{flag}: no such field in torchtitan 0.3.0's config"
        assert name not in fields.setdefault(section, {}), f"{flag} given twice"
        fields[section][name] = titan_value(titan_type(pinned[name]), value)
    return Titan(fields, choice[1])


def titan_stage_layers(par, pp, layers=LAYERS):
    """Each stage's layers as torchtitan 0.3.0 generates them (torchtitan/distributed/pipeline_parallel.py:
    _get_pipeline_metadata, _generate_llm_fqn_per_model_part); None where it refuses the fields."""
    first = par.get("pipeline_parallel_first_stage_less_layers", 1)
    last = par.get("pipeline_parallel_last_stage_less_layers", 1)
    single = par.get("pipeline_parallel_schedule", "1F1B") in ("1F1B", "GPipe")  # PipelineScheduleSingle
    per_stage, effective = par.get("pipeline_parallel_layers_per_stage"), layers + first + last
    if per_stage is None:
        stages = pp * (1 if single else 2)
    else:
        stages = -(-effective // per_stage)
        if stages % pp or (single and stages != pp) or (not single and stages // pp < 2):
            return None
    base, extra = divmod(effective, stages)
    if base < 1 or first > base or last > base:
        return None
    sizes = [base + (k < extra) for k in range(stages)]
    sizes[0] -= first
    sizes[-1] -= last
    return sizes


def titan_can_split(layers, pp, schedule):
    """Whether any first/last-stage weights and layers per stage make torchtitan 0.3 generate ``layers``
    (larger weights than these only shift a two-stage split; the stage count needs no other value)."""
    n = sum(layers)
    for first in range(-n, n + 2):
        for last in range(-n, n + 2):
            effective = n + first + last
            for per_stage in (None, -(-effective // len(layers)) if effective > 0 else None):
                par = {"pipeline_parallel_schedule": schedule, "pipeline_parallel_layers_per_stage": per_stage,
                       "pipeline_parallel_first_stage_less_layers": first,
                       "pipeline_parallel_last_stage_less_layers": last}
                if titan_stage_layers(par, pp, n) == layers:
                    return True
    return False


@given(plans, st.integers(1, 512), st.integers(0, 2), st.sampled_from(["none", "full", "selective"]))
def test_torchtitan_overrides_round_trip(spec, global_batch, pick, recompute):
    plan = make_plan(*spec)
    assume(global_batch >= plan.bins)
    if plan.llm.pp > 1:
        options = ["Interleaved1F1B", "LoopedBFS"] if plan.virtual_stages > 1 else ["1F1B", "GPipe", "ZBH1"]
        plan = dataclasses.replace(plan, schedule=options[pick % len(options)])
    plan = dataclasses.replace(plan, recompute=recompute)
    e = export_plan(plan, MODEL, "torchtitan", global_batch=global_batch)
    titan = parse_titan(e.text)
    par, training = titan.fields["parallelism"], titan.fields["training"]
    assert titan.checkpoint == recompute  # no subcommand would leave torchtitan's default, selective
    assert par["tensor_parallel_degree"] == plan.llm.tp and par["pipeline_parallel_degree"] == plan.llm.pp
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == plan.llm.dp
    assert training["global_batch_size"] == training["local_batch_size"] * plan.llm.dp
    assert training["global_batch_size"] <= global_batch
    if plan.llm.pp > 1:
        assert training["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == plan.microbatches
        layers = list(plan.llm.layers_per_stage)
        gap = any("generated split cannot give them" in g for g in e.unsupported)
        assert gap == (not titan_can_split(layers, plan.llm.pp, par["pipeline_parallel_schedule"]))
        if not gap:
            assert titan_stage_layers(par, plan.llm.pp) == layers


@pytest.mark.parametrize("line", [
    "--training.local_batch_sizes 4",  # a renamed field
    "--parallelism.tensor_parallel_degree two",
    "--parallelism.fsdp_reshard_after_forward sometimes",
    "--parallelism.enable_sequence_parallel true",  # a bool is a flag without a value
    "--parallelism.module_fqns_per_model_part tok_embeddings,layers.0",  # tyro reads one part only
    "--activation_checkpoint.mode full",  # 0.2's field; 0.3 has a subcommand
    "activation-checkpoint:full",  # the subcommand is no override: the contract keeps it commented
])
def test_torchtitan_check_refuses_what_0_3_does_not_take(line):
    head = ("# launch: ... $(grep -v '^#' THIS_FILE) activation-checkpoint:none)\n"
            "# subcommand: activation-checkpoint:none\n")
    assert parse_titan(head + "--training.local_batch_size 4\n").fields
    with pytest.raises((AssertionError, ValueError)):
        parse_titan(f"{head}{line}\n")


def test_torchtitan_version_chooses_the_form():
    plan, training = CASES["colocated_pp2_interleaved_tp2"]
    toml = export_plan(plan, MODEL, "torchtitan", global_batch=256, torchtitan_version=TitanVersion.V0_2).text
    assert tomllib.loads(toml)["activation_checkpoint"]["mode"] == "full"
    default = export_plan(plan, MODEL, "torchtitan", global_batch=256).text
    assert default == export_plan(plan, MODEL, "torchtitan", global_batch=256, torchtitan_version=" 0.3").text
    assert parse_titan(default).checkpoint == "full"
    with pytest.raises(DflopError, match=r"--torchtitan-version: unknown torchtitan version '0\.4' \(valid: 0\.2, 0\.3\)"):
        export_plan(plan, MODEL, "torchtitan", global_batch=256, torchtitan_version="0.4")


@pytest.mark.parametrize("version", ["0.2", "0.3"])
def test_torchtitan_states_what_it_loses(version):
    e = export("disaggregated", "torchtitan", version)
    par = tomllib.loads(e.text)["parallelism"] if version == "0.2" else parse_titan(e.text).fields["parallelism"]
    assert par["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    assert any("disaggregated placement" in g for g in e.unsupported)
    assert any("balanced bins" in g for g in e.unsupported)
    assert "BalancedBatchSampler(" in e.text and "dp_rank=dp_rank" in e.text
    for gap in e.unsupported:  # every loss is written into the fragment, too
        assert gap.split(":")[0] in e.text


def test_hsdp_shards_within_a_node_of_the_cluster():
    plan = dataclasses.replace(CASES["pure_dp_zero3"][0], hsdp=True)
    cluster = ClusterSpec(hardware=presets.hardware("h100"), nodes=4, gpus_per_node=8)
    doc = tomllib.loads(export_plan(plan, MODEL, "torchtitan", global_batch=256, cluster=cluster,
                                    torchtitan_version="0.2").text)
    assert (doc["parallelism"]["data_parallel_replicate_degree"],
            doc["parallelism"]["data_parallel_shard_degree"]) == (4, 8)
    titan = parse_titan(export_plan(plan, MODEL, "torchtitan", global_batch=256, cluster=cluster).text)
    par = titan.fields["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (4, 8)
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
    out = dflop_json("export", path, "--to", "torchtitan", "--global-batch", 128)  # torchtitan 0.3 by default
    assert out["target"] == "torchtitan" and isinstance(out["unsupported"], list)
    assert parse_titan(out["text"]).fields["training"]["global_batch_size"] == 128
    out = dflop_json("export", path, "--to", "torchtitan", "--torchtitan-version", "0.2", "--global-batch", 128)
    assert tomllib.loads(out["text"])["training"]["global_batch_size"] == 128
    assert_one_line_error(dflop("export", path, "--to", "torchtitan", "--torchtitan-version", "0.4"),
                          "--torchtitan-version", "0.4")
    text = dflop("export", path, "--to", "megatron")
    config_batch = load_run_config().training.global_batch
    assert text.returncode == 0 and parse_megatron(text.stdout).global_batch_size == config_batch
    assert_one_line_error(dflop("export", tmp_path / "missing.yaml", "--to", "megatron"), "missing.yaml")
    (tmp_path / "bad.yaml").write_text("encoder: {tp: 1}\nllm: {tp: 0}\nmicrobatches: 1\n")
    assert_one_line_error(dflop("export", tmp_path / "bad.yaml", "--to", "megatron"), "tp")


if __name__ == "__main__":  # rewrite the goldens
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        for target, version, suffix in FORMS:
            (GOLDEN / f"{case}.{suffix}").write_text(export(case, target, version).text)
    sys.exit(0)
