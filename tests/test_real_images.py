"""Real images and video: a LLaVA-OneVision checkpoint's own processing of a manifest's PNG, JPEG
and MPEG-4 files, as the torch backend trains on them. The pixels are transformers'
``LlavaOnevisionImageProcessor``'s bit for bit (a video's frames: LLaVA-NeXT's sampling, SigLIP's
image processor on each); each ``<image>`` or ``<video>`` expands to the tokens the data profile
counts (the processor's count); the encoder lays the tiles' features out as
``pack_image_features`` does (anyres grid, unpadding, bilinear shrinking, a newline per row; one
tile and a newline per image of several) and a video's as ``get_video_features`` does (2 x 2
pooling, one newline); and the loss is transformers' on the same samples. The checkpoint is the README's example
(``examples/llava_checkpoint.py``: tiny, random, saved by transformers, a WordLevel tokenizer
trained on the spot); nothing is downloaded."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
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
from dflop.specs.hf_config import encoder_from_hf_config
from dflop.workload.chat import ChatCounter, encode_dataset, load_chat
from dflop.workload.manifest import read_manifest
from dflop.workload.pixels import MediaError, image_tiles, load_image_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the README's example builds the checkpoint
import llava_checkpoint as example  # noqa: E402

ENTRIES = example.ENTRIES

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, processor, folder): the README's tiny LLaVA-OneVision example (a
    checkpoint with its tokenizer, template and image processor, PNG and JPEG files, a LLaVA
    manifest of them) and transformers' processor of it."""
    folder = tmp_path_factory.mktemp("llava-ov")
    model = example.build(folder)
    # (without torchvision transformers cannot look up a video processor class, not even to accept
    # none: the check that asks is skipped; images need no video processor)
    with mock.patch.object(T.ProcessorMixin, "check_argument_for_proper_class", lambda *_: None):
        processor = T.LlavaOnevisionProcessor(
            image_processor=T.LlavaOnevisionImageProcessorPil.from_pretrained(folder),
            tokenizer=T.PreTrainedTokenizerFast.from_pretrained(folder), num_image_tokens=16,
            vision_feature_select_strategy="full", vision_aspect_ratio=example.ASPECT,
            chat_template=example.TEMPLATE)
    return model, processor, folder


def transformers_inputs(processor, entry: dict, folder) -> dict:
    """What LLaVA-OneVision's processor makes of an entry (placeholders as dflop places them), with
    labels on the assistant turns. A video's frames (transformers' video processor needs
    torchvision, which is not installed) are LLaVA-NeXT's training code's: 1 frame a second of the
    container, decoded with PyAV, each through SigLIP's image processor at the tile size."""
    files = entry.get("image", [])
    files = [files] if isinstance(files, str) else files
    turns = [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
             for t in entry["conversations"]]
    if files and "<image>" not in turns[0]["content"]:
        turns[0]["content"] = "<image>\n" * len(files) + turns[0]["content"]
    mask = processor.tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
    text = processor.tokenizer.apply_chat_template(turns, tokenize=False)
    if "video" in entry:
        inputs = {"pixel_values_videos": video_pixels(processor, folder / entry["video"])}
        text = text.replace("<video>", processor.replace_video_token(inputs, 0))
        inputs["input_ids"] = torch.tensor([processor.tokenizer(text, add_special_tokens=False)["input_ids"]])
    else:
        images = [Image.open(folder / f).convert("RGB") for f in files]
        inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    ids = inputs["input_ids"][0]
    media = (ids == processor.image_token_id) | (ids == processor.video_token_id)
    unexpanded = torch.tensor(mask["input_ids"])
    assistant = torch.zeros(len(ids), dtype=torch.bool)
    assistant[~media] = torch.tensor(mask["assistant_masks"], dtype=torch.bool)[
        (unexpanded != processor.image_token_id) & (unexpanded != processor.video_token_id)]
    inputs["labels"] = torch.where(assistant, ids, -100)[None]
    return inputs


