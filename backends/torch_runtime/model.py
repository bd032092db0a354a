"""The modules a worker owns, named as in the whole model, and the synthetic inputs they train on.

A worker holds the layers of its pipeline stages and nothing else (a colocated
LLM stage 0 also holds the whole encoder). Parameters are named as in the
whole model (``llm.blocks.7.q.weight``) and initialised from the run's seed and
that name alone, so every layout of the same model (one process, a pipeline,
tensor-parallel shards) starts from the very same weights, which is what lets a
distributed run be checked against a single-process reference.

Inputs are shape-faithful and content-free: every sample gets seeded random
pixels for its tiles and random token ids for its text, from its id. The image
tokens the LLM sees are the projector's outputs for the sample's tiles laid out
to the sample's image-token count (first rows kept; a learned newline vector
fills rows beyond the tiles' features, as LLaVA's row newlines do): the tile
and token counts, hence the work, are exactly those the cost model prices. Real samples (a
checkpoint and a dataset) bring their own token ids and their images' tiles, laid out as
LLaVA-OneVision lays them out (:func:`onevision_layout`), where their conversation places them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dflop.models.llm import DecoderBlock, RMSNorm, wide
from dflop.models.vit import PatchEmbed, Projector, VisionBlock, patch_features
from dflop.specs.models import MLLMSpec
from dflop.specs.plan import Module
from dflop.workload.chat import Encoded
from dflop.workload.pixels import ImageRef, VideoRef

from dflop.backends.torch_runtime.recompute import BlockRunner


def stable_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def whole_model_name(name: str, tied: bool) -> str:
    """``llm.s1.blocks.3.q.weight`` -> ``llm.blocks.3.q.weight``: the same name under every plan (a
    layer keeps its global index); a tied head is the embedding."""
    module, _, rest = name.split(".", 2)
    out = f"{module}.{rest}"
    return "llm.embed.weight" if tied and out == "llm.head.weight" else out


def init_parameters(module: nn.Module, prefix: str, seed: int) -> None:
    """Weights N(0, 0.02), biases 0, norm scales 1, layer scales 0.1: each from (seed, full name)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = f"{prefix}.{name}"
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                p.zero_()
            elif "norm" in name and leaf == "weight" and p.dim() == 1:
                p.fill_(1.0)
            elif leaf in ("ls1", "ls2"):
                p.fill_(0.1)
            else:
                g = torch.Generator().manual_seed(stable_seed(seed, full))
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))


