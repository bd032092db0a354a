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

import sys
from pathlib import Path

from llava_checkpoint import ENTRIES, TEMPLATE, save_model, save_tokenizer, write_data  # noqa: F401 - the same chat

SIDE, MAX_TILES = 56, 4
IMAGES = {"wide.png": (130, 40), "tall.jpg": (30, 75), "square.png": (56, 56), "small.jpg": (9, 13)}
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
    """Write the checkpoint, images, video, manifest (the LLaVA example's entries) and run config into
    ``folder``; return the model."""
    import transformers as T

    tok = save_tokenizer(folder, list(SPECIAL.values()), **SPECIAL)
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
    model = save_model(T.InternVLForConditionalGeneration, config, folder)
    write_data(folder, IMAGES, VIDEO, RUN, seed=5)
    return model


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
    print(f"tiny InternVL checkpoint, {len(IMAGES)} images, {len(VIDEO)} video and {len(ENTRIES)} samples "
          f"-> {sys.argv[1]}")
