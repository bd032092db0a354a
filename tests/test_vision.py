"""Tiling rules against literal transcriptions of the reference implementations."""

import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dflop.specs import presets
from dflop.workload import vision

SIGLIP = presets.encoder("siglip-so400m").tiling
INTERNVL = presets.encoder("internvit-300m").tiling


def llava_select_best_resolution(original_size, possible_resolutions):
    """LLaVA-NeXT mm_utils.select_best_resolution, transcribed."""
    original_width, original_height = original_size
    best_fit, max_effective, min_wasted = None, 0, float("inf")
    for width, height in possible_resolutions:
        scale = min(width / original_width, height / original_height)
        down_w, down_h = int(original_width * scale), int(original_height * scale)
        effective = min(down_w * down_h, original_width * original_height)
        wasted = width * height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best_fit = effective, wasted, (width, height)
    return best_fit


def llava_onevision_counts(width, height):
    """Tiles and LLM tokens of one image under anyres_max_9 with (1x1)..(6x6) grids of 384 px."""
    pins = [(i * 384, j * 384) for i in range(1, 7) for j in range(1, 7)]
    best_w, best_h = llava_select_best_resolution((width, height), pins)
    grid_w, grid_h = best_w // 384, best_h // 384
    cur_h, cur_w = grid_h * 27, grid_w * 27
    if width / height > cur_w / cur_h:  # unpad_image
        new_h = int(height * (cur_w / width))
        pad = (cur_h - new_h) // 2
        cur_h = cur_h - 2 * pad
    else:
        new_w = int(width * (cur_h / height))
        pad = (cur_w - new_w) // 2
        cur_w = cur_w - 2 * pad
    times = math.sqrt(cur_h * cur_w / (9 * 27**2))
    if times > 1.1:
        cur_h, cur_w = int(cur_h // times), int(cur_w // times)
    return grid_w * grid_h + 1, 729 + cur_h * (cur_w + 1)


def internvl_tiles(width, height, max_num=12, image_size=448):
    """InternVL dynamic_preprocess (use_thumbnail=True), transcribed."""
    aspect_ratio = width / height
    target_ratios = set((i, j) for n in range(1, max_num + 1) for i in range(1, n + 1)
                        for j in range(1, n + 1) if 1 <= i * j <= max_num)
    target_ratios = sorted(target_ratios, key=lambda x: x[0] * x[1])
    best_diff, best = float("inf"), (1, 1)
    area = width * height
    for ratio in target_ratios:
        diff = abs(aspect_ratio - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    blocks = best[0] * best[1]
    return blocks + (1 if blocks != 1 else 0)


sizes = st.tuples(st.integers(1, 6000), st.integers(1, 6000))


@given(st.lists(sizes, min_size=1, max_size=40))
@example([(522, 1943)])  # features 1.04x the budget: kept, since anyres only shrinks beyond 1.1x
def test_anyres_matches_llava_reference(batch):
    w = np.array([s[0] for s in batch])
    h = np.array([s[1] for s in batch])
    tiles, tokens = vision.single_images(w, h, SIGLIP)
    assert [(int(a), int(b)) for a, b in zip(tiles, tokens)] == [llava_onevision_counts(*s) for s in batch]


@given(st.lists(sizes, min_size=1, max_size=40))
def test_dynamic_matches_internvl_reference(batch):
    w = np.array([s[0] for s in batch])
    h = np.array([s[1] for s in batch])
    tiles, tokens = vision.single_images(w, h, INTERNVL)
    assert tiles.tolist() == [internvl_tiles(*s) for s in batch]
    assert (tokens == tiles * 256).all()


@pytest.mark.parametrize("size,expected", [
    # 384x384: a 1x1 grid plus the base tile; 27x27 features unpadded to 27x27, + 27 newlines.
    ((384, 384), (2, 729 + 27 * 28)),
    # 1000x500: full resolution needs 1152x768, a 3x2 grid; features 81 wide, 54 high unpadded to
    # int(500 * 81/1000) = 40 rows (padding 7 above and below): 729 + 40 * (81 + 1).
    ((1000, 500), (7, 729 + 40 * 82)),
    # 4000x3000: best grid 6x5; 162x121 features after unpadding are 2.99x the 9-tile budget,
    # so they shrink by 1.7285 to 93x70: 729 + 70 * (93 + 1).
    ((4000, 3000), (31, 729 + 70 * 94)),
])
def test_anyres_hand_computed(size, expected):
    assert vision.single_image(*size, SIGLIP) == expected


def test_tile_range_is_2_to_37():
    w = np.array([10, 384, 6000, 2304, 100])
    h = np.array([10, 384, 6000, 2304, 6000])
    tiles, _ = vision.single_images(w, h, SIGLIP)
    assert tiles.min() >= 2 and tiles.max() == 37


def test_multi_image_and_video_rules():
    assert [a.tolist() for a in vision.multi_images(np.array([3]), SIGLIP)] == [[3], [3 * 730]]
    # 1 fps, capped at 32 frames; 196 pooled tokens + 14 row newlines per frame.
    assert vision.video_frames(np.array([42.5, 7.2, 0.3]), SIGLIP).tolist() == [32, 8, 1]
    tiles, tokens = vision.videos(np.array([32, 8]), SIGLIP)
    assert tiles.tolist() == [32, 8] and tokens.tolist() == [32 * 210, 8 * 210]
    tiles, tokens = vision.videos(np.array([40]), INTERNVL)
    assert tiles.tolist() == [32] and tokens.tolist() == [32 * 256]


def test_internvl_hand_computed():
    assert vision.single_image(448, 448, INTERNVL) == (1, 256)       # one tile, no thumbnail
    assert vision.single_image(1000, 500, INTERNVL) == (3, 3 * 256)  # 2x1 grid + thumbnail
    assert vision.single_image(4000, 3000, INTERNVL) == (13, 13 * 256)  # 4x3 grid + thumbnail


@given(st.lists(st.lists(sizes, min_size=2, max_size=14), min_size=1, max_size=6))
def test_internvl_multi_image_matches_reference(samples):
    """Each of n images: dynamic_preprocess with max_num = max(1, 12 // n), as InternVL's
    multi_modal_multi_image_get_item calls it."""
    w = np.array([s[0] for images in samples for s in images])
    h = np.array([s[1] for images in samples for s in images])
    n = np.array([len(images) for images in samples for _ in images])
    tiles, tokens = vision.multi_image_parts(w, h, n, INTERNVL)
    expected = [internvl_tiles(x, y, max_num=max(1, 12 // k)) for x, y, k in zip(w, h, n)]
    assert tiles.tolist() == expected and (tokens == tiles * 256).all()
    assert vision.multi_image_parts(w, h, n, SIGLIP)[0].tolist() == [1] * len(w)


def test_frames_from_container_headers():
    # LLaVA-NeXT: every round(avg_fps / 1)-th frame, at most 32: 12 frames at 4 fps -> 3;
    # 90 at 29.97 -> every 30th -> 3; 7 at 2.4 fps -> every 2nd -> 4; 1000 at 25 -> 40 -> 32; 1 at 0.3 -> 1.
    frames = vision.header_frames(np.array([12, 90, 7, 1000, 1]), np.array([4.0, 29.97, 2.4, 25.0, 0.3]), SIGLIP)
    assert frames.tolist() == [3, 3, 4, 32, 1]


def test_internvl_frame_draws():
    frames = vision.uniform_frames(2000, INTERNVL, np.random.default_rng(0))
    assert frames.min() == 8 and frames.max() == 32          # every count from 8 to 32 is drawn
    assert len(np.unique(frames)) == 25
