"""The manifest schemas in use, read into one form: turns of text, image and video paths, sizes.

``llava``: LLaVA-OneVision, LLaVA-Video, M4-Instruct, lmms-finetune, and
InternVL's JSON lines (``internvl`` is the same schema)::

    {"id": "x1", "image": "coco/1.jpg", "conversations": [{"from": "human", "value": "<image>\\nWhat?"},
                                                           {"from": "gpt", "value": "A cat."}]}

``image`` is a path or a list of paths, ``video`` a path; ``<image>`` stands
for an image or (LLaVA-Video) the video, ``<video>`` for the video; an optional
``system_prompt`` (lmms-finetune) is one more turn of text.

``sharegpt``: LLaMA-Factory and ms-swift::

    {"messages": [{"role": "user", "content": "<image><image>Compare."}, {"role": "assistant", ...}],
     "images": ["a.jpg", "b.jpg"], "videos": ["c.mp4"], "system": "..."}

with ``conversations``/``from``/``value`` accepted for ``messages``/``role``/
``content`` (LLaMA-Factory's default tags). ``<image>`` and ``<video>`` may
stand anywhere in the text; with none, the trainers add them, but a count
between zero and the number of files is an error, as LLaMA-Factory says.

Every schema takes optional sizes, so that a manifest can be read without its
files: ``width``/``height`` (a number for one image, a list with one per
image, as InternVL writes them) and ``frames``/``duration`` (frames fed to the
model, or seconds of video; a number for one video or a list).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from dflop.workload import media
from dflop.workload.entries import EntryError
from dflop.workload.media import field_error

IMAGE, VIDEO = "<image>", "<video>"


class Schema(str, Enum):
    LLAVA = "llava"
    SHAREGPT = "sharegpt"
    INTERNVL = "internvl"


@dataclass(slots=True)
class Parsed:
    """One entry, whatever its schema: text without placeholders, media paths and given sizes."""

    id: Any
    turns: list[str]
    images: list[str]
    videos: list[str]
    sizes: list[tuple[int, int]] | None
    frames: list[int] | None
    durations: list[float] | None


def detect(entry: dict) -> Schema:
    """The schema an entry's keys show."""
    if "messages" in entry or "images" in entry or "videos" in entry:
        return Schema.SHAREGPT
    return Schema.LLAVA


def _texts(entry: dict, where: str, key: str, text_keys: tuple[str, ...]) -> list[str]:
    conv = entry.get(key)
    if not isinstance(conv, list) or not conv:
        raise field_error(where, key, f"expected a non-empty list of turns, got {type(conv).__name__}")
    turns = []
    first = text_keys[0]
    for k, turn in enumerate(conv):
        text = turn.get(first) if type(turn) is dict else None
        if text is None and isinstance(turn, dict):
            text = next((turn[t] for t in text_keys[1:] if t in turn), None)
        if type(text) is not str:
            raise field_error(where, f"{key}[{k}]", f"expected an object with a string '{first}'")
        turns.append(text)
    return turns


def _paths(value: Any, where: str, name: str, single: bool) -> list[str]:
    """A path (when ``single``) or a list of paths; None, "" and [] are none."""
    if single and type(value) is str and value:
        return [value]
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, str):
        if single:
            return [value]
        raise field_error(where, name, f"expected a list of paths, got {value!r}")
    if isinstance(value, list) and all(isinstance(p, str) and p for p in value):
        return value
    raise field_error(where, name, f"expected a path or a list of paths, got {value!r}")


def _per_item(entry: dict, name: str, items: int, where: str, read: Callable[[Any, str], Any]) -> list | None:
    """A field given once for a single item or as a list with one value per item."""
    value = entry.get(name)
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if len(values) != items:
        raise field_error(where, name, f"{len(values)} value(s) for {items} file(s)")
    return [read(v, f"{name}[{k}]" if isinstance(value, list) else name) for k, v in enumerate(values)]


def _sizes(entry: dict, images: int, where: str) -> list[tuple[int, int]] | None:
    w, h = entry.get("width"), entry.get("height")
    if images == 1 and type(w) is int and type(h) is int and 1 <= w and 1 <= h and w * h <= media.MAX_PIXELS:
        return [(w, h)]  # the common cases, first
    if type(w) is list and type(h) is list and len(w) == len(h) == images and all(
            type(a) is int and type(b) is int and a >= 1 and b >= 1 and a * b <= media.MAX_PIXELS
            for a, b in zip(w, h)):
        return list(zip(w, h))
    widths = _per_item(entry, "width", images, where, lambda v, n: media.count(v, where, n, media.MAX_PIXELS))
    heights = _per_item(entry, "height", images, where, lambda v, n: media.count(v, where, n, media.MAX_PIXELS))
    if widths is None and heights is None:
        return None
    if widths is None or heights is None:
        missing = "height" if heights is None else "width"
        raise field_error(where, missing, "missing: give both 'width' and 'height', or neither")
    return [media.check_pixels(w, h, where, f"image {k}") for k, (w, h) in enumerate(zip(widths, heights))]


