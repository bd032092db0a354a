"""The chat layouts people train with (issue 26): transformers-style content lists, MiniCPM-V,
Mantis, preference pairs, and InternVL's ``width_list``/``height_list``.

Expected tiles and tokens are worked out by hand, as in test_manifest.py, from SigLIP's anyres
rule (arithmetic in test_vision.py): 384x384 -> 2 tiles, 729 + 27*28 tokens; 1000x500 -> 7 tiles,
729 + 40*82; 4000x3000 -> 31 tiles, 729 + 70*94; each image of a multi-image sample one tile of
730 tokens; a video frame one tile of 196 + 14 tokens. Text: ceil(characters / 4) + 5 a turn.
"""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, dflop_here
from dflop.errors import DflopError, ManifestError
from dflop.specs import presets
from dflop.workload import Modality, read_manifest
from media_files import image, turns, write_jsonl

SIGLIP = presets.encoder("siglip-so400m")
INTERNVIT = presets.encoder("internvit-300m")
SQUARE, WIDE, PHOTO = (2, 729 + 27 * 28), (7, 729 + 40 * 82), (31, 729 + 70 * 94)


def make_images(folder):
    if not (folder / "images/wide.jpg").exists():
        image(folder / "images/square.png", (384, 384))
        image(folder / "images/wide.jpg", (1000, 500), "JPEG")
    return folder


@pytest.fixture
def folder(tmp_path):
    return make_images(tmp_path)


def text(t):
    return {"type": "text", "text": t}


def user(*content):
    return {"role": "user", "content": list(content)}


def said(role, content):
    return {"role": role, "content": content}


LAYOUTS = {
    "content-list": [
        # TRL / Idefics: a {"type": "image"} item per image of the top-level list.
        {"id": "cl-one", "messages": [user({"type": "image"}, text("What is it?")),
                                      {"role": "assistant", "content": [text("A square.")]}],
         "images": ["images/square.png"]},
        # Qwen2-VL: the files inline, one as an OpenAI image_url with a file:// URL.
        {"id": "cl-two", "messages": [user({"type": "image", "image": "images/wide.jpg"},
                                           {"type": "image_url", "image_url": {"url": "file://images/square.png"}},
                                           text("Compare.")), said("assistant", "x")]},
        # No file at all: the size from the entry.
        {"id": "cl-sized", "messages": [user({"type": "image", "image": "far/photo.jpg"}, text("Hm"))],
         "width": 4000, "height": 3000},
        {"id": "cl-video", "messages": [user({"type": "video"}, text("What happens?"))],
         "videos": ["clip.mp4"], "frames": 8},
    ],
    "minicpm-v": [
        {"id": "mc-one", "image": "images/wide.jpg",
         "conversations": [said("user", "<image>\nWhat?"), said("assistant", "Wide.")]},
        {"id": "mc-two", "image": {"<image_00>": "images/square.png", "<image_01>": "images/wide.jpg"},
         "conversations": [said("user", "<image_00>\n<image_01>\nCompare."), said("assistant", "x")]},
        # No <image>: the trainer puts the image first.
        {"id": "mc-front", "image": "images/square.png", "conversations": [said("user", "Size?")]},
    ],
    "mantis": [
        {"id": "ma-two", "images": [{"bytes": None, "path": "images/square.png"},
                                    {"bytes": None, "path": "images/wide.jpg"}],
         "conversation": [said("user", "<image><image>Which is wider?"), said("assistant", "The second.")]},
        {"id": "ma-one", "images": ["images/wide.jpg"], "conversation": [said("user", "Describe.")]},
    ],
    "preference": [
        # TRL: prompt, chosen and rejected as content lists.
        {"id": "pr-trl", "prompt": [user({"type": "image"}, text("What is it?"))],
         "chosen": [{"role": "assistant", "content": [text("A square.")]}],
         "rejected": [{"role": "assistant", "content": [text("A circle, surely.")]}],
         "images": ["images/square.png"]},
        # LLaMA-Factory's sharegpt ranking form: the prompt in conversations, one message a side.
        {"id": "pr-lf", "conversations": [{"from": "human", "value": "<image>Describe."}],
         "chosen": {"from": "gpt", "value": "Wide."}, "rejected": {"from": "gpt", "value": "Tall."},
         "images": ["images/wide.jpg"]},
        {"id": "pr-str", "prompt": "<image><image>Compare.", "chosen": "Left.", "rejected": "Right.",
         "images": ["images/square.png", "images/wide.jpg"]},
        # TRL's implicit prompt: both sides whole conversations.
        {"id": "pr-text", "chosen": [said("user", "Hi"), said("assistant", "Hello")],
         "rejected": [said("user", "Hi"), said("assistant", "Go away")]},
    ],
}
OLD = [{"id": "llava", "image": "images/wide.jpg", "conversations": turns("<image>\nx")},
       {"id": "sharegpt", "messages": [said("user", "<image>x")], "images": ["images/square.png"]}]

