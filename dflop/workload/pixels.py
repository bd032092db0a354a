"""Images and videos as a LLaVA-OneVision or InternVL checkpoint's processing feeds them to its encoder.

The arithmetic follows transformers' ``LlavaOnevisionImageProcessorPil`` step by step, on
uint8 pixels through PIL (the resampling is PIL's, so the pixels are the very ones transformers
computes): a sample's only image is resized into the anyres grid its size selects (aspect kept,
centred on black), cut into tiles row by row, after a base tile of the whole image squashed to
one tile; each image of a multi-image sample is padded to a square with the mean colour and
squashed to one tile. Then rescaled (float64, as float32) and normalised per channel (float32).
A video's frames are sampled from the container as LLaVA-NeXT's training code samples them and
squashed to one tile each. InternVL (transformers' ``GotOcr2ImageProcessorPil`` with
``crop_to_patches``, InternVL's ``dynamic_preprocess``): every image resized to the grid of
closest aspect within its tile budget, cut row by row, then a thumbnail of the whole image when
the grid has more than one tile. The tiles and the grid are those :mod:`dflop.workload.vision`
counts, so the profile's tiles and tokens are the ones that run.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflop.errors import DflopError
from dflop.specs.loading import load_json
from dflop.specs.models import TilingSpec
from dflop.workload.vision import anyres_grid, dynamic_grid


class MediaError(DflopError):
    """An image or video that cannot be fed as the profile counted it (it does not decode, or
    decodes to another size or fewer frames): a run skips its sample."""


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""InternVL's normalisation (its checkpoints' ``preprocessor_config.json`` give it too)."""
BICUBIC = 3
"""Both processors' resampling (PIL's code)."""
SCHEMES = {("anyres", "one_tile"): (CLIP_MEAN, CLIP_STD), ("dynamic", "dynamic"): (IMAGENET_MEAN, IMAGENET_STD)}
"""The tilings whose images are read from files (LLaVA-OneVision's, InternVL's) and their default
normalisation."""


@dataclass(frozen=True)
class ImageRule:
    """How a checkpoint's processor turns an image into tiles: the tiling of its config, the
    normalisation of its ``preprocessor_config.json``."""

    tiling: TilingSpec
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale: float = 1 / 255
    resample: int = BICUBIC


def load_image_rule(folder: str | Path, tiling: TilingSpec) -> ImageRule:
    """The rule of the checkpoint in ``folder``: its ``preprocessor_config.json`` (the class's
    defaults where it has none); a tile size or grid that contradicts the config is an error."""
    path = Path(folder) / "preprocessor_config.json"
    if (tiling.scheme, tiling.multi_image) not in SCHEMES:
        raise DflopError(f"{folder}: images of a {tiling.scheme}-tiled encoder are not read from files yet "
                         "(LLaVA-OneVision's and InternVL's are; data: {synthetic: true} trains on synthetic inputs)")
    rule = ImageRule(tiling, *SCHEMES[tiling.scheme, tiling.multi_image])
    if not path.is_file():
        return rule
    raw = load_json(path)
    raw = raw if isinstance(raw, dict) else {}
    size = raw.get("size") or {}
    side = size.get("height", size.get("shortest_edge")) if isinstance(size, dict) else None
    if side is not None and side != tiling.tile_size:
        raise DflopError(f"{path}: 'size': {side} pixels a tile, but config.json's vision tower takes "
                         f"{tiling.tile_size}")
    pinpoints = raw.get("image_grid_pinpoints")
    if pinpoints is not None and tiling.pinpoints and [list(p) for p in tiling.pinpoints] != pinpoints:
        raise DflopError(f"{path}: 'image_grid_pinpoints' differ from config.json's")
    if tiling.scheme == "dynamic":  # GotOcr2's keys: the tiling config.json gives (max_dynamic_patch), and no other
        for key, want in (("crop_to_patches", True), ("min_patches", 1), ("max_patches", tiling.max_tiles)):
            if raw.get(key, want) != want:
                raise DflopError(f"{path}: '{key}': {raw[key]!r}, but dflop tiles as config.json's InternVL does "
                                 f"({key}: {want!r}; config.json's max_dynamic_patch sets max_patches)")
    for key, name in (("image_mean", "mean"), ("image_std", "std")):
        value = raw.get(key, getattr(rule, name))
        if not (isinstance(value, list | tuple) and len(value) == 3 and all(isinstance(v, int | float) for v in value)):
            raise DflopError(f"{path}: '{key}': expected three numbers, got {value!r}")
        rule = replace(rule, **{name: tuple(float(v) for v in value)})
    rescale, resample = raw.get("rescale_factor", rule.rescale), raw.get("resample", rule.resample)
    if not isinstance(rescale, int | float) or isinstance(rescale, bool) or resample not in range(6):
        raise DflopError(f"{path}: 'rescale_factor' or 'resample' is not what an image processor takes")
    return replace(rule, rescale=float(rescale), resample=int(resample))


