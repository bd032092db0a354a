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
