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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflop.errors import SpecError
from dflop.specs import presets
from dflop.specs.loading import load_json
from dflop.specs.models import EncoderSpec, LLMSpec



@dataclass(frozen=True)
class _Family:
    """How transformers' model class of one LLM family reads a config: the keys it honours and its
    config class's defaults for keys a config.json leaves out."""

    bias_key: str | None = "attention_bias"
    """Key that puts a bias on q, k, v and o (None: the family's fixed ``qkv_bias``, never on o)."""
    bias_default: bool = False
    qkv_bias: bool = False
    head_dim: int | None = None
    """head_dim without the key (None: hidden / heads)."""
    reads_head_dim: bool = True
    tied: bool = False
    """tie_word_embeddings without the key."""
    qk_norm: bool = False
    layer_norms: int = 2


QWEN2 = _Family(bias_key=None, qkv_bias=True)  # q, k, v biases whatever attention_bias says
LLM_FAMILIES = {
    "llama": _Family(), "mistral": _Family(bias_key=None),
    "qwen2": QWEN2, "llava_qwen": QWEN2, "qwen2_vl": QWEN2, "qwen2_5_vl": QWEN2,
    "qwen2_vl_text": QWEN2, "qwen2_5_vl_text": QWEN2,
    "qwen3": _Family(head_dim=128, qk_norm=True),
    "gemma": _Family(head_dim=256, tied=True), "gemma2": _Family(head_dim=256, tied=True, layer_norms=4),
    # remote code (InternLM2's modeling_internlm2.py): wqkv and wo biased by `bias` (default true),
    # head size always hidden / heads
    "internlm2": _Family(bias_key="bias", bias_default=True, reads_head_dim=False),
}
"""The LLM families dflop counts to the parameter, by ``model_type``."""
LLAVA_ARCHITECTURES = ((re.compile(r"^LlavaQwen"), "qwen2"), (re.compile(r"^LlavaLlama"), "llama"),
                       (re.compile(r"^LlavaMistral"), "mistral"))
"""LLaVA-NeXT checkpoints (model_type ``llava``) name their LLM family in the architecture only."""
UNCOUNTED_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
                  "num_experts_per_tok", "mlp_bias")
"""Keys that, when set, add weights the dense layout does not have (mixture of experts, MLP biases)."""
SIGLIP_TYPES = frozenset({"siglip_vision_model", "siglip"})
INTERNVIT_TYPES = frozenset({"intern_vit_6b", "internvit", "internvl_vision"})
"""InternVL's own InternViT configs, and transformers' (``InternVLVisionConfig``, in ``model_type`` internvl)."""
CLIP_TYPES = frozenset({"clip_vision_model", "clip"})
QWEN_VL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen2_vl_vision", "qwen2_5_vl_vision"})
VISION_DEFAULTS = {
    "siglip": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "image_size": 224, "patch_size": 16},
    "clip": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "image_size": 224, "patch_size": 32},
    "qwen2_vl": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "patch_size": 14,
                 "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2_5_vl": {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
                   "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                   "fullatt_block_indexes": [7, 15, 23, 31]},
}
"""transformers' vision config classes' defaults (SiglipVisionConfig, CLIPVisionConfig, Qwen2VLVisionConfig,
Qwen2_5_VLVisionConfig), which the model classes use for keys a config leaves out (PaliGemma's SigLIP
gives no image_size: 224). InternViT's class is remote code: its keys are required."""
LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
"""LLaVA-NeXT's (1.6) ``image_grid_pinpoints``, when a CLIP config does not list its own."""
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


def _folder(path: Path) -> str:
    """The checkpoint's folder; in a Hugging Face cache (``models--Org--Name/snapshots/<hash>``) the Name."""
    parent = path.resolve().parent
    if parent.parent.name == "snapshots" and parent.parent.parent.name.startswith("models--"):
        return parent.parent.parent.name.split("--")[-1]
    return parent.name or path.stem


