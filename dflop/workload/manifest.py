"""LLaVA-format manifests: the format of LLaVA-OneVision, M4-Instruct and LLaVA-Video.

A manifest is a JSON list of entries or JSON lines, one entry each::

    {"id": "x1", "image": "coco/1.jpg",            # a path, or a list of paths
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"},
                       {"from": "gpt", "value": "A cat."}]}
    {"id": "v1", "video": "clips/1.mp4", "duration": 42.0, ...}

Shapes come from the data, not from pixels: a single image's size is read
from its file header (Pillow opens lazily and decodes nothing) or from the
optional ``width``/``height`` fields; a multi-image entry needs no sizes (each
image is one tile); a video needs ``frames`` (frames fed to the model) or
``duration`` (seconds, sampled at the tiling's fps), since reading video
headers would need a decoder.

Text tokens come from ``tokenizer`` when given. Otherwise they are estimated
as ceil(characters / 4) per turn plus 5 tokens of chat template per turn:
about four characters per token is the usual figure for English with BPE
vocabularies of the Qwen2 / Llama-3 size, and ``<|im_start|>role\\n ...
<|im_end|>\\n`` adds about five tokens a turn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dflop.errors import ManifestError
from dflop.specs.models import EncoderSpec
from dflop.workload import vision
from dflop.workload.sample import Modality, SampleTable

CHARS_PER_TOKEN = 4.0
TEMPLATE_TOKENS_PER_TURN = 5
IMAGE_PLACEHOLDER = "<image>"

Tokenizer = Callable[[str], Any]


def estimate_text_tokens(turns: list[str]) -> int:
    """The documented estimate used when no tokenizer is given."""
    return sum(math.ceil(len(t) / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_TURN for t in turns)


def count_text_tokens(turns: list[str], tokenizer: Tokenizer | Any | None) -> int:
    if tokenizer is None:
        return estimate_text_tokens(turns)
    encode = tokenizer.encode if hasattr(tokenizer, "encode") else tokenizer
    total = 0
    for turn in turns:
        out = encode(turn)
        total += out if isinstance(out, int) else len(out)
        total += TEMPLATE_TOKENS_PER_TURN
    return total


@dataclass
class ManifestReport:
    samples: SampleTable
    skipped: int = 0
    problems: list[str] = field(default_factory=list)
    """The first few reasons entries were skipped (with ``skip_bad``)."""


@dataclass
class _Raw:
    id: str
    modality: Modality
    text_tokens: int
    size: tuple[int, int] | None = None
    images: int = 0
    frames: int = 0
    seconds: float = 0.0


def _entries(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(index, location, entry) for every entry; a parse failure yields a ManifestError instead."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{path}: manifest not found") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror})") from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        for index, entry in enumerate(data):
            yield index, f"{path}: entry {index}", entry
        return
    index = 0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}: entry {index}"
        try:
            yield index, where, json.loads(line)
        except json.JSONDecodeError as exc:
            yield index, where, ManifestError(f"{path}:{line_no}: entry {index}: not valid JSON ({exc.msg})")
        index += 1


def _field_error(where: str, name: str, problem: str) -> ManifestError:
    return ManifestError(f"{where}: field '{name}': {problem}")


def _turns(entry: dict, where: str) -> list[str]:
    conv = entry.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise _field_error(where, "conversations", "expected a non-empty list of {from, value} turns")
    turns = []
    for k, turn in enumerate(conv):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise _field_error(where, f"conversations[{k}]", "expected an object with a string 'value'")
        turns.append(turn["value"])
    return turns


def _int_field(entry: dict, name: str, where: str, minimum: int = 1) -> int | None:
    if name not in entry or entry[name] is None:
        return None
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise _field_error(where, name, f"expected a number >= {minimum}, got {value!r}")
    return int(value)


def _image_size(entry: dict, image: str, root: Path, where: str) -> tuple[int, int]:
    width, height = _int_field(entry, "width", where), _int_field(entry, "height", where)
    if width is not None and height is not None:
        return width, height
    file = root / image
    if not file.is_file():
        raise _field_error(where, "image", f"file '{file}' not found (give 'width' and 'height' "
                                           "to read the manifest without the images)")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as img:
            return img.size
    except (UnidentifiedImageError, OSError) as exc:
        raise _field_error(where, "image", f"cannot read the header of '{file}' ({exc})") from None


def _parse(entry: Any, index: int, where: str, root: Path, tokenizer: Any) -> _Raw:
    if not isinstance(entry, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    turns = _turns(entry, where)
    placeholders = sum(t.count(IMAGE_PLACEHOLDER) for t in turns)
    text = [t.replace(IMAGE_PLACEHOLDER, "") for t in turns]
    raw = _Raw(str(entry.get("id", index)), Modality.TEXT, count_text_tokens(text, tokenizer))
    image, video = entry.get("image"), entry.get("video")
    if image is not None and video is not None:
        raise _field_error(where, "video", "an entry has either 'image' or 'video', not both")
    if video is not None:
        if not isinstance(video, str):
            raise _field_error(where, "video", f"expected a path, got {video!r}")
        frames = _int_field(entry, "frames", where)
        duration = entry.get("duration")
        if frames is None:
            if isinstance(duration, bool) or not isinstance(duration, (int, float)) or duration <= 0:
                raise _field_error(where, "duration", "a video needs 'frames' or a positive 'duration' "
                                                      "(seconds)")
            raw.seconds = float(duration)
        else:
            raw.frames = frames
        raw.modality = Modality.VIDEO
        if placeholders > 1:
            raise _field_error(where, "conversations", f"{placeholders} <image> placeholders for one video")
        return raw
    if image is None:
        if placeholders:
            raise _field_error(where, "conversations",
                               f"{placeholders} <image> placeholder(s) but the entry has no image or video")
        return raw
    paths = [image] if isinstance(image, str) else image
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise _field_error(where, "image", f"expected a path or a list of paths, got {image!r}")
    if placeholders > len(paths):
        raise _field_error(where, "conversations",
                           f"{placeholders} <image> placeholders but {len(paths)} image(s)")
    if len(paths) == 1:
        raw.modality, raw.size = Modality.IMAGE, _image_size(entry, paths[0], root, where)
    else:
        raw.modality, raw.images = Modality.MULTI_IMAGE, len(paths)
    return raw


def read_manifest(path: str | Path, encoder: EncoderSpec, *, image_root: str | Path | None = None,
                  tokenizer: Any = None, skip_bad: bool = False, limit: int | None = None) -> ManifestReport:
    """Read a manifest into samples whose tiles and tokens follow ``encoder``'s tiling rules."""
    path = Path(path)
    root = Path(image_root) if image_root is not None else path.parent
    tiling = encoder.tiling
    rows: list[_Raw] = []
    report = ManifestReport(samples=SampleTable.build([], [], [], [], []))
    for index, where, entry in _entries(path):
        if limit is not None and len(rows) >= limit:
            break
        try:
            if isinstance(entry, ManifestError):
                raise entry
            rows.append(_parse(entry, index, where, root, tokenizer))
        except ManifestError as exc:
            if not skip_bad:
                raise
            report.skipped += 1
            if len(report.problems) < 10:
                report.problems.append(str(exc))
    if not rows:
        raise ManifestError(f"{path}: no readable entries"
                            + (f" ({report.skipped} skipped)" if report.skipped else ""))
    report.samples = _to_table(rows, tiling)
    return report


