"""Hugging Face checkpoints in: dflop's model on a checkpoint's weights computes what transformers
computes (fp32, CPU, 1e-4 relative), each rank reads only its own tensors and shards, and a bad
checkpoint is one line naming the tensor and the file. The checkpoints are tiny random ones that
transformers builds and saves here (``save_pretrained``, also sharded); nothing is downloaded.

What matches and what does not (dflop's image-token layout): a LLaVA-OneVision multi-image
sample's images are one tile each, 16 features then the image newline; dflop's ``layout`` puts a
sample's newline rows after all its tiles' features, so a sample of several images is laid out
differently. The tests hold the encoder, the projector and the newline of each image, and the LLM
on those images in LLaVA-OneVision's order, against transformers. Real images (a single image's
anyres grid, unpadding, bilinear downsampling, a newline per row) are laid out by
``onevision_layout`` and held against transformers in ``test_real_images.py``; video is not built.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from dflop.backends.torch_runtime.hf_checkpoint import check_checkpoint, load_stages, open_checkpoint
from dflop.backends.torch_runtime.model import EncoderStage, build_stage, pack_sequence
from dflop.errors import DflopError
from dflop.models.llm import pack
from dflop.specs import presets
from dflop.specs.hf_config import encoder_from_hf_config, llm_from_hf_config
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {  # each with what sets it apart: Qwen2's q/k/v biases, Llama's o bias, 1e-5 norms and tied
    # embeddings (Llama-3.2-1B ties), Mistral's head size apart from hidden / heads
    "qwen2": lambda: T.Qwen2Config(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama": lambda: T.LlamaConfig(**TEXT, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "mistral": lambda: T.MistralConfig(**TEXT, head_dim=12, sliding_window=None),
}
IMAGE, PATCH = 28, 7
"""The tiny SigLIP's tile: 4 x 4 = 16 patches, 16 image features and a newline an image."""


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its initial value (norm scales of 1 and zero biases would hide a
    swapped or unread tensor)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save(model: torch.nn.Module, folder, sharded: bool):
    model.save_pretrained(folder, max_shard_size="16KB" if sharded else "1GB")
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    return folder


