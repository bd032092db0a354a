"""Real images and video on an InternVL checkpoint (transformers' ``InternVLForConditionalGeneration``:
InternViT with its class token and layer scales, a pixel shuffle, the normalising MLP projector,
Qwen2): the tiles are ``GotOcr2ImageProcessorPil``'s with ``crop_to_patches`` bit for bit (the
grid of closest aspect, row by row, then a thumbnail), each ``<image>`` becomes
``<img><IMG_CONTEXT>...</img>`` as ``InternVLProcessor`` writes it, a video is its frames sampled
as InternVL's ``get_frame_indices`` (``middle``) samples them, each an image of its own
(``Frame{i}: <img>...</img>``), the data profile counts what the backend feeds, and the loss is
transformers'. The checkpoint is the example
``examples/internvl_checkpoint.py`` (tiny, random, saved by transformers); nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
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

from dflop.errors import DflopError
from dflop.specs.hf_config import encoder_from_hf_config, llm_from_hf_config
from dflop.workload import vision
from dflop.workload.chat import ChatCounter, encode_dataset, load_chat
from dflop.workload.manifest import read_manifest
from dflop.workload.pixels import image_tiles, load_image_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import internvl_checkpoint as example  # noqa: E402

ENTRIES = example.ENTRIES


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, its InternVLProcessor, folder) of the example."""
    folder = tmp_path_factory.mktemp("internvl")
    model = example.build(folder)
    # (without torchvision transformers cannot look up a video processor class, not even to accept none)
    with mock.patch.object(T.ProcessorMixin, "check_argument_for_proper_class", lambda *_: None):
        processor = T.InternVLProcessor(image_processor=T.GotOcr2ImageProcessorPil.from_pretrained(folder),
                                        tokenizer=T.PreTrainedTokenizerFast.from_pretrained(folder),
                                        image_seq_length=4, chat_template=example.TEMPLATE)
    return model, processor, folder