def video_pixels(processor, path) -> torch.Tensor:
    """(1, frames, 3, side, side): every 4th frame of the 4 fps clip, as LLaVA-NeXT feeds a video."""
    import av

    with av.open(str(path)) as container:
        frames = [f.to_image().convert("RGB") for f in container.decode(video=0)][::4]
    siglip = T.SiglipImageProcessorPil(size={"height": example.SIDE, "width": example.SIDE},
                                       image_mean=processor.image_processor.image_mean,
                                       image_std=processor.image_processor.image_std)
    return siglip(images=frames, return_tensors="pt")["pixel_values"][None]


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
        if "pixel_values_videos" in want:  # the frames fed are LLaVA-NeXT's, bit for bit
            video, = got.images
            assert torch.equal(torch.from_numpy(video.pixels(entry["id"])), want["pixel_values_videos"][0])
        elif len(got.images) == 1:  # (a multi-image sample's pixel rows are padded to the longest image)
            assert sum(im.tiles for im in got.images) == len(want["pixel_values"][0])
    assert [len(texts[e["id"]].images) for e in ENTRIES] == [1, 1, 2, 0, 1]
    assert table.image_tokens[4] == 3 * (2 * 2) + 1  # the video: 3 frames of 2 x 2 pooled features, a newline
    assert table.image_tokens[1] == 16 + 5 * (5 + 1)  # the square's 2 x 2 grid: 8 x 8 features shrunk to 5 x 5


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 400), height=st.integers(1, 400), aspect=st.sampled_from([1, 2, 9]))
def test_the_image_tokens_are_laid_out_as_pack_image_features(checkpoint, width, height, aspect):
    """Any image size, shrunk or not: dflop's layout of a single image's tile features is
    transformers' ``pack_image_features`` (unpadding rows or columns, bilinear shrinking, newlines)."""
    from dataclasses import replace

    from dflop.backends.torch_runtime.model import onevision_layout
    from dflop.workload.pixels import image_refs

    model, _, folder = checkpoint
    rule = load_image_rule(folder, encoder_from_hf_config(folder / "config.json").tiling)
    rule = replace(rule, tiling=replace(rule.tiling, anyres_max=aspect))
    image, = image_refs([(folder / "any.png", (width, height))], rule)
    features = torch.randn(image.tiles, 16, 32, generator=torch.Generator().manual_seed(width * 401 + height))
    with torch.no_grad():
        ours = onevision_layout(features, [image], model.model.image_newline)
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


def test_steps_scheduled_for_other_data_are_refused_before_any_rank_is_fed(checkpoint):
    """A run's steps carry each sample's tiles and tokens as they were planned; a dataset that renders
    otherwise now (edited in place: same ids) is one line naming the sample, not pixels of another shape."""
    from dflop.workload.sample import SampleTable

    _, _, folder = checkpoint
    encoder, table, _ = encoded(folder)
    planned = SampleTable.build(table.ids, table.modality, table.tiles + (table.ids == "square"), table.text_tokens,
                                table.image_tokens)
    with pytest.raises(DflopError, match=r"data\.jsonl: sample 'square' has 5 tiles, 46 image and \d+ text tokens "
                                         r"now, not what the run's steps were scheduled for"):
        encode_dataset(folder / "data.jsonl", encoder, load_chat(folder), [planned])


