"""Architecture specs of vision encoders, LLMs and the pair (with projector).

Specs hold the published architecture numbers only; FLOP and byte counts live
in :mod:`dflop.cost` so that one place decides what a layer costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflop.errors import SpecError
from dflop.specs.limits import MAX_SIZE
from dflop.specs.loading import at, check_numbers, limit, load_json, require

SIZE = limit(1, MAX_SIZE)
"""Bounds of an architecture size (layers, widths, heads, tokens)."""
PIXELS = limit(1, 16384)
"""Bounds of an image side in pixels (an encoder's attention grows with its fourth power)."""


@dataclass(frozen=True, kw_only=True)
class TilingSpec:
    """How a VLM's preprocessing turns images and videos into tiles and tokens.

    ``anyres`` is LLaVA-OneVision's "anyres_max_N" (a grid of tiles chosen to
    keep the most resolution, plus one base tile, grid features unpadded and
    downsampled to at most N tiles' worth, a newline token per feature row);
    ``dynamic`` is InternVL's dynamic tiling (the grid closest in aspect ratio
    with at most ``max_tiles`` tiles, plus a thumbnail).
    """

    scheme: Literal["anyres", "dynamic"]
    tile_size: int = field(metadata=PIXELS)
    """Pixels per tile side (the encoder's input resolution)."""
    max_grid: int = field(default=6, metadata=limit(1, 64))
    """anyres: grids from 1x1 up to max_grid x max_grid tiles."""
    max_tiles: int = field(default=12, metadata=limit(1, 128))
    """dynamic: at most this many tiles per image."""
    anyres_max: int = field(default=9, metadata=limit(1, 64 * 64))
    """anyres: grid features are downsampled to at most this many tiles' worth of tokens."""
    thumbnail: bool = True
    """A base (anyres) or thumbnail (dynamic) tile is added to every multi-tile image."""
    tile_tokens: int = field(metadata=SIZE)
    """LLM tokens produced by one tile."""
    newline_tokens: bool = True
    """anyres adds one newline token per row of grid features."""
    multi_image_tokens: int = field(metadata=SIZE)
    """LLM tokens per image of a multi-image sample (each image is one tile)."""
    frame_tokens: int = field(metadata=SIZE)
    """LLM tokens per video frame after spatial pooling."""
    video_newline: Literal["grid", "frame", "one_token", "none"] = "grid"
    """Where newline tokens go in a video: after each pooled row, each frame, once, or never."""
    max_frames: int = field(default=32, metadata=SIZE)
    fps: float = field(default=1.0, metadata=limit(high=1000.0))
    """Frames sampled per second of video, before the max_frames cap."""

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.fps > 0, f"fps: must be positive, got {self.fps}")
        if self.scheme == "anyres":
            side = math.isqrt(self.tile_tokens)
            require(side * side == self.tile_tokens,
                    f"tile_tokens: anyres needs a square feature grid, {self.tile_tokens} is not a square")
        if self.video_newline == "grid":
            side = math.isqrt(self.frame_tokens)
            require(side * side == self.frame_tokens,
                    f"frame_tokens: per-row newlines need a square frame grid, {self.frame_tokens} is not a square")

    @property
    def feature_side(self) -> int:
        """Side of one tile's feature grid (27 for SigLIP's 729 tokens)."""
        return math.isqrt(self.tile_tokens)

    @property
    def frame_side(self) -> int:
        return math.isqrt(self.frame_tokens)


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    """A ViT vision encoder (SigLIP or InternViT family)."""

    name: str
    family: Literal["siglip", "internvit"]
    layers: int = field(metadata=SIZE)
    hidden: int = field(metadata=SIZE)
    heads: int = field(metadata=SIZE)
    mlp: int = field(metadata=SIZE)
    """Intermediate size of the (GELU, two-matrix) MLP."""
    image_size: int = field(metadata=PIXELS)
    patch_size: int = field(metadata=PIXELS)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    qk_norm: bool = False
    qkv_bias: bool = True
    downsample: float = field(default=1.0, metadata=limit(0.01, 1.0))
    """Pixel-shuffle ratio before the projector (InternViT: 0.5, four patches become one token)."""
    tiling: TilingSpec
    source: str = ""
    """Where the numbers come from (public config file)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.hidden % self.heads == 0,
                f"heads: {self.heads} does not divide hidden size {self.hidden}")
        require(self.image_size >= self.patch_size,
                f"patch_size: {self.patch_size} is larger than image_size {self.image_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def coerce(cls, value: object, where: str) -> "EncoderSpec":
        """A preset name stands for the preset (``encoder: siglip-so400m``)."""
        from dflop.specs import presets

        if not isinstance(value, str):
            raise SpecError(f"{at(where)}: expected a preset name or a mapping, got {value!r}")
        return presets.encoder(value, where=where)

    @property
    def patches_per_tile(self) -> int:
        """Sequence length of one tile in the encoder (729 for SigLIP-so400m at 384 px)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def merge(self) -> int:
        """Patches merged into one output token by pixel shuffle (1, or 4 for InternViT)."""
        return round(1 / (self.downsample * self.downsample))