def _placeholders(turns: list[str], images: int, videos: int, where: str, key: str, strict: bool) -> list[str]:
    text = "".join(turns) if len(turns) > 1 else turns[0]
    n_image, n_video = text.count(IMAGE), text.count(VIDEO)
    if not images and not videos and (n_image or n_video):
        raise field_error(where, key, f"{n_image + n_video} placeholder(s) but the entry has no image or video")
    if strict:  # sharegpt: <image> per image, <video> per video (or none, and the trainer adds them)
        for tag, n, files in ((IMAGE, n_image, images), (VIDEO, n_video, videos)):
            if n and n != files:
                raise field_error(where, key, f"{n} {tag} placeholder(s) for {files} file(s)")
    elif n_image > images + videos or n_video > videos:
        raise field_error(where, key, f"{n_image} <image> and {n_video} <video> placeholder(s) for "
                                      f"{images} image(s) and {videos} video(s)")
    if n_image or n_video:
        return [t.replace(IMAGE, "").replace(VIDEO, "") if "<" in t else t for t in turns]
    return turns


def _media(entry: dict, where: str, images: list[str], videos: list[str], turns: list[str]) -> Parsed:
    sizes = _sizes(entry, len(images), where) if images else None
    if not videos:
        return Parsed(entry.get("id"), turns, images, videos, sizes, None, None)
    frames = _per_item(entry, "frames", len(videos), where,
                       lambda v, n: media.count(v, where, n, media.MAX_VIDEO_FRAMES))
    durations = _per_item(entry, "duration", len(videos), where, lambda v, n: media.seconds(v, where, n))
    return Parsed(entry.get("id"), turns, images, videos, sizes, frames, durations)


def _system(entry: dict, where: str, key: str, turns: list[str]) -> list[str]:
    system = entry.get(key)
    if system is None:
        return turns
    if not isinstance(system, str):
        raise field_error(where, key, f"expected a string, got {type(system).__name__}")
    return [system, *turns] if system else turns


def parse_llava(entry: dict, where: str) -> Parsed:
    turns = _texts(entry, where, "conversations", ("value",))
    images = _paths(entry.get("image"), where, "image", single=True)
    videos = _paths(entry.get("video"), where, "video", single=True)
    if len(videos) > 1:
        raise field_error(where, "video", "expected one path (a list of videos is the sharegpt schema's 'videos')")
    turns = _placeholders(turns, len(images), len(videos), where, "conversations", strict=False)
    return _media(entry, where, images, videos, _system(entry, where, "system_prompt", turns))


def parse_sharegpt(entry: dict, where: str) -> Parsed:
    key = "messages" if "messages" in entry else "conversations"
    turns = _texts(entry, where, key, ("content", "value"))
    images = _paths(entry.get("images"), where, "images", single=False)
    videos = _paths(entry.get("videos"), where, "videos", single=False)
    turns = _placeholders(turns, len(images), len(videos), where, key, strict=True)
    return _media(entry, where, images, videos, _system(entry, where, "system", turns))


PARSERS = {Schema.LLAVA: parse_llava, Schema.SHAREGPT: parse_sharegpt, Schema.INTERNVL: parse_llava}
FOREIGN_KEYS = {Schema.LLAVA: ("messages", "images", "videos"), Schema.SHAREGPT: ("image", "video")}


def parse(entry: Any, where: str, forced: Schema | None) -> tuple[Schema, Parsed]:
    """The entry in the forced schema, or in the one its keys show (``sharegpt`` when it has
    ``messages``, ``images`` or ``videos``, else ``llava``)."""
    if not isinstance(entry, dict):
        raise EntryError(f"{where}: expected a JSON object, got {type(entry).__name__}", "not an object")
    schema = forced or detect(entry)
    for key in FOREIGN_KEYS.get(Schema.LLAVA if schema is Schema.INTERNVL else schema, ()):
        if entry.get(key):  # read, never ignored: a key of the other schema is a mistake
            raise field_error(where, key, f"not a key of the {schema.value} schema")
    return schema, PARSERS[schema](entry, where)