@pytest.mark.parametrize("change, message", [
    (lambda e: [e["conversations"][0].update(value="what ?"), e["conversations"][1].update(value="<image> a cat")],
     "bad.jsonl:1: entry 0: an <image> or <video> placeholder in an assistant turn"),
    (lambda e: e["conversations"][0].update(value="<image> <image> what ?"), r"2 <image> and 0 <video> placeholder"),
    (lambda e: [e.pop("image"), e.update(video="clip.mp4", frames=8)],
     r"bad.jsonl:1: entry 0: .*clip.mp4: real frames are read for LLaVA-OneVision's video rule .* no 'frames' or "
     r"'duration' in the entry"),
])
def test_what_cannot_be_fed_as_the_checkpoint_feeds_it_is_one_line(checkpoint, tmp_path, change, message):
    _, _, folder = checkpoint
    entry = json.loads(json.dumps(ENTRIES[0]))
    change(entry)
    for name in ("wide.png", "clip.mp4"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "bad.jsonl").write_text(json.dumps(entry) + "\n")
    encoder = encoder_from_hf_config(folder / "config.json")
    with pytest.raises(DflopError, match=message):
        read_manifest(tmp_path / "bad.jsonl", encoder, tokenizer=ChatCounter(load_chat(folder), tiling=encoder.tiling))


PLANS = {  # 2 and 4 processes: data parallelism (the example's run.yaml), tensor and pipeline parallelism, each
    # module on its own ranks
    "colocated dp2": example.RUN["plan"],
    "disaggregated encoder tp2 + llm pp2": {"encoder": {"tp": 2}, "llm": {"pp": 2}, "placement": "disaggregated",
                                            "microbatches": 2},
}


@pytest.mark.processes
@pytest.mark.parametrize("plan", list(PLANS))
def test_a_torch_run_trains_on_images_and_video_from_transformers_loss(checkpoint, tmp_path, plan):
    """The first step's loss is transformers' on the samples it trained, the loss goes down, and the
    exported folder, loaded by transformers, computes the loss the run recorded for the step after
    its last checkpoint (step 14 of 20: the trained weights, not the initial ones). The 4-process run makes each
    step's images in a DataLoader worker process ahead of the step (``decode_workers: 1``), with the
    same results."""
    model, processor, folder = checkpoint
    wide = plan != "colocated dp2"
    run = {**example.RUN, "plan": PLANS[plan], "cluster": {**example.RUN["cluster"], "gpus_per_node": 4 if wide else 2},
           "execution": {"lr": 1e-2, "checkpoint_every": 7, "decode_workers": 1 if wide else 0}}
    path = folder / f"{plan}.yaml".replace(" ", "-")
    path.write_text(yaml.safe_dump(run))
    r = dflop_json("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    by_id = {e["id"]: e for e in ENTRIES}

    def samples(step):
        return [by_id[i.split(":", 1)[1]] for i in r["trained"][step]["sample_ids"]]

    assert r["inputs"].startswith("real samples") and len({e["id"] for e in samples(0)}) == 4
    assert {e["id"] for step in range(20) for e in samples(step)} == set(by_id)  # the video too
    assert r["trained"][0]["loss"] == pytest.approx(transformers_loss(model, processor, folder, samples(0)), rel=1e-4)
    assert len(r["losses"]) == 20 and max(r["losses"][-4:]) < min(r["losses"][:4])
    export = dflop_json("export", "checkpoint", tmp_path / "out", "--to", "hf", "--out", tmp_path / "hf")
    trained = T.LlavaOnevisionForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    assert export["step"] == 14
    assert r["trained"][14]["loss"] == pytest.approx(transformers_loss(trained, processor, folder, samples(14)),
                                                     rel=1e-4)


@dataclass(frozen=True)
class Traced:
    """A medium that, decoded, leaves a file ``name`` in ``folder`` and is one tile holding the id of
    the process that decoded it; ``broken``: it fails then, as a file cut short does."""

    folder: str
    name: str
    broken: bool = False

    def pixels(self, where: str) -> np.ndarray:
        Path(self.folder, self.name).write_text(str(os.getpid()))
        if self.broken:
            raise MediaError(f"{where}: {self.name}: cannot decode the image (cut short)")
        return np.full((1, 3, 2, 2), os.getpid(), dtype=np.float32)


def appears(path: Path, within_s: float = 30) -> bool:
    """Whether ``path`` exists within ``within_s`` seconds (a worker writes it when it decodes)."""
    end = time.monotonic() + within_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.01)
    return path.exists()