EXPECTED = {  # id: (modality, tiles, image tokens, text tokens)
    # "What is it?" (11) -> 3 + 5; "A square." (9) -> 3 + 5.
    "cl-one": (Modality.IMAGE, *SQUARE, 8 + 8),
    # Two images: one tile of 730 tokens each; "Compare." (8) -> 2 + 5, "x" -> 1 + 5.
    "cl-two": (Modality.MULTI_IMAGE, 2, 2 * 730, 7 + 6),
    "cl-sized": (Modality.IMAGE, *PHOTO, 1 + 5),
    "cl-video": (Modality.VIDEO, 8, 8 * 210, 4 + 5),                  # "What happens?" (13)
    # "\nWhat?" (6) -> 2 + 5; "Wide." (5) -> 2 + 5.
    "mc-one": (Modality.IMAGE, *WIDE, 7 + 7),
    "mc-two": (Modality.MULTI_IMAGE, 2, 2 * 730, 8 + 6),              # "\n\nCompare." (10)
    "mc-front": (Modality.IMAGE, *SQUARE, 2 + 5),
    # "Which is wider?" (15) -> 4 + 5; "The second." (11) -> 3 + 5.
    "ma-two": (Modality.MULTI_IMAGE, 2, 2 * 730, 9 + 8),
    "ma-one": (Modality.IMAGE, *WIDE, 3 + 5),
    # Pairs: the images encoded once a side, the text of both sequences (prompt + chosen,
    # prompt + rejected). "What is it?" 8, "A square." 8, "A circle, surely." (17) 5 + 5.
    "pr-trl": (Modality.IMAGE, 2 * SQUARE[0], 2 * SQUARE[1], (8 + 8) + (8 + 10)),
    # "Describe." (9) 3 + 5, "Wide." and "Tall." 2 + 5 each.
    "pr-lf": (Modality.IMAGE, 2 * WIDE[0], 2 * WIDE[1], (8 + 7) + (8 + 7)),
    # "Compare." 7, "Left." 7, "Right." 7; two images a side, 730 tokens each.
    "pr-str": (Modality.MULTI_IMAGE, 2 * 2, 2 * 2 * 730, (7 + 7) + (7 + 7)),
    # "Hi" 1 + 5, "Hello" 2 + 5, "Go away" 2 + 5.
    "pr-text": (Modality.TEXT, 0, 0, (6 + 7) + (6 + 7)),
    "llava": (Modality.IMAGE, *WIDE, (1 + 5) + (1 + 5)),                # "\nx", and turns()'s "ok"
    "sharegpt": (Modality.IMAGE, *SQUARE, 1 + 5),
}


def shapes(report):
    return {s.id: (s.modality, s.tiles, s.image_tokens, s.text_tokens) for s in report.samples}


def test_every_layout_detected_per_entry_in_one_file(folder):
    mixed = [e for layout in LAYOUTS.values() for e in layout] + OLD
    report = read_manifest(write_jsonl(folder / "mixed.jsonl", mixed), SIGLIP)
    assert shapes(report) == EXPECTED
    assert report.sources[0]["format"] == "content-list+llava+mantis+minicpm-v+preference+sharegpt"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forced_format_reads_its_layout(folder, layout):
    path = write_jsonl(folder / f"{layout}.jsonl", LAYOUTS[layout])
    report = read_manifest(path, SIGLIP, format=layout)
    assert shapes(report) == {e["id"]: EXPECTED[e["id"]] for e in LAYOUTS[layout]}
    assert report.sources[0]["format"] == layout


def test_the_cli_offers_exactly_the_formats_the_reader_knows():
    # the option's choices are written out in the CLI (importing the reader would slow `--help`)
    from dflop.cli.main import cli
    from dflop.workload.manifest import FORMATS

    option = next(p for p in cli.commands["profile"].commands["data"].params if p.name == "fmt")
    assert tuple(option.type.choices) == FORMATS


