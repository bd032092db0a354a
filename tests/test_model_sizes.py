"""LLM sizes from real config.json files, counted to the parameter against transformers.

``tests/data/hf_configs/llm`` holds the released ``config.json`` of each model (every key as
published). transformers builds each on the meta device (no memory, no weights) and its
parameter count, tied weights counted once, must equal dflop's exactly: a wrong head size
(Gemma, Qwen3: head_dim is not hidden / heads), a wrong tie default (Gemma's config leaves
``tie_word_embeddings`` out and ties), a missing norm (Gemma-2's four a layer, Qwen3's per-head
q/k norms) or bias (Qwen2's q/k/v) each shows up as a difference.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch

from dflop.cost import flops as F
from dflop.errors import SpecError
from dflop.models.llm import DecoderLLM, pack
from dflop.specs.hf_config import llm_from_hf_config
from dflop.specs.models import LLMSpec

CONFIGS = Path(__file__).parent / "data" / "hf_configs" / "llm"
TRANSFORMERS = sorted(p.stem for p in CONFIGS.glob("*.json") if json.loads(p.read_text())["model_type"] != "internlm2")


def transformers_model(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads((CONFIGS / f"{name}.json").read_text())))


def test_the_table_holds_the_families():
    assert len(TRANSFORMERS) + 1 == len(list(CONFIGS.glob("*.json"))) >= 17
    families = {json.loads(p.read_text())["model_type"] for p in CONFIGS.glob("*.json")}
    assert families == {"llama", "mistral", "internlm2", "qwen2", "qwen3", "gemma", "gemma2"}


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_parameters_equal_transformers(name):
    model = transformers_model(name)
    spec = llm_from_hf_config(CONFIGS / f"{name}.json")
    assert F.llm_params(spec) == sum(p.numel() for p in model.parameters())   # parameters() counts a tie once
    # One layer's matmul weights are what a token multiplies through: 2 FLOPs each (q/o heads x head_dim).
    layer = model.model.layers[0]
    matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert F.llm_layer_flops(spec, 1, 0).gemm == 2 * matmul
    assert F.llm_layer_params(spec) == sum(p.numel() for p in layer.parameters())


def test_internlm2_by_hand():
    """transformers has no InternLM2 class (remote code): InternLM2's modeling_internlm2.py builds
    tok_embeddings (vocab x h), per layer wqkv (h x (heads + 2 kv_heads) x head_dim), wo (h x h),
    w1 and w3 (h x ffn), w2 (ffn x h), attention_norm and ffn_norm (h each), no bias when ``bias``
    is false, then norm (h) and an untied output (vocab x h); head_dim = h / heads = 128."""
    h, layers, heads, kv, ffn, vocab = 4096, 32, 32, 8, 14336, 92544
    per_layer = h * (heads + 2 * kv) * 128 + h * h + 3 * h * ffn + 2 * h
    spec = llm_from_hf_config(CONFIGS / "internlm2_5-7b.json")
    assert F.llm_params(spec) == 2 * vocab * h + layers * per_layer + h == 7_737_708_544


def test_internlm2_bias_puts_a_bias_on_qkv_and_o(tmp_path):
    data = json.loads((CONFIGS / "internlm2_5-7b.json").read_text())
    plain = F.llm_params(llm_from_hf_config(CONFIGS / "internlm2_5-7b.json"))
    data.pop("bias")                       # InternLM2Config's default is bias=True
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert F.llm_params(llm_from_hf_config(path)) - plain == 32 * ((32 + 2 * 8) * 128 + 4096)


@pytest.mark.parametrize("name,billions,digits", [
    ("gemma-2b", 2.51, 2), ("gemma-2-9b", 9.24, 2), ("gemma-2-27b", 27.2, 1), ("Qwen3-0.6B", 0.596, 3),
    ("gemma-7b", 8.54, 2), ("gemma-2-2b", 2.61, 2), ("Qwen2.5-7B", 7.62, 2), ("Llama-3.1-8B", 8.03, 2),
])
def test_published_sizes(name, billions, digits):
    """The sizes the model cards give (Gemma-2B 2.51B, not the 3.03B of an untied head and h / heads)."""
    assert round(F.llm_params(llm_from_hf_config(CONFIGS / f"{name}.json")) / 1e9, digits) == billions


@pytest.mark.parametrize("name,head_dim,q_dim,tied,norms", [
    ("gemma-2b", 256, 2048, True, 2), ("gemma-7b", 256, 4096, True, 2), ("gemma-2-27b", 128, 4096, True, 4),
    ("Qwen3-0.6B", 128, 2048, True, 2), ("Qwen3-8B", 128, 4096, False, 2), ("Llama-3.2-3B", 128, 3072, True, 2),
])
def test_attention_width_drives_flops_and_activations(name, head_dim, q_dim, tied, norms):
    spec = llm_from_hf_config(CONFIGS / f"{name}.json")
    assert (spec.head_dim, spec.q_dim, spec.tie_embeddings, spec.layer_norms) == (head_dim, q_dim, tied, norms)
    assert F.llm_layer_flops(spec, 1, 1000.0).attention == 2.0 * q_dim * 1000.0      # QK^T and AV, causal half
    h = spec.hidden
    assert F.llm_layer_activation_elements(spec, 1) == 2 * norms * h + 2 * q_dim + 2 * spec.kv_dim + 3 * spec.ffn


def write(tmp_path, data):
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


QWEN3 = json.loads((CONFIGS / "Qwen3-8B.json").read_text())


@pytest.mark.parametrize("change,key", [
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 8}, "model_type"),
    ({"model_type": "qwen3_moe"}, "model_type"),
    ({"model_type": "phi3"}, "model_type"),
    ({"model_type": None}, "model_type"),
    ({"num_experts": 128, "moe_intermediate_size": 768}, "num_experts"),
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
])
def test_what_cannot_be_counted_exactly_is_refused(tmp_path, change, key):
    path = write(tmp_path, {**QWEN3, **change})
    with pytest.raises(SpecError, match=rf"^{path}: {key}: ") as info:
        llm_from_hf_config(path)
    assert "\n" not in str(info.value)


def test_sliding_window_and_window_layers_are_read(tmp_path):
    gemma2 = llm_from_hf_config(CONFIGS / "gemma-2-9b.json")           # sliding_window 4096 on alternate layers
    assert gemma2.layers == 42
    qwen = {**json.loads((CONFIGS / "Qwen2-7B.json").read_text()), "use_sliding_window": True}
    assert llm_from_hf_config(write(tmp_path, qwen)).layers == 28


@pytest.mark.parametrize("spec", [
    LLMSpec(name="gemma2-like", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, head_dim=32,
            tie_embeddings=True, layer_norms=4),
    LLMSpec(name="qwen3-like", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, head_dim=8,
            qk_norm=True),
    LLMSpec(name="biased", layers=2, hidden=64, heads=4, kv_heads=1, ffn=96, vocab=128, qkv_bias=True, o_bias=True),
])
def test_the_torch_model_has_the_counted_weights(spec):
    """The model the profiler and the torch backend run has exactly the weights the cost model counts."""
    model = DecoderLLM(spec)
    assert sum(p.numel() for p in model.parameters()) == F.llm_params(spec)
    tokens = torch.randint(0, spec.vocab, (7,))
    positions, cu = pack([3, 4])
    assert model(tokens, positions, cu).shape == (7, spec.vocab)


@pytest.mark.parametrize("preset,name", [("qwen2.5-7b", "Qwen2.5-7B"), ("qwen2.5-32b", "Qwen2.5-32B"),
                                         ("llama-3-8b", "Llama-3.1-8B")])
def test_presets_agree_with_the_released_configs(preset, name):
    """Llama-3-8B and Llama-3.1-8B differ in RoPE scaling and context only, not in weights."""
    from dflop.cost.store import ARCHITECTURE
    from dflop.specs import presets

    ours, real = presets.llm(preset), llm_from_hf_config(CONFIGS / f"{name}.json")
    fields = ARCHITECTURE["llm"] + ("tie_embeddings", "layers")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(real, f) for f in fields}
    assert F.llm_params(ours) == F.llm_params(real)
