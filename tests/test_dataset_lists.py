"""Dataset lists: LLaVA-NeXT's data YAML and InternVL's meta JSON, their sampling and roots."""

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.errors import ManifestError
from dflop.specs import presets
from dflop.workload import profile_mix, read_manifest
from dflop.workload.dataset_list import Sampling
from media_files import image, turns, write_json, write_jsonl

SIGLIP = presets.encoder("siglip-so400m")
INTERNVIT = presets.encoder("internvit-300m")


def texts(prefix, n):
    return [{"id": f"{prefix}{k}", "conversations": turns("x" * 4 * (k + 1))} for k in range(n)]


@pytest.fixture
def lists(tmp_path):
    write_json(tmp_path / "jsons/a.json", texts("a", 10))
    write_jsonl(tmp_path / "jsons/b.jsonl", texts("b", 8))
    return tmp_path


def data_yaml(folder, *items):
    body = "".join(f"  - json_path: {path}\n    sampling_strategy: \"{how}\"\n" for path, how in items)
    (folder / "data.yaml").write_text("datasets:\n" + body)
    return folder / "data.yaml"


def test_llava_next_sampling_strategies(lists):
    path = data_yaml(lists, ("jsons/a.json", "first:3"), ("jsons/b.jsonl", "end:25%"),
                     ("jsons/a.json", "random:4"), ("jsons/b.jsonl", "all"))
    report = read_manifest(path, SIGLIP, seed=7)
    ids = report.samples.ids.tolist()
    assert ids[:3] == ["a0", "a1", "a2"]                         # first:3
    assert ids[3:5] == ["b6", "b7"]                              # end:25% of 8 = ceil(2.0)
    drawn = [i.split("#")[0] for i in ids[5:9]]                  # random:4, repeated ids renamed
    assert len(set(drawn)) == 4 and all(d.startswith("a") for d in drawn)
    assert ids[9:] == [f"b{k}" for k in range(6)] + ["b6#2", "b7#2"]   # end:25% took b6 and b7 first
    assert len(set(ids)) == len(ids) == 17
    assert [s["samples"] for s in report.sources] == [3, 2, 4, 8]
    assert [s["sampling"] for s in report.sources] == ["first:3", "end:25%", "random:4", "all"]
    assert report.kind == "data-yaml"
    again = read_manifest(path, SIGLIP, seed=7).samples.ids.tolist()
    other = read_manifest(path, SIGLIP, seed=8).samples.ids.tolist()
    assert again == ids and other[5:9] != ids[5:9]


@given(n=st.integers(0, 300), number=st.integers(1, 400), percent=st.booleans(),
       kind=st.sampled_from(["first", "end", "random"]))
def test_sampling_counts_match_llava_next(n, number, percent, kind):
    """LLaVA-NeXT keeps ceil(P * n / 100) for P%, else N; never more than the source has."""
    import math

    import numpy as np

    chosen = Sampling(kind, number, percent).select(n, np.random.default_rng(0))
    expected = min(n, math.ceil(number * n / 100) if percent else number)
    assert len(chosen) == expected and len(set(chosen.tolist())) == expected
    assert all(0 <= i < n for i in chosen.tolist())


def test_internvl_meta_roots_repeats_and_counts(tmp_path):
    image(tmp_path / "data/coco/1.jpg", (1000, 500), "JPEG")
    write_jsonl(tmp_path / "ann/coco.jsonl", [
        {"id": "c", "image": "1.jpg", "conversations": turns("<image>\nx")},
        {"image": ["1.jpg", "1.jpg", "1.jpg"], "conversations": turns("<image><image><image>")}])
    write_jsonl(tmp_path / "ann/text.jsonl", texts("t", 10))
    meta = {"{coco}": {"root": "data/coco/", "annotation": "ann/coco.jsonl", "repeat_time": 2, "length": 2,
                     "data_augment": False},
            "coco_small": {"root": "data/coco/", "annotation": "ann/coco.jsonl", "repeat_time": 1,
                           "max_dynamic_patch": 2},
            "text": {"root": "", "annotation": "ann/text.jsonl", "repeat_time": 0.35, "length": 12}}
    path = write_json(tmp_path / "meta.json", meta)
    report = read_manifest(path, INTERNVIT)
    s = report.samples
    # repeat_time 2: both entries twice, repeats renamed; ids of unnamed entries are source:position.
    assert s.ids.tolist()[:4] == ["c", "{coco}:1", "c#2", "{coco}:1#2"]
    # 1000x500 under max 12 tiles: 2x1 + thumbnail; three images at 12 // 3 = 4 each: 3 tiles each.
    assert s.tiles.tolist()[:4] == [3, 9, 3, 9]
    # max_dynamic_patch 2 for that source: 1000x500 -> 2x1 + thumbnail; 3 images at max(1, 2 // 3) = 1.
    assert s.tiles.tolist()[4:6] == [3, 3]
    # repeat_time 0.35 keeps the first int(10 * 0.35) = 3, as InternVL does.
    assert s.ids.tolist()[6:] == ["t0", "t1", "t2"]
    assert [(r["name"], r["entries"], r["samples"], r.get("declared_length")) for r in report.sources] == \
        [("{coco}", 2, 4, 2), ("coco_small", 2, 2, None), ("text", 10, 3, 12)]
    assert report.sources[0]["root"] == str(tmp_path / "data/coco")


