"""Manifest schemas (LLaVA, ShareGPT / LLaMA-Factory / ms-swift, InternVL JSON lines) on real files.

Expected tiles and tokens are worked out by hand from the encoder rules; the anyres
and dynamic-tiling arithmetic for these sizes is spelled out in test_vision.py.
"""

import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.errors import ManifestError
from dflop.specs import presets
from dflop.workload import Modality, read_manifest
from dflop.workload.sample import unique_ids
from dflop.workload.tokens import estimate_text_tokens
from media_files import image, turns, write_json, write_jsonl

SIGLIP = presets.encoder("siglip-so400m")
INTERNVIT = presets.encoder("internvit-300m")
# SigLIP anyres (test_vision.py): 384x384 -> 2 tiles, 729 + 27*28 tokens; 1000x500 -> 7 tiles,
# 729 + 40*82; 4000x3000 -> 31 tiles, 729 + 70*94. A multi-image sample: 730 tokens an image.
SQUARE, WIDE, PHOTO = (2, 729 + 27 * 28), (7, 729 + 40 * 82), (31, 729 + 70 * 94)


@pytest.fixture
def folder(tmp_path):
    image(tmp_path / "images/square.png", (384, 384))
    image(tmp_path / "images/wide.jpg", (1000, 500), "JPEG")
    image(tmp_path / "images/a.png", (64, 64))
    return tmp_path


def by_id(report):
    return {s.id: s for s in report.samples}


LLAVA_ENTRIES = [
    {"id": "square", "image": "images/square.png", "conversations": turns("<image>\n" + "q" * 39, "a" * 8)},
    {"id": "wide", "image": "images/wide.jpg", "conversations": turns("<image>\nwhat?", "wide")},
    # No file: the size comes from the entry.
    {"id": "photo", "image": "elsewhere/photo.jpg", "width": 4000, "height": 3000,
     "conversations": turns("<image>\nDescribe.")},
    {"id": "three", "image": ["images/a.png", "images/square.png", "images/wide.jpg"],
     "conversations": turns("<image><image><image>\nCompare.")},
    {"id": "clip", "video": "videos/clip.mp4", "duration": 42.5, "conversations": turns("<image>\nWhat happens?")},
    {"id": "short", "video": "videos/short.mp4", "frames": 8, "conversations": turns("<video>\nAnd here?")},
    {"id": "chat", "conversations": turns("Hello there", "General Kenobi")},
    {"id": "lmms", "system_prompt": "Answer briefly.", "conversations": turns("Hello there", "General Kenobi")},
]


@pytest.mark.parametrize("suffix", ["json", "jsonl"])
def test_llava_schema_by_the_rules(folder, suffix):
    path = folder / f"data.{suffix}"
    write_json(path, LLAVA_ENTRIES) if suffix == "json" else write_jsonl(path, LLAVA_ENTRIES)
    report = read_manifest(path, SIGLIP)
    s = by_id(report)
    assert (s["square"].tiles, s["square"].image_tokens) == SQUARE
    assert (s["wide"].tiles, s["wide"].image_tokens) == WIDE          # size from the JPEG header
    assert (s["photo"].tiles, s["photo"].image_tokens) == PHOTO
    assert (s["three"].modality, s["three"].tiles, s["three"].image_tokens) == (Modality.MULTI_IMAGE, 3, 3 * 730)
    # 1 fps capped at 32 frames; 196 pooled tokens + 14 row newlines a frame.
    assert (s["clip"].modality, s["clip"].tiles, s["clip"].image_tokens) == (Modality.VIDEO, 32, 32 * 210)
    assert (s["short"].tiles, s["short"].image_tokens) == (8, 8 * 210)
    assert (s["chat"].modality, s["chat"].tiles, s["chat"].image_tokens) == (Modality.TEXT, 0, 0)
    # ceil(characters / 4) + 5 template tokens a turn, placeholders removed.
    assert s["square"].text_tokens == (math.ceil(40 / 4) + 5) + (math.ceil(8 / 4) + 5)
    assert s["chat"].text_tokens == (math.ceil(11 / 4) + 5) + (math.ceil(14 / 4) + 5)
    assert s["lmms"].text_tokens == s["chat"].text_tokens + math.ceil(15 / 4) + 5   # system_prompt: a turn
    assert report.sources[0]["format"] == "llava" and report.sources[0]["samples"] == 8