def llava_config(vision_layers: int = 3, feature_layer: int = -2) -> T.LlavaOnevisionConfig:
    text = T.Qwen2Config(**TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    vision = T.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=vision_layers,
                                  num_attention_heads=2, image_size=IMAGE, patch_size=PATCH)
    return T.LlavaOnevisionConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), image_token_index=94,
                                  video_token_index=95, vision_feature_layer=feature_layer,
                                  image_grid_pinpoints=[[28, 28], [28, 56], [56, 28], [56, 56]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(transformers model, folder) of every family, saved whole and sharded."""
    out = {}
    for family, config in FAMILIES.items():
        torch.manual_seed(0)
        model = perturbed(T.AutoModelForCausalLM.from_config(config()))
        for sharded in (False, True):
            out[family, sharded] = model, save(model, tmp_path_factory.mktemp(f"{family}{sharded}"), sharded)
    torch.manual_seed(0)
    llava = perturbed(T.LlavaOnevisionForConditionalGeneration(llava_config()))
    for sharded in (False, True):
        out["llava", sharded] = llava, save(llava, tmp_path_factory.mktemp(f"llava{sharded}"), sharded)
    return out


def model_of(folder) -> MLLMSpec:
    """The spec a run config's ``model: {checkpoint: folder}`` gives (a plain LLM with the tiny encoder)."""
    config = folder / "config.json"
    vision = "vision_config" in json.loads(config.read_text())
    return MLLMSpec(encoder=encoder_from_hf_config(config) if vision else presets.encoder("tiny-vit"),
                    llm=llm_from_hf_config(config))


def loaded(folder, module: Module, stage: int = 0, layers: tuple[int, ...] | None = None):
    model = model_of(folder)
    layers = layers or ((model.llm if module is Module.LLM else model.encoder).layers,)
    built = build_stage(model, module, stage, layers, seed=0)
    read = load_stages(open_checkpoint(folder), [(module, built)])
    return built, read


def dflop_logits(stage, lengths: list[int], tokens=None, embeddings=None) -> torch.Tensor:
    positions, cu = pack(lengths)
    x = stage.embed(tokens) if embeddings is None else embeddings
    for block in stage.blocks.values():
        x = block(x, positions, cu)
    return stage.head(stage.norm(x))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-4 of the larger magnitude of ``b``, element by element."""
    return float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())


@pytest.mark.parametrize("sharded", [False, True], ids=["one file", "sharded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_plain_llm_computes_the_logits_and_the_loss_of_transformers(checkpoints, family, sharded):
    hf, folder = checkpoints[family, sharded]
    stage, _ = loaded(folder, Module.LLM)
    g = torch.Generator().manual_seed(5)
    text = [torch.randint(0, TEXT["vocab_size"], (n,), generator=g) for n in (7, 12, 3)]
    with torch.no_grad():
        ours = dflop_logits(stage, [len(t) for t in text], tokens=torch.cat(text))
        theirs = [hf(input_ids=t[None], labels=t[None]) for t in text]
        seq = pack_sequence([0] * len(text), text)
        positions, cu = pack(seq.lengths)
        loss = stage(None, seq, positions, cu, text=torch.cat(text)) / len(seq.labels)
    assert close(ours, torch.cat([o.logits[0] for o in theirs]))
    hf_loss = sum(o.loss * (len(t) - 1) for o, t in zip(theirs, text)) / sum(len(t) - 1 for t in text)
    assert float(loss) == pytest.approx(float(hf_loss), rel=1e-4)


def test_llava_onevision_text_and_images_compute_what_transformers_computes(checkpoints):
    """A text-only sample, and a sample of two images (each one tile: its 16 features, then the
    newline) followed by text, as LLaVA-OneVision's multi-image path lays it out; the vision layer
    after ``vision_feature_layer`` -2, SigLIP's final norm and pooling head stay unread."""
    hf, folder = checkpoints["llava", True]
    encoder, read_enc = loaded(folder, Module.ENCODER)
    llm, _ = loaded(folder, Module.LLM)
    assert not any(".layers.2." in n or "post_layernorm" in n or ".head." in n for n in read_enc)
    g = torch.Generator().manual_seed(2)
    pixels = torch.randn(2, 3, IMAGE, IMAGE, generator=g)
    text = torch.randint(0, 90, (9,), generator=g)
    per_image = (IMAGE // PATCH) ** 2 + 1
    ids = torch.cat([torch.full((2 * per_image,), 94), text])
    labels = torch.cat([torch.full((2 * per_image,), -100), text])
    with torch.no_grad():
        image_tokens = encoder(pixels, [1, 1], [per_image, per_image])  # per image: its tile, then a newline
        seq = pack_sequence([2 * per_image], [text])
        positions, cu = pack(seq.lengths)
        loss = llm(image_tokens, seq, positions, cu, text=text) / len(seq.labels)
        out = hf(input_ids=ids[None], labels=labels[None], pixel_values=pixels[:, None],
                 image_sizes=torch.tensor([[IMAGE, IMAGE]] * 2), batch_num_images=torch.tensor([2]))
        embedded = llm.embed(ids).index_copy(0, seq.image_rows, image_tokens)
        logits = dflop_logits(llm, seq.lengths, embeddings=embedded)
        plain = hf(input_ids=text[None], labels=text[None])
        alone = dflop_logits(llm, [len(text)], tokens=text)
    assert close(logits, out.logits[0]) and float(loss) == pytest.approx(float(out.loss), rel=1e-4)
    assert close(alone, plain.logits[0])


def test_a_pipeline_stage_reads_only_its_own_tensors(checkpoints):
    """Stage 1 of 2 (layers 2 and 3, the final norm and the head) opens nothing of the rest."""
    _, folder = checkpoints["qwen2", True]
    _, read = loaded(folder, Module.LLM, stage=1, layers=(2, 2))
    layers = {n.split(".")[2] for n in read if n.startswith("model.layers.")}
    assert layers == {"2", "3"} and "model.norm.weight" in read and "lm_head.weight" in read
    assert "model.embed_tokens.weight" not in read and len(read) == 2 * 12 + 2


def test_a_tied_head_on_the_last_stage_is_the_embedding(checkpoints):
    hf, folder = checkpoints["llama", False]
    head, read = loaded(folder, Module.LLM, stage=1, layers=(2, 2))
    assert "model.embed_tokens.weight" in read and "lm_head.weight" not in read
    assert torch.equal(head.head.weight, hf.model.embed_tokens.weight)


def rewrite(folder, change):
    """The single-file checkpoint in ``folder`` with its tensors changed by ``change(dict)``."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def copied(src, dst):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
     r"model\.safetensors: missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(48, 31)}),
     r"model\.safetensors: tensor 'model\.layers\.2\.mlp\.up_proj\.weight' has shape \[48, 31\], "
     r"the config asks for \[48, 32\]"),
    (lambda t: t.update({"model.layers.9.self_attn.q_proj.weight": torch.zeros(32, 32)}),
     r"model\.safetensors: unexpected tensor 'model\.layers\.9\.self_attn\.q_proj\.weight'"),
], ids=["missing", "mis-shaped", "unexpected"])
def test_a_bad_tensor_is_one_line_naming_it_and_its_file(checkpoints, tmp_path, change, message):
    _, folder = checkpoints["qwen2", False]
    rewrite(copied(folder, tmp_path), change)
    with pytest.raises(DflopError, match=message) as exc:
        check_checkpoint(open_checkpoint(tmp_path), model_of(tmp_path))
    assert "\n" not in str(exc.value) and str(tmp_path) in str(exc.value)


def test_a_missing_shard_and_what_dflop_cannot_compute_are_refused(checkpoints, tmp_path):
    _, folder = checkpoints["qwen2", True]
    copied(folder, tmp_path)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(DflopError, match=rf"model\.safetensors\.index\.json: weight_map names '{shard.name}'"):
        open_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DflopError, match=r"config\.json: rope type: 'llama3': dflop's model computes default only"):
        open_checkpoint(tmp_path)


def test_the_encoder_of_a_plain_llm_keeps_its_seeded_weights(checkpoints):
    _, folder = checkpoints["qwen2", False]
    model = model_of(folder)
    encoder = build_stage(model, Module.ENCODER, 0, (model.encoder.layers,), seed=0)
    before = {n: p.clone() for n, p in encoder.named_parameters()}
    assert load_stages(open_checkpoint(folder), [(Module.ENCODER, encoder)]) == {}
    assert all(torch.equal(before[n], p) for n, p in encoder.named_parameters())
    assert isinstance(encoder, EncoderStage) and np.isclose(model.llm.norm_eps, 1e-6)


# ---- the torch backend from a checkpoint: every rank its own tensors, the reference's numbers ----

def system_for(model: MLLMSpec):
    from dflop.cost import System
    from dflop.cost.select import select_cost_model
    from dflop.specs import ClusterSpec, TrainingSpec

    hardware, training = presets.hardware("cpu"), TrainingSpec(global_batch=8)
    cost, _ = select_cost_model(model, hardware, training)
    return System(model, ClusterSpec(hardware=hardware, nodes=1, gpus_per_node=4), training, cost)


def batches(rows, steps: int):
    from dflop.workload.sample import SampleTable

    table = SampleTable.build(*zip(*rows))
    rng = np.random.default_rng(0)
    return [table.take(rng.choice(len(table), 8, replace=False)) for _ in range(steps)]


def trained(folder, plan, steps):
    from dflop.backends import ScheduledBatch
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.reference import reference_training
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.schedule.step import plan_costs, schedule_batch
    from dflop.timing.steps import CostedPlan

    model = model_of(folder)
    system = system_for(model)
    assert not plan.problems(system.cluster, model, 8)
    scheduled = [ScheduledBatch(b, schedule_batch(b, plan, costs=plan_costs(b, plan, model, system.cost),
                                                  solver="lpt").assignment) for b in steps]
    options = TorchOptions(dtype="float64", lr=1e-3, seed=3, weights=str(folder))  # no rounding noise
    result = TorchBackend(options=options, keep_parameters=True, predict=False).run(CostedPlan(plan, system),
                                                                                     scheduled)
    return model, result, reference_training(model, steps, options)


def differences(model, result, reference):
    from dflop.backends.torch_runtime.model import whole_model_name

    return max(float((t - reference.parameters[whole_model_name(n, model.llm.tie_embeddings)]).abs().max())
               for n, t in result.extra["parameters"].items())


@pytest.mark.processes
def test_llava_onevision_under_pp2_x_tp2_trains_as_the_reference_and_each_rank_reads_its_shard(checkpoints):
    """Four ranks (LLM pp2 x tp2, the encoder tp2 in stage 0) start from the checkpoint: after two
    steps their parameters are the single-process reference's (which starts from the same weights:
    the tests above hold it against transformers); a rank reads its own stage's tensors and, of
    a tensor-parallel weight, only its half."""
    from dflop.specs import ModulePlan, Plan

    _, folder = checkpoints["llava", True]
    rows = [(f"s{i}", i % 3, [0, 2, 3][i % 3], 6 + i % 7, [0, 2 * 16 + 3, 3 * 17][i % 3]) for i in range(24)]
    plan = Plan(encoder=ModulePlan(tp=2), llm=ModulePlan(tp=2, pp=2), placement="colocated", microbatches=2)
    model, result, ref = trained(folder, plan, batches(rows, 2))
    assert result.extra["losses"] == pytest.approx(ref.losses, rel=1e-12)
    assert differences(model, result, ref) < 1e-9
    read = result.extra["weights_read"]
    q = "language_model.model.layers.{}.self_attn.q_proj.weight"
    first = [r for r, names in read.items() if q.format(0) in names]
    last = [r for r, names in read.items() if q.format(3) in names]
    assert len(first) == len(last) == 2 and not set(first) & set(last)
    assert all(read[r][q.format(0)] == (16, 32) and q.format(3) not in read[r] for r in first)
    assert all("vision_tower.encoder.layers.0.mlp.fc2.weight" in read[r] for r in first)
    assert all(read[r]["vision_tower.encoder.layers.0.mlp.fc2.weight"] == (16, 12) for r in first)
    assert not any(n.startswith(("vision_tower", "multi_modal")) for r in last for n in read[r])


@pytest.mark.processes
def test_llava_onevision_under_dp2_zero3_trains_as_the_reference(checkpoints):
    """FSDP2 shards what each rank read from the checkpoint (the whole of every tensor, then its
    half kept): after two steps the parameters are the reference's, as from seeded weights."""
    from dflop.specs import ModulePlan, Plan

    _, folder = checkpoints["llava", True]
    rows = [(f"s{i}", i % 3, [0, 2, 3][i % 3], 6 + i % 7, [0, 2 * 16 + 3, 3 * 17][i % 3]) for i in range(24)]
    plan = Plan(encoder=ModulePlan(dp=2), llm=ModulePlan(dp=2), placement="colocated", microbatches=2, zero=3)
    model, result, ref = trained(folder, plan, batches(rows, 2))
    assert result.extra["losses"] == pytest.approx(ref.losses, rel=1e-12)
    assert differences(model, result, ref) < 1e-9


@pytest.mark.processes
def test_a_plain_llm_under_pp2_trains_from_the_loss_transformers_computes(checkpoints):
    """Qwen2 on text-only samples, two pipeline stages: the first step's loss is transformers'
    token-weighted mean over the global batch's samples (the same token ids), and the run ends
    where the reference does."""
    from dflop.backends.torch_runtime.model import sample_inputs
    from dflop.specs import ModulePlan, Plan

    hf, folder = checkpoints["qwen2", True]
    rows = [(f"t{i}", 0, 0, 5 + i % 11, 0) for i in range(16)]
    steps = batches(rows, 2)
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), placement="colocated", microbatches=2)
    model, result, ref = trained(folder, plan, steps)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, n in zip(steps[0].ids, steps[0].text_tokens):
            _, tokens = sample_inputs(3, str(i), 0, int(n), model.encoder.image_size, model.llm.vocab)
            total += float(hf(input_ids=tokens[None], labels=tokens[None]).loss) * (len(tokens) - 1)
            count += len(tokens) - 1
    assert result.extra["losses"][0] == pytest.approx(total / count, rel=1e-4)
    assert result.extra["losses"] == pytest.approx(ref.losses, rel=1e-12)
    assert differences(model, result, ref) < 1e-9


