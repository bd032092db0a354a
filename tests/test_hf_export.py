"""Checkpoints out: `dflop export checkpoint RUN_DIR --to hf --out DIR` writes a run's last DCP
checkpoint as a Hugging Face folder that transformers loads with no missing or unexpected key,
holding the run's trained weights (not the initial ones) under the source checkpoint's names, its
config.json and tokenizer files unchanged, and computing dflop's logits. One tiny run a family
(Qwen2, LLaVA-OneVision), 2 CPU processes, 2 steps, shared by the tests of that family."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers as T
from cli_helpers import assert_one_line_error, dflop_here
from test_hf_checkpoint import FAMILIES, close, dflop_logits, llava_config, model_of, perturbed

from dflop.backends.torch_runtime.hf_export import read_parameters
from dflop.backends.torch_runtime.model import build_stage
from dflop.errors import DflopError
from dflop.specs.plan import Module

pytestmark = pytest.mark.processes

TOKENIZER_FILES = {"tokenizer_config.json": '{"model_max_length": 256}', "chat_template.jinja": "{{ messages }}"}
"""Stand-ins for the tokenizer files a released checkpoint ships: the export copies them unchanged."""
CONFIG = """model: {{checkpoint: ckpt}}
{encoder}cluster: {{hardware: cpu, nodes: 1, gpus_per_node: 2}}
training: {{global_batch: 4}}
data: {{preset: {preset}, samples: 100}}
steps: 2
scheduler: {{solver: lpt}}
execution: {{checkpoint_every: 1, lr: 0.01}}
plan: {{encoder: {{dp: 1}}, llm: {{pp: 2}}, placement: colocated, microbatches: 2}}
"""
NAMES = {  # transformers' parameter name -> dflop's checkpoint key, spelled out (not from the table)
    "qwen2": {"model.embed_tokens.weight": "llm.embed.weight", "lm_head.weight": "llm.head.weight",
              "model.layers.1.self_attn.q_proj.weight": "llm.blocks.1.q.weight",
              "model.layers.3.self_attn.k_proj.bias": "llm.blocks.3.k.bias",
              "model.layers.2.mlp.down_proj.weight": "llm.blocks.2.down.weight", "model.norm.weight": "llm.norm.weight"},
    "llava": {"model.language_model.layers.1.self_attn.q_proj.weight": "llm.blocks.1.q.weight",
              "lm_head.weight": "llm.head.weight",
              "model.vision_tower.embeddings.patch_embedding.weight": "encoder.embed.conv.weight",
              "model.vision_tower.encoder.layers.1.mlp.fc1.weight": "encoder.blocks.1.fc1.weight",
              "model.multi_modal_projector.linear_2.bias": "encoder.projector.layers.2.bias",
              "model.image_newline": "encoder.newline"},
}
UNTRAINED = ("model.vision_tower.encoder.layers.2.", "model.vision_tower.post_layernorm.", "model.vision_tower.head.")
"""What the LLaVA checkpoint holds and dflop never runs (the layer after vision_feature_layer -2,
SigLIP's final norm and pooling head): copied as they are."""


def hf_class(family):
    return T.LlavaOnevisionForConditionalGeneration if family == "llava" else T.AutoModelForCausalLM


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each family's run and export, made once when a test first asks for it."""
    made = {}

    def run(family):
        if family not in made:
            made[family] = train_and_export(family, tmp_path_factory.mktemp(family))
        return made[family]
    return run


@pytest.fixture(params=["qwen2", "llava"])
def exported(request, runs):
    return runs(request.param)


def train_and_export(family, folder):
    """A tiny checkpoint built by transformers, trained by `dflop run --backend torch` (pp2, 2 steps,
    a checkpoint after each) and exported."""
    torch.manual_seed(0)
    model = perturbed(T.LlavaOnevisionForConditionalGeneration(llava_config()) if family == "llava"
                      else T.AutoModelForCausalLM.from_config(FAMILIES[family]()))
    model.save_pretrained(folder / "ckpt")
    for name, text in TOKENIZER_FILES.items():
        (folder / "ckpt" / name).write_text(text)
    config = folder / "run.yaml"
    config.write_text(CONFIG.format(encoder="" if family == "llava" else "encoder: tiny-vit\n",
                                    preset="llava-ov" if family == "llava" else "text-only"))
    ran = dflop_here("run", "--backend", "torch", "--config", config, "--out", folder / "run")
    assert ran.returncode == 0, ran.stderr
    done = dflop_here("export", "checkpoint", folder / "run", "--to", "hf", "--out", folder / "hf", "--json")
    assert done.returncode == 0, done.stderr
    return SimpleNamespace(family=family, folder=folder, source=folder / "ckpt", run=folder / "run", out=folder / "hf",
                           report=json.loads(done.stdout), initial=model)


def test_the_exported_folder_loads_in_transformers_with_the_runs_trained_weights(exported):
    model, info = hf_class(exported.family).from_pretrained(exported.out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    last = exported.run / "checkpoints" / "dflop" / "step-000002"
    assert exported.report["checkpoint"] == str(last) and exported.report["step"] == 2
    trained, state = read_parameters(last), model.state_dict()
    for hf, key in NAMES[exported.family].items():
        assert torch.equal(state[hf], trained[key]), hf
    initial = exported.initial.state_dict()
    for name, tensor in state.items():
        assert torch.equal(tensor, initial[name]) == name.startswith(UNTRAINED), name
    for name in ("config.json", *TOKENIZER_FILES):
        assert (exported.out / name).read_bytes() == (exported.source / name).read_bytes()


def test_the_exported_model_computes_dflops_logits_with_the_checkpoints_weights(exported):
    spec = model_of(exported.source)
    stage = build_stage(spec, Module.LLM, 0, (spec.llm.layers,), seed=5)
    trained = read_parameters(exported.run / "checkpoints" / "dflop" / "step-000002")
    stage.load_state_dict({k.removeprefix("llm."): t for k, t in trained.items() if k.startswith("llm.")})
    tokens = torch.randint(0, 90, (11,), generator=torch.Generator().manual_seed(4))
    model = hf_class(exported.family).from_pretrained(exported.out).eval()
    with torch.no_grad():
        assert close(dflop_logits(stage, [len(tokens)], tokens=tokens), model(input_ids=tokens[None]).logits[0])


def test_a_sharded_export_loads_as_the_single_file(exported, tmp_path):
    from dflop.jobs.export_checkpoint import export_checkpoint

    report = export_checkpoint(exported.run, "hf", tmp_path / "sharded", shard_bytes=20_000)
    assert "model.safetensors.index.json" in report["files"] and len(report["files"]) > 4
    whole = hf_class(exported.family).from_pretrained(exported.out).state_dict()
    sharded = hf_class(exported.family).from_pretrained(tmp_path / "sharded").state_dict()
    assert sharded.keys() == whole.keys() and all(torch.equal(sharded[n], whole[n]) for n in whole)


def _without_checkpoints(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    return [copy, "--to", "hf", "--out", tmp_path / "x"], f"{copy / 'checkpoints' / 'dflop'}: no complete checkpoint"


def _damaged(run, tmp_path):
    """Zeros of the right size pass every check of the files: reading fails with the folder half written."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    data = copy / "checkpoints" / "dflop" / "step-000002" / "__1_0.distcp"
    data.write_bytes(bytes(data.stat().st_size))
    return [copy, "--to", "hf", "--out", tmp_path / "x"], f"{data.parent}: cannot read this checkpoint ("


def _used_out(run, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("the user's")
    return [run, "--to", "hf", "--out", tmp_path / "x"], "exists and is not an empty folder"


ERRORS = {
    "no run folder": lambda run, tmp: ([tmp / "nowhere", "--to", "hf", "--out", tmp / "x"], "nowhere: no such run folder"),
    "a folder that is no run": lambda run, tmp: ([tmp, "--to", "hf", "--out", tmp / "x"], "no run.json"),
    "no checkpoint in it": _without_checkpoints,
    "a damaged checkpoint": _damaged,
    "--out not empty": _used_out,
    "unknown --to": lambda run, tmp: ([run, "--to", "gguf", "--out", tmp / "x"], "--to: unknown checkpoint format 'gguf' (valid: hf)"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_line_and_leaves_nothing_at_out(runs, tmp_path, case):
    args, fragment = ERRORS[case](runs("qwen2").run, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_one_line_error(dflop_here("export", "checkpoint", *args), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out, no temporary folder beside it
    if case == "--out not empty":
        assert (tmp_path / "x" / "keep.txt").read_text() == "the user's"


# ---- a run from dflop's own weights: its LLM in the Qwen2 layout --------------------------------

@pytest.fixture
def one_rank():
    """A process group of this process alone (no process started), for the backend's own save."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("tied", [True, False])
def test_a_run_from_random_weights_exports_its_llm_as_qwen2(one_rank, tmp_path, tied):
    from dataclasses import replace

    from dflop.backends.torch_runtime import checkpoint, hf_export
    from dflop.specs import presets
    from dflop.specs.hf_config import llm_from_hf_config
    from dflop.specs.models import MLLMSpec

    spec = MLLMSpec(encoder=presets.encoder("tiny-vit"), llm=replace(presets.llm("tiny-llm"), tie_embeddings=tied))
    stages = {"llm.s0": build_stage(spec, Module.LLM, 0, (spec.llm.layers,), seed=2),
              "encoder.s0": build_stage(spec, Module.ENCODER, 0, (spec.encoder.layers,), seed=2)}
    named = {f"{prefix}.{n}": p for prefix, stage in stages.items() for n, p in stage.named_parameters()}
    params = checkpoint.keyed(named, tied)
    optimizer = torch.optim.AdamW([p for ps in params.values() for p in ps])
    saved = checkpoint.save(tmp_path / "ckpt", 1, params, optimizer, checkpoint.identity(0, spec))
    (tmp_path / "hf").mkdir()
    hf_export.write_folder(saved, spec.llm, None, tmp_path / "hf", "run")
    model, info = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and type(model).__name__ == "Qwen2ForCausalLM"
    back = llm_from_hf_config(tmp_path / "hf" / "config.json")
    assert replace(back, name=spec.llm.name, source=spec.llm.source) == spec.llm
    tokens = torch.randint(0, spec.llm.vocab, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert close(dflop_logits(stages["llm.s0"], [13], tokens=tokens), model.eval()(input_ids=tokens[None]).logits[0])
    with pytest.raises(DflopError, match=r"^run: the run started from no Hugging Face checkpoint and its LLM "
                                         r"tiny-llm is no Qwen2 \(it has no q/k/v biases\): it has no Hugging Face "
                                         r"model to export to$"):
        hf_export.write_folder(saved, replace(spec.llm, qkv_bias=False), None, tmp_path / "hf", "run")