def test_sharegpt_schema_llamafactory_and_swift(folder):
    entries = [  # LLaMA-Factory's mllm_demo shape: placeholders anywhere, no newline needed
        {"messages": [{"role": "user", "content": "Who<image>is this?"},
                      {"role": "assistant", "content": "A square."}], "images": ["images/square.png"]},
        {"messages": [{"role": "user", "content": "<image>vs<image>"}, {"role": "assistant", "content": "x"}],
         "images": ["images/square.png", "images/wide.jpg"]},
        # ms-swift: a system prompt, and no placeholder (the trainer adds it)
        {"system": "Be brief.", "messages": [{"role": "user", "content": "Sizes?"},
                                             {"role": "assistant", "content": "Two."}],
         "images": ["images/wide.jpg"]},
        # LLaMA-Factory's default tags: conversations / from / value, with images and a video
        {"conversations": [{"from": "human", "value": "<image><video>Both?"}, {"from": "gpt", "value": "Yes"}],
         "images": ["images/wide.jpg"], "videos": ["v.mp4"], "duration": 5.0},
    ]
    path = write_json(folder / "sharegpt.json", entries)
    samples = list(read_manifest(path, SIGLIP).samples)
    assert [s.id for s in samples] == ["0", "1", "2", "3"]       # no id: the position
    assert (samples[0].modality, samples[0].tiles, samples[0].image_tokens) == (Modality.IMAGE, *SQUARE)
    assert samples[0].text_tokens == (math.ceil(len("Whois this?") / 4) + 5) + (math.ceil(9 / 4) + 5)
    assert (samples[1].modality, samples[1].tiles, samples[1].image_tokens) == (Modality.MULTI_IMAGE, 2, 2 * 730)
    assert (samples[2].tiles, samples[2].image_tokens) == WIDE
    assert samples[2].text_tokens == estimate_text_tokens(["Be brief.", "Sizes?", "Two."])
    # Image and video in one entry: a video sample whose tiles and tokens add up both.
    assert samples[3].modality == Modality.VIDEO
    assert (samples[3].tiles, samples[3].image_tokens) == (WIDE[0] + 5, WIDE[1] + 5 * 210)


def test_internvl_jsonl_with_size_lists_and_multi_image_tiling(folder):
    entries = [
        {"id": 1, "image": "images/wide.jpg", "conversations": turns("<image>\nx")},
        # Sizes as InternVL writes them: one per image, so no file is opened.
        {"id": 2, "image": ["p/a.jpg", "p/b.jpg", "p/c.jpg"], "width": [384, 1000, 4000],
         "height": [384, 500, 3000],
         "conversations": turns("Image-1: <image>\nImage-2: <image>\nImage-3: <image>")},
        {"id": 3, "image": ["p/a.jpg", "p/b.jpg"], "width": [1000, 4000], "height": [500, 3000],
         "conversations": turns("<image><image>")},
        {"id": 4, "image": [f"p/{k}.jpg" for k in range(7)], "width": [4000] * 7, "height": [3000] * 7,
         "conversations": turns("many")},
    ]
    path = write_jsonl(folder / "internvl.jsonl", entries)
    s = by_id(read_manifest(path, INTERNVIT, format="internvl"))
    assert (s["1"].tiles, s["1"].image_tokens) == (3, 3 * 256)      # 2x1 grid + thumbnail
    # 3 images: at most 12 // 3 = 4 tiles each: 384x384 -> 1x1 (no thumbnail), 1000x500 -> 2x1 + 1,
    # 4000x3000 -> 2x2 (ties 1x1 in aspect, wins on area) + 1.
    assert (s["2"].modality, s["2"].tiles, s["2"].image_tokens) == (Modality.MULTI_IMAGE, 1 + 3 + 5, 9 * 256)
    # 2 images: at most 6 tiles each: 1000x500 -> 2x1 + 1, 4000x3000 -> 3x2 (aspect 1.5 nearest 4:3) + 1.
    assert (s["3"].tiles, s["3"].image_tokens) == (3 + 7, 10 * 256)
    # 7 images: max(1, 12 // 7) = 1 tile each, and no thumbnail.
    assert (s["4"].tiles, s["4"].image_tokens) == (7, 7 * 256)
    # The same entries under SigLIP: one tile per image of a multi-image sample.
    s = by_id(read_manifest(path, SIGLIP))
    assert (s["2"].tiles, s["3"].tiles, s["4"].tiles) == (3, 2, 7)


