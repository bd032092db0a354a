import json
import math

import pytest
from PIL import Image

from dflop.errors import ManifestError
from dflop.specs import presets
from dflop.workload import Modality, read_manifest
from dflop.workload.manifest import estimate_text_tokens

SIGLIP = presets.encoder("siglip-so400m")


def turns(question, answer):
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


@pytest.fixture
def dataset(tmp_path):
    """A small LLaVA-format dataset with real image files of different sizes."""
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (384, 384), "red").save(images / "square.png")
    Image.new("RGB", (1000, 500), "blue").save(images / "wide.png")
    Image.new("RGB", (64, 64), "green").save(images / "a.png")
    entries = [
        {"id": "square", "image": "images/square.png", "conversations": turns("<image>\n" + "q" * 39, "a" * 8)},
        {"id": "wide", "image": "images/wide.png", "conversations": turns("<image>\nwhat?", "wide")},
        # No file: the size comes from the entry's width/height.
        {"id": "photo", "image": "images/missing.jpg", "width": 4000, "height": 3000,
         "conversations": turns("<image>\nDescribe.", "A photo.")},
        {"id": "pair", "image": ["images/a.png", "images/square.png", "images/wide.png"],
         "conversations": turns("<image><image><image>\nCompare.", "Same.")},
        {"id": "clip", "video": "videos/clip.mp4", "duration": 42.5,
         "conversations": turns("<image>\nWhat happens?", "Things.")},
        {"id": "short", "video": "videos/short.mp4", "frames": 8,
         "conversations": turns("<image>\nAnd here?", "Less.")},
        {"id": "chat", "conversations": turns("Hello there", "General Kenobi")},
    ]
    return tmp_path, entries


def write_jsonl(path, entries):
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n")
    return path


def test_reads_shapes_by_the_rules(dataset):
    root, entries = dataset
    path = root / "data.json"
    path.write_text(json.dumps(entries))
    samples = {s.id: s for s in read_manifest(path, SIGLIP).samples}
    # Single images: base tile + anyres grid; tokens hand-computed in test_vision.py.
    assert (samples["square"].tiles, samples["square"].image_tokens) == (2, 729 + 27 * 28)
    assert (samples["wide"].tiles, samples["wide"].image_tokens) == (7, 729 + 40 * 82)
    assert (samples["photo"].tiles, samples["photo"].image_tokens) == (31, 729 + 70 * 94)
    # Multi-image: one tile per image, 729 tokens + 1 newline each.
    assert (samples["pair"].modality, samples["pair"].tiles, samples["pair"].image_tokens) == \
        (Modality.MULTI_IMAGE, 3, 3 * 730)
    # Video: 1 fps capped at 32 frames; 196 pooled tokens + 14 row newlines per frame.
    assert (samples["clip"].modality, samples["clip"].tiles, samples["clip"].image_tokens) == \
        (Modality.VIDEO, 32, 32 * 210)
    assert (samples["short"].tiles, samples["short"].image_tokens) == (8, 8 * 210)
    assert (samples["chat"].modality, samples["chat"].tiles, samples["chat"].image_tokens) == \
        (Modality.TEXT, 0, 0)
    # Text: ceil(chars / 4) + 5 template tokens per turn, the <image> placeholder removed.
    assert samples["square"].text_tokens == (math.ceil(40 / 4) + 5) + (math.ceil(8 / 4) + 5)
    assert samples["chat"].text_tokens == (math.ceil(11 / 4) + 5) + (math.ceil(14 / 4) + 5)
    assert samples["chat"].llm_tokens == samples["chat"].text_tokens


def test_jsonl_and_tokenizer(dataset):
    root, entries = dataset
    path = write_jsonl(root / "data.jsonl", entries)
    by_words = read_manifest(path, SIGLIP, tokenizer=lambda text: text.split())
    chat = {s.id: s for s in by_words.samples}["chat"]
    assert chat.text_tokens == (2 + 5) + (2 + 5)
    assert len(by_words.samples) == len(entries)


def test_internvit_rules(dataset):
    root, entries = dataset
    path = write_jsonl(root / "data.jsonl", entries)
    samples = {s.id: s for s in read_manifest(path, presets.encoder("internvit-300m")).samples}
    assert (samples["wide"].tiles, samples["wide"].image_tokens) == (3, 3 * 256)
    assert (samples["clip"].tiles, samples["clip"].image_tokens) == (32, 32 * 256)


def test_line_that_is_not_json(dataset):
    root, entries = dataset
    path = root / "data.jsonl"
    path.write_text(json.dumps(entries[0]) + "\n{not json\n" + json.dumps(entries[6]) + "\n")
    with pytest.raises(ManifestError, match=r"data.jsonl:2: entry 1: not valid JSON"):
        read_manifest(path, SIGLIP)
    report = read_manifest(path, SIGLIP, skip_bad=True)
    assert report.skipped == 1 and len(report.samples) == 2
    assert "data.jsonl:2" in report.problems[0]


def test_missing_image_file(dataset):
    root, entries = dataset
    path = write_jsonl(root / "data.jsonl", [{"image": "images/nope.png", "conversations": turns("x", "y")}])
    with pytest.raises(ManifestError, match=r"data.jsonl:1: entry 0: field 'image': file '.*nope.png' not found"):
        read_manifest(path, SIGLIP)


@pytest.mark.parametrize("entry,field", [
    ({"image": 3, "conversations": turns("x", "y")}, "image"),
    ({"conversations": "hello"}, "conversations"),
    ({"video": "v.mp4", "conversations": turns("x", "y")}, "duration"),
    ({"image": "images/a.png", "width": -4, "height": 5, "conversations": turns("x", "y")}, "width"),
    ({"conversations": turns("<image> x", "y")}, "conversations"),
])
def test_bad_fields_name_entry_and_field(dataset, entry, field):
    root, _ = dataset
    path = root / "data.json"
    path.write_text(json.dumps([{"conversations": turns("ok", "ok")}, entry]))
    with pytest.raises(ManifestError, match=rf"data.json: entry 1: field '{field}'"):
        read_manifest(path, SIGLIP)


def test_whole_file_not_json(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"id": 1},\n  oops]')
    with pytest.raises(ManifestError, match=r"data.json:2: not valid JSON"):
        read_manifest(path, SIGLIP)


def test_estimate_is_documented_rule():
    assert estimate_text_tokens(["abcd", "abcde"]) == (1 + 5) + (2 + 5)