def _to_table(rows: list[_Raw], tiling) -> SampleTable:
    n = len(rows)
    modality = np.array([r.modality.code for r in rows], dtype=np.int8)
    tiles = np.zeros(n, dtype=np.int64)
    image_tokens = np.zeros(n, dtype=np.int64)
    single = [k for k, r in enumerate(rows) if r.modality is Modality.IMAGE]
    if single:
        w = np.array([rows[k].size[0] for k in single])
        h = np.array([rows[k].size[1] for k in single])
        tiles[single], image_tokens[single] = vision.single_images(w, h, tiling)
    multi = [k for k, r in enumerate(rows) if r.modality is Modality.MULTI_IMAGE]
    if multi:
        tiles[multi], image_tokens[multi] = vision.multi_images(np.array([rows[k].images for k in multi]),
                                                                tiling)
    vids = [k for k, r in enumerate(rows) if r.modality is Modality.VIDEO]
    if vids:
        given = np.array([rows[k].frames for k in vids])
        sampled = vision.video_frames(np.array([rows[k].seconds for k in vids]), tiling)
        frames = np.where(given > 0, given, sampled)
        tiles[vids], image_tokens[vids] = vision.videos(frames, tiling)
    return SampleTable.build([r.id for r in rows], modality, tiles,
                             [r.text_tokens for r in rows], image_tokens)