def test_text_tokens_with_a_callable_tokenizer(folder):
    path = write_jsonl(folder / "data.jsonl", LLAVA_ENTRIES)
    chat = by_id(read_manifest(path, SIGLIP, tokenizer=lambda text: text.split()))["chat"]
    assert chat.text_tokens == (2 + 5) + (2 + 5)


def test_ids_stay_unique_and_rows_keep_their_identity(folder):
    """Issue 13: duplicate ids were kept, and a schedule applied by id put all duplicates in one bin."""
    import numpy as np

    from dflop.schedule.step import StepSchedule

    entries = [{"id": "x", "conversations": turns("q" * (10 * k))} for k in range(1, 5)]
    entries += [{"id": "x#2", "conversations": turns("taken")}, {"conversations": turns("no id")}]
    table = read_manifest(write_json(folder / "dup.json", entries), SIGLIP).samples
    assert list(table.ids) == ["x", "x#3", "x#4", "x#5", "x#2", "5"]
    assert len(set(table.ids)) == len(table)
    schedule = StepSchedule(tuple(table.ids), np.arange(len(table)), len(table), 1)
    assert schedule.aligned(table).tolist() == list(range(len(table)))   # each row in its own bin


@given(st.lists(st.sampled_from(["a", "b", "a#2", "a#3", "b#2", "1", 1, "1#2"]), max_size=30))
def test_unique_ids_invariants(raw):
    ids, renamed = unique_ids(raw)
    assert len(ids) == len(raw) and len(set(ids)) == len(ids)
    assert renamed == len(raw) - len({str(r) for r in raw})
    kept = [str(r) for k, r in enumerate(raw) if str(r) not in map(str, raw[:k])]
    assert [i for i in ids if i in kept] == kept                 # the first of each id keeps it, in order
    assert all(i == str(r) or i.startswith(f"{r}#") for i, r in zip(ids, raw))


def test_errors_name_file_line_entry_and_field(folder):
    path = folder / "data.jsonl"
    path.write_text(json.dumps(LLAVA_ENTRIES[6]) + "\n{not json\n" + json.dumps(LLAVA_ENTRIES[6]) + "\n")
    with pytest.raises(ManifestError, match=r"data.jsonl:2: entry 1: not valid JSON"):
        read_manifest(path, SIGLIP)
    report = read_manifest(path, SIGLIP, skip_bad=True)
    assert report.skipped == 1 and len(report.samples) == 2 and "data.jsonl:2" in report.problems[0]


