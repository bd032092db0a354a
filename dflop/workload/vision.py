"""Vision preprocessing rules: image sizes and frame counts to tiles and tokens.

Vectorised over samples, because synthetic mixes and data profiles run these
rules on hundreds of thousands of images. The arithmetic follows the reference
implementations step by step (LLaVA-NeXT's ``select_best_resolution`` and
``unpad_image`` with ``anyres_max_N``; InternVL's ``dynamic_preprocess``; Qwen2-VL's
``smart_resize`` and frame sampling), so
that counts match what those models feed their encoders.
"""

from __future__ import annotations

import numpy as np

from dflop.specs.models import TilingSpec


def _anyres_grids(t: TilingSpec) -> np.ndarray:
    """Candidate (width, height) resolutions in LLaVA-NeXT's order."""
    if t.pinpoints:
        return np.array([(w, h) for h, w in t.pinpoints], dtype=float)
    return np.array([(i * t.tile_size, j * t.tile_size)
                     for i in range(1, t.max_grid + 1) for j in range(1, t.max_grid + 1)], dtype=float)


def anyres_grid(width: np.ndarray, height: np.ndarray, t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    """(columns, rows) of the anyres tile grid of each image: LLaVA-NeXT's ``select_best_resolution``."""
    w = width.astype(float)[:, None]
    h = height.astype(float)[:, None]
    grids = _anyres_grids(t)
    cw, ch = grids[:, 0][None, :], grids[:, 1][None, :]
    scale = np.minimum(cw / w, ch / h)
    effective = np.minimum(np.floor(w * scale) * np.floor(h * scale), w * h)
    wasted = cw * ch - effective
    # Best = largest effective resolution, then least waste, then first in order.
    best_eff = effective.max(axis=1, keepdims=True)
    waste_if_best = np.where(effective == best_eff, wasted, np.inf)
    choice = np.argmin(waste_if_best, axis=1)
    return (grids[choice, 0] // t.tile_size).astype(np.int64), (grids[choice, 1] // t.tile_size).astype(np.int64)


def _anyres(width: np.ndarray, height: np.ndarray, t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    grid_w, grid_h = anyres_grid(width, height, t)

    side = t.feature_side
    cur_h, cur_w = (grid_h * side).astype(float), (grid_w * side).astype(float)
    w1, h1 = width.astype(float), height.astype(float)
    wider = (w1 / h1) > (cur_w / cur_h)
    new_h = np.floor(np.round(h1 * (cur_w / w1), 7))  # int(round(x, 7)), as LLaVA-NeXT's unpad_image
    new_w = np.floor(np.round(w1 * (cur_h / h1), 7))
    pad_h = np.floor_divide(cur_h - new_h, 2)
    pad_w = np.floor_divide(cur_w - new_w, 2)
    feat_h = np.where(wider, cur_h - 2 * pad_h, cur_h)
    feat_w = np.where(wider, cur_w, cur_w - 2 * pad_w)

    times = np.sqrt(feat_h * feat_w / (t.anyres_max * t.tile_tokens))
    shrink = times > 1.1
    feat_h = np.where(shrink, np.floor_divide(feat_h, np.where(shrink, times, 1.0)), feat_h)
    feat_w = np.where(shrink, np.floor_divide(feat_w, np.where(shrink, times, 1.0)), feat_w)

    newline = 1 if t.newline_tokens else 0
    base = 1 if t.thumbnail else 0
    tiles = grid_w * grid_h + base
    tokens = base * t.tile_tokens + (feat_h * (feat_w + newline)).astype(np.int64)
    return tiles, tokens


def _dynamic_ratios(max_tiles: int) -> list[tuple[int, int]]:
    ratios = set((i, j) for n in range(1, max_tiles + 1) for i in range(1, n + 1)
                 for j in range(1, n + 1) if 1 <= i * j <= max_tiles)
    return sorted(ratios, key=lambda r: r[0] * r[1])


def dynamic_grid(width: int, height: int, max_tiles: int, t: TilingSpec) -> tuple[int, int]:
    """(columns, rows) of the grid InternVL's ``dynamic_preprocess`` resizes an image to."""
    return _dynamic_best(width, height, t, _dynamic_ratios(max_tiles))


def _dynamic_one(width: int, height: int, t: TilingSpec, ratios: list[tuple[int, int]]) -> int:
    best = _dynamic_best(width, height, t, ratios)
    blocks = best[0] * best[1]
    return blocks + (1 if t.thumbnail and blocks != 1 else 0)


def _dynamic_best(width: int, height: int, t: TilingSpec, ratios: list[tuple[int, int]]) -> tuple[int, int]:
    aspect = width / height
    best_diff, best = float("inf"), (1, 1)
    area = width * height
    for r in ratios:
        diff = abs(aspect - r[0] / r[1])
        if diff < best_diff:
            best_diff, best = diff, r
        elif diff == best_diff and area > 0.5 * t.tile_size * t.tile_size * r[0] * r[1]:
            best = r
    return best


def _dynamic_tiles(width: np.ndarray, height: np.ndarray, max_tiles: np.ndarray, t: TilingSpec) -> np.ndarray:
    """InternVL's ``dynamic_preprocess`` tile count of every image, each with its own ``max_num``."""
    ratios: dict[int, list[tuple[int, int]]] = {}
    cache: dict[tuple[int, int, int], int] = {}
    tiles = np.empty(len(width), dtype=np.int64)
    for k, key in enumerate(zip(width.tolist(), height.tolist(), max_tiles.tolist())):
        if key not in cache:
            if key[2] not in ratios:
                ratios[key[2]] = _dynamic_ratios(key[2])
            cache[key] = _dynamic_one(key[0], key[1], t, ratios[key[2]])
        tiles[k] = cache[key]
    return tiles


def _dynamic(width: np.ndarray, height: np.ndarray, t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    tiles = _dynamic_tiles(width, height, np.full(len(width), t.max_tiles), t)
    return tiles, tiles * t.tile_tokens


NOMINAL_VIDEO_FRAME = (640, 360)
"""Manifests give a video's length, not its frame size: a native-resolution rule (Qwen2-VL) counts
every video frame at 640 x 360 pixels (299 tokens a temporal patch within the video pixel bounds)."""


def smart_resize(width: np.ndarray, height: np.ndarray, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2-VL's ``smart_resize``: each side rounded to a multiple of ``factor``, then scaled
    (keeping the aspect ratio) into ``min_pixels``..``max_pixels``; returns (width, height)."""
    w, h = np.asarray(width, dtype=float), np.asarray(height, dtype=float)
    w_bar, h_bar = np.round(w / factor) * factor, np.round(h / factor) * factor
    big, small = h_bar * w_bar > max_pixels, h_bar * w_bar < min_pixels
    down = np.sqrt(h * w / max_pixels)
    up = np.sqrt(min_pixels / (h * w))
    h_bar = np.where(big, np.maximum(factor, np.floor(h / down / factor) * factor),
                     np.where(small, np.ceil(h * up / factor) * factor, h_bar))
    w_bar = np.where(big, np.maximum(factor, np.floor(w / down / factor) * factor),
                     np.where(small, np.ceil(w * up / factor) * factor, w_bar))
    return w_bar.astype(np.int64), h_bar.astype(np.int64)


def native_tokens(width: np.ndarray, height: np.ndarray, t: TilingSpec, video: bool = False) -> np.ndarray:
    """LLM tokens of one image (or one temporal patch of a video) at native resolution:
    ``(h / 28) * (w / 28)`` after ``smart_resize``, the encoder's patches merged 2 x 2."""
    bounds = (t.video_min_pixels, t.video_max_pixels) if video else (t.min_pixels, t.max_pixels)
    w, h = smart_resize(width, height, t.tile_size, *bounds)
    return (w // t.tile_size) * (h // t.tile_size)


def single_images(width: np.ndarray, height: np.ndarray, t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    """Tiles and LLM tokens of single images of the given pixel sizes."""
    width = np.asarray(width, dtype=np.int64)
    height = np.asarray(height, dtype=np.int64)
    if len(width) and (width.min() < 1 or height.min() < 1):
        raise ValueError("image sizes must be at least 1 x 1 pixel")
    if t.scheme == "native":
        tokens = native_tokens(width, height, t)
        return tokens, tokens
    if t.scheme == "anyres":
        return _anyres(width, height, t)
    return _dynamic(width, height, t)


def single_image(width: int, height: int, t: TilingSpec) -> tuple[int, int]:
    tiles, tokens = single_images(np.array([width]), np.array([height]), t)
    return int(tiles[0]), int(tokens[0])


def multi_images(count: np.ndarray, t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    """A multi-image sample feeds each image as one tile (``multi_image: one_tile``)."""
    count = np.asarray(count, dtype=np.int64)
    return count, count * t.multi_image_tokens


def multi_image_parts(width: np.ndarray, height: np.ndarray, images: np.ndarray,
                      t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    """Tiles and LLM tokens of each image of multi-image samples, ``images[k]`` being the number
    of images in image k's sample: one tile each, or (``multi_image: dynamic``, InternVL's
    ``multi_modal_multi_image_get_item``) dynamic tiling with at most ``max(1, max_tiles // n)``
    tiles plus a thumbnail."""
    images = np.asarray(images, dtype=np.int64)
    if t.scheme == "native":
        return single_images(width, height, t)
    if t.multi_image == "one_tile":
        return multi_images(np.ones_like(images), t)
    budget = np.maximum(1, t.max_tiles // np.maximum(images, 1))
    tiles = _dynamic_tiles(np.asarray(width, dtype=np.int64), np.asarray(height, dtype=np.int64), budget, t)
    return tiles, tiles * t.multi_image_tokens


def video_frames(duration_s: np.ndarray, t: TilingSpec) -> np.ndarray:
    """Frames sampled from videos of the given length: ``fps`` per second, at most ``max_frames``."""
    frames = np.ceil(np.asarray(duration_s, dtype=float) * t.fps).astype(np.int64)
    return np.clip(frames, 1, t.max_frames)


def header_frames(total_frames: np.ndarray, average_fps: np.ndarray, t: TilingSpec) -> np.ndarray:
    """LLaVA-NeXT's ``process_video_with_decord``: every ``round(avg_fps / fps)``-th frame of the
    container, uniformly resampled to ``max_frames`` when that gives more."""
    step = np.maximum(1, np.round(np.asarray(average_fps, dtype=float) / t.fps)).astype(np.int64)
    frames = -(-np.asarray(total_frames, dtype=np.int64) // step)
    return np.clip(frames, 1, t.max_frames)


def native_frames(given: np.ndarray, duration_s: np.ndarray, total_frames: np.ndarray,
                  average_fps: np.ndarray, t: TilingSpec) -> np.ndarray:
    """Qwen2-VL's video processor: frames given as a list are all used (padded with the last to a
    whole temporal patch); otherwise ``fps`` per second of video, at least ``min_frames``, at most
    ``max_frames`` and the video's own frames (from its header when known), rounded down to whole
    temporal patches."""
    tp = t.temporal_patch
    total = np.asarray(total_frames, dtype=np.int64)
    known = total > 0
    seconds = np.where(known, total / np.where(known, np.asarray(average_fps, dtype=float), 1.0),
                       np.asarray(duration_s, dtype=float))
    cap = np.where(known, np.minimum(t.max_frames, total) // tp * tp, t.max_frames // tp * tp)
    frames = np.minimum(np.minimum(np.maximum(seconds * t.fps, t.min_frames), cap), np.where(known, total, cap))
    sampled = (np.floor(frames / tp) * tp).astype(np.int64)
    given = np.asarray(given, dtype=np.int64)
    return np.maximum(np.where(given > 0, -(-given // tp) * tp, sampled), tp)


def uniform_frames(n: int, t: TilingSpec, rng: np.random.Generator) -> np.ndarray:
    """InternVL's ``read_frames_decord``: ``min_frames`` to ``max_frames`` frames a video, drawn
    uniformly whatever its length (short videos are padded with their last frame)."""
    return rng.integers(t.min_frames, t.max_frames + 1, size=n, dtype=np.int64)


def videos(frames: np.ndarray, t: TilingSpec) -> tuple[np.ndarray, np.ndarray]:
    """Tiles and LLM tokens of videos fed ``frames`` frames each (capped at max_frames; native:
    ``frame_tokens`` per temporal patch of ``temporal_patch`` frames, every token a tile)."""
    if t.scheme == "native":
        per_patch = native_tokens(*(np.array([side]) for side in NOMINAL_VIDEO_FRAME), t, video=True)[0]
        tokens = -(-np.asarray(frames, dtype=np.int64) // t.temporal_patch) * per_patch
        return tokens, tokens
    frames = np.clip(np.asarray(frames, dtype=np.int64), 1, t.max_frames)
    per_frame = t.frame_tokens
    extra = np.zeros_like(frames)
    if t.video_newline == "grid":
        per_frame += t.frame_side
    elif t.video_newline == "frame":
        per_frame += 1
    elif t.video_newline == "one_token":
        extra = np.ones_like(frames)
    return frames, frames * per_frame + extra