def test_format_option_on_the_command_line(folder):
    path = write_jsonl(folder / "pairs.jsonl", LAYOUTS["preference"])
    ran = dflop_here("profile", "data", "--dataset", path, "--format", "preference", "--json",
                     "--out", folder / "p.json")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["samples"] == 4
    ran = dflop_here("profile", "data", "--dataset", path, "--format", "mantis", "--out", folder / "q.json")
    assert_one_line_error(ran, "pairs.jsonl:1: entry 0: field 'chosen': not a key of the mantis schema")


@pytest.mark.parametrize("layout,entry,field", [
    ("content-list", OLD[1], "messages"),                 # string content is text: no placeholder for the image
    ("content-list", LAYOUTS["minicpm-v"][1], "image"),
    ("minicpm-v", LAYOUTS["content-list"][0], "messages"),
    ("minicpm-v", OLD[0], "conversations[0]"),                        # from/value, not role/content
    ("mantis", LAYOUTS["minicpm-v"][0], "image"),
    ("preference", LAYOUTS["mantis"][0], "conversation"),
    ("preference", OLD[1], "chosen"),
    ("llava", LAYOUTS["preference"][3], "chosen"),
    ("sharegpt", LAYOUTS["mantis"][1], "conversation"),
])
def test_forced_layout_that_does_not_fit_names_file_line_and_key(folder, layout, entry, field):
    fits = {"llava": OLD[0], "sharegpt": OLD[1]}.get(layout) or LAYOUTS[layout][0]
    path = write_jsonl(folder / "data.jsonl", [fits, entry])
    with pytest.raises(ManifestError, match=rf"^\S*data.jsonl:2: entry 1: field '{re.escape(field)}': [^\n]*$"):
        read_manifest(path, SIGLIP, format=layout)


@pytest.mark.parametrize("entry,field,problem", [
    ({"messages": [user({"type": "image"})], "images": []}, "messages", "1 image placeholder(s) for 0 file(s)"),
    ({"messages": [user(text("x"))], "images": ["images/wide.jpg"]}, "messages", "0 image placeholder(s) for 1"),
    ({"messages": [user({"type": "audio", "audio": "a.wav"})]}, "messages[0].content[0]", "expected an item"),
    ({"messages": [user({"type": "text"})]}, "messages[0].content[0]", "with a string 'text'"),
    ({"messages": [user({"type": "image", "image": 7})]}, "messages[0].content[0]", "expected a path, got 7"),
    ({"messages": [user({"type": "image_url"})]}, "messages[0].content[0]", "with a 'url'"),
    ({"messages": [user({"type": "image", "image": "gone.png"})]}, "images", "file"),
    ({"image": {"<image_00>": 3}, "conversations": [said("user", "x")]}, "image", "mapping of placeholders"),
    ({"image": ["images/wide.jpg"], "conversations": [said("user", "x")]}, "image", "a list is not"),
    ({"image": "images/wide.jpg", "conversations": [said("user", "<image><image>")]}, "conversations",
     "2 <image> placeholder(s) for 1 file(s)"),
    ({"images": ["images/wide.jpg"], "conversation": [said("user", "<image><image>")]}, "conversation",
     "2 <image> and 0 <video> placeholder(s) for 1 image(s)"),
    ({"images": [{"bytes": "AAAA"}], "conversation": [said("user", "x")]}, "images", "list of paths"),
    ({"conversation": [said("user", "x")], "video": "v.mp4"}, "video", "not a key of the mantis schema"),
    ({"prompt": "x", "chosen": "y"}, "rejected", "got nothing (missing)"),
    ({"prompt": "<image>x", "chosen": "<image>y", "rejected": "z", "images": ["images/wide.jpg"]}, "chosen",
     "2 image placeholder(s) for 1 file(s)"),
    ({"prompt": "x", "chosen": [{"role": "assistant", "content": "y", "image": 1}, 3], "rejected": "z"},
     "chosen[1]", "expected a string, or an object with 'content'"),
    ({"instruction": "x", "chosen": "y", "rejected": "z"}, "instruction", "not a key of the preference schema"),
    ({"prompt": [user({"type": "image", "image": "images/wide.jpg"})], "chosen": "y",
      "rejected": [user({"type": "image", "image": "images/square.png"})]}, "rejected", "names other images"),
    ({"image": ["p/a.jpg", "p/b.jpg"], "width_list": [10, 20], "height_list": [5], "conversations": turns("x")},
     "height_list", "1 value(s) for 2 file(s)"),
    ({"image": ["p/a.jpg", "p/b.jpg"], "width_list": [10, 20], "conversations": turns("x")},
     "height_list", "missing: give both 'width_list' and 'height_list'"),
    ({"image": "p/a.jpg", "width": 10, "height": 5, "width_list": [10], "height_list": [5],
      "conversations": turns("x")}, "width_list", "not both"),
])
def test_malformed_entries_of_each_layout(folder, entry, field, problem):
    path = write_jsonl(folder / "data.jsonl", [{"conversations": turns("ok")}, entry])
    with pytest.raises(ManifestError) as caught:
        read_manifest(path, SIGLIP)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: entry 1: field '{field}': ") and problem in message, message
    assert "\n" not in message


