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
AREA = limit(1, 16384 * 16384)
"""Bounds of an image area in pixels (Qwen2.5-VL ships max_pixels 12845056)."""


@dataclass(frozen=True, kw_only=True)
class TilingSpec:
    """How a VLM's preprocessing turns images and videos into tiles and tokens.

    ``anyres`` is LLaVA-OneVision's "anyres_max_N" (a grid of tiles chosen to
    keep the most resolution, plus one base tile, grid features unpadded and
    downsampled to at most N tiles' worth, a newline token per feature row);
    ``dynamic`` is InternVL's dynamic tiling (the grid closest in aspect ratio
    with at most ``max_tiles`` tiles, plus a thumbnail); ``native`` is Qwen2-VL's
    native resolution (``smart_resize`` to multiples of ``tile_size`` within
    ``min_pixels``..``max_pixels``; a "tile" is one ``tile_size`` square, the
    patches merged into one LLM token, so an image's tiles are its tokens).
    """

    scheme: Literal["anyres", "dynamic", "native"]
    tile_size: int = field(metadata=PIXELS)
    """Pixels per tile side (the encoder's input resolution)."""
    max_grid: int = field(default=6, metadata=limit(1, 64))
    """anyres: grids from 1x1 up to max_grid x max_grid tiles."""
    pinpoints: tuple[tuple[int, int], ...] = ()
    """anyres: the candidate (height, width) resolutions in pixels, in the config's order (LLaVA-NeXT's
    ``image_grid_pinpoints``), instead of every grid up to max_grid."""
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
    """LLM tokens per video frame after spatial pooling (native: unused, frames are sized by
    ``smart_resize`` within the video pixel bounds)."""
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
    min_pixels: int = field(default=56 * 56, metadata=AREA)
    """native: smallest image area in pixels after resizing (Qwen2-VL's processor default)."""
    max_pixels: int = field(default=28 * 28 * 1280, metadata=AREA)
    """native: largest image area in pixels after resizing."""
    video_min_pixels: int = field(default=128 * 28 * 28, metadata=AREA)
    """native: smallest frame area of a video (Qwen2-VL's video processor default)."""
    video_max_pixels: int = field(default=28 * 28 * 768, metadata=AREA)
    """native: largest frame area of a video."""
    temporal_patch: int = field(default=1, metadata=limit(1, 16))
    """native: video frames fused into one temporal patch (Qwen2-VL: 2); its tokens are a frame's."""

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.fps > 0, f"fps: must be positive, got {self.fps}")
        require(self.min_pixels <= self.max_pixels,
                f"min_pixels: {self.min_pixels} is more than max_pixels {self.max_pixels}")
        require(self.video_min_pixels <= self.video_max_pixels,
                f"video_min_pixels: {self.video_min_pixels} is more than video_max_pixels {self.video_max_pixels}")
        require(self.min_frames <= self.max_frames,
                f"min_frames: {self.min_frames} is more than max_frames {self.max_frames}")
        require(self.multi_image == "one_tile" or self.scheme == "dynamic",
                "multi_image: dynamic tiling of multi-image samples needs scheme 'dynamic'")
        if self.scheme == "anyres":
            side = math.isqrt(self.tile_tokens)
            require(side * side == self.tile_tokens,
                    f"tile_tokens: anyres needs a square feature grid, {self.tile_tokens} is not a square")
        require(self.scheme == "native" or self.temporal_patch == 1,
                "temporal_patch: fused video frames need scheme 'native'")
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


