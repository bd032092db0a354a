import json

import pytest
import yaml
from PIL import Image

from cli_helpers import assert_one_line_error, dflop, dflop_json

SMALL = """
encoder: siglip-so400m
llm: qwen2.5-7b
cluster: {hardware: h100, nodes: 1, gpus_per_node: 8}
training: {global_batch: 64, recompute: full}
data: {preset: llava-ov, samples: 3000}
scheduler: {solver: auto, time_limit: 0.2}
steps: 2
"""


def small_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SMALL)
    return path


@pytest.mark.processes
def test_schedule_command(tmp_path):
    items = tmp_path / "items.json"
    items.write_text(json.dumps({"items": [{"id": f"s{i}", "cost": [i % 3 + 1, (7 * i) % 5 + 1]}
                                           for i in range(12)]}))
    out = dflop_json("schedule", "--items", items, "--bins", 3, "--solver", "auto")
    assert sorted(x for b in out["bins"] for x in b) == sorted(f"s{i}" for i in range(12))
    assert len(out["bins"]) == 3 and all(out["bins"])
    assert out["makespan"] >= out["lower_bound"] and out["status"] in ("optimal", "feasible", "heuristic")
    assert set(out) >= {"bins", "makespan", "lower_bound", "gap", "solver", "status", "seconds"}
    blind = dflop_json("schedule", "--items", items, "--bins", 3, "--solver", "sequential")
    assert blind["bins"][0] == ["s0", "s1", "s2", "s3"] and blind["makespan"] >= out["makespan"]


@pytest.mark.processes
def test_schedule_bad_items(tmp_path):
    items = tmp_path / "items.json"
    items.write_text(json.dumps({"items": [{"id": "a", "cost": [1, 2]}, {"id": "b", "cost": "x"}]}))
    assert_one_line_error(dflop("schedule", "--items", items, "--bins", 2),
                          "items.json: items[1]: field 'cost': expected a number or a list of numbers")
    items.write_text(json.dumps({"items": [{"id": "a", "cost": [1]}]}))
    assert_one_line_error(dflop("schedule", "--items", items, "--bins", 2), "1 items cannot fill 2 bins")


@pytest.mark.processes
def test_optimize_simulate_and_plot(tmp_path):
    config = small_config(tmp_path)
    plan_file = tmp_path / "plans" / "plan.yaml"  # a folder that does not exist yet is made
    out = dflop_json("optimize", "--config", config, "--out", plan_file)
    assert set(out) >= {"plan", "expected_step_time_s", "per_gpu_memory_gib", "alternatives", "baseline",
                        "speedup", "search_seconds", "pruning", "why"}
    assert out["per_gpu_memory_gib"] <= out["usable_memory_gib"] and out["speedup"] > 1
    assert [b["space"] for b in out["baselines"] if b["batching"] == "dp-balanced"] == ["megatron"]
    assert yaml.safe_load(plan_file.read_text())["placement"] == out["plan"]["placement"]
    sim = dflop_json("simulate", "--config", config, "--plan", plan_file, "--steps", 2, "--out", tmp_path / "sim")
    assert sim["steps"] == 2 and sim["oom_events"] == 0
    trace = json.loads((tmp_path / "sim" / "simulate.trace.json").read_text())
    assert {"X", "M"} <= {e["ph"] for e in trace["traceEvents"]}
    assert Image.open(sim["artifacts"]["timeline"]).size[0] > 500
    picture = dflop_json("plot", "timeline", sim["artifacts"]["trace"], "--out", tmp_path / "t.png")
    assert picture["metrics"]["step_time_s"]["mean"] == sim["step_time_s"]["mean"]


@pytest.mark.processes
def test_run_compares_with_the_baseline(tmp_path):
    out = dflop_json("run", "--config", small_config(tmp_path), "--out", tmp_path / "run")
    assert set(out) >= {"plan", "step_time_s", "throughput_samples_per_s", "bubble_fraction", "idle_fraction",
                        "baseline", "speedup", "artifacts"}
    assert set(out["step_time_s"]) == {"mean", "p50", "each"} and len(out["step_time_s"]["each"]) == out["steps"]
    # on the simulator the prediction is the measurement
    assert out["predicted_step_time_s"]["each"] == out["step_time_s"]["each"]
    assert out["predicted_speedup"] == pytest.approx(out["speedup"]) and out["measured_prediction_error"] == 0
    assert out["speedup"] == out["baseline"]["step_time_s"]["mean"] / out["step_time_s"]["mean"]
    for path in out["artifacts"].values():
        assert (tmp_path / "run" / path.split("/")[-1]).exists()
    # every (space, batching rule) with its plan or its reason; the speedup split into plan and balance gains
    assert {(b["space"], b["batching"]) for b in out["baselines"]} == {
        (s, r) for s in ("megatron", "pytorch") for r in ("arrival", "modality-length", "token-budget")} | {
        ("megatron", "dp-balanced")}
    assert all(set(b) >= {"plan", "step_time_s", "mfu"} for b in out["baselines"])
    d = out["decomposition"]
    assert d["plan_gain"] * d["balance_gain"] == pytest.approx(out["speedup"])
    assert 0 < out["mfu"] <= out["hfu"] < 1 and 0 < out["baseline"]["mfu"] < 1


