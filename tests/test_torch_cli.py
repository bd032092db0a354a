"""`dflop run --backend torch` as a user runs it: spawned locally, and under torchrun."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import assert_one_line_error, dflop, dflop_json

pytestmark = pytest.mark.processes

TINY = {"encoder": "tiny-vit", "llm": "tiny-llm", "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2},
        "training": {"global_batch": 4}, "data": {"preset": "llava-ov", "samples": 300}, "steps": 2,
        "plan": {"encoder": {"dp": 2}, "llm": {"dp": 2}, "placement": "colocated", "microbatches": 1},
        "execution": {"calibrate": False}}
"""Uncalibrated: a calibrated torch run and its report are ``test_calibration``'s."""


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """(config, output folder, JSON) of one torch run of TINY."""
    folder = tmp_path_factory.mktemp("torch-run")
    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    out = folder / "run"
    return config, out, dflop_json("run", "--backend", "torch", "--config", config, "--out", out)


def test_torch_run_reports_measured_and_predicted_steps_losses_and_artifacts(torch_run):
    _, out, r = torch_run
    assert r["backend"] == "torch" and r["steps"] == 2 and len(r["losses"]) == 2
    assert r["step_time_s"]["mean"] > 0 and r["predicted_step_time_s"]["mean"] > 0
    graph, predicted = r["graph_time_s"]["each"], r["predicted_step_time_s"]["each"]
    assert all(0 < g < s for g, s in zip(graph, r["step_time_s"]["each"]))  # the optimizer step comes after
    assert r["measured_prediction_error"] == pytest.approx(predicted[1] / graph[1] - 1)  # step 1: one-time costs
    assert r["baseline"]["plan"]["describe"] == r["plan"]["describe"]  # same plan, arrival-order batches
    assert r["speedup"] == pytest.approx(r["baseline"]["step_time_s"]["mean"] / r["step_time_s"]["mean"])
    for key in ("trace", "predicted_trace", "baseline_trace", "timeline", "plan"):
        assert (out / r["artifacts"][key].split("/")[-1]).exists()
    trace = json.loads((out / "dflop.trace.json").read_text())
    assert trace["otherData"]["backend"] == "torch" and len(trace["otherData"]["steps"]) == 2
    assert sorted(p.name for p in (out / "schedules" / "dflop").iterdir()) == ["step-000000.json", "step-000001.json"]


def test_the_torch_run_reports_what_the_simulated_run_reports_and_its_training(torch_run, tmp_path):
    """One JSON schema: the same keys, nested ones too, but for what only a backend that trains has
    (``TRAINING_FIELDS``, in dflop's arm and the baseline's)."""
    from dflop.jobs.run import CALIBRATION_FIELDS, TRAINING_FIELDS

    config, _, r = torch_run
    sim = dflop_json("run", "--config", config, "--out", tmp_path / "sim")

    def keys(report):
        apart = TRAINING_FIELDS + CALIBRATION_FIELDS
        return {k for k in report if k not in apart} | {f"{section}.{k}" for section in (
            "baseline", "artifacts", "step_time_s", "predicted_step_time_s", "expected") for k in report[section]
            if k not in apart}

    assert set(TRAINING_FIELDS) <= set(r) and set(TRAINING_FIELDS) <= set(r["baseline"])
    assert keys(r) == keys(sim) and not set(TRAINING_FIELDS) & set(sim)
    assert {k for k in r["baseline"] if k not in TRAINING_FIELDS + CALIBRATION_FIELDS} == set(sim["baseline"])
    assert r["backend"] == "torch" and sim["backend"] == "sim"


def test_a_resume_folder_without_a_run_is_a_clear_error(tmp_path):
    proc = dflop("run", "--backend", "torch", "--resume", tmp_path, "--out", tmp_path / "x")
    assert_one_line_error(proc, str(tmp_path), "nothing to resume", "dflop.plan.yaml")


def test_the_same_config_runs_under_torchrun_and_only_rank_0_reports(tiny_config, tmp_path):
    torchrun = str(Path(sys.executable).parent / "torchrun")  # installed with torch
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "dflop", "run", "--backend",
                           "torch", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["gpus"] == 2 and len(r["losses"]) == 2 and r["step_time_s"]["mean"] > 0


def test_torch_run_takes_a_plan_file_and_records_its_cluster(tmp_path):
    from dflop.specs.plan_file import PlannedCluster, load_plan

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({**{k: v for k, v in TINY.items() if k != "plan"}, "steps": 1}))
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({**TINY["plan"], "cluster": {"hardware": "cpu", "nodes": 1, "gpus_per_node": 2}}))
    out = tmp_path / "run"
    r = dflop_json("run", "--backend", "torch", "--config", config, "--plan", plan, "--out", out)
    assert r["plan"]["describe"] == r["baseline"]["plan"]["describe"] == load_plan(plan).plan.describe()
    assert load_plan(out / "dflop.plan.yaml").cluster == PlannedCluster(hardware="cpu", nodes=1, gpus_per_node=2)