ENCODER_RULES = {"siglip": "llava-onevision", "internvit": "internvl", "clip": "llava-next", "qwen2_vl": "qwen2-vl"}
"""Each family's tiling rule, by the VLM that pairs it with an LLM (the name a data profile records)."""


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    """A ViT vision encoder (SigLIP, InternViT, CLIP or the Qwen2-VL family).

    The family fixes what the config does not spell out: CLIP adds a class token and a norm before
    the layers, Qwen2-VL's towers have rotary positions (no position table), a 3-D patch
    embedding over ``tiling.temporal_patch`` frames and no biases in it.
    """

    name: str
    family: Literal["siglip", "internvit", "clip", "qwen2_vl"]
    layers: int = field(metadata=SIZE)
    hidden: int = field(metadata=SIZE)
    heads: int = field(metadata=SIZE)
    mlp: int = field(metadata=SIZE)
    """Intermediate size of the MLP."""
    mlp_kind: Literal["gelu", "swiglu"] = "gelu"
    """A two-matrix GELU MLP, or gate, up and down projections with biases (Qwen2.5-VL)."""
    image_size: int = field(metadata=PIXELS)
    patch_size: int = field(metadata=PIXELS)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    qk_norm: bool = False
    qkv_bias: bool = True
    downsample: float = field(default=1.0, metadata=limit(0.01, 1.0))
    """Pixel-shuffle ratio before the projector (InternViT: 0.5, four patches become one token)."""
    tiling: TilingSpec
    window: int = field(default=0, metadata=limit(0, 4096))
    """Patches per side of an attention window (Qwen2.5-VL: 112 px / 14 = 8); 0: every layer
    attends over the whole image."""
    full_layers: tuple[int, ...] = ()
    """With ``window``: the layers (0-based) that attend over the whole image
    (Qwen2.5-VL's ``fullatt_block_indexes``)."""
    source: str = ""
    """Where the numbers come from (public config file)."""

    def __post_init__(self) -> None:
        check_numbers(self)
        require(self.hidden % self.heads == 0,
                f"heads: {self.heads} does not divide hidden size {self.hidden}")
        require(self.image_size >= self.patch_size,
                f"patch_size: {self.patch_size} is larger than image_size {self.image_size}")
        require(all(0 <= k < self.layers for k in self.full_layers),
                f"full_layers: {list(self.full_layers)} lists a layer outside 0..{self.layers - 1}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def rule(self) -> str:
        """The VLM whose preprocessing turns images and videos into this encoder's tiles."""
        if self.family == "clip" and self.tiling.scheme == "dynamic":
            return "llava-1.5"  # one tile an image, no anyres
        return ENCODER_RULES[self.family]

    @property
    def patches_per_tile(self) -> int:
        """Sequence length of one tile in the encoder (729 for SigLIP-so400m at 384 px)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def newline(self) -> bool:
        """Its VLM follows image rows, images or videos with a learned newline (LLaVA's
        ``image_newline``); InternVL and LLaVA-1.5 have none."""
        t = self.tiling
        return t.newline_tokens or t.video_newline != "none" or max(t.multi_image_tokens, t.frame_tokens) > t.tile_tokens

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
    head_dim: int | None = field(default=None, metadata=SIZE)
    """Width of one attention head; None means hidden / heads. Gemma (256) and Qwen3 (128) set it
    apart from hidden / heads, so the query and output projections are heads x head_dim wide,
    not hidden: deriving it would miscount their weights, FLOPs and activations."""
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    """The attention output projection has a bias too (Llama's ``attention_bias``, InternLM2's ``bias``)."""
    qk_norm: bool = False
    """Queries and keys go through a per-head RMSNorm (Qwen3): 2 x head_dim weights a layer."""
    layer_norms: Literal[2, 4] = 2
    """RMSNorms of hidden width per layer: before attention and MLP (2), and after each (Gemma-2: 4)."""
    rope_theta: float = 1.0e6
    norm_eps: float = field(default=1e-6, metadata=limit(high=1.0))
    """The RMSNorms' epsilon (``rms_norm_eps``: Llama-3 ships 1e-5): no cost depends on it, but a
    model run from a checkpoint computes what the checkpoint's own model computes only with it."""
    max_position: int = 32768
    source: str = ""

    def __post_init__(self) -> None:
        check_numbers(self)
        if self.head_dim is None:
            require(self.hidden % self.heads == 0,
                    f"heads: {self.heads} does not divide hidden size {self.hidden}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        require(self.heads % self.kv_heads == 0,
                f"kv_heads: {self.kv_heads} does not divide heads {self.heads}")
        require(self.norm_eps > 0, f"norm_eps: must be positive, got {self.norm_eps}")

    @property
    def q_dim(self) -> int:
        """Width of all query heads (the attention output's width), hidden unless head_dim says otherwise."""
        return self.heads * self.head_dim

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
