import json
from importlib.metadata import version
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, assert_only_error, dflop, dflop_here, dflop_json


@pytest.mark.processes
def test_help_lists_every_command():
    top = dflop("--help")
    assert top.returncode == 0
    for command in ("run", "profile", "optimize", "schedule", "simulate", "plot"):
        assert f"  {command}" in top.stdout
    assert "data" in dflop("profile", "--help").stdout and "model" in dflop("profile", "--help").stdout
    assert "timeline" in dflop("plot", "--help").stdout


@pytest.mark.processes
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


@pytest.mark.processes
def test_profile_data_plot(tmp_path):
    out = dflop_json("profile", "data", "--preset", "video-heavy", "--samples", 300, "--out",
                     tmp_path / "p.json", "--plot", tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and out["plot"].endswith("p.png")


@pytest.mark.processes
def test_profile_data_from_manifest_skip_bad(tmp_path):
    manifest = tmp_path / "m.jsonl"
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}]}
    manifest.write_text(json.dumps(good) + "\nnot json\n" + json.dumps(good) + "\n")
    bad = dflop("profile", "data", "--dataset", manifest, "--out", tmp_path / "p.json")
    assert_one_line_error(bad, "m.jsonl:2: entry 1: not valid JSON")
    assert not (tmp_path / "p.json").exists()
    out = dflop_json("profile", "data", "--dataset", manifest, "--skip-bad", "--out", tmp_path / "p.json")
    assert out["samples"] == 2 and out["skipped"] == 1


@pytest.mark.processes
def test_user_errors_are_one_line(tmp_path):
    assert_one_line_error(dflop("profile", "data", "--preset", "nope", "--out", tmp_path / "x.json"),
                          "unknown data preset 'nope'", "llava-ov")
    assert_one_line_error(dflop("profile", "data", "--out", tmp_path / "x.json"),
                          "exactly one of --dataset and --preset")
    assert_one_line_error(dflop("profile", "data", "--dataset", tmp_path / "none.json", "--out",
                                tmp_path / "x.json"), "none.json: manifest not found")
    assert_one_line_error(dflop("profile", "data", "--preset", "llava-ov", "--encoder", "vit",
                                "--out", tmp_path / "x.json"), "--encoder: unknown encoder 'vit'")


@pytest.mark.processes
def test_debug_shows_the_traceback(tmp_path):
    proc = dflop("--debug", "profile", "data", "--preset", "nope", "--out", tmp_path / "x.json")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_version():
    out = dflop_here("--version")
    assert out.returncode == 0 and out.stdout == f"dflop {version('dflop')}\n" and out.stderr == ""


