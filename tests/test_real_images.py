"""Real images: a LLaVA-OneVision checkpoint's own processing of a manifest's PNG and JPEG files,
as the torch backend trains on them. The pixels are transformers' ``LlavaOnevisionImageProcessor``'s
bit for bit; each ``<image>`` expands to the tokens the data profile counts (the processor's
count); the encoder lays the tiles' features out as ``pack_image_features`` does (anyres grid,
unpadding, bilinear shrinking, a newline per row; one tile and a newline per image of several);
and the loss is transformers' on the same samples. The checkpoint is a tiny random one that
transformers saves here, its tokenizer a WordLevel one trained here; nothing is downloaded."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch
import transformers as T
import yaml
from cli_helpers import dflop_json
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dflop.errors import DflopError
from dflop.specs.hf_config import encoder_from_hf_config
from dflop.workload.chat import ChatCounter, encode_dataset, load_chat
from dflop.workload.manifest import read_manifest
from dflop.workload.pixels import image_tiles, load_image_rule

TEMPLATE = (  # Qwen2's layout with plain-text content, assistant turns marked for transformers' assistant mask
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = "user assistant what is in the picture a red cat dog on mat and left right both same . ?".split()
SIDE, PINPOINTS, ASPECT = 28, [[28, 28], [28, 56], [56, 28], [56, 56]], "anyres_max_2"
"""Tiles of 4 x 4 features; at most 2 tiles' worth of grid features, so a 2 x 2 grid is shrunk."""
IMAGES = {"wide.png": (61, 23), "tall.jpg": (19, 50), "square.png": (56, 56), "small.jpg": (9, 13)}
ENTRIES = [  # a single image (placeholder written, then not), two images, text only
    {"id": "one", "image": "wide.png",
     "conversations": [{"from": "human", "value": "what is in the picture ?\n<image>"},
                       {"from": "gpt", "value": "a red cat on the mat ."}]},
    {"id": "square", "image": "square.png",
     "conversations": [{"from": "human", "value": "what is in the picture ?"}, {"from": "gpt", "value": "a dog ."}]},
    {"id": "two", "image": ["tall.jpg", "small.jpg"],
     "conversations": [{"from": "human", "value": "<image> left and <image> right ?"},
                       {"from": "gpt", "value": "both a cat ."}, {"from": "human", "value": "same ?"},
                       {"from": "gpt", "value": "the same ."}]},
    {"id": "text", "conversations": [{"from": "human", "value": "what is a cat ?"}, {"from": "gpt", "value": "a cat ."}]},
]