class EncoderStage(nn.Module):
    """Layers ``layers`` of the encoder; the first stage embeds patches, the last projects and lays
    out every sample's image tokens."""

    def __init__(self, model: MLLMSpec, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        spec = model.encoder
        self.first, self.last = first, last
        self.embed = PatchEmbed(spec) if first else None
        self.blocks = nn.ModuleDict({str(i): VisionBlock(spec) for i in layers})
        self.spec = spec
        self.projector = Projector(model) if last else None
        self.newline = nn.Parameter(torch.zeros(model.llm.hidden)) if last and spec.newline else None
        self.run_block: BlockRunner | None = None
        """How each block is called (activation recomputation, ``recompute.py``); None: plainly."""

    def forward(self, x: torch.Tensor, tiles: list[int] | None = None, image_tokens: list[int] | None = None,
                images: list[tuple[ImageRef | VideoRef, ...]] | None = None) -> torch.Tensor:
        """Pixels (first) or features (tiles, patches, hidden) -> features, or (last) image tokens
        (sum of image_tokens, LLM hidden) in sample order: real samples' ``images`` as
        LLaVA-OneVision lays them out, synthetic ones by :func:`layout`."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x) if self.run_block is None else self.run_block(block, x)
        if self.projector is None:
            return x
        features = self.projector(patch_features(self.spec, x))
        if images is None:
            return layout(features, tiles, image_tokens, self.newline)
        if self.newline is None:  # InternVL: every tile's tokens in order, image after image
            return features.reshape(-1, features.shape[-1])
        return onevision_layout(features, [im for sample in images for im in sample], self.newline)


def onevision_layout(features: torch.Tensor, images: list[ImageRef | VideoRef], newline: torch.Tensor) -> torch.Tensor:
    """(tiles, tokens per tile, H) -> (image tokens, H), image by image as LLaVA-OneVision's
    ``pack_image_features`` lays them out: a sample's only image is its base tile's features, then
    its grid's feature map unpadded to the image's aspect, bilinearly shrunk to at most
    ``anyres_max`` tiles' worth, a newline closing every row; an image of several is its one
    tile's features and a newline. A video (``get_video_features``) is each frame's feature map
    shrunk bilinearly to half its side (rounded up), then one newline."""
    side = math.isqrt(features.shape[1])
    out, start = [newline[None][:0]], 0  # (the newline in the graph even with no image: FSDP reduces its gradient)
    for image in images:
        tiles = features[start:start + image.tiles]
        start += image.tiles
        if isinstance(image, VideoRef):
            frames = tiles.reshape(len(tiles), side, side, -1).permute(0, 3, 1, 2)
            pooled = F.interpolate(frames, size=[math.ceil(side / 2)] * 2, mode="bilinear")
            out += [pooled.permute(0, 2, 3, 1).reshape(-1, tiles.shape[-1]), newline[None].to(tiles.dtype)]
            continue
        if not image.alone:
            out += [tiles[0], newline[None].to(tiles.dtype)]
            continue
        cols, rows = image.grid
        grid = tiles[1:].reshape(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        grid = unpad(grid, image.height, image.width)
        channels, height, width = grid.shape
        ratio = math.sqrt(height * width / (image.rule.tiling.anyres_max * side ** 2))
        if ratio > 1.1:
            grid = F.interpolate(grid[None], [int(height // ratio), int(width // ratio)], mode="bilinear")[0]
        rows_end = newline[:, None, None].to(grid.dtype).expand(channels, grid.shape[1], 1)
        out += [tiles[0], torch.cat([grid, rows_end], dim=-1).flatten(1, 2).transpose(0, 1)]
    return torch.cat(out)


def unpad(grid: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The (C, H, W) feature map without the rows or columns that padded the image to its grid
    (LLaVA-NeXT's ``unpad_image``, its rounding included)."""
    current_h, current_w = grid.shape[1:]
    if width / height > current_w / current_h:
        pad = (current_h - int(round(height * (current_w / width), 7))) // 2
        return grid[:, pad:current_h - pad, :]
    pad = (current_w - int(round(width * (current_h / height), 7))) // 2
    return grid[:, :, pad:current_w - pad]


def layout(features: torch.Tensor, tiles: list[int], image_tokens: list[int],
           newline: torch.Tensor | None) -> torch.Tensor:
    """(tiles, tokens per tile, H) -> (sum image_tokens, H): each sample's first rows, newline rows
    after (an encoder without a newline has as many rows as tokens)."""
    per_tile = features.shape[1]
    flat = features.reshape(-1, features.shape[-1])
    start, index = 0, []
    for t, n in zip(tiles, image_tokens):
        have = t * per_tile
        take = min(n, have)
        index.append(torch.arange(start, start + take))
        index.append(torch.full((n - take,), -1, dtype=torch.long))
        start += have
    idx = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    out = flat.index_select(0, idx.clamp(min=0).to(flat.device))
    if newline is None:  # (EncoderSpec.newline: every token is a tile's feature)
        return out
    mask = (idx < 0).to(flat.device)[:, None]  # even when no row needs it: every replica gives the newline a
    return torch.where(mask, newline.to(out.dtype).expand_as(out), out)  # gradient, as FSDP's reductions need


@dataclass(frozen=True)
class Sequence:
    """Where a bin's samples sit in the packed LLM sequence."""

    lengths: list[int]
    image_rows: torch.Tensor
    """Positions of image tokens (sample order, then row order)."""
    text_rows: torch.Tensor
    label_rows: torch.Tensor
    """Positions whose next token is a text token of the same sample."""
    labels: torch.Tensor


def pack_sequence(image_tokens: list[int], text: list[torch.Tensor], targets: list[np.ndarray] | None = None,
                  layouts: list[np.ndarray] | None = None) -> Sequence:
    """Each sample is its image tokens then its text tokens, or (``layouts``: a bool per position
    of each sample, True where an image token goes) interleaved as its conversation places them;
    a text token is predicted from the position before it, whatever that holds. With ``targets``
    (a bool per text token of each sample: real samples' assistant tokens) only those are predicted."""
    img, txt, lab_rows, labels = [], [], [], []
    offset = 0
    for s, (m, tokens) in enumerate(zip(image_tokens, text)):
        n = len(tokens)
        media = layouts[s] if layouts is not None else np.arange(m + n) < m
        at = np.flatnonzero(~media)  # each text token's position in the sample
        img.append(offset + np.flatnonzero(media))
        txt.append(offset + at)
        chosen = np.ones(n, dtype=bool) if targets is None else targets[s]
        predicted = np.flatnonzero(chosen & (at > 0))
        lab_rows.append(offset + at[predicted] - 1)
        labels.append(tokens[torch.from_numpy(predicted)])
        offset += m + n
    cat = lambda parts: torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0, dtype=torch.long)  # noqa: E731
    return Sequence([m + len(t) for m, t in zip(image_tokens, text)], cat(img), cat(txt), cat(lab_rows),
                    torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long))


