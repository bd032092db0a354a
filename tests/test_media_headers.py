"""Sizes from file headers: real PNG/JPEG files and real videos written with PyAV; bad media."""

import json
from dataclasses import replace

import numpy as np
import pytest

from dflop.errors import ManifestError
from dflop.specs import presets
from dflop.workload import read_manifest
from media_files import image, png_header_claiming, turns, video, write_json, write_jsonl

SIGLIP = presets.encoder("siglip-so400m")
INTERNVIT = presets.encoder("internvit-300m")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    video(root / "v/three.mp4", seconds=3, fps=4)      # 12 frames in the mp4 header
    video(root / "v/three.mkv", seconds=3, fps=4)      # Matroska counts no frames: 3 s x 4 fps
    video(root / "v/ten.avi", seconds=10, fps=4)       # 40 frames
    video(root / "v/long.mp4", seconds=45, fps=1, size=8)
    return root


def test_llava_ov_frames_from_the_container_header(clips):
    entries = [{"id": name, "video": f"v/{name}", "conversations": turns("<image>\nWhat?")}
               for name in ("three.mp4", "three.mkv", "ten.avi", "long.mp4")]
    s = {x.id: x for x in read_manifest(write_jsonl(clips / "videos.jsonl", entries), SIGLIP).samples}
    # LLaVA-NeXT: every round(4 fps / 1 fps) = 4th frame: 12 frames -> 3, 40 -> 10; 45 at 1 fps -> 32 (cap).
    assert (s["three.mp4"].tiles, s["three.mp4"].image_tokens) == (3, 3 * 210)
    assert (s["three.mkv"].tiles, s["three.mkv"].image_tokens) == (3, 3 * 210)
    assert (s["ten.avi"].tiles, s["ten.avi"].image_tokens) == (10, 10 * 210)
    assert (s["long.mp4"].tiles, s["long.mp4"].image_tokens) == (32, 32 * 210)
    # The video token layout is an option: one newline after the whole video instead of one a row.
    one_token = replace(SIGLIP, tiling=replace(SIGLIP.tiling, video_newline="one_token"))
    s = {x.id: x for x in read_manifest(clips / "videos.jsonl", one_token).samples}
    assert s["three.mp4"].image_tokens == 3 * 196 + 1


def test_video_root_and_missing_video(clips, tmp_path):
    path = write_json(tmp_path / "m.json", [{"video": "three.mp4", "conversations": turns("<video>x")}])
    assert read_manifest(path, SIGLIP, video_root=clips / "v").samples.tiles.tolist() == [3]
    with pytest.raises(ManifestError, match=r"m.json: entry 0: field 'video': file '.*three.mp4' not found \(video "
                                            r"paths resolve against the manifest's folder: give --video-root"):
        read_manifest(path, SIGLIP)


def test_internvl_draws_8_to_32_frames_a_video_seeded(clips):
    entries = [{"id": k, "video": "v/three.mp4", "conversations": turns("<video>\nx")} for k in range(40)]
    entries.append({"id": "given", "video": "v/three.mp4", "frames": 5, "conversations": turns("x")})
    path = write_jsonl(clips / "ivl.jsonl", entries)
    first = read_manifest(path, INTERNVIT, seed=3).samples
    frames = first.tiles[:40]
    assert frames.min() >= 8 and frames.max() <= 32 and len(set(frames.tolist())) > 5
    assert (first.image_tokens == first.tiles * 256).all()
    assert first.tiles[40] == 5                                     # frames given in the entry win
    assert (read_manifest(path, INTERNVIT, seed=3).samples.tiles == first.tiles).all()
    assert not (read_manifest(path, INTERNVIT, seed=4).samples.tiles == first.tiles).all()


@pytest.mark.parametrize("field,value", [("duration", float("nan")), ("duration", float("inf")),
                                         ("duration", -3.0), ("duration", 1e12), ("frames", float("nan")),
                                         ("duration", "long")])
def test_nan_infinite_and_absurd_video_lengths_are_errors(tmp_path, field, value):
    """Issue 13: a duration of NaN or infinity became 1 frame with a numpy warning."""
    entries = [{"id": "ok", "video": "a.mp4", "duration": 3.0, "conversations": turns("x")},
               {"id": "bad", "video": "b.mp4", field: value, "conversations": turns("x")}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in entries))   # json writes NaN and Infinity literally
    with pytest.raises(ManifestError, match=rf"m.jsonl:2: entry 1: field '{field}'"):
        read_manifest(path, SIGLIP)
    report = read_manifest(path, SIGLIP, skip_bad=True)
    assert report.samples.ids.tolist() == ["ok"] and report.skips.counts == {f"field '{field}'": 1}


