"""Model specs from the Hugging Face ``config.json`` files that checkpoints ship (no download).

The LLM part of a VLM config lives in different places: ``llm_config``
(InternVL), ``text_config`` (LLaVA, LLaVA-OneVision, Qwen2-VL in recent
transformers), or the top level (LLaVA-NeXT's ``llava_qwen``, Qwen2-VL). Some
``text_config`` sections are stubs that list only what differs from the
transformers defaults of their ``model_type`` (llava-hf/llava-1.5-7b-hf gives
five keys); the missing keys come from the top level, then from those defaults
(``hf_config_defaults`` in ``models.yaml``).

The vision part is ``vision_config`` or the whole file (a vision-only config).
The encoder spec counts the layers the VLM runs: ``vision_feature_layer``
(LLaVA), ``mm_vision_select_layer`` (LLaVA-NeXT) or ``select_layer``
(InternVL) of -2 drops the last layer. Without one, SigLIP follows
LLaVA-OneVision (-2: 26 of 27 layers) and InternViT follows InternVL (-1).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from dflop.errors import SpecError
from dflop.specs import presets
from dflop.specs.loading import load_json
from dflop.specs.models import EncoderSpec, LLMSpec

QKV_BIAS_MODEL_TYPES = frozenset({"qwen", "qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "llava_qwen"})
"""The Qwen2 family adds biases to q, k and v (Qwen3 and Llama do not)."""
QKV_BIAS_ARCHITECTURE = re.compile(r"^(LlavaQwen|Qwen2(_5)?(VL|_VL|Moe)?)(For|Model)")
SIGLIP_TYPES = frozenset({"siglip_vision_model", "siglip"})
INTERNVIT_TYPES = frozenset({"intern_vit_6b", "internvit"})
FEATURE_LAYER_KEYS = ("vision_feature_layer", "mm_vision_select_layer", "select_layer")


class _Section:
    """Keys of one part of a config, with errors of the form ``file: key: problem``."""

    def __init__(self, path: Path, data: dict, label: str) -> None:
        self.path, self.data, self.label = path, data, label

    def where(self, key: str | None = None) -> str:
        parts = [p for p in (self.label, key) if p]
        return f"{self.path}: {'.'.join(parts)}" if parts else str(self.path)

    def get(self, key: str, default: Any = SpecError) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is SpecError:
                raise SpecError(f"{self.where()}: missing key '{key}'")
            return default
        return value

    def integer(self, key: str, default: Any = SpecError) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.where(key)}: expected an integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = SpecError) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(f"{self.where(key)}: expected a finite number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self.where(key)}: expected true or false, got {value!r}")
        return value


def _load(path: str | Path) -> tuple[Path, dict]:
    data = load_json(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return Path(path), data


def _name(path: Path, *sections: dict) -> str:
    """``_name_or_path`` (its last part when it is a local path), else the checkpoint's folder."""
    for data in sections:
        value = data.get("_name_or_path")
        if isinstance(value, str) and value.strip("/"):
            return Path(value.rstrip("/")).name if value.startswith(("/", ".")) else value
    return path.resolve().parent.name or path.stem


def _build(cls: type, section: _Section, **fields: Any) -> Any:
    try:
        return cls(**fields)
    except SpecError as exc:
        raise SpecError(f"{section.where()}: {exc}") from None


def _llm_section(path: Path, data: dict) -> tuple[_Section, list[str]]:
    """The LLM keys and the names of the keys filled in from transformers' defaults."""
    for key in ("llm_config", "text_config"):
        part = data.get(key)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise SpecError(f"{path}: {key}: expected an object, got {type(part).__name__}")
        top = {k: v for k, v in data.items() if k not in ("llm_config", "text_config", "vision_config")}
        merged = {**top, **part}
        defaults = presets.hf_config_defaults().get(str(part.get("model_type", "")), {})
        filled = [k for k in defaults if merged.get(k) is None]
        return _Section(path, {**defaults, **merged}, key), filled
    return _Section(path, data, ""), []


def _qkv_bias(s: _Section) -> bool:
    for key in ("attention_bias", "bias"):  # Llama/Qwen3 name it attention_bias, InternLM2 bias
        if key in s.data:
            return s.flag(key, False)
    archs = s.data.get("architectures") or []
    return (str(s.data.get("model_type", "")) in QKV_BIAS_MODEL_TYPES
            or any(isinstance(a, str) and QKV_BIAS_ARCHITECTURE.match(a) for a in archs))


def llm_from_hf_config(path: str | Path, name: str | None = None) -> LLMSpec:
    """Read an LLM spec from a Hugging Face ``config.json`` (an LLM's or a VLM's)."""
    path, data = _load(path)
    s, filled = _llm_section(path, data)
    heads = s.integer("num_attention_heads")
    note = f" ({s.label}; transformers defaults for {', '.join(filled)})" if filled else ""
    return _build(
        LLMSpec, s,
        name=name or _name(path, s.data if s.label else {}, data),
        layers=s.integer("num_hidden_layers"), hidden=s.integer("hidden_size"), heads=heads,
        kv_heads=s.integer("num_key_value_heads", heads), ffn=s.integer("intermediate_size"),
        vocab=s.integer("vocab_size"), tie_embeddings=s.flag("tie_word_embeddings", False),
        qkv_bias=_qkv_bias(s), rope_theta=s.number("rope_theta", 1.0e4),
        max_position=s.integer("max_position_embeddings", 32768), source=f"{path}{note}",
    )