@pytest.mark.parametrize("entry,field", [
    ({"image": 3, "conversations": turns("x")}, "image"),
    ({"conversations": "hello"}, "conversations"),
    ({"image": "images/a.png", "width": -4, "height": 5, "conversations": turns("x")}, "width"),
    ({"image": "images/a.png", "width": 4.5, "height": 5, "conversations": turns("x")}, "width"),
    ({"image": "images/a.png", "width": 40, "conversations": turns("x")}, "height"),
    ({"image": ["images/a.png", "images/a.png"], "width": [4], "height": [4], "conversations": turns("x")},
     "width"),
    ({"conversations": turns("<image> x")}, "conversations"),
    ({"image": "images/a.png", "conversations": turns("<image><image>")}, "conversations"),
    ({"video": "v.mp4", "frames": 0, "conversations": turns("x")}, "frames"),
    ({"video": ["a.mp4", "b.mp4"], "conversations": turns("x")}, "video"),
    ({"images": ["images/a.png"], "messages": [{"role": "user", "content": "<image><image>"}]}, "messages"),
    ({"images": "images/a.png", "messages": [{"role": "user", "content": "x"}]}, "images"),
    ({"images": ["images/a.png"], "image": "images/a.png", "messages": [{"role": "user", "content": "x"}]},
     "image"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]"),
])
def test_bad_fields_name_entry_and_field(folder, entry, field):
    path = write_json(folder / "data.json", [{"conversations": turns("ok")}, entry])
    with pytest.raises(ManifestError, match=rf"data.json: entry 1: field '{re.escape(field)}'"):
        read_manifest(path, SIGLIP)


def test_forced_schema_reads_nothing_silently(folder):
    entry = {"messages": [{"role": "user", "content": "<image>x"}], "images": ["images/a.png"]}
    path = write_json(folder / "data.json", [entry])
    assert read_manifest(path, SIGLIP).samples.tiles.tolist() == [2]
    with pytest.raises(ManifestError, match=r"field 'messages': not a key of the llava schema"):
        read_manifest(path, SIGLIP, format="llava")


def test_whole_file_problems(folder):
    path = folder / "data.json"
    path.write_text('[{"id": 1},\n  oops]')
    with pytest.raises(ManifestError, match=r"data.json:2: not valid JSON"):
        read_manifest(path, SIGLIP)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match=r"data.json: JSON nested too deeply"):
        read_manifest(path, SIGLIP)
    with pytest.raises(ManifestError, match=r"nothing.json: manifest not found"):
        read_manifest(folder / "nothing.json", SIGLIP)
    with pytest.raises(ManifestError, match=r"images: is a folder"):
        read_manifest(folder / "images", SIGLIP)


def test_non_utf8_bytes_name_file_and_line(folder):
    """Issue 13: non-UTF-8 bytes were an internal error."""
    good = json.dumps({"conversations": turns("fine")}).encode()
    bad = json.dumps({"conversations": turns("caf\u00e9")}).encode().replace(b"\\u00e9", b"\xe9")
    lines = folder / "data.jsonl"
    lines.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    with pytest.raises(ManifestError, match=r"data.jsonl:2: entry 1: not valid UTF-8 \(byte 0xe9 at column"):
        read_manifest(lines, SIGLIP)
    report = read_manifest(lines, SIGLIP, skip_bad=True)
    assert len(report.samples) == 2 and report.skips.counts == {"not valid UTF-8": 1}
    listed = folder / "data.json"
    listed.write_bytes(b"[" + good + b",\n" + bad + b"]")
    with pytest.raises(ManifestError, match=r"data.json:2: not valid UTF-8"):
        read_manifest(listed, SIGLIP, skip_bad=True)


def test_limit_and_nothing_readable(folder):
    path = write_jsonl(folder / "data.jsonl", LLAVA_ENTRIES)
    assert len(read_manifest(path, SIGLIP, limit=3).samples) == 3
    bad = write_jsonl(folder / "bad.jsonl", [{"image": "gone.png", "conversations": turns("<image>")},
                                             {"conversations": 5}, {"conversations": 6}])
    with pytest.raises(ManifestError, match=r"bad.jsonl: no readable entries \(3 skipped: 2 field "
                                            r"'conversations', 1 missing file; first: .*gone.png"):
        read_manifest(bad, SIGLIP, skip_bad=True)
