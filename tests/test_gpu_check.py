"""`make gpu-check`: the dry run lists and passes every step on the CPU, a step that fails, runs out
of time or is never reached says so and fails the check, the refit recovers a known curve, the GPU
section of the report is replaced rather than repeated, and the shipped GPU profile and calibrated
curve are what the cost model selection uses for that GPU."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
from gpu_check import FAILED, NO_DEVICE, NOT_REACHED, OK, OUT_OF_TIME, STEPS, Check, Target  # noqa: E402

pytestmark = pytest.mark.processes


def test_make_gpu_check_dry_runs_every_step_on_the_cpu(tmp_path):
    venv = Path(sys.executable).parent.parent
    stamp = venv / ".dflop-installed"
    done = subprocess.run(["make", "-s", "-o", str(stamp), "gpu-check", "DRY=1", f"VENV={venv}",
                           f"GPU_CHECK_OUT={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for i, (name, _) in enumerate(STEPS):
        assert f"[{i + 1}/{len(STEPS)}] {name}" in done.stdout
    assert "gpu-check: passed" in done.stdout
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {name: s["status"] for name, s in results["steps"].items()}
    assert list(statuses) == [name for name, _ in STEPS]
    # "no device" only where a part needs CUDA, and said so: never a silent gap
    assert statuses == {name: NO_DEVICE if name == "two_processes" else OK for name, _ in STEPS}
    for shape in results["attention"]["shapes"].values():
        assert shape["paths"]["sdpa"]["status"] == OK
        assert shape["paths"]["flash-attn"]["status"] == NO_DEVICE
    assert all(m["status"] == OK and m["records"] > 0 for m in results["profiles"]["models"].values())
    runs = results["torch_backend"]["runs"]
    assert set(runs) == {"recompute none", "recompute full"}
    assert all(r["measured_s"] > 0 and r["profiled"]["predicted_s"] > 0 for r in runs.values())
    assert (tmp_path / "profiles" / "profile.jsonl").exists()
    assert "## GPU check" in (tmp_path / "REPORT-section.md").read_text()


def _check(tmp_path, budgets, budget_s=30.0):
    target = Target.of(True)
    target = Target(**{**target.__dict__, "budgets": budgets})
    return Check(target, tmp_path, time.monotonic() + budget_s, log=lambda s: None)


def test_a_step_that_fails_runs_out_of_time_or_is_never_reached_fails_the_check(tmp_path):
    def fine(c):
        return {"figure": 1}

    def broken(c):
        raise ValueError("a CUDA error")

    def slow(c):
        time.sleep(5)
        return {}

    def spend_the_rest(c):
        c.deadline = time.monotonic()  # the run's budget is gone after this step
        return {}

    c = _check(tmp_path, {"slow": 0.2})
    steps = (("fine", fine), ("broken", broken), ("slow", slow), ("spend", spend_the_rest), ("late", fine))
    assert gpu_check.run_steps(c, steps) is False
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {n: s["status"] for n, s in saved["steps"].items()} == {
        "fine": OK, "broken": FAILED, "slow": OUT_OF_TIME, "spend": OK, "late": NOT_REACHED}
    assert "ValueError: a CUDA error" in saved["broken"]["why"]
    assert saved["fine"] == {"figure": 1}
    assert gpu_check.run_steps(_check(tmp_path, {}), (("fine", fine),)) is True


def test_time_boxes_nest_and_give_the_outer_one_back_its_time():
    with pytest.raises(gpu_check.OutOfTime):
        with gpu_check.time_box(0.3):
            with gpu_check.time_box(5.0):  # ends no later than the box around it
                time.sleep(2)
    started = time.monotonic()
    with pytest.raises(gpu_check.OutOfTime):
        with gpu_check.time_box(0.4):
            with gpu_check.time_box(0.1):
                pass
            time.sleep(2)  # the outer box still fires
    assert time.monotonic() - started < 1.5


def test_the_refit_recovers_a_known_curve_and_keeps_time_growing_with_work():
    from dflop.specs import presets

    hardware = presets.hardware("h100")
    truth = ((1e10, 0.3), (1e11, 0.5), (1e12, 0.6), (1e13, 0.62))
    true_hw = type(hardware)(**{**hardware.__dict__, "efficiency": truth})
    flops = np.logspace(10, 13, 25)
    rows = [{"flops": f, "measured_fwd_ms": float(true_hw.compute_time(f)) * 1e3} for f in flops]
    fitted = gpu_check.refit_efficiency(rows, hardware.peak_flops, tuple(k for k, _ in truth))
    assert np.allclose([v for _, v in fitted], [v for _, v in truth], atol=1e-6)
    # launch-bound work (constant time whatever its FLOPs) cannot be followed; the curve stays valid
    flat = [{"flops": f, "measured_fwd_ms": 1.0} for f in np.logspace(8, 11, 10)]
    curve = gpu_check.refit_efficiency(flat, hardware.peak_flops, (1e8, 1e9, 1e10, 1e11))
    fit = type(hardware)(**{**hardware.__dict__, "efficiency": curve})  # HardwareSpec's rules hold
    assert float(fit.compute_time(1e11)) * 1e3 == pytest.approx(1.0, rel=0.15)  # the largest priced near measured
    assert float(fit.compute_time(1e8)) * 1e3 < 0.5  # the smallest priced short, said in the docstring


def test_a_run_s_report_section_replaces_its_earlier_one_and_keeps_the_other_runs(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text("# Benchmark report\n\ncpu figures\n")
    first, second = "benchmarks/results/gpu-h200-2026-01-01", "benchmarks/results/gpu-h100-2026-01-02"
    results = {"date": "2026-01-01", "steps": {"environment": {"status": OK, "seconds": 1.0}},
               "environment": {"device": {"name": "NVIDIA H200", "memory_gib": 139.8}, "torch": "2.11"}}
    gpu_check.write_report(report, gpu_check.report_section(results, first), first)
    other = {**results, "date": "2026-01-02", "environment": {"device": {"name": "NVIDIA H100"}}}
    gpu_check.write_report(report, gpu_check.report_section(other, second), second)
    results["steps"]["environment"]["status"] = FAILED
    gpu_check.write_report(report, gpu_check.report_section(results, first), first)
    text = report.read_text()
    assert text.startswith("# Benchmark report\n\ncpu figures\n")
    assert text.count("## GPU check: NVIDIA H200") == 1 and "| environment | failed | 1 |" in text
    assert text.index("## GPU check: NVIDIA H200") < text.index("## GPU check: NVIDIA H100")  # oldest first
    assert text.count(gpu_check.REPORT_START) == text.count(gpu_check.REPORT_END) == 2


def test_again_runs_the_named_steps_into_an_earlier_run_s_folder_and_keeps_the_others(tmp_path, capsys):
    earlier = {"date": "2026-01-01", "dry": True, "budget_s": 480.0, "command": "make gpu-check DRY=1",
               "steps": {"environment": {"status": FAILED, "seconds": 1.0}, "analytical": {"status": OK, "seconds": 0.0}},
               "environment": {"why": "an earlier failure"}, "analytical": {"kept": True}}
    (tmp_path / gpu_check.RESULTS).write_text(json.dumps(earlier))
    assert gpu_check.main(["--out", str(tmp_path), "--again", "environment"]) == 0
    results = json.loads((tmp_path / gpu_check.RESULTS).read_text())
    assert results["steps"]["environment"]["status"] == OK and "why" not in results["environment"]
    assert results["analytical"] == {"kept": True} and results["date"] == "2026-01-01"
    assert [a["steps"] for a in results["again"]] == [["environment"]]
    assert "--again" in (tmp_path / "REPORT-section.md").read_text()
    capsys.readouterr()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / gpu_check.RESULTS).write_text("{not json")
    for folder in ([], ["--out", str(tmp_path / "none")], ["--out", str(tmp_path / "broken")]):
        assert gpu_check.main([*folder, "--again", "environment"]) == 2  # one line, nothing run
        said = capsys.readouterr().err
        assert said.startswith("gpu-check: --again needs --out") and said.count("\n") == 1


def test_the_shipped_gpu_profile_and_curve_are_what_planning_for_that_gpu_uses():
    from dflop.cost.profiled import ProfiledCostModel
    from dflop.cost.select import select_cost_model
    from dflop.specs import TrainingSpec, presets

    h200 = presets.hardware("h200")
    assert h200.calibrated_from and (ROOT / h200.calibrated_from).exists()
    measured = json.loads((ROOT / h200.calibrated_from).read_text())
    assert np.allclose(h200.efficiency, measured["analytical"]["fitted_efficiency"], rtol=0.02)
    model = presets.model("siglip-so400m", "qwen2.5-7b")
    cost, note = select_cost_model(model, h200, TrainingSpec(global_batch=8))
    assert isinstance(cost, ProfiledCostModel) and cost.device == "NVIDIA H200"
    assert "from dflop/cost/profiles/h200-bf16.jsonl" in note
    # not for another GPU: the H100 keeps the analytical model (its curve an assumption)
    other, note = select_cost_model(model, presets.hardware("h100"), TrainingSpec(global_batch=8))
    assert not isinstance(other, ProfiledCostModel) and "analytical" in note
    assert not presets.hardware("h100").calibrated_from


def test_the_real_check_refuses_a_machine_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "no CUDA device here" in done.stderr and "DRY=1" in done.stderr