def transformers_inputs(processor, entry: dict, folder: Path, frames: tuple[int, ...] = ()) -> dict:
    """What InternVL's processor makes of an entry (placeholders where dflop places them, each image of
    a multi-image sample with InternVL's budget of max_tiles // images), labels on the assistant turns.
    A video: its ``frames`` decoded with PyAV, each resized to one tile by the image processor, written
    as the processor's ``replace_video_token`` writes them (its video processor needs torchvision)."""
    if "video" in entry:
        return video_inputs(processor, entry, folder, frames)
    files = entry.get("image", [])
    files = [files] if isinstance(files, str) else files
    turns = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
             for t in entry["conversations"]]
    if files and "<image>" not in turns[0]["content"]:
        turns[0]["content"] = "<image>\n" * len(files) + turns[0]["content"]
    turns = [{**t, "content": t["content"].replace("<image>", processor.image_token)} for t in turns]
    text = processor.tokenizer.apply_chat_template(turns, tokenize=False)
    budget = {"max_patches": max(1, example.MAX_TILES // len(files))} if len(files) > 1 else {}
    images = [Image.open(folder / f).convert("RGB") for f in files]
    inputs = processor(text=[text], images=images or None, return_tensors="pt", **budget)
    mask = processor.tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
    ids, unexpanded = inputs["input_ids"][0], torch.tensor(mask["input_ids"])
    media = torch.isin(ids, torch.tensor(processor.image_token_ids))  # <img>, its context tokens, </img>
    assistant = torch.zeros(len(ids), dtype=torch.bool)
    assistant[~media] = torch.tensor(mask["assistant_masks"], dtype=torch.bool)[unexpanded != processor.image_token_id]
    inputs["labels"] = torch.where(assistant, ids, -100)[None]
    return inputs


def video_inputs(processor, entry: dict, folder: Path, frames: tuple[int, ...]) -> dict:
    import av

    with av.open(str(folder / entry["video"])) as container:
        decoded = [f.to_image().convert("RGB") for f in container.decode(video=0)]
    tiles = processor.image_processor(images=[decoded[i] for i in frames], crop_to_patches=False,
                                      return_tensors="pt")["pixel_values"]
    written = processor.replace_video_token({"pixel_values_videos": [tiles]}, 0)
    turns = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"].replace("<video>", written)}
             for t in entry["conversations"]]
    made = processor.tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
    ids = torch.tensor([made["input_ids"]])
    labels = torch.where(torch.tensor(made["assistant_masks"], dtype=torch.bool), ids[0], -100)[None]
    return {"input_ids": ids, "pixel_values": tiles, "labels": labels}


def internvl_middle(num_frames: int, vlen: int) -> list[int]:
    """InternVL's ``get_frame_indices(num_frames, vlen, sample='middle')``, as its training code writes it."""
    acc_samples = min(num_frames, vlen)
    intervals = np.linspace(start=0, stop=vlen, num=acc_samples + 1).astype(int)
    ranges = []
    for idx, interv in enumerate(intervals[:-1]):
        ranges.append((interv, intervals[idx + 1] - 1))
    frame_indices = [(x[0] + x[1]) // 2 for x in ranges]
    if len(frame_indices) < num_frames:
        padded_frame_indices = [frame_indices[-1]] * num_frames
        padded_frame_indices[:len(frame_indices)] = frame_indices
        frame_indices = padded_frame_indices
    return frame_indices


@given(frames=st.integers(1, 40), total=st.integers(1, 400))
def test_a_videos_frames_are_internvls_middle_of_each_segment(frames, total):
    from dflop.workload.pixels import middle_frames

    assert middle_frames(frames, total).tolist() == internvl_middle(frames, total)


def encoded(folder: Path):
    encoder = encoder_from_hf_config(folder / "config.json")
    table = read_manifest(folder / "data.jsonl", encoder,
                          tokenizer=ChatCounter(load_chat(folder), tiling=encoder.tiling)).samples
    return encoder, table, encode_dataset(folder / "data.jsonl", encoder, load_chat(folder), [table])[0]


def transformers_loss(model, processor, folder: Path, entries: list[dict]) -> float:
    _, _, texts = encoded(folder)
    total, count = 0.0, 0
    with torch.no_grad():
        for entry in entries:
            inputs = transformers_inputs(processor, entry, folder, frames_of(texts[entry["id"]]))
            n = int((inputs["labels"][0, 1:] != -100).sum())
            total += float(model(**inputs).loss) * n
            count += n
    return total / count


def test_the_checkpoint_reads_as_transformers_builds_it(checkpoint):
    """transformers' InternVL names: square sizes as [h, w], attention_bias, and a head tied by the
    VLM's own tie_word_embeddings (its text config says false)."""
    model, _, folder = checkpoint
    encoder, llm = encoder_from_hf_config(folder / "config.json"), llm_from_hf_config(folder / "config.json")
    assert (encoder.family, encoder.image_size, encoder.patch_size, encoder.qkv_bias, encoder.merge) == \
        ("internvit", 56, 14, False, 4)
    assert (encoder.tiling.max_tiles, encoder.tiling.tile_tokens, encoder.newline) == (4, 4, False)
    assert llm.tie_embeddings and model.lm_head.weight is model.model.language_model.embed_tokens.weight


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 260), height=st.integers(1, 260), most=st.integers(1, 6))
def test_the_tiles_are_the_processors_pixels_bit_for_bit(checkpoint, width, height, most):
    _, processor, folder = checkpoint
    rule = load_image_rule(folder, encoder_from_hf_config(folder / "config.json").tiling)
    image = Image.fromarray(np.random.default_rng(width * 263 + height).integers(0, 256, (height, width, 3),
                                                                                   dtype=np.uint8))
    want = processor.image_processor(images=[image], max_patches=most, return_tensors="np")["pixel_values"]
    got = image_tiles(image, rule, alone=True, most=most)
    counted = vision._dynamic_tiles(np.array([width]), np.array([height]), np.array([most]), rule.tiling)
    assert np.array_equal(got, want) and len(got) == counted[0]


def frames_of(encoded) -> tuple[int, ...]:
    """The frames dflop feeds of a sample's video (none without one)."""
    from dflop.workload.pixels import VideoRef

    return next((v.indices for v in encoded.images if isinstance(v, VideoRef)), ())


def test_each_image_expands_to_the_tokens_the_processor_and_the_profile_count(checkpoint):
    _, processor, folder = checkpoint
    _, table, texts = encoded(folder)
    for i, entry in enumerate(ENTRIES):
        got = texts[entry["id"]]
        want = transformers_inputs(processor, entry, folder, frames_of(got))
        assert got.ids.tolist() == want["input_ids"][0].tolist()
        assert np.array_equal(np.where(got.targets, got.ids, -100), want["labels"][0].numpy())
        assert (int(got.text.sum()), int((~got.text).sum()), sum(im.tiles for im in got.images)) == \
            (table.text_tokens[i], table.image_tokens[i], table.tiles[i])
        if got.images:
            pixels = np.concatenate([im.pixels(entry["id"]) for im in got.images])
            assert np.array_equal(pixels, want["pixel_values"].numpy())
    clip, = texts["clip"].images
    assert 8 <= clip.tiles <= 32 and list(clip.indices) == internvl_middle(clip.tiles, 12)  # the 12-frame clip
    assert list(table.tiles) == [3 + 1, 1, 2 * (2 + 1), 0, clip.tiles]  # wide: 3 x 1, a thumbnail; two tall
    # images of budget 2 each; the video a tile a frame