class LLMStage(nn.Module):
    """Layers ``layers`` of the LLM; the first stage embeds text and places the image tokens, the
    last computes the loss."""

    def __init__(self, model: MLLMSpec, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        spec = model.llm
        self.first, self.last = first, last
        self.embed = nn.Embedding(spec.vocab, spec.hidden) if first else None
        self.blocks = nn.ModuleDict({str(i): DecoderBlock(spec) for i in layers})
        self.norm = RMSNorm(spec.hidden, spec.norm_eps) if last else None
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False) if last else None
        if spec.tie_embeddings and first and last:
            self.head.weight = self.embed.weight
        self.run_block: BlockRunner | None = None
        """How each block is called (activation recomputation, ``recompute.py``); None: plainly."""

    def forward(self, x: torch.Tensor | None, seq: Sequence, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                text: torch.Tensor | None = None, loss_scale: float = 1.0) -> torch.Tensor:
        """First stage: ``x`` is the bin's image tokens and ``text`` its text token ids; otherwise ``x``
        is the hidden states. Returns hidden states, or (last) the loss summed over target tokens
        times ``loss_scale``."""
        if self.embed is not None:
            hidden = self.embed(text)
            out = hidden.new_zeros(sum(seq.lengths), hidden.shape[-1])
            out = out.index_copy(0, seq.text_rows.to(out.device), hidden)
            if x is not None:  # even with no image tokens: FSDP needs every replica's backward to reach the encoder
                out = out.index_copy(0, seq.image_rows.to(out.device), x.to(out.dtype))
            x = out
        for block in self.blocks.values():
            x = (block(x, positions, cu_seqlens) if self.run_block is None
                 else self.run_block(block, x, positions, cu_seqlens))
        if self.head is None:
            return x
        logits = self.head(self.norm(x.index_select(0, seq.label_rows.to(x.device))))
        return F.cross_entropy(wide(logits), seq.labels.to(logits.device), reduction="sum") * loss_scale


def sample_inputs(seed: int, sample_id: str, tiles: int, text_tokens: int, image_size: int, vocab: int,
                  need_pixels: bool = True, text: dict[str, Encoded] | None = None,
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(pixels (tiles, 3, size, size) or None, text token ids) of one sample, from its id: its real
    tokens and its images' tiles where ``text`` has them (by id), else synthetic ones drawn from the id."""
    if text is not None:
        real, pixels = text[sample_id], None
        if need_pixels:
            tiles_of = [image.pixels(sample_id) for image in real.images]
            pixels = (torch.from_numpy(np.concatenate(tiles_of)) if tiles_of
                      else torch.zeros(0, 3, image_size, image_size))
        return pixels, torch.from_numpy(real.ids[real.text])
    g = torch.Generator().manual_seed(stable_seed(seed, f"sample:{sample_id}"))
    tokens = torch.randint(0, vocab, (int(text_tokens),), generator=g)
    pixels = torch.randn(int(tiles), 3, image_size, image_size, generator=g) if need_pixels else None
    return pixels, tokens


def stage_layers(layers: tuple[int, ...]) -> list[range]:
    """Global layer indices of every stage from layers per stage."""
    out, start = [], 0
    for n in layers:
        out.append(range(start, start + n))
        start += n
    return out


def build_stage(model: MLLMSpec, module: Module, stage: int, layers: tuple[int, ...], seed: int) -> nn.Module:
    """Stage ``stage`` (module-local) of ``module``, initialised as in the whole model."""
    ranges = stage_layers(layers)
    first, last = stage == 0, stage == len(ranges) - 1
    cls = EncoderStage if module is Module.ENCODER else LLMStage
    built = cls(model, ranges[stage], first, last)
    init_parameters(built, str(module), seed)
    if module is Module.LLM and last and model.llm.tie_embeddings and not first:
        with torch.no_grad():  # the head is the (tied) embedding, held on another stage too
            g = torch.Generator().manual_seed(stable_seed(seed, "llm.embed.weight"))
            built.head.weight.copy_(torch.randn(built.head.weight.shape, generator=g).mul_(0.02))
    return built