def _name(path: Path, section: dict, *_: dict) -> str:
    """The checkpoint's folder, and for a section of a VLM's config (``section`` non-empty) its
    architecture or model_type: ``InternVL3-1B (Qwen2ForCausalLM)``. Never ``_name_or_path``: it
    names what the checkpoint was made from (a cache hash, another model's hub path)."""
    archs = [a for a in section.get("architectures") or [] if isinstance(a, str)]
    part = archs[0] if archs else section.get("model_type") if isinstance(section.get("model_type"), str) else ""
    return f"{_folder(path)} ({part})" if part else _folder(path)


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


def _family(s: _Section) -> _Family:
    """The family whose layout the section describes; anything else is refused, not guessed."""
    model_type = s.data.get("model_type")
    if isinstance(model_type, str) and model_type in LLM_FAMILIES:
        family = LLM_FAMILIES[model_type]
    else:
        archs = [a for a in s.data.get("architectures") or [] if isinstance(a, str)]
        known = [f for pattern, f in LLAVA_ARCHITECTURES for a in archs if pattern.match(a)]
        if not known:
            what = repr(model_type) if model_type else "missing"
            raise SpecError(f"{s.where('model_type')}: {what}: not an LLM family dflop counts exactly "
                            f"(known: {', '.join(LLM_FAMILIES)})")
        family = LLM_FAMILIES[known[0]]
    for key in UNCOUNTED_KEYS:
        if s.data.get(key) not in (None, False, 0):
            raise SpecError(f"{s.where(key)}: {s.data[key]!r}: dflop counts dense layers without MLP biases only "
                            "and cannot size this model exactly")
    return family


def llm_from_hf_config(path: str | Path, name: str | None = None) -> LLMSpec:
    """Read an LLM spec from a Hugging Face ``config.json`` (an LLM's or a VLM's), as the family's
    transformers model class reads it: ``head_dim``, biases, tied embeddings and norms by the
    family's defaults where the file is silent. Sliding-window keys are read as no change: the
    attention cost counts every sample's full causal square (an upper bound for windowed layers)."""
    path, data = _load(path)
    s, filled = _llm_section(path, data)
    family = _family(s)
    heads = s.integer("num_attention_heads")
    head_dim = s.integer("head_dim") if family.reads_head_dim and s.data.get("head_dim") is not None \
        else family.head_dim
    bias = s.flag(family.bias_key, family.bias_default) if family.bias_key else False
    note = f" ({s.label}; transformers defaults for {', '.join(filled)})" if filled else ""
    return _build(
        LLMSpec, s,
        name=name or _name(path, s.data if s.label else {}, data),
        layers=s.integer("num_hidden_layers"), hidden=s.integer("hidden_size"), heads=heads,
        kv_heads=s.integer("num_key_value_heads", heads), ffn=s.integer("intermediate_size"),
        vocab=s.integer("vocab_size"), head_dim=head_dim,
        tie_embeddings=_tied(s, data, family), qkv_bias=bias or family.qkv_bias, o_bias=bias,
        qk_norm=family.qk_norm, layer_norms=family.layer_norms, rope_theta=_rope_theta(s),
        norm_eps=s.number("rms_norm_eps", 1e-6),
        max_position=s.integer("max_position_embeddings", 32768), source=f"{path}{note}",
    )


VLM_TIED = {"internvl": True, "llava_onevision": False}
"""A VLM whose own config's ``tie_word_embeddings`` ties its head (transformers reads the top-level
key, with this default): InternVL alone; LLaVA-OneVision ties when either its or its text config's
key says so."""


def _tied(s: _Section, data: dict, family: _Family) -> bool:
    text = s.flag("tie_word_embeddings", family.tied)
    top_type = data.get("model_type")
    if top_type not in VLM_TIED or not s.label:
        return text
    top = _Section(s.path, data, "").flag("tie_word_embeddings", VLM_TIED[top_type])
    return top if top_type == "internvl" else top or text


def _rope_theta(s: _Section) -> float:
    """``rope_theta``, or where transformers 5 writes it, ``rope_parameters.rope_theta``."""
    rope = s.data.get("rope_parameters")
    if s.data.get("rope_theta") is None and isinstance(rope, dict):
        return _Section(s.path, rope, ".".join(p for p in (s.label, "rope_parameters") if p)).number("rope_theta")
    return s.number("rope_theta", 1.0e4)


