"""A ViT vision encoder (SigLIP or InternViT layout) with the projector into the LLM.

Each tile is its own sequence of patches (all tiles have the same length, so
attention is an ordinary batched call). SigLIP: LayerNorm, GELU (tanh) MLP,
biases. InternViT: a class token before the patches (dropped before the
projector, as InternVL drops it), LayerNorm or RMSNorm, optional query/key
normalisation, layer scale, an exact-GELU MLP, and a pixel shuffle that merges
2x2 patches into one token before the projector. The projector is LLaVA's
two-layer GELU MLP (or a linear map); InternVL's normalises its input first. The
class token adds one position to a tile's sequence that the cost model does not
price (1 in 1025 for InternViT at 448 px).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflop.models.llm import RMSNorm, shard
from dflop.specs.models import EncoderSpec, MLLMSpec


def _norm(spec: EncoderSpec, dim: int) -> nn.Module:
    return RMSNorm(dim) if spec.norm == "rmsnorm" else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, spec: EncoderSpec, tp: int = 1) -> None:
        super().__init__()
        self.spec = spec
        self.heads = shard(spec.heads, tp, "attention heads")
        h, inner = spec.hidden, self.heads * spec.head_dim
        self.norm1 = _norm(spec, h)
        # Separate projections (as SigLIP's q_proj/k_proj/v_proj): column-parallel TP shards each by heads.
        self.q = nn.Linear(h, inner, bias=spec.qkv_bias)
        self.k = nn.Linear(h, inner, bias=spec.qkv_bias)
        self.v = nn.Linear(h, inner, bias=spec.qkv_bias)
        self.q_norm = RMSNorm(inner) if spec.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(inner) if spec.qk_norm else nn.Identity()
        self.proj = nn.Linear(inner, h)
        self.norm2 = _norm(spec, h)
        self.fc1 = nn.Linear(h, shard(spec.mlp, tp, "MLP channels"))
        self.fc2 = nn.Linear(shard(spec.mlp, tp, "MLP channels"), h)
        scale = spec.family == "internvit"
        self.ls1 = nn.Parameter(0.1 * torch.ones(h)) if scale else None
        self.ls2 = nn.Parameter(0.1 * torch.ones(h)) if scale else None
        self.gelu = "none" if scale else "tanh"  # InternViT's hidden_act is the exact GELU, SigLIP's the tanh one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, length, _ = x.shape
        a = self.norm1(x)
        q, k, v = self.q_norm(self.q(a)), self.k_norm(self.k(a)), self.v(a)
        # width // head_dim heads: the local count when tensor parallelism has sharded the projections
        split = lambda t: t.view(tiles, length, t.shape[-1] // self.spec.head_dim,  # noqa: E731
                                  self.spec.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(tiles, length,
                                                                                               q.shape[-1])
        a = self.proj(a)
        x = x + (a * self.ls1 if self.ls1 is not None else a)
        m = self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.gelu))
        return x + (m * self.ls2 if self.ls2 is not None else m)


def pixel_shuffle(x: torch.Tensor, merge: int) -> torch.Tensor:
    """(tiles, side*side, C) -> (tiles, side*side/merge, C*merge): neighbouring patches become one token."""
    if merge == 1:
        return x
    tiles, length, channels = x.shape
    side, r = math.isqrt(length), math.isqrt(merge)
    x = x.view(tiles, side // r, r, side // r, r, channels).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(tiles, (side // r) ** 2, channels * merge)


class Projector(nn.Module):
    def __init__(self, model: MLLMSpec) -> None:
        super().__init__()
        self.merge = model.encoder.merge
        out = model.llm.hidden
        # InternVL's mlp1 normalises the shuffled features first (LayerNorm at torch's default epsilon)
        self.norm = nn.LayerNorm(model.projector_in) if model.encoder.family == "internvit" else None
        if model.projector == "linear":
            self.layers = nn.Sequential(nn.Linear(model.projector_in, out))
        else:
            self.layers = nn.Sequential(nn.Linear(model.projector_in, out), nn.GELU(), nn.Linear(out, out))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = pixel_shuffle(features, self.merge)
        return self.layers(x if self.norm is None else self.norm(x))


class PatchEmbed(nn.Module):
    """Tiles (n, 3, size, size) to patch features (n, patches, hidden) with learned positions
    (InternViT: (n, 1 + patches, hidden), its class token first; shaped as InternVL saves them)."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        self.side = spec.image_size // spec.patch_size
        self.pixels = self.side * spec.patch_size
        self.conv = nn.Conv2d(3, spec.hidden, kernel_size=spec.patch_size, stride=spec.patch_size)
        classed = spec.family == "internvit"
        self.cls = nn.Parameter(torch.zeros(1, 1, spec.hidden)) if classed else None
        self.position = nn.Parameter(torch.zeros(1, self.side * self.side + 1, spec.hidden) if classed
                                     else torch.zeros(self.side * self.side, spec.hidden))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cropped = pixels[..., :self.pixels, :self.pixels]
        x = self.conv(cropped).flatten(2).transpose(1, 2)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(len(x), -1, -1).to(x.dtype), x], dim=1)
        return x + self.position


def patch_features(spec: EncoderSpec, x: torch.Tensor) -> torch.Tensor:
    """The encoder's output without its class token (InternVL's ``vit_embeds[:, 1:]``)."""
    return x[:, 1:] if spec.family == "internvit" else x


class VisionEncoder(nn.Module):
    """Tiles (n, 3, size, size) to LLM embeddings (n, tokens per tile, LLM hidden)."""

    def __init__(self, model: MLLMSpec, tp: int = 1, layers: int | None = None,
                 checkpointing: bool = False) -> None:
        super().__init__()
        spec = model.encoder
        self.spec, self.checkpointing = spec, checkpointing
        self.embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec, tp) for _ in range(layers or spec.layers))
        self.projector = Projector(model)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embed(pixels)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        return self.projector(patch_features(self.spec, x))
