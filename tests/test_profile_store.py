"""The profile store keeps every record it is given, whatever state the file was left in."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cli_helpers import assert_only_error, dflop_here
from dflop.cost.store import FILENAME, ProfileStore, load_records
from dflop.errors import SpecError


def record(tokens, **extra):
    return {"device": "cpu", "module": "llm", "model": "tiny-llm", "dtype": "float32", "tp": 1,
            "phase": "block", "shape": {"tokens": tokens}, "fwd_ms": 1.0, "bwd_ms": 2.0,
            "memory_bytes": 10, **extra}


@given(torn=st.text(alphabet='{}":,abc0123 ', max_size=40), tokens=st.integers(1, 10**6))
def test_a_record_appended_after_a_torn_line_is_kept(tmp_path_factory, torn, tokens):
    store = ProfileStore.in_dir(tmp_path_factory.mktemp("store"))
    store.append(record(1))
    with store.path.open("a") as f:
        f.write(torn)  # an interrupted write: no newline at the end
    store.append(record(tokens + 1))
    warnings = []
    kept = {r["shape"]["tokens"] for r in store.read(warnings.append)}
    assert kept == {1, tokens + 1}
    assert len(warnings) <= 1


def test_a_store_that_is_a_folder_is_named(tmp_path):
    (tmp_path / FILENAME).mkdir()
    with pytest.raises(SpecError, match=f"^{tmp_path / FILENAME}: is a folder, expected a file$"):
        ProfileStore.in_dir(tmp_path).read()
    with pytest.raises(SpecError, match="is a folder, expected a file"):
        load_records([tmp_path], shipped=False)
    assert_only_error(dflop_here("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--out", tmp_path),
                      f"{tmp_path / FILENAME}: is a folder, expected a file")


def test_non_finite_and_deep_records_are_skipped_with_a_warning(tmp_path):
    store = ProfileStore.in_dir(tmp_path)
    store.append(record(1))
    with store.path.open("a") as f:
        f.write(json.dumps(record(2, fwd_ms=math.nan)) + "\n")
        f.write(json.dumps(record(3, shape={"tokens": math.inf})) + "\n")
        f.write("[" * 5000 + "]" * 5000 + "\n")
        f.write(json.dumps(record(5, tp=2, tp_comm="guessed")) + "\n")
    warnings = []
    assert [r["shape"]["tokens"] for r in store.read(warnings.append)] == [1]
    assert [w.split(": ", 1)[0] for w in warnings] == [f"{store.path}:{i}" for i in (2, 3, 4, 5)]
    assert "nested deeper than" in warnings[2]
    assert "field 'tp_comm' must be one of measured, modelled" in warnings[3]


def test_non_utf8_store_names_file_and_line(tmp_path):
    store = ProfileStore.in_dir(tmp_path)
    store.append(record(1))
    with store.path.open("ab") as f:
        f.write(b"\xff\n")
    with pytest.raises(SpecError, match=f"^{store.path}:2: not UTF-8 text"):
        store.read()
