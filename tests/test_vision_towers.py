"""CLIP and the Qwen2-VL / Qwen2.5-VL vision towers: sizes against transformers, their image and
video rules against Qwen2-VL's processor, the window-attention cost, and data profiles that name
the rule they were made with.

The configs under ``tests/data/hf_configs/vision`` are the public config.json files of the
checkpoints they are named after. transformers is a test dependency only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as T
from PIL import Image
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from cli_helpers import dflop_here
from dflop.cost import flops as F
from dflop.errors import DflopError
from dflop.specs import presets
from dflop.specs.hf_config import encoder_from_hf_config
from dflop.specs.models import MLLMSpec
from dflop.workload import vision
from dflop.workload.data_profile import DataProfile, profile_mix
from dflop.workload.shapes import ShapeColumns

CONFIGS = Path(__file__).parent / "data" / "hf_configs" / "vision"


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _clip(vc: dict) -> int:
    # LLaVA takes hidden_states[-2]: post_layernorm's output is never used, and dflop does not count it.
    m = T.CLIPVisionModel(T.CLIPVisionConfig(**vc))
    return _params(m) - _params(m.post_layernorm)


def _siglip(vc: dict) -> int:
    # LLaVA-OneVision drops the pooling head and uses the hidden states before post_layernorm.
    m = T.SiglipVisionModel(T.SiglipVisionConfig(**vc, vision_use_head=False))
    return _params(m) - _params(m.post_layernorm)


def _internvit_config(hidden: int, layers: int, heads: int, mlp: int, image: int, patch: int, qkv_bias: bool,
                      qk_norm: bool, rms: bool) -> T.InternVLVisionConfig:
    return T.InternVLVisionConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                  intermediate_size=mlp, image_size=[image] * 2, patch_size=[patch] * 2,
                                  attention_bias=qkv_bias, use_qk_norm=qk_norm,
                                  norm_type="rms_norm" if rms else "layer_norm")


def _internvit(vc: dict) -> int:
    # InternVL's own InternViT config, in transformers' InternVLVisionConfig terms.
    return _params(T.InternVLVisionModel(_internvit_config(
        vc["hidden_size"], vc["num_hidden_layers"], vc["num_attention_heads"], vc["intermediate_size"],
        vc["image_size"], vc["patch_size"], vc.get("qkv_bias", True), vc.get("qk_normalization", False),
        vc.get("norm_type") == "rms_norm")))


def _qwen2_vl(vc: dict) -> int:
    return _params(Qwen2VisionTransformerPretrainedModel._from_config(T.Qwen2VLVisionConfig(**vc)))


def _qwen2_5_vl(vc: dict) -> int:
    return _params(Qwen2_5_VisionTransformerPretrainedModel._from_config(T.Qwen2_5_VLVisionConfig(**vc)))


# (config, transformers' count, layers in the checkpoint, layers the VLM runs, merger counted as the projector)
TOWERS = [
    ("llava-v1.6-mistral-7b-hf", _clip, 24, 23, False),
    ("InternVL2_5-1B", _internvit, 24, 24, False),
    ("siglip-so400m-patch14-384", _siglip, 27, 26, False),
    ("siglip2-so400m-patch14-384", _siglip, 27, 26, False),
    ("Qwen2-VL-7B-Instruct", _qwen2_vl, 32, 32, True),
    ("Qwen2.5-VL-7B-Instruct", _qwen2_5_vl, 32, 32, True),
]


@pytest.mark.parametrize("name, build, total, run, merger", TOWERS, ids=[t[0] for t in TOWERS])
def test_vision_parameters_match_transformers(name, build, total, run, merger):
    path = CONFIGS / f"{name}.json"
    spec = encoder_from_hf_config(path)
    assert spec.layers == run                       # LLaVA's feature layer -2 runs all but the last
    whole = dataclasses.replace(spec, layers=total)
    count = F.vit_embedding_params(whole) + total * F.vit_layer_params(whole)
    if merger:  # the Qwen towers end in their merger, which dflop counts as the projector
        count += F.projector_params(MLLMSpec(encoder=whole, llm=presets.llm("qwen2.5-7b")))
    with torch.device("meta"):
        expected = build(json.loads(path.read_text())["vision_config"])
    assert count == expected


@pytest.mark.parametrize("name", ["internvit-300m", "internvit-6b"])
def test_internvit_presets_match_transformers(name):
    # the 6B's RMSNorm and q/k norms, the 300M's LayerNorm; both with layer scales and a class token
    e = presets.encoder(name)
    with torch.device("meta"):
        expected = _params(T.InternVLVisionModel(_internvit_config(
            e.hidden, e.layers, e.heads, e.mlp, e.image_size, e.patch_size, e.qkv_bias, e.qk_norm, e.norm == "rmsnorm")))
    assert F.vit_embedding_params(e) + e.layers * F.vit_layer_params(e) == expected


def test_siglip_without_image_size_takes_the_class_default(tmp_path):
    # google/paligemma-3b-pt-224's vision_config: no image_size (SiglipVisionConfig's default is 224).
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "paligemma", "vision_config": {
        "hidden_size": 1152, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "num_image_tokens": 256, "patch_size": 14,
        "projection_dim": 2048, "projector_hidden_act": "gelu_fast", "vision_use_head": False}}))
    spec = encoder_from_hf_config(path)
    assert (spec.image_size, spec.patch_size, spec.patches_per_tile) == (224, 14, 256)


def test_clip_anyres_follows_llava_next():
    t = encoder_from_hf_config(CONFIGS / "llava-v1.6-mistral-7b-hf.json").tiling
    # 640 x 480 picks 672 x 672 (2 x 2 tiles + base); features 48 x 48 unpadded to 36 rows of 48,
    # a newline per row: 36 * 49 + 576.
    assert vision.single_image(640, 480, t) == (5, 36 * 49 + 576)
    # 336 x 336: the first pinpoint of best fit is [336, 672] (1 row, 2 columns), unpadded to 24 x 24.
    assert vision.single_image(336, 336, t) == (3, 24 * 25 + 576)
    assert vision.videos(np.array([8]), t)[1].tolist() == [8 * 144]   # 24 x 24 pooled 2 x 2, no newlines


def test_llava_1_5_feeds_one_tile(tmp_path):
    path = tmp_path / "config.json"
    data = json.loads((CONFIGS / "llava-v1.6-mistral-7b-hf.json").read_text())
    del data["image_grid_pinpoints"]
    path.write_text(json.dumps({**data, "model_type": "llava"}))
    spec = encoder_from_hf_config(path)
    assert spec.rule == "llava-1.5"
    assert vision.single_image(1000, 300, spec.tiling) == (1, 576)


SIZES = [(640, 480), (480, 640), (28, 28), (10, 10), (1920, 1080), (4000, 3000), (333, 777), (56, 1000),
         (1003, 999), (224, 224), (100, 2000), (5000, 200)]


@pytest.mark.parametrize("version", ["Qwen2-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct"])
def test_qwen_images_match_the_processor(version):
    t = encoder_from_hf_config(CONFIGS / f"{version}.json").tiling
    processor = Qwen2VLImageProcessorPil()
    grids = processor(images=[Image.new("RGB", size) for size in SIZES], return_tensors="np")["image_grid_thw"]
    expected = [int(g[0] * g[1] * g[2]) // 4 for g in grids]          # 2 x 2 patches merge into a token
    width, height = np.array([s[0] for s in SIZES]), np.array([s[1] for s in SIZES])
    tiles, tokens = vision.single_images(width, height, t)
    assert tokens.tolist() == expected
    assert tiles.tolist() == expected                                 # one tile = one merged token
    assert vision.single_image(640, 480, t) == (391, 391)             # not LLaVA-OneVision's ~2.9k


def test_qwen_pixel_bounds_come_from_the_preprocessor_config(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "Qwen2-VL-7B-Instruct.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}))
    t = encoder_from_hf_config(tmp_path / "config.json").tiling
    grid = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)(
        images=[Image.new("RGB", (4000, 3000))], return_tensors="np")["image_grid_thw"][0]
    assert vision.single_image(4000, 3000, t)[1] == int(grid.prod()) // 4 > 1280


def _qwen_video_tokens(total: int, fps: float, width: int, height: int) -> int:
    """Qwen2VLVideoProcessor (it needs torchvision, absent here): its ``sample_frames`` with fps 2,
    min_frames 4, max_frames 768, temporal patch 2, then transformers' own ``smart_resize`` within
    the video pixel bounds (128 * 28 * 28 .. 768 * 28 * 28)."""
    cap = math.floor(min(768, total) / 2) * 2
    frames = min(max(total / fps * 2, 4), cap, total)
    frames = math.floor(frames / 2) * 2
    h, w = smart_resize(height, width, factor=28, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
    return frames // 2 * (h // 28) * (w // 28)


@pytest.mark.parametrize("total, fps", [(300, 30.0), (7200, 24.0), (50, 25.0)])
def test_qwen_videos_follow_the_processor(total, fps):
    t = encoder_from_hf_config(CONFIGS / "Qwen2-VL-7B-Instruct.json").tiling
    frames = vision.native_frames(np.array([0]), np.array([0.0]), np.array([total]), np.array([fps]), t)
    tokens = vision.videos(frames, t)[1][0]
    assert tokens == _qwen_video_tokens(total, fps, *vision.NOMINAL_VIDEO_FRAME)


def test_qwen_manifest_rows_use_the_native_rule():
    spec = encoder_from_hf_config(CONFIGS / "Qwen2-VL-7B-Instruct.json")
    columns = ShapeColumns()
    columns.add("one", 10, [(640, 480)], [])
    columns.add("two", 10, [(640, 480), (28, 28)], [])
    columns.add("clip", 10, [], [(0, 10.0, 0, 0.0)])               # 10 s: 20 frames, 10 temporal patches
    table = columns.table(spec.tiling, np.random.default_rng(0))
    # a 640 x 360 frame resizes to 644 x 364: 23 x 13 tokens a temporal patch
    assert table.image_tokens.tolist() == [391, 391 + 4, 10 * 23 * 13]


def test_window_attention_cost():
    """Qwen2.5-VL: 4 of 32 layers attend over the whole image, 28 within 8 x 8 patches; Qwen2-VL
    attends over the whole image in every layer."""
    q2 = encoder_from_hf_config(CONFIGS / "Qwen2-VL-7B-Instruct.json")
    q25 = encoder_from_hf_config(CONFIGS / "Qwen2.5-VL-7B-Instruct.json")
    tiles = 256.0                                                   # one 448 x 448 image: 1024 patches
    h = q25.hidden
    full, window = 4.0 * h * 1024 * 1024, 4.0 * h * 1024 * 64
    assert F.vit_layer_flops(q2, tiles, 1.0).attention == full
    assert F.vit_layer_flops(q25, tiles, 1.0).attention == (4 * full + 28 * window) / 32
    # two such images in a microbatch of two samples: twice one image, not one image of 2048 patches
    assert F.vit_layer_flops(q2, 2 * tiles, 2.0).attention == 2 * full


def test_profiles_name_their_rule_and_a_mismatch_is_refused(tmp_path):
    qwen = encoder_from_hf_config(CONFIGS / "Qwen2-VL-7B-Instruct.json")
    profile = profile_mix("llava-ov", 50, qwen, seed=0)
    assert profile.source["rule"] == "qwen2-vl"
    loaded = DataProfile.load(profile.save(tmp_path / "profile.json"))
    loaded.check_rule(qwen, "profile.json")
    with pytest.raises(DflopError, match=r"^profile.json: made under the qwen2-vl rule \(encoder .*\), but the "
                                         r"encoder siglip-so400m uses the llava-onevision rule"):
        loaded.check_rule(presets.encoder("siglip-so400m"), "profile.json")


def test_profile_data_says_its_rule(tmp_path):
    ran = dflop_here("profile", "data", "--preset", "llava-ov", "--samples", "20", "--encoder",
                     CONFIGS / "Qwen2.5-VL-7B-Instruct.json", "--out", tmp_path / "p.json")
    assert ran.returncode == 0, ran.stderr
    assert "  rule: qwen2-vl (encoder " in ran.stdout
    assert json.loads((tmp_path / "p.json").read_text())["source"]["rule"] == "qwen2-vl"