def test_unreadable_and_empty_videos(tmp_path):
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 10)
    image(tmp_path / "still.png", (32, 32))
    entries = [{"video": "junk.mp4", "conversations": turns("x")},
               {"video": "still.png", "conversations": turns("x")}]
    path = write_json(tmp_path / "m.json", entries)
    with pytest.raises(ManifestError, match=r"entry 0: field 'video': cannot read the container header of"):
        read_manifest(path, SIGLIP)
    with pytest.raises(ManifestError, match=r"no readable entries \(2 skipped: 2 unreadable video"):
        read_manifest(path, SIGLIP, skip_bad=True)


def test_missing_multi_image_files_are_errors(tmp_path):
    """Issue 13: a multi-image entry whose files were missing was accepted."""
    image(tmp_path / "img/a.png", (64, 64))
    entry = {"id": "pair", "image": ["img/a.png", "img/b.png"], "conversations": turns("<image><image>")}
    path = write_json(tmp_path / "m.json", [entry])
    with pytest.raises(ManifestError, match=r"entry 0: field 'image\[1\]': file '.*img/b.png' not found \(image "
                                            r"paths resolve against the manifest's folder: give --image-root"):
        read_manifest(path, SIGLIP)
    image(tmp_path / "elsewhere/img/b.png", (64, 64))
    image(tmp_path / "elsewhere/img/a.png", (64, 64))
    assert read_manifest(path, SIGLIP, image_root=tmp_path / "elsewhere").samples.tiles.tolist() == [2]


def test_image_header_claiming_a_huge_size(tmp_path):
    """Issue 13: a PNG header claiming 100000 x 100000 raised an internal error, also under --skip-bad."""
    png_header_claiming(tmp_path / "bomb.png", 100_000, 100_000)
    image(tmp_path / "ok.png", (384, 384))
    entries = [{"id": "bomb", "image": "bomb.png", "conversations": turns("<image>")},
               {"id": "ok", "image": "ok.png", "conversations": turns("<image>")},
               {"id": "said", "image": "x.png", "width": 100_000, "height": 100_000, "conversations": turns("x")}]
    path = write_json(tmp_path / "m.json", entries)
    with pytest.raises(ManifestError, match=r"entry 0: field 'image': the header of '.*bomb.png' claims more "
                                            r"than 178956970 pixels"):
        read_manifest(path, SIGLIP)
    report = read_manifest(path, SIGLIP, skip_bad=True)
    assert report.samples.ids.tolist() == ["ok"] and report.skips.counts == {"image too large": 2}
    # Just under Pillow's limit the header is read (Pillow only warns there) and tiled.
    png_header_claiming(tmp_path / "big.png", 13_000, 13_000)
    write_json(path, [{"image": "big.png", "conversations": turns("<image>")}])
    assert read_manifest(path, SIGLIP).samples.tiles.tolist() == [37]


def test_corrupt_image_header(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff" + bytes(range(40)))
    path = write_json(tmp_path / "m.json", [{"image": "broken.jpg", "conversations": turns("<image>")}])
    with pytest.raises(ManifestError, match=r"entry 0: field 'image': cannot read the header of"):
        read_manifest(path, SIGLIP)


def test_multi_image_sizes_are_read_only_when_the_rule_needs_them(tmp_path):
    image(tmp_path / "a.png", (1000, 500))
    image(tmp_path / "b.png", (384, 384))
    path = write_json(tmp_path / "m.json", [{"image": ["a.png", "b.png"], "conversations": turns("x")}])
    assert read_manifest(path, SIGLIP).samples.tiles.tolist() == [2]
    # InternVL: at most 12 // 2 = 6 tiles each: 1000x500 -> 2x1 + thumbnail, 384x384 -> 1.
    assert read_manifest(path, INTERNVIT).samples.tiles.tolist() == [4]
    assert np.array_equal(read_manifest(path, INTERNVIT).samples.image_tokens, [4 * 256])