def _vision_section(path: Path, data: dict) -> tuple[_Section, str]:
    part = data.get("vision_config")
    s = _Section(path, part, "vision_config") if isinstance(part, dict) else _Section(path, data, "")
    model_type = str(s.data.get("model_type", ""))
    archs = [a for a in s.data.get("architectures") or [] if isinstance(a, str)]
    top_type = str(data.get("model_type", ""))
    if model_type in SIGLIP_TYPES:
        return _defaults(s, "siglip"), "siglip"
    if model_type in INTERNVIT_TYPES or "InternVisionModel" in archs:
        return s, "internvit"
    if model_type in CLIP_TYPES or (not model_type and top_type == "clip" and s.label):
        return _defaults(s, "clip"), "clip"
    if model_type in QWEN_VL_TYPES or (s.label and top_type in QWEN_VL_TYPES):
        version = "qwen2_5_vl" if "2_5" in (model_type or top_type) else "qwen2_vl"
        return _defaults(s, version), "qwen2_vl"
    if not isinstance(part, dict) and isinstance(data.get("mm_vision_tower"), str):
        raise SpecError(f"{path}: no vision_config: the vision tower '{data['mm_vision_tower']}' is named, not "
                        "described; give its own config.json or an encoder preset")
    known = SIGLIP_TYPES | INTERNVIT_TYPES | CLIP_TYPES | QWEN_VL_TYPES
    raise SpecError(f"{s.where('model_type')}: {model_type or 'missing'!r} is not a SigLIP, InternViT, CLIP or "
                    f"Qwen2-VL vision config (known: {', '.join(sorted(known))})")


def _defaults(s: _Section, version: str) -> _Section:
    """The section with its family's config-class defaults under the keys it leaves out."""
    present = {k: v for k, v in s.data.items() if v is not None}
    return _Section(s.path, {**VISION_DEFAULTS[version], **present}, s.label)


def _layers_run(s: _Section, top: _Section, family: str) -> int:
    """Layers whose output the VLM uses (hidden_states index, as transformers counts it)."""
    total = s.integer("depth" if family == "qwen2_vl" else "num_hidden_layers")
    key = next((k for k in FEATURE_LAYER_KEYS if top.data.get(k) is not None), None)
    layer = top.integer(key) if key else (-2 if family in ("siglip", "clip") else -1)
    run = total + 1 + layer if layer < 0 else layer
    if not 1 <= run <= total:
        raise SpecError(f"{top.where(key)}: layer {layer} is outside the encoder's {total} layers")
    return run


def _replace(tiling: Any, where: str, **fields: Any) -> Any:
    try:
        return dataclasses.replace(tiling, **fields)
    except SpecError as exc:
        raise SpecError(f"{where}: tiling: {exc}") from None


NEWLINE_POSITIONS = {"grid": "grid", "frame": "frame", "one_token": "one_token", "no_token": "none"}
"""LLaVA-NeXT's ``mm_newline_position`` values (llava_arch.py) and the tiling's names for them."""


def _video_newline(top: _Section, default: str) -> str:
    """Where a video's newline tokens go: the config's ``mm_newline_position`` (LLaVA-OneVision,
    LLaVA-NeXT-Video), else the VLM's default (transformers' LLaVA-OneVision: one after the video;
    LLaVA-OneVision's training recipe, as the presets have it: one after every pooled row)."""
    value = top.get("mm_newline_position", None)
    if value is None:
        return default
    if value not in NEWLINE_POSITIONS:
        raise SpecError(f"{top.where('mm_newline_position')}: expected one of {', '.join(NEWLINE_POSITIONS)}, "
                        f"got {value!r}")
    return NEWLINE_POSITIONS[value]


