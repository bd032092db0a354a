"""Architecture specs of vision encoders, LLMs and the pair (with projector).

Specs hold the published architecture numbers only; FLOP and byte counts live
in :mod:`dflop.cost` so that one place decides what a layer costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dflop.specs.limits import MAX_SIZE
from dflop.specs.loading import check_numbers, limit, require

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
    """Where newline tokens go in a video (LLaVA-NeXT's ``mm_newline_position``): after each
    pooled row of every frame (``grid``, 196 + 14 = 210 tokens a SigLIP frame), after each frame,
    once after the whole video (``one_token``), or never."""
    max_frames: int = field(default=32, metadata=SIZE)
    fps: float = field(default=1.0, metadata=limit(high=1000.0))
    """Frames sampled per second of video, before the max_frames cap."""
    multi_image: Literal["one_tile", "dynamic"] = "one_tile"
    """Each image of a multi-image sample is one tile (LLaVA-OneVision), or is tiled dynamically
    with at most ``max(1, max_tiles // images)`` tiles plus a thumbnail (InternVL)."""
    video_sampling: Literal["fps", "uniform"] = "fps"
    """``fps``: ``fps`` frames per second of video, at most ``max_frames`` (LLaVA-OneVision);
    ``uniform``: a seeded draw of ``min_frames`` to ``max_frames`` frames per video whatever its
    length (InternVL, which pads short videos with their last frame)."""
    min_frames: int = field(default=1, metadata=SIZE)

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.fps > 0, f"fps: must be positive, got {self.fps}")
        require(self.min_frames <= self.max_frames,
                f"min_frames: {self.min_frames} is more than max_frames {self.max_frames}")
        require(self.multi_image == "one_tile" or self.scheme == "dynamic",
                "multi_image: dynamic tiling of multi-image samples needs scheme 'dynamic'")
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