def test_internvl_width_and_height_lists_size_multi_image_entries(folder):
    entries = [
        # InternVL's documented multi-image form: no file is opened.
        {"id": 3, "image": ["p/a.jpg", "p/b.jpg"], "width_list": [1000, 4000], "height_list": [500, 3000],
         "conversations": turns("<image><image>")},
        {"id": 4, "image": "p/c.jpg", "width_list": [1000], "height_list": [500], "conversations": turns("<image>")},
    ]
    path = write_jsonl(folder / "internvl.jsonl", entries)
    report = read_manifest(path, INTERNVIT, skip_bad=True)
    assert report.skipped == 0
    # 2 images, at most 12 // 2 = 6 tiles each: 1000x500 -> 2x1 + thumbnail, 4000x3000 -> 3x2 + thumbnail;
    # one image 1000x500: 2x1 + thumbnail. 256 tokens a tile. Text: "" 0 + 5, "ok" 1 + 5.
    assert shapes(report) == {"3": (Modality.MULTI_IMAGE, 3 + 7, 10 * 256, 11),
                              "4": (Modality.IMAGE, 3, 3 * 256, 11)}


# ---- malformed variants of the new layouts: a one-line DflopError or a sample, nothing else ----------

WORDS = ["<image>", "<video>", "<image_00>", "images/wide.jpg", "images/square.png", "file://", "image",
         "text", "video", "image_url", "url", "path", "content", "role", ""]
KEYS = ["type", "text", "image", "video", "image_url", "url", "path", "content", "role", "value", "from",
        "images", "videos", "messages", "conversations", "conversation", "prompt", "chosen", "rejected",
        "width", "height", "width_list", "height_list", "frames", "duration", "system", "<image_00>"]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 5000) | st.floats() | st.sampled_from(WORDS) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=3),
    max_leaves=8)
BASES = [(layout, e) for layout, entries in LAYOUTS.items() for e in entries]


def mutate(value, data, depth=0):
    """``value`` with one thing somewhere inside it replaced, removed or added."""
    if isinstance(value, (dict, list)) and value and depth < 6 and data.draw(st.booleans()):
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        key = data.draw(st.sampled_from(keys))
        copy = dict(value) if isinstance(value, dict) else list(value)
        action = data.draw(st.sampled_from(["into", "into", "drop", "add"]))
        if action == "into":
            copy[key] = mutate(value[key], data, depth + 1)
        elif action == "drop":
            del copy[key]
        elif isinstance(copy, dict):
            copy[data.draw(st.sampled_from(KEYS))] = data.draw(JSON)
        else:
            copy.append(data.draw(JSON))
        return copy
    return data.draw(JSON)


@settings(max_examples=150, deadline=None)
@given(base=st.sampled_from(BASES), data=st.data())
def test_malformed_variants_fail_in_one_line(tmp_path_factory, base, data):
    folder = make_images(tmp_path_factory.getbasetemp() / "layouts")
    own, entry = base
    path = folder / "data.jsonl"
    path.write_text(json.dumps(entry) + "\n")
    assert len(read_manifest(path, SIGLIP, format=own).samples) == 1     # the entry as it was: read
    entry = mutate(entry, data)
    layout = data.draw(st.sampled_from(["auto", *LAYOUTS]))
    path.write_text(json.dumps(entry) + "\n")
    try:
        report = read_manifest(path, SIGLIP, format=layout)
    except DflopError as exc:
        assert str(exc) and "\n" not in str(exc), str(exc)
    else:
        assert len(report.samples) == 1