def open_rgb(path: str | Path, where: str):  # noqa: ANN201 - PIL.Image.Image
    """The image at ``path`` as RGB (transparency composited on white, as transformers does)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                rgba = image.convert("RGBA")
                return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise MediaError(f"{where}: {path}: cannot decode the image ({exc})") from None


def image_tiles(image, rule: ImageRule, alone: bool, most: int = 0) -> np.ndarray:  # noqa: ANN001 - PIL.Image
    """(tiles, 3, side, side) float32 of one RGB image. anyres: the base tile then the grid row by
    row when it is its sample's only image (``alone``), else the one padded, squashed tile.
    dynamic: the grid of at most ``most`` tiles (0: the tiling's ``max_tiles``) row by row, then the
    thumbnail."""
    from PIL import Image

    side = rule.tiling.tile_size
    if rule.tiling.scheme == "dynamic":
        cols, rows = dynamic_grid(image.size[0], image.size[1], most or rule.tiling.max_tiles, rule.tiling)
        grid = np.asarray(image.resize((cols * side, rows * side), rule.resample))
        tiles = [grid[i:i + side, j:j + side] for i in range(0, rows * side, side) for j in range(0, cols * side, side)]
        if rule.tiling.thumbnail and len(tiles) > 1:
            tiles.append(np.asarray(image.resize((side, side), rule.resample)))
    elif alone:
        width, height = image.size
        cols, rows = (int(v[0]) for v in anyres_grid(np.array([width]), np.array([height]), rule.tiling))
        target_w, target_h = cols * side, rows * side
        if target_w / width < target_h / height:
            new_w, new_h = target_w, min(math.ceil(height * target_w / width), target_h)
        else:
            new_w, new_h = min(math.ceil(width * target_h / height), target_w), target_h
        canvas = np.zeros((target_h, target_w, 3), dtype=np.uint8)
        top, left = (target_h - new_h) // 2, (target_w - new_w) // 2
        canvas[top:top + new_h, left:left + new_w] = np.asarray(image.resize((new_w, new_h), rule.resample))
        tiles = [np.asarray(image.resize((side, side), rule.resample))]
        tiles += [canvas[i:i + side, j:j + side] for i in range(0, target_h, side) for j in range(0, target_w, side)]
    else:
        width, height = image.size
        square = Image.new("RGB", (max(width, height),) * 2, tuple(int(m * 255) for m in rule.mean))
        square.paste(image, ((max(width, height) - width) // 2, (max(width, height) - height) // 2))
        tiles = [np.asarray(square.resize((side, side), rule.resample))]
    return normalised(tiles, rule)


def normalised(tiles: list[np.ndarray], rule: ImageRule) -> np.ndarray:
    """uint8 (side, side, 3) tiles -> (tiles, 3, side, side) float32, rescaled in float64 then
    normalised in float32, as transformers' numpy transforms do."""
    pixels = (np.stack(tiles).astype(np.float64) * rule.rescale).astype(np.float32).transpose(0, 3, 1, 2)
    mean = np.array(rule.mean, dtype=np.float32)[None, :, None, None]
    std = np.array(rule.std, dtype=np.float32)[None, :, None, None]
    return (pixels - mean) / std


def frame_indices(total: int, fps: float, tiling: TilingSpec) -> np.ndarray:
    """The frames of a ``total``-frame video at ``fps`` that are fed (LLaVA-NeXT's
    ``process_video_with_decord``): every ``round(fps / tiling.fps)``-th, or ``max_frames`` spread
    evenly where that gives more."""
    picked = np.arange(0, total, max(1, round(fps / tiling.fps)))
    return np.linspace(0, total - 1, tiling.max_frames, dtype=int) if len(picked) > tiling.max_frames else picked


def middle_frames(frames: int, total: int) -> np.ndarray:
    """InternVL's ``get_frame_indices`` with ``sample='middle'``: the middle frame of each of
    ``min(frames, total)`` equal segments of a ``total``-frame video, the last repeated up to ``frames``."""
    taken = min(frames, total)
    edges = np.linspace(0, total, taken + 1).astype(int)
    middle = (edges[:-1] + edges[1:] - 1) // 2
    return np.concatenate([middle, np.full(frames - taken, middle[-1])])


def video_frames(path: str | Path, indices: np.ndarray, where: str) -> list:  # noqa: ANN201 - PIL images
    """Frames ``indices`` of the first video stream of ``path``, decoded with PyAV, as RGB images."""
    import av

    wanted, frames = set(indices.tolist()), {}
    last = int(indices.max())
    try:
        with av.open(str(path)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames[i] = frame.to_image().convert("RGB")
                if i >= last:
                    break
    except Exception as exc:  # noqa: BLE001 - FFmpeg reports bad streams with many error types
        raise MediaError(f"{where}: {path}: cannot decode the video ({exc})") from None
    if len(frames) != len(wanted):
        raise MediaError(f"{where}: {path}: decodes to fewer frames than its header gives ({len(frames)} of the "
                         f"{len(wanted)} sampled up to frame {last})")
    return [frames[i] for i in indices.tolist()]


@dataclass(frozen=True)
class ImageRef:
    """One image of a real sample: its file, the tiles its processor makes of it and where in the
    grid they sit (``alone``: its sample's only image, tiled anyres; else one tile; InternVL:
    every image tiled dynamically, with at most ``most`` tiles in its grid)."""

    path: str
    width: int
    height: int
    alone: bool
    tiles: int
    tokens: int
    rule: ImageRule
    most: int = 0

    @property
    def slots(self) -> list[int]:
        """The tokens of its one placeholder."""
        return [self.tokens]

    @property
    def grid(self) -> tuple[int, int]:
        """(columns, rows) of its anyres grid."""
        cols, rows = anyres_grid(np.array([self.width]), np.array([self.height]), self.rule.tiling)
        return int(cols[0]), int(rows[0])

    def pixels(self, where: str) -> np.ndarray:
        image = open_rgb(self.path, where)
        sized = self.alone or self.rule.tiling.scheme == "dynamic"  # its size chose its tiles
        if sized and image.size != (self.width, self.height):
            raise MediaError(f"{where}: {self.path}: decodes to {image.size[0]} x {image.size[1]} pixels, but its "
                             f"header said {self.width} x {self.height} when the data was profiled")
        return image_tiles(image, self.rule, self.alone, self.most)


@dataclass(frozen=True)
class VideoRef:
    """A video of a real sample: its file, the frames fed (one tile each: squashed to the encoder's
    side, as LLaVA-NeXT's and InternVL's training code feed them) and its tokens (LLaVA-OneVision's
    ``get_video_features``: each frame's features pooled 2 x 2, one newline after the video;
    InternVL: each frame its own image, ``Frame{i}: <img>...</img>``)."""

    path: str
    indices: tuple[int, ...]
    tokens: int
    rule: ImageRule

    @property
    def tiles(self) -> int:
        return len(self.indices)

    @property
    def framed(self) -> bool:
        """Each frame is its own image placeholder (InternVL), rather than one for the video."""
        return self.rule.tiling.video_sampling == "uniform"

    @property
    def slots(self) -> list[int]:
        """The tokens of each of its placeholders."""
        return [self.rule.tiling.frame_tokens] * self.tiles if self.framed else [self.tokens]

    def pixels(self, where: str) -> np.ndarray:
        side, resample = self.rule.tiling.tile_size, self.rule.resample
        frames = video_frames(self.path, np.array(self.indices), where)
        return normalised([np.asarray(f.resize((side, side), resample)) for f in frames], self.rule)


def video_ref(path: Path, header: tuple[int, float, int, float], rule: ImageRule, where: str) -> VideoRef:
    """The video at ``path`` (``header``: the manifest's frames and duration, 0 where it gives none,
    and the container's frames and rate, 0 where it was not read) sampled and counted as the data
    profile counts it."""
    from dflop.workload import vision

    given, seconds, total, fps = header
    t = rule.tiling
    internvl = t.video_sampling == "uniform" and t.video_newline == "none"
    if not (internvl or (t.video_sampling == "fps" and t.video_newline == "one_token")) or given or seconds \
            or not total:
        raise DflopError(f"{where}: {path}: real frames are read for LLaVA-OneVision's video rule (frames from the "
                         "container at the config's fps, one newline after the video) and InternVL's (a frame "
                         "count drawn per video), with no 'frames' or 'duration' in the entry")
    if internvl:  # InternVL draws min..max frames a video; here once per video (seeded by its file's name and
        # length, wherever the dataset lies), so that the profile and every run of it agree
        seed = zlib.crc32(f"{Path(path).name}:{total}".encode())
        indices = middle_frames(int(vision.uniform_frames(1, t, np.random.default_rng(seed))[0]), total)
    else:
        indices = frame_indices(total, fps, t)
    _, tokens = vision.videos(np.array([len(indices)]), t)
    return VideoRef(str(path), tuple(int(i) for i in indices), int(tokens[0]), rule)


def image_refs(files: list[tuple[Path, tuple[int, int]]], rule: ImageRule) -> tuple[ImageRef, ...]:
    """The images of one sample (file, (width, height) from its header), tiled and counted by
    :mod:`dflop.workload.vision` as the data profile counts them."""
    from dflop.workload import vision

    t = rule.tiling
    if len(files) == 1:
        (path, (width, height)), = files
        tiles, tokens = vision.single_images(np.array([width]), np.array([height]), t)
        return (ImageRef(str(path), width, height, True, int(tiles[0]), int(tokens[0]), rule, t.max_tiles),)
    n = len(files)
    width, height = (np.array([size[k] for _, size in files]) for k in (0, 1))
    tiles, tokens = vision.multi_image_parts(width, height, np.full(n, n), t)
    return tuple(ImageRef(str(p), w, h, False, int(k), int(m), rule, max(1, t.max_tiles // n))
                 for (p, (w, h)), k, m in zip(files, tiles, tokens))
