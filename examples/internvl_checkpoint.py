"""A tiny random InternVL checkpoint (transformers' format) and a small LLaVA manifest of real
images, to try training on real samples without downloading anything (needs the ``dev`` extra).

    .venv/bin/python examples/internvl_checkpoint.py out/tiny-internvl
    dflop run --backend torch --config out/tiny-internvl/run.yaml --out out/real-internvl

writes what a released InternVL-hf checkpoint and a dataset hold: ``config.json`` and
``model.safetensors`` (InternViT + Qwen2 + pixel-shuffle projector, random), ``tokenizer.json``
with a chat template and InternVL's ``<img>``, ``<IMG_CONTEXT>`` and ``</img>`` tokens,
``preprocessor_config.json`` (dynamic tiling, at most 4 tiles and a thumbnail); PNG and JPEG
images and an MPEG-4 video; ``data.jsonl`` (a single image, a multi-image conversation, text only,
a video) and ``run.yaml`` training it on 2 CPU processes. Tiles are 56 pixels (4 x 4 patches, 2 x 2 tokens after the
pixel shuffle).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from llava_checkpoint import TEMPLATE, WORDS, write_video

SIDE, MAX_TILES = 56, 4
IMAGES = {"wide.png": (130, 40), "tall.jpg": (30, 75), "square.png": (56, 56), "small.jpg": (9, 13)}
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
    {"id": "clip", "video": "clip.mp4",
     "conversations": [{"from": "human", "value": "<video>\nwhat is in the video ?"},
                       {"from": "gpt", "value": "a dog on the mat ."}]},
]
VIDEO = {"clip.mp4": (24, 16, 12, 4)}
"""width, height, frames, frames per second: InternVL feeds 8 to 32 frames a video (drawn), each a tile."""
RUN = {"model": {"checkpoint": "."}, "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
       "training": {"global_batch": 4}, "data": {"dataset": "data.jsonl"}, "steps": 20,
       "plan": {"encoder": {"tp": 2}, "llm": {"tp": 2}, "placement": "colocated", "microbatches": 1},
       "execution": {"lr": 1e-2, "checkpoint_every": 10}}
SPECIAL = {"start_image_token": "<img>", "context_image_token": "<IMG_CONTEXT>", "end_image_token": "</img>",
           "video_token": "<video>"}
"""The tokens InternVL's processor names (transformers reads them from the tokenizer's config)."""


def build(folder: Path):  # noqa: ANN201 - the transformers model it saved
    """Write the checkpoint, images, manifest and run config into ``folder``; return the model."""
    import torch
    import transformers as T
    import yaml
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>", *SPECIAL.values()], min_frequency=1))
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                     pad_token="[UNK]", extra_special_tokens=SPECIAL)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    T.GotOcr2ImageProcessorPil(size={"height": SIDE, "width": SIDE}, crop_to_patches=True, max_patches=MAX_TILES,
                               image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]
                               ).save_pretrained(folder)
    text = T.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    vision = T.InternVLVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=[SIDE, SIDE], patch_size=[14, 14])
    config = T.InternVLConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                              image_token_id=tok.token_to_id("<IMG_CONTEXT>"), image_seq_length=4,
                              max_dynamic_patch=MAX_TILES)
    torch.manual_seed(0)
    model = T.InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():  # every weight off its initial value, so that a weight left unread shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    rng = np.random.default_rng(5)
    for name, (w, h) in IMAGES.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    for name, (w, h, frames, fps) in VIDEO.items():
        write_video(folder / name, [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(frames)], fps)
    (folder / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ENTRIES))
    (folder / "run.yaml").write_text(yaml.safe_dump(RUN, sort_keys=False))
    return model


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
    print(f"tiny InternVL checkpoint, {len(IMAGES)} images, {len(VIDEO)} video and {len(ENTRIES)} samples "
          f"-> {sys.argv[1]}")