# ---- the run config's model: {checkpoint: DIR} ------------------------------------------------

def run_config(folder, text):
    from dflop.specs.run import load_run_config

    path = folder / "run.yaml"
    path.write_text(text)
    return load_run_config(path)


def test_a_run_config_names_a_checkpoint_folder_relative_to_itself(checkpoints, tmp_path):
    from dflop.backends.torch_runtime.backend import TorchBackend

    (tmp_path / "ckpt").mkdir()
    copied(checkpoints["llava", False][1], tmp_path / "ckpt")
    config = run_config(tmp_path, "model: {checkpoint: ckpt}\ncluster: {hardware: cpu, nodes: 1, gpus_per_node: 2}\n"
                                  "training: {global_batch: 4}\n")
    assert config.checkpoint == str(tmp_path / "ckpt")
    assert (config.encoder.family, config.encoder.layers, config.llm.hidden) == ("siglip", 2, 32)
    backend = TorchBackend()
    with backend.session(config, tmp_path / "out", where="run.yaml", resume=False):
        assert backend.options.weights == str(tmp_path / "ckpt")


@pytest.mark.parametrize("text, message", [
    ("model: {checkpoint: llm}\n", r"run\.yaml: model: .*llm/config\.json is a plain LLM \(no vision_config\): "
                                   r"name the encoder"),
    ("model: {checkpoint: llm}\nencoder: tiny-vit\nllm: tiny-llm\n", r"run\.yaml: llm: give llm or model\.checkpoint"),
    ("model: {path: llm}\n", r"run\.yaml: model: expected a mapping with one key, checkpoint"),
    ("model: {checkpoint: nowhere}\n", r"nowhere/config\.json: file not found"),
])
def test_a_bad_model_checkpoint_entry_is_one_line_naming_it(checkpoints, tmp_path, text, message):
    from dflop.errors import SpecError

    (tmp_path / "llm").mkdir()
    copied(checkpoints["qwen2", False][1], tmp_path / "llm")
    with pytest.raises(SpecError, match=message):
        run_config(tmp_path, text + "cluster: {hardware: cpu, nodes: 1, gpus_per_node: 2}\ntraining: {global_batch: 4}\n")


