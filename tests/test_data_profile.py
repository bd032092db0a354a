import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflop.specs import presets
from dflop.workload import DataProfile, batches, mix, mix_names, profile_mix, synthesize, with_shares

SIGLIP = presets.encoder("siglip-so400m")


def test_mix_shares_and_determinism():
    a = synthesize(mix("llava-ov"), 4000, SIGLIP, seed=3)
    b = synthesize(mix("llava-ov"), 4000, SIGLIP, seed=3)
    assert all((getattr(a, f) == getattr(b, f)).all() for f in ("modality", "tiles", "text_tokens"))
    shares = np.bincount(a.modality, minlength=4) / len(a)
    spec = mix("llava-ov")
    for code, name in enumerate(["text", "image", "multi_image", "video"]):
        assert shares[code] == pytest.approx(spec.shares[name], abs=0.03)
    assert a.tiles[a.modality == 0].max() == 0          # text-only feeds the encoder nothing
    assert a.tiles[a.modality == 3].max() <= 32          # video frames are capped


@pytest.mark.parametrize("name", mix_names())
def test_every_preset_mix_is_valid(name):
    table = synthesize(mix(name), 500, SIGLIP)
    assert len(table) == 500 and (table.llm_tokens > 0).all()


def test_profile_summary_and_round_trip(tmp_path):
    prof = profile_mix("llava-ov", 2000, SIGLIP, seed=0)
    summary = prof.summary()
    assert sum(m["count"] for m in summary["modalities"].values()) == 2000
    video = summary["modalities"]["video"]
    assert video["tiles"]["max"] <= 32 and video["llm_tokens"]["p99"] >= video["llm_tokens"]["p50"]
    path = prof.save(tmp_path / "p.json")
    again = DataProfile.load(path)
    assert again.summary() == summary
    assert json.loads(path.read_text())["histograms"]["image"]["tiles"][2] >= 0


def test_profile_sampling_keeps_joint_shapes():
    prof = profile_mix("llava-ov", 500, SIGLIP)
    drawn = prof.sample(300, np.random.default_rng(1))
    rows = {(m, t, x) for m, t, x in zip(prof.samples.modality, prof.samples.tiles, prof.samples.text_tokens)}
    assert all((m, t, x) in rows for m, t, x in zip(drawn.modality, drawn.tiles, drawn.text_tokens))
    assert len(set(drawn.ids)) == 300


def test_shifted_shares():
    spec = with_shares(mix("llava-ov"), video=0.5, image=0.5)
    table = synthesize(spec, 2000, SIGLIP)
    assert set(np.unique(table.modality)) == {1, 3}


@given(n=st.integers(1, 60), batch=st.integers(1, 25), steps=st.integers(1, 12), seed=st.integers(0, 5))
def test_batches_lose_and_repeat_nothing(n, batch, steps, seed):
    table = synthesize(mix("llava-ov"), n, SIGLIP, seed=seed)
    stream = batches(table, batch, seed=seed)
    seen = Counter()
    for _ in range(steps):
        b = next(stream)
        assert len(b) == batch
        seen.update(b.ids)
    assert all(count == 1 for count in seen.values())          # ids are unique across the stream
    per_sample = Counter(i.split(":", 1)[1] for i in seen)
    assert max(per_sample.values()) - min(per_sample.values(), default=0) <= 1 or len(per_sample) < n
    epochs_done = (steps * batch) // n
    assert all(per_sample[s] >= epochs_done for s in table.ids)   # every sample once per epoch


# ---- `dflop profile data` on real datasets -----------------------------------------------------

