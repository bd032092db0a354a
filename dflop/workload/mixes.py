"""Synthetic data mixes: seeded draws of raw sample attributes, shaped by the encoder's rules."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

import numpy as np
import yaml

from dflop.errors import SpecError
from dflop.specs.loading import from_mapping, require
from dflop.specs.models import EncoderSpec
from dflop.workload import vision
from dflop.workload.sample import MODALITIES, Modality, SampleTable


@dataclass(frozen=True, kw_only=True)
class LogNormal:
    """value = median * exp(sigma * N(0, 1)), clipped to [min, max]."""

    median: float
    sigma: float
    min: float
    max: float

    def __post_init__(self) -> None:
        require(self.median > 0, f"median: must be positive, got {self.median}")
        require(self.sigma >= 0, f"sigma: must not be negative, got {self.sigma}")
        require(0 <= self.min <= self.max, f"min/max: need 0 <= min <= max, got {self.min}, {self.max}")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(self.median * np.exp(self.sigma * rng.standard_normal(n)), self.min, self.max)


@dataclass(frozen=True, kw_only=True)
class MixSpec:
    """A synthetic mix of modalities and the distributions of their raw attributes."""

    name: str
    description: str = ""
    source: str = ""
    shares: dict[str, float]
    image_megapixels: LogNormal
    image_aspect_sigma: float
    """log(width / height) ~ N(0, sigma)."""
    multi_images: LogNormal
    video_seconds: LogNormal
    text_tokens: dict[str, LogNormal]

    def __post_init__(self) -> None:
        known = {m.value for m in MODALITIES}
        for key in self.shares:
            require(key in known, f"shares: unknown modality '{key}' (known: {', '.join(sorted(known))})")
        require(all(v >= 0 for v in self.shares.values()), "shares: must not be negative")
        total = sum(self.shares.values())
        require(abs(total - 1.0) < 1e-6, f"shares: must sum to 1, got {total:.6f}")
        for key, share in self.shares.items():
            require(share == 0 or key in self.text_tokens,
                    f"text_tokens: missing a distribution for '{key}'")

    def share(self, modality: Modality) -> float:
        return self.shares.get(modality.value, 0.0)


@lru_cache(maxsize=None)
def _presets() -> dict:
    return yaml.safe_load(resources.files("dflop.workload").joinpath("mixes.yaml").read_text())


def mix_names() -> list[str]:
    return list(_presets())


def mix(name: str) -> MixSpec:
    key = name.strip().lower()
    table = _presets()
    if key not in table:
        raise SpecError(f"unknown data preset '{name}' (known: {', '.join(table)})")
    return from_mapping(MixSpec, {"name": key, **table[key]}, f"mixes.yaml: {key}")


def with_shares(spec: MixSpec, **shares: float) -> MixSpec:
    """The same mix with other modality shares (normalised), for what-if studies."""
    total = sum(shares.values())
    if total <= 0:
        raise SpecError("shares: at least one must be positive")
    merged = {m.value: shares.get(m.value, 0.0) / total for m in MODALITIES}
    label = ",".join(f"{k}={v:.2f}" for k, v in merged.items() if v > 0)
    return replace(spec, name=f"{spec.name}[{label}]", shares=merged)


def _image_sizes(spec: MixSpec, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    pixels = spec.image_megapixels.draw(rng, n) * 1e6
    aspect = np.exp(spec.image_aspect_sigma * rng.standard_normal(n))
    width = np.maximum(1, np.round(np.sqrt(pixels * aspect))).astype(np.int64)
    height = np.maximum(1, np.round(pixels / width)).astype(np.int64)
    return width, height


def synthesize(spec: MixSpec, n: int, encoder: EncoderSpec, seed: int = 0,
               id_prefix: str = "s") -> SampleTable:
    """``n`` samples of the mix; the same seed gives the same samples."""
    if n < 1:
        raise SpecError(f"samples: must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    shares = np.array([spec.share(m) for m in MODALITIES])
    modality = rng.choice(len(MODALITIES), size=n, p=shares / shares.sum()).astype(np.int8)
    tiles = np.zeros(n, dtype=np.int64)
    image_tokens = np.zeros(n, dtype=np.int64)
    text_tokens = np.zeros(n, dtype=np.int64)
    tiling = encoder.tiling
    for m in MODALITIES:
        rows = np.flatnonzero(modality == m.code)
        if not len(rows):
            continue
        text_tokens[rows] = np.round(spec.text_tokens[m.value].draw(rng, len(rows))).astype(np.int64)
        if m is Modality.IMAGE:
            width, height = _image_sizes(spec, rng, len(rows))
            tiles[rows], image_tokens[rows] = vision.single_images(width, height, tiling)
        elif m is Modality.MULTI_IMAGE:
            count = np.maximum(2, np.round(spec.multi_images.draw(rng, len(rows)))).astype(np.int64)
            if tiling.multi_image == "one_tile" and tiling.scheme != "native":
                tiles[rows], image_tokens[rows] = vision.multi_images(count, tiling)
            else:  # sizes matter only here, so the draws of one-tile encoders stay as they were
                owner = np.repeat(np.arange(len(rows)), count)
                part_tiles, part_tokens = vision.multi_image_parts(*_image_sizes(spec, rng, len(owner)),
                                                                   count[owner], tiling)
                tiles[rows] = np.bincount(owner, part_tiles, len(rows)).astype(np.int64)
                image_tokens[rows] = np.bincount(owner, part_tokens, len(rows)).astype(np.int64)
        elif m is Modality.VIDEO:
            seconds = spec.video_seconds.draw(rng, len(rows))
            if tiling.scheme == "native":
                none = np.zeros(len(rows))
                frames = vision.native_frames(none, seconds, none, none, tiling)
            else:
                frames = (vision.uniform_frames(len(rows), tiling, rng) if tiling.video_sampling == "uniform"
                          else vision.video_frames(seconds, tiling))
            tiles[rows], image_tokens[rows] = vision.videos(frames, tiling)
    ids = np.array([f"{id_prefix}{i}" for i in range(n)], dtype=object)
    return SampleTable(ids, modality, tiles, text_tokens, image_tokens)