def _siglip_tiling(top: _Section, image_size: int, patch: int) -> Any:
    side = image_size // patch
    fields: dict[str, Any] = {"tile_size": image_size, "tile_tokens": side * side,
                              "multi_image_tokens": side * side + 1, "frame_tokens": math.ceil(side / 2) ** 2,
                              "video_newline": _video_newline(top, "one_token" if top.data.get("model_type") ==
                                                              "llava_onevision" else "grid")}
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


def _clip_tiling(top: _Section, image_size: int, patch: int) -> Any:
    """LLaVA-NeXT's anyres over ``image_grid_pinpoints`` (no downsampling of the grid, a newline per
    feature row, plus the base tile); LLaVA-1.5 (``model_type`` llava, no pinpoints) feeds one tile.
    Videos (LLaVA-NeXT-Video): features pooled 2 x 2 a frame, no newlines."""
    side = image_size // patch
    fields: dict[str, Any] = {"tile_size": image_size, "tile_tokens": side * side, "multi_image_tokens": side * side,
                              "frame_tokens": math.ceil(side / 2) ** 2, "video_newline": _video_newline(top, "none"),
                              "anyres_max": 64 * 64}  # the largest: plain "anyres" never downsamples
    pins = top.get("image_grid_pinpoints", None)
    if pins is None and top.data.get("model_type") == "llava":
        return _replace(presets.encoder("internvit-300m").tiling, top.where(), tile_size=image_size,
                        tile_tokens=side * side, multi_image_tokens=side * side, frame_tokens=side * side,
                        max_tiles=1, thumbnail=False, multi_image="one_tile", video_sampling="fps", min_frames=1)
    if pins is not None and not (isinstance(pins, list) and pins and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and v >= image_size for v in p)
            for p in pins)):
        raise SpecError(f"{top.where('image_grid_pinpoints')}: expected a list of [height, width] pairs of at "
                        f"least {image_size} pixels, got {pins!r}")
    fields["pinpoints"] = tuple(tuple(p) for p in pins) if pins else LLAVA_NEXT_PINPOINTS
    return _replace(presets.encoder("siglip-so400m").tiling, top.where(), **fields)


def _pixel_bounds(path: Path, name: str, low: int, high: int) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a processor config next to the model's, else the defaults."""
    file = path.parent / name
    if not file.is_file():
        return low, high
    data = load_json(file)
    p = _Section(file, data if isinstance(data, dict) else {}, "")
    size = p.data.get("size") if isinstance(p.data.get("size"), dict) else {}
    low = p.integer("min_pixels", size.get("shortest_edge", low))
    high = p.integer("max_pixels", size.get("longest_edge", high))
    if not 1 <= low <= high:
        raise SpecError(f"{file}: min_pixels {low} must be at least 1 and at most max_pixels {high}")
    return low, high


def _qwen_tiling(path: Path, s: _Section, patch: int, merge: int) -> Any:
    """Qwen2-VL's native resolution: one tile per LLM token (``merge`` x ``merge`` patches), pixel
    bounds from ``preprocessor_config.json`` / ``video_preprocessor_config.json`` next to the
    config when present; videos sampled at 2 frames a second (4 to 768 frames), two frames to a
    temporal patch."""
    lo, hi = _pixel_bounds(path, "preprocessor_config.json", 56 * 56, 28 * 28 * 1280)
    vlo, vhi = _pixel_bounds(path, "video_preprocessor_config.json", 128 * 28 * 28, 28 * 28 * 768)
    return _replace(presets.encoder("siglip-so400m").tiling, s.where(), scheme="native", tile_size=patch * merge,
                    tile_tokens=1, multi_image_tokens=1, frame_tokens=1, newline_tokens=False, video_newline="none",
                    thumbnail=False, min_pixels=lo, max_pixels=hi, video_min_pixels=vlo, video_max_pixels=vhi,
                    fps=2.0, min_frames=4, max_frames=768, temporal_patch=s.integer("temporal_patch_size"))