def _dataset(tmp_path):
    from media_files import image, turns, write_json, write_jsonl

    image(tmp_path / "img/wide.jpg", (1000, 500), "JPEG")
    write_json(tmp_path / "llava.json", [
        {"id": "w", "image": "img/wide.jpg", "conversations": turns("<image>\nx")},
        {"id": "gone", "image": ["img/a.png", "img/b.png"], "conversations": turns("<image><image>")},
        {"id": "nan", "video": "v.mp4", "duration": float("nan"), "conversations": turns("x")},
        {"id": "t", "conversations": turns("hello")}])
    write_jsonl(tmp_path / "swift.jsonl", [
        {"messages": [{"role": "user", "content": "<image>hi"}], "images": ["img/wide.jpg"]},
        {"messages": [{"role": "user", "content": "<video>hi"}], "videos": ["v.mp4"], "frames": 4}])
    (tmp_path / "data.yaml").write_text("datasets:\n  - json_path: llava.json\n"
                                        "  - json_path: swift.jsonl\n    sampling_strategy: first:1\n")
    return tmp_path / "data.yaml"


@pytest.mark.processes
def test_cli_skip_bad_summary_and_per_source_counts(tmp_path):
    from cli_helpers import assert_one_line_error, dflop

    listed = _dataset(tmp_path)
    assert_one_line_error(dflop("profile", "data", "--dataset", listed, "--out", tmp_path / "p.json"),
                          "llava.json: entry 1: field 'image[0]'", "not found", "give --image-root")
    proc = dflop("profile", "data", "--dataset", listed, "--skip-bad", "--json", "--out", tmp_path / "p.json")
    out = json.loads(proc.stdout)
    assert out["samples"] == 3 and out["skipped"] == 2
    assert [(s["name"], s["format"], s["entries"], s["chosen"], s["samples"], s["skipped"])
            for s in out["source"]["sources"]] == [("llava.json", "llava", 4, 4, 2, 2),
                                                   ("swift.jsonl", "sharegpt", 2, 1, 1, 0)]
    assert out["source"]["skipped_reasons"] == {"missing file": 1, "field 'duration'": 1}
    stderr = proc.stderr.splitlines()
    assert stderr[0] == "dflop: skipped 2 bad entries: 1 missing file, 1 field 'duration'"
    assert any("llava.json: entry 2: field 'duration'" in line for line in stderr[1:])
    saved = DataProfile.load(tmp_path / "p.json")
    assert saved.source["sources"][1]["sampling"] == "first:1" and len(saved) == 3
    human = dflop("profile", "data", "--dataset", listed, "--skip-bad", "--out", tmp_path / "p.json").stdout
    assert "source swift.jsonl            1 samples of 2 entries (first:1, sharegpt)" in human


@pytest.mark.processes
def test_cli_format_encoder_config_and_video_layout(tmp_path):
    from cli_helpers import assert_one_line_error, dflop, dflop_json
    from media_files import turns, write_json

    manifest = write_json(tmp_path / "m.json", [{"video": "v.mp4", "frames": 3, "conversations": turns("x")}])
    assert_one_line_error(dflop("profile", "data", "--dataset", manifest, "--format", "data-yaml", "--out",
                                tmp_path / "p.json"), "m.json is a manifest, not a LLaVA-NeXT data YAML")
    grid = dflop_json("profile", "data", "--dataset", manifest, "--out", tmp_path / "p.json")
    one = dflop_json("profile", "data", "--dataset", manifest, "--video-newline", "one_token", "--out",
                     tmp_path / "p.json")
    assert (grid["all"]["llm_tokens"]["max"] - one["all"]["llm_tokens"]["max"]) == 3 * 210 - (3 * 196 + 1)
    vit = write_json(tmp_path / "vit/config.json", {
        "model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 384, "intermediate_size": 4304,
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14})
    out = dflop_json("profile", "data", "--dataset", manifest, "--encoder", vit, "--out", tmp_path / "p.json")
    assert out["source"]["encoder"] == "vit" and out["all"]["tiles"]["max"] == 3
    negative = dflop("profile", "data", "--dataset", manifest, "--seed", "-1", "--out", tmp_path / "p.json")
    assert negative.returncode == 2 and "Traceback" not in negative.stderr
