"""The files under examples/ are what the README runs: they must load and do what it says."""

import json
from pathlib import Path

import pytest
from cli_helpers import dflop, dflop_json
from dflop.specs.run import load_run_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_every_example_config_loads():
    configs = {p.name: load_run_config(p) for p in EXAMPLES.glob("*.yaml") if p.name != "plan-pipeline.yaml"}
    assert set(configs) == {"tiny-cpu.yaml", "internvit6b-qwen72b.yaml"}
    assert configs["tiny-cpu.yaml"].cluster.gpus == 4
    assert configs["internvit6b-qwen72b.yaml"].cluster.gpus == 64


@pytest.mark.processes
def test_items_example_schedules_near_its_bound_and_beats_arrival_order():
    auto = dflop_json("schedule", "--items", EXAMPLES / "items.json", "--bins", 8)
    blind = dflop_json("schedule", "--items", EXAMPLES / "items.json", "--bins", 8, "--solver", "sequential")
    assert sum(map(len, auto["bins"])) == 128 and auto["gap"] < 1e-3
    assert blind["makespan"] > 1.05 * auto["makespan"]


@pytest.mark.processes
def test_pipeline_plan_example_simulates_within_memory(tmp_path):
    out = dflop_json("simulate", "--plan", EXAMPLES / "plan-pipeline.yaml", "--steps", 2, "--out", tmp_path)
    assert out["plan"]["placement"] == "disaggregated" and out["plan"]["schedule"] == "ZBH1"
    assert out["oom_events"] == 0 and 0 < out["bubble_fraction"] < 1


@pytest.mark.processes
def test_tiny_cpu_example_runs_on_the_shipped_profile(tmp_path):
    proc = dflop("run", "--config", EXAMPLES / "tiny-cpu.yaml", "--out", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert "beyond the profiled range" not in proc.stderr  # the shipped profile covers the shipped example
    out = json.loads(proc.stdout)
    assert out["cost_model"].startswith("profiled (cpu") and (out["gpus"], out["hardware"]) == (4, "cpu")
    assert out["speedup"] >= 1.0
