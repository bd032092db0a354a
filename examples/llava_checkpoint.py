"""A tiny random LLaVA-OneVision checkpoint and a small LLaVA manifest of real images, to try
training on real samples without downloading anything (needs the ``dev`` extra: transformers).

    .venv/bin/python examples/llava_checkpoint.py out/tiny-llava
    dflop run --backend torch --config out/tiny-llava/run.yaml --out out/real

writes into the folder what a released checkpoint and a dataset hold: ``config.json`` and
``model.safetensors`` (SigLIP + Qwen2 + projector, random), ``tokenizer.json`` with a chat
template, ``preprocessor_config.json``; PNG and JPEG images and an MPEG-4 video; ``data.jsonl``
(LLaVA's schema: a single image, a multi-image conversation, text only, a video); and
``run.yaml`` training it on 2 CPU processes. Tiles are 28 pixels (4 x 4 features), at most 2 tiles' worth of grid features.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

TEMPLATE = (  # Qwen2's layout with plain-text content, assistant turns marked for transformers' assistant mask
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = "user assistant what is in the picture a red cat dog on mat and left right both same . ?".split()
SIDE, PINPOINTS, ASPECT = 28, [[28, 28], [28, 56], [56, 28], [56, 56]], "anyres_max_2"
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
    {"id": "clip", "video": "clip.mp4",
     "conversations": [{"from": "human", "value": "<video>\nwhat is in the video ?"},
                       {"from": "gpt", "value": "a dog on the mat ."}]},
]
VIDEO = {"clip.mp4": (24, 16, 12, 4)}
"""width, height, frames, frames per second: 1 frame a second is fed, so frames 0, 4 and 8."""
RUN = {"model": {"checkpoint": "."}, "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
       "training": {"global_batch": 4}, "data": {"dataset": "data.jsonl"}, "steps": 20,
       "plan": {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1},
       "execution": {"lr": 1e-2, "checkpoint_every": 10}}


def save_tokenizer(folder: Path, specials: list[str], **named: str):  # noqa: ANN201 - tokenizers.Tokenizer
    """A WordLevel tokenizer of ``WORDS`` with the chat's and the model's special tokens, and the chat
    template, saved into ``folder`` as transformers saves them (``named``: special tokens the model's
    processor reads by name)."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>", *specials], min_frequency=1))
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                     pad_token="[UNK]", **({"extra_special_tokens": named} if named else {}))
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return tok


def save_model(cls: type, config, folder: Path):  # noqa: ANN001, ANN201 - transformers' classes
    """A seeded ``cls(config)`` with every weight moved off its initial value (so that a weight left
    unread shows), saved into ``folder``; returned."""
    import torch

    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def write_data(folder: Path, images: dict, videos: dict, run: dict, seed: int) -> None:
    """Random PNG/JPEG images and MPEG-4 videos of the given sizes, ``ENTRIES`` as ``data.jsonl`` and
    ``run`` as ``run.yaml``."""
    import yaml
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name, (w, h) in images.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    for name, (w, h, frames, fps) in videos.items():
        write_video(folder / name, [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(frames)], fps)
    (folder / "data.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ENTRIES))
    (folder / "run.yaml").write_text(yaml.safe_dump(run, sort_keys=False))


def build(folder: Path):  # noqa: ANN201 - the transformers model it saved
    """Write the checkpoint, images, manifest and run config into ``folder``; return the model."""
    import transformers as T

    tok = save_tokenizer(folder, ["<image>", "<video>"])
    T.LlavaOnevisionImageProcessorPil(size={"height": SIDE, "width": SIDE},
                                      image_grid_pinpoints=PINPOINTS).save_pretrained(folder)
    text = T.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    vision = T.SiglipVisionConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=SIDE, patch_size=7)
    image_token = tok.token_to_id("<image>")
    config = T.LlavaOnevisionConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    image_token_index=image_token, video_token_index=image_token + 1,
                                    vision_aspect_ratio=ASPECT, image_grid_pinpoints=PINPOINTS)
    model = save_model(T.LlavaOnevisionForConditionalGeneration, config, folder)
    write_data(folder, IMAGES, VIDEO, RUN, seed=3)
    return model


def write_video(path: Path, frames: list[np.ndarray], fps: int) -> None:
    """An MPEG-4 video of ``frames`` (RGB arrays), written with PyAV."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
    print(f"tiny LLaVA-OneVision checkpoint, {len(IMAGES)} images, {len(VIDEO)} video and {len(ENTRIES)} samples "
          f"-> {sys.argv[1]}")