def test_the_reference_loss_on_images_is_transformers(checkpoint):
    from dflop.backends.torch_runtime.reference import reference_training
    from dflop.backends.torch_runtime.worker import TorchOptions
    from dflop.specs.models import MLLMSpec

    model, processor, folder = checkpoint
    encoder, table, texts = encoded(folder)
    spec = MLLMSpec(encoder=encoder, llm=llm_from_hf_config(folder / "config.json"))
    ref = reference_training(spec, [table], TorchOptions(weights=str(folder), lr=1e-3), [texts])
    assert ref.losses[0] == pytest.approx(transformers_loss(model, processor, folder, ENTRIES), rel=1e-4)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        (data[section] if section else data)[name] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("file, changes, message", [
    ("preprocessor_config.json", {"max_patches": 6},
     r"preprocessor_config\.json: 'max_patches': 6, but dflop tiles as config\.json's InternVL does"),
    ("config.json", {"vision_config.use_mean_pooling": False},
     r"config\.json: vision_config\.use_mean_pooling: False: dflop's model computes True only"),
])
def test_what_dflop_would_compute_otherwise_is_one_line(checkpoint, tmp_path, file, changes, message):
    from dflop.backends.torch_runtime.hf_checkpoint import open_checkpoint

    _, _, source = checkpoint
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    _edit_json(folder / file, **changes)
    with pytest.raises(DflopError, match=message):
        open_checkpoint(folder)
        encoded(folder)


def test_a_video_whose_entry_gives_its_duration_is_refused_in_one_line(checkpoint, tmp_path):
    _, _, folder = checkpoint
    entry = {**ENTRIES[-1], "duration": 3.0}
    shutil.copy(folder / "clip.mp4", tmp_path / "clip.mp4")
    (tmp_path / "v.jsonl").write_text(json.dumps(entry) + "\n")
    encoder = encoder_from_hf_config(folder / "config.json")
    with pytest.raises(DflopError, match=r"v\.jsonl:1: entry 0: .*clip\.mp4: real frames are read for "
                                         r"LLaVA-OneVision's video rule .* and InternVL's"):
        read_manifest(tmp_path / "v.jsonl", encoder, tokenizer=ChatCounter(load_chat(folder), tiling=encoder.tiling))


@pytest.mark.processes
def test_a_tensor_parallel_run_trains_from_transformers_loss_and_exports_what_it_trained(checkpoint, tmp_path):
    """The example's run (encoder and LLM tp2 on 2 processes: each rank reads its shard of every
    weight): the first loss is transformers' on the samples of step 0, the loss goes down over 20
    steps, and the exported folder, loaded by transformers, gives the loss the run recorded at the
    step after its last checkpoint."""
    model, processor, folder = checkpoint
    path = folder / "tp2.yaml"
    path.write_text(yaml.safe_dump({**example.RUN, "execution": {"lr": 1e-2, "checkpoint_every": 7}}))
    r = dflop_json("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    by_id = {e["id"]: e for e in ENTRIES}

    def samples(step):
        return [by_id[i.split(":", 1)[1]] for i in r["trained"][step]["sample_ids"]]

    assert r["inputs"].startswith("real samples") and len({e["id"] for e in samples(0)}) == 4
    assert {e["id"] for step in range(20) for e in samples(step)} == set(by_id)  # the video too
    assert r["trained"][0]["loss"] == pytest.approx(transformers_loss(model, processor, folder, samples(0)), rel=1e-4)
    assert len(r["losses"]) == 20 and max(r["losses"][-4:]) < min(r["losses"][:4])
    export = dflop_json("export", "checkpoint", tmp_path / "out", "--to", "hf", "--out", tmp_path / "hf")
    trained = T.InternVLForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert export["step"] == 14
    assert r["trained"][14]["loss"] == pytest.approx(transformers_loss(trained, processor, folder, samples(14)),
                                                     rel=1e-4)
