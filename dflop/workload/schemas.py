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

``content-list``: transformers-style messages (Aria, Idefics / SmolVLM, TRL,
Qwen2-VL's chat template), a ``content`` that is a list of items::

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}],
     "images": ["a.jpg"]}

Every ``{"type": "image"}`` item is one image (the processor's chat template
inserts one image token sequence per item), taken in order from ``images``;
an item may name its own file instead (``"image"``, ``"url"`` or ``"path"``, or
``{"type": "image_url", "image_url": {"url": ...}}``), and ``{"type": "video"}``
items do the same with ``videos``. The items without a file must match the
listed files one to one. A string ``content`` is plain text.

``minicpm-v``: ``conversations`` of ``role``/``content``, and ``image`` a path
(``<image>`` in the text, or none and the trainer puts it first) or a mapping
of placeholders to paths, ``{"<image_00>": "a.jpg", "<image_01>": "b.jpg"}``.

``mantis``: ``conversation`` (singular) of ``role``/``content``, ``images`` a
list of paths or of ``{"path": ...}`` objects (Mantis-Instruct's), at most one
``<image>`` per image.

``preference``: DPO pairs as LLaMA-Factory and TRL store them: ``prompt`` (or
``messages``/``conversations``; absent, the prompt is inside both answers as in
TRL's implicit-prompt form), ``chosen`` and ``rejected``, each a string, one
message or a list of messages (strings with ``<image>``, or content lists),
with ``images``/``videos`` shared by both sides. The trainer runs the pair as
two LLM sequences, prompt + chosen and prompt + rejected, in the same batch and
encodes the images once for each (TRL's DPOTrainer concatenates the pixel
values of both sides; LLaMA-Factory's pairwise collator makes two features):
the pair is one sample whose text is both sequences and whose media count
twice (``Parsed.copies``), so that it is never split across microbatches, as
the trainer never splits it. The sample is one sequence of the summed length
to the cost model, so its attention cost is the pair's at most twice over.

Every schema takes optional sizes, so that a manifest can be read without its
files: ``width``/``height`` (a number for one image, a list with one per
image, as InternVL writes them; ``width_list``/``height_list``, InternVL's
names for multi-image entries, read the same) and ``frames``/``duration``
(frames fed to the model, or seconds of video; a number for one video or a list).
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
    CONTENT_LIST = "content-list"
    MINICPM_V = "minicpm-v"
    MANTIS = "mantis"
    PREFERENCE = "preference"

    @property
    def file_keys(self) -> tuple[str, str]:
        """The keys that list an entry's images and videos (named in errors about their files)."""
        if self in (Schema.LLAVA, Schema.INTERNVL, Schema.MINICPM_V):
            return "image", "video"
        return "images", "videos"


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
    copies: int = 1
    """Times the trainer encodes the media (2 for a preference pair: once for each side)."""


def detect(entry: dict) -> Schema:
    """The schema an entry's keys show, checked in this order: ``chosen``/``rejected``
    (preference), ``conversation`` (mantis), a message whose ``content`` is a list
    (content-list), ``messages``/``images``/``videos`` (sharegpt), ``conversations`` of
    ``role``/``content`` or an ``image`` mapping (minicpm-v), else llava."""
    if "chosen" in entry or "rejected" in entry:
        return Schema.PREFERENCE
    if "conversation" in entry:
        return Schema.MANTIS
    conv = entry.get("messages") or entry.get("conversations")
    role_content = type(conv) is list and conv and type(conv[0]) is dict and "content" in conv[0]  # not from/value
    if role_content:
        for m in conv:  # (a loop, not any(): this runs for every entry)
            if type(m) is dict and type(m.get("content")) is list:
                return Schema.CONTENT_LIST
    if "messages" in entry or "images" in entry or "videos" in entry:
        return Schema.SHAREGPT
    if role_content or type(entry.get("image")) is dict:
        return Schema.MINICPM_V
    return Schema.LLAVA


def _texts(entry: dict, where: str, key: str, text_keys: tuple[str, ...]) -> list[str]:
    conv = entry.get(key)
    if not isinstance(conv, list) or not conv:
        got = "nothing (missing)" if conv is None else type(conv).__name__
        raise field_error(where, key, f"expected a non-empty list of turns, got {got}")
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
    wk, hk = "width", "height"
    if "width_list" in entry or "height_list" in entry:  # InternVL's names for multi-image entries
        if "width" in entry or "height" in entry:
            raise field_error(where, "width_list", "give 'width'/'height' or 'width_list'/'height_list', not both")
        wk, hk = "width_list", "height_list"
    w, h = entry.get(wk), entry.get(hk)
    if images == 1 and type(w) is int and type(h) is int and 1 <= w and 1 <= h and w * h <= media.MAX_PIXELS:
        return [(w, h)]  # the common cases, first
    if type(w) is list and type(h) is list and len(w) == len(h) == images and all(
            type(a) is int and type(b) is int and a >= 1 and b >= 1 and a * b <= media.MAX_PIXELS
            for a, b in zip(w, h)):
        return list(zip(w, h))
    widths = _per_item(entry, wk, images, where, lambda v, n: media.count(v, where, n, media.MAX_PIXELS))
    heights = _per_item(entry, hk, images, where, lambda v, n: media.count(v, where, n, media.MAX_PIXELS))
    if widths is None and heights is None:
        return None
    if widths is None or heights is None:
        missing = hk if heights is None else wk
        raise field_error(where, missing, f"missing: give both '{wk}' and '{hk}', or neither")
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


SOURCE_KEYS = {"image": ("image", "url", "path"), "video": ("video", "url", "path"), "image_url": ("image_url",)}


def _source(item: dict, kind: str, where: str, name: str) -> str | None:
    """The file an image or video item names (``file://`` dropped), or None: a placeholder."""
    value = next((item[k] for k in SOURCE_KEYS[kind] if item.get(k) is not None), None)
    if kind == "image_url":
        value = value.get("url") if type(value) is dict else value
        if value is None:
            raise field_error(where, name, "expected 'image_url' with a 'url'")
    if value is None or (type(value) is str and value):
        return value.removeprefix("file://") if value else None
    raise field_error(where, name, f"expected a path, got {value!r}")


def _messages(value: Any, where: str, key: str, tags: bool) -> tuple[list[str], list, list]:
    """Turns of a message list, one message or (a preference side) a string, with the images and
    videos its items name in order: a path, or None for a placeholder that the entry's file list
    fills. With ``tags``, ``<image>``/``<video>`` in a string are placeholders too."""
    if type(value) is str or type(value) is dict:
        value = [value]
    if type(value) is not list or not value:
        got = "nothing (missing)" if value is None else repr(value)[:40]
        raise field_error(where, key, f"expected a non-empty list of messages, got {got}")
    turns: list[str] = []
    images: list[str | None] = []
    videos: list[str | None] = []
    for k, message in enumerate(value):
        content = message.get("content", message.get("value")) if type(message) is dict else message
        if type(content) is str:
            if tags and "<" in content:
                images += [None] * content.count(IMAGE)
                videos += [None] * content.count(VIDEO)
                content = content.replace(IMAGE, "").replace(VIDEO, "")
            turns.append(content)
            continue
        if type(content) is not list:
            raise field_error(where, f"{key}[{k}]", "expected a string, or an object with 'content' "
                                                     "(a string or a list of items)")
        texts = []
        for j, item in enumerate(content):
            name = f"{key}[{k}].content[{j}]"
            kind = item.get("type") if type(item) is dict else None
            if kind == "text" and type(item.get("text")) is str:
                texts.append(item["text"])
            elif kind in SOURCE_KEYS:
                (videos if kind == "video" else images).append(_source(item, kind, where, name))
            else:
                raise field_error(where, name, "expected an item of type text (with a string 'text'), image, "
                                               f"image_url or video, got {repr(item)[:60]}")
        turns.append("".join(texts))
    return turns, images, videos


def _fill(items: list, files: list[str], where: str, key: str, files_key: str, lenient: bool) -> list[str]:
    """``items`` with their placeholders (None) taken from ``files`` in order, one each; with
    ``lenient``, no placeholder at all is fine too: the trainer puts the files first."""
    slots = items.count(None)
    if slots == len(files):
        pending = iter(files)
        return [p if p is not None else next(pending) for p in items] if slots else items
    if lenient and not slots:
        return files + items
    raise field_error(where, key, f"{slots} {files_key[:-1]} placeholder(s) for {len(files)} file(s) "
                                  f"in '{files_key}'")


def parse_content_list(entry: dict, where: str) -> Parsed:
    key = "messages" if "messages" in entry else "conversations"
    turns, images, videos = _messages(entry.get(key), where, key, tags=False)
    images = _fill(images, _paths(entry.get("images"), where, "images", single=False), where, key, "images", False)
    videos = _fill(videos, _paths(entry.get("videos"), where, "videos", single=False), where, key, "videos", False)
    return _media(entry, where, images, videos, _system(entry, where, "system", turns))


def parse_minicpm_v(entry: dict, where: str) -> Parsed:
    turns = _texts(entry, where, "conversations", ("content",))
    image = entry.get("image")
    if type(image) is dict:  # multi-image: {"<image_00>": path, ...}, each key a placeholder in the text
        if not image or not all(k and type(v) is str and v for k, v in image.items()):
            raise field_error(where, "image", "expected a path, or a mapping of placeholders such as "
                                              f"'<image_00>' to paths, got {repr(image)[:60]}")
        images = list(image.values())
        for tag in image:
            turns = [t.replace(tag, "") for t in turns]
    elif type(image) is list:
        raise field_error(where, "image", "expected a path, or a mapping of placeholders such as '<image_00>' to "
                                          "paths (a list is not MiniCPM-V's)")
    else:
        images = _paths(image, where, "image", single=True)
    turns = _placeholders(turns, len(images), 0, where, "conversations", strict=True)
    return _media(entry, where, images, [], turns)


def parse_mantis(entry: dict, where: str) -> Parsed:
    turns = _texts(entry, where, "conversation", ("content",))
    images = entry.get("images")
    if type(images) is list:  # Mantis-Instruct's {"bytes": ..., "path": ...} objects
        images = [p.get("path") if type(p) is dict else p for p in images]
    images = _paths(images, where, "images", single=False)
    turns = _placeholders(turns, len(images), 0, where, "conversation", strict=False)
    return _media(entry, where, images, [], turns)


def parse_preference(entry: dict, where: str) -> Parsed:
    """Both sequences of the pair as one sample: see the module's docstring."""
    prompt_key = next((k for k in ("prompt", "messages", "conversations") if k in entry), None)
    prompt = _messages(entry[prompt_key], where, prompt_key, tags=True) if prompt_key else ([], [], [])
    system = _system(entry, where, "system", [])
    files = [_paths(entry.get(k), where, k, single=False) for k in ("images", "videos")]
    sides = []
    for side in ("chosen", "rejected"):
        turns, images, videos = _messages(entry.get(side), where, side, tags=True)
        media = [_fill(prompt[m + 1] + items, files[m], where, side, ("images", "videos")[m], True)
                 for m, items in enumerate((images, videos))]
        if sides and media != sides[0][1]:
            raise field_error(where, side, "names other images or videos than 'chosen'")
        sides.append(([*system, *prompt[0], *turns], media))
    parsed = _media(entry, where, *sides[0][1], sides[0][0] + sides[1][0])
    parsed.copies = 2
    return parsed


PARSERS = {Schema.LLAVA: parse_llava, Schema.SHAREGPT: parse_sharegpt, Schema.INTERNVL: parse_llava,
           Schema.CONTENT_LIST: parse_content_list, Schema.MINICPM_V: parse_minicpm_v, Schema.MANTIS: parse_mantis,
           Schema.PREFERENCE: parse_preference}
NEW_LAYOUT_KEYS = ("chosen", "rejected", "conversation")
"""Keys that only a preference pair or a Mantis entry has: in any other schema, a mistake."""
FOREIGN_KEYS = {Schema.LLAVA: ("messages", "images", "videos", *NEW_LAYOUT_KEYS),
                Schema.SHAREGPT: ("image", "video", *NEW_LAYOUT_KEYS),
                Schema.CONTENT_LIST: ("image", "video", *NEW_LAYOUT_KEYS),
                Schema.MINICPM_V: ("messages", "images", "video", "videos", *NEW_LAYOUT_KEYS),
                Schema.MANTIS: ("image", "video", "videos", "messages", "conversations", "chosen", "rejected"),
                Schema.PREFERENCE: ("image", "video", "conversation", "instruction")}


def parse(entry: Any, where: str, forced: Schema | None) -> tuple[Schema, Parsed]:
    """The entry in the forced schema, or in the one its keys show (:func:`detect`)."""
    if not isinstance(entry, dict):
        raise EntryError(f"{where}: expected a JSON object, got {type(entry).__name__}", "not an object")
    schema = forced or detect(entry)
    for key in FOREIGN_KEYS.get(Schema.LLAVA if schema is Schema.INTERNVL else schema, ()):
        if entry.get(key):  # read, never ignored: a key of the other schema is a mistake
            raise field_error(where, key, f"not a key of the {schema.value} schema")
    return schema, PARSERS[schema](entry, where)
