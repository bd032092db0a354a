"""--tokenizer: text tokens counted with a local tokenizer.json built here with `tokenizers`."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.errors import DflopError
from dflop.specs import presets
from dflop.workload import manifest, read_manifest
from media_files import turns, write_json

SIGLIP = presets.encoder("siglip-so400m")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A word-level tokenizer over a few words: whitespace and punctuation split, unknown words one token."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello there general kenobi you are a bold one"],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "ckpt" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


ENTRIES = [{"id": "a", "conversations": turns("hello there!", "general kenobi, you are a bold one")},
           {"id": "b", "conversations": turns("<image>\nhello", "x")}, ]
# "hello there!" -> hello, there, ! = 3; "general kenobi, you are a bold one" -> 8 (the comma is one);
# every turn adds 5 template tokens. The <image> placeholder is removed before counting.
EXPECTED = {"a": (3 + 5) + (8 + 5), "b": (1 + 5) + (1 + 5)}


def test_counts_with_the_tokenizer_file_or_its_folder(tmp_path, tokenizer_json, monkeypatch):
    entries = [ENTRIES[0], {**ENTRIES[1], "image": "i.png", "width": 10, "height": 10}]
    path = write_json(tmp_path / "m.json", entries)
    for given in (tokenizer_json, tokenizer_json.parent):
        report = read_manifest(path, SIGLIP, tokenizer=given)
        assert {s.id: s.text_tokens for s in report.samples} == EXPECTED
        assert report.text_tokens == f"tokenizer {tokenizer_json}"
    monkeypatch.setattr(manifest, "TOKENIZE_CHUNK", 1)      # counted in batches: order kept across batches
    assert [s.text_tokens for s in read_manifest(path, SIGLIP, tokenizer=tokenizer_json).samples] == \
        [EXPECTED["a"], EXPECTED["b"]]


@pytest.mark.processes
def test_profile_records_which_count_was_used(tmp_path, tokenizer_json):
    path = write_json(tmp_path / "m.json", [ENTRIES[0]])
    counted = dflop_json("profile", "data", "--dataset", path, "--tokenizer", tokenizer_json,
                         "--out", tmp_path / "p.json")
    assert counted["source"]["text_tokens"] == f"tokenizer {tokenizer_json}"
    assert counted["all"]["llm_tokens"]["max"] == EXPECTED["a"]
    estimated = dflop_json("profile", "data", "--dataset", path, "--out", tmp_path / "p.json")
    assert estimated["source"]["text_tokens"] == "estimate"
    assert estimated["all"]["llm_tokens"]["max"] == (3 + 5) + (9 + 5)   # ceil(12 / 4), ceil(34 / 4)


@pytest.mark.processes
def test_bad_tokenizer_files(tmp_path):
    path = write_json(tmp_path / "m.json", [ENTRIES[0]])
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DflopError, match=r"tokenizer.json: not a tokenizers tokenizer.json"):
        read_manifest(path, SIGLIP, tokenizer=tmp_path / "tokenizer.json")
    assert_one_line_error(dflop("profile", "data", "--dataset", path, "--tokenizer", tmp_path / "none",
                                "--out", tmp_path / "p.json"), "none: tokenizer not found")
