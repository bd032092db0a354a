"""Model specs from the config.json files real checkpoints ship (trimmed to the keys that matter)."""

import json
from dataclasses import replace

import numpy as np
import pytest

from dflop.errors import SpecError
from dflop.specs import presets
from dflop.specs.hf_config import encoder_from_hf_config, llm_from_hf_config
from dflop.specs.run import load_run_config

QWEN2_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
            "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
            "max_position_embeddings": 32768}
INTERNVIT_300M = {"architectures": ["InternVisionModel"], "model_type": "intern_vit_6b", "hidden_size": 1024,
                  "image_size": 448, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                  "patch_size": 14, "qkv_bias": True, "qk_normalization": False, "norm_type": "layer_norm"}
SIGLIP_SO400M = {"hidden_size": 1152, "image_size": 384, "intermediate_size": 4304,
                 "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                 "patch_size": 14}
PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]


def config(tmp_path, data, folder="ckpt"):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def shape(spec):
    return (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.vocab, spec.qkv_bias)


def test_internvl_chat_config(tmp_path):
    path = config(tmp_path, {
        "architectures": ["InternVLChatModel"], "downsample_ratio": 0.5, "force_image_size": 448,
        "max_dynamic_patch": 12, "use_thumbnail": True, "select_layer": -1, "vision_config": INTERNVIT_300M,
        "llm_config": {"_name_or_path": "internlm/internlm2_5-7b-chat", "architectures": ["InternLM2ForCausalLM"],
                       "model_type": "internlm2", "hidden_size": 4096, "intermediate_size": 14336,
                       "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                       "vocab_size": 92553, "bias": False, "rope_theta": 1000000}})
    llm = llm_from_hf_config(path)
    assert (llm.name, *shape(llm)) == ("ckpt (InternLM2ForCausalLM)", 32, 4096, 32, 8, 14336, 92553, False)
    vit, preset = encoder_from_hf_config(path), presets.encoder("internvit-300m")
    assert (vit.family, vit.layers, vit.hidden, vit.heads, vit.mlp, vit.downsample) == \
        ("internvit", 24, 1024, 16, 4096, 0.5)
    assert vit.tiling == preset.tiling              # 256 tokens a tile, 12 tiles, InternVL's video rule


def test_stub_text_config_of_llava_15(tmp_path):
    """llava-hf/llava-1.5-7b-hf: text_config lists five keys; the rest are LlamaConfig defaults."""
    path = config(tmp_path, {
        "_name_or_path": "llava-hf/llava-1.5-7b-hf", "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava", "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures":
                                               ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                                               "model_type": "llama", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vocab_size": 32064})
    llm = llm_from_hf_config(path)
    assert (llm.name, *shape(llm), llm.max_position) == \
        ("ckpt (LlamaForCausalLM)", 32, 4096, 32, 32, 11008, 32064, False, 4096)
    assert "transformers defaults for" in llm.source and "hidden_size" in llm.source
    clip = encoder_from_hf_config(path)  # CLIP ViT-L/14-336, LLaVA-1.5's one 336-pixel tile an image
    assert (clip.family, clip.layers, clip.rule, clip.tiling.tile_tokens) == ("clip", 23, "llava-1.5", 576)


@pytest.mark.parametrize("top,bias", [
    ({"architectures": ["LlavaQwenForCausalLM"], "model_type": "llava_qwen"}, True),   # lmms-lab LLaVA-OV
    ({"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}, True),
    ({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}, True),
    ({"architectures": ["LlavaQwenForCausalLM"], "model_type": "llava"}, True),        # by architecture
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, False),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": False}, True),  # ignored
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, False),
])
def test_qkv_bias_from_the_architecture(tmp_path, top, bias):
    spec = llm_from_hf_config(config(tmp_path, {**top, **QWEN2_7B}, folder="llava-onevision-qwen2-7b-ov"))
    assert spec.qkv_bias is bias
    assert spec.name == "llava-onevision-qwen2-7b-ov"                # no _name_or_path: the folder


def test_llava_onevision_hf_config_gives_the_presets(tmp_path):
    path = config(tmp_path, {
        "architectures": ["LlavaOnevisionForConditionalGeneration"], "model_type": "llava_onevision",
        "image_grid_pinpoints": PINPOINTS, "vision_aspect_ratio": "anyres_max_9", "vision_feature_layer": -1,
        "text_config": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **QWEN2_7B},
        "vision_config": {**SIGLIP_SO400M, "num_hidden_layers": 26, "vision_use_head": False}})
    llm, qwen = llm_from_hf_config(path), presets.llm("qwen2.5-7b")
    assert shape(llm) == shape(qwen)
    siglip, preset = encoder_from_hf_config(path), presets.encoder("siglip-so400m")
    assert (siglip.layers, siglip.hidden, siglip.heads, siglip.mlp, siglip.patches_per_tile) == \
        (26, 1152, 16, 4304, 729)
    # transformers' LLaVA-OneVision closes a video with one newline; the preset (the training recipe)
    # one per pooled row of every frame
    assert siglip.tiling == replace(preset.tiling, video_newline="one_token") and siglip.layers == preset.layers


def test_vision_only_configs(tmp_path):
    # google/siglip-so400m-patch14-384 (vision_config of a SiglipModel): LLaVA-OV runs 26 of its 27 layers.
    siglip = encoder_from_hf_config(config(tmp_path, {"architectures": ["SiglipModel"], "model_type": "siglip",
                                                      "text_config": {}, "vision_config": SIGLIP_SO400M}))
    assert (siglip.layers, siglip.tiling) == (26, presets.encoder("siglip-so400m").tiling)
    # A smaller SigLIP: 224 px / 16 = 14 x 14 = 196 tokens a tile, frames pooled to 7 x 7.
    small = encoder_from_hf_config(config(tmp_path, {**SIGLIP_SO400M, "image_size": 224, "patch_size": 16,
                                                     "num_hidden_layers": 12}, folder="siglip-base"))
    assert (small.name, small.layers, small.tiling.tile_tokens, small.tiling.multi_image_tokens,
            small.tiling.frame_tokens, small.tiling.tile_size) == ("siglip-base", 11, 196, 197, 49, 224)
    big = encoder_from_hf_config(config(tmp_path, {
        **INTERNVIT_300M, "hidden_size": 3200, "intermediate_size": 12800, "num_attention_heads": 25,
        "num_hidden_layers": 45, "qkv_bias": False, "qk_normalization": True, "norm_type": "rms_norm"}))
    ref = presets.encoder("internvit-6b")
    assert (big.layers, big.hidden, big.heads, big.mlp, big.norm, big.qk_norm, big.qkv_bias, big.tiling) == \
        (ref.layers, ref.hidden, ref.heads, ref.mlp, ref.norm, ref.qk_norm, ref.qkv_bias, ref.tiling)


@pytest.mark.parametrize("data,read,message", [
    ({"text_config": {**QWEN2_7B, "model_type": "qwen2", "hidden_size": "x"}}, llm_from_hf_config,
     r"^[^ ]*config.json: text_config.hidden_size: expected an integer, got 'x'$"),
    ({"llm_config": {"model_type": "internlm2", "hidden_size": 8}}, llm_from_hf_config,
     r"^[^ ]*config.json: llm_config: missing key 'num_attention_heads'$"),
    ({**QWEN2_7B, "model_type": "qwen2", "num_attention_heads": 5}, llm_from_hf_config,
     r"^[^ ]*config.json: heads: 5 does not divide hidden size 3584$"),
    ({**QWEN2_7B, "model_type": "qwen2", "rope_theta": "big"}, llm_from_hf_config,
     r"config.json: rope_theta: expected a finite number"),
    ({"mm_vision_tower": "google/siglip-so400m-patch14-384", **QWEN2_7B}, encoder_from_hf_config,
     r"config.json: no vision_config: the vision tower 'google/siglip-so400m-patch14-384' is named"),
    ({"vision_config": {**SIGLIP_SO400M, "num_hidden_layers": 2}, "vision_feature_layer": -5},
     encoder_from_hf_config, r"config.json: vision_feature_layer: layer -5 is outside the encoder's 2 layers"),
    ([1, 2], llm_from_hf_config, r"config.json: expected a JSON object"),
])
def test_errors_name_file_and_key_once(tmp_path, data, read, message):
    path = config(tmp_path, data)
    with pytest.raises(SpecError, match=message) as info:
        read(path)
    assert str(info.value).count(str(path)) == 1


def test_run_config_paths_resolve_against_its_folder(tmp_path, monkeypatch):
    config(tmp_path, {"vision_config": SIGLIP_SO400M}, folder="models/vit")
    config(tmp_path, {"model_type": "qwen2", **QWEN2_7B}, folder="models/llm")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/run.yaml").write_text(
        "encoder: ../models/vit/config.json\nllm: ../models/llm/config.json\n"
        "cluster: {hardware: h100, nodes: 1, gpus_per_node: 8}\ntraining: {global_batch: 8}\n"
        "data: {dataset: ../data/m.json}\nprofiles: [../profiles]\n")
    monkeypatch.chdir(tmp_path / "models")      # anywhere but the config's folder
    run = load_run_config(tmp_path / "runs/run.yaml")
    assert (run.encoder.family, run.encoder.layers, run.llm.layers) == ("siglip", 26, 28)
    assert run.data.dataset == str(tmp_path / "runs/../data/m.json")
    assert run.profiles == (str(tmp_path / "runs/../profiles"),)


def test_names_come_from_the_folder_never_from_a_stale_name_or_path(tmp_path):
    """InternVL3-1B's llm_config names Qwen2.5-32B-Instruct and its vision_config InternViT-6B:
    the hub paths it was made from, not what it is."""
    qwen = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "_name_or_path": "Qwen/Qwen2.5-32B-Instruct",
            **QWEN2_7B, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "num_hidden_layers": 24}
    path = config(tmp_path, {"_name_or_path": "/root/.cache/abc123", "architectures": ["InternVLChatModel"],
                             "llm_config": qwen, "force_image_size": 448,
                             "vision_config": {**INTERNVIT_300M, "_name_or_path": "OpenGVLab/InternViT-6B-448px-V1-5"}},
                  folder="InternVL3-1B")
    assert llm_from_hf_config(path).name == "InternVL3-1B (Qwen2ForCausalLM)"
    assert encoder_from_hf_config(path).name == "InternVL3-1B (InternVisionModel)"
    top = {"model_type": "qwen2", "_name_or_path": "/tmp/tmpk2j3h4", **QWEN2_7B}
    assert llm_from_hf_config(config(tmp_path, top, folder="Qwen2.5-7B-Instruct")).name == "Qwen2.5-7B-Instruct"
    cached = config(tmp_path, top, folder="hub/models--Qwen--Qwen2.5-7B-Instruct/snapshots/a09a3545")
    assert llm_from_hf_config(cached).name == "Qwen2.5-7B-Instruct"          # a cache snapshot: the model's name


@pytest.mark.parametrize("position,per_frame,once", [
    ("grid", 196 + 14, 0), ("frame", 196 + 1, 0), ("one_token", 196, 1), ("no_token", 196, 0), (None, 196, 1),
])
def test_mm_newline_position_sets_the_video_tokens(tmp_path, position, per_frame, once):
    """LLaVA-NeXT's llava_arch.py: 27 x 27 SigLIP features pooled to 14 x 14 a frame, then a newline
    after every pooled row (grid), after every frame, once after the whole video, or none; no key in
    transformers' LLaVA-OneVision config: once, as transformers computes it."""
    from dflop.workload.vision import videos

    data = {"architectures": ["LlavaOnevisionForConditionalGeneration"], "model_type": "llava_onevision",
            "vision_config": SIGLIP_SO400M, **({"mm_newline_position": position} if position else {})}
    tiling = encoder_from_hf_config(config(tmp_path, data)).tiling
    frames, tokens = videos(np.array([8, 32]), tiling)
    assert frames.tolist() == [8, 32] and tokens.tolist() == [8 * per_frame + once, 32 * per_frame + once]


def test_unknown_mm_newline_position_is_refused(tmp_path):
    path = config(tmp_path, {"vision_config": SIGLIP_SO400M, "mm_newline_position": "row"})
    with pytest.raises(SpecError, match=r"config.json: mm_newline_position: expected one of grid, frame, one_token, "
                                        r"no_token, got 'row'$"):
        encoder_from_hf_config(path)