@pytest.mark.processes
def test_debug_is_accepted_anywhere_on_the_line(tmp_path):
    for args in (("--debug", "profile", "data"), ("profile", "--debug", "data"), ("profile", "data", "--debug")):
        out = dflop_here(*args, "--preset", "text-only", "--samples", 10, "--out", tmp_path / "p.json", "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["samples"] == 10, out.stderr
    proc = dflop("profile", "data", "--preset", "nope", "--out", tmp_path / "x.json", "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "unknown data preset 'nope'" in proc.stderr


CONFIG = ("encoder: siglip-so400m\nllm: qwen2.5-7b\ncluster: {hardware: h100, nodes: 32, gpus_per_node: 8}\n"
          "training: {global_batch: 256}\n")


def config(tmp_path, extra=""):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG + extra)
    return path


def outputs(tmp_path):
    """Every command's output option, each given a path that cannot be written."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": []}')
    cfg = config(tmp_path)
    return [
        (("optimize", "--config", cfg), blocker / "plan.yaml", "plan.yaml: cannot be written, "),
        (("optimize", "--config", cfg), Path("/proc/dflop-nowhere/plan.yaml"), "/proc is not writable"),
        (("optimize", "--config", cfg), tmp_path, "is a folder, expected a file name"),
        (("simulate", "--config", cfg), blocker, "exists and is not a folder"),
        (("simulate", "--config", cfg), blocker / "sub", "cannot be written"),
        (("run", "--config", cfg), blocker, "exists and is not a folder"),
        (("plot", "timeline", trace), tmp_path / "t.xyz", "unsupported file type '.xyz'"),
        (("plot", "timeline", trace), tmp_path / "t", "no file type"),
        (("plot", "timeline", trace), tmp_path, "is a folder, expected a file name"),
        (("profile", "data", "--preset", "llava-ov"), tmp_path, "is a folder, expected a file name"),
        (("profile", "data", "--preset", "llava-ov"), blocker / "p.json", "cannot be written"),
        (("profile", "model", "--model", "tiny-llm"), blocker, "exists and is not a folder"),
    ]


def test_outputs_are_checked_before_any_work(tmp_path):
    """At 256 GPUs the search takes seconds: an output that cannot be written fails before it."""
    for command, out, message in outputs(tmp_path):
        ran = dflop_here(*command, "--out", out)
        assert_only_error(ran, "Invalid value for '--out'", str(out), message)
    ran = dflop_here("profile", "data", "--preset", "llava-ov", "--out", tmp_path / "p.json", "--plot",
                     tmp_path / "p.xyz")
    assert_only_error(ran, "Invalid value for '--plot'", "unsupported file type '.xyz'")
    assert not (tmp_path / "p.json").exists()


def test_the_path_reported_is_the_path_written(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 5}]}')
    for name in ("timeline.png", "timeline.svg", "timeline.PDF"):
        out = json.loads(dflop_here("plot", "timeline", trace, "--out", tmp_path / name, "--json").stdout)
        assert out["out"] == str(tmp_path / name) and (tmp_path / name).stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "timeline.PDF", "timeline.png", "timeline.svg"]


@pytest.mark.parametrize("extra,message", [
    ("scheduler: {solver: simplex}\n", "run.yaml: scheduler: solver: unknown solver 'simplex' (valid: auto, ilp"),
    ("data: {preset: video-only}\n", "run.yaml: data.preset: unknown data preset 'video-only' (known: llava-ov"),
    ("plan: {encoder: {}, llm: {dp: 8}, microbatches: 4, schedule: 2F2B}\n",
     "run.yaml: plan.schedule: unknown pipeline schedule '2F2B' (known: GPipe, 1F1B"),
    ("profiles: [no/such/folder]\n", ("run.yaml: profiles[0]: ", "no/such/folder: no such folder")),
    ("profiles: [.]\n", ("run.yaml: profiles[0]: ", ": holds no profile store (profile.jsonl")),
    ("scheduler: {time_limit: .inf}\n", "run.yaml: scheduler.time_limit: must be a finite number, got inf"),
    ("scheduler: {time_limit: .nan}\n", "run.yaml: scheduler.time_limit: must be a finite number, got nan"),
    ("seed: -1\n", "run.yaml: seed: must be at least 0, got -1"),
    ("data: {seed: -1}\n", "run.yaml: data.seed: must be at least 0, got -1"),
    ("data: {samples: 100000000000}\n", "run.yaml: data.samples: must be at most 10000000"),
    ("steps: 1000000000\n", "run.yaml: steps: must be at most 100000"),
    ("encoder: internvit-6b\n", "run.yaml:5: not valid YAML (duplicate key 'encoder' (first given on line 1))"),
    ("execution: {timeout_s: .inf}\n", "run.yaml: execution.timeout_s: must be a finite number, got inf"),
    ("execution: {checkpoint_every: -1}\n", "run.yaml: execution.checkpoint_every: must be at least 0, got -1"),
    ("execution: {lr: 0}\n", "run.yaml: execution: lr: must be positive, got 0.0"),
    ("execution: {decode_workers: -1}\n", "run.yaml: execution.decode_workers: must be at least 0, got -1"),
    ("execution: {decode_workers: 1.5}\n", "run.yaml: execution.decode_workers: expected an integer, got"),
    ("execution: {device: tpu}\n", "run.yaml: execution.device: 'tpu' is not one of 'cpu', 'cuda'"),
])
def test_config_errors_name_file_and_key_before_any_work(tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    path = config(tmp_path, extra)
    for command in (("optimize", "--out", "plan.yaml"), ("simulate",), ("run",), ("run", "--backend", "torch")):
        assert_only_error(dflop_here(*command, "--config", path), f"{path}",
                          *(message if isinstance(message, tuple) else (message,)))


def test_global_batch_too_large_to_allocate(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("global_batch: 256", "global_batch: 100000000000"))
    assert_only_error(dflop_here("optimize", "--config", path, "--out", tmp_path / "p.yaml"),
                      f"{path}: training.global_batch: must be at most 1000000, got 100000000000")


def test_sizes_and_seeds_on_the_command_line(tmp_path):
    out = tmp_path / "p.json"
    assert_only_error(dflop_here("profile", "data", "--preset", "llava-ov", "--samples", 10**10, "--out", out),
                      "Invalid value for '--samples'", "1<=x<=10000000")
    assert_only_error(dflop_here("profile", "data", "--preset", "llava-ov", "--seed", -1, "--out", out),
                      "Invalid value for '--seed'", "x>=0")
    assert_only_error(dflop_here("simulate", "--steps", 10**9, "--out", tmp_path), "Invalid value for '--steps'")
    for option in ("--gpus", "--nodes"):
        assert_only_error(dflop_here("optimize", option, 10**30, "--out", tmp_path / "p.yaml"),
                          f"Invalid value for '{option}'", "1<=x<=1000000")
    assert_only_error(dflop_here("simulate", "--schedule", "2F2B", "--out", tmp_path),
                      "Invalid value for '--schedule'", "unknown pipeline schedule '2F2B'")


def test_llm_option_applies_to_encoders_only(tmp_path):
    assert_only_error(dflop_here("profile", "model", "--model", "tiny-llm", "--llm", "tiny-llm", "--out", tmp_path),
                      "--llm tiny-llm: applies only when profiling an encoder", "tiny-llm is an LLM")
    assert_only_error(dflop_here("profile", "model", "--model", "tiny-vit", "--llm", "gpt", "--out", tmp_path),
                      "--llm: unknown LLM 'gpt'")
    assert not (tmp_path / "profile.jsonl").exists()