def config(vocab: int, image_token: int, layers: int = 2) -> T.LlavaOnevisionConfig:
    text = T.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    vision = T.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=SIDE, patch_size=7)
    return T.LlavaOnevisionConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                  image_token_index=image_token, video_token_index=image_token + 1,
                                  vision_aspect_ratio=ASPECT, image_grid_pinpoints=PINPOINTS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, processor, folder): a tiny LLaVA-OneVision with its tokenizer, template,
    image processor, the images as PNG and JPEG files and a LLaVA manifest of them."""
    folder = tmp_path_factory.mktemp("llava-ov")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>", "<image>", "<video>"], min_frequency=1))
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                     pad_token="[UNK]")
    # (without torchvision transformers cannot look up a video processor class, not even to accept
    # none: the check that asks is skipped; images need no video processor)
    with mock.patch.object(T.ProcessorMixin, "check_argument_for_proper_class", lambda *_: None):
        processor = T.LlavaOnevisionProcessor(
            image_processor=T.LlavaOnevisionImageProcessorPil(size={"height": SIDE, "width": SIDE},
                                                              image_grid_pinpoints=PINPOINTS),
            tokenizer=fast, num_image_tokens=16, vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT,
            chat_template=TEMPLATE)
    processor.image_processor.save_pretrained(folder)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    model = T.LlavaOnevisionForConditionalGeneration(config(tok.get_vocab_size(), tok.token_to_id("<image>"))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    rng = np.random.default_rng(3)
    for name, (w, h) in IMAGES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    (folder / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ENTRIES))
    return model, processor, folder


def transformers_inputs(processor, entry: dict, folder) -> dict:
    """What LLaVA-OneVision's processor makes of an entry (placeholders as dflop places them), with
    labels on the assistant turns."""
    files = entry.get("image", [])
    files = [files] if isinstance(files, str) else files
    turns = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
             for t in entry["conversations"]]
    if files and "<image>" not in turns[0]["content"]:
        turns[0]["content"] = "<image>\n" * len(files) + turns[0]["content"]
    mask = processor.tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
    text = processor.tokenizer.apply_chat_template(turns, tokenize=False)
    images = [Image.open(folder / f).convert("RGB") for f in files]
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    ids = inputs["input_ids"][0]
    assistant = torch.zeros(len(ids), dtype=torch.bool)
    unexpanded = torch.tensor(mask["input_ids"])
    keep = (ids != processor.image_token_id)
    assistant[keep] = torch.tensor(mask["assistant_masks"], dtype=torch.bool)[unexpanded != processor.image_token_id]
    inputs["labels"] = torch.where(assistant, ids, -100)[None]
    return inputs


def encoded(folder):
    encoder = encoder_from_hf_config(folder / "config.json")
    table = read_manifest(folder / "data.jsonl", encoder, tokenizer=ChatCounter(load_chat(folder),
                                                                                 tiling=encoder.tiling)).samples
    return encoder, table, encode_dataset(folder / "data.jsonl", encoder, load_chat(folder), [table])[0]


@settings(max_examples=25, deadline=None)
@given(width=st.integers(1, 130), height=st.integers(1, 130), alone=st.booleans())
def test_the_tiles_are_the_processors_pixels_bit_for_bit(checkpoint, width, height, alone):
    _, processor, folder = checkpoint
    rule = load_image_rule(folder, encoder_from_hf_config(folder / "config.json").tiling)
    image = Image.fromarray(np.random.default_rng(width * 131 + height).integers(0, 256, (height, width, 3),
                                                                                   dtype=np.uint8))
    want = processor.image_processor(images=[[image]] if alone else [[image, image]],
                                     return_tensors="np")["pixel_values"][0]
    got = image_tiles(image, rule, alone)
    assert np.array_equal(got, want if alone else want[:1])


def test_each_image_expands_to_the_tokens_the_processor_and_the_profile_count(checkpoint):
    """Sample by sample: the ids are the processor's, and the profile's text tokens, tiles and image
    tokens are what the backend feeds."""
    _, processor, folder = checkpoint
    _, table, texts = encoded(folder)
    for i, entry in enumerate(ENTRIES):
        got, want = texts[entry["id"]], transformers_inputs(processor, entry, folder)
        assert got.ids.tolist() == want["input_ids"][0].tolist()
        assert np.array_equal(np.where(got.targets, got.ids, -100), want["labels"][0].numpy())
        assert (int(got.text.sum()), int((~got.text).sum()), sum(im.tiles for im in got.images)) == \
            (table.text_tokens[i], table.image_tokens[i], table.tiles[i])
        assert sum(im.tiles for im in got.images) == len(want.get("pixel_values", torch.zeros(1, 0))[0]) \
            or len(got.images) > 1  # a multi-image sample's pixel rows are padded to the longest image
    assert [len(texts[e["id"]].images) for e in ENTRIES] == [1, 1, 2, 0]
    assert table.image_tokens[1] == 16 + 5 * (5 + 1)  # the square's 2 x 2 grid: 8 x 8 features shrunk to 5 x 5


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 400), height=st.integers(1, 400), aspect=st.sampled_from([1, 2, 9]))
def test_the_image_tokens_are_laid_out_as_pack_image_features(checkpoint, width, height, aspect):
    """Any image size, shrunk or not: dflop's layout of a single image's tile features is
    transformers' ``pack_image_features`` (unpadding rows or columns, bilinear shrinking, newlines)."""
    from dataclasses import replace

    from dflop.backends.torch_runtime.model import anyres_layout
    from dflop.workload.pixels import image_refs

    model, _, folder = checkpoint
    rule = load_image_rule(folder, encoder_from_hf_config(folder / "config.json").tiling)
    rule = replace(rule, tiling=replace(rule.tiling, anyres_max=aspect))
    image, = image_refs([(folder / "any.png", (width, height))], rule)
    features = torch.randn(image.tiles, 16, 32, generator=torch.Generator().manual_seed(width * 401 + height))
    with torch.no_grad():
        ours = anyres_layout(features, [image], model.model.image_newline)
        theirs, _ = model.model.pack_image_features([features], torch.tensor([[height, width]]),
                                                    model.model.image_newline, f"anyres_max_{aspect}")
    assert ours.shape[0] == image.tokens and torch.equal(ours, theirs[0])


