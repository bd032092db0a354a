"""Model specs from the config.json files real checkpoints ship (trimmed to the keys that matter)."""

import json

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
    assert (llm.name, *shape(llm)) == ("internlm/internlm2_5-7b-chat", 32, 4096, 32, 8, 14336, 92553, False)
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
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "num_hidden_layers": 24},
        "vision_feature_layer": -2, "vocab_size": 32064})
    llm = llm_from_hf_config(path)
    assert (llm.name, *shape(llm), llm.max_position) == \
        ("lmsys/vicuna-7b-v1.5", 32, 4096, 32, 32, 11008, 32064, False, 4096)
    assert "transformers defaults for" in llm.source and "hidden_size" in llm.source
    with pytest.raises(SpecError, match=r"config.json: vision_config.model_type: 'clip_vision_model' is not a "
                                        r"SigLIP or InternViT vision config"):
        encoder_from_hf_config(path)


@pytest.mark.parametrize("top,bias", [
    ({"architectures": ["LlavaQwenForCausalLM"], "model_type": "llava_qwen"}, True),   # lmms-lab LLaVA-OV
    ({"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}, True),
    ({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}, True),
    ({"architectures": ["LlavaQwenForCausalLM"], "model_type": "llava"}, True),        # by architecture
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, False),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": False}, False),
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
    assert siglip.tiling == preset.tiling and siglip.layers == preset.layers


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
    ({"text_config": {**QWEN2_7B, "hidden_size": "x"}}, llm_from_hf_config,
     r"^[^ ]*config.json: text_config.hidden_size: expected an integer, got 'x'$"),
    ({"llm_config": {"model_type": "internlm2", "hidden_size": 8}}, llm_from_hf_config,
     r"^[^ ]*config.json: llm_config: missing key 'num_attention_heads'$"),
    ({**QWEN2_7B, "num_attention_heads": 5}, llm_from_hf_config,
     r"^[^ ]*config.json: heads: 5 does not divide hidden size 3584$"),
    ({**QWEN2_7B, "rope_theta": "big"}, llm_from_hf_config, r"config.json: rope_theta: expected a finite number"),
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
