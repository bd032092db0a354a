"""`dflop profile check`: a profile's shapes measured again say how far the machine has moved."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error, dflop, dflop_json
from dflop.cost.store import FILENAME, ProfileStore, load_records
from dflop.profile.drift import POINTS, _around


@pytest.mark.alone  # timing: two measurements compared
def test_a_check_finds_the_parts_of_a_profile_measured_on_a_slower_machine(tmp_path):
    measured, doctored = tmp_path / "measured", tmp_path / "doctored"
    dflop_json("profile", "model", "--model", "tiny-llm", "--grid", "quick", "--repeats", 2, "--out", measured)
    doctored.mkdir()
    with (doctored / FILENAME).open("w") as f:  # as if blocks had run 3x slower when profiled
        for r in ProfileStore.in_dir(measured).read():
            slow = 3.0 if r["phase"] == "block" else 1.0
            f.write(json.dumps({**r, "fwd_ms": r["fwd_ms"] * slow, "bwd_ms": r["bwd_ms"] * slow}) + "\n")
    out = dflop_json("profile", "check", "--profiles", doctored, "--model", "tiny-llm", "--repeats", 3)
    [model] = out["models"]
    parts = {p["part"]: p["ratio"] for p in model["parts"]}
    assert model["model"] == "tiny-llm" and model["processes"] == 1 and set(parts) == {"block", "embed", "head"}
    # the machine's own drift since the store was measured moves every part alike; the doctoring, blocks only
    assert 1 / 6 < parts["block"] / parts["head"] < 2 / 3 and 1 / 6 < parts["block"] / parts["embed"] < 2 / 3, parts
    text = dflop("profile", "check", "--profiles", doctored, "--model", "tiny-llm", "--repeats", 1)
    assert text.returncode == 0 and "tp1 block" in text.stdout and "the time it records" in text.stdout


@pytest.mark.processes
def test_the_shipped_profile_is_checked_the_way_it_was_measured_around_the_size_asked(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # measured with the profile's thread count, not this
    out = dflop_json("profile", "check", "--model", "tiny-llm", "--tokens", 100, "--repeats", 1)
    [model] = out["models"]
    assert model["processes"] == 2 and model["threads"] == 1 and {s["tp"] for s in model["shapes"]} == {1, 2}
    assert {s["shape"]["tokens"] for s in model["shapes"]} == {128, 256, 512}  # the grid's smallest three
    # "then" is the shipped record itself; the ratio, whatever this machine's speed, is now over then summed
    stored = {(r["tp"], r["phase"], json.dumps(r["shape"], sort_keys=True)): r["fwd_ms"] + r["bwd_ms"]
              for r in load_records((), None, shipped=True)
              if r["model"] == "tiny-llm" and r["device"] == "cpu" and r.get("processes", 1) == 2}
    for s in model["shapes"]:
        assert s["then_ms"] == pytest.approx(stored[s["tp"], s["part"], json.dumps(s["shape"], sort_keys=True)])
        assert s["now_ms"] > 0
    now, then = (sum(s[k] for s in model["shapes"]) for k in ("now_ms", "then_ms"))
    assert model["ratio"] == pytest.approx(now / then) and out["ratio"] == pytest.approx(now / then)


@pytest.mark.processes
def test_a_profile_measured_with_more_threads_is_checked_with_as_many(tmp_path):
    with (tmp_path / FILENAME).open("w") as f:
        for r in load_records((), None, shipped=True):
            if r["model"] == "tiny-llm" and r["tp"] == 1:
                f.write(json.dumps({**r, "threads": 2, "processes": 1}) + "\n")
    out = dflop_json("profile", "check", "--profiles", tmp_path, "--model", "tiny-llm", "--repeats", 1)
    [model] = out["models"]
    assert (model["processes"], model["threads"]) == (1, 2) and len(model["shapes"]) == 3 * POINTS


@given(st.sets(st.integers(1, 10**6), min_size=1, max_size=20), st.none() | st.integers(0, 2 * 10**6))
def test_the_shapes_measured_again_are_consecutive_grid_sizes_around_the_one_asked(values, near):
    chosen = _around(values, POINTS, near)
    assert len(chosen) == min(POINTS, len(values)) and set(chosen) <= values
    assert len([v for v in values if min(chosen) <= v <= max(chosen)]) == len(chosen)  # consecutive
    if near is None:  # the middle of the grid
        assert abs(sum(v < min(chosen) for v in values) - sum(v > max(chosen) for v in values)) <= 1
    else:
        assert min(values, key=lambda v: (abs(v - near), v)) in chosen


@pytest.mark.processes
def test_bad_input(tmp_path):
    assert_one_line_error(dflop("profile", "check", "--model", "siglip-so400m"),
                          "--model siglip-so400m: the profile holds no records of it on cpu")
    assert_one_line_error(dflop("profile", "check", "--model", "gpt-5"), "unknown model 'gpt-5'")
    assert_one_line_error(dflop("profile", "check", "--profiles", tmp_path / "nowhere"),
                          f"--profiles {tmp_path / 'nowhere'}: not a folder")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(dflop("profile", "check", "--profiles", tmp_path / "empty"),
                          "--profiles: no records measured on cpu")
    if not torch.cuda.is_available():
        assert_one_line_error(dflop("profile", "check", "--device", "cuda"),
                              "--device cuda: this machine has no CUDA device")