@pytest.mark.processes
def test_simulate_rejects_a_plan_that_does_not_fit(tmp_path):
    plan = tmp_path / "big.yaml"
    plan.write_text("encoder: {tp: 1, pp: 1, dp: 8}\nllm: {tp: 4, pp: 2, dp: 2}\nmicrobatches: 4\n")
    proc = dflop("simulate", "--config", small_config(tmp_path), "--plan", plan, "--out", tmp_path / "s")
    assert_one_line_error(proc, "does not fit", "the plan needs 24 GPUs but the cluster has 8")


@pytest.mark.processes
def test_unwritable_output_and_unknown_backend(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_one_line_error(dflop("optimize", "--config", small_config(tmp_path), "--out", blocker / "plan.yaml"),
                          "plan.yaml: cannot be written", "file is not a folder")
    assert_one_line_error(dflop("run", "--backend", "nope"), "'--backend'", "'nope' is not one of 'sim', 'torch'")


@pytest.mark.processes
def test_simulate_takes_a_v_schedule_by_any_case_with_the_stages_it_needs(tmp_path):
    plan = tmp_path / "pp.yaml"
    plan.write_text("encoder: {tp: 2, pp: 1, dp: 2}\nllm: {tp: 2, pp: 2, dp: 2}\nplacement: colocated\n"
                    "microbatches: 8\nschedule: 1F1B\n")
    config = small_config(tmp_path)
    for name, schedule in (("dualpipev", "DualPipeV"), ("ZBVZEROBUBBLE", "ZBVZeroBubble")):
        sim = dflop_json("simulate", "--config", config, "--plan", plan, "--schedule", name, "--steps", 1,
                         "--out", tmp_path / name)
        assert (sim["plan"]["schedule"], sim["plan"]["virtual_stages"]) == (schedule, 2)
    back = dflop_json("simulate", "--config", config, "--plan", plan, "--schedule", "gpipe", "--steps", 1,
                      "--out", tmp_path / "g")
    assert (back["plan"]["schedule"], back["plan"]["virtual_stages"]) == ("GPipe", 1)
    v_plan = tmp_path / "v.yaml"  # as the optimizer writes a V plan: two stages per rank
    v_plan.write_text(plan.read_text().replace("1F1B", "ZBVZeroBubble\nvirtual_stages: 2"))
    sim = dflop_json("simulate", "--config", config, "--plan", v_plan, "--steps", 1, "--out", tmp_path / "v")
    assert (sim["plan"]["schedule"], sim["plan"]["virtual_stages"]) == ("ZBVZeroBubble", 2)


@pytest.mark.processes
def test_simulate_says_which_module_idles(tmp_path):
    plan = tmp_path / "dis.yaml"  # the encoder on 2 GPUs of its own, the LLM in 2 stages of TP 2 on 4
    plan.write_text("encoder: {tp: 1, pp: 1, dp: 2}\nllm: {tp: 2, pp: 2, dp: 1}\nplacement: disaggregated\n"
                    "microbatches: 4\nschedule: 1F1B\n")
    proc = dflop("simulate", "--config", small_config(tmp_path), "--plan", plan, "--steps", 1, "--out", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "idle" in x)
    sim = dflop_json("simulate", "--config", small_config(tmp_path), "--plan", plan, "--steps", 1,
                     "--out", tmp_path / "j")
    idle = sim["idle_by_module"]
    assert set(idle) == {"encoder", "llm"}
    assert f"idle {sim['idle_fraction']:.1%} (encoder {idle['encoder']:.1%}, LLM {idle['llm']:.1%})" in line
    assert (2 * idle["encoder"] + 4 * idle["llm"]) / 6 == pytest.approx(sim["idle_fraction"])