def transformers_loss(model, processor, folder, entries) -> float:
    """The token-weighted mean over every assistant target of ``entries``, as transformers computes it."""
    total, count = 0.0, 0
    with torch.no_grad():
        for entry in entries:
            inputs = transformers_inputs(processor, entry, folder)
            n = int((inputs["labels"][0, 1:] != -100).sum())
            total += float(model(**inputs).loss) * n
            count += n
    return total / count


def test_the_reference_loss_on_images_is_transformers(checkpoint):
    """The whole model in one process, from the checkpoint, on every sample at once: its loss is
    transformers' (the layout of every image, the interleaving and the targets all enter it)."""
    from dflop.backends.torch_runtime.reference import reference_training
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.specs.hf_config import llm_from_hf_config
    from dflop.specs.models import MLLMSpec

    model, processor, folder = checkpoint
    encoder, table, texts = encoded(folder)
    spec = MLLMSpec(encoder=encoder, llm=llm_from_hf_config(folder / "config.json"))
    ref = reference_training(spec, [table], TorchOptions(weights=str(folder), lr=1e-3), [texts])
    assert ref.losses[0] == pytest.approx(transformers_loss(model, processor, folder, ENTRIES), rel=1e-4)


@pytest.mark.parametrize("change, message", [
    (lambda e: [e["conversations"][0].update(value="what ?"), e["conversations"][1].update(value="<image> a cat")],
     "bad.jsonl:1: entry 0: an <image> placeholder in an assistant turn"),
    (lambda e: e["conversations"][0].update(value="<image> <image> what ?"), r"2 <image> and 0 <video> placeholder"),
])
def test_a_placeholder_that_cannot_be_placed_is_one_line(checkpoint, tmp_path, change, message):
    _, _, folder = checkpoint
    entry = json.loads(json.dumps(ENTRIES[0]))
    change(entry)
    (tmp_path / "wide.png").write_bytes((folder / "wide.png").read_bytes())
    (tmp_path / "bad.jsonl").write_text(json.dumps(entry) + "\n")
    encoder = encoder_from_hf_config(folder / "config.json")
    with pytest.raises(DflopError, match=message):
        read_manifest(tmp_path / "bad.jsonl", encoder, tokenizer=ChatCounter(load_chat(folder), tiling=encoder.tiling))


PLANS = {  # 2 and 4 processes: the encoder on its own rank; pipeline and tensor parallelism
    "disaggregated": {"encoder": {"dp": 1}, "llm": {"dp": 1}, "placement": "disaggregated", "microbatches": 2},
    "colocated pp2 x tp2": {"encoder": {"tp": 2}, "llm": {"tp": 2, "pp": 2}, "placement": "colocated",
                            "microbatches": 2},
}


@pytest.mark.processes
@pytest.mark.parametrize("plan", list(PLANS))
def test_a_torch_run_trains_on_the_images_from_transformers_loss(checkpoint, tmp_path, plan):
    """The first step's loss is transformers' on the samples it trained, the loss goes down, and the
    exported folder, loaded by transformers, computes the loss the run recorded for the step after
    its checkpoint (the trained weights, not the initial ones)."""
    model, processor, folder = checkpoint
    gpus = 2 if plan == "disaggregated" else 4
    run = {"model": {"checkpoint": "."}, "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": gpus},
           "training": {"global_batch": 4}, "data": {"dataset": "data.jsonl"}, "steps": 4, "plan": PLANS[plan],
           "execution": {"lr": 1e-2, "checkpoint_every": 3}}
    path = folder / f"{plan}.yaml".replace(" ", "-")
    path.write_text(yaml.safe_dump(run))
    r = dflop_json("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    by_id = {e["id"]: e for e in ENTRIES}

    def samples(step):
        return [by_id[i.split(":", 1)[1]] for i in r["trained"][step]["sample_ids"]]

    assert sorted(e["id"] for e in samples(0)) == sorted(by_id)
    assert r["trained"][0]["loss"] == pytest.approx(transformers_loss(model, processor, folder, samples(0)), rel=1e-4)
    assert r["losses"][-1] < r["losses"][0]
    export = dflop_json("export", "checkpoint", tmp_path / "out", "--to", "hf", "--out", tmp_path / "hf")
    trained = T.LlavaOnevisionForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert export["step"] == 3
    assert r["trained"][3]["loss"] == pytest.approx(transformers_loss(trained, processor, folder, samples(3)),
                                                    rel=1e-4)
