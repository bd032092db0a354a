import json

from cli_helpers import assert_one_line_error, dflop, dflop_json


def test_help_lists_every_command():
    top = dflop("--help")
    assert top.returncode == 0
    for command in ("run", "profile", "optimize", "schedule", "simulate", "plot"):
        assert f"  {command}" in top.stdout
    assert "data" in dflop("profile", "--help").stdout and "model" in dflop("profile", "--help").stdout
    assert "timeline" in dflop("plot", "--help").stdout


def test_profile_data_preset_is_deterministic(tmp_path):
    args = ("profile", "data", "--preset", "llava-ov", "--samples", 5000, "--out", tmp_path / "p.json")
    first, second = dflop_json(*args), dflop_json(*args)
    assert first == second
    assert first["samples"] == 5000
    assert set(first["modalities"]) == {"text", "image", "multi_image", "video"}
    for block in first["modalities"].values():
        for key in ("tiles", "llm_tokens"):
            assert set(block[key]) >= {"mean", "p50", "p99"}
    assert sum(b["count"] for b in first["modalities"].values()) == 5000
    assert json.loads((tmp_path / "p.json").read_text())["summary"]["all"] == first["all"]


def test_profile_data_plot(tmp_path):
    out = dflop_json("profile", "data", "--preset", "video-heavy", "--samples", 300, "--out",
                     tmp_path / "p.json", "--plot", tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and out["plot"].endswith("p.png")


def test_profile_data_from_manifest_skip_bad(tmp_path):
    manifest = tmp_path / "m.jsonl"
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}]}
    manifest.write_text(json.dumps(good) + "\nnot json\n" + json.dumps(good) + "\n")
    bad = dflop("profile", "data", "--dataset", manifest, "--out", tmp_path / "p.json")
    assert_one_line_error(bad, "m.jsonl:2: entry 1: not valid JSON")
    assert not (tmp_path / "p.json").exists()
    out = dflop_json("profile", "data", "--dataset", manifest, "--skip-bad", "--out", tmp_path / "p.json")
    assert out["samples"] == 2 and out["skipped"] == 1


def test_user_errors_are_one_line(tmp_path):
    assert_one_line_error(dflop("profile", "data", "--preset", "nope", "--out", tmp_path / "x.json"),
                          "unknown data preset 'nope'", "llava-ov")
    assert_one_line_error(dflop("profile", "data", "--out", tmp_path / "x.json"),
                          "exactly one of --dataset and --preset")
    assert_one_line_error(dflop("profile", "data", "--dataset", tmp_path / "none.json", "--out",
                                tmp_path / "x.json"), "none.json: manifest not found")
    assert_one_line_error(dflop("profile", "data", "--preset", "llava-ov", "--encoder", "vit",
                                "--out", tmp_path / "x.json"), "--encoder: unknown encoder 'vit'")


def test_debug_shows_the_traceback(tmp_path):
    proc = dflop("--debug", "profile", "data", "--preset", "nope", "--out", tmp_path / "x.json")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