def _qwen_fields(path: Path, s: _Section, layers: int) -> dict[str, Any]:
    """Qwen2-VL (``embed_dim``, ``mlp_ratio``, LayerNorm, GELU) or Qwen2.5-VL (``hidden_size``,
    ``intermediate_size``, RMSNorm, SwiGLU, windows of ``window_size`` pixels)."""
    patch, merge = s.integer("patch_size"), s.integer("spatial_merge_size")
    fields: dict[str, Any] = dict(heads=s.integer("num_heads"), image_size=patch * merge, patch_size=patch,
                                  downsample=1 / merge, qkv_bias=True, tiling=_qwen_tiling(path, s, patch, merge))
    if "fullatt_block_indexes" in s.data:  # Qwen2.5-VL
        full = s.get("fullatt_block_indexes")
        if not (isinstance(full, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in full)):
            raise SpecError(f"{s.where('fullatt_block_indexes')}: expected a list of layer indices, got {full!r}")
        window = s.integer("window_size")
        if window % patch:
            raise SpecError(f"{s.where('window_size')}: {window} pixels is not a whole number of {patch}-pixel patches")
        fields.update(hidden=s.integer("hidden_size"), mlp=s.integer("intermediate_size"), mlp_kind="swiglu",
                      norm="rmsnorm", window=window // patch, full_layers=tuple(k for k in full if k < layers))
    else:
        hidden = s.integer("embed_dim")
        fields.update(hidden=hidden, mlp=hidden * s.integer("mlp_ratio"), norm="layernorm")
    return fields


def _side(s: _Section, key: str) -> int:
    """A square size: an integer, or transformers' [height, width] of two equal ones (InternVL)."""
    value = s.get(key)
    if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{s.where(key)}: expected an integer or [height, width] of two equal integers, got {value!r}")
    return value


def encoder_from_hf_config(path: str | Path, name: str | None = None) -> EncoderSpec:
    """Read a SigLIP, InternViT, CLIP or Qwen2-VL encoder spec from a vision config or a VLM's
    ``vision_config``.

    Tiling follows the VLM that pairs the family with an LLM (LLaVA-OneVision's anyres for
    SigLIP, InternVL's dynamic tiling for InternViT, LLaVA-NeXT's anyres for CLIP, Qwen2-VL's
    native resolution for its towers), sized by the config's image and patch size
    and by the VLM keys when present (``anyres_max_N``, ``image_grid_pinpoints``,
    ``max_dynamic_patch``, ``use_thumbnail``, ``downsample_ratio``).
    """
    path, data = _load(path)
    s, family = _vision_section(path, data)
    top = _Section(path, data, "")
    if family == "qwen2_vl":
        layers = _layers_run(s, top, family)
        return _build(EncoderSpec, s, name=name or _name(path, s.data if s.label else {}, data), family=family,
                      layers=layers, source=str(path), **_qwen_fields(path, s, layers))
    image_size = top.integer("force_image_size", 0) or _side(s, "image_size")
    patch = _side(s, "patch_size")
    fields: dict[str, Any] = dict(
        name=name or _name(path, s.data if s.label else {}, data), family=family,
        layers=_layers_run(s, top, family), hidden=s.integer("hidden_size"),
        heads=s.integer("num_attention_heads"), mlp=s.integer("intermediate_size"),
        image_size=image_size, patch_size=patch, source=str(path))
    if family == "siglip":
        fields.update(norm="layernorm", qkv_bias=True, tiling=_siglip_tiling(top, image_size, patch))
    elif family == "clip":
        fields.update(norm="layernorm", qkv_bias=True, tiling=_clip_tiling(top, image_size, patch))
    else:
        downsample = top.number("downsample_ratio", 0.5)
        hf = s.data.get("model_type") == "internvl_vision"  # transformers' names, and its defaults
        fields.update(norm="rmsnorm" if s.get("norm_type", "layer_norm") == "rms_norm" else "layernorm",
                      qk_norm=s.flag("use_qk_norm" if hf else "qk_normalization", False),
                      qkv_bias=s.flag("attention_bias", False) if hf else s.flag("qkv_bias", True),
                      downsample=downsample, tiling=_internvit_tiling(top, image_size, patch, downsample))
    return _build(EncoderSpec, s, **fields)