def test_lists_resolve_against_their_folder_then_the_working_directory(tmp_path, monkeypatch):
    write_json(tmp_path / "repo/playground/a.json", texts("a", 2))
    (tmp_path / "repo/scripts").mkdir(parents=True)
    listed = tmp_path / "repo/scripts/data.yaml"
    listed.write_text("datasets:\n  - json_path: playground/a.json\n")   # relative to the repo, as trained
    monkeypatch.chdir(tmp_path / "repo")
    assert read_manifest(listed, SIGLIP).samples.ids.tolist() == ["a0", "a1"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ManifestError, match=r"data.yaml: datasets\[0\].json_path: .*a.json: manifest not found "
                                            r"\(relative paths resolve against the list's folder"):
        read_manifest(listed, SIGLIP)
    write_json(tmp_path / "repo/scripts/playground/a.json", texts("s", 1))   # the list's folder comes first
    assert read_manifest(listed, SIGLIP).samples.ids.tolist() == ["s0"]


def test_image_root_is_the_base_of_relative_roots(tmp_path):
    image(tmp_path / "mnt/coco/1.png", (384, 384))
    write_jsonl(tmp_path / "coco.jsonl", [{"image": "1.png", "conversations": turns("<image>")}])
    path = write_json(tmp_path / "lists/meta.json",
                      {"coco": {"root": "coco", "annotation": os.fspath(tmp_path / "coco.jsonl")}})
    with pytest.raises(ManifestError, match=r"image paths resolve against the root of .*meta.json: coco"):
        read_manifest(path, SIGLIP)
    assert read_manifest(path, SIGLIP, image_root=tmp_path / "mnt").samples.tiles.tolist() == [2]


@pytest.mark.parametrize("text,message", [
    ("datasets: []\n", r"not a LLaVA-NeXT data YAML \(expected a non-empty 'datasets' list"),
    ("encoder: siglip-so400m\nllm: qwen2.5-7b\n", r"found keys encoder, llm"),
    ("datasets:\n  - json_path: jsons/a.json\n    sampling_strategy: half\n",
     r"datasets\[0\].sampling_strategy: 'half' is not all, first:N, end:N or random:N"),
    ("datasets:\n  - json_path: jsons/a.json\n    sampling_strategy: 'first:2.5'\n", r"'first:2.5' is not all"),
    ("datasets:\n  - sampling_strategy: all\n", r"datasets\[0\].json_path: expected a path, got None"),
    ("datasets: [unclosed\n", r"data.yaml:2: not valid YAML"),
])
def test_data_yaml_errors(lists, text, message):
    (lists / "data.yaml").write_text(text)
    with pytest.raises(ManifestError, match=message):
        read_manifest(lists / "data.yaml", SIGLIP)


@pytest.mark.parametrize("entry,message", [
    ({"annotation": "jsons/a.json", "repeat_time": 1.5}, r"x.repeat_time: expected a whole number of repeats"),
    ({"annotation": "jsons/a.json", "repeat_time": 0}, r"x.repeat_time"),
    ({"annotation": "jsons/a.json", "repeat_time": float("nan")}, r"x.repeat_time: expected a number"),
    ({"annotation": "jsons/a.json", "length": -1}, r"x.length: expected a whole number"),
    ({"annotation": "jsons/missing.jsonl"}, r"x.annotation: .*missing.jsonl: manifest not found"),
    ({"root": "data/"}, r"x.annotation: expected a path, got None"),
])
def test_meta_json_errors(lists, entry, message):
    path = lists / "meta.json"
    path.write_text(json.dumps({"ok": {"annotation": "jsons/a.json"}, "x": entry}))
    with pytest.raises(ManifestError, match=message):
        read_manifest(path, SIGLIP)


def test_a_list_where_a_manifest_is_expected_and_the_reverse(lists):
    path = data_yaml(lists, ("jsons/a.json", "all"))
    with pytest.raises(ManifestError, match=r"data.yaml is a LLaVA-NeXT data YAML \(a dataset list\), not a "
                                            r"llava manifest: leave out --format"):
        read_manifest(path, SIGLIP, format="llava")
    with pytest.raises(ManifestError, match=r"a.json is a manifest, not an InternVL meta JSON"):
        read_manifest(lists / "jsons/a.json", SIGLIP, format="meta-json")
    meta = write_json(lists / "meta.json", {"x": {"annotation": "data.yaml", "repeat_time": 1}})
    with pytest.raises(ManifestError, match=r"meta.json: x.annotation: '.*data.yaml' is a LLaVA-NeXT data YAML "
                                            r"\(a dataset list\), not a manifest \(dataset lists do not nest\)"):
        read_manifest(meta, SIGLIP)
    data_yaml(lists, ("meta.json", "all"))
    with pytest.raises(ManifestError, match=r"is an InternVL meta JSON \(a dataset list\), not a manifest"):
        read_manifest(lists / "data.yaml", SIGLIP)
    profile = lists / "profile.json"
    profile_mix("text-only", 10, SIGLIP).save(profile)
    with pytest.raises(ManifestError, match=r"profile.json is a dflop data profile, not a dataset"):
        read_manifest(profile, SIGLIP)