@dataclass(frozen=True, kw_only=True)
class LLMSpec:
    """A decoder-only LLM with RMSNorm, RoPE, grouped-query attention and SwiGLU."""

    name: str
    layers: int = field(metadata=SIZE)
    hidden: int = field(metadata=SIZE)
    heads: int = field(metadata=SIZE)
    kv_heads: int = field(metadata=SIZE)
    ffn: int = field(metadata=SIZE)
    """Intermediate size of the SwiGLU MLP."""
    vocab: int = field(metadata=SIZE)
    tie_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 1.0e6
    max_position: int = 32768
    source: str = ""

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.hidden % self.heads == 0,
                f"heads: {self.heads} does not divide hidden size {self.hidden}")
        require(self.heads % self.kv_heads == 0,
                f"kv_heads: {self.kv_heads} does not divide heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def coerce(cls, value: object, where: str) -> "LLMSpec":
        """A preset name, or the path of a Hugging Face config.json, stands for the spec."""
        from dflop.specs import presets

        if not isinstance(value, str):
            raise SpecError(f"{at(where)}: expected a preset name, a config.json path or a mapping, "
                            f"got {value!r}")
        if value.endswith(".json"):
            return llm_from_hf_config(value)
        return presets.llm(value, where=where)


@dataclass(frozen=True, kw_only=True)
class MLLMSpec:
    """A vision encoder feeding an LLM through a projector (LLaVA's two-layer GELU MLP)."""

    encoder: EncoderSpec
    llm: LLMSpec
    projector: Literal["mlp2x_gelu", "linear"] = "mlp2x_gelu"

    @property
    def name(self) -> str:
        return f"{self.encoder.name}+{self.llm.name}"

    @property
    def projector_in(self) -> int:
        """Projector input width: encoder hidden times the patches merged by pixel shuffle."""
        return self.encoder.hidden * self.encoder.merge


def llm_from_hf_config(path: str | Path, name: str | None = None) -> LLMSpec:
    """Read an LLM spec from a Hugging Face ``config.json`` (no download).

    A VLM config (LLaVA, Qwen2-VL, ...) keeps its language model under
    ``text_config``; that part is used when present.
    """
    data = load_json(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a JSON object")
    where = str(path)
    if isinstance(data.get("text_config"), dict):
        data, where = data["text_config"], f"{path}: text_config"

    def get(key: str, default: object = SpecError) -> object:
        if key in data:
            value = data[key]
            if default is not SpecError and value is None:
                return default
            return value
        if default is SpecError:
            raise SpecError(f"{where}: missing key '{key}'")
        return default

    def integer(key: str, default: object = SpecError) -> int:
        value = get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{where}: key '{key}': expected an integer, got {value!r}")
        return value

    heads = integer("num_attention_heads")
    model_type = str(data.get("model_type", ""))
    spec_name = name or data.get("_name_or_path") or model_type or Path(path).parent.name
    try:
        return LLMSpec(
            name=str(spec_name),
            layers=integer("num_hidden_layers"),
            hidden=integer("hidden_size"),
            heads=heads,
            kv_heads=integer("num_key_value_heads", heads),
            ffn=integer("intermediate_size"),
            vocab=integer("vocab_size"),
            tie_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=bool(get("attention_bias", model_type.startswith("qwen2"))),
            rope_theta=float(get("rope_theta", 1.0e4)),
            max_position=integer("max_position_embeddings", 32768),
            source=str(path),
        )
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None