def test_a_plain_llm_with_an_encoder_preset_trains_its_llm_from_the_checkpoint(checkpoints, tmp_path):
    (tmp_path / "llm").mkdir()
    copied(checkpoints["qwen2", False][1], tmp_path / "llm")
    config = run_config(tmp_path, "model: {checkpoint: llm}\nencoder: tiny-vit\n"
                                  "cluster: {hardware: cpu, nodes: 1, gpus_per_node: 2}\ntraining: {global_batch: 4}\n")
    assert config.encoder == presets.encoder("tiny-vit") and config.llm.qkv_bias and config.checkpoint


def test_the_backend_refuses_a_bad_checkpoint_before_any_rank_starts(checkpoints, tmp_path):
    """In process: the check runs in the launcher, so no process is started (the fast tier would fail
    the test if one were)."""
    from dflop.backends.torch_runtime.backend import TorchBackend
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.specs import ModulePlan, Plan
    from dflop.timing.steps import CostedPlan

    rewrite(copied(checkpoints["qwen2", False][1], tmp_path), lambda t: t.pop("model.norm.weight"))
    plan = Plan(encoder=ModulePlan(), llm=ModulePlan(pp=2), placement="colocated", microbatches=2)
    backend = TorchBackend(options=TorchOptions(weights=str(tmp_path)))
    with pytest.raises(DflopError, match=r"model\.safetensors: missing tensor 'model\.norm\.weight'"):
        backend.run(CostedPlan(plan, system_for(model_of(tmp_path))), [])
