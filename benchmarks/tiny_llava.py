"""A tiny LLaVA-OneVision that transformers builds from a config (SigLIP + Qwen2), and samples for it.

Shared by bench_trainer.py and the Hugging Face Trainer tests (tests/test_integration_transformers.py,
tests/hf_trainer_job.py), so that the bench trains the model the tests check.

The image config is as simple as LLaVA-OneVision allows: 28-pixel images of 14-pixel patches and one
grid pinpoint (28 x 28), so every image is one anyres tile plus the base tile. The number of image
tokens a sample holds is what the model computes for its image size, asked of the model itself.
"""

import numpy as np
import torch
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM

from dflop.workload import Modality
from dflop.workload.data_profile import DataProfile
from dflop.workload.sample import SampleTable

IMAGE_TOKEN, SIZE, TILES = 63, 28, 2
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def tiny_qwen2(seed=0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TEXT, attn_implementation="sdpa"))


def tiny_llava(seed=0):
    torch.manual_seed(seed)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=SIZE, patch_size=14, vision_use_head=False)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=dict(model_type="qwen2", **TEXT),
                                  image_token_index=IMAGE_TOKEN, video_token_index=IMAGE_TOKEN - 1,
                                  image_grid_pinpoints=[[SIZE, SIZE]], attn_implementation="sdpa")
    return LlavaOnevisionForConditionalGeneration(config)


def image_tokens(model, images=1):
    """Tokens per image of a sample with ``images`` images, as the model computes them."""
    sizes = torch.tensor([[SIZE, SIZE]] * images)
    counts = None if images == 1 else torch.tensor([images])
    with torch.no_grad():
        features = model.model.get_image_features(torch.zeros(images, TILES, 3, SIZE, SIZE), sizes,
                                                  batch_num_images=counts).pooler_output
    return features[0].shape[0]


def sample(rng, text, images, per_image):
    """One training item: ``text`` text tokens, ``images`` images placed after the first two; the
    images of a multi-image sample are one tile each, as LLaVA-OneVision's processor gives them."""
    ids = torch.as_tensor(rng.integers(0, IMAGE_TOKEN - 1, size=text))
    item = {}
    if images:
        tiles = TILES if images == 1 else 1
        ids = torch.cat([ids[:2], torch.full((images * per_image,), IMAGE_TOKEN), ids[2:]])
        item = {"pixel_values": torch.as_tensor(rng.standard_normal((images, tiles, 3, SIZE, SIZE)),
                                                dtype=torch.float32),
                "image_sizes": torch.tensor([[SIZE, SIZE]] * images)}
    return {"input_ids": ids, "labels": torch.where(ids == IMAGE_TOKEN, -100, ids), **item}


def dataset(model, n, seed=0):
    """``n`` items, every third with an image, text of 3 to 40 tokens."""
    rng = np.random.default_rng(seed)
    per_image = image_tokens(model)
    return [sample(rng, int(rng.integers(3, 41)), int(i % 3 == 0), per_image) for i in range(n)]


def profile(items):
    """The data profile of ``items``: sample i describes item i (a single image is ``TILES`` tiles,
    each image of a multi-image sample one tile, as :func:`sample` makes them)."""
    images = [len(item.get("image_sizes", [])) for item in items]
    modality = {0: Modality.TEXT, 1: Modality.IMAGE}
    image_tokens_ = [int((item["input_ids"] == IMAGE_TOKEN).sum()) for item in items]
    text = [len(item["input_ids"]) - k for item, k in zip(items, image_tokens_)]
    table = SampleTable.build([str(i) for i in range(len(items))],
                              [modality.get(k, Modality.MULTI_IMAGE).code for k in images],
                              [TILES if k == 1 else k for k in images], text, image_tokens_)
    return DataProfile(table, {"kind": "test"})