def _vision_section(path: Path, data: dict) -> tuple[_Section, str]:
    part = data.get("vision_config")
    s = _Section(path, part, "vision_config") if isinstance(part, dict) else _Section(path, data, "")
    model_type = str(s.data.get("model_type", ""))
    archs = [a for a in s.data.get("architectures") or [] if isinstance(a, str)]
    if model_type in SIGLIP_TYPES:
        return s, "siglip"
    if model_type in INTERNVIT_TYPES or "InternVisionModel" in archs:
        return s, "internvit"
    if not isinstance(part, dict) and isinstance(data.get("mm_vision_tower"), str):
        raise SpecError(f"{path}: no vision_config: the vision tower '{data['mm_vision_tower']}' is named, not "
                        "described; give its own config.json or an encoder preset")
    raise SpecError(f"{s.where('model_type')}: {model_type or 'missing'!r} is not a SigLIP or InternViT "
                    f"vision config (known: {', '.join(sorted(SIGLIP_TYPES | INTERNVIT_TYPES))})")


def _layers_run(s: _Section, top: _Section, family: str) -> int:
    """Layers whose output the VLM uses (hidden_states index, as transformers counts it)."""
    total = s.integer("num_hidden_layers")
    key = next((k for k in FEATURE_LAYER_KEYS if top.data.get(k) is not None), None)
    layer = top.integer(key) if key else (-2 if family == "siglip" else -1)
    run = total + 1 + layer if layer < 0 else layer
    if not 1 <= run <= total:
        raise SpecError(f"{top.where(key)}: layer {layer} is outside the encoder's {total} layers")
    return run


def _replace(tiling: Any, where: str, **fields: Any) -> Any:
    try:
        return dataclasses.replace(tiling, **fields)
    except SpecError as exc:
        raise SpecError(f"{where}: tiling: {exc}") from None


def _siglip_tiling(top: _Section, image_size: int, patch: int) -> Any:
    side = image_size // patch
    fields: dict[str, Any] = {"tile_size": image_size, "tile_tokens": side * side,
                              "multi_image_tokens": side * side + 1, "frame_tokens": math.ceil(side / 2) ** 2}
    for key in ("vision_aspect_ratio", "image_aspect_ratio"):
        match = re.fullmatch(r"anyres_max_(\d+)", str(top.data.get(key, "")))
        if match:
            fields["anyres_max"] = int(match.group(1))
    pins = top.data.get("image_grid_pinpoints")
    if isinstance(pins, list) and pins and all(isinstance(p, list) and len(p) == 2 for p in pins):
        fields["max_grid"] = max(1, max(max(p) for p in pins) // image_size)
    return _replace(presets.encoder("siglip-so400m").tiling, top.where(), **fields)


def _internvit_tiling(top: _Section, image_size: int, patch: int, downsample: float) -> Any:
    tokens = round((image_size // patch) ** 2 * downsample * downsample)
    tiling = presets.encoder("internvit-300m").tiling
    return _replace(tiling, top.where(), tile_size=image_size, tile_tokens=tokens, multi_image_tokens=tokens,
                               frame_tokens=tokens, max_tiles=top.integer("max_dynamic_patch", tiling.max_tiles),
                               thumbnail=top.flag("use_thumbnail", tiling.thumbnail))


def encoder_from_hf_config(path: str | Path, name: str | None = None) -> EncoderSpec:
    """Read a SigLIP or InternViT encoder spec from a vision config or a VLM's ``vision_config``.

    Tiling follows the VLM that pairs the family with an LLM (LLaVA-OneVision's anyres for
    SigLIP, InternVL's dynamic tiling for InternViT), sized by the config's image and patch size
    and by the VLM keys when present (``anyres_max_N``, ``image_grid_pinpoints``,
    ``max_dynamic_patch``, ``use_thumbnail``, ``downsample_ratio``).
    """
    path, data = _load(path)
    s, family = _vision_section(path, data)
    top = _Section(path, data, "")
    image_size = top.integer("force_image_size", 0) or s.integer("image_size")
    patch = s.integer("patch_size")
    fields: dict[str, Any] = dict(
        name=name or _name(path, s.data if s.label else {}, data), family=family,
        layers=_layers_run(s, top, family), hidden=s.integer("hidden_size"),
        heads=s.integer("num_attention_heads"), mlp=s.integer("intermediate_size"),
        image_size=image_size, patch_size=patch, source=str(path))
    if family == "siglip":
        fields.update(norm="layernorm", qkv_bias=True, tiling=_siglip_tiling(top, image_size, patch))
    else:
        downsample = top.number("downsample_ratio", 0.5)
        fields.update(norm="rmsnorm" if s.get("norm_type", "layer_norm") == "rms_norm" else "layernorm",
                      qk_norm=s.flag("qk_normalization", False), qkv_bias=s.flag("qkv_bias", True),
                      downsample=downsample, tiling=_internvit_tiling(top, image_size, patch, downsample))
    return _build(EncoderSpec, s, **fields)