@pytest.mark.processes
@pytest.mark.parametrize("workers", [0, 1])
def test_decode_workers_decode_each_step_in_another_process_ahead_of_it(tmp_path, workers):
    """With ``decode_workers`` a DataLoader worker process decodes the next step while the caller still
    holds this one (else the wait for its file would time out); with 0 the caller decodes each step
    itself, at its turn. Either way the steps come in order, and a medium that fails to decode comes
    back as its sample's message, not as an error."""
    from dflop.backends.torch_runtime.decoding import decoded_steps

    steps = range(1, 5)
    media = {k: {f"s{k}": (Traced(str(tmp_path), f"s{k}"),), f"bad{k}": (Traced(str(tmp_path), f"bad{k}", True),)}
             for k in steps}
    got = []
    for item, waited in decoded_steps(media, steps, workers):
        k = item.step
        got.append(k)
        decoder = int(item.pixels[f"s{k}"].flatten()[0])
        assert (decoder != os.getpid()) == (workers > 0) and item.seconds > 0 and waited >= 0
        assert item.pixels[f"bad{k}"] == f"bad{k}: bad{k}: cannot decode the image (cut short)"
        if k < steps[-1]:
            assert appears(tmp_path / f"s{k + 1}") if workers else not (tmp_path / f"s{k + 1}").exists()
    assert got == list(steps) and not (tmp_path / "s0").exists()


@pytest.mark.processes
def test_a_worker_decodes_real_media_as_the_rank_would_and_names_a_file_cut_short(checkpoint, tmp_path):
    """The images and the video decoded in a worker are the tiles the rank decodes itself, bit for
    bit; a PNG cut short after its header is its sample's message (the rank then skips it)."""
    from dataclasses import replace

    from dflop.backends.torch_runtime.decoding import decoded_steps

    _, _, folder = checkpoint
    _, _, texts = encoded(folder)
    png = (folder / "square.png").read_bytes()
    (tmp_path / "square.png").write_bytes(png[:len(png) // 2])
    cut = tuple(replace(ref, path=str(tmp_path / "square.png")) for ref in texts["square"].images)
    media = {0: {k: texts[k].images for k in ("one", "two", "clip")}, 1: {"square": cut}}
    first, second = (item for item, _ in decoded_steps(media, range(2), workers=1))
    for k in ("one", "two", "clip"):
        assert torch.equal(first.pixels[k], torch.from_numpy(np.concatenate([r.pixels(k) for r in texts[k].images])))
    assert "square.png: cannot decode the image" in second.pixels["square"]


@pytest.mark.processes
def test_a_sample_whose_media_fail_to_decode_is_skipped_on_every_rank(checkpoint, tmp_path):
    """A PNG cut short after its header (the profile reads it; its pixels do not decode): every
    step that drew it trains without it on both ranks alike, from transformers' loss on the others;
    the report names it; the run goes on."""
    import shutil

    model, processor, source = checkpoint
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    png = (folder / "square.png").read_bytes()
    (folder / "square.png").write_bytes(png[:len(png) // 2])
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump({**example.RUN, "steps": 4, "execution": {"lr": 1e-2}}))
    r = dflop_json("run", "--backend", "torch", "--config", path, "--out", tmp_path / "out")
    assert r["skipped"] and {s["sample_id"].split(":", 1)[1] for s in r["skipped"]} == {"square"}
    assert all("square.png: cannot decode the image" in s["why"] for s in r["skipped"])
    trained = [i.split(":", 1)[1] for step in r["trained"] for i in step["sample_ids"]]
    assert "square" not in trained and len(trained) == 16 - len(r["skipped"])
    assert any("dflop: " in w and "skipped, their media failed to decode" in w for w in r["warnings"])
    by_id = {e["id"]: e for e in ENTRIES}
    first = [by_id[i.split(":", 1)[1]] for i in r["trained"][0]["sample_ids"]]
    assert r["trained"][0]["loss"] == pytest.approx(transformers_loss(model, processor, folder, first), rel=1e-4)
